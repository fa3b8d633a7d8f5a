"""This engine in-process, through its public chat API, in three modes:
stateful (a persistent session per agent), stateless (stateless=True: every
turn re-prefills the whole history) and block (block-hash prefix caching
over a stateless API, a fresh session per request: what vLLM's automatic
prefix caching does)."""
from __future__ import annotations

import gc
import time

from agentkv.experiments.drivers.system import Request, kv_tokens_needed, turn_row

KINDS = ("stateful", "stateless", "block")


def engine_pages(reqs: list[Request], page_size: int, kind: str = "stateful") -> int:
    if kind == "stateless":  # one temporary session at a time
        return max(len(r.ids) + r.gen for r in reqs) // page_size + 64
    # Room for every agent's session plus half as much again for published
    # prefixes (the radix keeps generated tails until evicted; it evicts
    # least recently used ones under pressure), and slack.
    return 3 * (kv_tokens_needed(reqs) // page_size + len(reqs)) // 2 + 64


def warm_engine(model, tokenizer, reqs: list[Request], page_size: int) -> None:
    """One short request on a throwaway engine, before any timed turn."""
    from agentkv import Engine

    eng = Engine(model, tokenizer, page_size=page_size, num_pages=64, prefix_cache=False)
    with eng.session() as s:
        s.append(reqs[0].ids[:256])
        s.generate(max_tokens=4, ignore_eos=True, speculative=False)


class EngineSystem:
    """One of KINDS on a model shared with the other systems; every pass
    (begin) gets a fresh engine, so it starts from empty caches."""

    def __init__(self, kind: str, model, tokenizer, reqs: list[Request], page_size: int = 16,
                 speculative: bool = False):
        self.name, self.model, self.tokenizer = kind, model, tokenizer
        self.page_size, self.speculative = page_size, speculative
        self.pages = engine_pages(reqs, page_size, kind)
        self.info = {"pages": self.pages, "page_size": page_size}
        self.eng = None
        self.sessions: dict[str, object] = {}

    def begin(self) -> None:
        from agentkv import Engine

        self.end()
        kind = self.name
        self.eng = Engine(self.model, self.tokenizer, page_size=self.page_size, num_pages=self.pages,
                          stateless=kind == "stateless", prefix_cache=kind != "stateless",
                          prefix_match="block" if kind == "block" else "token",
                          # The peers decode "auto" tool calls unconstrained: so does the engine here,
                          # so that every system generates the same greedy tokens.
                          constrain_auto=False,
                          # Every system gets the shared rendering's token ids: the history as the
                          # template writes it, not as this run sampled it (that is
                          # experiments.benchmarks.bench_continuation's question).
                          continuation="template-faithful")

    def turn(self, r: Request) -> dict:
        eng = self.eng
        session = self.sessions.setdefault(r.agent, eng.session()) if self.name == "stateful" else None
        start = time.perf_counter()
        res = eng.chat(r.messages, tools=r.tools, session=session, max_tokens=r.gen, ignore_eos=True,
                       speculative=self.speculative)
        latency = time.perf_counter() - start
        st = eng.stats[-1]
        if res.usage["prompt_tokens"] != len(r.ids):
            raise RuntimeError(f"turn {r.index + 1}: the engine rendered {res.usage['prompt_tokens']} tokens, "
                               f"the shared rendering {len(r.ids)}")
        return turn_row(latency, st.prefill_s, st.decode_s, st.computed_tokens, st.reused_tokens,
                        st.generated_tokens, decode_steps=st.decode_steps, drafted=st.drafted_tokens,
                        accepted=st.accepted_tokens, token_ids=list(res.token_ids))

    def end(self) -> None:
        for s in self.sessions.values():
            s.close()
        self.sessions.clear()
        self.eng = None
        gc.collect()

    close = end


class EngineDecode:
    """The engine in-process for experiments.benchmarks.bench_decode: one session per
    prompt (agent), prefilled on its first call and kept; every call decodes
    exactly gen greedy tokens through the scheduler's normal path
    (Session.generate, speculation off, so each step is a plain decode step)
    and cuts the session back to its prompt afterwards."""

    name = "ours"

    def __init__(self, model, num_pages: int, page_size: int = 16):
        from agentkv import Engine

        # No prefix cache: each prompt lives in its own session, so nothing would match.
        self.eng = Engine(model, None, page_size=page_size, num_pages=num_pages, prefix_cache=False)
        self.sessions: dict[str, object] = {}
        self.info = {"pages": num_pages, "page_size": page_size}

    def decode(self, ids: list[int], gen: int, agent: str) -> dict:
        """As PeerSystem.decode: token_s holds each token's seconds from the
        call's start; on the first call for agent the prefill comes first."""
        start = time.perf_counter()
        session = self.sessions.get(agent)
        if session is None:
            session = self.sessions[agent] = self.eng.session()
            session.append(ids)
        elif session.tokens != ids:
            raise ValueError(f"agent {agent!r} was prefilled with another prompt")
        stamps: list[float] = []

        def arrived(new: list[int]) -> None:
            stamps.extend([time.perf_counter() - start] * len(new))

        out = session.generate(max_tokens=gen, ignore_eos=True, speculative=False, on_tokens=arrived)
        latency = time.perf_counter() - start
        session.truncate(len(ids))
        return {"latency_s": latency, "prefill_s": stamps[0], "decode_s": stamps[-1] - stamps[0],
                "generated": len(out), "token_ids": list(out), "token_s": stamps}

    def close(self) -> None:
        for s in self.sessions.values():
            s.close()
        self.sessions.clear()
        self.eng = None
        gc.collect()
