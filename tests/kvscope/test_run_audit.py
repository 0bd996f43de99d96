"""An audit over the whole run (issue 39): a problem seen at one step stays in the run's record after the pool is
clean again, in ``--headless``'s summary (kvscope's own engine's and a probed vLLM's alike: one ``Summary``)."""

from __future__ import annotations

import numpy as np

from engine.inspect.audit import AuditProblem, AuditReport
from engine.inspect.snapshot import assemble_snapshot
from kvscope.run_audit import MAX_LISTED, RunAudit
from kvscope.sources.base import StepRecord
from kvscope.sources.summary import Summary

LEAK = AuditProblem(3, "leaked", 0, 1, "chat-1")
COUNTERS = {
    "kv_cache_usage_perc": 0.0,
    "num_blocks": 8,
    "num_free_blocks": 8,
    "prefix_cache_queries": 0,
    "prefix_cache_hits": 0,
    "num_preemptions": 0,
    "cow_copies": 0,
    "evictions": 0,
    "swap_outs": 0,
    "swap_ins": 0,
    "generation_tokens": 0,
}


def record(step: int, problems=()) -> StepRecord:
    n = 8
    snap = assemble_snapshot(
        step,
        4,
        np.zeros(n, np.int32),
        np.zeros(n, bool),
        np.zeros(n, np.int64),
        np.arange(n, dtype=np.int32),
        [],
        {},
        {},
        dict(COUNTERS),
        0,
    )
    return StepRecord(step, snap, [], None, 0.0, AuditReport(tuple(problems)))


def test_a_problem_that_healed_stays_in_the_runs_record():
    run = RunAudit()
    for step, problems in ((1, ()), (2, (LEAK,)), (3, (LEAK,)), (3, (LEAK,)), (4, ())):
        run.add(step, AuditReport(problems))
    assert run.steps_with_problems == 2 and run.first_step == 2 and not run.clean  # step 3 seen twice counts once
    assert run.listed() == [f"step 2: {LEAK}"]  # one leak on two steps: one problem, at the step it was first seen
    assert run.at(3).problems == (LEAK,) and run.at(4) is None and run.problem_steps() == [2, 3]
    assert "problems on 2 steps of this run (the first at step 2: block 3: leaked" in run.text()


def test_the_list_keeps_the_first_hundred_and_counts_the_rest():
    run = RunAudit()
    for b in range(MAX_LISTED + 5):
        run.add(b, AuditReport((AuditProblem(b, "leaked", 0, 1),)))
    listed = run.listed()
    assert len(listed) == MAX_LISTED + 1 and listed[-1] == "... and 5 more problems"
    assert run.steps_with_problems == MAX_LISTED + 5


def test_the_headless_summary_lists_every_steps_problems_not_the_last_ones_alone():
    s = Summary(prefix_caching=False)
    for rec in (record(1), record(2, (LEAK,)), record(3)):
        s.add(rec)
    out = s.as_dict()
    assert out["audit_problems"] == [f"step 2: {LEAK}"] and out["audit_steps_with_problems"] == 1
    assert out["flagged_blocks"] == 0 and out["kv_cache_groups"] == 1  # the last step's pool is clean
