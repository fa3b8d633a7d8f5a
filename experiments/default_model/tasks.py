"""Short task episodes for the agent model, beside experiments/default_model/data.py's
windows of long multi-agent workflows: what those lack.

- plainly worded requests: the tool is named by what it does, in one of many
  phrasings (terse or verbose, polite or blunt), under one of many system
  prompt styles; the values are given inline, in parentheses, in quoted
  fields, in an earlier turn, or come from an earlier tool result;
- many argument names (stems x suffixes), a share of them held out by hash:
  never in a training episode, used by the held-out evaluation;
- tasks that end: once a tool result answers the question the assistant
  writes the answer (quoting the result), and a tools-offered-but-not-needed
  class (thanks, greetings, a question the context answers);
- conversations without tools, answered in plain text (arithmetic, copying a
  value out of the text, counting, sorting);
- values copied from anywhere in a long context: the value the user gave at
  the start, after many distractor results full of look-alike ids;
- multi-agent hand-offs: a triage agent transfers to the agent whose
  description covers the request, and the receiving agent acts on the
  user's values from before the hand-off;
- requests no offered tool fits (another record kind, another action, or
  nothing a business tool does: a sum, a fact, the weather): the assistant
  says so in text, or answers directly when it can, and calls nothing;
- several calls in one reply: the same action on two or three ids, or two
  actions in one request.

Each episode is a whole conversation whose assistant messages are all
trainable; its last assistant message is the one the evaluation scores.
No torch here (data workers import it).
"""
from __future__ import annotations

import hashlib
import json
import random
import string
from dataclasses import dataclass, field
from functools import lru_cache

PLACEMENTS = ("inline", "paren", "quoted", "earlier", "result")
HELDOUT_TASK_ARG_PERCENT = 25


@dataclass
class Episode:
    messages: list[dict]  # the whole conversation, ending with the scored assistant message
    tools: list[dict]
    kind: str  # see experiments/default_model/episodes.py KINDS
    placement: str  # where the call's values were given (PLACEMENTS); "record" or "off_domain" for unfit; else "none"
    heldout_args: int = 0  # held-out argument names in the scored call
    answer_values: list[str] = field(default_factory=list)  # what a scored answer must quote

    @property
    def prompt(self) -> list[dict]:
        return self.messages[:-1]

    @property
    def reply(self) -> dict:
        return self.messages[-1]

    def reference(self) -> list[dict]:
        return [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                for c in self.reply.get("tool_calls") or []]


# ---------------------------------------------------------------------------
# Names: entities with their verbs, argument names

# entity -> (id prefix, plural, extra fields of its record with value kinds)
ENTITIES = {
    "order": ("ORD", "orders", {"status": "status", "total": "money", "eta": "date"}),
    "invoice": ("INV", "invoices", {"status": "status", "amount": "money", "due_date": "date"}),
    "ticket": ("TCK", "tickets", {"status": "status", "assigned_to": "person", "priority": "level"}),
    "customer": ("CUS", "customers", {"email": "email", "plan": "plan", "city": "city"}),
    "shipment": ("SHP", "shipments", {"status": "status", "carrier": "carrier", "eta": "date"}),
    "subscription": ("SUB", "subscriptions", {"status": "status", "plan": "plan", "renews_on": "date"}),
    "build": ("BLD", "builds", {"status": "status", "branch": "branch", "duration_s": "count"}),
    "deployment": ("DEP", "deployments", {"status": "status", "region": "region", "version": "version"}),
    "incident": ("INC", "incidents", {"status": "status", "severity": "level", "owner": "person"}),
    "employee": ("EMP", "employees", {"team": "team", "manager": "person", "office": "city"}),
    "payment": ("PAY", "payments", {"status": "status", "amount": "money", "method": "method"}),
    "refund": ("RFD", "refunds", {"status": "status", "amount": "money", "reason_code": "code"}),
    "account": ("ACC", "accounts", {"owner": "person", "tier": "plan", "balance": "money"}),
    "document": ("DOC", "documents", {"title": "title", "owner": "person", "path": "path"}),
    "job": ("JOB", "jobs", {"state": "status", "queue": "team", "attempts": "count"}),
    "device": ("DEV", "devices", {"model": "version", "location": "city", "battery": "count"}),
}
# verb -> (phrasings of the action, description template, whether it reads a record)
VERBS = {
    "get": (("look up", "fetch", "pull up", "find", "get me", "show me", "check", "retrieve"),
            "Get one {e} by its id.", True),
    "cancel": (("cancel", "call off", "stop", "abort"), "Cancel a {e}.", False),
    "update": (("update", "change", "modify", "edit"), "Update fields of a {e}.", False),
    "delete": (("delete", "remove", "get rid of", "erase"), "Delete a {e} permanently.", False),
    "create": (("create", "open", "make", "add", "register", "start"), "Create a new {e}.", False),
    "archive": (("archive", "file away", "shelve"), "Archive a {e} so it no longer shows up.", False),
    "reopen": (("reopen", "revive", "bring back"), "Reopen a closed {e}.", False),
    "assign": (("assign", "hand", "give"), "Assign a {e} to someone.", False),
}
ID_SUFFIXES = ("_id", "_ref", "_code", "_number", "_key", "_uid", "_handle", "_no", "Id", "_identifier")
# extra arguments: name -> value kind
EXTRA_ARGS = {
    "reason": "sentence", "note": "sentence", "comment": "sentence", "message": "sentence", "summary": "sentence",
    "amount": "money", "quantity": "count", "limit": "count", "days": "count", "retries": "count",
    "email": "email", "owner": "person", "assignee": "person", "reviewer": "person", "contact": "person",
    "path": "path", "target_path": "path", "label": "word", "tag": "word", "channel": "word",
    "notify": "bool", "force": "bool", "dry_run": "bool", "urgent": "bool",
    "region": "region", "priority": "level", "due_date": "date", "start_date": "date",
}
EXTRA_STEMS = ("memo", "remark", "detail", "hint", "caption", "tally", "budget", "recipient", "folder", "slot",
               "topic", "batch", "cohort", "zone", "window", "marker")
EXTRA_STEM_KINDS = ("sentence", "count", "word", "person", "path", "date")


@lru_cache(maxsize=1)
def task_arg_names() -> frozenset[str]:
    """Every argument name the task episodes can give a tool."""
    names = {stem + suf for stem in ENTITIES for suf in ID_SUFFIXES}
    names |= set(EXTRA_ARGS)
    names |= {f"{stem}_{kind}" for stem in EXTRA_STEMS for kind in ("text", "value", "name")}
    return frozenset(names)


def stable_hash(text: str) -> int:
    """A hash that is the same in every process and run (Python's is salted)."""
    return int(hashlib.md5(text.encode("utf-8")).hexdigest()[:8], 16)


@lru_cache(maxsize=1)
def heldout_task_args() -> frozenset[str]:
    """The task argument names no training episode uses (by hash). Plain
    words also written in messages (reason, email, ...) stay in training:
    holding them out would mean rewriting the text around them."""
    return frozenset(n for n in task_arg_names() - set(EXTRA_ARGS)
                     if stable_hash("task-arg:" + n) % 100 < HELDOUT_TASK_ARG_PERCENT)


def _extra_kind(name: str) -> str:
    if name in EXTRA_ARGS:
        return EXTRA_ARGS[name]
    stem, _, tail = name.rpartition("_")
    return EXTRA_STEM_KINDS[stable_hash(stem) % len(EXTRA_STEM_KINDS)] if tail in ("text", "value", "name") else "word"


# ---------------------------------------------------------------------------
# Values

FIRST = ("Ana", "Bo", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivo", "Jun", "Kofi", "Lena", "Mateo",
         "Nia", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tove", "Uma", "Viktor", "Wen", "Yusuf", "Zoe")
LAST = ("Okafor", "Lindqvist", "Moreau", "Tanaka", "Silva", "Kowalski", "Haddad", "Novak", "Reyes", "Brennan",
        "Ito", "Mensah", "Petrov", "Quist", "Varga")
WORDS = ("amber", "basil", "cedar", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper", "kestrel",
         "lagoon", "maple", "nectar", "onyx", "pebble", "quartz", "raven", "sierra", "tundra", "umber", "violet",
         "willow", "yonder", "zephyr")
SENTENCES = ("customer asked for it", "duplicate of an earlier request", "arrived damaged", "wrong size",
             "no longer needed", "requested by finance", "budget was cut", "moved to next quarter",
             "failing since the last release", "approved in the weekly review", "the address changed",
             "charged twice", "see the attached log", "blocked on the vendor", "needs a second look")
STATUS = ("open", "pending", "shipped", "delivered", "failed", "paid", "overdue", "resolved", "in progress",
          "on hold", "queued", "running", "succeeded", "cancelled")
CITIES = ("Lisbon", "Osaka", "Nairobi", "Denver", "Tallinn", "Recife", "Hanoi", "Krakow", "Perth", "Montreal")
REGIONS = ("eu-west-1", "us-east-2", "ap-south-1", "eu-central-1", "us-west-2", "sa-east-1")
PLANS = ("free", "starter", "team", "business", "enterprise")
LEVELS = ("low", "medium", "high", "critical")
CARRIERS = ("DHL", "UPS", "FedEx", "PostNL", "Yamato")
METHODS = ("card", "bank transfer", "paypal", "invoice")
TEAMS = ("platform", "billing", "growth", "support", "infra", "data")


def _person(r: random.Random) -> str:
    return f"{r.choice(FIRST)} {r.choice(LAST)}"


def make_id(r: random.Random, prefix: str) -> str:
    style = r.random()
    if style < 0.45:
        return f"{prefix}-{r.randint(1000, 99999)}"
    if style < 0.65:
        return f"{prefix}-{r.randint(2019, 2026)}-{r.randint(1, 9999):04d}"
    if style < 0.8:
        return f"{prefix.lower()}_{''.join(r.choices(string.ascii_letters + string.digits, k=r.randint(6, 10)))}"
    if style < 0.9:
        return f"{r.getrandbits(32):08x}-{r.getrandbits(16):04x}-{r.getrandbits(16):04x}"
    return str(r.randint(10000, 9999999))


def make_value(r: random.Random, kind: str):
    if kind == "sentence":
        return r.choice(SENTENCES)
    if kind == "money":
        return round(r.randint(100, 500000) / 100, 2)
    if kind == "count":
        return r.randint(1, 500)
    if kind == "email":
        return f"{r.choice(FIRST).lower()}.{r.choice(LAST).lower()}@{r.choice(WORDS)}.{r.choice(['com', 'io', 'org'])}"
    if kind == "person":
        return _person(r)
    if kind == "path":
        return "/" + "/".join(r.choice(WORDS) for _ in range(r.randint(1, 3))) + r.choice(
            [".csv", ".json", ".log", ".md", ".yaml", ".txt", "/"])
    if kind == "word":
        return r.choice(WORDS)
    if kind == "bool":
        return r.random() < 0.5
    if kind == "region":
        return r.choice(REGIONS)
    if kind == "level":
        return r.choice(LEVELS)
    if kind == "date":
        return f"2025-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}"
    if kind == "status":
        return r.choice(STATUS)
    if kind == "plan":
        return r.choice(PLANS)
    if kind == "city":
        return r.choice(CITIES)
    if kind == "carrier":
        return r.choice(CARRIERS)
    if kind == "method":
        return r.choice(METHODS)
    if kind == "team":
        return r.choice(TEAMS)
    if kind == "branch":
        return f"{r.choice(['feat', 'fix', 'release'])}/{r.choice(WORDS)}-{r.randint(1, 99)}"
    if kind == "version":
        return f"{r.randint(0, 9)}.{r.randint(0, 30)}.{r.randint(0, 99)}"
    if kind == "title":
        return f"{r.choice(WORDS).title()} {r.choice(['plan', 'notes', 'spec', 'runbook', 'report'])}"
    if kind == "code":
        return f"{r.choice('ABCDEFG')}{r.randint(10, 99)}"
    raise ValueError(kind)


def _json_type(value) -> dict:
    if isinstance(value, bool):
        return {"type": "boolean"}
    if isinstance(value, int):
        return {"type": "integer"}
    if isinstance(value, float):
        return {"type": "number"}
    return {"type": "string"}


def _call(name: str, args: dict, r: random.Random) -> dict:
    return {"id": f"call_{r.getrandbits(48):012x}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def _assistant_call(name: str, args: dict, r: random.Random) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [_call(name, args, r)]}


def _tool_msg(call_msg: dict, content) -> dict:
    text = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
    return {"role": "tool", "tool_call_id": call_msg["tool_calls"][0]["id"], "content": text}


# ---------------------------------------------------------------------------
# System prompts and request phrasing

COMPANIES = ("Northwind", "Acme", "Globex", "Initech", "Umbrella Logistics", "Stark Retail", "Hooli", "Vandelay")
SYSTEM_STYLES = (
    "You are a helpful assistant.",
    "You are {agent}, {company}'s assistant. Use the tools when they help; otherwise just answer.",
    "# Role\nYou are the {agent} for {company}.\n\n# Rules\n- Call a tool only when you need its result.\n"
    "- Copy ids and values exactly as the user gives them.\n- When you have the answer, reply in plain text.",
    "{agent}. Keep it short.",
    "You work for {company} support. Resolve the user's request with the available functions, then report back.",
    "Instructions: help {company} staff with their requests. Never invent ids: use exactly the ones given.",
    "You are an agent in a team of agents at {company}. Your name is {agent}.",
    "Act as {company}'s operations bot. Answer in one or two sentences.",
    "You are {agent}. Today is 2025-06-{day:02d}. Tools are available below; the user cannot see them.",
    "SYSTEM: {agent} online. Use functions for lookups and changes; answer questions directly.",
    "You are a concise assistant for the {team} team.",
    "Help the user. If a function is needed, call it; if the conversation already has the answer, give it.",
)
AGENT_NAMES = ("triage", "support_agent", "ops-helper", "Assistant", "billing_agent", "helpdesk", "Orion", "Atlas",
               "concierge", "dispatcher")


def system_prompt(r: random.Random, agent: str | None = None) -> str:
    return r.choice(SYSTEM_STYLES).format(agent=agent or r.choice(AGENT_NAMES), company=r.choice(COMPANIES),
                                          day=r.randint(1, 28), team=r.choice(TEAMS))


OPENERS = ("", "", "", "Hi, ", "Hello! ", "Hey, ", "Quick one: ", "Good morning. ", "Hi there, hope you're well. ",
           "Sorry to bother you, but ", "Urgent: ", "ok so ")
POLITE = ("", "", "please ", "could you ", "can you ", "would you mind if you could ", "I need you to ",
          "I'd like you to ", "go ahead and ")
CLOSERS = ("", "", "", " Thanks!", " Thank you.", " Cheers.", " ASAP please.", " That's all.", " thx")


def _fmt(value) -> str:
    return json.dumps(value) if isinstance(value, bool) else str(value)


def _arg_phrase(name: str, value, r: random.Random) -> str:
    """How a non-id value is worded inline."""
    v = f'"{value}"' if isinstance(value, str) and " " in value else _fmt(value)  # where a phrase ends
    words = name.replace("_", " ").replace("Id", " id").strip()
    return r.choice([f"{words} {v}", f"with {words} {v}", f"{words}: {v}", f"set {words} to {v}"])


def request_text(r: random.Random, verb: str, entity: str, id_value: str, extras: dict, placement: str,
                 id_name: str) -> str:
    """The user's request. placement says how the values appear; 'earlier'
    and 'result' name the entity only, the value being elsewhere."""
    action = r.choice(VERBS[verb][0])
    polite = r.choice(POLITE)
    if placement in ("earlier", "result"):
        ref = r.choice([f"that {entity}", f"the {entity} {'I mentioned' if placement == 'earlier' else 'from above'}",
                        f"the same {entity}", f"it (the {entity})"])
        core = f"{polite}{action} {ref}"
    elif placement == "inline":
        the = "" if r.random() < 0.6 else "the "
        core = f"{polite}{action} {the}{entity} {id_value}"
    elif placement == "paren":
        core = (f"{polite}{action} a {entity} by its id for {id_value} please ({id_name}: {id_value})"
                if r.random() < 0.4 else f"{polite}{action} the {entity} ({id_name}={id_value})")
    else:  # quoted
        core = r.choice([f'{polite}{action} the {entity} with {id_name}="{id_value}"',
                         f'{polite}{action} {entity}: "{id_value}"',
                         f"{polite}{action} this {entity}: {json.dumps({id_name: id_value})}"])
    parts = []
    for name, value in extras.items():
        if placement in ("quoted", "paren"):
            parts.append(f'{name}="{value}"' if isinstance(value, str) else f"{name}={_fmt(value)}")
        else:
            parts.append(_arg_phrase(name, value, r))
    text = core + ((", " if placement not in ("quoted", "paren") else " ") + ", ".join(parts) if parts else "")
    opener = r.choice(OPENERS)
    text = opener + (text[0].upper() + text[1:] if not opener or opener.endswith(". ") else text)
    if r.random() < 0.15:  # terse (values keep their case)
        text = text.removeprefix("Please ").removeprefix("please ").rstrip(".")
        text = text[:1].lower() + text[1:]
    return text.rstrip() + r.choice([".", "", "?", "!"]) + r.choice(CLOSERS)


# ---------------------------------------------------------------------------
# Tools


@dataclass
class TaskTool:
    name: str
    verb: str
    entity: str
    id_name: str
    extras: dict[str, str]  # argument name -> value kind
    schema: dict

    def args(self, r: random.Random, id_value: str, with_extras: int) -> dict:
        out = {self.id_name: id_value}
        for name in list(self.extras)[:with_extras]:
            out[name] = make_value(r, self.extras[name])
        return out


def make_tool(r: random.Random, verb: str, entity: str, arg_ok, name_style: int = 0) -> TaskTool:
    """A tool; arg_ok(name) says which argument and tool names may be used."""
    candidates = [entity + s for s in ID_SUFFIXES if arg_ok(entity + s)]
    id_name = r.choice(candidates) if candidates else entity + "_id"
    # sorted: a set's order changes with the process's string hash seed, and the draws must not
    extra_pool = [n for n in sorted(task_arg_names()) if not n.startswith(tuple(ENTITIES)) and arg_ok(n)]
    extras = {n: _extra_kind(n) for n in r.sample(extra_pool, r.choice([0, 0, 1, 1, 2, 3]))} if verb != "get" else {}
    styles = [f"{verb}_{entity}", f"{entity}_{verb}", f"{verb}{entity.title()}"]
    if name_style or r.random() < 0.3:
        r.shuffle(styles)
    name = next((n for n in styles if arg_ok(n)), styles[0])  # a name the split keeps out goes to the guard
    desc = VERBS[verb][1].format(e=entity)
    props = {id_name: {"type": "string", "description": f"The {entity}'s id, exactly as given."}}
    for n, kind in extras.items():
        props[n] = {**_json_type(make_value(random.Random(0), kind)), "description": f"{n.replace('_', ' ')}."}
    schema = {"type": "function", "function": {"name": name, "description": desc, "parameters": {
        "type": "object", "properties": props, "required": [id_name]}}}
    return TaskTool(name, verb, entity, id_name, extras, schema)


def _record(r: random.Random, entity: str, id_name: str, id_value: str) -> dict:
    rec = {id_name: id_value}
    for f, kind in ENTITIES[entity][2].items():
        rec[f] = make_value(r, kind)
    return rec


def _toolset(r: random.Random, target: TaskTool, arg_ok, n: int) -> list[TaskTool]:
    """target plus distractors sharing its verb or its entity (so both must be read)."""
    tools = [target]
    names = {target.name}
    tries = 0
    while len(tools) < n and tries < 50:
        tries += 1
        if r.random() < 0.5:
            verb, entity = r.choice(list(VERBS)), target.entity
        else:
            verb, entity = target.verb, r.choice(list(ENTITIES))
        t = make_tool(r, verb, entity, arg_ok)
        if t.name not in names and (t.verb, t.entity) != (target.verb, target.entity):
            tools.append(t)
            names.add(t.name)
    r.shuffle(tools)
    return tools


# ---------------------------------------------------------------------------
# Long contexts: distractor results full of look-alike ids

def _filler_turns(r: random.Random, n: int, entity: str, arg_ok) -> list[dict]:
    """n earlier exchanges about other records (with other ids of the same
    kinds), for the value the user gave first to be copied from far back."""
    out = []
    for _ in range(n):
        other = r.choice([e for e in ENTITIES if e != entity])
        tool = make_tool(r, "get", other, arg_ok)
        oid = make_id(r, ENTITIES[other][0])
        out.append({"role": "user", "content": f"{r.choice(VERBS['get'][0]).capitalize()} {other} {oid}."})
        call = _assistant_call(tool.name, {tool.id_name: oid}, r)
        rec = _record(r, other, tool.id_name, oid)
        rec["related"] = [make_id(r, ENTITIES[entity][0]) for _ in range(r.randint(1, 4))]
        rec["log"] = "\n".join(f"{make_value(r, 'date')} {make_id(r, r.choice(['REQ', 'EVT', ENTITIES[entity][0]]))} "
                               f"{r.choice(SENTENCES)}" for _ in range(r.randint(2, 12)))
        out += [call, _tool_msg(call, rec), {"role": "assistant", "content": _answer_text(r, other, oid, rec)}]
    return out


def _answer_text(r: random.Random, entity: str, id_value: str, rec: dict, field_: str | None = None) -> str:
    fields = [f for f in rec if f not in ("related", "log") and rec[f] != id_value]
    f = field_ or r.choice(fields)
    v = _fmt(rec[f])
    words = f.replace("_", " ")
    return r.choice([f"The {words} of {entity} {id_value} is {v}.", f"{entity.capitalize()} {id_value}: {words} {v}.",
                     f"It's {v} ({words} of {entity} {id_value}).", f"Done: {entity} {id_value} has {words} {v}."])


# ---------------------------------------------------------------------------
# Episodes


def _messages_start(r: random.Random, agent: str | None = None) -> list[dict]:
    return [{"role": "system", "content": system_prompt(r, agent)}]


def call_episode(r: random.Random, arg_ok, heldout: frozenset[str], placement: str | None = None,
                 filler: int | None = None) -> Episode:
    """A request whose answer is one tool call, values placed per placement,
    after `filler` earlier exchanges about other records (default: none or
    a few, at random)."""
    placement = placement or r.choice(PLACEMENTS)
    entity = r.choice(list(ENTITIES))
    verb = r.choice([v for v in VERBS if v != "get"]) if placement == "result" else r.choice(list(VERBS))
    target = make_tool(r, verb, entity, arg_ok)
    tools = _toolset(r, target, arg_ok, r.randint(2, 6))
    id_value = make_id(r, ENTITIES[entity][0])
    args = target.args(r, id_value, len(target.extras))
    extras = {k: v for k, v in args.items() if k != target.id_name}
    msgs = _messages_start(r)
    if filler is None:
        filler = r.randint(1, 5) if r.random() < 0.3 else 0
    if placement == "earlier":
        msgs.append({"role": "user", "content": r.choice([
            f"My {entity} is {id_value}.", f"I'm asking about {entity} {id_value}.",
            f"For reference, the {entity} number is {id_value}.", f"Context: {entity} {id_value}, opened last week."])})
        msgs.append({"role": "assistant", "content": r.choice(["Noted. What should I do with it?", "Got it.",
                                                               "Thanks, what would you like me to do?"])})
    msgs += _filler_turns(r, filler, entity, arg_ok)
    if placement == "result":
        getter = make_tool(r, "get", entity, arg_ok)
        if getter.name not in {t.name for t in tools}:
            tools.append(getter)
        # the record is reached through another one's id, so only the result holds it
        parent = r.choice([e for e in ENTITIES if e != entity])
        ptool = make_tool(r, "get", parent, arg_ok)
        if ptool.name not in {t.name for t in tools}:
            tools.append(ptool)
        pid = make_id(r, ENTITIES[parent][0])
        msgs.append({"role": "user", "content": f"{r.choice(VERBS['get'][0]).capitalize()} {parent} {pid}."})
        call = _assistant_call(ptool.name, {ptool.id_name: pid}, r)
        rec = _record(r, parent, ptool.id_name, pid)
        rec[target.id_name] = id_value
        msgs += [call, _tool_msg(call, rec), {"role": "assistant", "content": _answer_text(r, parent, pid, rec)}]
    msgs.append({"role": "user", "content": request_text(r, verb, entity, id_value, extras, placement,
                                                         target.id_name)})
    msgs.append(_assistant_call(target.name, args, r))
    held = sum(a in heldout for a in args)
    return Episode(msgs, [t.schema for t in tools], "call", placement, held)


def answer_episode(r: random.Random, arg_ok, heldout: frozenset[str]) -> Episode:
    """A question a lookup answers: the call, its result, then the answer
    quoting the result (sometimes two lookups first)."""
    entity = r.choice(list(ENTITIES))
    getter = make_tool(r, "get", entity, arg_ok)
    tools = _toolset(r, getter, arg_ok, r.randint(1, 5))
    id_value = make_id(r, ENTITIES[entity][0])
    rec = _record(r, entity, getter.id_name, id_value)
    field_ = r.choice(list(ENTITIES[entity][2]))
    words = field_.replace("_", " ")
    msgs = _messages_start(r)
    if r.random() < 0.25:
        msgs += _filler_turns(r, r.randint(1, 3), entity, arg_ok)
    q = r.choice([f"What is the {words} of {entity} {id_value}?", f"{r.choice(OPENERS)}what's the {words} on {entity} "
                  f"{id_value}?", f"Can you tell me the {words} for {entity} {id_value}",
                  f"{entity} {id_value} {words}?",
                  f"I need the {words} of the {entity} {id_value}, please."])
    msgs.append({"role": "user", "content": q})
    call = _assistant_call(getter.name, {getter.id_name: id_value}, r)
    msgs += [call, _tool_msg(call, rec)]
    msgs.append({"role": "assistant", "content": _answer_text(r, entity, id_value, rec, field_)})
    return Episode(msgs, [t.schema for t in tools], "answer", "none", 0, [_fmt(rec[field_])])


NO_TOOL_REQUESTS = (
    ("Thanks, that's all for now.", ("You're welcome!", "Glad I could help.", "Anytime.")),
    ("Hello!", ("Hi! What can I do for you?", "Hello, how can I help?")),
    ("Who are you?", ("I'm an assistant that can look things up and make changes with the tools I have.",)),
    ("Never mind, I figured it out.", ("Great, let me know if you need anything else.",)),
    ("ok", ("Anything else?",)),
)


def no_tool_episode(r: random.Random, arg_ok, heldout: frozenset[str]) -> Episode:
    """Tools offered but none needed: small talk, or a question the
    conversation already answers (after a lookup)."""
    entity = r.choice(list(ENTITIES))
    getter = make_tool(r, "get", entity, arg_ok)
    tools = _toolset(r, getter, arg_ok, r.randint(1, 5))
    msgs = _messages_start(r)
    values: list[str] = []
    if r.random() < 0.5:
        text, replies = r.choice(NO_TOOL_REQUESTS)
        msgs.append({"role": "user", "content": text})
        msgs.append({"role": "assistant", "content": r.choice(replies)})
    else:
        id_value = make_id(r, ENTITIES[entity][0])
        rec = _record(r, entity, getter.id_name, id_value)
        msgs.append({"role": "user", "content": f"{r.choice(VERBS['get'][0]).capitalize()} {entity} {id_value}."})
        call = _assistant_call(getter.name, {getter.id_name: id_value}, r)
        msgs += [call, _tool_msg(call, rec), {"role": "assistant", "content": _answer_text(r, entity, id_value, rec)}]
        field_ = r.choice(list(ENTITIES[entity][2]))
        msgs.append({"role": "user", "content": r.choice([
            f"And what was its {field_.replace('_', ' ')} again?", f"Remind me of the {field_.replace('_', ' ')}?",
            f"so the {field_.replace('_', ' ')} is what?"])})
        msgs.append({"role": "assistant", "content": _answer_text(r, entity, id_value, rec, field_)})
        values = [_fmt(rec[field_])]
    return Episode(msgs, [t.schema for t in tools], "no_tool", "none", 0, values)


# Requests outside what business tools do. Each is (request, reply or None);
# None: the reply says the tools cannot do it.
OFF_DOMAIN = (
    ("What's the weather going to be like in {city} tomorrow?", None),
    ("Book me a table for two at an Italian place near {city}.", None),
    ("Translate 'good morning' into Japanese.", "In Japanese, 'good morning' is 'ohayou gozaimasu'."),
    ("Convert {n} kilometres to metres.", "{n} kilometres is {n1000} metres."),
    ("What is {a} plus {b}?", "{a} plus {b} is {ab}."),
    ("Play some relaxing music.", None),
    ("Send a text message to {person} saying I'm running late.", None),
    ("Find me a flight from {city} to {city2} next Friday.", None),
    ("How many minutes are in {n} hours?", "{n} hours is {n60} minutes."),
    ("Write a haiku about {word}.", None),
    ("Set an alarm for 6:30 tomorrow.", None),
    ("Who is the manager of the {team} team at the company across the street?", None),
    ("Order a pizza with {word} topping.", None),
    ("Check the stock price of {company}.", None),
    ("What is the square of {a}?", "The square of {a} is {a2}."),
)
DECLINES = ("None of my tools can {want}. I can {can}.", "I can't {want} with the tools I have: they {can}.",
            "Sorry, that's outside what I can do here. My tools {can}; none of them can {want}.",
            "I don't have a tool to {want}. What I can do: {can}.")


def _can_text(tools: list[TaskTool]) -> str:
    return ", ".join(f"{t.verb} {t.entity}s" for t in tools[:4])


def unfit_episode(r: random.Random, arg_ok, heldout: frozenset[str]) -> Episode:
    """Tools offered, none of which does what the user asks (another kind of
    record, another action, or nothing business tools do): the assistant
    says so, or answers a question it can answer itself, and calls nothing."""
    msgs = _messages_start(r)
    entity = r.choice(list(ENTITIES))
    verb = r.choice(list(VERBS))
    if r.random() < 0.55:
        # the request's action and record kind; the tools share at most one of the two with it
        others = [e for e in ENTITIES if e != entity]
        tools, names = [], set()
        for _ in range(r.randint(1, 5)):
            t = (make_tool(r, r.choice([v for v in VERBS if v != verb]), entity, arg_ok) if r.random() < 0.4
                 else make_tool(r, r.choice(list(VERBS)), r.choice(others), arg_ok))
            if t.name not in names:
                tools.append(t)
                names.add(t.name)
        id_value = make_id(r, ENTITIES[entity][0])
        msgs.append({"role": "user", "content": request_text(r, verb, entity, id_value, {}, "inline",
                                                             entity + "_id")})
        want = f"{verb} a {entity}"
        reply = r.choice(DECLINES).format(want=want, can=_can_text(tools))
        values, placement = [entity], "record"
    else:
        tools = _toolset(r, make_tool(r, verb, entity, arg_ok), arg_ok, r.randint(1, 5))
        a, b, n = r.randint(2, 99), r.randint(2, 99), r.randint(2, 30)
        fill = {"city": r.choice(CITIES), "city2": r.choice(CITIES), "person": _person(r), "word": r.choice(WORDS),
                "team": r.choice(TEAMS), "company": r.choice(COMPANIES), "a": a, "b": b, "ab": a + b, "a2": a * a,
                "n": n, "n1000": n * 1000, "n60": n * 60}
        request, answer = r.choice(OFF_DOMAIN)
        request = request.format(**fill)
        opener = r.choice(OPENERS)
        msgs.append({"role": "user", "content": opener + (request[0].lower() + request[1:]
                                                          if opener and not opener.endswith(". ") else request)})
        if answer is None:
            reply = r.choice(DECLINES).format(want="help with that", can=_can_text(tools))
            values = []
        else:
            reply = answer.format(**fill)
            values = [reply.split(" is ")[-1].rstrip(".")]
        placement = "off_domain"
    msgs.append({"role": "assistant", "content": reply})
    return Episode(msgs, [t.schema for t in tools], "unfit", placement, 0, values)


def parallel_episode(r: random.Random, arg_ok, heldout: frozenset[str]) -> Episode:
    """One request, several calls in one reply: the same action on two or
    three records, or two different actions."""
    entity = r.choice(list(ENTITIES))
    verb = r.choice(list(VERBS))
    target = make_tool(r, verb, entity, arg_ok)
    tools = _toolset(r, target, arg_ok, r.randint(2, 5))
    msgs = _messages_start(r)
    ids = [make_id(r, ENTITIES[entity][0]) for _ in range(r.randint(2, 3))]
    action = r.choice(VERBS[verb][0])
    calls = []
    if r.random() < 0.6 or len(tools) < 2:
        listed = ", ".join(ids[:-1]) + " and " + ids[-1]
        text = r.choice([f"{r.choice(POLITE)}{action} {ENTITIES[entity][1]} {listed}",
                         f"{r.choice(POLITE)}{action} these {ENTITIES[entity][1]}: {listed}",
                         f"{r.choice(POLITE)}{action} {entity} {ids[0]}, and the same for {', '.join(ids[1:])}"])
        calls = [(target, {target.id_name: i}) for i in ids]
    else:
        other = r.choice([t for t in tools if t is not target])
        oid = make_id(r, ENTITIES[other.entity][0])
        text = (f"{r.choice(POLITE)}{action} {entity} {ids[0]} and "
                f"{r.choice(VERBS[other.verb][0])} {other.entity} {oid}")
        calls = [(target, {target.id_name: ids[0]}), (other, {other.id_name: oid})]
    opener = r.choice(OPENERS)
    text = opener + (text[0].upper() + text[1:] if not opener or opener.endswith(". ") else text)
    msgs.append({"role": "user", "content": text + r.choice([".", "", "?"]) + r.choice(CLOSERS)})
    msgs.append({"role": "assistant", "content": None, "tool_calls": [_call(t.name, a, r) for t, a in calls]})
    held = sum(a in heldout for _, args in calls for a in args)
    return Episode(msgs, [t.schema for t in tools], "parallel", "none", held)


def plain_episode(r: random.Random, arg_ok=None, heldout: frozenset[str] = frozenset()) -> Episode:
    """No tools offered: a question answered in plain text (that the answer is
    right can be checked)."""
    msgs = [] if r.random() < 0.2 else _messages_start(r)
    kind = r.randrange(5)
    if kind == 0:
        a, b = r.randint(2, 999), r.randint(2, 999)
        op = r.choice(["+", "-", "*"]) if max(a, b) < 100 else r.choice(["+", "-"])
        val = str(eval(f"{a}{op}{b}"))
        q, ans = r.choice([f"What is {a} {op} {b}?", f"{a}{op}{b}=", f"compute {a} {op} {b}"]), f"{a} {op} {b} = {val}."
    elif kind == 1:
        prefix = r.choice([e[0] for e in ENTITIES.values()])
        val = make_id(r, prefix)
        noise = ", ".join(make_id(r, r.choice(["REQ", "EVT", "LOG"])) for _ in range(r.randint(1, 4)))
        q = f"In this note, which id is the {prefix} one? \"Refs: {noise}, {val}; see thread.\""
        ans = f"The {prefix} id is {val}."
    elif kind == 2:
        words = r.sample(WORDS, r.randint(3, 7))
        val = ", ".join(sorted(words))
        q, ans = f"Sort alphabetically: {', '.join(words)}", val
    elif kind == 3:
        words = [r.choice(WORDS) for _ in range(r.randint(2, 12))]
        val = str(len(words))
        q, ans = f"How many words are in \"{' '.join(words)}\"?", f"There are {val} words."
    else:
        name = _person(r)
        val = name.split()[0]
        q, ans = f"What is the first name in \"{name}\"?", f"{val}."
    msgs.append({"role": "user", "content": q})
    msgs.append({"role": "assistant", "content": ans})
    return Episode(msgs, [], "plain", "none", 0, [val])


HANDOFF_AGENTS = {
    "billing_agent": ("invoices, payments and refunds", ("invoice", "payment", "refund")),
    "shipping_agent": ("orders and shipments", ("order", "shipment")),
    "devops_agent": ("builds, deployments and jobs", ("build", "deployment", "job")),
    "support_agent": ("tickets and incidents", ("ticket", "incident")),
    "accounts_agent": ("customers, accounts and subscriptions", ("customer", "account", "subscription")),
    "it_agent": ("employees, devices and documents", ("employee", "device", "document")),
}


def handoff_episode(r: random.Random, arg_ok, heldout: frozenset[str], receiving: bool | None = None) -> Episode:
    """Triage hands off to the agent covering the request (a transfer tool per
    agent, as the OpenAI Agents SDK offers), or, as the receiving agent, acts
    on the values the user gave before the hand-off."""
    agents = r.sample(list(HANDOFF_AGENTS), r.randint(2, 4))
    target = r.choice(agents)
    entity = r.choice(HANDOFF_AGENTS[target][1])
    verb = r.choice(list(VERBS))
    tool = make_tool(r, verb, entity, arg_ok)
    id_value = make_id(r, ENTITIES[entity][0])
    args = tool.args(r, id_value, len(tool.extras))
    extras = {k: v for k, v in args.items() if k != tool.id_name}
    request = request_text(r, verb, entity, id_value, extras, r.choice(["inline", "paren", "quoted"]), tool.id_name)
    transfers = [{"type": "function", "function": {
        "name": f"transfer_to_{a}", "description": f"Handoff to the {a} agent: it handles {HANDOFF_AGENTS[a][0]}.",
        "parameters": {"type": "object", "properties": {}, "required": []}}} for a in agents]
    msgs = [{"role": "system", "content": r.choice([
        "You are the triage agent. Hand the user to the agent that can handle the request.",
        "Triage: route each request to the right specialist agent.",
        f"You are {r.choice(COMPANIES)}'s front desk. Transfer to a specialist; do not answer yourself."])},
        {"role": "user", "content": request}]
    transfer = _assistant_call(f"transfer_to_{target}", {}, r)
    if not (receiving if receiving is not None else r.random() < 0.5):
        msgs.append(transfer)
        return Episode(msgs, transfers, "handoff", "none", 0)
    # The receiving agent: the SDK sends the history with the transfer and its result.
    msgs[0] = {"role": "system", "content": f"You are the {target}. You handle {HANDOFF_AGENTS[target][0]}. "
                                            f"{r.choice(['Use your tools.', 'Be precise with ids.', ''])}".strip()}
    msgs += [transfer, _tool_msg(transfer, json.dumps({"assistant": target}))]
    tools = _toolset(r, tool, arg_ok, r.randint(2, 5))
    msgs.append(_assistant_call(tool.name, args, r))
    held = sum(a in heldout for a in args)
    return Episode(msgs, [t.schema for t in tools], "call", "earlier", held)

