"""Engine.chat: a re-sent history pays only for what changed."""
import pytest

from agentkv import Engine, InvalidRequestError
from agentkv.cache.tokens import common_prefix_len
from agentkv.engine.session import Session
from agentkv.model.default import SMALL_MODEL_DIR
from tests.conftest import assert_all_pages_free

SYSTEM = "You are a careful agent. Use the tools to inspect the repository before answering."
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(SMALL_MODEL_DIR, num_pages=512)


def history(middle: str) -> list[dict]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Find where the config is loaded."},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "read_file", "arguments": '{"path": "src/config.py"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": middle},
        {"role": "user", "content": "Now summarise it."},
    ]


def test_second_turn_computes_only_the_delta(engine):
    s = engine.session()
    first = history("def load(path): return json.load(open(path))")[:4]
    r1 = engine.chat(first, tools=TOOLS, session=s, max_tokens=5, ignore_eos=True)
    assert r1.usage["cached_tokens"] == 0
    held = s.tokens
    second = history("def load(path): return json.load(open(path))")
    r2 = engine.chat(second, tools=TOOLS, session=s, max_tokens=5, ignore_eos=True)
    prompt = engine.tokenizer.apply_chat_template(second, tools=TOOLS)
    lcp = common_prefix_len(held, prompt)
    assert r2.usage["cached_tokens"] == lcp > len(engine.tokenizer.apply_chat_template(first, tools=TOOLS)) - 5
    assert r2.usage["computed_tokens"] == len(prompt) - lcp
    s.close()


def test_edited_middle_recomputes_from_the_first_difference_and_no_earlier(engine):
    s = engine.session()
    original = history("x = 1\n" * 20)
    engine.chat(original, tools=TOOLS, session=s, max_tokens=4, ignore_eos=True)
    held = s.tokens
    edited = history("x = 1\n" * 10 + "y = 2\n" + "x = 1\n" * 9)
    r = engine.chat(edited, tools=TOOLS, session=s, max_tokens=4, ignore_eos=True)
    prompt = engine.tokenizer.apply_chat_template(edited, tools=TOOLS)
    first_diff = common_prefix_len(held, prompt)
    assert first_diff < len(engine.tokenizer.apply_chat_template(original, tools=TOOLS))
    assert r.usage["cached_tokens"] == first_diff
    assert r.usage["computed_tokens"] == len(prompt) - first_diff
    # And the answer is the one a fresh conversation gets.
    fresh = Engine(engine.model, engine.tokenizer, num_pages=512, prefix_cache=False)
    assert fresh.chat(edited, tools=TOOLS, max_tokens=4, ignore_eos=True).token_ids == r.token_ids
    s.close()


def test_stateless_mode_recomputes_everything(engine):
    stateless = Engine(engine.model, engine.tokenizer, num_pages=512, stateless=True)
    s = stateless.session()
    msgs = history("pass")
    stateless.chat(msgs, tools=TOOLS, session=s, max_tokens=3, ignore_eos=True)
    r = stateless.chat(msgs, tools=TOOLS, session=s, max_tokens=3, ignore_eos=True)
    assert r.usage["cached_tokens"] == 0 and r.usage["computed_tokens"] == r.usage["prompt_tokens"]
    assert len(s) == 0
    s.close()
    assert_all_pages_free(stateless)


def test_tool_calls_are_parsed_from_the_reply(engine, monkeypatch):
    reply = engine.tokenizer.encode('<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>')
    original = Session.start_generate

    def scripted(self, **kwargs):
        req = original(self, **{**kwargs, "max_tokens": 1})  # keep the session's bookkeeping real
        engine.scheduler.wait(req)
        self.truncate(len(self) - 1)
        self.queue(reply)
        req.output = list(reply)
        return req

    monkeypatch.setattr(Session, "start_generate", scripted)
    r = engine.chat(history("pass"), tools=TOOLS, max_tokens=64)
    assert r.finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in r.tool_calls] == [("read_file", {"path": "a.py"})]
    assert r.tool_calls[0]["id"].startswith("call_")


def test_failed_chat_leaves_the_session_as_it_was(engine):
    s = engine.session()
    engine.chat(history("pass"), tools=TOOLS, session=s, max_tokens=3, ignore_eos=True)
    before = (s.tokens, list(s.table.pages), s.table.length)
    with pytest.raises(InvalidRequestError):
        engine.chat(history("pass"), tools=TOOLS, session=s, max_tokens=0)
    assert (s.tokens, list(s.table.pages), s.table.length) == before
    s.close()
