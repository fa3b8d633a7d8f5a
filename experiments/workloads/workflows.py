"""Seeded, fully generated multi-agent tool-calling workflows for replay.

A workflow is a few agent conversations in OpenAI chat format. In the
planned shapes a planner calls tools, hands sub-tasks to workers (the task
and what it has found so far travel with the hand-off; the worker's report
comes back as the hand-off call's result) and ends with a final answer. Tool
calls copy ids, paths, names, URLs and quoted phrases from the conversation,
which is what prompt-lookup speculation feeds on; tool results vary
log-normally in length and mint fresh values for later calls to copy.

Shapes: six_turn_workflow and thirty_five_turn_workflow (6 and 35 assistant
turns across all agents), and interleaved_run (N independent agents sharing
one system prompt and tool set, their turns arriving interleaved).

One random.Random(seed) draws everything from the pools of words, rules and
templates in experiments/workloads/data/workloads.json: the same seed gives
byte-identical JSON.

    python -m agentkv.experiments.workloads.workflows --shape 35 --seed 0 --out wf.json
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Callable, Iterator

TokenCounter = Callable[[str], int]

# Kinds of values a tool call copies from its context.
COPY_KINDS = ("id", "path", "name", "url", "quote")

# ---------------------------------------------------------------------------
# Sizes

MIN_TOOLS, MAX_TOOLS = 5, 20
# The schema budget is drawn below 4,000 so that the tool that crosses it
# still leaves the set under 4,000 tokens.
TOOL_BUDGET = (1000, 3500)
# Tool results: log-normal around 300 tokens; 30 and 3,000 sit about two
# standard deviations out.
RESULT_MU, RESULT_SIGMA = math.log(300), 1.15
RESULT_MIN, RESULT_MAX = 30, 3000
RESULT_STRATA = 8
PARALLEL_CALLS = (1, 2, 3)
PARALLEL_WEIGHTS = (0.75, 0.2, 0.05)
OPTIONAL_ARG_RATE = 0.5
EXTRA_REQUIRED_RATE = 0.25
ASIDE_RATE = 0.4
NOTE_LINES = 6


def approx_tokens(text: str) -> int:
    """About four characters a token: close to BPE vocabularies on English
    and code, and needs no tokenizer."""
    return len(text) // 4


# ---------------------------------------------------------------------------
# The workflow


@dataclass(frozen=True)
class Turn:
    """One assistant turn as a client replays it. request and tools share
    their dicts with the conversation: copy before mutating."""

    agent: str
    index: int  # the agent's own turn number, from 0
    tools: list[dict]
    request: list[dict]  # the history the client re-sends, system message first
    reply: dict  # the reference assistant message
    copied: list[str]  # values in reply copied verbatim from request


@dataclass
class Conversation:
    """One agent's transcript; messages[0] is its system message."""

    agent: str
    role: str
    tools: list[dict]
    messages: list[dict]
    copied: list[list[str]]  # per assistant message, in order

    @property
    def system(self) -> str:
        return self.messages[0]["content"]

    def turns(self) -> Iterator[Turn]:
        assistant = (i for i, m in enumerate(self.messages) if m["role"] == "assistant")
        for index, at in enumerate(assistant):
            yield Turn(self.agent, index, self.tools, self.messages[:at], self.messages[at], self.copied[index])


@dataclass
class Workflow:
    """The conversations of one run and the order their turns arrive in:
    schedule[k] names the agent whose next turn is the k-th request."""

    shape: str
    seed: int
    conversations: list[Conversation]
    schedule: list[str]

    def conversation(self, agent: str) -> Conversation:
        return next(c for c in self.conversations if c.agent == agent)

    def turns(self) -> Iterator[Turn]:
        pending = {c.agent: c.turns() for c in self.conversations}
        for agent in self.schedule:
            yield next(pending[agent])

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Workflow:
        data = json.loads(text)
        conversations = [Conversation(**c) for c in data["conversations"]]
        return cls(data["shape"], data["seed"], conversations, data["schedule"])


# ---------------------------------------------------------------------------
# Pools: the words, rules and templates workflows are drawn from, kept in
# data/workloads.json. Placeholders in braces are filled by format_map: the
# COPY_KINDS mint fresh values (in tool results and tasks) or copy seen ones
# (in assistant messages); the rest are FILLERS. No value may contain a double
# quote or a backslash, so that JSON-encoding an argument never changes a
# copied span, nor a comma or a pipe, which would break the tables they are
# put in. The draws depend on the order of every list and mapping: the file
# is part of the generator's output.

_POOLS = json.loads((Path(__file__).parent / "data" / "workloads.json").read_text())


@dataclass(frozen=True)
class Role:
    summary: str
    rules: tuple[str, ...]
    domains: tuple[str, ...]


@dataclass(frozen=True)
class Domain:
    system: str
    prefixes: tuple[str, ...]
    nouns: tuple[str, ...]
    verbs: tuple[str, ...]


# Who the agents are
ORGS: list[str] = _POOLS["orgs"]
PRODUCTS: list[str] = _POOLS["products"]
TEAMS: list[str] = _POOLS["teams"]
GROUND_RULES: list[str] = _POOLS["ground_rules"]
TOOL_RULES: list[str] = _POOLS["tool_rules"]
REPORT_RULES: list[str] = _POOLS["report_rules"]
ROLES = {name: Role(r["summary"], tuple(r["rules"]), tuple(r["domains"])) for name, r in _POOLS["roles"].items()}
WORKER_ROLES = [role for role in ROLES if role != "planner"]
HANDOFF_NOTE: str = _POOLS["handoff_note"]
SOLO_NOTE: str = _POOLS["solo_note"]

# Tools
DOMAINS = {name: Domain(d["system"], tuple(d["prefixes"]), tuple(d["nouns"]), tuple(d["verbs"]))
           for name, d in _POOLS["domains"].items()}
# verb: (kind of result that answers it, slots of its required parameters, description)
VERBS = {verb: (v["result"], tuple(v["slots"]), v["description"]) for verb, v in _POOLS["verbs"].items()}
PLURAL_VERBS = set(_POOLS["plural_verbs"])
TOOL_NOTES: list[str] = _POOLS["tool_notes"]
RESULT_BLURBS: dict[str, str] = _POOLS["result_blurbs"]
# Parameter names by slot; each pool is larger than the most parameters of one
# slot a tool can draw.
SLOT_PARAMS: dict[str, list[str]] = _POOLS["slot_params"]
SLOT_DESCRIPTIONS: dict[str, list[str]] = _POOLS["slot_descriptions"]
INT_PARAMS = {name: (p["minimum"], p["maximum"], p["description"]) for name, p in _POOLS["int_params"].items()}
BOOL_PARAMS: dict[str, str] = _POOLS["bool_params"]
ENUM_PARAMS = {name: (p["values"], p["description"]) for name, p in _POOLS["enum_params"].items()}
ARRAY_PARAMS = {name: (p["item"], p["description"]) for name, p in _POOLS["array_params"].items()}
# Slots of the optional parameters a tool may add; repeats weight the draw.
EXTRA_SLOTS: list[str] = _POOLS["extra_slots"]
HANDOFF_NAMES: list[str] = _POOLS["handoff_names"]
HANDOFF_AGENT_PARAMS: list[str] = _POOLS["handoff_agent_params"]
HANDOFF_BRIEF_PARAMS: list[str] = _POOLS["handoff_brief_params"]

# The material of tasks and tool results
WORDS: list[str] = _POOLS["words"]
FN_VERBS: list[str] = _POOLS["fn_verbs"]
CLASS_SUFFIXES: list[str] = _POOLS["class_suffixes"]
ARG_WORDS: list[str] = _POOLS["arg_words"]
FIRST_NAMES: list[str] = _POOLS["first_names"]
LAST_NAMES: list[str] = _POOLS["last_names"]
SERVICE_SUFFIXES: list[str] = _POOLS["service_suffixes"]
STATUSES: list[str] = _POOLS["statuses"]
REGIONS: list[str] = _POOLS["regions"]
ENVS: list[str] = _POOLS["envs"]
SQL_COLUMNS: list[str] = _POOLS["sql_columns"]
SQL_SCHEMAS: list[str] = _POOLS["sql_schemas"]
PACKAGES: list[str] = _POOLS["packages"]
PATH_ROOTS: list[str] = _POOLS["path_roots"]
PATH_EXTENSIONS: list[str] = _POOLS["path_extensions"]
URL_FORMS: list[str] = _POOLS["url_forms"]
ID_PREFIXES: dict[str, str] = _POOLS["id_prefixes"]
ALL_NOUNS = [noun for domain in DOMAINS.values() for noun in domain.nouns]
SUBJECTS: list[str] = _POOLS["subjects"]
PREDICATES: list[str] = _POOLS["predicates"]
CONDITIONS: list[str] = _POOLS["conditions"]
QUOTES: list[str] = _POOLS["quotes"]
TASKS: list[str] = _POOLS["tasks"]
TASK_CODA: str = _POOLS["task_coda"]
PY_BLOCKS: list[str] = _POOLS["py_blocks"]
YAML_BLOCKS: list[str] = _POOLS["yaml_blocks"]
MD_BLOCKS: list[str] = _POOLS["md_blocks"]
SQL_BLOCKS: list[str] = _POOLS["sql_blocks"]
CODE_HITS: list[str] = _POOLS["code_hits"]
WEB_HITS: list[str] = _POOLS["web_hits"]
RECORD_HITS: list[str] = _POOLS["record_hits"]
LOG_LINES: list[str] = _POOLS["log_lines"]
# (key, template) pairs: table columns after the id column, a record's
# fields, the fields of one event in its history.
TABLE_COLUMNS = list(_POOLS["table_columns"].items())
RECORD_FIELDS = list(_POOLS["record_fields"].items())
RECORD_EVENT = list(_POOLS["record_event"].items())

# Assistant-side templates: their COPY_KINDS placeholders copy seen values.
QUERIES: list[str] = _POOLS["queries"]
ASIDES: list[str] = _POOLS["asides"]
BRIEFS: list[str] = _POOLS["briefs"]
LEADS: list[str] = _POOLS["leads"]
FINDINGS: list[str] = _POOLS["findings"]


def _plural(noun: str) -> str:
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    return noun + ("es" if noun.endswith(("s", "x", "ch")) else "s")


def _hex(rng: random.Random, digits: int) -> str:
    return f"{rng.getrandbits(4 * digits):0{digits}x}"


FILLERS: dict[str, Callable[[_Draw], str]] = {
    "word": lambda d: d.rng.choice(WORDS),
    "noun": lambda d: d.rng.choice(ALL_NOUNS).replace("_", " "),
    "fn": lambda d: f"{d.rng.choice(FN_VERBS)}_{d.rng.choice(WORDS)}",
    "Cls": lambda d: d.rng.choice(WORDS).title() + d.rng.choice(CLASS_SUFFIXES),
    "CONST": lambda d: f"{d.rng.choice(WORDS)}_{d.rng.choice(WORDS)}".upper(),
    "arg": lambda d: d.rng.choice(ARG_WORDS),
    "n": lambda d: str(d.rng.randint(2, 5000)),
    "small": lambda d: str(d.rng.randint(1, 9)),
    "hex": lambda d: _hex(d.rng, 8),
    "arxiv": lambda d: f"{d.rng.randint(18, 25)}{d.rng.randint(1, 12):02d}.{d.rng.randint(1, 29999):05d}",
    "sentence": lambda d: d.sentence(),
    "Title": lambda d: d.sentence()[:-1].split(" when ")[0],
    "ts": lambda d: d.tick(),
    "date": lambda d: d.tick()[:10],
    "status": lambda d: d.rng.choice(STATUSES),
    "svc": lambda d: d.service(),
    "version": lambda d: f"{d.rng.randint(0, 4)}.{d.rng.randint(0, 30)}.{d.rng.randint(0, 99)}",
    "bool": lambda d: d.rng.choice(["true", "false"]),
    "col": lambda d: d.rng.choice(SQL_COLUMNS),
    "table": lambda d: f"{d.rng.choice(SQL_SCHEMAS)}.{d.rng.choice(WORDS)}_{d.rng.choice(['daily', 'events', 'facts', 'raw'])}",
    "pct": lambda d: f"{d.rng.uniform(0, 100):.2f}%",
    "money": lambda d: f"{d.rng.uniform(10, 99999):.2f}",
    "region": lambda d: d.rng.choice(REGIONS),
    "env": lambda d: d.rng.choice(ENVS),
    "pkg": lambda d: d.rng.choice(PACKAGES),
    "slug": lambda d: d.slug,
    "product": lambda d: d.product.lower(),
}


# ---------------------------------------------------------------------------
# Drawing values


class _Draw:
    """The one random stream of a workflow and the values minted from it."""

    def __init__(self, seed: int, count_tokens: TokenCounter):
        self.rng = random.Random(seed)
        self.count = count_tokens
        self.org = self.rng.choice(ORGS)
        self.slug = self.org.lower().replace(" ", "")
        self.product = self.rng.choice(PRODUCTS)
        self.clock = datetime(2024, 1, 1) + timedelta(minutes=self.rng.randrange(2 * 365 * 24 * 60))
        self.schedule: list[str] = []
        self._ids: set[str] = set()
        self._strata: list[float] = []

    def mint(self, kind: str) -> str:
        return {"id": self.id, "path": self.path, "name": self.name, "url": self.url, "quote": self.quote}[kind]()

    def id(self, noun: str | None = None) -> str:
        """A fresh id: equal ids in a workflow always mean the same thing."""
        while True:
            value = self._id_like(noun or self.rng.choice(ALL_NOUNS))
            if value not in self._ids:
                self._ids.add(value)
                return value

    def _id_like(self, noun: str) -> str:
        rng = self.rng
        form = rng.randrange(4)
        if form == 0:
            return f"{ID_PREFIXES.get(noun, noun[:3].upper())}-{rng.randint(100, 99999)}"
        if form == 1:
            alphabet = "abcdefghijkmnpqrstuvwxyzABCDEFGHJKLMNPQRSTUVWXYZ23456789"
            return f"{noun.split('_')[0][:4]}_" + "".join(rng.choice(alphabet) for _ in range(10))
        if form == 2:
            return _hex(rng, rng.choice([7, 10, 12]))
        u = _hex(rng, 32)
        return f"{u[:8]}-{u[8:12]}-{u[12:16]}-{u[16:20]}-{u[20:]}"

    def path(self) -> str:
        rng = self.rng
        ext = rng.choice(PATH_EXTENSIONS)
        if ext == "log":
            return f"/var/log/{self.service()}/{rng.choice(WORDS)}.log"
        root = self.fill(rng.choice(PATH_ROOTS))
        stem = f"{rng.choice(FN_VERBS)}_{rng.choice(WORDS)}"
        if ext == "md":
            stem = stem.replace("_", "-")
        elif root == "migrations":
            stem = f"{rng.randint(1, 400):04d}_{stem}"
        return f"{root}/{stem}.{ext}"

    def name(self) -> str:
        if self.rng.random() < 0.35:
            return self.service()
        return f"{self.rng.choice(FIRST_NAMES)} {self.rng.choice(LAST_NAMES)}"

    def url(self) -> str:
        return self.fill(self.rng.choice(URL_FORMS))

    def quote(self) -> str:
        return self.fill(self.rng.choice(QUOTES))

    def service(self) -> str:
        return f"{self.rng.choice(WORDS)}-{self.rng.choice(SERVICE_SUFFIXES)}"

    def sentence(self) -> str:
        return f"{self.rng.choice(SUBJECTS)} {self.rng.choice(PREDICATES)} {self.rng.choice(CONDITIONS)}."

    def tick(self) -> str:
        """A timestamp after every earlier one, so logs and histories read forward."""
        self.clock += timedelta(seconds=self.rng.randint(1, 900))
        return self.clock.strftime("%Y-%m-%dT%H:%M:%S.") + f"{self.rng.randrange(1000):03d}Z"

    def call_id(self) -> str:
        return "call_" + _hex(self.rng, 24)

    def result_length(self) -> int:
        """Log-normal tokens, drawn in shuffled strata so that even a short
        workflow sees both tails."""
        if not self._strata:
            self._strata = [(i + self.rng.uniform(0.01, 0.99)) / RESULT_STRATA for i in range(RESULT_STRATA)]
            self.rng.shuffle(self._strata)
        z = statistics.NormalDist().inv_cdf(self._strata.pop())
        return round(min(max(math.exp(RESULT_MU + RESULT_SIGMA * z), RESULT_MIN), RESULT_MAX))

    def fill(self, template: str) -> str:
        return template.format_map(_Fill(self))

    def write(self, template: str, w: _Writer, noun: str | None = None, **fixed: str) -> str:
        return template.format_map(_Mint(self, w, noun, fixed))

    def copy(self, template: str, memory: _Memory, copied: list[str]) -> str:
        return template.format_map(_Copy(self, memory, copied))


class _Fill:
    """A format_map mapping that draws a fresh filler at every placeholder."""

    def __init__(self, d: _Draw):
        self.d = d

    def __getitem__(self, key: str) -> str:
        return FILLERS[key](self.d)


class _Mint(_Fill):
    """Copyable placeholders mint fresh values and record them in the writer;
    own_id mints an id of the noun a result is about; fixed keys keep one
    value across a text (the service of a log)."""

    def __init__(self, d: _Draw, w: _Writer, noun: str | None, fixed: dict[str, str]):
        super().__init__(d)
        self.w, self.noun, self.fixed = w, noun, fixed

    def __getitem__(self, key: str) -> str:
        if key in self.fixed:
            return self.fixed[key]
        if key == "own_id":
            return self.w.put("id", self.d.id(self.noun))
        if key in COPY_KINDS:
            return self.w.put(key, self.d.mint(key))
        return super().__getitem__(key)


class _Copy(_Fill):
    """Copyable placeholders copy a value the agent has seen and record it."""

    def __init__(self, d: _Draw, memory: _Memory, copied: list[str]):
        super().__init__(d)
        self.memory, self.copied = memory, copied

    def __getitem__(self, key: str) -> str:
        if key in COPY_KINDS:
            value = self.memory.pick(self.d.rng, key)
            self.copied.append(value)
            return value
        return super().__getitem__(key)


class _Writer:
    """A message written line by line, with the copyable values put into it."""

    def __init__(self, count: TokenCounter):
        self.count = count
        self.lines: list[str] = []
        self.tokens = 0
        self._values: list[tuple[str, str]] = []

    def put(self, kind: str, value: str) -> str:
        self._values.append((kind, value))
        return value

    def add(self, text: str, target: int | None = None) -> None:
        """Append text, stopping at the line that reaches target tokens."""
        for line in text.split("\n"):
            if target is not None and self.tokens >= target:
                return
            self.lines.append(line)
            self.tokens += self.count(line + "\n")

    def done(self) -> tuple[str, list[tuple[str, str]]]:
        """The text and the values that survived truncation."""
        text = "\n".join(self.lines).strip("\n")
        return text, [(kind, value) for kind, value in self._values if value in text]


class _Memory:
    """Values an agent has seen, by kind, oldest first: what it may copy."""

    def __init__(self) -> None:
        self.by_kind: dict[str, list[str]] = {kind: [] for kind in COPY_KINDS}
        self._known: set[str] = set()

    def add(self, values: list[tuple[str, str]]) -> None:
        for kind, value in values:
            if value not in self._known:
                self._known.add(value)
                self.by_kind[kind].append(value)

    def pick(self, rng: random.Random, kind: str) -> str:
        """Mostly something recent: agents act on what they just read."""
        seen = self.by_kind[kind]
        if rng.random() < 0.7:
            return seen[-rng.randint(1, min(6, len(seen)))]
        return rng.choice(seen)

    def seen_in(self, text: str) -> list[tuple[str, str]]:
        return [(kind, v) for kind, values in self.by_kind.items() for v in values if v in text]


# ---------------------------------------------------------------------------
# Tools


@dataclass
class _Param:
    slot: str
    schema: dict
    item: str | None = None  # the copy kind of an array's items


@dataclass
class _Tool:
    name: str
    domain: str
    noun: str
    result: str
    description: str
    params: dict[str, _Param]
    required: list[str]

    @property
    def schema(self) -> dict:
        properties = {name: param.schema for name, param in self.params.items()}
        parameters = {"type": "object", "properties": properties, "required": self.required,
                      "additionalProperties": False}
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": parameters}}


def _unused(rng: random.Random, pool: list[str], taken: dict) -> str:
    return rng.choice([name for name in pool if name not in taken])


def _param(d: _Draw, slot: str, noun: str, system: str, taken: dict[str, _Param]) -> tuple[str, _Param]:
    rng = d.rng
    if slot == "int":
        name = _unused(rng, list(INT_PARAMS), taken)
        lo, hi, text = INT_PARAMS[name]
        return name, _Param(slot, {"type": "integer", "description": text, "minimum": lo, "maximum": hi})
    if slot == "bool":
        name = _unused(rng, list(BOOL_PARAMS), taken)
        return name, _Param(slot, {"type": "boolean", "description": BOOL_PARAMS[name], "default": False})
    if slot == "enum":
        name = _unused(rng, list(ENUM_PARAMS), taken)
        values, text = ENUM_PARAMS[name]
        return name, _Param(slot, {"type": "string", "enum": values, "description": text})
    if slot == "array":
        name = _unused(rng, list(ARRAY_PARAMS), taken)
        item, text = ARRAY_PARAMS[name]
        schema = {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 10,
                  "uniqueItems": True, "description": text}
        return name, _Param(slot, schema, item)
    own_id = f"{noun}_id"
    name = own_id if slot == "id" and own_id not in taken else _unused(rng, SLOT_PARAMS[slot], taken)
    text = rng.choice(SLOT_DESCRIPTIONS[slot]).format(noun=noun.replace("_", " "), system=system)
    return name, _Param(slot, {"type": "string", "description": text, "minLength": 1})


def _tool_name(d: _Draw, verb: str, noun: str, prefixes: tuple[str, ...]) -> str:
    base = f"{verb}_{_plural(noun) if verb in PLURAL_VERBS else noun}"
    return f"{d.rng.choice(prefixes)}_{base}" if d.rng.random() < 0.35 else base


def _tool(d: _Draw, domain: str, taken: set[str]) -> _Tool:
    rng, spec = d.rng, DOMAINS[domain]
    while True:
        verb, noun = rng.choice(spec.verbs), rng.choice(spec.nouns)
        name = _tool_name(d, verb, noun, spec.prefixes)
        if name not in taken:
            break
    result, primaries, blurb = VERBS[verb]
    params: dict[str, _Param] = {}
    required = []
    for slot in primaries:
        pname, param = _param(d, slot, noun, spec.system, params)
        params[pname] = param
        required.append(pname)
    for slot in rng.sample(EXTRA_SLOTS, rng.randint(1, 4)):
        pname, param = _param(d, slot, noun, spec.system, params)
        params[pname] = param
        if rng.random() < EXTRA_REQUIRED_RATE:
            required.append(pname)
    human = noun.replace("_", " ")
    description = " ".join([blurb.format(noun=human, plural=_plural(human), system=spec.system),
                            rng.choice(TOOL_NOTES), RESULT_BLURBS[result]])
    return _Tool(name, domain, noun, result, description, params, required)


def _handoff_tool(d: _Draw, team: list[str]) -> _Tool:
    rng = d.rng
    params = {
        rng.choice(HANDOFF_AGENT_PARAMS): _Param("agent", {"type": "string", "enum": team,
                                                           "description": "The worker who takes the sub-task."}),
        rng.choice(HANDOFF_BRIEF_PARAMS): _Param("brief", {"type": "string", "minLength": 1, "description":
                                                           "What to do and what to report back, with exact ids and paths."}),
        "references": _Param("array", {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 10,
                                       "uniqueItems": True, "description": "Ids the worker should start from."}, "id"),
        "priority": _Param("enum", {"type": "string", "enum": ["low", "normal", "urgent"],
                                    "description": "How soon the report is needed."}),
    }
    description = ("Hand a sub-task to a worker agent. The worker receives the task, your notes so far and these "
                   "instructions; its report comes back as this call's result.")
    return _Tool(rng.choice(HANDOFF_NAMES), "agents", "subtask", "handoff", description, params, list(params)[:2])


def _schema_tokens(d: _Draw, tools: list[_Tool]) -> int:
    return d.count(json.dumps([tool.schema for tool in tools]))


def _toolset(d: _Draw, domains: tuple[str, ...], tools: list[_Tool]) -> list[_Tool]:
    """Add tools from domains until the schemas fill a drawn token budget."""
    budget = d.rng.randint(*TOOL_BUDGET)
    while len(tools) < MIN_TOOLS or (_schema_tokens(d, tools) < budget and len(tools) < MAX_TOOLS):
        tools.append(_tool(d, d.rng.choice(domains), {tool.name for tool in tools}))
    d.rng.shuffle(tools)
    return tools


# ---------------------------------------------------------------------------
# Tool results: each fills a writer to about target tokens with fresh values.


def _given(tool: _Tool, args: dict, slot: str) -> str | None:
    """The call's first argument of a slot: results echo what was asked for."""
    return next((args[name] for name, p in tool.params.items() if p.slot == slot and name in args), None)


def _fill_to(d: _Draw, w: _Writer, blocks: list[str], target: int, noun: str | None = None, **fixed: str) -> None:
    while w.tokens < target:
        w.add(d.write(d.rng.choice(blocks), w, noun, **fixed), target)


FILE_BLOCKS = {"py": PY_BLOCKS, "yaml": YAML_BLOCKS, "md": MD_BLOCKS, "sql": SQL_BLOCKS}


def _file_result(d: _Draw, w: _Writer, tool: _Tool, args: dict, target: int) -> None:
    source = _given(tool, args, "path") or _given(tool, args, "url") or w.put("path", d.path())
    ext = "md" if source.startswith("http") else source.rsplit(".", 1)[-1]
    if ext == "json":
        _record_result(d, w, tool, args, target)
        return
    if ext == "log":
        _log_result(d, w, tool, args, target)
        return
    w.add(source)
    _fill_to(d, w, FILE_BLOCKS[ext], target)
    if d.rng.random() < 0.5:
        w.lines[1:] = [f"{i:>5}  {line}" for i, line in enumerate(w.lines[1:], 1)]


def _search_result(d: _Draw, w: _Writer, tool: _Tool, args: dict, target: int) -> None:
    asked = _given(tool, args, "query") or _given(tool, args, "quote") or tool.noun
    w.add(f"Results for {asked}:")
    hits = {"code": CODE_HITS, "security": CODE_HITS, "web": WEB_HITS, "docs": WEB_HITS}.get(tool.domain, RECORD_HITS)
    _fill_to(d, w, hits, target, noun=tool.noun)


def _table_result(d: _Draw, w: _Writer, tool: _Tool, args: dict, target: int) -> None:
    columns = d.rng.sample(TABLE_COLUMNS, d.rng.randint(3, 6))
    headers = [f"{tool.noun}_id"] + [header for header, _ in columns]
    cells = ["{own_id}"] + [cell for _, cell in columns]
    if d.rng.random() < 0.5:
        w.add("| " + " | ".join(headers) + " |\n|" + "---|" * len(headers))
        row = "| " + " | ".join(cells) + " |"
    else:
        w.add(",".join(headers))
        row = ",".join(cells)
    _fill_to(d, w, [row], target, noun=tool.noun)


def _log_result(d: _Draw, w: _Writer, tool: _Tool, args: dict, target: int) -> None:
    service = _given(tool, args, "name") or d.service()
    _fill_to(d, w, LOG_LINES, target, svc=service.replace(" ", "-").lower())


def _record_result(d: _Draw, w: _Writer, tool: _Tool, args: dict, target: int) -> None:
    """A JSON record grown field by field, then by history events, so it stays
    valid JSON at any length."""
    record: dict = {"id": _given(tool, args, "id") or w.put("id", d.id(tool.noun)), "type": tool.noun,
                    "status": d.rng.choice(STATUSES)}
    fields = d.rng.sample(RECORD_FIELDS, len(RECORD_FIELDS))
    while d.count(json.dumps(record, indent=2)) < target:
        if fields:
            key, template = fields.pop()
            record[key] = d.write(template, w)
        else:
            events = record.setdefault("history", [])
            events.append({key: d.write(template, w) for key, template in RECORD_EVENT})
    w.add(json.dumps(record, indent=2))


RESULTS = {"file": _file_result, "search": _search_result, "table": _table_result, "log": _log_result,
           "record": _record_result}

# ---------------------------------------------------------------------------
# Agents


@dataclass
class _Profile:
    """What agents of one role share: the system prompt and the tools."""

    role: str
    system: str
    tools: list[_Tool]


def _shared_prompt(d: _Draw) -> str:
    rng = d.rng
    intro = (f"You are one of the AI agents that {d.org}'s {rng.choice(TEAMS)} team runs on the {d.product} "
             f"platform. Agents work together on a task: a planner splits it up and hands sub-tasks to workers, "
             f"each with its own tools. Today is {d.clock:%Y-%m-%d}.")
    sections = [intro]
    for title, pool, k in (("Ground rules", GROUND_RULES, 7), ("Using tools", TOOL_RULES, 5),
                           ("Reporting", REPORT_RULES, 4)):
        rules = rng.sample(pool, k)
        sections.append(f"## {title}\n" + "\n".join(f"{i}. {rule}" for i, rule in enumerate(rules, 1)))
    return "\n\n".join(sections)


def _role_prompt(role: str, note: str) -> str:
    profile = ROLES[role]
    rules = "\n".join(f"- {rule}" for rule in profile.rules)
    return f"## Your role: {role.replace('_', ' ')}\n{profile.summary}\n{rules}\n{note}"


def _profile(d: _Draw, shared: str, role: str, note: str, tools: list[_Tool] | None = None) -> _Profile:
    tools = _toolset(d, ROLES[role].domains, tools or [])
    return _Profile(role, f"{shared}\n\n{_role_prompt(role, note)}", tools)


def _task(d: _Draw) -> tuple[str, list[tuple[str, str]]]:
    """A task that names a value of every copyable kind, so that every kind of
    argument has something to copy from the first turn on."""
    w = _Writer(d.count)
    text = d.write(d.rng.choice(TASKS), w)
    if d.rng.random() < 0.5:
        text += d.write(TASK_CODA, w)
    w.add(text)
    return w.done()


class _Agent:
    """One agent's conversation while it is being generated."""

    def __init__(self, d: _Draw, name: str, profile: _Profile, opening: str, known: list[tuple[str, str]]):
        self.d, self.name, self.tools = d, name, profile.tools
        self.memory = _Memory()
        self.memory.add(known)
        messages = [{"role": "system", "content": profile.system}, {"role": "user", "content": opening}]
        self.conv = Conversation(name, profile.role, [tool.schema for tool in profile.tools], messages, [])

    def work(self) -> None:
        """One turn of ordinary tool calls, each answered by a generated result."""
        usable = [tool for tool in self.tools if tool.result != "handoff"]
        k = min(self.d.rng.choices(PARALLEL_CALLS, PARALLEL_WEIGHTS)[0], len(usable))
        for tool, args, call_id in self._call(self.d.rng.sample(usable, k), {}):
            w = _Writer(self.d.count)
            RESULTS[tool.result](self.d, w, tool, args, self.d.result_length())
            self.receive(call_id, *w.done())

    def delegate(self, tool: _Tool, role: str) -> tuple[str, str]:
        """Call the hand-off tool; returns the call id and the brief."""
        [(_, args, call_id)] = self._call([tool], {"agent": role})
        return call_id, _given(tool, args, "brief")

    def receive(self, call_id: str, content: str, values: list[tuple[str, str]]) -> None:
        self.conv.messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
        self.memory.add(values)

    def finish(self, heading: str) -> str:
        """The agent's last message: an answer that cites what it found."""
        rng, copied = self.d.rng, []
        findings = rng.sample(FINDINGS, rng.randint(3, 6))
        lines = [heading, "", self._copy(rng.choice(LEADS), copied), ""] + [self._copy(f, copied) for f in findings]
        content = "\n".join(lines)
        self._reply({"role": "assistant", "content": content}, copied)
        return content

    def _call(self, tools: list[_Tool], fixed: dict[str, str]) -> list[tuple[_Tool, dict, str]]:
        copied: list[str] = []
        calls = [(tool, self._arguments(tool, fixed, copied), self.d.call_id()) for tool in tools]
        content = self._copy(self.d.rng.choice(ASIDES), copied) if self.d.rng.random() < ASIDE_RATE else None
        tool_calls = [{"id": call_id, "type": "function", "function": {"name": tool.name, "arguments": json.dumps(args)}}
                      for tool, args, call_id in calls]
        self._reply({"role": "assistant", "content": content, "tool_calls": tool_calls}, copied)
        return calls

    def _reply(self, message: dict, copied: list[str]) -> None:
        self.conv.messages.append(message)
        self.conv.copied.append(list(dict.fromkeys(copied)))
        self.d.schedule.append(self.name)

    def _copy(self, template: str, copied: list[str]) -> str:
        return self.d.copy(template, self.memory, copied)

    def _arguments(self, tool: _Tool, fixed: dict[str, str], copied: list[str]) -> dict:
        return {name: fixed[p.slot] if p.slot in fixed else self._value(p, copied)
                for name, p in tool.params.items()
                if name in tool.required or self.d.rng.random() < OPTIONAL_ARG_RATE}

    def _value(self, param: _Param, copied: list[str]) -> object:
        rng, slot = self.d.rng, param.slot
        if slot in COPY_KINDS:
            return self._copy("{" + slot + "}", copied)
        if slot == "query":
            return self._copy(rng.choice(QUERIES), copied)
        if slot == "brief":
            return self._copy(rng.choice(BRIEFS), copied)
        if slot == "int":
            return rng.randint(param.schema["minimum"], param.schema["maximum"])
        if slot == "bool":
            return rng.random() < 0.5
        if slot == "enum":
            return rng.choice(param.schema["enum"])
        items = [self._copy("{" + param.item + "}", copied) for _ in range(rng.randint(1, 3))]
        return list(dict.fromkeys(items))


# ---------------------------------------------------------------------------
# Shapes


def _handoff_message(task: str, planner: Conversation, brief: str) -> str:
    """The task, the head of every result the planner has so far, and the brief."""
    names = {call["id"]: call["function"]["name"]
             for m in planner.messages if m["role"] == "assistant" for call in m.get("tool_calls") or []}
    notes = [f"From {names[m['tool_call_id']]}:\n" + "\n".join(m["content"].split("\n")[:NOTE_LINES])
             for m in planner.messages if m["role"] == "tool"]
    return "\n\n".join(["## Task", task, "## What the planner knows so far", *(notes or ["(nothing yet)"]),
                        "## Your assignment", brief])


def _split(rng: random.Random, total: int, parts: int, minimum: int) -> list[int]:
    counts = [minimum] * parts
    for _ in range(total - minimum * parts):
        counts[rng.randrange(parts)] += 1
    return counts


def _planned_workflow(shape: str, seed: int, turns: int, handoffs: int, count_tokens: TokenCounter) -> Workflow:
    """A planner with some tool turns of its own and `handoffs` workers of at
    least two turns each (a tool call and a report); turns in total."""
    d = _Draw(seed, count_tokens)
    rng = d.rng
    shared = _shared_prompt(d)
    team = rng.sample(WORKER_ROLES, rng.randint(max(1, handoffs - 1), handoffs))
    roles = team + rng.choices(team, k=handoffs - len(team))
    rng.shuffle(roles)
    handoff_tool = _handoff_tool(d, team)
    note = f"Workers you can hand sub-tasks to: {', '.join(r.replace('_', ' ') for r in team)}."
    planner_profile = _profile(d, shared, "planner", note, [handoff_tool])
    profiles = {role: _profile(d, shared, role, HANDOFF_NOTE) for role in team}
    # The planner's own tool turns: up to a sixth of all, and few enough to
    # leave each worker two.
    own = rng.randint(1, max(1, min(turns // 6, turns - 1 - 3 * handoffs)))
    worker_turns = _split(rng, turns - 1 - own - handoffs, handoffs, 2)
    # It looks around before it delegates anything.
    later = ["call"] * (own - 1) + ["handoff"] * handoffs
    rng.shuffle(later)

    task, task_values = _task(d)
    planner = _Agent(d, "planner", planner_profile, task, task_values)
    conversations = [planner.conv]
    for action in ["call"] + later:
        if action == "call":
            planner.work()
            continue
        role = roles.pop()
        name = f"{role}-{len(conversations)}"
        conversations.append(_handoff(d, planner, handoff_tool, task, name, profiles[role], worker_turns.pop()))
    planner.finish("## Final answer")
    return Workflow(shape, seed, conversations, d.schedule)


def _handoff(d: _Draw, planner: _Agent, tool: _Tool, task: str, name: str, profile: _Profile,
             turns: int) -> Conversation:
    call_id, brief = planner.delegate(tool, profile.role)
    opening = _handoff_message(task, planner.conv, brief)
    worker = _Agent(d, name, profile, opening, planner.memory.seen_in(opening))
    for _ in range(turns - 1):
        worker.work()
    report = worker.finish(f"## Report from {name}")
    planner.receive(call_id, report, worker.memory.seen_in(report))
    return worker.conv


def six_turn_workflow(seed: int, count_tokens: TokenCounter = approx_tokens) -> Workflow:
    """A planner and one worker; 6 assistant turns in all."""
    return _planned_workflow("six_turn", seed, turns=6, handoffs=1, count_tokens=count_tokens)


def thirty_five_turn_workflow(seed: int, count_tokens: TokenCounter = approx_tokens) -> Workflow:
    """A planner and three hand-offs to workers; 35 assistant turns in all."""
    return _planned_workflow("thirty_five_turn", seed, turns=35, handoffs=3, count_tokens=count_tokens)


def interleaved_run(seed: int, n_agents: int, turns_per_agent: int = 6,
                    count_tokens: TokenCounter = approx_tokens) -> Workflow:
    """n_agents agents of one role, sharing the system prompt and tools, each
    on its own task; their turns arrive in a uniformly random interleaving."""
    if n_agents < 1 or turns_per_agent < 1:
        raise ValueError(f"need at least one agent and one turn, got {n_agents} x {turns_per_agent}")
    d = _Draw(seed, count_tokens)
    role = d.rng.choice(WORKER_ROLES)
    profile = _profile(d, _shared_prompt(d), role, SOLO_NOTE)
    conversations = []
    for i in range(1, n_agents + 1):
        agent = _Agent(d, f"{role}-{i}", profile, *_task(d))
        for _ in range(turns_per_agent - 1):
            agent.work()
        agent.finish("## Answer")
        conversations.append(agent.conv)
    # Shuffling the multiset of names keeps each agent's turns in order (the
    # k-th occurrence is its k-th turn) and makes every interleaving equally likely.
    d.rng.shuffle(d.schedule)
    return Workflow("interleaved", seed, conversations, d.schedule)


# ---------------------------------------------------------------------------
# Summary and command line


def _message_text(message: dict) -> str:
    """What a chat template renders of a message, near enough for counting."""
    calls = [f"{c['function']['name']}({c['function']['arguments']})" for c in message.get("tool_calls") or []]
    return "\n".join([message["content"] or "", *calls])


@dataclass
class TurnStats:
    agent: str
    messages: int  # in the request
    prompt_tokens: int  # tool schemas + request
    new_tokens: int  # since this agent's previous reply: what a stateful engine computes
    reply_tokens: int
    tool_results: list[int]  # tokens of each tool result among the new messages


def turn_stats(workflow: Workflow, count_tokens: TokenCounter = approx_tokens) -> list[TurnStats]:
    """Per turn in schedule order, how much a client sends and how much is new."""
    seen: dict[str, int] = {}  # agent -> messages already held after its previous turn
    rows = []
    for turn in workflow.turns():
        tokens = [count_tokens(_message_text(m)) for m in turn.request]
        schema = count_tokens(json.dumps(turn.tools))
        start = seen.get(turn.agent, 0)
        results = [t for m, t in zip(turn.request[start:], tokens[start:]) if m["role"] == "tool"]
        rows.append(TurnStats(turn.agent, len(turn.request), schema + sum(tokens),
                              (0 if start else schema) + sum(tokens[start:]),
                              count_tokens(_message_text(turn.reply)), results))
        seen[turn.agent] = len(turn.request) + 1
    return rows


def summary(workflow: Workflow, count_tokens: TokenCounter = approx_tokens) -> str:
    rows = turn_stats(workflow, count_tokens)
    results = [count_tokens(m["content"]) for c in workflow.conversations for m in c.messages if m["role"] == "tool"]
    lines = [f"{workflow.shape} seed {workflow.seed}: {len(workflow.conversations)} conversations, {len(rows)} "
             f"assistant turns, {sum(len(c.messages) for c in workflow.conversations)} messages"]
    for c in workflow.conversations:
        lines.append(f"  {c.agent:<22} {len(c.tools):>2} tools {count_tokens(json.dumps(c.tools)):>5} schema tokens, "
                     f"system {count_tokens(c.system):>4} tokens, {len(c.copied)} turns")
    lines.append(f"tool results: {len(results)}, tokens min {min(results)} / median {statistics.median(results):.0f}"
                 f" / max {max(results)}")
    lines.append(f"{'turn':>4}  {'agent':<22} {'msgs':>4} {'prompt':>7} {'new':>6} {'reply':>5}  tool results")
    for n, r in enumerate(rows):
        lines.append(f"{n:>4}  {r.agent:<22} {r.messages:>4} {r.prompt_tokens:>7} {r.new_tokens:>6} "
                     f"{r.reply_tokens:>5}  {' '.join(map(str, r.tool_results))}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=["6", "35", "interleaved"], default="6")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--agents", type=int, default=4, help="agents of the interleaved shape")
    parser.add_argument("--turns-per-agent", type=int, default=6, help="turns of each interleaved agent")
    parser.add_argument("--out", help="write the workflow as JSON here")
    args = parser.parse_args(argv)
    if args.shape == "6":
        workflow = six_turn_workflow(args.seed)
    elif args.shape == "35":
        workflow = thirty_five_turn_workflow(args.seed)
    else:
        workflow = interleaved_run(args.seed, args.agents, args.turns_per_agent)
    if args.out:
        with open(args.out, "w") as f:
            f.write(workflow.to_json())
    print(summary(workflow))


if __name__ == "__main__":
    main()
