"""The scheduler's observer hooks and the engine's trace spans: what
profiling and benchmarks watch instead of patching methods."""
from __future__ import annotations

import pytest
import torch

from agentkv import Engine
from agentkv.engine import trace
from agentkv.engine.step_observer import StepObserver
from tests.conftest import assert_all_pages_free
from tests.hf_models import make_hf_model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("observer")
    make_hf_model("llama-gqa-llama3rope-tied", path, seed=4)
    return path


def repeating_prompt(seed: int) -> list[int]:
    """Random tokens with a copied span, so prompt lookup has drafts to make."""
    base = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(seed)).tolist()
    return base + base[5:17] + base[5:11]


class Recorder(StepObserver):
    """Records every hook's arguments; the tests check them afterwards (an
    observer's own exceptions are logged and swallowed by the scheduler)."""

    def __init__(self):
        self.steps, self.drafts, self.verdicts, self.forward_s = [], [], [], []

    def on_step(self, phase, items, forward_s):
        self.forward_s.append(forward_s)
        self.steps.append((phase, sum(len(it.tokens) for it in items), len(items)))

    def on_draft(self, req, draft, seconds):
        self.drafts.append((req, list(draft)))

    def on_verdict(self, req, draft, accepted, tokens):
        self.verdicts.append((req, list(draft), accepted, list(tokens)))

    def check(self) -> None:
        assert self.forward_s and all(s > 0 for s in self.forward_s)
        for _, draft, accepted, tokens in self.verdicts:
            assert 0 <= accepted <= len(draft) and draft[:accepted] == tokens[:accepted]


@pytest.mark.parametrize("speculative", [False, True])
def test_an_observer_sees_every_step_draft_and_verdict(ckpt, speculative):
    engine = Engine.from_pretrained(ckpt, page_size=8, num_pages=64)
    rec = Recorder()
    engine.scheduler.add_observer(rec)
    with engine.session() as s:
        s.append(repeating_prompt(1))
        out = s.generate(max_tokens=24, ignore_eos=True, speculative=speculative)
    rec.check()
    # The verdicts' tokens are the output, in order; each verdict applies one step's draft.
    assert [t for v in rec.verdicts for t in v[3]] == out
    phases = [p for p, _, _ in rec.steps]
    assert phases[0] == "prefill" and set(phases) <= {"prefill", "decode", "verify"}
    assert len(rec.steps) == len(rec.verdicts)  # the first token comes with the prompt's last chunk
    if speculative:
        assert [d for _, d in rec.drafts] == [v[1] for v in rec.verdicts[1:]]
        assert any(v[2] for v in rec.verdicts), "prompt lookup should land some drafts on a copied span"
        assert "verify" in phases
    else:
        assert rec.drafts == [] and "verify" not in phases
    engine.scheduler.remove_observer(rec)
    seen = (len(rec.steps), len(rec.drafts), len(rec.verdicts))
    with engine.session() as s:
        s.append(repeating_prompt(2))
        s.generate(max_tokens=4, ignore_eos=True, speculative=speculative)
    assert (len(rec.steps), len(rec.drafts), len(rec.verdicts)) == seen
    assert_all_pages_free(engine)


def test_a_step_batches_the_queued_sessions_as_the_observer_sees_it(ckpt):
    # Three generations queued before any step runs: each decode step takes all three.
    engine = Engine.from_pretrained(ckpt, page_size=8, num_pages=96)
    rec = Recorder()
    engine.scheduler.add_observer(rec)
    sessions = [engine.session() for _ in range(3)]
    for i, s in enumerate(sessions):
        s.append(repeating_prompt(10 + i))
    reqs = [s.start_generate(max_tokens=12, ignore_eos=True, speculative=False) for s in sessions]
    for req in reqs:
        engine.scheduler.wait(req)
    assert [len(req.output) for req in reqs] == [12, 12, 12]
    rec.check()
    decode_batches = [n for phase, _, n in rec.steps if phase == "decode"]
    assert decode_batches == [3] * 11  # the first token comes with the prompt's step
    assert sum(len(v[3]) for v in rec.verdicts) == 36
    for s in sessions:
        s.close()
    assert_all_pages_free(engine)


def test_a_failing_observer_fails_no_request(ckpt):
    engine = Engine.from_pretrained(ckpt, page_size=8, num_pages=64)
    with engine.session() as s:
        s.append(repeating_prompt(3))
        reference = s.generate(max_tokens=8, ignore_eos=True, speculative=True)

    class Broken(StepObserver):
        def on_step(self, phase, items, forward_s):
            raise RuntimeError("observer bug")

        def on_verdict(self, req, draft, accepted, tokens):
            raise RuntimeError("observer bug")

    broken = Broken()
    engine.scheduler.add_observer(broken)
    with engine.session() as s:
        s.append(repeating_prompt(3))
        assert s.generate(max_tokens=8, ignore_eos=True, speculative=True) == reference
    engine.scheduler.remove_observer(broken)
    with pytest.raises(ValueError):
        engine.scheduler.remove_observer(broken)
    assert_all_pages_free(engine)


@pytest.mark.slow
def test_span_listeners_time_the_engines_phases_and_leave_when_removed():
    engine = Engine.from_pretrained(None)  # the embedded model: a tokenizer and a chat template
    seen: list[tuple[str, float]] = []

    def listener(name, seconds):
        seen.append((name, seconds))

    trace.add_span_listener(listener)
    try:
        engine.chat([{"role": "user", "content": "list the files"}], max_tokens=4)
    finally:
        trace.remove_span_listener(listener)
    names = {n for n, _ in seen}
    assert {"render", "prefill", "sample", "detokenize", "parse_tools"} <= names
    assert all(seconds >= 0 for _, seconds in seen)
    count = len(seen)
    engine.chat([{"role": "user", "content": "list the files"}], max_tokens=4)
    assert len(seen) == count
    with pytest.raises(ValueError):
        trace.remove_span_listener(listener)
