"""The Responses API, driven by the real openai client over in-process ASGI,
on the embedded default model (trained: given a directive it writes real
tool calls). Each continuation must compute only its new items' tokens, and
say the same as the whole conversation sent through chat completions."""
from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from agentkv import Engine
from agentkv.engine.api import create_app
from agentkv.engine.api.tenants import ApiKeys
from agentkv.model.default import SMALL_MODEL_DIR
from tests.conftest import assert_all_pages_free

MODEL = "agentkv-test"
KEY = "tenant-a"
# Each key its own tenant (a key names the tenant of the same name).
KEYS = ApiKeys({key: key for key in (KEY, "tenant-b", "tenant-evict")})
GEN = 40
TOOL = {
    "type": "function", "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}


def ask(city: str) -> dict:
    return {"role": "user", "content": f'Next step: call get_weather with city="{city}".'}


class Server:
    def __init__(self, engine: Engine, http: TestClient):
        self.engine, self.http = engine, http
        self.store = http.app.state.api.responses

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=self.http, max_retries=0)

    def respond(self, input, previous: str | None = None, key: str = KEY, **kwargs):
        kwargs = {"model": MODEL, "tools": [TOOL], "temperature": 0.0, "max_output_tokens": GEN, **kwargs}
        return self.client(key).responses.create(input=input, previous_response_id=previous, **kwargs)

    def chat(self, messages: list[dict], **kwargs):
        kwargs = {"model": MODEL, "tools": [CHAT_TOOL], "temperature": 0.0, "max_tokens": GEN, **kwargs}
        return self.client().chat.completions.create(messages=messages, **kwargs)

    def session(self, response_id: str, key: str = KEY):
        return self.store.get(response_id, key).session

    def post(self, body: dict, key: str = KEY) -> httpx.Response:
        return self.http.post("/v1/responses", json=body, headers={"Authorization": f"Bearer {key}"})


@pytest.fixture(scope="module")
def server():
    engine = Engine.from_pretrained(SMALL_MODEL_DIR, num_pages=1024)
    with TestClient(create_app(engine, MODEL, keys=KEYS)) as http:
        yield Server(engine, http)
    # Shutdown closed every stored response: only the prefix cache may hold pages.
    assert_all_pages_free(engine)


def reply_messages(r) -> list[dict]:
    """A response's output as the assistant message chat completions are sent."""
    text = "".join(p.text for o in r.output if o.type == "message" for p in o.content) or None
    calls = [{"id": o.call_id, "type": "function", "function": {"name": o.name, "arguments": o.arguments}}
             for o in r.output if o.type == "function_call"]
    return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]


def outputs(r) -> list:
    return [(o.type, o.name, o.arguments) if o.type == "function_call" else (o.type, o.content[0].text) for o in r.output]


def chat_outputs(c) -> list:
    m = c.choices[0].message
    text = [("message", m.content)] if m.content is not None else []
    return text + [("function_call", t.function.name, t.function.arguments) for t in m.tool_calls or []]


def tool_results(r, turn: int) -> list[dict]:
    return [{"type": "function_call_output", "call_id": o.call_id, "output": json.dumps({"sky": "sunny", "turn": turn})}
            for o in r.output if o.type == "function_call"]


def test_tool_loop_computes_only_the_new_items(server):
    tokenizer = server.engine.tokenizer
    messages = [ask("Paris")]
    r = server.respond(messages)
    assert [o.type for o in r.output] == ["function_call"]  # the trained model follows the directive
    first = r.output[0]
    assert first.call_id.startswith("call_") and first.id.startswith("fc_") and first.status == "completed"
    assert json.loads(first.arguments) and first.name == "get_weather"
    assert r.usage.input_tokens_details.cached_tokens == 0
    for turn, city in enumerate(["Rome", "Oslo", "Lima"]):
        items = tool_results(r, turn) + [ask(city)]
        messages += reply_messages(r) + [{"role": "tool", "tool_call_id": i["call_id"], "content": i["output"]} for i in items[:-1]] + [ask(city)]
        previous = server.session(r.id)
        # What the previous turn holds: its prompt and reply, the reply's last token (and any the
        # tokenizer would spell otherwise) still to compute.
        held, computed = len(previous), previous.table.length
        assert held == r.usage.input_tokens + r.usage.output_tokens or held - computed > 1
        assert r.usage.input_tokens <= computed < held
        r = server.respond(items, previous=r.id)
        stats = server.engine.stats[-1]
        new = r.usage.input_tokens - held  # the new items' tokens
        assert r.usage.input_tokens_details.cached_tokens == stats.reused_tokens == computed
        assert stats.computed_tokens == r.usage.input_tokens_details.cache_write_tokens == new + (held - computed)
        assert stats.generated_tokens == r.usage.output_tokens
        # The session holds the whole conversation as its rendering tokenizes it: nothing else differs.
        prompt = tokenizer.apply_chat_template(messages, tools=[CHAT_TOOL])
        assert server.session(r.id).tokens[: r.usage.input_tokens] == prompt
        full = server.chat(messages)
        assert full.usage.prompt_tokens == r.usage.input_tokens
        assert outputs(r) == chat_outputs(full)
    assert any(o.type == "function_call" for o in r.output)


def test_branches_match_independent_full_histories(server):
    root = server.respond([ask("Bern")], instructions="You check the weather.")
    before = server.session(root.id).tokens
    computed = server.session(root.id).table.length
    branches = {}
    for city in ("Kyiv", "Quito"):
        items = tool_results(root, 0) + [ask(city)]
        branches[city] = server.respond(items, previous=root.id, instructions="You check the weather.")
        assert branches[city].usage.input_tokens_details.cached_tokens == computed
    assert server.session(root.id).tokens == before  # both forked it, neither changed it
    assert outputs(branches["Kyiv"]) != outputs(branches["Quito"])
    for city, branch in branches.items():
        history = [{"role": "system", "content": "You check the weather."}, ask("Bern")] + reply_messages(root) + [
            {"role": "tool", "tool_call_id": i["call_id"], "content": i["output"]} for i in tool_results(root, 0)] + [ask(city)]
        assert outputs(branch) == chat_outputs(server.chat(history))
        # The same history sent whole to the Responses API, without a previous response.
        whole = [{"role": "system", "content": "You check the weather."}, ask("Bern")] + [
            {"type": "function_call", "call_id": o.call_id, "name": o.name, "arguments": o.arguments} for o in root.output
        ] + tool_results(root, 0) + [ask(city)]
        assert outputs(server.respond(whole)) == outputs(branch)


def test_concurrent_continuations_of_one_response(server):
    root = server.respond([ask("Bonn")])
    inputs = [tool_results(root, 0) + [ask(city)] for city in ("Gent", "Graz")]
    alone = [outputs(server.respond(items, previous=root.id, store=False)) for items in inputs]
    together: list = [None, None]
    barrier = threading.Barrier(2)

    def run(i: int) -> None:
        barrier.wait(30)
        together[i] = outputs(server.respond(inputs[i], previous=root.id))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert together == alone


def test_evicted_response_continues_from_what_is_cached(server):
    key = "tenant-evict"  # a namespace of its own: no other test's pages match its prompts
    root = server.respond([ask("Cairo")], key=key)
    items = tool_results(root, 0) + [ask("Doha")]
    live = server.respond(items, previous=root.id, key=key, store=False)  # stored, it would hold the history's pages
    session = server.session(root.id, key)
    # The engine's own policy: an idle session past its pin time leaves the
    # pool (its KV to the second tier), unused cache evicted.
    session.pin_ttl = 0.0
    with server.engine.lock:
        server.engine.scheduler.make_room(server.engine.pool.num_pages)
    assert not session.table.pages
    restored = server.engine.tier.counters.restored_tokens
    evicted = server.respond(items, previous=root.id, key=key, store=False)
    assert outputs(evicted) == outputs(live)
    assert evicted.usage.input_tokens == live.usage.input_tokens
    cached = evicted.usage.input_tokens_details.cached_tokens
    assert cached == server.engine.tier.counters.restored_tokens - restored > 0  # all of it from the tier
    assert server.engine.stats[-1].computed_tokens == evicted.usage.input_tokens - cached
    # Without the tier the same eviction loses it: everything is recomputed.
    session.park()
    with server.engine.lock:
        server.engine.scheduler.make_room(server.engine.pool.num_pages)
        server.engine.tier.drop(session.key)
    lost = server.respond(items, previous=root.id, key=key, store=False)
    assert outputs(lost) == outputs(live) and lost.usage.input_tokens_details.cached_tokens == 0
    # Parked again: the history the last continuation computed is matched in the prefix cache.
    with server.engine.lock:
        session.park()
    parked = server.respond(items, previous=root.id, key=key)
    assert outputs(parked) == outputs(live)
    cached = parked.usage.input_tokens_details.cached_tokens
    # The fork re-matched the history from the prefix cache; the parked session itself holds nothing.
    assert cached >= root.usage.input_tokens and session.table.length == 0
    assert parked.usage.input_tokens_details.cache_write_tokens == parked.usage.input_tokens - cached


def test_other_instructions_rerender_the_history(server):
    root = server.respond([ask("Accra")])
    r = server.respond([ask("Lagos")], previous=root.id, instructions="Answer tersely.")
    history = [{"role": "system", "content": "Answer tersely."}, ask("Accra")] + reply_messages(root) + [ask("Lagos")]
    assert outputs(r) == chat_outputs(server.chat(history))
    # The system prompt changed, so the history before it cannot be continued in place.
    assert r.usage.input_tokens_details.cached_tokens < root.usage.input_tokens


def test_stream_events(server):
    plain = server.respond([ask("Riga")])
    events = list(server.respond([ask("Riga")], stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response
    assert outputs(done) == outputs(plain) and done.status == "completed"
    call = next(o for o in done.output if o.type == "function_call")
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta" and e.item_id == call.id)
    assert args == call.arguments
    assert [e.item.id for e in events if e.type == "response.output_item.done"] == [o.id for o in done.output]
    assert server.client().responses.retrieve(done.id).output == done.output
    # A text reply streams its text as deltas that add up to the message.
    text_events = list(server.respond("Say hello.", tools=None, stream=True, max_output_tokens=12))
    final = text_events[-1].response
    message = next(o for o in final.output if o.type == "message")
    deltas = "".join(e.delta for e in text_events if e.type == "response.output_text.delta")
    assert deltas == message.content[0].text
    assert [e.type for e in text_events[2:4]] == ["response.output_item.added", "response.content_part.added"]
    assert text_events[-1].type == f"response.{final.status}"
    if final.status == "incomplete":
        assert final.incomplete_details.reason == "max_output_tokens" and final.usage.output_tokens == 12
    else:
        assert final.status == "completed" and final.incomplete_details is None


def test_retrieve_list_input_items_and_delete(server):
    free = server.engine.pool.num_free
    root = server.respond([ask("Nuuk"), {"role": "user", "content": "Quickly."}, ask("Baku")])
    child = server.respond(tool_results(root, 0) + [ask("Lima")], previous=root.id)
    client = server.client()
    assert client.responses.retrieve(root.id).output == root.output
    listed = client.responses.input_items.list(root.id, order="asc", limit=2)
    assert len(listed.data) == 2 and listed.has_more
    http = server.http
    page = http.get(f"/v1/responses/{root.id}/input_items", params={"order": "asc", "limit": 2},
                    headers={"Authorization": f"Bearer {KEY}"}).json()
    assert page["object"] == "list" and len(page["data"]) == 2 and page["has_more"]
    assert page["data"][0]["content"] == ask("Nuuk")["content"] and page["first_id"] == page["data"][0]["id"]
    rest = http.get(f"/v1/responses/{root.id}/input_items", params={"order": "asc", "after": page["last_id"]},
                    headers={"Authorization": f"Bearer {KEY}"}).json()
    assert [i["content"] for i in rest["data"]] == [ask("Baku")["content"]] and not rest["has_more"]
    newest = http.get(f"/v1/responses/{root.id}/input_items", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert [i["id"] for i in newest["data"]] == [i["id"] for i in page["data"] + rest["data"]][::-1]
    # Deleting the root leaves its continuation whole.
    assert client.responses.delete(root.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(root.id)
    with pytest.raises(openai.NotFoundError):
        server.respond([ask("Oslo")], previous=root.id)
    computed = server.session(child.id).table.length
    again = server.respond([ask("Oslo")], previous=child.id)
    assert again.usage.input_tokens_details.cached_tokens == computed
    for r in (child, again):
        client.responses.delete(r.id)
    server.engine.radix.clear()
    assert server.engine.pool.num_free >= free


def test_least_recently_used_responses_expire_past_the_cap():
    engine = Engine.from_pretrained(SMALL_MODEL_DIR, num_pages=512)
    with TestClient(create_app(engine, MODEL, max_stored_responses=2, keys=KEYS)) as http:
        server = Server(engine, http)
        a = server.respond([ask("Nuuk")], max_output_tokens=4)
        b = server.respond([ask("Baku")], max_output_tokens=4)
        child = server.respond([ask("Lima")], previous=a.id, max_output_tokens=4)  # uses a: b is the oldest
        assert len(server.store) == 2
        for gone in (b.id,):
            with pytest.raises(openai.NotFoundError):
                server.client().responses.retrieve(gone)
            with pytest.raises(openai.NotFoundError):
                server.respond([ask("Oslo")], previous=gone, max_output_tokens=4)
        server.respond([ask("Kyiv")], max_output_tokens=4)  # expires a, the parent of child
        with pytest.raises(openai.NotFoundError):
            server.client().responses.retrieve(a.id)
        # child keeps its own session and the whole conversation.
        held = server.session(child.id).table.length
        again = server.respond([ask("Oslo")], previous=child.id, max_output_tokens=4)
        assert again.usage.input_tokens_details.cached_tokens == held
    assert_all_pages_free(engine)


BAD_REQUESTS = [
    ("unknown previous response", {"previous_response_id": "resp_nope"}, KEY, 404),
    ("another tenant's response", {}, "tenant-b", 404),
    ("unstored previous response", "unstored", KEY, 404),
    ("function_call without call_id", {"input": [{"type": "function_call", "name": "get_weather", "arguments": "{}"}]}, KEY, 400),
    ("unknown item type", {"input": [{"type": "reasoning", "summary": []}]}, KEY, 400),
    ("unknown message role", {"input": [{"role": "robot", "content": "hi"}]}, KEY, 400),
    ("empty input", {"input": []}, KEY, 400),
    ("output of no call", {"input": [{"type": "function_call_output", "call_id": "call_nope", "output": "{}"}]}, KEY, 400),
    ("named tool not offered", {"tool_choice": {"type": "function", "name": "rm_rf"}}, KEY, 400),
    ("tool schema that cannot compile", {"tools": [{**TOOL, "parameters": {"type": "object", "properties": {
        "city": {"$ref": "#/nowhere"}}}}], "tool_choice": "required"}, KEY, 400),
    ("unknown field", {"frobnicate": True}, KEY, 400),
    ("max_output_tokens as a string", {"max_output_tokens": "4"}, KEY, 400),
    ("huge max_output_tokens", {"max_output_tokens": 10**9}, KEY, 413),
    ("huge max_output_tokens streamed", {"max_output_tokens": 10**9, "stream": True}, KEY, 413),
    ("unknown model", {"model": "gpt-4o"}, KEY, 404),
]


@pytest.fixture(scope="module")
def bad_input_root(server):
    root = server.respond([ask("Turin")])
    unstored = server.respond([ask("Turin")], store=False)
    return root, unstored


@pytest.mark.parametrize("case,change,key,status", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_changes_nothing(server, bad_input_root, case, change, key, status):
    root, unstored = bad_input_root
    body = {"model": MODEL, "input": tool_results(root, 0), "tools": [TOOL], "max_output_tokens": 4,
            "previous_response_id": root.id}
    body.update({"previous_response_id": unstored.id} if change == "unstored" else change)
    session = server.session(root.id)
    state = lambda: (session.tokens, session.table.length, len(server.store), server.engine.pool.num_free, len(server.engine.stats))  # noqa: E731
    before = state()
    r = server.post(body, key)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert state() == before
    # The response is still there to continue.
    still = {"model": MODEL, "input": tool_results(root, 0), "max_output_tokens": 2, "previous_response_id": root.id, "store": False}
    assert server.post(still).status_code == 200
