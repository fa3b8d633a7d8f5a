"""The Anthropic Messages API, driven by the official `anthropic` client
against a live server (uvicorn over real HTTP) on the embedded small model
(trained: given a directive it writes real tool calls). The client of this
release sends no temperature of its own: greedy requests pass it in
extra_body, as any field the client does not know.

A conversation over /v1/messages must be the same prompt as over chat
completions, the stream the SDK assembles the same message as the
non-streamed one, a forced tool call's input valid under its schema, a bad
request an Anthropic error that changes nothing, and usage's cache counts
the engine's own."""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from agentkv import Engine
from agentkv.engine.api import create_app
from agentkv.engine.api.cache_pins import CachePins
from agentkv.engine.api.tenants import ApiKeys
from agentkv.model.default import SMALL_MODEL_DIR
from tests.conftest import assert_all_pages_free, http_server

MODEL = "agentkv-test"
KEY = "tenant-a"
# Each key its own tenant (a key names the tenant of the same name): a test
# that counts cache reads has a namespace no other test's KV is found in.
KEYS = ApiKeys({key: key for key in (KEY, "tenant-cache", "tenant-count", "tenant-ttl", "tenant-session")})
GREEDY = {"temperature": 0.0}
WEATHER = {"name": "get_weather", "description": "The current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TIME = {"name": "get_time", "description": "The local time in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                          "hours24": {"type": "boolean"}},
                         "required": ["city", "hours24"]}}
SCHEMAS = {t["name"]: t["input_schema"] for t in (WEATHER, TIME)}
SUNNY = '{"sky": "sunny"}'
SYSTEM = "You are a weather agent. Call a tool when told to, then answer in one short sentence."


def ask(city: str) -> dict:
    return {"role": "user", "content": f'Next step: call get_weather with city="{city}".'}


class Server:
    def __init__(self, engine: Engine, url: str, app):
        self.engine, self.url, self.api = engine, url, app.state.api

    def client(self, key: str = KEY, **kwargs) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key=key, max_retries=0, **kwargs)

    def create(self, messages: list[dict], key: str = KEY, **kwargs) -> anthropic.types.Message:
        kwargs = {"model": MODEL, "max_tokens": 40, "tools": [WEATHER], "extra_body": GREEDY, **kwargs}
        return self.client(key).messages.create(messages=messages, **kwargs)

    def post(self, path: str, body: dict | bytes, headers: dict | None = None) -> httpx.Response:
        headers = {"x-api-key": KEY, **(headers or {})}
        if isinstance(body, bytes):
            return httpx.post(self.url + path, content=body, headers={**headers, "content-type": "application/json"})
        return httpx.post(self.url + path, json=body, headers=headers, timeout=60)

    def state(self) -> tuple:
        """What a refused request must leave as it was: every session of the tenant, the pool, the kept prefixes."""
        sessions = httpx.get(self.url + "/v1/sessions", headers={"x-api-key": KEY}).json()["data"]
        return sessions, self.engine.pool.num_free, len(self.api.cache_pins.sessions_of(KEY))


@pytest.fixture(scope="module")
def server():
    engine = Engine.from_pretrained(SMALL_MODEL_DIR, num_pages=1024)
    app = create_app(engine, MODEL, keys=KEYS)
    with http_server(app) as url:
        yield Server(engine, url, app)
    # Shutdown closed every session and kept prefix: only the prefix cache may hold pages.
    assert_all_pages_free(engine)


def check_inputs(message: anthropic.types.Message, names: set[str]) -> list:
    uses = [b for b in message.content if b.type == "tool_use"]
    for use in uses:
        assert use.name in names
        jsonschema.validate(use.input, SCHEMAS[use.name])
    return uses


def common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_tool_loop_matches_chat_completions(server):
    """tool_use -> tool_result -> tool_use -> tool_result -> answer over one
    session: each turn the same prompt, reuse and reply as the same
    conversation over chat completions in a session of its own; a turn that
    shows the same tools continues natively (only the new messages computed)."""
    chat = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    chat_tool = {"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                                  "parameters": WEATHER["input_schema"]}}
    messages, chat_messages = [ask("Paris")], [{"role": "system", "content": SYSTEM}, ask("Paris")]
    held = 0  # tokens of the conversation the session holds
    # Forced calls, then the answer: tool_choice "none" shows no tools, so that turn renders anew.
    for turn, (choice, chat_choice) in enumerate([
        ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}),
        ({"type": "any"}, "required"),
        ({"type": "none"}, "none"),
    ]):
        reply = server.create(messages, system=SYSTEM, tool_choice=choice, extra_headers={"X-Session-Id": "loop"})
        stats = server.engine.stats[-1]
        chat_reply = chat.chat.completions.create(model=MODEL, messages=chat_messages, tools=[chat_tool], max_tokens=40,
                                                  temperature=0.0, tool_choice=chat_choice,
                                                  extra_headers={"X-Session-Id": "loop-chat"})
        u, c = reply.usage, chat_reply.usage
        assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == c.prompt_tokens
        assert u.cache_read_input_tokens == stats.reused_tokens
        assert u.cache_creation_input_tokens == 0 and u.output_tokens == stats.generated_tokens == c.completion_tokens
        if turn == 0:  # the same tokens: chat completions found all the Messages turn computed
            assert u.cache_read_input_tokens == 0 and c.prompt_tokens_details.cached_tokens == c.prompt_tokens - 1
        if turn == 1:
            assert stats.native_turns == 1 and u.cache_read_input_tokens >= held - 1
        message = chat_reply.choices[0].message
        if choice["type"] == "none":
            assert reply.stop_reason in ("end_turn", "max_tokens") and [b.type for b in reply.content] == ["text"]
            assert reply.content[0].text == message.content
            break
        assert reply.stop_reason == "tool_use" and reply.role == "assistant" and reply.id.startswith("msg_")
        [use] = check_inputs(reply, {"get_weather"})
        [call] = message.tool_calls
        assert json.loads(call.function.arguments) == use.input
        held = c.prompt_tokens + c.completion_tokens
        city = ["Rome", "Oslo"][turn]
        messages += [{"role": "assistant", "content": [b.model_dump(include={"type", "id", "name", "input"})
                                                       for b in reply.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": SUNNY},
                                                  {"type": "text", "text": ask(city)["content"]}]}]
        chat_messages += [message.model_dump(include={"role", "content", "tool_calls"}, exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": SUNNY}, ask(city)]


def blocks(message: anthropic.types.Message) -> list[dict]:
    """The content, but for call ids (the server makes each anew)."""
    return [b.model_dump(exclude={"id"}) for b in message.content]


def test_stream_is_the_non_streamed_message(server):
    client = server.client()
    for kwargs in ({"messages": [{"role": "user", "content": "Say hello to the weather team."}], "tools": []},
                   {"messages": [ask("Oslo")], "tool_choice": {"type": "any"}}):
        kwargs = {"model": MODEL, "max_tokens": 24, "tools": [WEATHER], "extra_body": GREEDY, **kwargs}
        whole = client.messages.create(**kwargs)
        with client.messages.stream(**kwargs) as stream:
            texts = list(stream.text_stream)
            streamed = stream.get_final_message()
        assert "".join(texts) == "".join(b.text for b in whole.content if b.type == "text")
        assert blocks(streamed) == blocks(whole) and streamed.stop_reason == whole.stop_reason
        assert streamed.usage.output_tokens == whole.usage.output_tokens
        assert streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens == \
            whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert whole.stop_reason == "tool_use" and check_inputs(whole, {"get_weather"})


def test_stream_event_sequence(server):
    body = {"model": MODEL, "max_tokens": 60, "messages": [ask("Lima")], "tools": [WEATHER, TIME],
            "tool_choice": {"type": "tool", "name": "get_time", "disable_parallel_tool_use": True}, "stream": True, **GREEDY}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    kinds = [line.split(": ", 1)[1] for line in lines if line.startswith("event: ")]
    data = [json.loads(line.split(": ", 1)[1]) for line in lines if line.startswith("data: ")]
    assert [d["type"] for d in data] == kinds
    assert kinds == ["message_start", "ping", "content_block_start", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"]
    assert data[2]["content_block"]["type"] == "tool_use" and data[2]["content_block"]["input"] == {}
    assert data[3]["delta"]["type"] == "input_json_delta"
    jsonschema.validate(json.loads(data[3]["delta"]["partial_json"]), TIME["input_schema"])
    assert data[5]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


@pytest.mark.parametrize("choice,names", [
    ({"type": "any"}, {"get_weather", "get_time"}),
    ({"type": "tool", "name": "get_time"}, {"get_time"}),
    ({"type": "any", "disable_parallel_tool_use": True}, {"get_weather", "get_time"}),
], ids=["any", "tool", "any-one-call"])
def test_forced_tool_choice_yields_valid_calls(server, choice, names):
    r = server.create([ask("Rome")], tools=[WEATHER, TIME], tool_choice=choice, max_tokens=60)
    uses = check_inputs(r, names)
    assert uses and r.stop_reason == "tool_use"
    if choice.get("disable_parallel_tool_use"):
        assert len(uses) == 1


def test_tool_choice_none_and_auto(server):
    none = server.create([ask("Rome")], tools=[WEATHER, TIME], tool_choice={"type": "none"})
    assert [b.type for b in none.content] == ["text"] and none.stop_reason in ("end_turn", "max_tokens")
    client = server.client()
    hidden = client.messages.count_tokens(model=MODEL, messages=[ask("Rome")], tools=[WEATHER, TIME],
                                          tool_choice={"type": "none"})
    shown = client.messages.count_tokens(model=MODEL, messages=[ask("Rome")], tools=[WEATHER, TIME])
    assert hidden.input_tokens < shown.input_tokens  # "none" shows the model no tools
    auto = server.create([ask("Rome")], tools=[WEATHER, TIME], tool_choice={"type": "auto"}, max_tokens=60)
    # The trained model follows the directive; under auto a call it opens is held to the schema.
    assert auto.stop_reason == "tool_use" and check_inputs(auto, {"get_weather", "get_time"})


def test_stop_sequences_and_max_tokens(server):
    user = [{"role": "user", "content": "Say hello to the weather team."}]
    free = server.create(user, tools=[], max_tokens=12)
    text = free.content[0].text
    assert free.stop_reason == "max_tokens" and free.usage.output_tokens == 12 and free.stop_sequence is None
    stop = text.split()[1]  # the reply as far as it goes is the same (greedy): it stops before its second word
    cut = server.create(user, tools=[], max_tokens=12, stop_sequences=["NEVER", stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]


def test_count_tokens_is_the_prompt(server):
    client = server.client("tenant-count")
    kwargs = {"model": MODEL, "messages": [ask("Quito")], "system": SYSTEM, "tools": [WEATHER, TIME]}
    count = client.messages.count_tokens(**kwargs)
    # A tenant's first request: nothing of it is cached, nothing marked.
    r = client.messages.create(max_tokens=8, extra_body=GREEDY, **kwargs)
    assert r.usage.input_tokens == count.input_tokens == server.engine.stats[-1].computed_tokens
    assert r.usage.cache_read_input_tokens == r.usage.cache_creation_input_tokens == 0
    again = client.messages.create(max_tokens=8, extra_body=GREEDY, **kwargs)
    u = again.usage
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == count.input_tokens
    assert u.cache_read_input_tokens == count.input_tokens - 1  # all but the token whose logits start the reply


def test_cache_breakpoint_is_written_then_read(server):
    client = server.client("tenant-cache")
    tokenizer = server.engine.tokenizer
    system = [{"type": "text", "text": SYSTEM + " Cities are answered in English.", "cache_control": {"type": "ephemeral"}}]
    chat_system = [{"role": "system", "content": system[0]["text"]}]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                               "parameters": WEATHER["input_schema"]}}]
    prompt = tokenizer.apply_chat_template(chat_system + [ask("Paris")], tools=tools)
    marked = tokenizer.apply_chat_template(chat_system, tools=tools, add_generation_prompt=False)
    marked_len = common(prompt, marked)
    first = client.messages.create(model=MODEL, max_tokens=8, system=system, messages=[ask("Paris")], tools=[WEATHER],
                                   extra_body=GREEDY)
    u = first.usage
    assert u.cache_read_input_tokens == 0 and u.cache_creation_input_tokens == marked_len
    assert u.cache_creation.ephemeral_5m_input_tokens == marked_len and u.cache_creation.ephemeral_1h_input_tokens == 0
    assert u.input_tokens == len(prompt) - marked_len
    [pin] = server.api.cache_pins.sessions_of("tenant-cache")
    assert len(pin) == marked_len and pin.pinned and pin.tokens == prompt[:marked_len]
    # Another question after the same system prompt: the marked prefix is read, not written again.
    second = client.messages.create(model=MODEL, max_tokens=8, system=system, messages=[ask("Oslo")], tools=[WEATHER],
                                    extra_body=GREEDY)
    stats = server.engine.stats[-1]
    other = tokenizer.apply_chat_template(chat_system + [ask("Oslo")], tools=tools)
    reused = common(prompt, other)
    u = second.usage
    assert u.cache_read_input_tokens == stats.reused_tokens == reused >= marked_len > 0
    assert u.cache_creation_input_tokens == 0 and u.input_tokens == len(other) - reused
    [renewed] = server.api.cache_pins.sessions_of("tenant-cache")
    assert renewed is not pin and pin.closed  # marked again: held anew, for a TTL from now


def test_one_hour_breakpoint_on_a_message_block(server):
    client = server.client("tenant-ttl")
    question = {"role": "user", "content": [{"type": "text", "text": "Remember: Lima is in Peru.",
                                             "cache_control": {"type": "ephemeral", "ttl": "1h"}},
                                            {"type": "text", "text": 'Next step: call get_weather with city="Lima".'}]}
    r = client.messages.create(model=MODEL, max_tokens=8, messages=[question], extra_body=GREEDY)
    u = r.usage
    assert u.cache_creation.ephemeral_1h_input_tokens == u.cache_creation_input_tokens > 0
    assert u.cache_creation.ephemeral_5m_input_tokens == 0
    [pin] = server.api.cache_pins.sessions_of("tenant-ttl")
    assert len(pin) == u.cache_creation_input_tokens
    text = server.engine.tokenizer.decode(pin.tokens)
    assert "Remember: Lima is in Peru" in text and "Next step" not in text


def test_api_key_as_x_api_key_or_bearer(server):
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0)
    r = bearer.messages.create(model=MODEL, max_tokens=4, messages=[ask("Bern")], extra_body=GREEDY)
    assert r.usage.output_tokens > 0 and r.content


BASE = {"model": MODEL, "max_tokens": 4, "messages": [ask("Paris")]}
BAD = [
    ("missing max_tokens", {k: v for k, v in BASE.items() if k != "max_tokens"}, 400, "invalid_request_error"),
    ("unknown block type", {**BASE, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
     400, "invalid_request_error"),
    ("tool_result without its tool_use", {**BASE, "messages": [ask("Paris"), {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]},
     400, "invalid_request_error"),
    ("tool_use in a user message", {**BASE, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]}]}, 400, "invalid_request_error"),
    ("named tool not offered", {**BASE, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "rm_rf"}},
     400, "invalid_request_error"),
    ("five breakpoints", {**BASE, "system": [{"type": "text", "text": str(i), "cache_control": {"type": "ephemeral"}}
                                             for i in range(5)]}, 400, "invalid_request_error"),
    ("bad ttl", {**BASE, "cache_control": {"type": "ephemeral", "ttl": "2h"}}, 400, "invalid_request_error"),
    ("malformed json", b'{"model": "agentkv-test", "messages": [', 400, "invalid_request_error"),
    ("prompt beyond context", {**BASE, "messages": [{"role": "user", "content": "7 " * 20000}]},
     400, "invalid_request_error"),
    ("unknown model", {**BASE, "model": "claude-opus-4"}, 404, "not_found_error"),
    ("huge max_tokens streamed", {**BASE, "max_tokens": 10**9, "stream": True}, 400, "invalid_request_error"),
]


@pytest.fixture
def held_session(server):
    server.create([ask("Paris")], max_tokens=4, extra_headers={"X-Session-Id": "kept"})
    yield "kept"
    httpx.delete(server.url + "/v1/sessions/kept", headers={"x-api-key": KEY})


@pytest.mark.parametrize("case,body,status,kind", BAD, ids=[b[0] for b in BAD])
def test_bad_request_is_an_anthropic_error_that_changes_nothing(server, held_session, case, body, status, kind):
    before = server.state()
    r = server.post("/v1/messages", body, headers={"X-Session-Id": held_session})
    assert r.status_code == status, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind and r.json()["error"]["message"]
    assert set(r.json()) == {"type", "error"} and set(r.json()["error"]) == {"type", "message"}
    assert server.state() == before


def test_sdk_raises_typed_errors(server):
    before = server.state()
    with pytest.raises(anthropic.AuthenticationError) as e:
        server.client("not-a-key").messages.create(model=MODEL, max_tokens=4, messages=[ask("Paris")])
    assert e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        server.create([ask("Paris"), {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}])
    assert "tool_use" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        server.client().messages.count_tokens(model="claude-opus-4", messages=[ask("Paris")])
    assert server.state() == before
    # The OpenAI routes keep their own error shape, the gate's refusals too.
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL}, headers={"x-api-key": "not-a-key"})
    assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL}, headers={"x-api-key": KEY})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_session_header_continues_over_both_apis(server):
    """A conversation begun over chat completions goes on over /v1/messages in the same session, natively."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="tenant-session", max_retries=0)
    user = [{"role": "user", "content": "Say hello to the weather team."}]
    first = client.chat.completions.create(model=MODEL, messages=user, max_tokens=8, temperature=0.0,
                                           extra_headers={"X-Session-Id": "both"})
    messages = user + [{"role": "assistant", "content": first.choices[0].message.content}, ask("Kyiv")]
    r = server.create(messages, key="tenant-session", tools=[], max_tokens=8, extra_headers={"X-Session-Id": "both"})
    stats = server.engine.stats[-1]
    assert stats.native_turns == 1
    assert r.usage.cache_read_input_tokens == stats.reused_tokens == first.usage.prompt_tokens + first.usage.completion_tokens - 1


def test_cache_pins_expire_refresh_and_stay_within_a_tenant_limit():
    engine = Engine.from_pretrained(SMALL_MODEL_DIR, num_pages=64)
    now = [0.0]
    pins = CachePins(max_per_tenant=2, clock=lambda: now[0])
    source = engine.session("t")
    source.append(list(range(10, 40)))
    pins.hold("t", source, 20, 300.0)
    [first] = pins.sessions_of("t")
    assert first.tokens == source.tokens[:20] and first.pinned and first.pages_held == -(-20 // engine.pool.page_size)
    pins.hold("t", source, 20, 300.0)  # the same prefix again: held anew
    [again] = pins.sessions_of("t")
    assert first.closed and not again.closed
    pins.hold("t", source, 10, 300.0)
    pins.hold("t", source, 25, 300.0)  # a third: the tenant's oldest goes
    assert again.closed and sorted(len(s) for s in pins.sessions_of("t")) == [10, 25]
    now[0] = 301.0
    pins.hold("u", source, 5, 3600.0)  # past their TTL, the others go as a new one comes
    assert pins.sessions_of("t") == [] and len(pins.sessions_of("u")) == 1
    pins.close_all()
    source.close()
    assert_all_pages_free(engine)
