"""KV budgets of a replay, as fractions of the agents' distinct tokens.

Every request's prompt is rendered once with the served model's chat
template. distinct_tokens is what a cache must hold so that no token is
ever computed twice: the union of all prompts (a token trie: a prefix
that agents share, such as their tools, counts once; so does each agent's
own history, which every later prompt repeats) plus one reply per agent
(the replies a server generates are never re-sent: the recorded ones
are). The working set is the sum over agents of their largest prompt and
its reply, nothing shared: the measure of older benchmarks, reported
beside it. Budgets are whole `unit`-token blocks, so that every system (our
pages, vLLM's blocks) gets the same tokens.
"""
from __future__ import annotations

from collections.abc import Sequence

from agentkv.cache.tokens import common_prefix_len
from agentkv.experiments.workloads.traces import Trace


def trie_size(sequences: Sequence[Sequence[int]]) -> int:
    """Nodes of the token trie holding every sequence: in sorted order each
    sequence adds what it does not share with the one before it (the
    longest prefix it shares with any earlier one)."""
    ordered = sorted(map(list, sequences))
    return sum(len(s) - (common_prefix_len(prev, s) if prev is not None else 0)
               for prev, s in zip([None] + ordered[:-1], ordered))


def render_prompts(tokenizer, traces: Sequence[Trace]) -> dict[str, list[list[int]]]:
    """Each agent's request prompts as token ids, in order."""
    return {t.agent: [tokenizer.apply_chat_template(t.history(k), tools=list(t.tools), add_generation_prompt=True)
                      for k in range(len(t))] for t in traces}


def replay_footprint(prompts: dict[str, list[list[int]]], max_tokens: int) -> dict:
    """distinct_tokens, working_set_tokens, the shared part and the longest request (prompt + reply)."""
    everything = [p for ps in prompts.values() for p in ps]
    distinct = trie_size(everything) + len(prompts) * max_tokens
    largest = {a: max(len(p) for p in ps) + max_tokens for a, ps in prompts.items()}
    working_set = sum(largest.values())
    return {"distinct_tokens": distinct, "working_set_tokens": working_set,
            "shared_tokens": working_set - distinct, "longest_request_tokens": max(largest.values()),
            "requests": len(everything), "prompt_tokens": sum(map(len, everything))}


def budget_tokens(footprint: dict, fraction: float, unit: int) -> int:
    """fraction of the distinct tokens in whole units; ValueError where that
    cannot hold the longest request (every system would refuse it)."""
    if fraction <= 0:
        raise ValueError(f"a budget fraction must be positive, not {fraction}")
    tokens = int(footprint["distinct_tokens"] * fraction) // unit * unit
    if tokens < footprint["longest_request_tokens"]:
        raise ValueError(f"{fraction:.0%} of {footprint['distinct_tokens']} distinct tokens is {tokens} in blocks of "
                         f"{unit}, less than the longest request ({footprint['longest_request_tokens']} tokens)")
    return tokens
