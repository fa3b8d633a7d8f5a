"""One streamed /v1/completions request over token ids, timed as its client
sees it: the first token's arrival (prefill, HTTP included) and the last's.
Any OpenAI-compatible server that streams completions answers it (vLLM's,
this engine's); fields only one of them takes go in `extra`."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class StreamedCompletion:
    first_token_s: float  # from sending the request to the first chunk with text or token ids
    latency_s: float  # to the end of the stream
    prompt_tokens: int
    cached_tokens: int  # usage.prompt_tokens_details.cached_tokens (0 where the server gives none)
    completion_tokens: int
    token_ids: list[int] = field(default_factory=list)  # where the server returns them (vLLM: return_token_ids)


def stream_completion(http: httpx.Client, model: str, ids: list[int], max_tokens: int,
                      extra: dict | None = None) -> StreamedCompletion:
    """Greedy, exactly max_tokens tokens (ignore_eos), usage in the last
    chunk. http: a client whose base_url is the server's root. Raises
    RuntimeError on an HTTP error or a stream without usage."""
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    start = time.perf_counter()
    first = None
    usage = None
    token_ids: list[int] = []
    with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"/v1/completions answered {r.status_code}: {r.read().decode(errors='replace')[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            for choice in chunk.get("choices") or ():
                if first is None and (choice.get("text") or choice.get("token_ids")):
                    first = time.perf_counter() - start
                token_ids += choice.get("token_ids") or []
            usage = chunk.get("usage") or usage
    latency = time.perf_counter() - start
    if usage is None:
        raise RuntimeError("the stream ended without usage")
    details = usage.get("prompt_tokens_details") or {}
    return StreamedCompletion(latency if first is None else first, latency, usage["prompt_tokens"],
                              details.get("cached_tokens") or 0, usage["completion_tokens"], token_ids)
