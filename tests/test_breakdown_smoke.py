"""Smoke test of profiling.breakdown on the embedded model: every phase a
turn goes through is timed from the engine's own hooks (scheduler observers
and trace spans), and the report's files are written."""
from __future__ import annotations

import json

import pytest

from agentkv.engine import trace
from agentkv.profiling import breakdown

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("speculative", [False, True])
def test_breakdown_times_every_phase_from_the_engines_hooks(tmp_path, speculative):
    argv = ["--turn", "2", "--repeats", "1", "--max-gen", "6", "--threads", "1", "--out", str(tmp_path)]
    res = breakdown.main(argv + (["--speculative"] if speculative else []))
    calls, ms, tokens = res["calls"], res["median_ms"], res["tokens"]
    for phase in ("render", "prefill", "sample", "detokenize", "parse_tools"):
        assert calls[phase] >= 1 and ms[phase] > 0, phase
    # Every token after the first is drawn in a decode or verify step.
    assert calls["decode"] + calls["verify"] >= 1
    assert tokens["prefill"] >= res["repeats"][0]["stats"]["computed_tokens"] > 0
    if speculative:
        assert calls["draft"] >= 1
    else:
        assert calls["draft"] == 0 and calls["verify"] == 0
    assert sum(ms[p] for p in breakdown.PHASES) == pytest.approx(res["total_ms"], rel=0.02)
    saved = json.loads((tmp_path / "breakdown.json").read_text())
    assert saved["calls"] == calls
    assert (tmp_path / "trace.json").stat().st_size > 0 and "prefill" in (tmp_path / "trace.json").read_text()
    assert not trace._listeners  # the listener goes with the run
