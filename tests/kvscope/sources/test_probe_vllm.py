"""The probe inside vLLM's real scheduler, block pool and KV cache manager (vLLM's CPU build, no model: the harness
steps the scheduler with made-up outputs), against kvscope's ``ProbeSource``.

What kvscope shows must be what vLLM holds: after every step the audit is clean, and at any pause the ref counts,
the free queue, the hashes and the tables equal those read straight from vLLM's objects. Step runs exactly one
schedule; a window that goes while vLLM is paused lets it run on; the leak fault is found and named; a release the
probe does not know is refused in one line and vLLM runs untouched; kvscope may start before vLLM, and vLLM may
restart while kvscope watches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
from vllm_live import (
    CONTROL,
    REMOTE_FAULTS,
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

from kvscope.sources.probe import ProbeReplay, ProbeSource
from kvscope_vllm_probe.wire import PROTOCOL


def same_as_vllm(rec, dump: dict, src: ProbeSource) -> None:
    snap = rec.snapshot
    ref = snap.ref_cnt.tolist()
    assert ref[1:] == dump["ref_cnt"][1:]  # block 0 is vLLM's null block, whose count vLLM does not keep
    assert snap.free_queue.tolist() == dump["free_queue"]
    assert {str(b): int(h, 16) for b, h in snap.block_hashes.items()} == dump["hashes"]
    shown = {r.request_id: list(r.block_ids) for r in snap.requests if r.block_ids}
    assert shown == {rid: t for rid, t in dump["tables"].items() if t}
    same_tokens(src.mirror, dump)


@pytest.fixture(scope="module")
def vllm_python():
    return need_vllm()


def test_kvscope_shows_what_vllm_holds_under_sharing_and_preemption(vllm_python):
    ep = endpoint()
    with Harness(ep, num_blocks=12, env=CONTROL) as h:
        assert h.ready["probed"] and h.ready["scheduler"] == "KvscopeProbedScheduler"
        src = ProbeSource(ep, wait_s=30)
        try:
            h.cmd("spin", on=True, pace=0.01)
            chats(h, 6, max_tokens=30)
            recs = drain(src, lambda r: r.snapshot.counters["num_preemptions"] >= 1)  # the pool ran out
            recs += src.hold(True)  # vLLM waits at its next schedule: read both sides there
            assert src.mirror.paused
            rec = src.current()
            same_as_vllm(rec, h.cmd("dump"), src)
            assert any(r.block_ids for r in rec.snapshot.requests)  # read mid-run, with tables to compare
            src.hold(False)
            recs += drain(src, lambda r: r.snapshot.counters["num_requests_running"] == 0 and not src.mirror.requests)
            same_as_vllm(recs[-1], h.cmd("dump"), src)
            c = recs[-1].snapshot.counters
            assert c["prefix_cache_hits"] > 0 and c["evictions"] > 0 and c["num_preemptions"] >= 1
            kinds = {e.kind for r in recs for e in r.events}
            assert {"allocated", "hit", "freed", "stored", "evicted", "admitted", "preempted", "finished"} <= kinds
            named = [e.request_id for r in recs for e in r.events if e.kind in ("allocated", "hit", "freed")]
            assert named and all(rid.startswith("chat-") for rid in named)  # every block change names its request
            assert [r.step for r in recs] == sorted(r.step for r in recs)
        finally:
            src.close()


def test_step_runs_exactly_one_schedule_and_a_window_that_goes_lets_vllm_run(vllm_python):
    ep = endpoint()
    with Harness(ep, num_blocks=64, env=CONTROL) as h:
        src = ProbeSource(ep, wait_s=30)
        h.cmd("spin", on=True, pace=0.01)
        chats(h, 3, max_tokens=400)
        drain(src, lambda r: r.snapshot.counters["num_requests_running"] == 3)
        src.hold(True)
        assert src.mirror.paused
        held_at = src.mirror.vllm_step
        time.sleep(0.5)  # a stretch in which nothing may happen: vLLM held schedules no step
        assert h.cmd("dump")["step"] == held_at  # held: vLLM schedules nothing
        before = {r.request_id: r.num_computed_tokens for r in src.current().snapshot.requests}
        for k in range(1, 4):
            rec = src.step()
            assert rec.step_output is not None and src.mirror.vllm_step == held_at + k
            assert h.cmd("dump")["step"] == held_at + k
            now = {r.request_id: r.num_computed_tokens for r in rec.snapshot.requests}
            assert all(now[rid] == before[rid] + k for rid in before)  # one decode token each, per Step
        src.close()  # the window goes while vLLM is held
        deadline = time.monotonic() + 10
        while h.cmd("dump")["step"] <= held_at + 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert h.cmd("dump")["step"] > held_at + 3, "vLLM stayed held by a window that is gone"
        assert logged(h, "said goodbye")


def test_the_leak_fault_is_found_with_its_block_request_and_step(vllm_python):
    ep = endpoint()
    with Harness(ep, num_blocks=32, env={"KVSCOPE_PROBE_FAULT": "leak-last-block"}) as h:
        src = ProbeSource(ep, wait_s=30)
        try:
            assert src.info.extra["fault"] == "leak-last-block"
            h.cmd("spin", on=True, pace=0.01)
            h.cmd("add", id="victim", prompt=SYSTEM + [7] * 9, max_tokens=12)
            found = first_audit_problem(src, 30)
            (p,) = found.audit.problems
            assert p.problem == "leaked" and p.last_owner == "victim" and p.actual_ref == 1 and p.expected_ref == 0
            assert logged(h, f"block {p.block_id} of request victim will not be freed")
            assert any(e.kind == "finished" and e.request_id == "victim" for e in found.events)  # found that step
            assert found.snapshot.ref_cnt[p.block_id] == 1 and h.cmd("dump")["ref_cnt"][p.block_id] == 1
        finally:
            src.close()


def test_a_fault_switched_on_from_kvscope(vllm_python):
    ep = endpoint()
    with Harness(ep, num_blocks=32, env=REMOTE_FAULTS) as h:
        src = ProbeSource(ep, wait_s=30, fault="leak-last-block")  # what --probe-fault does
        try:
            time.sleep(0.3)  # the fault reaches the probe's thread before vLLM works (no message acknowledges it)
            h.cmd("spin", on=True, pace=0.01)
            h.cmd("add", id="r", prompt=SYSTEM[:20], max_tokens=4)
            rec = first_audit_problem(src, 30)
            assert [(p.problem, p.last_owner) for p in rec.audit.problems] == [("leaked", "r")]
        finally:
            src.close()


def test_an_unknown_release_is_refused_in_one_line_and_vllm_runs_untouched(vllm_python):
    ep = endpoint()
    with Harness(ep, args=("--pretend-version", "0.99.1")) as h:
        assert not h.ready["probed"] and h.ready["scheduler"] == "Scheduler"
        h.cmd("add", id="r", prompt=SYSTEM, max_tokens=3)
        assert h.cmd("run")["stepped"] >= 3
        assert logged(h, "vLLM 0.99.1 is not a release")
        lines = [ln for ln in h.log_text().splitlines() if "kvscope probe" in ln]
        assert len(lines) == 1 and "vLLM 0.99.1 is not a release the probe was checked against" in lines[0]


def test_kvscope_started_before_vllm_and_vllm_restarted_while_watched(vllm_python):
    ep = endpoint()
    got: list = []
    t = threading.Thread(target=lambda: got.append(ProbeSource(ep, wait_s=60)), daemon=True)
    t.start()
    time.sleep(1.0)  # kvscope waits for a probe that is not there yet
    h = Harness(ep, num_blocks=32)
    t.join(60)
    src = got[0]
    try:
        h.cmd("spin", on=True, pace=0.01)
        chats(h, 2, max_tokens=20)
        recs = drain(src, lambda r: r.snapshot.counters["num_requests_running"] == 0 and r.step > 5)
        last = recs[-1].step
        h.kill()  # vLLM dies...
        h = Harness(ep, num_blocks=32)  # ...and a new one starts at the same address, with the same pool
        h.cmd("spin", on=True, pace=0.01)
        notices: list[str] = []

        def said(rec) -> bool:
            notices.extend([rec.notice] if rec.notice else [])
            return any("restarted" in n for n in notices)

        drain(src, said)
        chats(h, 1, max_tokens=5, start=10)  # the new vLLM's request, seen from its first step to its last
        rec = drain(
            src,
            lambda r: any(q.request_id == "chat-10" and q.status.startswith("FINISHED") for q in r.snapshot.requests),
        )[-1]
        assert any("has not answered" in n for n in notices), notices
        assert any(f"vLLM at {ep} restarted: its pool is read again" in n for n in notices), notices
        assert rec.step > last  # kvscope's steps go on from where they were
        same_as_vllm(src.current(), h.cmd("dump"), src)
        h.kill()  # once more, now with another pool: kvscope says so and stops, it does not draw the wrong grid
        h = Harness(ep, num_blocks=16)
        deadline = time.monotonic() + 40
        while src.has_work() and time.monotonic() < deadline:
            rec = src.step()
        assert not src.has_work() and "restarted with a pool of 16 blocks of 16 tokens (it had 32 of 16)" in rec.notice
    finally:
        src.close()
        h.close()


def test_a_probe_of_another_protocol_refuses_kvscope_in_one_line(vllm_python, monkeypatch):
    import kvscope_vllm_probe.client as client

    monkeypatch.setattr(client, "PROTOCOL", 999)
    ep = endpoint()
    with Harness(ep) as h:
        with pytest.raises(ValueError, match=rf"speaks probe protocol {PROTOCOL} .*speaks 999: install the probe"):
            ProbeSource(ep, wait_s=20)
        assert h.cmd("add", id="r", prompt=SYSTEM, max_tokens=2)["ok"]
        assert h.cmd("run")["stepped"] >= 2  # vLLM goes on


def test_headless_json_and_a_trace_that_replays_the_same_run(vllm_python, tmp_path):
    ep = endpoint()
    trace = tmp_path / "vllm.probe.jsonl"
    with Harness(ep, num_blocks=12) as h:
        h.cmd("spin", on=True, pace=0.05)
        env = dict(os.environ, QT_QPA_PLATFORM="offscreen")
        kvscope = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvscope",
                "--headless",
                "--json",
                "--probe",
                ep,
                "--duration",
                "8",
                "--trace",
                str(trace),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            # the chats start once kvscope reads (a loaded machine may take longer to start it than they take)
            assert logged(h, "subscribed", timeout=120), "kvscope did not subscribe"
            chats(h, 6, max_tokens=60)
            stdout, stderr = kvscope.communicate(timeout=120)
        finally:
            if kvscope.poll() is None:
                kvscope.kill()
        assert kvscope.returncode == 0, stderr
        live = json.loads(stdout)
    for key in ("steps", "blocks_used_peak", "prefix_cache_hits", "num_preemptions", "audit_problems"):
        assert key in live
    assert live["steps"] > 0 and live["blocks_used_peak"] > 1 and live["audit_problems"] == []
    out = subprocess.run(
        [sys.executable, "-m", "kvscope", "--headless", "--json", "--replay", str(trace)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    replayed = json.loads(out.stdout)
    for key in (
        "steps",
        "blocks_used_peak",
        "prefix_cache_hits",
        "prefix_cache_queries",
        "num_preemptions",
        "evictions",
        "audit_problems",
        "num_blocks",
    ):
        assert replayed[key] == live[key], key
    src = ProbeReplay(str(trace))
    assert src.info.read_only and src.has_work()


def test_bad_probe_flags_are_refused_in_one_line():
    for argv, want in (
        (["--probe", "localhost:5570"], "give the probe's ZeroMQ address"),
        (["--probe", "tcp://127.0.0.1:5570", "--scenario", "four-score"], "not with --scenario"),
        (["--probe-fault", "leak-last-block"], "needs --probe ADDR"),
    ):
        out = subprocess.run(
            [sys.executable, "-m", "kvscope", "--headless", *argv], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and want in out.stderr, out.stderr
