"""A short soak (the full one is ``python bench/soak.py``, 5,000 requests): see bench/soak.py."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from soak import run_soak  # noqa: E402


def test_short_soak_under_pressure_both_preemption_modes():
    rows = [run_soak(250, seed=0, mode="recompute"), run_soak(250, seed=1, mode="swap")]
    states = set(rows[0]["aborts_by_state"]) | set(rows[1]["aborts_by_state"])
    assert {"waiting", "mid-prefill", "mid-decode", "swapped"} <= states
    assert rows[0]["preemptions_by_mode"].get("recompute", 0) > 0
    assert rows[1]["swap_outs"] > 0 and rows[1]["preemptions_by_mode"].get("recompute", 0) > 0  # CPU pool full
    assert all(r["cow_copies"] > 0 and r["evictions"] > 0 and r["leaks_found"] == 0 for r in rows)


def test_short_fault_soak_both_preemption_modes():
    """Model steps, the sampler and every kind of device copy fail at random (after writing noise);
    run_soak asserts the audit, the replay, the ends and the greedy outputs of what was not failed."""
    rows = [run_soak(250, seed=0, mode="recompute", faults=True), run_soak(250, seed=1, mode="swap", faults=True)]
    injected = {k: sum(r["faults_by_kind"][k] for r in rows) for k in rows[0]["faults_by_kind"]}
    assert all(n > 0 for n in injected.values()), injected
    assert rows[1]["faults_by_kind"]["swap_out"] > 0 and rows[1]["recomputed_after_failed_swap_out"] > 0
    assert all(r["requests_failed"] > 0 and r["greedy_checked"] >= 5 and r["leaks_found"] == 0 for r in rows)
    assert {"recompute", "swap"} <= set(rows[1]["preemptions_by_mode"])
