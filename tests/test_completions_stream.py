"""experiments/drivers/completions_stream.py, the client bench_turns' vllm-server
system times turns with, against this engine's own app: any OpenAI server that
streams completions answers it alike."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from agentkv import Engine
from agentkv.engine.api import create_app
from agentkv.experiments.drivers.completions_stream import stream_completion
from agentkv.model.default import SMALL_MODEL_DIR


@pytest.fixture(scope="module")
def client():
    with TestClient(create_app(Engine.from_pretrained(SMALL_MODEL_DIR, num_pages=64), "m")) as c:
        yield c


def test_exactly_the_asked_tokens_and_the_prefix_found_again(client):
    ids = list(range(40, 240))  # 200 tokens: 12 whole pages of 16
    first = stream_completion(client, "m", ids, 6)
    assert (first.prompt_tokens, first.completion_tokens) == (200, 6)
    assert 0 < first.first_token_s <= first.latency_s
    again = stream_completion(client, "m", ids + [7, 8], 3)
    assert again.completion_tokens == 3 and again.prompt_tokens == 202
    assert again.cached_tokens >= 192  # the first request's whole pages, from the prefix cache
    assert again.token_ids == []  # this server returns none: only vLLM is asked for them


def test_an_error_answer_raises_with_the_servers_words(client):
    with pytest.raises(RuntimeError, match="400"):
        stream_completion(client, "m", [1, 2, 3], 2, extra={"return_token_ids": True})  # an unknown field here
