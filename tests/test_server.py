"""The HTTP server, driven by the real openai client (and httpx for what the
client cannot send) against uvicorn on 127.0.0.1, on the embedded default
model. Its weights are random, so the tests check protocol and state, not
what the replies say."""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Callable

import httpx
import openai
import pytest

from agentkv import Engine, TurnResult
from agentkv.engine.api import create_app
from agentkv.model.default import SMALL_MODEL_DIR
from tests.conftest import assert_all_pages_free, http_server

MODEL = "agentkv-test"
USER = [{"role": "user", "content": "Read src/engine/cache.py and tell me what it does."}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@dataclass
class Server:
    engine: Engine
    url: str
    app: object

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60)

    def session_info(self, session_id: str) -> dict:
        with self.http() as http:
            response = http.get(f"/v1/sessions/{session_id}")
        response.raise_for_status()
        return response.json()

    def wait_idle(self) -> None:
        """Until no generation runs (a disconnected stream's may go on)."""
        sessions = self.app.state.api.sessions
        for _ in range(3000):
            if not self.engine.scheduler.in_flight and not sessions.busy_count():
                return
            time.sleep(0.01)
        raise AssertionError("the server did not become idle")


@pytest.fixture(scope="module")
def server():
    engine = Engine.from_pretrained(SMALL_MODEL_DIR, num_pages=1024)
    app = create_app(engine, MODEL)
    with http_server(app) as url:
        yield Server(engine, url, app)
    # Shutdown closed every named session: only the prefix cache may hold pages.
    assert_all_pages_free(engine)


def chat(client: openai.OpenAI, messages: list[dict], **kwargs):
    kwargs = {"model": MODEL, "max_tokens": 8, "temperature": 0.0, **kwargs}
    return client.chat.completions.create(messages=messages, **kwargs)


def test_health_and_models(server):
    with server.http() as http:
        assert http.get("/health").json() == {"status": "ok"}
    client = server.client()
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_plain_chat(server):
    r = chat(server.client(), USER, seed=3)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == MODEL
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls
    u = r.usage
    assert u.completion_tokens <= 8 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert 0 <= u.prompt_tokens_details.cached_tokens < u.prompt_tokens


@pytest.mark.parametrize("use_stop", [False, True])
def test_stream_reassembles_the_non_streamed_reply(server, use_stop):
    client = server.client()
    kwargs = {"temperature": 0.0, "seed": 7, "max_tokens": 12}
    free = chat(client, USER, **kwargs).choices[0].message.content
    stop = free[4:7] if use_stop else None  # three characters from inside the greedy reply
    whole = chat(client, USER, stop=stop, **kwargs)
    chunks = list(chat(client, USER, stream=True, stream_options={"include_usage": True}, stop=stop, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    if stop:  # cut before the stop string's first occurrence, which is never returned
        assert whole.choices[0].message.content == free[: free.find(stop)]
        assert whole.choices[0].finish_reason == "stop"


def scripted(engine: Engine, replies: list[str]) -> Callable:
    """engine.start_turn that runs for real (the session's state, usage, pages
    are the engine's own) but reports the next scripted reply as what the
    model wrote, parsed as the turn parses it: the random model never writes
    a tool call by itself."""
    real_start = engine.start_turn
    tokenizer = engine.tokenizer

    class Turn:
        def __init__(self, turn, ids: list[int]):
            self.turn, self.ids = turn, ids

        def cancel(self) -> None:
            self.turn.cancel()

        def finish(self) -> TurnResult:
            result = self.turn.finish()
            text = tokenizer.decode(self.ids, skip_special_tokens=True)
            fmt = self.turn.tool_format
            content, calls = fmt.parse(text) if fmt is not None else (text, [])
            return TurnResult(content, calls, {**result.usage, "completion_tokens": len(self.ids)},
                              "tool_calls" if calls else "stop", self.ids, stats=result.stats)

    def start_turn(prompt, session=None, on_tokens=None, on_done=None, **kwargs):
        ids = tokenizer.encode(replies.pop(0)) + engine.eos_token_ids[:1]

        def done(req) -> None:
            if on_tokens is not None and req.error is None:
                on_tokens(ids)
            on_done(req)

        return Turn(real_start(prompt, session, on_done=done, **kwargs), ids)

    return start_turn


def tool_call_text(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


def test_tool_calling_loop_reuses_the_session(server, monkeypatch):
    replies = [
        tool_call_text("get_weather", {"city": "Zürich"}),
        "Let me check Paris too.\n" + tool_call_text("get_weather", {"city": "Paris"}),
        "Zürich is sunny, Paris is rainy.",
    ]
    monkeypatch.setattr(server.engine, "start_turn", scripted(server.engine, replies))
    client = server.client()
    messages = [{"role": "user", "content": "What's the weather in Zürich and Paris?"}]
    extra = {"extra_body": {"session_id": "tool-loop"}}
    usages, contents = [], []
    for turn in range(3):
        stream = turn == 1
        r = chat(client, messages, tools=[WEATHER_TOOL], stream=stream, **extra)
        if stream:
            chunks = list(r)
            content = "".join(c.choices[0].delta.content or "" for c in chunks) or None
            calls = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or []]
            finish = chunks[-1].choices[0].finish_reason
        else:
            content, calls, finish = r.choices[0].message.content, r.choices[0].message.tool_calls or [], r.choices[0].finish_reason
            usages.append(r.usage)
        contents.append(content)
        if turn < 2:
            assert finish == "tool_calls" and len(calls) == 1 and calls[0].type == "function"
            assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather"
            city = json.loads(calls[0].function.arguments)["city"]
            assert city == ["Zürich", "Paris"][turn]
            messages.append({"role": "assistant", "content": content, "tool_calls": [
                {"id": calls[0].id, "type": "function", "function": {"name": "get_weather", "arguments": calls[0].function.arguments}}
            ]})
            messages.append({"role": "tool", "tool_call_id": calls[0].id, "content": json.dumps({"city": city, "sky": "sunny"})})
        else:
            assert finish == "stop" and not calls
    assert contents == [None, "Let me check Paris too.", "Zürich is sunny, Paris is rainy."]
    # Each turn found the history of the turns before it in the session.
    first, last = usages
    assert last.prompt_tokens_details.cached_tokens >= first.prompt_tokens
    info = server.session_info("tool-loop")
    assert [t["prompt_tokens"] for t in info["turns"]][0] == first.prompt_tokens and len(info["turns"]) == 3
    assert all(b["cached_tokens"] >= a["prompt_tokens"] for a, b in zip(info["turns"], info["turns"][1:]))
    with server.http() as http:
        assert http.delete("/v1/sessions/tool-loop").status_code == 200


def test_tool_choice_none_hides_the_tools(server):
    client = server.client()
    with_tools = chat(client, USER, tools=[WEATHER_TOOL])
    hidden = chat(client, USER, tools=[WEATHER_TOOL], tool_choice="none")
    plain = chat(client, USER)
    assert hidden.usage.prompt_tokens == plain.usage.prompt_tokens < with_tools.usage.prompt_tokens


def conversation(client: openai.OpenAI, i: int, turns: int, session_id: str) -> list[tuple]:
    """A multi-turn conversation; even clients decode greedily, odd ones sample with seeds."""
    sampling = {"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.9}
    messages = [{"role": "system", "content": f"You are worker {i}."}]
    out = []
    for t in range(turns):
        messages.append({"role": "user", "content": f"Step {t}: check file_{i}_{t}.py"})
        r = chat(client, messages, max_tokens=6, seed=100 * i + t, extra_headers={"X-Session-Id": session_id}, **sampling)
        reply = r.choices[0].message.content
        messages.append({"role": "assistant", "content": reply})
        out.append((reply, r.choices[0].finish_reason, r.usage.prompt_tokens, r.usage.completion_tokens))
    return out


@pytest.mark.slow
def test_concurrent_clients_match_one_at_a_time(server):
    clients, turns = 16, 10
    client = server.client()
    alone = [conversation(client, i, turns, f"alone-{i}") for i in range(clients)]
    # Nothing the reference runs computed may be found again: the comparison is with work done from scratch.
    with server.http() as http:
        for i in range(clients):
            assert http.delete(f"/v1/sessions/alone-{i}").status_code == 200
    with server.engine.lock:
        server.engine.radix.clear()
    batched = sum(server.engine.scheduler.counters.batch_size.counts[1:])
    together: list = [None] * clients
    barrier = threading.Barrier(clients)

    def run(i: int) -> None:
        barrier.wait(30)
        together[i] = conversation(server.client(), i, turns, f"together-{i}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert together == alone
    assert len({tuple(c) for c in alone}) > 1  # the conversations do differ
    assert sum(server.engine.scheduler.counters.batch_size.counts[1:]) > batched, "no step held two requests"
    with server.http() as http:
        for i in range(clients):
            assert http.delete(f"/v1/sessions/together-{i}").status_code == 200
    assert_all_pages_free(server.engine)


def test_disconnect_mid_stream_leaks_nothing(server, monkeypatch):
    client = server.client()
    bystander_alone = chat(client, USER, seed=5, temperature=0.9, max_tokens=16)
    body = {"model": MODEL, "messages": USER, "stream": True, "max_tokens": 300, "temperature": 1.0, "seed": 1,
            "session_id": "dropped", "ignore_eos": True}
    # Once the request runs, the scheduler's loop is held after each step
    # (holding no lock), so no step runs between its first (which sends the
    # response's head and role chunk) and the stream's close: a race against
    # the role chunk was lost once the step got fast enough to finish all 300
    # tokens first. (Held before its first step, the response never starts.)
    sched = server.engine.scheduler
    gate, step = threading.Event(), sched.step

    def step_then_hold() -> bool:
        busy = step()
        if sched.running:
            gate.wait(60)
        return busy

    monkeypatch.setattr(sched, "step", step_then_hold)
    with server.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # the role chunk
        server.engine.lock.acquire()
        gate.set()  # the loop now waits on the engine lock the test holds
    try:
        (req,) = sched.running + sched.waiting
        for _ in range(500):  # the server notices the disconnect without the engine lock
            if req.cancelled:
                break
            time.sleep(0.01)
        assert req.cancelled and not req.done.is_set()
        steps = sched.counters.steps
    finally:
        server.engine.lock.release()
    assert req.done.wait(10)
    # Dropped at the next step's start: no step computed for it after the close.
    assert sched.counters.steps == steps
    assert type(req.error).__name__ == "RequestCancelledError" and req.output == []
    bystander = chat(client, USER, seed=5, temperature=0.9, max_tokens=16)
    server.wait_idle()
    assert bystander.choices[0].message.content == bystander_alone.choices[0].message.content
    info = server.session_info("dropped")
    # The session is as before the request (new, so empty), and free again.
    assert not info["busy"] and info["length"] == 0 and info["pages"] == 0 and info["turns"] == []
    with server.http() as http:
        assert http.delete("/v1/sessions/dropped").status_code == 200
    assert_all_pages_free(server.engine)


def test_busy_session_is_409_and_unharmed(server, monkeypatch):
    client = server.client()
    done: list = []
    # A gate in the forward stalls generation, so the first request stays in flight.
    gate, step = threading.Event(), server.engine.runner.step
    monkeypatch.setattr(server.engine.runner, "step", lambda items: gate.wait(60) and step(items))
    try:
        first = threading.Thread(target=lambda: done.append(list(chat(
            client, USER, stream=True, stream_options={"include_usage": True}, extra_body={"session_id": "busy"}))))
        first.start()
        for _ in range(500):
            if server.app.state.api.sessions.busy_count():
                break
            time.sleep(0.01)
        assert server.session_info("busy")["busy"]
        with pytest.raises(openai.ConflictError) as err:
            chat(client, USER, extra_headers={"X-Session-Id": "busy"})
        assert err.value.status_code == 409 and err.value.body["code"] == "session_busy"
        with server.http() as http:
            for method, path, body in [("POST", "/v1/sessions/busy/truncate", {"length": 0}),
                                       ("POST", "/v1/sessions/busy/fork", None), ("DELETE", "/v1/sessions/busy", None)]:
                assert http.request(method, path, json=body).status_code == 409
    finally:
        gate.set()
    first.join(60)
    usage = done[0][-1].usage
    info = server.session_info("busy")
    assert info["length"] == usage.prompt_tokens + usage.completion_tokens and len(info["turns"]) == 1
    with server.http() as http:
        assert http.delete("/v1/sessions/busy").status_code == 200


GOOD = {"model": MODEL, "messages": USER, "max_tokens": 4, "session_id": "bad-input"}
BAD_REQUESTS = [
    ("malformed json", "/v1/chat/completions", b'{"model": "agentkv-test", "messages": [', 400),
    ("messages not a list", "/v1/chat/completions", {**GOOD, "messages": "hello"}, 400),
    ("max_tokens as a string", "/v1/chat/completions", {**GOOD, "max_tokens": "4"}, 400),
    ("unknown field", "/v1/chat/completions", {**GOOD, "frobnicate": True}, 400),
    ("unknown message role", "/v1/chat/completions", {**GOOD, "messages": [{"role": "robot", "content": "hi"}]}, 400),
    ("empty messages", "/v1/chat/completions", {**GOOD, "messages": []}, 400),
    ("negative max_tokens", "/v1/chat/completions", {**GOOD, "max_tokens": -1}, 400),
    ("negative temperature", "/v1/chat/completions", {**GOOD, "temperature": -0.5}, 400),
    ("top_p zero", "/v1/chat/completions", {**GOOD, "top_p": 0}, 400),
    ("n=2", "/v1/chat/completions", {**GOOD, "n": 2}, 400),
    ("named tool not offered", "/v1/chat/completions",
     {**GOOD, "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "rm_rf"}}}, 400),
    ("bad session id", "/v1/chat/completions", {**GOOD, "session_id": "no spaces allowed"}, 400),
    ("huge max_tokens", "/v1/chat/completions", {**GOOD, "max_tokens": 10**9}, 413),
    ("huge max_tokens streamed", "/v1/chat/completions", {**GOOD, "max_tokens": 10**9, "stream": True}, 413),
    ("prompt beyond context", "/v1/chat/completions", {**GOOD, "messages": [{"role": "user", "content": "7 " * 20000}]}, 413),
    ("unknown model", "/v1/chat/completions", {**GOOD, "model": "gpt-4o"}, 404),
    ("token id out of vocabulary", "/v1/completions", {"model": MODEL, "prompt": [1, 10**9], "max_tokens": 2}, 400),
    ("unknown session: read", "GET /v1/sessions/nope", None, 404),
    ("unknown session: fork", "/v1/sessions/nope/fork", None, 404),
    ("unknown session: truncate", "/v1/sessions/nope/truncate", {"length": 1}, 404),
    ("unknown session: delete", "DELETE /v1/sessions/nope", None, 404),
    ("truncate past the end", "/v1/sessions/bad-input/truncate", {"length": 10**6}, 400),
    ("truncate negative", "/v1/sessions/bad-input/truncate", {"length": -1}, 400),
    ("unknown route", "/v1/embeddings", {"model": MODEL, "input": "x"}, 404),
]


@pytest.fixture
def bad_input_session(server):
    chat(server.client(), USER, extra_body={"session_id": "bad-input"})
    yield "bad-input"
    with server.http() as http:
        http.delete("/v1/sessions/bad-input")


@pytest.mark.parametrize("case,target,body,status", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
@pytest.mark.slow
def test_bad_request_changes_nothing(server, bad_input_session, case, target, body, status):
    method, path = target.split() if " " in target else ("POST", target)
    before = server.session_info(bad_input_session), server.engine.pool.num_free
    with server.http() as http:
        if isinstance(body, bytes):
            r = http.request(method, path, content=body, headers={"content-type": "application/json"})
        else:
            r = http.request(method, path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (server.session_info(bad_input_session), server.engine.pool.num_free) == before


def test_header_and_body_must_name_the_same_session(server):
    with pytest.raises(openai.BadRequestError):
        chat(server.client(), USER, extra_headers={"X-Session-Id": "a"}, extra_body={"session_id": "b"})


def test_text_completions(server):
    client = server.client()
    r = client.completions.create(model=MODEL, prompt="def read_file(path):", max_tokens=6, temperature=0.0)
    assert r.object == "text_completion" and r.usage.completion_tokens <= 6
    ids = server.engine.tokenizer.encode("def read_file(path):")
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0.0)
    assert by_ids.choices[0].text == r.choices[0].text
    assert by_ids.usage.prompt_tokens_details.cached_tokens == len(ids) - 1  # found in the prefix cache
    chunks = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0.0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-2].choices[0].finish_reason == r.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_session_endpoints(server):
    with server.http() as http:
        created = http.post("/v1/sessions", json={"session_id": "planner"}).json()
        assert created["id"] == "planner" and created["length"] == 0
        assert http.post("/v1/sessions", json={"session_id": "planner"}).status_code == 409
        chat(server.client(), USER, extra_body={"session_id": "planner"})
        info = http.get("/v1/sessions/planner").json()
        assert info["length"] > 0 and info["pages"] > 0 and len(info["turns"]) == 1 and not info["busy"]
        fork = http.post("/v1/sessions/planner/fork").json()
        assert fork["length"] == info["length"] and fork["id"] != "planner"
        cut = http.post(f"/v1/sessions/{fork['id']}/truncate", json={"length": 5}).json()
        assert cut["length"] == 5 and http.get("/v1/sessions/planner").json()["length"] == info["length"]
        anonymous = http.post("/v1/sessions").json()["id"]
        for name in ("planner", fork["id"], anonymous):
            assert http.delete(f"/v1/sessions/{name}").json()["deleted"]
        assert http.get("/v1/sessions/planner").status_code == 404
    assert_all_pages_free(server.engine)


def parse_metrics(text: str) -> dict[str, float]:
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_metrics(server):
    client = server.client()
    with server.http() as http:
        before = parse_metrics(http.get("/metrics").text)
        r = chat(client, USER)
        http.post("/v1/chat/completions", json={"model": "nope", "messages": USER})
        response = http.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    after = parse_metrics(response.text)

    def grew(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    assert grew('agentkv_requests_total{endpoint="/v1/chat/completions",status="200"}') == 1
    assert grew('agentkv_requests_total{endpoint="/v1/chat/completions",status="404"}') == 1
    assert grew("agentkv_prompt_tokens_total") == r.usage.prompt_tokens
    assert grew("agentkv_generated_tokens_total") == r.usage.completion_tokens
    assert grew("agentkv_cached_tokens_total") + grew("agentkv_computed_tokens_total") >= r.usage.prompt_tokens
    assert grew("agentkv_turn_latency_seconds_count") == 1
    assert after["agentkv_kv_pages_free"] + after["agentkv_kv_pages_used"] == after["agentkv_kv_pages_total"]
    assert after["agentkv_active_requests"] == 0
    assert after["agentkv_spec_accepted_tokens_total"] <= after["agentkv_spec_drafted_tokens_total"]
    # vLLM's names, with its model_name label, for tools written against vLLM.
    label = f'{{model_name="{MODEL}"}}'
    assert after[f"vllm:num_requests_running{label}"] == 0 and after[f"vllm:num_requests_waiting{label}"] == 0
    assert grew(f"vllm:prompt_tokens_total{label}") == r.usage.prompt_tokens
    assert grew(f"vllm:generation_tokens_total{label}") == r.usage.completion_tokens
    assert grew(f"vllm:prefix_cache_queries_total{label}") == r.usage.prompt_tokens
    assert grew(f"vllm:prefix_cache_hits_total{label}") == r.usage.prompt_tokens_details.cached_tokens
    assert grew(f"vllm:request_queue_time_seconds_count{label}") == 1
    usage = after[f"vllm:kv_cache_usage_perc{label}"]
    assert usage == after["agentkv_kv_pages_used"] / after["agentkv_kv_pages_total"]
    assert grew("agentkv_step_batch_size_count") >= 1 and after["agentkv_step_seconds_total"] >= after["agentkv_forward_seconds_total"]


def dropped_before_any_token_is_cancelled(server, session_id: str, stream: bool) -> None:
    """A request whose client gives up before any token (each step held, no
    response head sent) is cancelled, and its session is as before."""
    sched = server.engine.scheduler
    body = {"model": MODEL, "messages": USER, "max_tokens": 300, "session_id": session_id, "ignore_eos": True,
            "stream": stream}
    cancelled = sched.counters.cancelled
    gate, step = threading.Event(), server.engine.runner.step
    server.engine.runner.step = lambda items: gate.wait(30) and step(items)
    try:
        with server.http() as http:
            with pytest.raises(httpx.ReadTimeout):
                http.post("/v1/chat/completions", json=body, timeout=1.0)  # the client gives up, closing the connection
        (req,) = sched.running + sched.waiting
        # The server marks it cancelled now; the scheduler counts it at the
        # start of the step after the held one.
        for _ in range(500):
            if req.cancelled:
                break
            time.sleep(0.01)
        assert req.cancelled
    finally:
        gate.set()
        server.engine.runner.step = step
    server.wait_idle()
    assert sched.counters.cancelled == cancelled + 1
    info = server.session_info(session_id)
    assert not info["busy"] and info["length"] == 0 and info["turns"] == []
    with server.http() as http:
        assert http.delete(f"/v1/sessions/{session_id}").status_code == 200


def test_a_stream_dropped_before_its_first_token_is_cancelled(server):
    # Issue 42: the handler waited for a stream's first token without
    # watching its client, so a dropped stream queued and prefilled for nobody.
    dropped_before_any_token_is_cancelled(server, "gone-early", stream=True)


def test_disconnect_without_streaming_cancels(server):
    dropped_before_any_token_is_cancelled(server, "gone", stream=False)
