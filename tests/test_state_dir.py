"""Sessions kept across restarts (serve.py --state-dir): a server killed
with SIGKILL after some turns is replaced by one that resumes every session,
restoring its KV from disk, with replies equal to an uninterrupted run; a
corrupted page file or KV saved for another model is reported and that
session recomputes; a restore of an unknown session is a 404."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from agentkv import Engine
from agentkv.engine.api import create_app
from agentkv.engine.api.tenants import OPEN_TENANT, Tenant
from agentkv.model.default import SMALL_MODEL_DIR

MODEL = "agentkv-state"
ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = ["Read the file notes/todo.md and list what is open.", "Now summarise the first item.",
             "And the second one?", "Which of them is the oldest?"]


def turns(post, session_id: str, questions: list[str], history: list[dict]) -> list[dict]:
    """Chat turns on one session; each re-sends the history, as agents do."""
    replies = []
    for q in questions:
        history.append({"role": "user", "content": q})
        r = post({"model": MODEL, "messages": history, "max_tokens": 40, "temperature": 0.0,
                  "session_id": session_id})
        message = r["choices"][0]["message"]
        history.append({"role": "assistant", "content": message["content"] or "", "tool_calls": message["tool_calls"]}
                       if message.get("tool_calls") else {"role": "assistant", "content": message["content"] or ""})
        replies.append(r)
    return replies


def said(replies: list[dict]) -> list[tuple]:
    """What each reply says: its text and its calls (names and arguments)."""
    out = []
    for r in replies:
        m = r["choices"][0]["message"]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or []]
        out.append((m["content"], calls))
    return out


def in_process(state: Path | None, **engine_kwargs):
    kv = state / "kv" if state is not None else None
    engine = Engine.from_pretrained(SMALL_MODEL_DIR, num_pages=256, kv_offload_dir=kv, **engine_kwargs)
    return TestClient(create_app(engine, MODEL, state_dir=state))


def held_session(client: TestClient):
    """The open server's one session."""
    (session,) = client.app.state.api.sessions.sessions_of(Tenant(OPEN_TENANT))
    return session


def post_with(client: TestClient):
    def post(body: dict) -> dict:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()
    return post


@pytest.fixture(scope="module")
def uninterrupted() -> list[tuple]:
    with in_process(None) as client:
        return said(turns(post_with(client), "a", QUESTIONS, []))


def test_clean_restart_resumes_sessions_from_disk(tmp_path, uninterrupted):
    history: list[dict] = []
    with in_process(tmp_path) as client:
        first = turns(post_with(client), "a", QUESTIONS[:2], history)
        length = client.get("/v1/sessions/a").json()["length"]
        log = held_session(client).message_log
        assert log is not None
    with in_process(tmp_path) as client:
        assert held_session(client).message_log == log  # the next turn continues natively
        listed = client.get("/v1/sessions").json()
        assert [s["id"] for s in listed["data"]] == ["a"] and listed["reports"] == []
        info = listed["data"][0]
        assert info["length"] == length and info["pages"] == 0
        assert info["tier_tokens"] == length - 1  # the reply's last token is held, its KV computed next turn
        assert len(info["turns"]) == 2
        rest = turns(post_with(client), "a", QUESTIONS[2:], history)
        # The resumed session's KV came from disk: only the new turn's tokens were computed.
        u = rest[0]["usage"]
        assert u["prompt_tokens_details"]["cached_tokens"] >= length - 1
        metrics = client.get("/metrics").text
        assert "agentkv_kv_restored_tokens_total" in metrics
    assert said(first + rest) == uninterrupted


def test_corrupt_kv_is_reported_and_the_session_recomputes(tmp_path, uninterrupted):
    history: list[dict] = []
    with in_process(tmp_path) as client:
        first = turns(post_with(client), "a", QUESTIONS[:2], history)
        key_dirs = [p for p in (tmp_path / "kv").iterdir() if p.is_dir()]
    # The last piece's file, the newest: an older file's tail may be a piece since replaced.
    newest = key_dirs[0] / json.loads((key_dirs[0] / "manifest.json").read_text())["pieces"][-1]["file"]
    raw = bytearray(newest.read_bytes())
    raw[-9] ^= 0x5A
    newest.write_bytes(bytes(raw))
    with in_process(tmp_path) as client:
        listed = client.get("/v1/sessions").json()
        assert [s["id"] for s in listed["data"]] == ["a"]  # the session stays, its KV does not
        assert any("checksum" in r for r in listed["reports"])
        assert listed["data"][0]["tier_tokens"] == 0
        rest = turns(post_with(client), "a", QUESTIONS[2:], history)
        assert rest[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # recomputed, never served wrong
    assert said(first + rest) == uninterrupted


def test_kv_of_another_layout_is_refused(tmp_path):
    with in_process(tmp_path) as client:
        turns(post_with(client), "a", QUESTIONS[:1], [])
    with in_process(tmp_path, page_size=32) as client:
        listed = client.get("/v1/sessions").json()
        assert any("another model or layout" in r for r in listed["reports"])
        assert listed["data"][0]["tier_tokens"] == 0


def test_unknown_session_restore_is_404_and_changes_nothing(tmp_path):
    with in_process(tmp_path) as client:
        turns(post_with(client), "a", QUESTIONS[:1], [])
        before = client.get("/v1/sessions").json()
        r = client.post("/v1/sessions/nobody/restore")
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
        assert client.get("/v1/sessions").json() == before
        assert client.post("/v1/sessions/a/restore").status_code == 200


def test_deleted_session_is_not_resumed(tmp_path):
    with in_process(tmp_path) as client:
        turns(post_with(client), "a", QUESTIONS[:1], [])
        turns(post_with(client), "b", QUESTIONS[:1], [])
        assert client.delete("/v1/sessions/a").status_code == 200
    with in_process(tmp_path) as client:
        assert [s["id"] for s in client.get("/v1/sessions").json()["data"]] == ["b"]
    assert len([p for p in (tmp_path / "kv").iterdir() if p.is_dir()]) == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(state: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "serve.py", "--port", str(port), "--model", "models/agent-8m", "--served-model-name", MODEL, "--kv-cache-gb", "0.01",
         "--state-dir", str(state)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise AssertionError(proc.stderr.read().decode())
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("the server did not become ready")


@pytest.mark.slow
def test_sigkill_then_restart_resumes_with_equal_replies(tmp_path, uninterrupted):
    client_kwargs = dict(api_key="unused", max_retries=0, timeout=60)
    history: list[dict] = []

    def post_over(url: str):
        client = openai.OpenAI(base_url=url + "/v1", **client_kwargs)

        def post(body: dict) -> dict:
            sid = body.pop("session_id")
            return client.chat.completions.create(**body, extra_body={"session_id": sid}).model_dump()
        return post

    proc, url = _start(tmp_path)
    try:
        first = turns(post_over(url), "agent-1", QUESTIONS[:2], history)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    proc, url = _start(tmp_path)
    try:
        info = httpx.get(url + "/v1/sessions/agent-1").json()
        assert info["tier_tokens"] == info["length"] - 1 > 0
        rest = turns(post_over(url), "agent-1", QUESTIONS[2:], history)
        assert rest[0]["usage"]["prompt_tokens_details"]["cached_tokens"] >= info["length"] - 1
    finally:
        proc.terminate()
        proc.wait(30)
    assert said(first + rest) == uninterrupted


@pytest.mark.slow
def test_stored_responses_continue_after_a_restart(tmp_path):
    def respond(client: TestClient, text: str, previous: str | None) -> dict:
        body = {"model": MODEL, "input": text, "max_output_tokens": 24, "temperature": 0.0}
        if previous:
            body["previous_response_id"] = previous
        r = client.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    with in_process(None) as client:
        a = respond(client, QUESTIONS[0], None)
        want = respond(client, QUESTIONS[1], a["id"])["output"]
    with in_process(tmp_path) as client:
        a = respond(client, QUESTIONS[0], None)
    with in_process(tmp_path) as client:
        b = respond(client, QUESTIONS[1], a["id"])
        assert b["usage"]["input_tokens_details"]["cached_tokens"] > 0  # its KV came back from disk
        assert client.get(f"/v1/responses/{a['id']}").status_code == 200
        assert client.delete(f"/v1/responses/{a['id']}").status_code == 200
    strip = lambda out: [{k: v for k, v in item.items() if k != "id"} for item in out]  # noqa: E731
    assert strip(b["output"]) == strip(want)
    with in_process(tmp_path) as client:  # a deleted response stays deleted
        assert client.get(f"/v1/responses/{a['id']}").status_code == 404
        assert client.get(f"/v1/responses/{b['id']}").status_code == 200
