"""The fault-injection soak (experiments/soak.py) in its CI form: three
tenants' agents beside a hostile one, streams dropped, the disk tier full,
a saved KV piece corrupted, the server SIGKILLed and restarted on its
state directory. Every well-behaved turn equals the run with no faults,
none gets a 5xx, the restart resumes every session and stored response,
and no page leaks."""
from __future__ import annotations

import json

import pytest

from agentkv.experiments import soak


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("soak")
    soak.main(["--short", "--out", str(out), "--no-wandb"])
    return json.loads((out / "results.json").read_text())


def test_no_turn_of_a_well_behaved_tenant_is_lost_or_altered(result):
    planned = result["args"]["agents"] * result["args"]["turns_per_agent"]
    for phase in result["phases"]:
        assert phase["turns_done"] == planned, phase["phase"]
        assert phase["turns_lost"] == [] and phase["turns_altered"] == [] and phase["errors"] == []
        assert phase["server_errors"] == 0 and phase["hostile_server_errors"] == 0
        assert all(set(c) == {"200"} for c in phase["statuses"].values()), phase["statuses"]


def test_the_hostile_tenant_was_refused_not_served_errors(result):
    for phase in result["phases"][1:]:
        got = phase["hostile_statuses"]
        assert got.get("413", 0) > 0 and got.get("400", 0) > 0, got  # oversized and malformed bodies
        assert not any(int(s) >= 500 for s in got), got


def test_the_restart_resumes_every_session_and_stored_response(result):
    faults = result["phases"][-1]["faults"]
    assert "error" not in faults, faults
    assert faults["drops"] == [False, True, False, True]
    assert faults["corrupted"] is not None and result["phases"][-1]["tier_corrupt"] >= 1
    assert faults["sessions_checked"] == result["args"]["agents"] and faults["sessions_lost"] == []
    assert faults["responses_checked"] == 3 and faults["responses_lost"] == []
    assert result["phases"][-1]["saves_refused_disk_full"] > 0  # the disk tier was full


def test_no_page_leaks(result):
    for phase in result["phases"]:
        assert phase["leaked_pages"] == 0 and phase["pages_used"] <= phase["pages_total"]
