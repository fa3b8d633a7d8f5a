"""The server-wide session limit (--max-sessions) over HTTP, two tenants on
the embedded default model: it counts live named sessions (a turn's working
fork, a request without a session and stored responses aside), a turn on a
session held at the limit closes nothing, and whatever would make one more
session, any tenant's, is a 429 naming the limit that changes nothing.
Issue 56: the fork of own-3's turn closed own-0, and bravo's first chat on a
new session id was a 404 "the session is closed". (Issue 42's answer, that
the limit closes the requester's own longest idle session, closed sessions
their clients still held: it refuses instead.) The other limits on what a
client holds tell it too: a tenant at its quota of stored responses is
refused, responses it is still generating counted, rather than its oldest
erased, and a response the store's limit expired says so."""
from __future__ import annotations

import threading
import time

import pytest
from fastapi.testclient import TestClient

from agentkv import Engine
from agentkv.engine.api import create_app
from agentkv.engine.api.quotas import Quotas
from agentkv.engine.api.tenants import ApiKeys
from agentkv.engine.limits import Limits
from agentkv.model.default import SMALL_MODEL_DIR
from tests.test_tenancy import KEY_A, KEY_B, KEYS, MODEL, auth, chat

LIMIT = 4
OWN = [f"own-{i}" for i in range(LIMIT)]


def turn(client: TestClient, key: str, session_id: str, content: str = "hello"):
    """A chat turn on the session X-Session-Id names (made on first use)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2, "temperature": 0.0}
    return client.post("/v1/chat/completions", json=body, headers={**auth(key), "X-Session-Id": session_id})


def held(client: TestClient, key: str) -> dict[str, dict]:
    """The tenant's sessions, by id."""
    return {s["id"]: s for s in client.get("/v1/sessions", headers=auth(key)).json()["data"]}


def assert_refused_by_the_limit(r) -> None:
    assert r.status_code == 429, r.text
    assert r.json() == {"error": {
        "message": f"the server holds its limit of {LIMIT} live sessions (--max-sessions); delete one "
                   "(DELETE /v1/sessions/{id}) first",
        "type": "server_error", "param": None, "code": "session_limit_reached"}}
    assert "retry-after" not in r.headers  # waiting frees no session


@pytest.fixture
def engine() -> Engine:
    return Engine.from_pretrained(SMALL_MODEL_DIR, num_pages=128, limits=Limits(max_sessions=LIMIT))


@pytest.fixture
def full(engine):
    """A server whose limit alpha's four named sessions (one turn each) fill."""
    with TestClient(create_app(engine, MODEL, keys=ApiKeys(KEYS))) as c:
        for i, name in enumerate(OWN):
            assert turn(c, KEY_A, name, f"hello {name}").status_code == 200
            # Each turn worked on a fork beside the sessions made so far: none was closed for it.
            assert sorted(held(c, KEY_A)) == OWN[: i + 1]
        assert all(s["length"] > 0 and s["turns"] for s in held(c, KEY_A).values())
        yield c


def test_the_owners_turn_at_the_limit_closes_none_of_its_sessions(full):
    c = full
    before = held(c, KEY_A)
    assert turn(c, KEY_A, "own-0", "and again").status_code == 200
    after = held(c, KEY_A)
    assert sorted(after) == OWN and after["own-0"]["turns"][:-1] == before["own-0"]["turns"]
    assert len(after["own-0"]["turns"]) == 2
    assert {n: after[n] for n in OWN[1:]} == {n: before[n] for n in OWN[1:]}


def test_every_session_takes_a_turn_at_once_at_the_limit(full, engine):
    # Four turns in flight hold four forks beside the four sessions: twice the limit, all legitimate.
    c = full
    before = held(c, KEY_A)
    answers: dict[str, int] = {}
    engine.scheduler.stop()  # nobody steps: every turn stays in flight, its fork open
    threads = [threading.Thread(target=lambda n=n: answers.__setitem__(n, turn(c, KEY_A, n, "go on").status_code))
               for n in OWN]
    try:
        for t in threads:
            t.start()
        for _ in range(1000):
            if len(engine.scheduler.waiting) == LIMIT:
                break
            time.sleep(0.01)
        assert len(engine.scheduler.waiting) == LIMIT and len(engine.sequences.all) == 2 * LIMIT
        # A newcomer meanwhile is refused by the limit, whoever asks.
        assert_refused_by_the_limit(turn(c, KEY_B, "newcomer"))
        assert_refused_by_the_limit(turn(c, KEY_A, "own-4"))
    finally:
        engine.scheduler.start()
    for t in threads:
        t.join(120)
    assert answers == {n: 200 for n in OWN}
    after = held(c, KEY_A)
    assert sorted(after) == OWN
    assert all(after[n]["turns"][:-1] == before[n]["turns"] and len(after[n]["turns"]) == 2 for n in OWN)
    assert len(engine.sequences.all) == LIMIT  # the forks are gone with their turns


def test_a_newcomer_at_the_limit_is_429_naming_it_and_changes_nothing(full, engine):
    c = full
    before, free = held(c, KEY_A), engine.pool.num_free
    assert_refused_by_the_limit(turn(c, KEY_B, "newcomer"))
    assert_refused_by_the_limit(c.post("/v1/sessions", json={"session_id": "newcomer"}, headers=auth(KEY_B)))
    # The owner of every session gets the same answer: none of its own is closed to make room.
    assert_refused_by_the_limit(turn(c, KEY_A, "own-4"))
    assert_refused_by_the_limit(c.post("/v1/sessions", headers=auth(KEY_A)))
    assert_refused_by_the_limit(c.post("/v1/sessions/own-1/fork", headers=auth(KEY_A)))
    assert held(c, KEY_A) == before and held(c, KEY_B) == {}
    assert c.get("/v1/sessions/newcomer", headers=auth(KEY_B)).status_code == 404  # it was never made
    assert engine.pool.num_free == free
    # What holds no named session does not count.
    chat(c, KEY_B, "a request without a session")
    r = c.post("/v1/responses", json={"model": MODEL, "input": "Say hello.", "max_output_tokens": 2},
               headers=auth(KEY_B))
    assert r.status_code == 200, r.text
    assert held(c, KEY_A) == before
    # A deleted session makes room; the newcomer's first chat then makes it.
    assert c.delete("/v1/sessions/own-1", headers=auth(KEY_A)).status_code == 200
    assert turn(c, KEY_B, "newcomer").status_code == 200
    assert held(c, KEY_B)["newcomer"]["length"] > 0
    assert sorted(held(c, KEY_A)) == ["own-0", "own-2", "own-3"]
    assert_refused_by_the_limit(turn(c, KEY_A, "own-1"))


def test_sessions_saved_past_a_lower_limit_are_reported_and_kept_for_a_higher_one(tmp_path):
    def server(limit: int) -> TestClient:
        engine = Engine.from_pretrained(SMALL_MODEL_DIR, num_pages=128, kv_offload_dir=tmp_path / "kv",
                                        limits=Limits(max_sessions=limit))
        return TestClient(create_app(engine, MODEL, state_dir=tmp_path))

    with server(LIMIT) as c:
        for name in OWN:
            assert turn(c, None, name, f"hello {name}").status_code == 200
        saved = {n: (s["length"], s["turns"]) for n, s in held(c, None).items()}
    with server(LIMIT - 1) as c:
        listed = c.get("/v1/sessions").json()
        assert len(listed["data"]) == LIMIT - 1
        assert f"1 of {LIMIT} saved sessions were not resumed: the engine holds its limit of {LIMIT - 1} live " \
               "sessions; close one first" in listed["reports"]
    with server(LIMIT) as c:  # nothing of the one left out was lost
        assert {n: (s["length"], s["turns"]) for n, s in held(c, None).items()} == saved
        assert not c.get("/v1/sessions").json()["reports"]


def respond(client: TestClient, key: str, **extra):
    body = {"model": MODEL, "input": "Say hello.", "max_output_tokens": 2, **extra}
    return client.post("/v1/responses", json=body, headers=auth(key))


def test_responses_generating_count_toward_the_quota_and_none_is_erased_for_them(engine):
    # They were checked against what the tenant held when each began: three at
    # once against a quota of two all stored, and the first was silently erased.
    with TestClient(create_app(engine, MODEL, keys=ApiKeys(KEYS), quotas=Quotas(max_responses=2))) as c:
        answers = []
        engine.scheduler.stop()  # nobody steps: what is admitted stays in flight
        threads = [threading.Thread(target=lambda: answers.append(respond(c, KEY_A))) for _ in range(3)]
        try:
            for t in threads:
                t.start()
            for _ in range(1000):
                if len(engine.scheduler.waiting) == 2 and answers:
                    break
                time.sleep(0.01)
            # Two are admitted; the third is refused at once, not generated and stored over the first.
            assert len(engine.scheduler.waiting) == 2 and len(answers) == 1
            r = answers[0]
            assert r.status_code == 429 and r.json()["error"]["code"] == "quota_exceeded", r.text
            assert "holds 2 stored responses" in r.json()["error"]["message"]
        finally:
            engine.scheduler.start()
        for t in threads:
            t.join(120)
        assert sorted(a.status_code for a in answers) == [200, 200, 429]
        for a in answers[1:]:
            assert c.get(f"/v1/responses/{a.json()['id']}", headers=auth(KEY_A)).status_code == 200
        assert respond(c, KEY_A).status_code == 429
        assert respond(c, KEY_B).status_code == 200


def test_a_response_the_store_expired_says_so(engine):
    with TestClient(create_app(engine, MODEL, max_stored_responses=2, keys=ApiKeys(KEYS))) as c:
        first, second, third = (respond(c, KEY_A).json()["id"] for _ in range(3))
        for r in (c.get(f"/v1/responses/{first}", headers=auth(KEY_A)),
                  respond(c, KEY_A, previous_response_id=first)):
            assert r.status_code == 404
            assert r.json()["error"] == {
                "message": f"response {first!r} expired: the server keeps 2 stored responses (--max-stored-responses) "
                           "and it was the least recently used of the tenant holding the most; send the whole "
                           "conversation instead",
                "type": "invalid_request_error", "param": "previous_response_id", "code": "response_expired"}
        # To another tenant it never existed; one its owner deleted is simply gone.
        assert c.get(f"/v1/responses/{first}", headers=auth(KEY_B)).json()["error"]["code"] == "response_not_found"
        assert c.delete(f"/v1/responses/{second}", headers=auth(KEY_A)).status_code == 200
        assert c.get(f"/v1/responses/{second}", headers=auth(KEY_A)).json()["error"]["code"] == "response_not_found"
        assert respond(c, KEY_A, previous_response_id=third).status_code == 200
