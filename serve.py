"""Command line of the engine (`python serve.py` from the checkout, or
`python -m agentkv.serve` from anywhere once installed).

    python serve.py [--host 127.0.0.1] [--port 8000] [--model PATH] [--dtype float32|auto] [--kv-cache-gb 1]
        # the OpenAI-compatible HTTP server (ready when GET /health answers 200)
    python serve.py demo [--agents 8] [--kv-fraction 0.3]   # BFCL's agents with tool pauses, three ways to serve them
    python serve.py cluster --replicas 2 --state-dir DIR [--port 8000]   # replicas behind vllm-router (engine.api.cluster)
"""
from __future__ import annotations

if __name__ == "serve":  # a bare import from the checkout, which must not shadow another package
    __import__("agentkv").step_aside(__name__)

import argparse
import logging
import runpy
import signal
import sys
import time
from pathlib import Path

from agentkv.cache.kv_codec import CODECS
from agentkv.engine.api.quotas import Quotas
from agentkv.engine.api.tenants import ApiKeys, ApiKeysError
from agentkv.engine.engine import DEFAULT_KV_OFFLOAD_BYTES, DEFAULT_KV_OFFLOAD_DISK_BYTES
from agentkv.engine.limits import Limits
from agentkv.engine.message_log import CONTINUATIONS
from agentkv.engine.retention import MODES, RetentionConfig
from agentkv.spec.drafters import KINDS

log = logging.getLogger("agentkv.serve")
# The main job, an experiment (experiments/benchmarks/demo.py) that `serve.py demo` starts by name.
DEMO = "agentkv.experiments.benchmarks.demo"


def serve(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        description="agentkv: a stateful inference engine for multi-agent tool calling, served over an OpenAI-compatible API",
        epilog="`python serve.py demo --help`: the main job, many agents with tool pauses served three ways",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default=None,
                        help="a Hugging Face checkpoint directory, a GGUF file, an adapter directory over a base "
                             "(model/lora.py), or shape:NAME[@SEED], random weights of a real model's shape for "
                             "serving benchmarks (model/shapes.py) (default: the embedded model)")
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja chat template file that replaces the model's own (as vLLM's flag)")
    parser.add_argument("--served-model-name", default=None, help="the name clients use (default: the directory's name)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32",
                        help="float32, bfloat16, float16, or auto: the checkpoint's own dtype where the device "
                             "computes in it (bf16 on a CPU with AVX512-BF16, else float32)")
    parser.add_argument("--kv-cache-gb", type=float, default=1.0,
                        help="memory for KV: on a CPU the pool and the host tier together, the same RAM (unless "
                             "--kv-offload-gb sizes the tier, in addition); on a GPU the pool's")
    parser.add_argument("--no-constrain-auto", action="store_true",
                        help="decode tool_choice \"auto\" unconstrained (default: a call the model opens is held to "
                             "the tools' schemas)")
    parser.add_argument("--continuation", choices=CONTINUATIONS, default="native",
                        help="how a chat turn on a session reuses its history: native continues from the tokens the "
                             "model produced (matched by message: only new messages are rendered); "
                             "template-faithful re-renders the history and reuses up to the first differing token")
    parser.add_argument("--drafter", choices=KINDS, default="suffix",
                        help="speculation's draft source: suffix trees over the session and its namespace's recent "
                             "outputs, ngram prompt lookup over the session alone (docs/bench_spec.md), or none: "
                             "no speculation (one token per request a step, grammar-forced drafts included)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="run every step eagerly (default on a CUDA device: decode and fixed-length verify "
                             "steps replay CUDA graphs, engine/decode_graphs.py)")
    parser.add_argument("--timeout-keep-alive", type=int, default=75,
                        help="seconds an idle HTTP keep-alive connection stays open. Above the clients' own pool "
                             "expiry (httpx, under the openai client: 5 s), so that an agent resuming after a tool "
                             "pause never sends on a connection the server is closing (uvicorn's default of 5 s "
                             "raced it: connection errors)")
    parser.add_argument("--max-stored-responses", type=int, default=4096,
                        help="Responses API responses kept for previous_response_id; past that the least recently "
                             "used of the tenant holding the most expire (404 response_expired)")
    limits = parser.add_argument_group("limits", "how much work a step takes and how much state the server keeps")
    defaults = Limits()
    limits.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs, help="requests in one step")
    limits.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens,
                        help="tokens one step computes; prompts are chunked at multiples of it")
    limits.add_argument("--prefill-chunk", type=int, default=defaults.prefill_chunk,
                        help="prompt tokens one request computes per step (chunks end at multiples of it)")
    limits.add_argument("--max-queue", type=int, default=defaults.max_queue,
                        help="waiting requests; past it a request gets 429 with Retry-After")
    limits.add_argument("--max-sessions", type=int, default=defaults.max_sessions,
                        help="live named sessions, every tenant's together (a turn's working copy, a request "
                             "without a session and stored responses do not count); at it a new one is a 429 "
                             "naming this limit, and no session is ever closed to make room")
    limits.add_argument("--session-idle-timeout", type=float, default=3600.0,
                        help="seconds after which an idle session is closed (its KV offered to the prefix cache first); "
                             "named sessions and stored responses only leave the pool, their records kept")
    limits.add_argument("--max-retain-seconds", type=float, default=defaults.max_retain_s,
                        help="the longest pin POST /v1/sessions/{id}/retain may ask for, and what one without "
                             "seconds gets: no client holds KV in the pool for good")
    access = parser.add_argument_group("tenants", "who may use the server, and how much of it each tenant may hold "
                                       "(the --tenant-* quotas apply with API keys: an open server has one tenant)")
    access.add_argument("--api-key", action="append", default=[],
                        help="a key clients send as `Authorization: Bearer KEY`; repeatable, each its own tenant "
                             "(none, and no --api-keys-file: the server is open to anyone who reaches it)")
    access.add_argument("--api-keys-file", default=None,
                        help="lines of `key tenant-name` (several keys may name one tenant); read again on SIGHUP")
    access.add_argument("--public-metrics", action="store_true", help="serve /metrics without a key")
    q = Quotas()
    access.add_argument("--tenant-max-sessions", type=int, default=q.max_sessions, help="live named sessions")
    access.add_argument("--tenant-max-responses", type=int, default=q.max_responses,
                        help="stored Responses API responses")
    access.add_argument("--tenant-max-concurrent", type=int, default=q.max_concurrent,
                        help="requests in flight, streams included")
    access.add_argument("--tenant-max-kv-pages", type=int, default=None,
                        help="KV pages its sessions and stored responses hold in the pool and the second tier "
                             "(default: no quota beyond what there is)")
    access.add_argument("--max-request-bytes", type=int, default=q.max_body_bytes, help="one request body")
    access.add_argument("--default-max-tokens", type=int, default=None,
                        help="a request's max_tokens when it names none (default: the model's generation config's "
                             "max_new_tokens, else 4096; never past the context)")
    kv = parser.add_argument_group("KV tiers", "what stays in the pool between turns, and where the rest goes")
    kv.add_argument("--kv-retention", choices=MODES, default="tool",
                    help="tool: a session awaiting a tool keeps its KV for as long as that tool usually takes "
                         "(learned per tool name), final answers give way first; lru: idle sessions give way by "
                         "idle time alone (the ablation)")
    r = RetentionConfig()
    kv.add_argument("--tool-ttl-default", type=float, default=r.tool_ttl_default,
                    help="seconds a session awaiting a tool never seen stays pinned")
    kv.add_argument("--tool-ttl-floor", type=float, default=r.tool_ttl_floor, help="shortest tool pin, seconds")
    kv.add_argument("--tool-ttl-cap", type=float, default=r.tool_ttl_cap, help="longest tool pin, seconds")
    kv.add_argument("--tool-ttl-margin", type=float, default=r.margin,
                    help="a tool pin lasts this many times the tool's estimated pause")
    kv.add_argument("--kv-offload-gb", type=float, default=None,
                    help="host memory for KV that leaves the pool, in addition to --kv-cache-gb (0: none; evicted "
                         "KV is dropped). Default: on a GPU %g; on a CPU none, or half of --kv-cache-gb with "
                         "--state-dir (which writes KV through the tier)" % (DEFAULT_KV_OFFLOAD_BYTES / 2**30))
    kv.add_argument("--prefix-match", choices=("token", "block"), default="token",
                    help="token: a request reuses cached KV up to its first differing token; block: whole pages "
                         "only, as block-hash prefix caches (vLLM's) do (the ablation)")
    kv.add_argument("--page-size", type=int, default=16,
                    help="tokens per KV page: the unit of allocation, and of reuse under --prefix-match block")
    kv.add_argument("--no-program-admission", action="store_true",
                    help="admit every request at once; by default an agent's turns are one program, admitted "
                         "whole only while the admitted programs' KV fits the pool and the host tier")
    kv.add_argument("--kv-offload-dir", default=None, help="spill the host tier's least recently used KV here")
    kv.add_argument("--kv-offload-disk-gb", type=float, default=DEFAULT_KV_OFFLOAD_DISK_BYTES / 2**30,
                    help="disk for spilled KV; past it the least recently used is dropped")
    kv.add_argument("--state-dir", default=None,
                    help="keep named sessions across restarts (clean or kill -9, up to each one's last completed "
                         "turn): their tokens here, their KV written through to the disk tier (by default "
                         "STATE_DIR/kv); on start they are verified and resumed")
    kv.add_argument("--shared-state", action="store_true",
                    help="other replicas use --state-dir and its disk tier too (serve.py cluster): nothing is "
                         "resumed at start; a session or response is taken up from what any replica saved last "
                         "when it is asked for")
    kv.add_argument("--kv-offload-codec", choices=CODECS, default="pool",
                    help="pool: KV at the pool's dtype (bit-exact); int8: a quarter of fp32's bytes, lossy")
    args = parser.parse_args(argv)
    if args.shared_state and not args.state_dir:
        parser.error("--shared-state shares the --state-dir: name one")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import uvicorn

    from agentkv import Engine
    from agentkv.kernels.cpu_extension import isa
    from agentkv.kernels.dispatch import build_cpu_kernels
    from agentkv.engine.api import create_app
    from agentkv.model.shapes import is_shape

    # A shape's name has dots (qwen2.5-0.5b) that a path's stem would cut.
    stem = args.model if is_shape(args.model) else Path(args.model).resolve().stem if args.model else None
    name = args.served_model_name or stem or "agentkv-default"
    log.info("loading %s", args.model or "the embedded default model")
    try:
        retention = RetentionConfig(mode=args.kv_retention, tool_ttl_default=args.tool_ttl_default,
                                    tool_ttl_floor=args.tool_ttl_floor, tool_ttl_cap=args.tool_ttl_cap,
                                    margin=args.tool_ttl_margin)
        limits = Limits(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        prefill_chunk=min(args.prefill_chunk, args.max_num_batched_tokens), max_queue=args.max_queue, max_sessions=args.max_sessions,
                        session_idle_timeout=args.session_idle_timeout, max_retain_s=args.max_retain_seconds)
        quotas = Quotas(max_sessions=args.tenant_max_sessions, max_responses=args.tenant_max_responses,
                        max_concurrent=args.tenant_max_concurrent, max_kv_pages=args.tenant_max_kv_pages,
                        max_body_bytes=args.max_request_bytes, default_max_tokens=args.default_max_tokens)
        keys = ApiKeys.from_args(args.api_key, args.api_keys_file)
        chat_template = Path(args.chat_template).read_text(encoding="utf-8") if args.chat_template else None
    except (ValueError, OSError) as e:  # ApiKeysError is a ValueError
        parser.error(str(e))
    if args.device == "cpu":
        started = time.perf_counter()
        log.info("building the C++ CPU kernels for %s (cached after the first time on a machine)", isa())
        for kernel, error in build_cpu_kernels().items():
            log.warning("%s: %s; its torch path runs instead", kernel, error)
        log.info("CPU kernels ready in %.1f s", time.perf_counter() - started)
    pool_bytes, tier_bytes = kv_split(args.kv_cache_gb, args.kv_offload_gb, args.device, bool(args.state_dir))
    log.info("KV memory: %.3f GiB pool + %.3f GiB host tier = %.3f GiB%s", pool_bytes / 2**30, tier_bytes / 2**30,
             (pool_bytes + tier_bytes) / 2**30, " (the tier out of --kv-cache-gb: on a CPU it is the same RAM)"
             if args.device == "cpu" and args.kv_offload_gb is None and tier_bytes else "")
    engine = Engine.from_pretrained(
        args.model, device=args.device, dtype=args.dtype, chat_template=chat_template, kv_cache_bytes=pool_bytes,
        constrain_auto=not args.no_constrain_auto, limits=limits, retention=retention, continuation=args.continuation,
        program_admission=not args.no_program_admission, kv_offload_bytes=tier_bytes,
        kv_offload_dir=args.kv_offload_dir or (Path(args.state_dir) / "kv" if args.state_dir else None),
        kv_offload_disk_bytes=int(args.kv_offload_disk_gb * 2**30), kv_offload_codec=args.kv_offload_codec,
        kv_resume=not args.shared_state, drafter=args.drafter, prefix_match=args.prefix_match,
        page_size=args.page_size, decode_graphs=False if args.enforce_eager else None)
    log.info("serving %r on http://%s:%d/v1 (%d KV pages of %d tokens)", name, args.host, args.port,
             engine.pool.num_pages, engine.pool.page_size)
    if args.state_dir and engine.tier is None:
        parser.error("--state-dir keeps KV in the second tier: --kv-offload-gb must be > 0")
    app = create_app(engine, name, args.max_stored_responses, args.state_dir, keys=keys, quotas=quotas,
                     public_metrics=args.public_metrics, shared_state=args.shared_state)
    if keys.open:
        log.warning("no API keys configured: the server is open to anyone who can reach it (one tenant)")
    else:
        log.info("%d API keys; every endpoint but /health%s needs one", len(keys),
                 " and /metrics" if args.public_metrics else "")
    if args.api_keys_file:
        signal.signal(signal.SIGHUP, lambda *_: _reload(keys))
    if args.state_dir and not args.shared_state:
        log.info("resumed %d saved sessions from %s", len(app.state.api.sessions), args.state_dir)
        for line in app.state.api.sessions.reports():
            log.warning("%s", line)
    uvicorn.run(app, host=args.host, port=args.port, timeout_keep_alive=args.timeout_keep_alive)


def kv_split(kv_cache_gb: float, kv_offload_gb: float | None, device: str, state_dir: bool) -> tuple[int, int]:
    """Bytes for the pool and for the host tier. On a CPU the tier is the same
    RAM as the pool, so unless it is sized explicitly it comes out of the
    total: none, or half with a state directory (which needs one)."""
    total = int(kv_cache_gb * 2**30)
    if kv_offload_gb is not None:
        return total, int(kv_offload_gb * 2**30)
    if device == "cpu":
        tier = total // 2 if state_dir else 0
        return total - tier, tier
    return total, DEFAULT_KV_OFFLOAD_BYTES


def _reload(keys: ApiKeys) -> None:
    try:
        keys.reload()
        log.info("API keys reloaded from %s: %d keys", keys.file, len(keys))
    except (ApiKeysError, OSError) as e:
        log.error("API keys not reloaded, the old ones stay: %s", e)


def run_experiment(module: str, argv: list[str]) -> None:
    """Runs an experiment as `python -m module *argv` would: named, not
    imported, so the product's command line loads no benchmark."""
    saved = sys.argv[1:]
    sys.argv[1:] = argv
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        sys.argv[1:] = saved


def main(argv: list[str]) -> None:
    if argv[:1] == ["demo"]:
        run_experiment(DEMO, argv[1:])
    elif argv[:1] == ["cluster"]:
        from agentkv.engine.api.cluster import main as cluster

        cluster(argv[1:])
    else:
        serve(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
