"""Command line of the engine.

    python serve.py [--host 127.0.0.1] [--port 8000] [--model PATH] [--dtype float32] [--kv-cache-gb 1]
        # the OpenAI-compatible HTTP server (ready when GET /health answers 200)
    python serve.py demo [--shape 6|35|interleaved]   # the multi-agent demo, stateful vs stateless
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from engine.limits import Limits

log = logging.getLogger("agentkv.serve")


def serve(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        description="agentkv: a stateful inference engine for multi-agent tool calling, served over an OpenAI-compatible API",
        epilog="`python serve.py demo --help`: the multi-agent demo, stateful vs stateless",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default=None, help="a Hugging Face checkpoint directory (default: the embedded model)")
    parser.add_argument("--served-model-name", default=None, help="the name clients use (default: the directory's name)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-gb", type=float, default=1.0, help="memory for the KV cache's pages")
    parser.add_argument("--no-constrain-auto", action="store_true",
                        help="decode tool_choice \"auto\" unconstrained (default: a call the model opens is held to "
                             "the tools' schemas)")
    parser.add_argument("--max-stored-responses", type=int, default=4096,
                        help="Responses API responses kept for previous_response_id; past that the least recently "
                             "used expire (404)")
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
                        help="live sessions; past it the longest idle one is closed")
    limits.add_argument("--session-idle-timeout", type=float, default=3600.0,
                        help="seconds after which an idle session is closed (its KV offered to the prefix cache first)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import uvicorn

    from engine import Engine
    from engine.api import create_app

    name = args.served_model_name or (Path(args.model).resolve().name if args.model else "agentkv-default")
    log.info("loading %s", args.model or "the embedded default model")
    try:
        limits = Limits(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        prefill_chunk=min(args.prefill_chunk, args.max_num_batched_tokens), max_queue=args.max_queue, max_sessions=args.max_sessions,
                        session_idle_timeout=args.session_idle_timeout)
    except ValueError as e:
        parser.error(str(e))
    engine = Engine.from_pretrained(args.model, device=args.device, dtype=args.dtype, kv_cache_bytes=int(args.kv_cache_gb * 2**30),
                                    constrain_auto=not args.no_constrain_auto, limits=limits)
    log.info("serving %r on http://%s:%d/v1 (%d KV pages of %d tokens)", name, args.host, args.port,
             engine.pool.num_pages, engine.pool.page_size)
    uvicorn.run(create_app(engine, name, args.max_stored_responses), host=args.host, port=args.port)


def main(argv: list[str]) -> None:
    if argv[:1] == ["demo"]:
        from experiments.demo import main as demo

        demo(argv[1:])
    else:
        serve(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
