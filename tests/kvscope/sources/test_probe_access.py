"""Who may do what through the probe (vLLM's real scheduler stepped by the harness, no model): read-only unless vLLM
allows control, nothing before Hello, faults off unless switched on, a pause that ends with the peer that asked
for it, loopback or CURVE keys. The peers that misbehave are plain pyzmq (``raw_peer``), none of kvscope's code."""

from __future__ import annotations

import time

import pytest
import zmq
from ports import free_port
from raw_peer import RawPeer
from vllm_live import CONTROL, Harness, logged, need_vllm

from kvscope.sources.probe import READ_ONLY, ProbeSource
from kvscope_vllm_probe.constants import PROTOCOL
from kvscope_vllm_probe.keys import make_keys
from kvscope_vllm_probe.security import client_keys

SYSTEM = list(range(100, 164))


@pytest.fixture(scope="module")
def vllm_python():
    return need_vllm()


def steps_go_on(h: Harness, timeout: float = 10.0) -> bool:
    """vLLM's scheduler keeps scheduling (it has work: the harness spins)."""
    start, deadline = h.cmd("dump")["step"], time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.2)  # polling: a step count that moves
        if h.cmd("dump")["step"] > start:
            return True
    return False


def busy(h: Harness, n: int = 2) -> None:
    h.cmd("spin", on=True, pace=0.02)
    for i in range(n):
        h.cmd("add", id=f"long-{time.monotonic_ns()}-{i}", prompt=SYSTEM + [7 + i] * 5, max_tokens=3000)


def test_read_only_by_default_nothing_before_hello_and_no_faults(vllm_python):
    ep = f"tcp://127.0.0.1:{free_port()}"
    with Harness(ep, num_blocks=64) as h:
        busy(h)
        stranger = RawPeer(ep)
        for msg in (("Command", "pause", 1), ("SetFault", "leak-last-block", True), ("Resync",)):
            refused = stranger.refused(*msg)
            assert refused is not None and "say Hello first" in refused, msg
            time.sleep(1.1)  # strangers are refused once a second at most: the next one's own answer
        assert steps_go_on(h)
        peer = RawPeer(ep)
        peer.hello("a curious peer\nwith a second line")
        welcome = peer.wait_for("Welcome")
        assert welcome[5:] == [0, 1, False, False]  # rank 0 of 1, no control, no faults from subscribers
        assert peer.wait_for("Keyframe") is not None
        peer.send("Command", "pause", 1)
        refused = peer.wait_for("Refused", 5, beat=True)
        assert refused is not None and "read-only: pause refused" in refused[1]
        assert steps_go_on(h)
        time.sleep(1.1)
        peer.send("SetFault", "leak-last-block", True)
        refused = peer.wait_for("Refused", 5, beat=True)
        assert refused is not None and "faults are off" in refused[1]
        assert logged(h, "a curious peer?with a second line #")  # its name: one line of vLLM's log
        peer.close()
        stranger.close()
        # kvscope on a read-only probe: Pause stops its view, vLLM runs on, Step shows vLLM's next step
        src = ProbeSource(ep, wait_s=30)
        try:
            assert not src.info.extra["control"] and "read-only" in src.info.watch
            (rec,) = src.hold(True)
            assert rec.notice == READ_ONLY.format(at=ep)
            assert steps_go_on(h)
            before = src.mirror.vllm_step
            deadline = time.monotonic() + 10
            while src.mirror.vllm_step == before and time.monotonic() < deadline:
                src.step()
            assert src.mirror.vllm_step > before and src.current().audit.ok
        finally:
            src.close()
        assert h.cmd("dump")["ref_cnt"]  # vLLM serves on


def test_a_pause_ends_with_the_peer_that_asked_for_it(vllm_python):
    ep = f"tcp://127.0.0.1:{free_port()}"
    with Harness(ep, num_blocks=64, env=CONTROL) as h:
        busy(h)
        holder = RawPeer(ep)
        holder.hello("holder")
        assert holder.wait_for("Keyframe") is not None
        holder.send("Command", "pause", 1)
        assert holder.wait_for("Held", 5, beat=True)[1] is True
        other = RawPeer(ep)
        other.hello("holder")  # the same name: its goodbye must not end the first one's pause
        assert other.wait_for("Keyframe") is not None
        other.send("Bye")
        time.sleep(0.5)  # the goodbye is handled (a wrong one would end the pause now)
        held_at = h.cmd("dump")["step"]
        for _ in range(3):  # the holder answers: the pause lasts
            holder.heartbeat()
            time.sleep(1.0)  # a stretch longer than the heartbeat rule's tick in which the pause must last
        assert h.cmd("dump")["step"] == held_at, "a pause ended while its peer kept answering"
        t = time.monotonic()
        holder.die()  # no goodbye: silence
        assert steps_go_on(h, 10), "vLLM stayed paused by a peer that is gone"
        assert 4.0 <= time.monotonic() - t <= 9.0
        assert logged(h, "holder #1 held vLLM paused and went silent for 5 s: vLLM runs on")


def test_a_network_endpoint_without_keys_is_refused_and_vllm_runs_unprobed(vllm_python):
    port = free_port()
    with Harness(f"tcp://0.0.0.0:{port}", env=CONTROL) as h:
        assert not h.ready["probed"] and h.ready["scheduler"] == "Scheduler"  # nothing patched
        h.cmd("add", id="r", prompt=SYSTEM, max_tokens=3)
        assert h.cmd("run")["stepped"] >= 3
        lines = [ln for ln in h.log_text().splitlines() if "kvscope probe" in ln]
        assert (
            len(lines) == 1
            and f"tcp://0.0.0.0:{port} is reachable from the network and the probe has no keys" in (lines[0])
        )
        peer = RawPeer(f"tcp://127.0.0.1:{port}")  # nothing listens there
        peer.hello()
        assert peer.received(1.0) == []
        peer.close()


def test_keys_let_the_probe_on_the_network_and_no_one_else(vllm_python, tmp_path):
    make_keys(str(tmp_path), ["kvscope"])
    env = {
        **CONTROL,
        "KVSCOPE_PROBE_SECRET_KEY": str(tmp_path / "probe.key_secret"),
        "KVSCOPE_PROBE_AUTHORIZED_KEYS": str(tmp_path / "authorized"),
    }
    port = free_port()
    ep = f"tcp://127.0.0.1:{port}"
    keys = client_keys(str(tmp_path / "kvscope.key_secret"), str(tmp_path / "probe.key"))
    with Harness(f"tcp://0.0.0.0:{port}", num_blocks=64, env=env) as h:
        assert h.ready["probed"] and logged(h, "CURVE keys; pause and step allowed")
        busy(h)
        for who, peer_keys in (
            ("no keys", None),
            ("a key the probe does not know", (*zmq.curve_keypair(), keys[2])),
        ):
            peer = RawPeer(ep, peer_keys)
            peer.hello()
            peer.send("Command", "pause", 1)
            assert peer.received(2.0) == [], who  # the handshake fails: not one byte of the pool
            peer.close()
        assert steps_go_on(h)
        t = time.monotonic()
        with pytest.raises(ValueError, match="asks for CURVE keys: give kvscope --probe-key"):
            ProbeSource(ep, wait_s=30)
        with pytest.raises(ValueError, match="refused kvscope's key"):
            ProbeSource(ep, wait_s=30, keys=(*zmq.curve_keypair(), keys[2]))
        assert time.monotonic() - t < 15  # said at the handshake, not after the wait
        src = ProbeSource(ep, wait_s=30, keys=keys)
        try:
            assert src.info.extra["control"]
            src.hold(True)
            assert src.mirror.paused
            at = src.mirror.vllm_step
            src.step()
            assert src.mirror.vllm_step == at + 1 and src.current().audit.ok
            tokens = [r.token_ids for r in src.current().snapshot.requests]  # an authenticated peer's: all of it
            assert tokens and all(list(t[:64]) == SYSTEM for t in tokens)
        finally:
            src.close()
        assert steps_go_on(h)


def test_subscribers_and_keyframes_are_bounded(vllm_python):
    """A keyframe is the one costly answer (the whole pool, under the scheduler's lock): a peer asking for one a
    hundred times a second gets one a second; and past 16 subscribers a Hello is refused."""
    from kvscope_vllm_probe.probe_io import MAX_SUBSCRIBERS

    ep = f"tcp://127.0.0.1:{free_port()}"
    with Harness(ep, num_blocks=64) as h:
        busy(h)
        greedy = RawPeer(ep)
        greedy.hello("greedy")
        assert greedy.wait_for("Keyframe") is not None
        t0, keyframes = time.monotonic(), 0
        while time.monotonic() - t0 < 3.0:
            for _ in range(10):
                greedy.send("Resync")
            keyframes += sum(m[0] == "Keyframe" for m in greedy.received(0.1))
        assert 1 <= keyframes <= 4  # about one a second, for 300 asked
        peers = [greedy]
        for i in range(MAX_SUBSCRIBERS - 1):
            p = RawPeer(ep)
            p.hello(f"peer {i}")
            peers.append(p)
        assert all(p.wait_for("Welcome", 10) is not None for p in peers[1:])
        one_too_many = RawPeer(ep)
        refused = one_too_many.refused("Hello", PROTOCOL, "one too many")
        assert refused == f"the probe has {MAX_SUBSCRIBERS} subscribers already"
        assert steps_go_on(h)
        for p in [*peers, one_too_many]:
            p.close()
