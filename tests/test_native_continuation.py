"""Native continuation (engine.turn, engine.message_log) on the
embedded default model: a chat turn on a session whose messages begin with
the logged conversation renders and computes only its new messages and
continues from the reply as the model sampled it, even where re-tokenizing
that reply gives other tokens; the result is what a fresh prefill of the
same tokens gives. Template-faithful mode and any mismatch (an edited
history, a truncated session) re-render and reuse only up to the first
differing token."""
from __future__ import annotations

import json
import time

import pytest
import torch
from fastapi.testclient import TestClient

from agentkv import Engine
from agentkv.engine.api import create_app
from agentkv.engine.structured import request_grammar
from agentkv.model.chat_suffix import render_suffix
from agentkv.model.default import SMALL_MODEL_DIR

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CITIES = ["Oslo", "Lima", "Baku", "Nuuk", "Kyiv", "Cairo"]


def ask(city: str) -> dict:
    return {"role": "user", "content": f'Next step: call get_weather with city="{city}".'}


def echo(result) -> dict:
    """The reply as an OpenAI client sends it back (arguments as a JSON string)."""
    calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
             for c in result.tool_calls]
    return {"role": "assistant", "content": result.text or None, "tool_calls": calls or None}


def tool_result(city: str) -> dict:
    return {"role": "tool", "tool_call_id": "call_x", "content": json.dumps({"city": city, "temp_c": len(city)})}


@pytest.fixture(scope="module")
def engines() -> dict[str, Engine]:
    native = Engine.from_pretrained(SMALL_MODEL_DIR, num_pages=1024)
    return {"native": native, "template-faithful": Engine(native.model, native.tokenizer, num_pages=1024,
                                                          continuation="template-faithful")}


def turn(engine: Engine, session, messages: list[dict]):
    return engine.chat(messages, TOOLS, session=session, max_tokens=48, temperature=0.0)


def called(engine: Engine, session, city: str) -> list[dict]:
    """A first turn that calls get_weather, then its result: the next turn's messages."""
    messages = [ask(city)]
    return messages + [echo(turn(engine, session, messages)), tool_result(city)]


def fresh_reply(engine: Engine, prompt: list[int]) -> list[int]:
    """The greedy reply of a fresh session prefilled with prompt, under the grammar a chat turn with TOOLS has."""
    with engine.session() as fresh:
        fresh.queue(prompt)
        return fresh.generate(48, temperature=0.0, grammar=request_grammar(engine, TOOLS, None, None, True))


def assert_as_a_fresh_prefill(engine: Engine, session, prompt: list[int], reply: list[int]) -> None:
    """The session's own KV, read back at the prompt's end, gives the logits a
    fresh prefill of the prompt gives, and the reply is that prefill's."""
    with engine.session() as fresh:
        want = fresh.append(prompt)
    with session.fork() as again:
        again.truncate(len(prompt) - 1)
        assert torch.equal(again.append(prompt[-1:]), want)
    assert reply == fresh_reply(engine, prompt)


def test_native_continuation_computes_only_the_new_messages(engines):
    engine = engines["native"]
    with engine.session() as s:
        messages = [ask("Oslo")]
        first = turn(engine, s, messages)
        assert first.tool_calls and s.message_log is not None
        held = s.message_log.length  # the reply's end; past it, the pre-positioned opening of the tool result
        messages += [echo(first), tool_result("Oslo")]
        second = turn(engine, s, messages)
        u = second.usage
        assert u["native"]
        prompt = s.tokens[: u["prompt_tokens"]]
        # The case this is about: the reply as sampled is not how the tokenizer spells its text.
        full = engine.tokenizer.apply_chat_template(messages, tools=TOOLS)
        assert prompt != full and engine.tokenizer.decode(prompt) == engine.tokenizer.decode(full)
        # Everything held was reused; computed: the new messages, and the reply's last
        # token, whose KV no step had computed yet (no loop ran to pre-position them).
        assert u["cached_tokens"] == held - 1 and u["computed_tokens"] == u["prompt_tokens"] - held + 1
        assert_as_a_fresh_prefill(engine, s, prompt, second.token_ids)


def test_a_reply_cut_by_max_tokens_continues_natively(engines):
    engine = engines["native"]
    with engine.session() as s:
        messages = [ask("Lima")]
        cut = engine.chat(messages, TOOLS, session=s, max_tokens=5, temperature=0.0)
        assert cut.finish_reason == "length" and s.message_log is not None
        held = len(s)
        messages += [{"role": "assistant", "content": cut.text}, {"role": "user", "content": "Go on."}]
        second = turn(engine, s, messages)
        assert second.usage["native"] and second.usage["cached_tokens"] == held - 1
        prompt = s.tokens[: second.usage["prompt_tokens"]]
        # The template's end of the cut reply's message, then the new message.
        assert engine.tokenizer.decode(prompt[held:]).startswith("<|im_end|>\n<|im_start|>user\nGo on.")
        assert second.token_ids == fresh_reply(engine, prompt)


@pytest.fixture
def serving(engines):
    """The native engine with its scheduler loop running (idle steps pre-position)."""
    engine = engines["native"]
    engine.scheduler.start()
    try:
        yield engine
    finally:
        engine.scheduler.stop()


def wait_prepositioned(engine: Engine, before: int) -> int:
    for _ in range(500):
        if engine.scheduler.counters.prepositioned_tokens > before:
            return engine.scheduler.counters.prepositioned_tokens - before
        time.sleep(0.01)
    raise AssertionError("nothing was pre-positioned")


def test_the_tool_results_opening_is_computed_while_idle_and_kept(serving):
    engine = serving
    with engine.session() as s:
        messages = [ask("Nuuk")]
        before = engine.scheduler.counters.prepositioned_tokens
        first = turn(engine, s, messages)
        log = s.message_log
        assert first.tool_calls and log.prepositioned
        assert engine.tokenizer.decode(list(log.prepositioned)) == "\n<|im_start|>user\n<tool_response>"
        # The reply's last token and the opening: computed while the tool "runs".
        assert wait_prepositioned(engine, before) == len(log.prepositioned) + 1
        assert s.table.length == len(s) == log.length + len(log.prepositioned)
        messages += [echo(first), tool_result("Nuuk")]
        second = turn(engine, s, messages)
        u = second.usage
        assert u["native"] and u["cached_tokens"] == log.length + len(log.prepositioned)
        prompt = s.tokens[: u["prompt_tokens"]]
        assert_as_a_fresh_prefill(engine, s, prompt, second.token_ids)


def test_prepositioned_tokens_roll_back_when_the_turn_begins_otherwise(serving):
    engine = serving
    with engine.session() as s:
        messages = [ask("Baku")]
        before = engine.scheduler.counters.prepositioned_tokens
        first = turn(engine, s, messages)
        log = s.message_log
        wait_prepositioned(engine, before)
        messages += [echo(first), {"role": "user", "content": "Never mind, no tool."}]
        second = turn(engine, s, messages)
        u = second.usage
        assert u["native"]
        prompt = s.tokens[: u["prompt_tokens"]]
        new = engine.tokenizer.encode(log.gap + render_suffix(engine.tokenizer, messages, len(log.digests), TOOLS))
        assert prompt == s.tokens[: log.length] + new  # nothing of the opening that it does not begin with
        kept = next(i for i, (a, b) in enumerate(zip(new, log.prepositioned)) if a != b)
        assert 0 < kept < len(log.prepositioned) and u["cached_tokens"] == log.length + kept
        engine.pool.check()
        assert second.token_ids == fresh_reply(engine, prompt)


def test_template_faithful_reproduces_a_full_render(engines):
    engine = engines["template-faithful"]
    with engine.session() as s:
        messages = called(engine, s, "Lima")
        second = turn(engine, s, messages)
        assert not second.usage["native"] and s.message_log is None
        full = engine.tokenizer.apply_chat_template(messages, tools=TOOLS)
        assert s.tokens[: second.usage["prompt_tokens"]] == full
        assert second.token_ids == fresh_reply(engine, full)


def test_an_edited_history_falls_back_to_reuse_up_to_the_edit(engines):
    engine = engines["native"]
    with engine.session() as s:
        messages = called(engine, s, "Baku")
        messages += [echo(turn(engine, s, messages)), ask("Nuuk")]
        assert s.message_log is not None
        held = s.tokens
        edited = [{"role": "user", "content": 'Next step: call get_weather with city="Bern".'}] + messages[1:]
        third = turn(engine, s, edited)
        assert not third.usage["native"]
        full = engine.tokenizer.apply_chat_template(edited, tools=TOOLS)
        assert s.tokens[: third.usage["prompt_tokens"]] == full
        edit_at = next(i for i, (a, b) in enumerate(zip(held, full)) if a != b)
        assert third.usage["cached_tokens"] <= edit_at
        assert third.token_ids == fresh_reply(engine, full)


def test_a_truncated_session_forgets_its_log(engines):
    engine = engines["native"]
    with engine.session() as s:
        messages = called(engine, s, "Kyiv")
        s.truncate(len(s) - 3)
        assert s.message_log is None
        second = turn(engine, s, messages)
        assert not second.usage["native"]
        assert s.tokens[: second.usage["prompt_tokens"]] == engine.tokenizer.apply_chat_template(messages, tools=TOOLS)


def test_native_turns_render_only_the_new_messages(engines, monkeypatch):
    """Host work per turn does not grow with the history: each render is of
    the conversation's head, the last held message and the new ones."""
    engine = engines["native"]
    tok = engine.tokenizer
    rendered: list[int] = []
    original = type(tok).apply_chat_template

    def counting(self, messages, *args, **kwargs):
        rendered.append(len(messages))
        return original(self, messages, *args, **kwargs)

    with engine.session() as s:
        messages = [{"role": "system", "content": "You are a weather agent."}, ask(CITIES[0])]
        first = turn(engine, s, messages)
        monkeypatch.setattr(type(tok), "apply_chat_template", counting)
        for city, nxt in zip(CITIES, CITIES[1:]):
            messages += [echo(first), tool_result(city), ask(nxt)]
            rendered.clear()
            first = turn(engine, s, messages)
            assert first.usage["native"], city
            # The head (system, first user), the last held message, the three new ones.
            assert max(rendered) <= 2 + 1 + 3
        assert len(messages) == 2 + 3 * (len(CITIES) - 1)


def test_chat_completions_continue_natively_over_http(engines):
    engine = engines["native"]
    with TestClient(create_app(engine, "agentkv-native")) as client:
        messages, last = [ask("Cairo")], None
        for city in ("Cairo", "Oslo"):
            r = client.post("/v1/chat/completions", json={
                "model": "agentkv-native", "messages": messages, "tools": TOOLS, "max_tokens": 48,
                "temperature": 0.0, "session_id": "native-http"}).json()
            usage = r["usage"]
            if last is not None:
                # All of the previous turn reused (its last token too, and the tool
                # result's opening, if the idle scheduler pre-positioned them).
                cached = usage["prompt_tokens_details"]["cached_tokens"]
                assert last["total_tokens"] - 1 <= cached < usage["prompt_tokens"]
            last = usage
            message = r["choices"][0]["message"]
            messages += [{k: v for k, v in message.items() if v is not None}, tool_result(city)]


def test_a_reply_without_tools_offered_stays_text_and_continues_natively(engines):
    # With no tools offered nothing parses a reply's calls, here as over HTTP
    # (engine.api.replies): the client echoes the text as it got it, the
    # message log logged the same, and the next turn continues natively.
    engine = engines["native"]
    for city in CITIES:
        with engine.session() as s:
            messages = [ask(city)]
            first = engine.chat(messages, None, session=s, max_tokens=48, temperature=0.0)
            if "<tool_call>" not in first.text:
                continue
            assert first.tool_calls == [] and first.finish_reason != "tool_calls" and s.message_log is not None
            messages += [echo(first), {"role": "user", "content": "Thanks. Anything else?"}]
            second = engine.chat(messages, None, session=s, max_tokens=8, temperature=0.0)
            u = second.usage
            assert u["native"] and u["cached_tokens"] >= first.usage["prompt_tokens"] + len(first.token_ids) - 1
            return
    pytest.fail("the embedded model wrote no <tool_call> without tools for any city: the case is untested")


def native_turns(client: TestClient) -> int:
    line = next(x for x in client.get("/metrics").text.splitlines() if x.startswith("agentkv_native_turns_total "))
    return int(line.split()[1])


def chat_over_http(client: TestClient, body: dict, stream: bool) -> tuple[dict, dict]:
    """The reply's message as an OpenAI client rebuilds it, and the usage."""
    if not stream:
        r = client.post("/v1/chat/completions", json=body).json()
        return {k: v for k, v in r["choices"][0]["message"].items() if v is not None}, r["usage"]
    text, usage = "", None
    with client.stream("POST", "/v1/chat/completions",
                       json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[len("data: "):])
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    assert not choice["delta"].get("tool_calls"), "calls parsed though no tools were offered"
                    text += choice["delta"].get("content") or ""
    return {"role": "assistant", "content": text}, usage


@pytest.mark.parametrize("stream", [False, True])
def test_text_tool_calls_without_tools_keep_every_held_token_over_http(engines, stream):
    # The client's echo of a reply holding complete <tool_call>...</tool_call>
    # text (no tools offered) must match the message log; at temperature 1 the
    # sampled tokens are often not the tokenizer's own spelling, so a fallback
    # to re-rendering would recompute part of every such reply.
    engine = engines["native"]
    complete = 0
    with TestClient(create_app(engine, "agentkv-native")) as client:
        natives = native_turns(client)
        messages = [{"role": "system", "content": "You can call tools by writing <tool_call>{json}</tool_call>."},
                    {"role": "user", "content": 'Call get_weather with city="Oslo" now.'}]
        held = None
        for t in range(4):
            message, usage = chat_over_http(client, {
                "model": "agentkv-native", "messages": messages, "max_tokens": 160, "temperature": 1.0,
                "seed": t, "session_id": f"no-tools-{stream}"}, stream)
            if held is not None:
                # Every token the session held, all but the last sampled one (its KV is computed now).
                assert usage["prompt_tokens_details"]["cached_tokens"] == held - 1
            held = usage["total_tokens"]
            complete += "</tool_call>" in message["content"]
            messages += [message, {"role": "user", "content": "Go on."}]
        # Not re-rendered either (where sampling spelled a reply as the tokenizer would, a
        # re-render would keep every token too): each turn after the first matched the log.
        assert native_turns(client) - natives == 3
    assert complete >= 2, "the embedded model wrote too few complete <tool_call> texts: the case is untested"
