"""bench/probe_cost.py reads the one-process runs turn by turn: a pair of cycles that another job slowed moves its
estimate of the probe's cost a step little, where it moves a pooled mean by its whole burst; and it says on which
step of the cycle the cost falls."""

from __future__ import annotations

import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from probe_cost import cycle_costs  # noqa: E402

CYCLE = 16


def _run(cycles: int, burst_every: int, seed: int) -> dict:
    """A load whose bare step takes 6 ms (its 8th step 10), the probe adding 0.2 ms a step and 8 ms more on the 8th;
    one cycle in ``burst_every`` with the probe also slowed 20 ms a step by another job."""
    rnd = random.Random(seed)
    on, off = [], []
    for k in range(cycles):
        for i in range(CYCLE):
            bare = (10e-3 if i == 7 else 6e-3) + rnd.gauss(0, 0.1e-3)
            off.append(bare)
            burst = 20e-3 if burst_every and k % burst_every == 3 else 0.0
            on.append(bare + 0.2e-3 + (8e-3 if i == 7 else 0.0) + burst + rnd.gauss(0, 0.1e-3))
    return {"cycle": CYCLE, "step_cpu_s": on, "bare_step_cpu_s": off}


def test_the_cost_a_step_is_read_pair_by_pair_and_a_burst_moves_it_little():
    runs = [_run(25, burst_every=8, seed=s) for s in range(3)]
    out = cycle_costs(runs)
    true_mean = 0.2 + 8 / CYCLE  # ms
    assert out["cycles"] == 75
    assert abs(out["mean"] - true_mean) < 0.1
    assert out["mean_q1"] <= out["mean"] <= out["mean_q3"]
    assert abs(out["median"] - 0.2) < 0.1
    pooled = 1e3 * (
        statistics.mean(t for r in runs for t in r["step_cpu_s"])
        - statistics.mean(t for r in runs for t in r["bare_step_cpu_s"])
    )
    assert pooled - true_mean > 2  # the bursts' share of a pooled mean: what this estimate leaves out
    phases = out["by_phase"]
    assert len(phases) == CYCLE
    assert abs(phases[7] - 8.2) < 0.3 and all(abs(p - 0.2) < 0.3 for i, p in enumerate(phases) if i != 7)


def test_runs_of_quiet_cycles_give_the_pooled_figures():
    out = cycle_costs([_run(10, burst_every=0, seed=9)])
    assert out["cycles"] == 10 and abs(out["mean"] - (0.2 + 8 / CYCLE)) < 0.05
