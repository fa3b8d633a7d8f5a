"""serve.py's command line: what reaches uvicorn. An agent resumes after a
tool pause on the connection its client kept alive; if the server closes idle
connections first, the request lands on a closing socket and the agent sees
a connection error (bench_agents hit one with uvicorn's default of 5 s)."""
from __future__ import annotations

import sys

import openai
import pytest
import uvicorn

from agentkv import serve
from agentkv.model.default import SMALL_MODEL_DIR

SMALL = str(SMALL_MODEL_DIR)  # the fast model: these tests are about the command line


@pytest.fixture
def uvicorn_calls(monkeypatch) -> list[dict]:
    calls: list[dict] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: calls.append({"app": app, **kwargs}))
    return calls


def test_idle_connections_outlive_the_openai_clients_pool(uvicorn_calls):
    serve.serve(["--model", SMALL, "--kv-cache-gb", "0.02", "--port", "8123"])
    (kwargs,) = uvicorn_calls
    assert kwargs["port"] == 8123
    # The client drops an idle connection before the server would: never the other way round.
    assert kwargs["timeout_keep_alive"] > openai.DEFAULT_CONNECTION_LIMITS.keepalive_expiry


def test_the_keep_alive_is_the_operators_to_set(uvicorn_calls):
    serve.serve(["--model", SMALL, "--kv-cache-gb", "0.02", "--timeout-keep-alive", "300"])
    assert uvicorn_calls[-1]["timeout_keep_alive"] == 300


def test_on_a_cpu_the_kv_budget_is_the_pool_and_the_tier_together():
    gib = 2**30
    assert serve.kv_split(1.0, None, "cpu", state_dir=False) == (gib, 0)  # no tier beside the pool
    assert serve.kv_split(1.0, None, "cpu", state_dir=True) == (gib // 2, gib // 2)  # the tier out of the total
    assert serve.kv_split(1.0, 2.0, "cpu", state_dir=False) == (gib, 2 * gib)  # sized explicitly: in addition
    assert serve.kv_split(1.0, None, "cuda", state_dir=False)[1] > 0  # host memory beside a GPU's


def test_the_server_logs_how_kv_memory_is_split(uvicorn_calls, caplog):
    caplog.set_level("INFO")
    serve.serve(["--model", SMALL, "--kv-cache-gb", "0.02"])
    assert any("KV memory" in r.getMessage() and "host tier" in r.getMessage() for r in caplog.records)


def test_a_chat_template_file_replaces_the_models_own(tmp_path, uvicorn_calls):
    from fastapi.testclient import TestClient

    from agentkv.model.tokenizer import Tokenizer

    template = tmp_path / "t.jinja"
    template.write_text("<<{{ messages[0].content }}>>")
    serve.serve(["--model", SMALL, "--kv-cache-gb", "0.02", "--chat-template", str(template)])
    with TestClient(uvicorn_calls[-1]["app"]) as client:
        r = client.post("/v1/chat/completions", json={"model": "agent-8m", "max_tokens": 1,
                                                      "messages": [{"role": "user", "content": "hi there"}]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(Tokenizer.from_dir(SMALL_MODEL_DIR).encode("<<hi there>>"))


def test_the_demo_starts_by_name_with_its_own_arguments(capsys):
    # serve.py imports no experiment: `serve.py demo` runs the module as `python -m` would.
    argv = list(sys.argv)
    with pytest.raises(SystemExit) as exit_:
        serve.main(["demo", "--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("usage: serve.py demo")
    assert sys.argv == argv  # the caller's arguments are back
