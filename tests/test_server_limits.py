"""Admission over HTTP: a request the KV pool can never hold is a 413 at
once, a full queue is a 429 with Retry-After, and neither changes anything;
many clients against a pool smaller than their working set all complete."""
from __future__ import annotations

import threading
import time

import pytest
from fastapi.testclient import TestClient

from agentkv import Engine
from agentkv.engine.api import create_app
from agentkv.engine.limits import Limits
from agentkv.model.default import SMALL_MODEL_DIR

MODEL = "agentkv-limits"


def chat_body(content: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}


@pytest.fixture
def small():
    engine = Engine.from_pretrained(SMALL_MODEL_DIR, num_pages=12, limits=Limits(max_queue=1))  # 192 tokens of KV
    with TestClient(create_app(engine, MODEL)) as client:
        yield engine, client


def test_a_prompt_the_pool_can_never_hold_is_413_and_changes_nothing(small):
    engine, client = small
    free = engine.pool.num_free
    r = client.post("/v1/chat/completions", json=chat_body("word " * 400, session_id="huge"))
    assert r.status_code == 413 and r.json()["error"]["code"] == "kv_capacity_exceeded"
    assert client.get("/v1/sessions/huge").json()["length"] == 0
    assert engine.pool.num_free == free and engine.scheduler.in_flight == 0
    assert client.post("/v1/chat/completions", json=chat_body("hi")).status_code == 200


def test_a_full_queue_is_429_with_retry_after_and_changes_nothing(small):
    engine, client = small
    engine.scheduler.stop()  # nobody steps: what is submitted stays queued
    answers = {}

    def send(name: str) -> None:
        answers[name] = client.post("/v1/chat/completions", json=chat_body(f"ask {name}", session_id=name))

    queued = threading.Thread(target=send, args=("queued",))
    queued.start()
    try:
        for _ in range(500):
            if engine.scheduler.waiting:
                break
            time.sleep(0.01)
        assert len(engine.scheduler.waiting) == 1
        r = client.post("/v1/chat/completions", json=chat_body("one too many", session_id="refused"))
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "server_busy"
        info = client.get("/v1/sessions/refused").json()
        assert (info["length"], info["pages"], info["busy"], info["turns"]) == (0, 0, False, [])
        assert len(engine.scheduler.waiting) == 1
    finally:
        engine.scheduler.start()
    queued.join(60)
    assert answers["queued"].status_code == 200


@pytest.mark.slow
def test_a_pin_is_always_finite_and_capped():
    # Issue 42: `retain` with no seconds used to pin a session's KV until it
    # was released, so one client could hold the pool for good.
    engine = Engine.from_pretrained(SMALL_MODEL_DIR, num_pages=64, limits=Limits(max_retain_s=0.5))
    with TestClient(create_app(engine, MODEL)) as client:
        assert client.post("/v1/chat/completions", json=chat_body("hi", session_id="s", max_tokens=2)).status_code == 200
        before = client.get("/v1/sessions/s").json()
        for body in ({"seconds": 0.51}, {"seconds": 1e9}):
            r = client.post("/v1/sessions/s/retain", json=body)
            assert r.status_code == 400 and r.json()["error"]["code"] == "retain_too_long"
            assert "0.5 seconds" in r.json()["error"]["message"]
            assert client.get("/v1/sessions/s").json() == before  # changed nothing
        for body in ({}, {"seconds": None}, {"seconds": 0.5}):
            assert client.post("/v1/sessions/s/retain", json=body).json()["pinned"] is True
            time.sleep(0.6)
            assert client.get("/v1/sessions/s").json()["pinned"] is False  # the pin ran out


def test_limits_refuse_an_unbounded_pin():
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="max_retain_s"):
            Limits(max_retain_s=bad)


@pytest.mark.slow
def test_named_sessions_and_stored_responses_outlive_the_idle_timeout():
    # Issue 42: the idle timeout closed every idle session, those that a named
    # session or a stored response names included: continuing the response
    # was a 404, and the next turn on the session id began empty. Now their
    # KV leaves the pool and the record stays; the next turn restores or
    # recomputes it and answers as with no timeout.
    engine = Engine.from_pretrained(SMALL_MODEL_DIR, num_pages=64, limits=Limits(session_idle_timeout=0.2))
    with TestClient(create_app(engine, MODEL)) as client:
        first = client.post("/v1/chat/completions", json=chat_body("Plan a trip to Osaka.", session_id="trip"))
        assert first.status_code == 200
        made = client.post("/v1/responses", json={"model": MODEL, "input": "Say hello.", "max_output_tokens": 3})
        assert made.status_code == 200
        held = client.get("/v1/sessions/trip").json()
        time.sleep(2.5)  # the scheduler looks for idle sessions once a second
        after = client.get("/v1/sessions/trip").json()
        assert after["length"] == held["length"] > 0 and held["pages"] > 0 == after["pages"]
        history = [{"role": "user", "content": "Plan a trip to Osaka."}, first.json()["choices"][0]["message"],
                   {"role": "user", "content": "And then Kyoto?"}]
        second = client.post("/v1/chat/completions", json={**chat_body("", session_id="trip"), "messages": history})
        assert second.status_code == 200 and second.json()["usage"]["prompt_tokens"] > held["length"]
        assert client.get("/v1/sessions/trip").json()["length"] > held["length"]
        cont = client.post("/v1/responses", json={"model": MODEL, "input": "Again.", "max_output_tokens": 3,
                                                  "previous_response_id": made.json()["id"]})
        assert cont.status_code == 200, cont.text
        assert cont.json()["usage"]["input_tokens"] > made.json()["usage"]["input_tokens"]
        # The engine holds the sessions the records name: trip and the two responses'.
        assert len(engine.sequences.all) == 3
