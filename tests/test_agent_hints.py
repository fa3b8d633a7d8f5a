"""Agent hints over HTTP: the X-Tool-Expected-Seconds header pins a session's
KV for the pause the client says comes before its next turn (its tools' run
time, or its user's after an answer), within the retention cap, instead of
the learned estimate; a bad value is a 400 naming it that changes nothing; without it,
the pause after an answer is learned from the tenant's own sessions; a
session's end (DELETE) frees its program's place."""
from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from agentkv import Engine
from agentkv.engine.api import create_app
from agentkv.engine.retention import RetentionConfig
from agentkv.model.default import SMALL_MODEL_DIR
from tests.test_tenancy import MODEL

MARGIN, CAP = 1.5, 300.0


@pytest.fixture
def client():
    engine = Engine.from_pretrained(SMALL_MODEL_DIR, num_pages=128,
                                    retention=RetentionConfig(margin=MARGIN, tool_ttl_cap=CAP, final_ttl=0.0))
    with TestClient(create_app(engine, MODEL)) as c:
        c.engine = engine
        yield c


def turn(client: TestClient, session_id: str, content: str, **headers: str):
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2, "temperature": 0.0}
    return client.post("/v1/chat/completions", json=body, headers={"X-Session-Id": session_id, **headers})


def info(client: TestClient, session_id: str) -> dict:
    r = client.get(f"/v1/sessions/{session_id}")
    assert r.status_code == 200, r.text
    return r.json()


def pin_left(client: TestClient) -> float:
    """Seconds the one named session's pin still runs (the engine's view: its
    info says only whether it is pinned)."""
    [seq] = [s for s in client.engine.scheduler.sequences.all if s.counted and len(s)]
    return max(0.0, seq.pin_ttl - (time.monotonic() - seq.idle_since))


def test_the_expected_pause_pins_the_session_for_it(client):
    r = turn(client, "agent", "hello", **{"X-Tool-Expected-Seconds": "40"})
    assert r.status_code == 200, r.text
    assert info(client, "agent")["pinned"] and 40 * MARGIN - 5 < pin_left(client) <= 40 * MARGIN
    turn(client, "agent", "hello again", **{"X-Tool-Expected-Seconds": "3000"})
    assert CAP - 5 < pin_left(client) <= CAP  # the client's word, within the cap


def test_a_bad_expected_pause_is_refused_and_changes_nothing(client):
    assert turn(client, "agent", "hello").status_code == 200
    before = info(client, "agent")
    for bad in ("-1", "soon", "nan", "1e9"):
        r = turn(client, "agent", "more", **{"X-Tool-Expected-Seconds": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "x-tool-expected-seconds", (bad, r.text)
    after = info(client, "agent")
    assert after["length"] == before["length"] and len(after["turns"]) == len(before["turns"])


def test_without_hints_the_pause_after_an_answer_is_learned(client):
    assert turn(client, "agent", "hello").status_code == 200
    assert pin_left(client) == 0.0 and not info(client, "agent")["pinned"]  # nothing seen yet: final_ttl
    time.sleep(0.5)
    assert turn(client, "agent", "next").status_code == 200  # a pause of about half a second observed
    pause = client.engine.scheduler.policy.retention.answer_estimate()["pause_s"]
    assert 0.4 < pause < 5.0
    assert pin_left(client) > 0 and info(client, "agent")["pinned"]  # pinned for it (the retention floor at least)


def test_a_sessions_end_frees_its_programs_place(client):
    programs = client.engine.scheduler.programs
    assert turn(client, "agent", "hello", **{"X-Tool-Expected-Seconds": "100"}).status_code == 200
    assert len(programs.admitted) == 1  # paused inside its pin: it keeps its place
    assert client.delete("/v1/sessions/agent").status_code == 200
    deadline = time.monotonic() + 5
    while programs.admitted and time.monotonic() < deadline:
        time.sleep(0.05)  # the serving loop's next pass
    assert not programs.admitted
