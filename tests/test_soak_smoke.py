"""The fault-injection soak (experiments/soak.py) in its CI form: three
tenants' agents beside a hostile one at its full quotas, the tier's disk a
tmpfs that fills (ENOSPC), some of the agents' own streams dropped
mid-reply, and the server SIGKILLed while their turns are mid-prefill and
mid-decode, restarted on its state directory each time (a saved KV piece
corrupted after the first). Every well-behaved turn equals the run with no
faults, none gets a 5xx, no turn is lost, half-written or given up, every
session and stored response survives, and no page leaks."""
from __future__ import annotations

import json

import pytest

from agentkv.experiments import soak

pytestmark = pytest.mark.slow


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
        assert phase["gave_up"] == [] and phase["stream_errors"] == []
        assert phase["server_errors"] == 0 and phase["hostile_server_errors"] == 0
        for statuses in phase["statuses"].values():  # a 409 or 429 is a retry's, never a failure's
            assert set(statuses) <= {"200", "409", "429"}, phase["statuses"]


def test_the_kills_land_mid_prefill_and_mid_decode_and_cut_turns_are_absent_or_whole(result):
    faults = result["phases"][-1]
    assert "error" not in faults["faults"], faults["faults"]
    kills = faults["faults"]["kills"]
    assert [k["point"] for k in kills] == result["args"]["kills"].split(",")
    assert not any(k.get("missed") for k in kills), kills
    assert all(k["running"] >= 1 for k in kills if k["point"] == "prefill"), kills
    for point in ("prefill", "decode"):  # an agent's own request in flight at that point was cut
        assert any(k["cut"] for k in kills if k["point"] == point), kills
    assert faults["cut_off"]["killed"] >= len(kills)
    assert faults["cut_off"]["dropped"] == faults["faults"]["drops_planned"] == result["args"]["drops"]
    assert faults["half_written"] == []
    assert faults["absent"] + faults["complete"] == sum(faults["cut_off"].values())


def test_every_completed_turn_session_and_stored_response_survives(result):
    for phase in result["phases"]:
        assert phase["turns_missing"] == [] and phase["turns_extra"] == [] and phase["sessions_lost"] == []
        assert phase["faults"]["responses_lost"] == [], phase["faults"]


def test_the_full_disk_and_the_corrupt_piece_fail_no_request(result):
    faults = result["phases"][-1]
    assert faults["enospc"] > 0  # the tier's writes met a full disk
    assert faults["faults"]["corrupted"] is not None and faults["corrupt_found"] >= 1


def test_the_hostile_tenant_was_refused_not_served_errors(result):
    for phase in result["phases"][1:]:
        got, moves = phase["hostile_statuses"], phase["hostile_moves"]
        assert got.get("413", 0) > 0 and got.get("400", 0) > 0, got  # oversized and malformed bodies
        assert moves.get("at_limit 200", 0) > 0, moves  # a body exactly at the limit is served
        assert not any(int(s) >= 500 for s in got), got


def test_no_page_leaks(result):
    for phase in result["phases"]:
        assert phase["leaked_pages"] == 0 and phase["pages_used"] <= phase["pages_total"]
