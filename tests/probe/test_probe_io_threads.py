"""The probe's socket shared by two threads (``probe_io.py``): vLLM's engine core sends each step itself while the
probe's I/O thread answers peers, the two taking turns under ``sock_lock``, and the I/O thread waits on the socket's
file descriptor, which ZeroMQ signals edge-triggered. A send by the engine thread can take the signal of input that
arrived meanwhile; the sender then wakes the I/O thread, so a peer is answered at once however fast steps go out
(missed, it would wait for the I/O thread's 0.1 s timeout). Played with a stand-in probe (no vLLM) and a peer
written with plain pyzmq: steps and answers side by side, then the wake-up itself, made to happen."""

from __future__ import annotations

import os
import resource
import threading
import time

import msgspec
import zmq
from ports import free_port
from raw_peer import RawPeer

from kvscope_vllm_probe.gate import Gate
from kvscope_vllm_probe.probe_io import ProbeIO
from kvscope_vllm_probe.security import Access


class StandInProbe:
    def __init__(self, endpoint: str) -> None:
        self.endpoint, self.access, self.instance = endpoint, Access(), "stand-in"
        self.vllm_version, self.dp_rank, self.dp_size = "0.0", 0, 1
        self.lock = threading.RLock()
        self.gate = Gate()
        self.in_step, self.step = False, 0

    def flush_between(self):
        return None

    def keyframe(self):
        return ["Keyframe"]


def test_steps_from_the_engine_thread_and_answers_from_the_io_thread_share_the_socket():
    probe = StandInProbe(f"tcp://127.0.0.1:{free_port()}")
    io = ProbeIO(probe)
    io.start()
    stop = threading.Event()
    sent = [0]

    def engine_core() -> None:  # vLLM's steps, one every 2 ms, each one sent by this thread
        while not stop.is_set():
            with probe.lock:
                io.post(b"\x91\xa4Step")  # msgpack ["Step"]
            sent[0] += 1
            time.sleep(0.002)

    engine = threading.Thread(target=engine_core)
    engine.start()
    peer = RawPeer(probe.endpoint)
    try:
        peer.hello("a peer among steps")
        assert peer.wait_for("Welcome", 5) is not None
        assert peer.wait_for("Keyframe", 5) is not None
        assert peer.wait_for("Step", 5) is not None  # subscribed: the engine thread's steps reach it
        slow = []
        for _ in range(20):  # heartbeats: each answered by a Pong, the I/O thread's, while steps pour out
            time.sleep(0.55)  # the probe pongs a peer at most every 0.5 s
            t0 = time.monotonic()
            peer.heartbeat()
            assert peer.wait_for("Pong", 5) is not None
            slow.append(time.monotonic() - t0)
        # answered at once, not at the I/O thread's 0.1 s timeout (a lost edge is rare here: the next test makes one)
        assert sorted(slow)[len(slow) // 2] < 0.05, slow
        assert sent[0] > 1000, sent[0]  # steps went on meanwhile
    finally:
        stop.set()
        engine.join(5)
        peer.close()
        io.stop()
    assert not io._thread.is_alive()
    io.post(b"\x91\xa4Step")  # after stop: sent nowhere, no error (a step that ends while vLLM shuts down)
    io.post(b"\x91\xa4Step", now=False)  # a step's record too: not kept for a socket that is gone
    assert not io._pending


def test_the_engine_threads_records_are_sent_by_the_io_thread_in_order_and_soon():
    """A step's record (``post(now=False)``) is left in a queue by vLLM's thread, which makes no send and no system
    call for it while the I/O thread is awake: the I/O thread sends what waits every ``FLUSH_S``, in the order posted.
    After a quiet spell the I/O thread naps (0.1 s waits), and the next record wakes it through its pipe, once."""
    probe = StandInProbe(f"tcp://127.0.0.1:{free_port()}")
    io = ProbeIO(probe)
    senders: set[int] = set()
    send_locked = io._send_locked

    def recorded_send(ident: bytes, data: bytes) -> None:
        if data.startswith(b"\x92\xa4Step"):
            senders.add(threading.get_ident())
        send_locked(ident, data)

    io._send_locked = recorded_send
    wakes = []
    wake = io._wake

    def counted_wake() -> None:
        wakes.append(threading.get_ident())
        wake()

    io._wake = counted_wake
    io.start()
    peer = RawPeer(probe.endpoint)
    try:
        peer.hello("a peer of a stepping vLLM")
        assert peer.wait_for("Keyframe", 5) is not None
        deadline = time.monotonic() + 5
        while not io.has_subscribers and time.monotonic() < deadline:
            time.sleep(0.01)

        def engine_core() -> None:  # 400 steps, one every 2 ms
            for i in range(400):
                with probe.lock:
                    io.post(msgspec.msgpack.encode(["Step", i]), now=False)
                time.sleep(0.002)

        engine = threading.Thread(target=engine_core)
        wakes.clear()
        engine.start()
        got = [m[1] for m in peer.received(3.0) if m[0] == "Step"]
        engine.join(5)
        assert got == list(range(400))  # every record, in order
        assert senders == {io._thread.ident}  # each sent by the I/O thread, none by vLLM's
        assert len(wakes) <= 1  # the first record may find it napping; then its own timeout wakes it

        time.sleep(0.5)  # quiet: the I/O thread naps
        assert io._napping
        wakes.clear()
        io.post(msgspec.msgpack.encode(["Step", 400]), now=False)
        assert wakes == [threading.get_ident()]  # vLLM's thread woke it
        assert peer.wait_for("Step", 2) == ["Step", 400]
    finally:
        peer.close()
        io.stop()


def test_a_send_that_finds_input_waiting_wakes_the_io_thread():
    """The edge the engine thread's send may take from the I/O thread is given back: after sending, a post that finds
    a peer's message waiting writes to the wake-up pipe the I/O thread waits on (its thread not started here, so
    nothing else reads the socket)."""
    probe = StandInProbe(f"tcp://127.0.0.1:{free_port()}")
    io = ProbeIO(probe)
    peer = RawPeer(probe.endpoint)
    try:
        peer.hello("a peer whose Hello waits")
        io.subscribed.add(b"nobody")  # a subscriber to send to (gone: its step is dropped, as for a peer that left)
        deadline = time.monotonic() + 5
        woke = b""
        while not woke and time.monotonic() < deadline:
            io.post(b"\x91\xa4Step")
            try:
                woke = os.read(io._wake_r, 16)
            except BlockingIOError:
                time.sleep(0.01)  # the Hello is still on its way
        assert woke, "a post found the Hello waiting and did not wake the I/O thread"
        with io.sock_lock:
            assert io.router.recv_multipart(zmq.NOBLOCK)[1][:7] == b"\x93\xa5Hello"  # it is there to be read
    finally:
        peer.close()
        io.stop()


def test_the_io_thread_waits_on_descriptors_past_1023():
    """vLLM raises the open-file limit and holds many files by the time the probe starts: its socket's descriptor and
    its wake-up pipe can be past 1,023, which select(2) cannot take (the I/O thread died on its first wait)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1200
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    held = []
    try:
        while len(held) < 1100:
            held.append(os.open(os.devnull, os.O_RDONLY))
        probe = StandInProbe(f"tcp://127.0.0.1:{free_port()}")
        io = ProbeIO(probe)
        assert min(io._fd, io._wake_r) > 1023
        io.start()
        peer = RawPeer(probe.endpoint)
        try:
            peer.hello("a peer of a busy vLLM")
            assert peer.wait_for("Welcome", 5) is not None
            assert io._thread.is_alive()
        finally:
            peer.close()
            io.stop()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
