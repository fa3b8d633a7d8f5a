"""The prefix cache inside the engine: sessions start from cached prefixes,
reused KV equals recomputed KV, memory pressure evicts idle work only."""
import pytest
import torch

from agentkv import Engine, KVCapacityError
from tests.conftest import assert_all_pages_free
from tests.hf_models import make_hf_model

PS = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("radix")
    make_hf_model("llama-gqa-llama3rope-tied", path, seed=7)
    return path


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def fresh_logits(ckpt, tokens: list[int]) -> torch.Tensor:
    engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=64, prefix_cache=False)
    with engine.session() as s:
        return s.append(tokens, all_logits=True)


@pytest.mark.parametrize("shared", [16, 21])  # page-aligned, and ending mid-page (copy-on-write)
def test_second_agent_reuses_the_shared_prefix(ckpt, shared):
    engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=64)
    system = ids(shared, 1)
    a_tail, b_tail = ids(9, 2), ids(7, 3)
    a = engine.session()
    a.append(system + a_tail)
    a.generate(max_tokens=3, ignore_eos=True)  # end of a's turn: published
    b = engine.session()
    b.append(system + b_tail[:4])
    assert b.turn.reused_tokens == shared and b.turn.computed_tokens == 4
    got = b.append(b_tail[4:], all_logits=True)
    torch.testing.assert_close(got, fresh_logits(ckpt, system + b_tail)[-3:], atol=1e-5, rtol=0)
    # The owner is unharmed by the sharer's writes.
    more = a.append([5, 6, 7], all_logits=True)
    torch.testing.assert_close(more, fresh_logits(ckpt, a.tokens)[-3:], atol=1e-5, rtol=0)
    a.close()
    b.close()
    assert_all_pages_free(engine)


def test_chat_of_a_new_conversation_reuses_the_cached_system_prompt(ckpt, tmp_path):
    engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=64)
    system = ids(40, 4)
    with engine.session() as s:
        s.append(system + ids(5, 5))
        s.generate(max_tokens=2, ignore_eos=True)
    with engine.session() as t:
        t.queue(system + ids(6, 6))
        t.generate(max_tokens=2, ignore_eos=True)
        assert engine.stats[-1].computed_tokens == 6
    assert engine.radix.hits >= 1 and engine.radix.matched_tokens >= 40


def test_namespaces_never_share(ckpt):
    engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=64)
    prompt = ids(30, 7)
    with engine.session(namespace="tenant-a") as s:
        s.append(prompt)
        s.generate(max_tokens=2, ignore_eos=True)
    with engine.session(namespace="tenant-b") as s:
        s.append(prompt + [1])
        assert s.turn.reused_tokens == 0 and s.turn.computed_tokens == 31
    with engine.session(namespace="tenant-a") as s:
        s.append(prompt + [1])
        assert s.turn.reused_tokens == 30


def test_memory_pressure_evicts_idle_work_lru_and_keeps_live_sessions(ckpt):
    engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=24, pin_ttl=None)
    live = engine.session()
    live.append(ids(40, 8))  # 5 pages, pinned for its whole life
    before = live.append([3], all_logits=True)
    live.truncate(40)
    for k in range(4):  # closed conversations: cached, evictable
        with engine.session() as s:
            s.append(ids(30, 10 + k))
            s.generate(max_tokens=2, ignore_eos=True)
    assert engine.pool.num_free < 16
    with engine.session() as big:
        big.append(ids(120, 20))  # 15 pages: only fits by evicting the cached conversations
    # Least recently used first: the last conversation survived longer than the first.
    assert engine.radix.evicted_pages > 0
    assert live.append([3], all_logits=True).equal(before)
    with engine.session() as s:
        with pytest.raises(KVCapacityError):
            s.append(ids(200, 21))  # more than everything but the live session
        assert len(s) == 0
    live.close()
    assert_all_pages_free(engine)


def test_idle_session_past_its_ttl_is_parked_and_comes_back(ckpt):
    engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=16, pin_ttl=0.0)
    waiting = engine.session()  # e.g. waiting on a tool call
    waiting.append(ids(60, 30))
    out = waiting.generate(max_tokens=4, ignore_eos=True)
    with engine.session(pin_ttl=None) as other:
        other.append(ids(100, 31))  # needs the waiting session's pages
    assert waiting.table.length < 60  # parked: some of its KV was evicted
    logits = waiting.append([9, 9], all_logits=True)  # back: re-matched or recomputed, never wrong
    torch.testing.assert_close(logits, fresh_logits(ckpt, ids(60, 30) + out + [9, 9])[-2:], atol=1e-5, rtol=0)
    waiting.close()
    assert_all_pages_free(engine)


def test_agents_that_start_together_compute_their_shared_prompt_once(ckpt):
    """Requests queued at once with a common system prompt: one computes it
    (published chunk by chunk), the others wait and match it; each reply
    equals the one it gets alone."""
    from agentkv.engine.limits import Limits

    limits = Limits(prefill_chunk=32, max_num_batched_tokens=128)
    engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=128, limits=limits)
    system = ids(100, 40)
    prompts = [system + ids(11, 41 + i) for i in range(4)]
    sessions = [engine.session() for _ in prompts]
    reqs = []
    for s, p in zip(sessions, prompts):
        s.queue(p)
        reqs.append(s.start_generate(max_tokens=5, ignore_eos=True))
    for r in reqs:
        engine.scheduler.wait(r)
        assert r.error is None
    computed = sum(r.turn.computed_tokens for r in reqs)
    assert computed <= len(system) + 4 * (11 + PS)  # the system prompt once, not four times
    alone = Engine.from_pretrained(ckpt, page_size=PS, num_pages=128, limits=limits)
    for p, r in zip(prompts, reqs):
        with alone.session() as s:
            s.append(p)
            assert s.generate(max_tokens=5, ignore_eos=True) == r.output
    for s in sessions:
        s.close()


def test_a_prefix_only_the_tree_holds_below_a_used_path_gives_way_before_a_request_fails(ckpt):
    """B computed the system prompt itself before A published it: the tree
    keeps A's copy in a node above B's published tail, which plain eviction
    cannot take (B's tail below it is in use). Rather than fail B's request
    for lack of pages, the tree goes."""
    engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=14, kv_offload_bytes=0)
    system = ids(40, 50)
    b = engine.session()
    b.append(system + ids(8, 51))  # one chunk: nothing published yet
    with engine.session() as a:
        a.append(system + ids(8, 52))
        a.generate(max_tokens=2, ignore_eos=True)  # publishes the system prompt with a's pages
    b.generate(max_tokens=2, ignore_eos=True)  # publishes b's tail below a's copy of the prompt
    assert engine.pool.num_free < 3
    more = ids(24, 53)
    got = b.append(more, all_logits=True)
    torch.testing.assert_close(got, fresh_logits(ckpt, b.tokens)[-24:], rtol=0, atol=1e-5)
    b.close()
