"""HF transformers generate: stateless (hf: a fresh cache per turn), or
with a DynamicCache kept per agent and cropped to the longest common prefix
with each new prompt (hf-reuse)."""
from __future__ import annotations

import gc
import time
from pathlib import Path

import torch

from agentkv.cache.tokens import common_prefix_len
from agentkv.experiments.drivers.system import Request, turn_row

KINDS = ("hf", "hf-reuse")


def load_hf(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    gc_ = model.generation_config
    gc_.eos_token_id = None  # ignore EOS: always generate the fixed length
    gc_.pad_token_id = 0
    gc_.do_sample = False
    for name in ("temperature", "top_p", "top_k"):
        setattr(gc_, name, None)
    return model


class _FirstToken:
    """A generate() streamer that notes when the first new token arrives
    (its first put() is the prompt)."""

    def __init__(self):
        self.calls = 0
        self.first = None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def hf_generate(model, ids: list[int], gen: int, cache=None) -> tuple[list[int], float, float, float]:
    """(new ids, latency, prefill seconds, decode seconds)."""
    streamer = _FirstToken()
    x = torch.tensor([ids], dtype=torch.long)
    kwargs = dict(max_new_tokens=gen, min_new_tokens=gen, do_sample=False, streamer=streamer,
                  attention_mask=torch.ones_like(x))
    if cache is not None:
        kwargs["cache"] = cache
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(x, **kwargs)
    end = time.perf_counter()
    first = streamer.first or end
    return out[0, len(ids):].tolist(), end - start, first - start, end - first


class HFSystem:
    def __init__(self, kind: str, model):
        self.name, self.model, self.info = kind, model, {}
        self.caches: dict[str, tuple[object, list[int]]] = {}

    def begin(self) -> None:
        self.end()

    def turn(self, r: Request) -> dict:
        from transformers import DynamicCache

        cache, reused = None, 0
        if self.name == "hf-reuse":
            cache, held = self.caches.get(r.agent, (None, []))
            if cache is None:
                cache = DynamicCache(config=self.model.config)
            else:
                reused = min(common_prefix_len(held, r.ids), len(r.ids) - 1)
                if len(held) > reused:
                    cache.crop(reused - len(held))  # a negative count removes that many tokens from the end
        new, latency, prefill, decode = hf_generate(self.model, r.ids, r.gen, cache)
        if self.name == "hf-reuse":
            # The cache holds the prompt and every generated token but the last.
            held = r.ids + new[:-1]
            if cache.get_seq_length() != len(held):
                raise RuntimeError(f"HF cache holds {cache.get_seq_length()} tokens, expected {len(held)}")
            self.caches[r.agent] = (cache, held)
        return turn_row(latency, prefill, decode, len(r.ids) - reused, reused, len(new), token_ids=new)

    def end(self) -> None:
        self.caches.clear()
        gc.collect()

    close = end
