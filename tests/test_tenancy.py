"""Tenancy over HTTP, on the embedded default model: API keys (401 without
one), one KV namespace per tenant (and per cache_salt) on every endpoint,
sessions and responses that another tenant cannot see or touch (404, and
nothing of the owner's changes), and per-tenant quotas (429 that changes
nothing and leaves other tenants alone)."""
from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from agentkv import serve
from agentkv import Engine
from agentkv.engine.api import create_app
from agentkv.engine.api.gate import Gate
from agentkv.engine.api.quotas import Quotas
from agentkv.engine.api.tenants import ApiKeys, ApiKeysError, Tenant, key_tenant_name, parse_keys_file
from agentkv.model.default import SMALL_MODEL_DIR

MODEL = "agentkv-tenancy"
KEY_A, KEY_B = "sk-alpha-0123456789", "sk-bravo-9876543210"
KEYS = {KEY_A: "alpha", KEY_B: "bravo"}
ALPHA, BRAVO = Tenant("alpha"), Tenant("bravo")
# Long enough to span several pages: a hit would be many tokens, a miss none.
LONG = "Summarize the incident report for the storage cluster in region west, shard seven. " * 6


def auth(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key is not None else {}


def chat(client: TestClient, key: str, content: str = LONG, **extra) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2,
            "temperature": 0.0, **extra}
    r = client.post("/v1/chat/completions", json=body, headers=auth(key))
    assert r.status_code == 200, r.text
    return r.json()


def cached(reply: dict) -> int:
    details = reply["usage"].get("prompt_tokens_details") or reply["usage"].get("input_tokens_details")
    return details["cached_tokens"]


@functools.cache
def shared_engine() -> Engine:
    return Engine.from_pretrained(SMALL_MODEL_DIR, num_pages=512)


@pytest.fixture
def engine() -> Engine:
    return shared_engine()


@pytest.fixture
def client(engine):
    """A fresh server (fresh sessions and responses) on the shared engine; its prefix cache starts empty."""
    engine.radix.clear()
    with TestClient(create_app(engine, MODEL, keys=ApiKeys(KEYS))) as c:
        yield c


# Authentication.

ENDPOINTS = [
    ("GET", "/v1/models"), ("GET", f"/v1/models/{MODEL}"), ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"), ("POST", "/v1/responses"), ("GET", "/v1/responses/resp_x"),
    ("DELETE", "/v1/responses/resp_x"), ("GET", "/v1/responses/resp_x/input_items"), ("GET", "/v1/sessions"),
    ("POST", "/v1/sessions"), ("GET", "/v1/sessions/s"), ("POST", "/v1/sessions/s/fork"),
    ("POST", "/v1/sessions/s/truncate"), ("POST", "/v1/sessions/s/retain"), ("POST", "/v1/sessions/s/release"),
    ("POST", "/v1/sessions/s/restore"), ("DELETE", "/v1/sessions/s"), ("GET", "/metrics"), ("GET", "/nowhere"),
]


@pytest.mark.parametrize("headers", [{}, auth("sk-wrong"), auth(""), {"Authorization": KEY_A},
                                     {"Authorization": f"Basic {KEY_A}"}, auth(KEY_A + "x"), auth(KEY_A[:-1])],
                         ids=["missing", "unknown", "empty", "no scheme", "basic", "longer", "prefix"])
def test_every_endpoint_but_health_needs_a_known_key(client, headers):
    for method, path in ENDPOINTS:
        r = client.request(method, path, headers=headers, json={})
        assert r.status_code == 401, (method, path, r.status_code)
        assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
    assert client.get("/health", headers=headers).status_code == 200


def test_a_known_key_passes_and_the_key_is_never_logged(client, caplog):
    with caplog.at_level(logging.DEBUG):
        assert client.get("/v1/models", headers=auth(KEY_A)).status_code == 200
        assert client.get("/metrics", headers=auth(KEY_B)).status_code == 200
        assert client.get("/v1/models", headers=auth("sk-guess")).status_code == 401
        chat(client, KEY_A, "hello")
    assert KEY_A not in caplog.text and KEY_B not in caplog.text and "sk-guess" not in caplog.text


def test_a_keys_file_with_no_key_is_refused_at_start(tmp_path):
    (tmp_path / "keys").write_text("# none yet\n")
    with pytest.raises(ApiKeysError, match="no keys"):
        ApiKeys.from_args([], tmp_path / "keys")


def test_an_open_server_has_one_tenant_and_no_per_tenant_quotas(engine):
    """Quotas share a server out between tenants; alone, the tenant is held to the server's own limits."""
    quotas = Quotas(max_sessions=1, max_concurrent=1, max_body_bytes=4096, default_max_tokens=3)
    with TestClient(create_app(engine, MODEL, quotas=quotas)) as c:
        for name in ("o1", "o2"):
            assert c.post("/v1/sessions", json={"session_id": name}).status_code == 200
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}]})
        assert r.status_code == 413  # the body limit and the default budget apply always
        r = c.post("/v1/chat/completions", json={"model": MODEL, "ignore_eos": True,
                                                 "messages": [{"role": "user", "content": "Tell me a story."}]})
        assert r.json()["usage"]["completion_tokens"] == 3


def test_public_metrics_and_an_open_server(engine):
    with TestClient(create_app(engine, MODEL, keys=ApiKeys(KEYS), public_metrics=True)) as c:
        assert c.get("/metrics").status_code == 200
        assert c.get("/v1/models").status_code == 401
    with TestClient(create_app(engine, MODEL)) as c:  # no keys: open, one tenant
        assert c.get("/v1/models").status_code == 200
        assert c.get("/v1/models", headers=auth("anything")).status_code == 200


def test_keys_file_parses_reloads_and_keeps_old_keys_on_a_bad_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# key tenant\nk1 alpha\nk2 alpha   # rotating\n\nk3 bravo\n")
    assert parse_keys_file(path) == {"k1": "alpha", "k2": "alpha", "k3": "bravo"}
    keys = ApiKeys.from_args(["cli-key"], path)
    assert [keys.authenticate(f"Bearer {k}") for k in ("k1", "k2", "k3")] == [ALPHA, ALPHA, BRAVO]
    assert keys.authenticate("Bearer cli-key") == Tenant(key_tenant_name("cli-key"))
    assert "cli-key" not in key_tenant_name("cli-key")
    path.write_text("k1 alpha\nk4 charlie\n")
    serve._reload(keys)  # what SIGHUP runs
    assert keys.authenticate("Bearer k3") is None and keys.authenticate("Bearer k4") == Tenant("charlie")
    for bad in ("k1\n", "k1 al/pha\n", "k1 a\nk1 b\n"):
        path.write_text(bad)
        with pytest.raises(ApiKeysError):
            keys.reload()
        serve._reload(keys)  # logs and keeps the keys it had
        assert keys.authenticate("Bearer k4") == Tenant("charlie")
    # Every key removed from the file (and none on the command line): refused, never open.
    only = tmp_path / "only"
    only.write_text("k5 delta\n")
    only_file = ApiKeys.from_args([], only)
    only.write_text("# every key removed\n")
    with pytest.raises(ApiKeysError, match="no keys"):
        only_file.reload()
    assert not only_file.open and only_file.authenticate("Bearer k5") == Tenant("delta")
    assert only_file.authenticate(None) is None


# One namespace per tenant and per cache_salt.


def _no_speed_up(engine: Engine, reply: dict) -> None:
    """Nothing reused: every prompt token was computed by this request."""
    stats = engine.stats[-1]
    assert cached(reply) == 0 and stats.reused_tokens == 0 and stats.computed_tokens == stats.prompt_tokens


def test_a_prompt_cached_by_one_tenant_is_not_a_hit_for_another(client, engine):
    first = chat(client, KEY_A)
    assert cached(first) == 0
    _no_speed_up(engine, chat(client, KEY_B))
    assert cached(chat(client, KEY_A)) >= first["usage"]["prompt_tokens"] - 16  # within A, reused
    for endpoint, body in (("/v1/completions", {"prompt": LONG, "max_tokens": 2}),
                           ("/v1/responses", {"input": LONG, "max_output_tokens": 2, "store": False})):
        body = {"model": MODEL, "temperature": 0.0, **body}
        engine.radix.clear()  # what B could then reuse, only A can have cached
        client.post(endpoint, json=body, headers=auth(KEY_A))
        b = client.post(endpoint, json=body, headers=auth(KEY_B)).json()
        _no_speed_up(engine, b)
        assert cached(client.post(endpoint, json=body, headers=auth(KEY_A)).json()) > 0


def test_cache_salt_isolates_within_a_tenant(client, engine):
    chat(client, KEY_A, cache_salt="user-1")
    _no_speed_up(engine, chat(client, KEY_A, cache_salt="user-2"))
    _no_speed_up(engine, chat(client, KEY_A))  # unsalted is a namespace of its own too
    assert cached(chat(client, KEY_A, cache_salt="user-1")) > 0
    _no_speed_up(engine, chat(client, KEY_B, cache_salt="user-1"))  # the same salt under another tenant


def test_a_session_keeps_the_cache_salt_it_was_made_with(client):
    chat(client, KEY_A, "hi", session_id="salted", cache_salt="u1")
    for salt in ("u2", None):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "session_id": "salted", **({"cache_salt": salt} if salt else {})}
        r = client.post("/v1/chat/completions", json=body, headers=auth(KEY_A))
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
    assert len(client.get("/v1/sessions/salted", headers=auth(KEY_A)).json()["turns"]) == 1


# Ownership.


def snapshot(client: TestClient, engine: Engine, key: str, tenant: Tenant) -> dict:
    """What a tenant's sessions are: as the API shows them, and their tokens and pages."""
    listed = client.get("/v1/sessions", headers=auth(key)).json()["data"]
    held = {id(s): (list(s.tokens), list(s.table.pages)) for s in client.app.state.api.sessions.sessions_of(tenant)}
    return {"listed": sorted(listed, key=lambda s: s["id"]), "held": sorted(held.values())}


def test_another_tenant_cannot_touch_a_session_by_id(client, engine):
    chat(client, KEY_A, "Next step: call get_weather with city=\"Oslo\".", session_id="agent-1")
    created = client.post("/v1/sessions", headers=auth(KEY_A)).json()["id"]
    assert created.startswith("sess_") and len(created) == len("sess_") + 32  # 128 random bits
    before = snapshot(client, engine, KEY_A, ALPHA)
    for session_id in ("agent-1", created):
        for method, path, body in (("GET", "", None), ("POST", "/fork", None), ("POST", "/truncate", {"length": 0}),
                                   ("POST", "/retain", {"seconds": 60}), ("POST", "/release", None),
                                   ("POST", "/restore", None), ("DELETE", "", None)):
            r = client.request(method, f"/v1/sessions/{session_id}{path}", headers=auth(KEY_B), json=body)
            assert r.status_code == 404, (session_id, path, r.text)
            assert r.json()["error"]["code"] == "session_not_found"
    assert client.get("/v1/sessions", headers=auth(KEY_B)).json()["data"] == []
    # The same client-chosen id under B is B's own, new session.
    reply = chat(client, KEY_B, "Next step: call get_weather with city=\"Oslo\".", session_id="agent-1")
    assert cached(reply) == 0
    assert [s["id"] for s in client.get("/v1/sessions", headers=auth(KEY_B)).json()["data"]] == ["agent-1"]
    assert snapshot(client, engine, KEY_A, ALPHA) == before


def test_another_tenant_cannot_read_continue_or_delete_a_response(client):
    body = {"model": MODEL, "input": "Say hello.", "max_output_tokens": 2}
    made = client.post("/v1/responses", json=body, headers=auth(KEY_A)).json()
    assert made["id"].startswith("resp_") and len(made["id"]) == len("resp_") + 32
    for method, path, extra in (("GET", f"/v1/responses/{made['id']}", None),
                                ("GET", f"/v1/responses/{made['id']}/input_items", None),
                                ("DELETE", f"/v1/responses/{made['id']}", None),
                                ("POST", "/v1/responses", {**body, "previous_response_id": made["id"]})):
        r = client.request(method, path, headers=auth(KEY_B), json=extra)
        assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found", (method, path)
    assert client.get(f"/v1/responses/{made['id']}", headers=auth(KEY_A)).json() == made
    again = client.post("/v1/responses", json={**body, "previous_response_id": made["id"]}, headers=auth(KEY_A))
    assert again.status_code == 200
    salted = client.post("/v1/responses", headers=auth(KEY_A),
                         json={**body, "previous_response_id": made["id"], "cache_salt": "u1"})
    assert salted.status_code == 400 and salted.json()["error"]["param"] == "cache_salt"


# Quotas.


@pytest.fixture
def quota_client(engine):
    engine.radix.clear()
    quotas = Quotas(max_sessions=2, max_responses=2, max_concurrent=1, max_kv_pages=12, max_body_bytes=4096,
                    default_max_tokens=5)
    with TestClient(create_app(engine, MODEL, keys=ApiKeys(KEYS), quotas=quotas)) as c:
        yield c


def test_session_quota_is_429_and_leaves_others_alone(quota_client, engine):
    c = quota_client
    for name in ("s1", "s2"):
        assert c.post("/v1/sessions", json={"session_id": name}, headers=auth(KEY_A)).status_code == 200
    free = engine.pool.num_free
    r = c.post("/v1/sessions", json={"session_id": "s3"}, headers=auth(KEY_A))
    assert r.status_code == 429 and r.json()["error"]["code"] == "quota_exceeded"
    r = c.post("/v1/chat/completions", headers=auth(KEY_A),
               json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "session_id": "s4"})
    assert r.status_code == 429
    assert c.post(f"/v1/sessions/s1/fork", headers=auth(KEY_A)).status_code == 429
    assert sorted(s["id"] for s in c.get("/v1/sessions", headers=auth(KEY_A)).json()["data"]) == ["s1", "s2"]
    assert engine.pool.num_free == free and len(c.app.state.api.sessions) == 2
    for name in ("s1", "s2"):  # B is not affected
        assert c.post("/v1/sessions", json={"session_id": name}, headers=auth(KEY_B)).status_code == 200
    assert c.delete("/v1/sessions/s2", headers=auth(KEY_A)).status_code == 200
    assert c.post("/v1/sessions", json={"session_id": "s3"}, headers=auth(KEY_A)).status_code == 200


def test_one_tenants_pins_never_make_another_tenants_request_fail():
    # Issue 42: alpha retaining sessions that filled the pool made bravo's
    # plain request a 503 (KV cache out of capacity). Pins are finite and
    # give way to running work; alpha's sessions keep their history.
    engine = Engine.from_pretrained(SMALL_MODEL_DIR, num_pages=40, kv_offload_bytes=0)
    with TestClient(create_app(engine, MODEL, keys=ApiKeys(KEYS))) as c:
        held = {}
        for name in ("p1", "p2", "p3"):
            chat(c, KEY_A, name + LONG, session_id=name)  # nothing shared: 13 pages each
            assert c.post(f"/v1/sessions/{name}/retain", json={"seconds": 600}, headers=auth(KEY_A)).status_code == 200
            held[name] = c.get(f"/v1/sessions/{name}", headers=auth(KEY_A)).json()["length"]
        assert engine.pool.num_free < 13  # bravo's prompt needs more than what is free
        chat(c, KEY_B, "bravo" + LONG)
        for name, length in held.items():
            assert c.get(f"/v1/sessions/{name}", headers=auth(KEY_A)).json()["length"] == length
        chat(c, KEY_A, "p1" + LONG, session_id="p1")  # a pin that gave way comes back by recompute


def test_response_quota_is_429_for_stored_responses_only(quota_client):
    c = quota_client
    body = {"model": MODEL, "input": "Say hello.", "max_output_tokens": 2}
    made = [c.post("/v1/responses", json=body, headers=auth(KEY_A)).json()["id"] for _ in range(2)]
    r = c.post("/v1/responses", json=body, headers=auth(KEY_A))
    assert r.status_code == 429 and r.json()["error"]["code"] == "quota_exceeded"
    assert c.post("/v1/responses", json={**body, "store": False}, headers=auth(KEY_A)).status_code == 200
    assert c.post("/v1/responses", json=body, headers=auth(KEY_B)).status_code == 200
    assert all(c.get(f"/v1/responses/{i}", headers=auth(KEY_A)).status_code == 200 for i in made)


def test_kv_page_quota_is_429_and_leaves_others_alone(quota_client, engine):
    c = quota_client
    chat(c, KEY_A, LONG, session_id="big")  # more than 12 pages of 16 tokens
    assert c.get("/v1/sessions/big", headers=auth(KEY_A)).json()["pages"] > 12
    r = c.post("/v1/chat/completions", headers=auth(KEY_A),
               json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 429 and "KV pages" in r.json()["error"]["message"]
    r = c.post("/v1/completions", headers=auth(KEY_A), json={"model": MODEL, "prompt": "hi"})
    assert r.status_code == 429
    chat(c, KEY_B, "hi")
    assert c.delete("/v1/sessions/big", headers=auth(KEY_A)).status_code == 200
    chat(c, KEY_A, "hi")


def test_a_body_over_the_limit_is_413_before_anything_runs(quota_client, engine):
    c = quota_client
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}], "session_id": "never"}
    r = c.post("/v1/chat/completions", json=big, headers=auth(KEY_A))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    chunks = (b'{"model": "%s", "prompt": "' % MODEL.encode(), b"y" * 5000, b'"}')
    r = c.post("/v1/completions", content=iter(chunks), headers={**auth(KEY_A), "Content-Type": "application/json"})
    assert r.status_code == 413
    assert c.get("/v1/sessions", headers=auth(KEY_A)).json()["data"] == []


def test_default_max_tokens_bounds_a_request_that_names_none(quota_client):
    reply = quota_client.post("/v1/chat/completions", headers=auth(KEY_A), json={
        "model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}], "ignore_eos": True}).json()
    assert reply["usage"]["completion_tokens"] == 5 and reply["choices"][0]["finish_reason"] == "length"


def test_concurrent_requests_past_the_quota_are_429_with_retry_after(quota_client, engine):
    c = quota_client
    engine.scheduler.stop()  # nobody steps: the first request stays in flight
    answers = {}
    first = threading.Thread(target=lambda: answers.setdefault("first", c.post(
        "/v1/completions", headers=auth(KEY_A), json={"model": MODEL, "prompt": "hi", "max_tokens": 2})))
    first.start()
    try:
        for _ in range(500):
            if engine.scheduler.waiting:
                break
            time.sleep(0.01)
        r = c.get("/v1/sessions", headers=auth(KEY_A))
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert c.get("/v1/sessions", headers=auth(KEY_B)).status_code == 200
    finally:
        engine.scheduler.start()
    first.join(60)
    assert answers["first"].status_code == 200
    assert c.get("/v1/sessions", headers=auth(KEY_A)).status_code == 200


def test_the_gate_counts_a_stream_until_it_ends():
    """At the ASGI level: a response still streaming holds its tenant's slot."""
    release = asyncio.Event()

    async def streaming(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await release.wait()
        await send({"type": "http.response.body", "body": b"done"})

    gate = Gate(streaming, ApiKeys(KEYS), Quotas(max_concurrent=1), frozenset())

    async def call(key: str) -> list[dict]:
        sent = []

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            sent.append(message)
        scope = {"type": "http", "path": "/v1/x", "headers": [(b"authorization", f"Bearer {key}".encode())]}
        await gate(scope, receive, send)
        return sent

    async def main() -> None:
        held = asyncio.ensure_future(call(KEY_A))
        await asyncio.sleep(0.01)
        assert gate.in_flight("alpha") == 1
        refused = await call(KEY_A)
        assert refused[0]["status"] == 429
        release.set()
        assert (await held)[0]["status"] == 200 and gate.in_flight("alpha") == 0
        assert (await call(KEY_A))[0]["status"] == 200

    asyncio.run(main())


# Random interleavings: nothing one tenant does changes what the other sees.

IDS = st.sampled_from(["agent-1", "agent-2", "shared"])
TENANTS = st.sampled_from([(KEY_A, ALPHA), (KEY_B, BRAVO)])


class TwoTenants(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.engine = shared_engine()
        self.client = TestClient(create_app(self.engine, MODEL, keys=ApiKeys(KEYS)))
        self.client.__enter__()
        self.seen = {tenant: snapshot(self.client, self.engine, key, tenant) for key, tenant in ((KEY_A, ALPHA), (KEY_B, BRAVO))}

    def act(self, who: tuple[str, Tenant], method: str, path: str, body: dict | None = None) -> None:
        key, tenant = who
        other_key, other = (KEY_B, BRAVO) if tenant == ALPHA else (KEY_A, ALPHA)
        r = self.client.request(method, path, headers=auth(key), json=body)
        assert r.status_code in (200, 400, 404, 409), r.text
        assert snapshot(self.client, self.engine, other_key, other) == self.seen[other]
        self.seen[tenant] = snapshot(self.client, self.engine, key, tenant)

    @rule(who=TENANTS, session_id=IDS, word=st.sampled_from(["alpha", "bravo", "delta"]))
    def chat(self, who, session_id, word):
        self.act(who, "POST", "/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": f"Tell me about {word}."}], "max_tokens": 2,
            "temperature": 0.0, "session_id": session_id})

    @rule(who=TENANTS, session_id=IDS)
    def create(self, who, session_id):
        self.act(who, "POST", "/v1/sessions", {"session_id": session_id})

    @rule(who=TENANTS, session_id=IDS, length=st.integers(0, 12))
    def truncate(self, who, session_id, length):
        self.act(who, "POST", f"/v1/sessions/{session_id}/truncate", {"length": length})

    @rule(who=TENANTS, session_id=IDS)
    def fork(self, who, session_id):
        self.act(who, "POST", f"/v1/sessions/{session_id}/fork")

    @rule(who=TENANTS, session_id=IDS, op=st.sampled_from(["retain", "release", "restore"]))
    def retention(self, who, session_id, op):
        self.act(who, "POST", f"/v1/sessions/{session_id}/{op}", {"seconds": 30} if op == "retain" else None)

    @rule(who=TENANTS, session_id=IDS)
    def delete(self, who, session_id):
        self.act(who, "DELETE", f"/v1/sessions/{session_id}")

    @invariant()
    def pages_are_accounted(self):
        self.engine.pool.check()

    def teardown(self) -> None:
        self.client.__exit__(None, None, None)


TestTwoTenantsInterleaved = settings(max_examples=12, stateful_step_count=10, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])(TwoTenants).TestCase


def test_two_tenants_sessions_of_one_id_are_saved_and_resumed_apart(tmp_path):
    def server() -> TestClient:
        engine = Engine.from_pretrained(SMALL_MODEL_DIR, num_pages=256, kv_offload_dir=tmp_path / "kv")
        return TestClient(create_app(engine, MODEL, state_dir=tmp_path, keys=ApiKeys(KEYS)))

    with server() as c:
        chat(c, KEY_A, "Tell me about alpha.", session_id="agent-1")
        chat(c, KEY_B, "Tell me about bravo, at length, please.", session_id="agent-1")
        before = {key: c.get("/v1/sessions/agent-1", headers=auth(key)).json() for key in (KEY_A, KEY_B)}
        assert before[KEY_A]["length"] != before[KEY_B]["length"]
    with server() as c:
        after = {key: c.get("/v1/sessions/agent-1", headers=auth(key)).json() for key in (KEY_A, KEY_B)}
        assert c.get("/v1/sessions", headers=auth(KEY_A)).json()["reports"] == []  # not shown with keys
    for key in (KEY_A, KEY_B):
        assert (after[key]["length"], after[key]["turns"]) == (before[key]["length"], before[key]["turns"])


def test_a_tenants_session_quota_counts_its_sessions_on_every_replica(tmp_path):
    """Two replicas sharing one state directory: the sessions a tenant made on
    one count on the other, a session taken up from the folder is one it
    already holds (continuing it is no new session), and a deletion on either
    frees its place on both."""
    quotas = Quotas(max_sessions=2)

    def replica() -> TestClient:
        engine = Engine.from_pretrained(SMALL_MODEL_DIR, num_pages=256, kv_offload_dir=tmp_path / "kv", kv_resume=False)
        return TestClient(create_app(engine, MODEL, state_dir=tmp_path, keys=ApiKeys(KEYS), quotas=quotas,
                                     shared_state=True))

    with replica() as a, replica() as b:
        for name in ("s1", "s2"):
            assert a.post("/v1/sessions", json={"session_id": name}, headers=auth(KEY_A)).status_code == 200
        r = b.post("/v1/sessions", json={"session_id": "s3"}, headers=auth(KEY_A))
        assert r.status_code == 429 and "holds 2 live sessions" in r.json()["error"]["message"]
        r = b.post("/v1/chat/completions", headers=auth(KEY_A),
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "session_id": "s4"})
        assert r.status_code == 429
        chat(b, KEY_A, "Continue on the other replica.", session_id="s1")  # taken up: held already
        assert b.get("/v1/sessions/s1", headers=auth(KEY_A)).json()["turns"]
        assert b.post("/v1/sessions/s1/fork", headers=auth(KEY_A)).status_code == 429
        assert b.post("/v1/sessions", json={"session_id": "s3"}, headers=auth(KEY_B)).status_code == 200
        assert a.delete("/v1/sessions/s2", headers=auth(KEY_A)).status_code == 200
        assert b.post("/v1/sessions", json={"session_id": "s3"}, headers=auth(KEY_A)).status_code == 200
        r = a.post("/v1/sessions", json={"session_id": "s5"}, headers=auth(KEY_A))
        assert r.status_code == 429


def test_a_state_folder_of_the_earlier_record_names_resumes_once(tmp_path):
    """Records named before names began with their tenant's digest are renamed
    on resume: a session saved later is not shadowed by its old record."""
    from agentkv.engine.api import session_files

    def server() -> TestClient:
        engine = Engine.from_pretrained(SMALL_MODEL_DIR, num_pages=256, kv_offload_dir=tmp_path / "kv")
        return TestClient(create_app(engine, MODEL, state_dir=tmp_path, keys=ApiKeys(KEYS)))

    with server() as c:
        chat(c, KEY_A, "Tell me about alpha.", session_id="agent-1")
    folder = tmp_path / "sessions"
    (record,) = folder.glob("*.json")
    record.rename(folder / f"{session_files._legacy_name('alpha', 'agent-1')}.json")
    with server() as c:
        chat(c, KEY_A, "And more.", session_id="agent-1")
        turns = c.get("/v1/sessions/agent-1", headers=auth(KEY_A)).json()["turns"]
    assert len(list(folder.glob("*.json"))) == 1
    with server() as c:
        assert c.get("/v1/sessions/agent-1", headers=auth(KEY_A)).json()["turns"] == turns
