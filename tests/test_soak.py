"""A short soak (the full one is ``python bench/soak.py``, 5,000 requests): see bench/soak.py."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from soak import run_soak  # noqa: E402


def test_short_soak_under_pressure_both_preemption_modes():
    rows = [run_soak(250, seed=0, mode="recompute"), run_soak(250, seed=1, mode="swap")]
    states = set(rows[0]["aborts_by_state"]) | set(rows[1]["aborts_by_state"])
    assert {"waiting", "mid-prefill", "mid-decode", "swapped"} <= states
    assert rows[0]["preemptions_by_mode"].get("recompute", 0) > 0
    assert rows[1]["swap_outs"] > 0 and rows[1]["preemptions_by_mode"].get("recompute", 0) > 0  # CPU pool full
    assert all(r["cow_copies"] > 0 and r["evictions"] > 0 and r["leaks_found"] == 0 for r in rows)
