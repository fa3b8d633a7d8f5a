"""Training and held-out data for the project's own agent model, generated on
the fly from experiments/workloads/workflows.py (no files, no downloads).

What the generator gives and what this adds
-------------------------------------------
The workflows' reference assistant messages call a tool drawn at random from
the offered set, with argument values picked at random among the values seen
so far: nothing in the request says which call comes next, so "the right
tool" and "exactly the right arguments" are not defined for them. To make
them defined (and learnable), a tool-call turn may be *directed*: a user
message just before it says what to do next, in one of two styles:

- explicit:  ``Next step: call jira_get_ticket with ticket_id="TCK-123", limit=20.``
- described: ``Next step: fetch one ticket from the issue tracker by its id, with all fields.
  Arguments: ticket_id="TCK-123", limit=20.`` -- the tool is named only by
  the first sentence of its description in the schema, so the model must
  look the name up in the offered tools.

The model then has to write the Hermes call ``<tool_call>\\n{"name": ...,
"arguments": {...}}\\n</tool_call>``: copy the (unseen) tool name from the
directive or the schema, the (unseen) argument names, and the values, with
JSON types taken from the schema. Undirected turns (the generator's reference,
a random but well-formed call) stay in the training mix, and so do final
answers, so the model also learns to act without a directive.

Held-out split
--------------
By NAME, through a stable hash: a tool is held out when the hash of its core
(the name without a system prefix such as ``jira_``, so ``get_ticket`` and
``jira_get_ticket`` share a fate) falls in the held-out range; an argument
name likewise. Only names that never occur in the generator's free text
(messages, descriptions, code and logs in tool results) are eligible, so that
holding one out does not require rewriting text. Training conversations drop
held-out tools from the schemas, their calls and results, and held-out
parameters from the remaining tools and calls; tool names quoted in hand-off
notes are rewritten. A last guard drops any training example whose text still
contains a held-out name as a word, so no training batch ever holds one.
Evaluation turns come from other seeds and call held-out tools only, with the
unfiltered schemas.

Packing
-------
Examples are windows of a conversation that end at an assistant turn: the
system prompt with a subset of the tools (always the ones called in the
window), the task, the most recent messages that fit, the directives and the
replies, rendered with the default chat template and tokenized. Rows of
seq_len + 1 tokens are packed best-fit from a small pool of examples; the
space left in a row is filled with short synthetic copy documents. Each token
carries a loss code: 0 none, 1 context, 2 assistant reply, 3 synthetic copy
target.

Synthetic copy documents (dense, 16-256 tokens) make copying emerge early
(induction heads): a random span and its repeat, key -> value lookups over
random multi-token keys, and ``k="v"`` lists rewritten as a JSON call. Their
loss is only on what can be predicted (the repeat, the looked-up value, the
JSON).

Task episodes
-------------
Half of the example refills (TASK_RATE) are instead a batch of short
episodes from experiments/default_model/tasks.py (plainly worded calls, final
answers, no-tool and no-tools turns, long-context copies, hand-offs), with
their own held-out argument names (added to the split); task_eval_turns
draws their held-out turns, episode_turn turns any episode (also those of
experiments/default_model/data_alt.py) into an EvalTurn.

This module imports no torch, so data workers start fast.
"""
from __future__ import annotations

import copy
import json
import random
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from agentkv.experiments.default_model import episodes as E
from agentkv.experiments.default_model import tasks as T
from agentkv.experiments.default_model.tasks import stable_hash
from agentkv.experiments.default_model.tokenizer import CHAT_TEMPLATE
from agentkv.experiments.workloads import workflows as W
from agentkv.model.tokenizer import Tokenizer, render_chat_template

# ---------------------------------------------------------------------------
# Loss codes of the tokens in a row (the code of a token applies when it is the
# target being predicted).
NO_LOSS, CONTEXT, ASSISTANT, SYNTH = 0, 1, 2, 3
CODE_NAMES = {CONTEXT: "context", ASSISTANT: "assistant", SYNTH: "synthetic"}

HELDOUT_TOOL_PERCENT = 22
HELDOUT_ARG_PERCENT = 40
EVAL_SEED_BASE = 1_000_000_007  # eval workflows; training seeds stay below it
MAX_RESULT_CHARS = 3600  # tool results are cut (at a line) to keep windows dense
UNDIRECTED_RATE = 0.25
DESCRIBED_RATE = 0.5  # of directed turns
FULL_TOOLSET_RATE = 0.35
COMPACT_RATE = 0.15  # windows whose system prompt keeps only the intro and the role
TASK_RATE = 0.5  # of example refills: a batch of task episodes (tasks.py) instead of a workflow
TASK_BATCH = 8

PREFIXES = frozenset(p for d in W.DOMAINS.values() for p in d.prefixes)
_WORD = re.compile(r"[A-Za-z0-9_]+")


def tool_core(name: str) -> str:
    head, _, rest = name.partition("_")
    return rest if head in PREFIXES and rest else name


def _all_tool_cores() -> dict[str, set[str]]:
    """core -> every tool name the generator can give it."""
    cores: dict[str, set[str]] = {}
    for domain in W.DOMAINS.values():
        for verb in domain.verbs:
            for noun in domain.nouns:
                core = f"{verb}_{W._plural(noun) if verb in W.PLURAL_VERBS else noun}"
                cores.setdefault(core, set()).update({core, *(f"{p}_{core}" for p in domain.prefixes)})
    for name in W.HANDOFF_NAMES:
        cores.setdefault(name, set()).add(name)
    return cores


def _all_param_names() -> set[str]:
    names = {p for pool in W.SLOT_PARAMS.values() for p in pool}
    names |= set(W.INT_PARAMS) | set(W.BOOL_PARAMS) | set(W.ENUM_PARAMS) | set(W.ARRAY_PARAMS)
    names |= set(W.HANDOFF_AGENT_PARAMS) | set(W.HANDOFF_BRIEF_PARAMS) | {"references", "priority"}
    names |= {f"{noun}_id" for noun in W.ALL_NOUNS}
    return names


@lru_cache(maxsize=1)
def _free_text_words() -> frozenset[str]:
    """Every word the generator writes outside names: message contents, tool
    descriptions, parameter schemas, argument values (a seeded sample of
    workflows of every shape), plus every function-name filler it can mint."""
    words: set[str] = set()
    for seed in range(24):
        for wf in (W.six_turn_workflow(seed), W.thirty_five_turn_workflow(seed + 500),
                   W.interleaved_run(seed + 900, 3)):
            for conv in wf.conversations:
                for tool in conv.tools:
                    fn = tool["function"]
                    words.update(_WORD.findall(fn["description"]))
                    for schema in fn["parameters"]["properties"].values():
                        words.update(_WORD.findall(json.dumps(schema)))
                for m in conv.messages:
                    text = m.get("content") or ""
                    # Hand-off notes quote the planner's tool names; those are rewritten.
                    words.update(_WORD.findall(re.sub(r"(?m)^From [A-Za-z0-9_]+:$", "", text)))
                    for call in m.get("tool_calls") or []:
                        words.update(_WORD.findall(json.dumps(list(json.loads(call["function"]["arguments"]).values()))))
    words |= {f"{v}_{w}" for v in W.FN_VERBS for w in W.WORDS}  # {fn} fillers in code and logs
    words |= set(W.ARG_WORDS) | set(W.SQL_COLUMNS)
    words |= {h for h, _ in W.TABLE_COLUMNS} | {k for k, _ in W.RECORD_FIELDS} | {k for k, _ in W.RECORD_EVENT}
    words |= {f"{noun}_id" for noun in W.ALL_NOUNS}  # table headers
    return frozenset(words)


@dataclass(frozen=True)
class Split:
    """The held-out names. Everything else may appear in training."""

    tools: frozenset[str]  # every held-out tool name (all prefix variants)
    tool_cores: frozenset[str]
    args: frozenset[str]

    def heldout_tool(self, name: str) -> bool:
        return name in self.tools or tool_core(name) in self.tool_cores

    def heldout_arg(self, name: str) -> bool:
        return name in self.args

    @property
    def names(self) -> frozenset[str]:
        return self.tools | self.args

    def leaks(self, text: str) -> list[str]:
        """Held-out names that occur in text as whole words (a word: [A-Za-z0-9_]+)."""
        names = self.names
        return sorted({w for w in _WORD.findall(text) if w in names})

    def scrub(self, text: str, replacement: str = "a tool") -> str:
        names = self.names
        return _WORD.sub(lambda m: replacement if m.group() in names else m.group(), text)

    def as_json(self) -> dict:
        return {"tool_cores": sorted(self.tool_cores), "tools": sorted(self.tools), "args": sorted(self.args),
                "heldout_tool_percent": HELDOUT_TOOL_PERCENT, "heldout_arg_percent": HELDOUT_ARG_PERCENT}

    @staticmethod
    def from_json(data: dict) -> "Split":
        return Split(frozenset(data["tools"]), frozenset(data["tool_cores"]), frozenset(data["args"]))


@lru_cache(maxsize=1)
def default_split() -> Split:
    free = _free_text_words()
    cores = _all_tool_cores()
    held_cores = {c for c, names in cores.items()
                  if not (names & free) and stable_hash("tool:" + c) % 100 < HELDOUT_TOOL_PERCENT}
    held_tools = {n for c in held_cores for n in cores[c]}
    held_args = {a for a in _all_param_names() - free if stable_hash("arg:" + a) % 100 < HELDOUT_ARG_PERCENT}
    held_args |= T.heldout_task_args()
    return Split(frozenset(held_tools), frozenset(held_cores), frozenset(held_args))


# ---------------------------------------------------------------------------
# Conversations: filtering, directives


def _cap_result(text: str, limit: int = MAX_RESULT_CHARS) -> str:
    if len(text) <= limit:
        return text
    cut = text.rfind("\n", 0, limit)
    return text[: cut if cut > limit // 2 else limit] + "\n[... output truncated]"


@dataclass
class Conv:
    """A conversation prepared for windowing: tools, messages, and for each
    assistant message whether it is directed and how."""

    tools: list[dict]
    messages: list[dict]
    directives: dict[int, str] = field(default_factory=dict)  # message index -> directive text


def filter_for_training(conv: W.Conversation, split: Split) -> tuple[list[dict], list[dict]]:
    """Tools and messages of a conversation with every held-out name removed."""
    tools = []
    for tool in conv.tools:
        fn = tool["function"]
        if split.heldout_tool(fn["name"]):
            continue
        tool = copy.deepcopy(tool)
        params = tool["function"]["parameters"]
        params["properties"] = {k: v for k, v in params["properties"].items() if not split.heldout_arg(k)}
        params["required"] = [k for k in params["required"] if not split.heldout_arg(k)]
        tools.append(tool)
    dropped: set[str] = set()
    messages = []
    for m in conv.messages:
        if m["role"] == "tool" and m.get("tool_call_id") in dropped:
            continue
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                fn = call["function"]
                if split.heldout_tool(fn["name"]):
                    dropped.add(call["id"])
                    continue
                args = {k: v for k, v in json.loads(fn["arguments"]).items() if not split.heldout_arg(k)}
                calls.append({**call, "function": {"name": fn["name"], "arguments": json.dumps(args)}})
            if not calls:
                continue  # a call-only turn whose every call was held out
            m["tool_calls"] = calls
        if m.get("content"):
            # Hand-off notes name the planner's tools: "From get_ticket:".
            m["content"] = split.scrub(m["content"])
        messages.append(m)
    return tools, messages


def _describe(tool: dict) -> str:
    text = tool["function"]["description"]
    first = text.split(". ")[0].rstrip(".") + "."
    return first[0].lower() + first[1:]


def _args_text(arguments: str) -> str:
    args = json.loads(arguments)
    if not args:
        return "no arguments"
    return ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in args.items())


def directive(calls: list[dict], tools: list[dict], style: str) -> str:
    """The user message that says what the next tool call is."""
    by_name = {t["function"]["name"]: t for t in tools}
    if style == "described":
        firsts = [_describe(t) for t in tools]
        # A description two offered tools share does not single one out.
        if any(firsts.count(_describe(by_name[c["function"]["name"]])) > 1 for c in calls):
            style = "explicit"
    parts = []
    for c in calls:
        fn = c["function"]
        if style == "described":
            parts.append(f"{_describe(by_name[fn['name']])} Arguments: {_args_text(fn['arguments'])}.")
        else:
            parts.append(f"call {fn['name']} with {_args_text(fn['arguments'])}.")
    if len(parts) == 1:
        return "Next step: " + parts[0]
    return f"Next step: make {len(parts)} calls in parallel: " + " ".join(
        f"({i}) {p}" for i, p in enumerate(parts, 1))


def prepare(tools: list[dict], messages: list[dict], rng: random.Random, undirected_rate: float = UNDIRECTED_RATE,
            described_rate: float = DESCRIBED_RATE) -> Conv:
    """Cap tool results; choose which tool-call turns are directed, and how.
    A directed turn loses its aside text: the directive already says what to do."""
    out = []
    directives = {}
    offered = {t["function"]["name"] for t in tools}
    for m in messages:
        if m["role"] == "tool":
            m = {**m, "content": _cap_result(m["content"])}
        elif m["role"] == "assistant" and m.get("tool_calls"):
            callable_ = all(c["function"]["name"] in offered for c in m["tool_calls"])
            if callable_ and rng.random() >= undirected_rate:
                style = "described" if rng.random() < described_rate else "explicit"
                directives[len(out)] = directive(m["tool_calls"], tools, style)
                m = {**m, "content": None}
        out.append(m)
    return Conv(tools, out, directives)


# ---------------------------------------------------------------------------
# Rendering and tokenizing windows


class Renderer:
    """Windows of prepared conversations -> (token ids, loss codes), with the
    default chat template; segments (one per <|im_start|>) are tokenized once
    per text and cached, since windows of one conversation overlap."""

    def __init__(self, tokenizer: Tokenizer, template: str = CHAT_TEMPLATE):
        self.tok = tokenizer
        self.template = template
        self.im_start = tokenizer.token_to_id("<|im_start|>")
        self.im_end = tokenizer.token_to_id("<|im_end|>")
        self.eot = tokenizer.token_to_id("<|endoftext|>")
        self.assistant_header = tokenizer.encode("<|im_start|>assistant\n")
        self._cache: dict[str, list[int]] = {}

    def reset_cache(self) -> None:
        self._cache.clear()

    def encode(self, text: str) -> list[int]:
        ids = self._cache.get(text)
        if ids is None:
            ids = self.tok.encode(text)
            if len(self._cache) > 4096:
                self._cache.clear()
            self._cache[text] = ids
        return ids

    def render(self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool = False) -> str:
        return render_chat_template(self.template, messages, tools, add_generation_prompt=generation_prompt)

    def tokens(self, messages: list[dict], tools: list[dict] | None) -> tuple[list[int], list[int]]:
        """Token ids and loss codes of a rendered conversation: assistant
        message bodies and their <|im_end|> are ASSISTANT, the rest CONTEXT."""
        text = self.render(messages, tools)
        ids: list[int] = []
        codes: list[int] = []
        for k, seg in enumerate(text.split("<|im_start|>")):
            if not seg:
                continue
            seg_ids = self.encode("<|im_start|>" + seg)
            seg_codes = [CONTEXT] * len(seg_ids)
            h = len(self.assistant_header)
            if seg.startswith("assistant\n") and seg_ids[:h] == self.assistant_header:
                end = len(seg_ids)
                while end > h and seg_ids[end - 1] != self.im_end:
                    end -= 1
                seg_codes[h:end] = [ASSISTANT] * (end - h)
            ids += seg_ids
            codes += seg_codes
        return ids, codes

    def tool_tokens(self, tool: dict) -> int:
        return len(self.encode("\n" + json.dumps(tool, ensure_ascii=False)))


def _calls_of(m: dict) -> list[str]:
    return [c["function"]["name"] for c in m.get("tool_calls") or []]


def compact_system(text: str) -> str:
    """The system prompt without its rule lists: the intro and the role."""
    sections = text.split("\n\n## ")
    return "\n\n## ".join([sections[0]] + [s for s in sections[1:] if s.startswith("Your role")])


def window(conv: Conv, end: int, renderer: Renderer, budget: int, rng: random.Random,
           full_toolset_rate: float = FULL_TOOLSET_RATE, reply: bool = True,
           compact_rate: float = 0.0) -> tuple[list[dict], list[dict]] | None:
    """Messages and tools of one window ending with the assistant message at
    index `end` (included when reply, else the window is its prompt), at most
    `budget` tokens: system + tools + task + most recent messages + directives.
    The system prompt loses its rule lists (compact_rate, or when it would not
    fit otherwise). None when even that does not fit."""
    msgs, tools = conv.messages, conv.tools
    by_name = {t["function"]["name"]: t for t in tools}
    end_calls = _calls_of(msgs[end])
    chosen: set[str] = set(end_calls)
    if rng.random() < full_toolset_rate:
        chosen |= set(by_name)
    else:
        others = [n for n in by_name if n not in chosen]
        chosen |= set(rng.sample(others, rng.randint(0, len(others))))
    tool_cost = {n: renderer.tool_tokens(by_name[n]) for n in by_name}

    def cost_of(i: int) -> int:
        m = msgs[i]
        n = len(renderer.encode(m.get("content") or "")) + 6
        for c in m.get("tool_calls") or []:
            n += len(renderer.encode(c["function"]["arguments"])) + len(renderer.encode(c["function"]["name"])) + 12
        if i in conv.directives:
            n += len(renderer.encode(conv.directives[i])) + 6
        return n

    system = msgs[0]
    overhead = 120 if chosen else 10  # the template's tools section
    needed = cost_of(end) + overhead + sum(tool_cost.get(n, 10**9) for n in set(end_calls))
    if rng.random() < compact_rate or len(renderer.encode(system["content"])) + needed > budget:
        system = {"role": "system", "content": compact_system(system["content"])}
    system_cost = len(renderer.encode(system["content"])) + overhead
    while True:
        used = system_cost + sum(tool_cost[n] for n in chosen if n in tool_cost) + cost_of(end)
        if used > budget:
            # Drop tools not called at the end turn, largest first; give up if none.
            extra = sorted((n for n in chosen if n not in end_calls), key=lambda n: -tool_cost[n])
            if not extra:
                return None
            chosen.discard(extra[0])
            continue
        break
    keep = [end]
    task = 1 if len(msgs) > 1 and msgs[1]["role"] == "user" and end > 1 else None
    if task is not None:
        c = cost_of(task)
        if used + c <= budget:
            used += c
        else:
            task = None
    i = end - 1
    while i > (task if task is not None else 0):
        c = cost_of(i)
        need = [n for n in _calls_of(msgs[i]) if n not in chosen]
        extra = sum(tool_cost.get(n, 10**9) for n in need)
        if used + c + extra > budget:
            break
        chosen |= set(need)
        used += c + extra
        keep.append(i)
        i -= 1
    order = sorted(keep + ([task] if task is not None else []))
    out = [system]
    for j in order:
        if j in conv.directives:
            out.append({"role": "user", "content": conv.directives[j]})
        if j == end and not reply:
            break
        out.append(msgs[j])
    offered = [t for t in tools if t["function"]["name"] in chosen]
    return out, offered


def conversation_examples(conv: Conv, renderer: Renderer, seq_len: int, rng: random.Random,
                          split: Split | None = None, per_conv: float = 1.0,
                          stats: dict | None = None) -> list[tuple[list[int], list[int]]]:
    """Training examples of one prepared conversation: windows ending at a
    sample of its assistant turns, each at most seq_len + 1 tokens."""
    assistant = [i for i, m in enumerate(conv.messages) if m["role"] == "assistant"]
    if not assistant:
        return []
    k = max(1, min(len(assistant), round(per_conv * len(assistant) / 2)))
    ends = sorted(rng.sample(assistant, k))
    out = []
    for end in ends:
        # Mostly shorter windows: more replies per token, cheaper attention.
        budget = seq_len + 1 if rng.random() < 0.35 else rng.randint(min(768, seq_len // 2), seq_len + 1)
        w = window(conv, end, renderer, budget, rng, compact_rate=COMPACT_RATE)
        if w is None:
            continue
        ids, codes = renderer.tokens(*w)
        if len(ids) > seq_len + 1:
            continue  # the estimate fell short: rare, skip
        if split is not None and split.leaks(renderer.tok.decode(ids)):
            if stats is not None:
                stats["guard_dropped"] = stats.get("guard_dropped", 0) + 1
            continue
        out.append((ids, codes))
    return out


# ---------------------------------------------------------------------------
# Synthetic copy documents


class Synth:
    """Short, dense documents whose targets can only be predicted by copying."""

    def __init__(self, tokenizer: Tokenizer, rng: random.Random, split: Split | None = None):
        self.tok = tokenizer
        self.rng = rng
        self.split = split
        vocab = tokenizer.vocab_size
        specials = {tokenizer.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>",
                                                         "</tool_call>", "<tool_response>", "</tool_response>")}
        self.normal = [i for i in range(vocab) if i not in specials]
        self.small_pool = random.Random(7).sample(self.normal, 384)
        glue = {s: tokenizer.encode(s) for s in (" ", ":", ",", "\n", " =", "?", " ->", "|", ";")}
        self.glue = glue

    def _span(self, n: int, pool: list[int]) -> list[int]:
        return [self.rng.choice(pool) for _ in range(n)]

    def repeat(self) -> tuple[list[int], list[int]]:
        pool = self.small_pool if self.rng.random() < 0.5 else self.normal
        span = self._span(self.rng.randint(6, 48), pool)
        sep = self.glue[self.rng.choice(["\n", "|", ";"])]
        ids, codes = span + sep, [NO_LOSS] * (len(span) + len(sep))
        for _ in range(self.rng.choice([1, 1, 2, 3])):  # the span again, once or more
            ids += span + sep
            codes += [SYNTH] * (len(span) + len(sep))
        return ids, codes

    def lookup(self) -> tuple[list[int], list[int]]:
        pool = self.small_pool if self.rng.random() < 0.5 else self.normal
        n = self.rng.randint(2, 12)
        keys = [self._span(self.rng.randint(1, 3), pool) for _ in range(n)]
        vals = [self._span(self.rng.randint(1, 4), pool) for _ in range(n)]
        colon, comma, nl = self.glue[":"], self.glue[","], self.glue["\n"]
        ids, codes = [], []
        for k, v in zip(keys, vals):
            part = k + colon + v + comma
            ids += part
            codes += [NO_LOSS] * len(part)
        ids += nl
        codes += [NO_LOSS] * len(nl)
        for q in self.rng.sample(range(n), self.rng.randint(1, min(4, n))):
            part = keys[q] + self.glue[" ="]
            ids += part + vals[q] + nl
            codes += [NO_LOSS] * len(part) + [SYNTH] * len(vals[q]) + [NO_LOSS] * len(nl)
        return ids, codes

    def _word(self) -> str:
        r = self.rng
        return "".join(r.choice("bcdfghjklmnprstvz") + r.choice("aeiou") for _ in range(r.randint(1, 3)))

    def _value(self) -> object:
        r = self.rng
        kind = r.random()
        if kind < 0.25:
            return f"{self._word()[:3].upper()}-{r.randint(10, 99999)}"
        if kind < 0.45:
            return "/".join(self._word() for _ in range(r.randint(1, 3))) + r.choice([".py", ".md", ".yaml", ".log"])
        if kind < 0.6:
            return f"{r.getrandbits(40):010x}"
        if kind < 0.75:
            return " ".join(self._word() for _ in range(r.randint(2, 5)))
        if kind < 0.87:
            return r.randint(0, 5000)
        if kind < 0.94:
            return r.random() < 0.5
        return [f"{self._word()}-{r.randint(1, 999)}" for _ in range(r.randint(1, 3))]

    def call(self) -> tuple[list[int], list[int]]:
        """k="v" pairs rewritten as the JSON of a tool call."""
        name = "_".join(self._word() for _ in range(self.rng.randint(2, 3)))
        args = {"_".join(self._word() for _ in range(self.rng.randint(1, 2))): self._value()
                for _ in range(self.rng.randint(1, 4))}
        text = _args_text(json.dumps(args))
        prompt = self.tok.encode(f"call {name} with {text}.\n")
        target = self.tok.encode(f'{{"name": "{name}", "arguments": {json.dumps(args)}}}\n')
        return prompt + target, [NO_LOSS] * len(prompt) + [SYNTH] * len(target)

    def document(self) -> tuple[list[int], list[int]]:
        while True:
            r = self.rng.random()
            doc = self.repeat() if r < 0.4 else self.lookup() if r < 0.75 else self.call()
            # Random tokens can spell a held-out name ("body"): draw again.
            if self.split is None or not self.split.leaks(self.tok.decode(doc[0])):
                return doc


# ---------------------------------------------------------------------------
# Rows


def random_workflow(rng: random.Random) -> W.Workflow:
    seed = rng.randrange(EVAL_SEED_BASE)
    r = rng.random()
    if r < 0.4:
        return W.six_turn_workflow(seed)
    if r < 0.7:
        return W.thirty_five_turn_workflow(seed)
    return W.interleaved_run(seed, n_agents=rng.randint(1, 3), turns_per_agent=rng.randint(3, 8))


class RowMaker:
    """Packs training rows of seq_len + 1 tokens (inputs are row[:-1], targets
    row[1:]) with their loss codes (of the targets)."""

    def __init__(self, tokenizer: Tokenizer, seq_len: int, seed: int, split: Split | None = None, pool: int = 12,
                 task_rate: float = TASK_RATE):
        self.rng = random.Random(seed)
        self.task_rate = task_rate
        self.renderer = Renderer(tokenizer)
        self.split = split if split is not None else default_split()
        self.synth = Synth(tokenizer, random.Random(seed + 1), self.split)
        self.seq_len = seq_len
        self.pool_size = pool
        self.pending: list[tuple[list[int], list[int]]] = []
        self.eot = self.renderer.eot
        self.stats = {"examples": 0, "conversations": 0, "guard_dropped": 0}

    def _refill(self) -> None:
        barren = 0
        while len(self.pending) < self.pool_size:
            if barren >= 50:
                raise RuntimeError(f"no training example fits in {self.seq_len} tokens")
            barren += 1
            if self.rng.random() < self.task_rate:
                ex = self._task_examples()
                self.pending += ex
                barren = 0 if ex else barren
                continue
            wf = random_workflow(self.rng)
            self.renderer.reset_cache()
            for conv in wf.conversations:
                tools, messages = filter_for_training(conv, self.split)
                prepared = prepare(tools, messages, self.rng)
                ex = conversation_examples(prepared, self.renderer, self.seq_len, self.rng, self.split,
                                           stats=self.stats)
                self.pending += ex
                barren = 0 if ex else barren
                self.stats["examples"] += len(ex)
                self.stats["conversations"] += 1

    def _task_examples(self) -> list[tuple[list[int], list[int]]]:
        out = []
        for _ in range(TASK_BATCH):
            ep = E.training_episode(self.rng, self.allowed)
            ex = task_example(ep, self.renderer, self.seq_len, self.split, self.stats)
            if ex is not None:
                out.append(ex)
        self.stats["examples"] += len(out)
        self.stats["episodes"] = self.stats.get("episodes", 0) + TASK_BATCH
        return out

    def allowed(self, name: str) -> bool:
        """Whether a task episode may use this tool or argument name in training."""
        return not (self.split.heldout_arg(name) or self.split.heldout_tool(name) or name in T.heldout_task_args())

    def synthetic_row(self) -> tuple[np.ndarray, np.ndarray]:
        ids, codes = [], []
        self._fill(ids, codes)
        return np.asarray(ids, np.int32), np.asarray(codes, np.uint8)

    def _fill(self, ids: list[int], codes: list[int]) -> None:
        n = self.seq_len + 1
        while len(ids) < n:
            d_ids, d_codes = self.synth.document()
            ids += [self.eot] + d_ids
            codes += [NO_LOSS] + d_codes
        del ids[n:], codes[n:]

    def transcript_row(self) -> tuple[np.ndarray, np.ndarray]:
        n = self.seq_len + 1
        ids: list[int] = []
        codes: list[int] = []
        while True:
            self._refill()
            room = n - len(ids) - (1 if ids else 0)
            fits = [k for k, (e, _) in enumerate(self.pending) if len(e) <= room]
            if not fits:
                break
            k = max(fits, key=lambda k: len(self.pending[k][0]))
            e_ids, e_codes = self.pending.pop(k)
            if ids:
                ids.append(self.eot)
                codes.append(NO_LOSS)
            ids += e_ids
            codes += e_codes
            if n - len(ids) < 48:
                break
        self._fill(ids, codes)
        # The first target of a row follows nothing it could be predicted from.
        return np.asarray(ids, np.int32), np.asarray(codes, np.uint8)

    def row(self, p_synthetic: float) -> tuple[np.ndarray, np.ndarray]:
        if self.rng.random() < p_synthetic:
            return self.synthetic_row()
        return self.transcript_row()


# ---------------------------------------------------------------------------
# Held-out evaluation turns


@dataclass
class EvalTurn:
    messages: list[dict]  # system, window, directive
    tools: list[dict]
    reference: list[dict]  # [{"name", "arguments": dict}]; [] when the reference is a text answer
    reply_text: str  # the reference reply as the template renders it (without <|im_end|>)
    style: str  # explicit | described (workflow turns); a value placement or "none" (task episodes)
    heldout_args: int  # argument names of the calls that are held out
    seed: int
    agent: str
    kind: str = "call"  # one of experiments/default_model/episodes.py KINDS
    answer_values: list[str] = field(default_factory=list)  # what a text answer must quote
    source: str = "workflow"  # workflow | task | alt (the generator)

    def as_json(self) -> dict:
        return {"style": self.style, "seed": self.seed, "agent": self.agent, "reference": self.reference,
                "heldout_args": self.heldout_args, "kind": self.kind, "answer_values": self.answer_values,
                "source": self.source}


def eval_turns(n: int, renderer: Renderer, seq_len: int, split: Split | None = None, max_reply: int = 256,
               seed_base: int = EVAL_SEED_BASE) -> list[EvalTurn]:
    """n held-out tool-call turns (every call to a held-out tool), from
    workflows no training run draws, directed alternately in the explicit and
    the described style; at most two per conversation."""
    split = split if split is not None else default_split()
    out: list[EvalTurn] = []
    k = 0
    while len(out) < n and k < 40 * n + 100:
        seed = seed_base + k
        shapes = (W.six_turn_workflow, W.thirty_five_turn_workflow, lambda s: W.interleaved_run(s, 2, 6))
        wf = shapes[k % 3](seed)
        k += 1
        for conv in wf.conversations:
            rng = random.Random(f"{seed}:{conv.agent}")
            prepared = prepare(conv.tools, conv.messages, rng)
            taken = 0
            for end, m in enumerate(prepared.messages):
                calls = m.get("tool_calls") or []
                if m["role"] != "assistant" or not calls or taken >= 2 or len(out) >= n:
                    continue
                if not all(split.heldout_tool(c["function"]["name"]) for c in calls):
                    continue
                style = "explicit" if len(out) % 2 == 0 else "described"
                text = directive(calls, conv.tools, style)
                style = "described" if "Arguments:" in text else "explicit"
                prepared.directives[end] = text
                prepared.messages[end] = m = {**m, "content": None}
                # Every offered tool that fits: the realistic, harder choice.
                w = window(prepared, end, renderer, seq_len - max_reply, rng, full_toolset_rate=1.0, reply=False)
                if w is None:
                    continue
                messages, tools = w
                reference = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                             for c in calls]
                reply = renderer.render(messages + [m], tools)[len(renderer.render(messages, tools, True)):]
                reply = reply.removesuffix("\n").removesuffix("<|im_end|>")
                held = sum(split.heldout_arg(a) for r in reference for a in r["arguments"])
                out.append(EvalTurn(messages, tools, reference, reply, style, held, seed, conv.agent))
                taken += 1
    return out


def load_split(model_dir: str | Path | None) -> Split:
    """The split a model was trained with (from its train_log.json), else the default."""
    if model_dir is not None:
        log = Path(model_dir) / "train_log.json"
        if log.is_file():
            data = json.loads(log.read_text())
            if "split" in data:
                return Split.from_json(data["split"])
    return default_split()


# ---------------------------------------------------------------------------
# Task episodes (experiments/default_model/tasks.py) as training examples and eval turns


def task_example(ep: T.Episode, renderer: Renderer, seq_len: int, split: Split | None = None,
                 stats: dict | None = None) -> tuple[list[int], list[int]] | None:
    """Token ids and loss codes of a whole episode (every assistant message
    trained), or None when it is too long or shows a held-out name."""
    ids, codes = renderer.tokens(ep.messages, ep.tools or None)
    if len(ids) > seq_len + 1:
        return None
    if split is not None and split.leaks(renderer.tok.decode(ids)):
        if stats is not None:
            stats["guard_dropped"] = stats.get("guard_dropped", 0) + 1
        return None
    return ids, codes


def episode_turn(ep: T.Episode, renderer: Renderer, seed: int, source: str) -> EvalTurn:
    """The scored (last) assistant message of an episode as an eval turn."""
    prompt, tools = ep.prompt, ep.tools or None
    reply = renderer.render(ep.messages, tools)[len(renderer.render(prompt, tools, True)):]
    reply = reply.removesuffix("\n").removesuffix("<|im_end|>")
    agent = prompt[0]["content"][:40] if prompt and prompt[0]["role"] == "system" else ""
    return EvalTurn(prompt, ep.tools, ep.reference(), reply, ep.placement, ep.heldout_args, seed, agent,
                    ep.kind, list(ep.answer_values), source)


TASK_EVAL_SEED = EVAL_SEED_BASE + 77_777
# New kinds go last: the earlier kinds keep their draws (and their figures stay comparable).
TASK_EVAL_COUNTS = {"call": 80, "answer": 30, "no_tool": 10, "plain": 15, "handoff": 16, "unfit": 20, "parallel": 16,
                    "function": 40, "function_parallel": 12, "function_unfit": 20}


def task_eval_turns(renderer: Renderer, seq_len: int, split: Split | None = None,
                    counts: dict[str, int] | None = None, max_reply: int = 256) -> list[EvalTurn]:
    """Held-out task turns (seeds no training run draws): calls half with
    held-out argument names, answers, no-tool, plain-text and hand-off turns."""
    split = split if split is not None else default_split()
    heldout = frozenset(split.args | T.heldout_task_args())

    def train_ok(name: str) -> bool:
        return not (name in heldout or split.heldout_tool(name))

    eps = E.eval_episodes(TASK_EVAL_SEED, counts or TASK_EVAL_COUNTS, train_ok, heldout)
    out = []
    for k, ep in enumerate(eps):
        if len(renderer.tok.encode(renderer.render(ep.prompt, ep.tools or None, True))) + max_reply > seq_len:
            continue
        out.append(episode_turn(ep, renderer, TASK_EVAL_SEED + k, "task"))
    return out
