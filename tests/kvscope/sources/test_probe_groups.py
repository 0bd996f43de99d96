"""The probe on vLLM's real scheduler (no model: tests/probe_vllm/harness.py) with what real servers add to the
single full-attention group: several KV cache groups (a sliding window or a Mamba state group beside full
attention, vLLM's hybrid coordinator), vLLM's AsyncScheduler, and a KV connector that delays frees, loads, fails
and pins (tests/probe_vllm/scripted_connector.py).

In every case the audit is clean on every step, and at a pause every group's tables, the ref counts and the free
queue equal what vLLM holds; a leak is still found, named with its group.
"""

from __future__ import annotations

import pytest
from vllm_live import (
    CONTROL,
    SYSTEM,
    Harness,
    chats,
    drain,
    endpoint,
    first_audit_problem,
    logged,
    need_vllm,
    same_tokens,
)

from engine.inspect.kv_groups import NO_GROUP
from engine.inspect.snapshot import BlockState
from kvscope.sources.probe import ProbeSource
from kvscope.sources.probe_mirror import VllmPoolMirror


def idle(src: ProbeSource):
    return lambda r: r.snapshot.counters["num_requests_running"] == 0 and not src.mirror.requests


def same_as_vllm(rec, dump: dict, src: ProbeSource) -> None:
    """Every group's tables, the ref counts (but the null block's, which vLLM does not keep), the free queue, every
    request's tokens and computed count."""
    snap = rec.snapshot
    assert snap.ref_cnt.tolist()[1:] == dump["ref_cnt"][1:]
    assert snap.free_queue.tolist() == dump["free_queue"]
    for g, tables in enumerate(dump["group_tables"]):
        shown = {r.request_id: list(r.tables[g]) for r in snap.requests if any(r.tables)}
        assert shown == {rid: t for rid, t in tables.items() if rid in shown or t}, f"group {g}"
    same_tokens(src.mirror, dump)


@pytest.fixture(scope="module")
def vllm_python():
    return need_vllm()


@pytest.mark.parametrize("groups", ["sliding:32,full", "mamba,full"])
def test_every_groups_tables_are_vllms_and_the_audit_is_clean(vllm_python, groups, monkeypatch):
    ep = endpoint()
    nulled = []  # the table positions the probe said vLLM put its null block in (not the tables sent whole)
    apply = VllmPoolMirror.apply

    def seen(self, st):
        nulled.extend(st.nulled)
        return apply(self, st)

    monkeypatch.setattr(VllmPoolMirror, "apply", seen)
    with Harness(ep, num_blocks=40, args=("--groups", groups), env=CONTROL) as h:  # a hold that holds
        src = ProbeSource(ep, wait_s=30)
        try:
            kinds = [g.kind for g in src.mirror.groups]
            assert kinds == ["sliding_window" if groups.startswith("sliding") else "mamba", "full"]
            assert src.mirror.primary == 1  # the full-attention group's table is a row's first
            h.cmd("spin", on=True, pace=0.02)
            chats(h, 5, max_tokens=60)
            recs = drain(src, lambda r: r.snapshot.counters["num_requests_running"] >= 3)
            recs += drain(src, lambda r: any(0 in r2.tables[0] for r2 in r.snapshot.requests))  # a block gave back
            recs += src.hold(True)
            rec = src.current()
            same_as_vllm(rec, h.cmd("dump"), src)
            snap = rec.snapshot
            running = [r for r in snap.requests if r.status == "RUNNING"]
            assert running and all(len(r.group_block_ids) == 2 and r.block_ids == r.group_block_ids[1] for r in running)
            # the null block in a window's (or a state group's) table: reserved, in no group, held by nobody
            assert snap.state[0] == BlockState.RESERVED and snap.block_group[0] == NO_GROUP and snap.owner[0] == -1
            for r in running:
                for g, t in enumerate(r.group_block_ids):
                    assert all(snap.block_group[b] == g for b in t if b != 0)
            src.hold(False)
            recs += drain(src, idle(src))
            same_as_vllm(recs[-1], h.cmd("dump"), src)
            kinds = {e.kind for r in recs for e in r.events}
            assert {"allocated", "freed", "stored", "admitted", "finished"} <= kinds
            freed = [e.request_id for r in recs for e in r.events if e.kind == "freed"]
            assert freed and all(rid.startswith("chat-") for rid in freed)  # a block a window gave back is named too
            assert nulled and all(g == 0 and positions for _rid, g, positions in nulled)
        finally:
            src.close()


def test_the_leak_in_a_hybrid_model_is_found_and_named_with_its_group(vllm_python):
    ep = endpoint()
    with Harness(
        ep, num_blocks=40, args=("--groups", "sliding:32,full"), env={"KVSCOPE_PROBE_FAULT": "leak-last-block"}
    ) as h:
        src = ProbeSource(ep, wait_s=30)
        try:
            h.cmd("spin", on=True, pace=0.01)
            h.cmd("add", id="victim", prompt=SYSTEM + [7] * 9, max_tokens=12)
            found = first_audit_problem(src, 30)
            (p,) = found.audit.problems
            assert (p.problem, p.last_owner, p.actual_ref, p.expected_ref) == ("leaked", "victim", 1, 0)
            assert p.group == "group 1 (full attention)" and "KV cache group 1 (full attention)" in str(p)
            assert logged(h, f"block {p.block_id} of request victim will not be freed (KV cache group 1)")
        finally:
            src.close()


def test_async_scheduling_every_step_recorded_and_audited(vllm_python):
    """vLLM's AsyncScheduler schedules the next batch before the last one's output is applied: the probe records
    every step (one record a update_from_output), the audit is clean on each, and at a pause the tables are
    vLLM's."""
    ep = endpoint()
    with Harness(ep, num_blocks=16, args=("--async",), env=CONTROL) as h:
        assert "AsyncScheduler" in h.ready["bases"]
        src = ProbeSource(ep, wait_s=30)
        try:
            assert src.info.extra["async_scheduling"] is True
            assert any("asynchronous scheduling is on" in n for n in src.info.extra["probe_notes"])
            h.cmd("spin", on=True, pace=0.02)
            chats(h, 6, max_tokens=40)
            recs = drain(src, lambda r: r.snapshot.counters["num_preemptions"] >= 1)  # the small pool ran out
            recs += src.hold(True)
            same_as_vllm(src.current(), h.cmd("dump"), src)
            src.hold(False)
            recs += drain(src, idle(src))
            steps = [r.snapshot.counters["vllm_step"] for r in recs if r.step_output is not None]
            assert steps == list(range(steps[0], steps[0] + len(steps)))  # no update_from_output unrecorded
            assert recs[-1].snapshot.counters["generation_tokens"] >= 6 * 40
        finally:
            src.close()


def test_a_connectors_delayed_free_load_failure_and_pins_are_held_and_audited(vllm_python):
    ep = endpoint()
    with Harness(ep, num_blocks=32, args=("--connector",)) as h:
        src = ProbeSource(ep, wait_s=30)
        try:
            assert src.info.extra.get("connector") == "ScriptedConnector"
            h.cmd("connector", delay_free=True, second_pool=True)  # and a pool of its own, stepped every schedule
            h.cmd("add", id="sent", prompt=SYSTEM + [5] * 10, max_tokens=4)
            for _ in range(8):
                h.cmd("step")
            recs = drain(src, lambda r: (q := r.snapshot.request("sent")) is not None and q.status.startswith("FIN"))
            snap = src.current().snapshot
            sent = snap.request("sent")  # finished, its blocks kept for the transfer: held, with the reason
            assert sent.block_ids and "ScriptedConnector" in sent.held_by and "finished_sending" in sent.held_by
            assert all(snap.ref_cnt[b] == 1 for b in sent.block_ids) and src.mirror.audit().ok
            same_as_vllm(src.current(), h.cmd("dump"), src)
            for _ in range(3):  # finished_sending comes late: the blocks stay held meanwhile
                h.cmd("step")
                assert drain(src, lambda r: True)[-1].snapshot.request("sent").block_ids
            h.cmd("kv_output", finished_sending=["sent"])
            h.cmd("step")
            drain(src, lambda r: "sent" not in src.mirror.requests)
            assert all(src.current().snapshot.ref_cnt[b] == 0 for b in sent.block_ids)
            # a load from the connector that fails: blocks allocated for it, then given back, the request recomputed
            h.cmd("connector", delay_free=False, load={"loads": 32})
            h.cmd("add", id="loads", prompt=[9] * 40, max_tokens=3)
            h.cmd("step")
            at = h.cmd("dump")["step"]  # the step's own record, not the one the add sent before it (CI read that)
            rec = drain(src, lambda r: src.mirror.vllm_step >= at)[-1]
            assert "being loaded" in rec.snapshot.request("loads").held_by
            h.cmd("kv_output", finished_recving=["loads"], failed_recving=["loads"])
            h.cmd("run")
            drain(src, idle(src))
            # a pin: a reference with no table behind it, held by the connector, then released
            h.cmd("connector", pin=[5, 6])
            h.cmd("add", id="p", prompt=SYSTEM[:20], max_tokens=2)
            h.cmd("step")
            rec = drain(src, lambda r: bool(r.snapshot.pinned))[-1]
            assert rec.snapshot.pinned == {5: 1, 6: 1} and h.cmd("dump")["pinned"] == [5, 6]
            assert rec.snapshot.ref_cnt[5] >= 1 and rec.audit.ok
            h.cmd("connector", unpin=True)  # released when the connector's output next comes (update_connector_output)
            h.cmd("kv_output")
            h.cmd("run")
            rec = drain(src, lambda r: not r.snapshot.pinned and idle(src)(r))[-1]
            same_as_vllm(rec, h.cmd("dump"), src)
            touched = {e.block_id for r in recs for e in r.events if hasattr(e, "block_id")}
            assert touched <= set(range(32))  # the connector's own pool's blocks are not this pool's
            assert all("connector:" not in (e.request_id or "") for r in recs for e in r.events if e.kind == "evicted")
        finally:
            src.close()
