"""The probe on a real vLLM-CPU server as people run it on a shared network: ``--data-parallel-size 2``, the probe on
``tcp://0.0.0.0`` with CURVE keys, pause and step allowed, faults from subscribers off (one server for the module:
two engine cores take a few minutes to start on 2 cores).

kvscope reads both ranks (8 completions, all 8 seen, both audits clean); then peers written with plain pyzmq
(``raw_peer``, none of kvscope's code) send what a stranger or a broken client would, and after each vLLM still
answers a completion.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import zmq
from ports import free_ports
from raw_peer import RawPeer
from vllm_live import CONTROL, VllmServer, logged, need_vllm, stop_headless, wait_reading

from kvscope_vllm_probe.keys import make_keys
from kvscope_vllm_probe.security import client_keys


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    need_vllm()
    folder = tmp_path_factory.mktemp("probe-keys")
    make_keys(str(folder), ["kvscope"])
    port = free_ports(2)[0]  # rank 0's probe at port, rank 1's at port + 1
    env = {
        **CONTROL,
        "KVSCOPE_PROBE_SECRET_KEY": str(folder / "probe.key_secret"),
        "KVSCOPE_PROBE_AUTHORIZED_KEYS": str(folder / "authorized"),
    }
    with VllmServer(
        probe=f"tcp://0.0.0.0:{port}",
        extra=("--data-parallel-size", "2"),
        env=env,
        max_model_len=512,
        startup_s=600,
    ) as s:
        s.rank0 = f"tcp://127.0.0.1:{port}"
        s.key, s.server_key = str(folder / "kvscope.key_secret"), str(folder / "probe.key")
        s.keys = client_keys(s.key, s.server_key)
        yield s


def answers(server, n: int = 1) -> None:
    """vLLM serves: ``n`` completions at once (the front end spreads them over both ranks), each answered in full."""
    got: list[int] = []

    def ask() -> None:
        got.append(server.complete("The capital of France is", max_tokens=4, timeout=60)["usage"]["completion_tokens"])

    threads = [threading.Thread(target=ask, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert got == [4] * n


def probe_answers(server) -> None:
    """The probe still greets a new subscriber with the pool."""
    fresh = RawPeer(server.rank0, server.keys)
    fresh.hello("a newcomer")
    assert fresh.wait_for("Keyframe", 15) is not None
    fresh.die()


def test_both_ranks_are_read_all_eight_completions_seen_and_both_audits_clean(server):
    assert logged(server, f"at tcp://0.0.0.0:{int(server.rank0.rsplit(':', 1)[1]) + 1} for data-parallel rank 1 of 2")
    before = server.log_text().count("kvscope (kvscope-vllm-probe")
    kvscope = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvscope",
            "--headless",
            "--json",
            "--probe",
            server.rank0,
            "--probe-key",
            server.key,
            "--probe-server-key",
            server.server_key,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, QT_QPA_PLATFORM="offscreen"),
    )
    try:
        deadline = time.monotonic() + 120  # both ranks' probes say kvscope subscribed
        while server.log_text().count("kvscope (kvscope-vllm-probe") < before + 2:
            assert kvscope.poll() is None and time.monotonic() < deadline, (
                kvscope.stderr.read() if kvscope.poll() else ""
            )
            time.sleep(0.2)
        wait_reading(kvscope)
        threads = [
            threading.Thread(target=server.complete, args=(f"Question {i}: name a colour.",), kwargs={"max_tokens": 12})
            for i in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        d = stop_headless(kvscope)
    finally:
        if kvscope.poll() is None:
            kvscope.kill()
    assert d["requests_seen"] == 8
    ranks = d["dp_ranks"]
    assert [(r["rank"], r["answered"]) for r in ranks] == [(0, True), (1, True)]
    assert sum(r["requests_seen"] for r in ranks) == 8 and all(r["requests_seen"] >= 1 for r in ranks)
    for r in ranks:
        assert r["audit_problems"] == [] and r["flagged_blocks"] == 0, r


def test_a_peer_without_an_authorized_key_gets_nothing(server):
    for peer_keys in (None, (*zmq.curve_keypair(), server.keys[2])):
        peer = RawPeer(server.rank0, peer_keys)
        peer.hello()
        peer.send("Command", "pause", 1)
        assert peer.received(2.0) == []  # not a Welcome, not a block, not a token id
        peer.die()
    answers(server)


def test_an_unknown_message_type_is_refused(server):
    peer = RawPeer(server.rank0, server.keys)
    refused = peer.refused("Launch", "missiles", 3)
    assert refused is not None and "cannot read that message" in refused
    peer.die()
    answers(server)


def test_a_100_mb_frame_is_dropped_unread(server):
    peer = RawPeer(server.rank0, server.keys)
    peer.send_bytes(b"\x00" * (100 * 2**20))
    assert peer.received(3.0) == []  # past ZMQ_MAXMSGSIZE: the probe drops the connection, reads nothing
    peer.die()
    answers(server)
    probe_answers(server)


def test_ten_thousand_messages_a_second(server):
    flood = RawPeer(server.rank0, server.keys)
    flood.hello("flood")
    assert flood.wait_for("Welcome", 10) is not None
    done = threading.Event()
    served: list[dict] = []

    def ask() -> None:
        served.append(server.complete("Count to three:", max_tokens=4, timeout=60))
        done.set()

    threading.Thread(target=ask, daemon=True).start()
    t0 = time.monotonic()
    for k in range(10):  # 10,000 messages in one second: heartbeats, resyncs, commands, junk
        for i in range(1000):
            kind = (k * 1000 + i) % 4
            if kind == 0:
                flood.heartbeat()
            elif kind == 1:
                flood.send("Resync")
            elif kind == 2:
                flood.send("Command", "run", 1)
            else:
                flood.send_bytes(b"\xc1junk")
        time.sleep(max(0.0, t0 + (k + 1) * 0.1 - time.monotonic()))
    assert time.monotonic() - t0 < 2.0
    assert done.wait(60) and served[0]["usage"]["completion_tokens"] == 4  # answered during the flood
    flood.die()
    probe_answers(server)
    answers(server)


def test_a_command_with_no_hello_is_refused(server):
    peer = RawPeer(server.rank0, server.keys)
    refused = peer.refused("Command", "pause", 1)
    assert refused is not None and "say Hello first" in refused
    peer.die()
    answers(server)


def test_a_fault_with_faults_off_is_refused(server):
    peer = RawPeer(server.rank0, server.keys)
    peer.hello("would-be saboteur")
    assert peer.wait_for("Welcome", 10)[8] is False  # the probe says faults are off
    peer.send("SetFault", "leak-last-block", True)
    refused = peer.wait_for("Refused", 5, beat=True)
    assert refused is not None and "faults are off" in refused[1]
    peer.die()
    answers(server)
    assert not logged(server, "will not be freed", timeout=0.5)


def test_a_pause_whose_sender_dies_lasts_5_s_at_most(server):
    watcher = RawPeer(server.rank0, server.keys)
    watcher.hello("watcher")
    assert watcher.wait_for("Keyframe", 15, beat=True) is not None
    holder = RawPeer(server.rank0, server.keys)
    holder.hello("pauser")
    assert holder.wait_for("Welcome", 10) is not None
    holder.send("Command", "pause", 1)
    held = watcher.wait_for("Held", 10, beat=True)
    assert held is not None and held[1] is True and held[3].startswith("pauser #")
    t = time.monotonic()
    holder.die()  # gone without a goodbye, holding rank 0
    released = watcher.wait_for("Held", 15, beat=True)
    assert released is not None and released[1] is False and "went silent for 5 s" in released[4]
    assert time.monotonic() - t <= 9.0
    assert logged(server, "held vLLM paused and went silent for 5 s: vLLM runs on")
    watcher.die()
    answers(server, 4)  # spread over both ranks: rank 0's too
