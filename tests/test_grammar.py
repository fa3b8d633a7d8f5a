"""Grammar-constrained decoding through the engine, on the default model's
tokenizer and shape with random weights (which write nonsense unconstrained):
every constrained reply parses and validates, speculation changes nothing,
and bad options change nothing."""
import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
import torch

from agentkv import Engine, InvalidRequestError
from agentkv.engine.grammar import GrammarCache, GrammarError, GrammarState
from agentkv.engine.structured import request_grammar
from agentkv.model.default import random_init
from agentkv.model.tool_calls import parse_tool_calls
from agentkv.model.default import SMALL_MODEL_DIR
from tests.test_speculation import FixedDrafter

TOOLS = [
    {"type": "function", "function": {"name": "read_file", "parameters": {
        "type": "object", "required": ["path"],
        "properties": {"path": {"type": "string", "maxLength": 16}, "start": {"type": "integer", "minimum": 1, "maximum": 500}}}}},
    {"type": "function", "function": {"name": "set_mode", "parameters": {
        "type": "object", "required": ["mode", "dry_run"],
        "properties": {"mode": {"enum": ["fast", "safe"]}, "dry_run": {"type": "boolean"},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}}}}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ANSWER = {"type": "object", "required": ["answer", "ok"], "properties": {
    "answer": {"type": "string", "pattern": "^[a-z ]{1,10}$"}, "score": {"type": "integer", "minimum": 0, "maximum": 9},
    "ok": {"type": "boolean"}}}
CALL = '<tool_call>\n{"name": "read_file", "arguments": {"path": "src/app.py", "start": 12}}\n</tool_call>'


@pytest.fixture(scope="module")
def engine():
    eng = Engine.from_pretrained(SMALL_MODEL_DIR, num_pages=512)
    random_init(eng.model, 0)
    return eng


def user(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Task {i}: look at file_{i}.py and set the mode."}]


@pytest.mark.parametrize("parallel", [False, True])
def test_required_yields_a_valid_call_on_every_prompt(engine, parallel):
    names = set()
    for i in range(10):
        r = engine.chat(user(i), tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel,
                        max_tokens=200, temperature=1.0, seed=i)
        assert r.finish_reason == "tool_calls" and r.tool_calls and r.text == ""
        assert parallel or len(r.tool_calls) == 1
        for call in r.tool_calls:
            jsonschema.validate(call["arguments"], SCHEMAS[call["name"]])
            names.add(call["name"])
    assert len(names) > 1  # sampling explores: not one memorised call


def test_named_tool_is_the_one_called(engine):
    for i in range(4):
        r = engine.chat(user(i), tools=TOOLS, tool_choice={"type": "function", "function": {"name": "read_file"}},
                        max_tokens=200, temperature=1.0, seed=i)
        assert [c["name"] for c in r.tool_calls] == ["read_file"]
        jsonschema.validate(r.tool_calls[0]["arguments"], SCHEMAS["read_file"])


def test_json_schema_replies_validate(engine):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    for i in range(6):
        r = engine.chat(user(i), response_format=fmt, max_tokens=120, temperature=1.0, seed=i)
        assert r.finish_reason == "stop"
        jsonschema.validate(json.loads(r.text), ANSWER)


def test_json_object_admits_objects_only(engine):
    g = request_grammar(engine, response_format={"type": "json_object"})
    tok = engine.tokenizer
    obj, arr = GrammarState(g), GrammarState(g)
    assert all(obj.accept(t) for t in tok.encode('{"a": [1, {"b": null}]}') + engine.eos_token_ids[:1])
    assert obj.terminated
    assert not arr.accept(tok.encode("[1]")[0])


def test_grammar_end_stops_the_reply_even_with_ignore_eos(engine):
    r = engine.chat(user(0), tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=300,
                    ignore_eos=True, temperature=1.0, seed=3)
    assert r.finish_reason == "tool_calls" and len(r.tool_calls) == 1
    assert r.token_ids[-1] in engine.eos_token_ids and r.usage["completion_tokens"] < 300


def test_auto_constrains_only_an_opened_call(engine):
    g = request_grammar(engine, tools=TOOLS, tool_choice="auto")
    tok, state = engine.tokenizer, GrammarState(g)
    rows = torch.zeros(1, engine.model.cfg.vocab_size)
    free = torch.isfinite(state.masked(rows, [])[0])
    assert free[tok.encode(" hello")[0]] and free[tok.encode("<tool_call>")[0]]
    assert all(state.accept(t) for t in tok.encode('Sure. <tool_call>\n{"name": "'))
    opened = torch.isfinite(state.masked(rows, [])[0])
    assert not opened[tok.encode(" hello")[0]] and opened[tok.encode("read")[0]]
    assert not state.accept(tok.encode("delete")[0])  # no such tool


def test_auto_is_free_when_the_engine_does_not_constrain_it(engine):
    engine.constrain_auto = False
    try:
        assert request_grammar(engine, tools=TOOLS, tool_choice="auto") is None
        assert request_grammar(engine, tools=TOOLS) is None
        # What the request asks for explicitly is still enforced, and bad options still refused.
        assert request_grammar(engine, tools=TOOLS, tool_choice="required") is not None
        assert request_grammar(engine, tools=TOOLS, response_format={"type": "json_object"}) is not None
        with pytest.raises(GrammarError):
            request_grammar(engine, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    finally:
        engine.constrain_auto = True


def test_a_35_turn_loop_compiles_its_tools_once(engine):
    tools = TOOLS + [{"type": "function", "function": {"name": "only_in_this_loop"}}]
    before = engine.grammars.compiles
    # Each turn sends its tools afresh: equal, never the same objects.
    grammars = {id(request_grammar(engine, json.loads(json.dumps(tools)), "required")) for _ in range(35)}
    assert len(grammars) == 1 and engine.grammars.compiles == before + 1


def test_tenants_share_no_compiled_grammar_and_one_compile_serves_concurrent_requests(engine):
    # Issue 42: one cache for all tenants, compiled under its lock: a tenant
    # cycling schemas evicted the others' grammars, and its slow compiles
    # held up every tenant's requests.
    cache = GrammarCache(engine.tokenizer, engine.model.cfg.vocab_size, engine.eos_token_ids, capacity=2)
    tags = [{"type": "structural_tag", "format": {"type": "json_schema", "json_schema": {
        "type": "object", "properties": {f"k{i}": {"type": "integer"}}}}} for i in range(4)]
    mine = cache.get(tags[0], "alice")
    for tag in tags[1:]:
        cache.get(tag, "mallory")  # mallory fills its own cache, twice over
    compiles = cache.compiles
    assert cache.get(tags[0], "alice") is mine and cache.compiles == compiles  # alice's is still there
    assert cache.get(tags[0], "mallory") is not mine and cache.compiles == compiles + 1
    # Requests that want one grammar at once: a single compile, the same grammar for all.
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda _: cache.get(tags[3], "bob"), range(8)))
    assert len({id(g) for g in got}) == 1 and cache.compiles == compiles + 2
    bad = {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": {"type": "no-such-type"}}}
    for _ in range(2):  # a failed compile leaves nothing behind: the next asks again and fails the same
        with pytest.raises(GrammarError):
            cache.get(bad, "bob")


def prompt_with_calls(engine) -> list[int]:
    """A history of earlier calls: the drafter finds the call syntax and
    argument spans to copy, and the random model often writes otherwise."""
    history = user(1) + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": f"c{i}", "type": "function", "function": {
            "name": "read_file", "arguments": json.dumps({"path": f"src/m{i}.py", "start": 10 * i + 1})}}]}
        for i in range(3)
    ]
    return engine.tokenizer.apply_chat_template(history, tools=TOOLS)


def constrained(engine, prompt, speculative, drafter=None, **sampling):
    g = request_grammar(engine, TOOLS, "required", parallel_tool_calls=False)
    with engine.session() as s:
        s.append(prompt)
        if drafter is not None:
            s.use_drafter(drafter)
        out = s.generate(max_tokens=120, speculative=speculative, grammar=g, **sampling)
        # The newest token is held, not computed; the KV of rejected drafts is gone.
        assert s.table.length == len(s) - 1 and len(s.table.pages) == -(-s.table.length // engine.pool.page_size)
    return out, engine.stats[-1]


def replays(engine, out: list[int]) -> bool:
    """The output is a whole sentence of the grammar, token by token."""
    state = GrammarState(request_grammar(engine, TOOLS, "required", parallel_tool_calls=False))
    return all(state.accept(t) for t in out) and state.terminated


def test_speculation_gives_identical_constrained_greedy_output(engine):
    prompt = prompt_with_calls(engine)
    plain, _ = constrained(engine, prompt, speculative=False)
    spec, turn = constrained(engine, prompt, speculative=True)
    assert spec == plain and replays(engine, spec)
    assert turn.drafted_tokens > turn.accepted_tokens > 0  # drafts were made, some accepted, some rejected


def test_what_the_grammar_forces_is_drafted_and_output_stays_identical(engine):
    """With prompt lookup finding nothing, the drafts are what the grammar
    forces alone (a call's syntax, the tool's name once begun, required keys)."""
    prompt = engine.tokenizer.apply_chat_template(user(1), tools=TOOLS)
    plain, _ = constrained(engine, prompt, speculative=False)
    spec, turn = constrained(engine, prompt, speculative=True, drafter=FixedDrafter([]))
    assert spec == plain and replays(engine, spec)
    assert turn.drafted_tokens == turn.forced_tokens > 0 and turn.forced_accepted > 0
    assert turn.decode_steps < len(plain)  # forced tokens took no decode step of their own


def test_a_draft_the_grammar_forbids_ends_there(engine):
    prompt = prompt_with_calls(engine)
    plain, _ = constrained(engine, prompt, speculative=False)
    # The first tokens of the true reply, then a token the grammar never allows there.
    bad = engine.tokenizer.encode("delete")[0]
    drafter = FixedDrafter(plain[1:3] + [bad] + plain[3:6])
    spec, turn = constrained(engine, prompt, speculative=True, drafter=drafter)
    assert spec == plain and replays(engine, spec)
    # Never past the forbidden token (what the grammar forced drafts on its own, ahead of the drafter's).
    assert turn.verify_steps and turn.drafted_tokens - turn.forced_tokens <= 2 * turn.verify_steps


def test_sampling_with_speculation_stays_in_the_grammar(engine):
    prompt = prompt_with_calls(engine)
    out, turn = constrained(engine, prompt, speculative=True, temperature=1.0, seed=11)
    assert turn.drafted_tokens and replays(engine, out)


def test_masks_leave_the_matcher_where_it_was(engine):
    state = GrammarState(request_grammar(engine, TOOLS, "required"))
    ids = engine.tokenizer.encode(CALL)
    rows = torch.randn(4, engine.model.cfg.vocab_size)
    assert state.accept(ids[0])
    before = state.masked(rows[:1], [])
    assert state.clip(ids[1:4] + engine.tokenizer.encode("delete")) == ids[1:4]
    state.masked(rows, ids[1:4])
    assert torch.equal(state.masked(rows[:1], []), before)
    assert all(state.accept(t) for t in ids[1:])


@pytest.mark.parametrize("options", [
    {"tool_choice": {"type": "function", "function": {"name": "rm_rf"}}},
    {"tool_choice": "sometimes"},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "banana"}}}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/defs/nowhere"}}}},
    {"response_format": {"type": "xml"}},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "p": {"type": "string", "pattern": "(("}}}}}], "tool_choice": "required"},
])
def test_bad_options_are_refused_and_change_nothing(engine, options):
    s = engine.session()
    engine.chat(user(0), session=s, max_tokens=3)
    tokens, length, free = s.tokens, s.table.length, engine.pool.num_free
    kwargs = {"tools": TOOLS, **options}
    with pytest.raises(GrammarError) as e:
        engine.chat(user(0) + [{"role": "user", "content": "again"}], session=s, max_tokens=3, **kwargs)
    assert isinstance(e.value, InvalidRequestError) and "[" not in str(e.value)[:1]
    assert s.tokens == tokens and s.table.length == length and engine.pool.num_free == free
    s.close()


@pytest.mark.parametrize("value", ["a\tb", "</tool_call>"])
def test_strings_a_grammar_admits_still_parse_as_a_call(value):
    """A raw tab (xgrammar admits one into a length-bounded string) or a closing tag inside a string."""
    block = '<tool_call>\n{"name": "read_file", "arguments": {"path": "%s"}}\n</tool_call>' % value
    content, calls = parse_tool_calls("Reading.\n" + block + "\nDone.")
    assert [c["arguments"] for c in calls] == [{"path": value}] and content == "Reading.\nDone."


def test_responses_api_shapes_give_the_same_grammars(engine):
    flat = [{"type": "function", **t["function"]} for t in TOOLS]
    assert request_grammar(engine, flat, "required") is request_grammar(engine, TOOLS, "required")
    named = request_grammar(engine, flat, {"type": "function", "name": "ping"})
    assert named is request_grammar(engine, TOOLS, {"type": "function", "function": {"name": "ping"}})
    text_format = {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}
    chat_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    assert request_grammar(engine, response_format=text_format) is request_grammar(engine, response_format=chat_format)
    assert request_grammar(engine, flat, "none") is None
