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
