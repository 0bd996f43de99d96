"""The probe's socket: one ROUTER at the endpoint, shared by two threads, safe to leave on a shared network.

vLLM's engine core thread leaves its steps' records in a queue, and the probe's I/O thread sends them every
``FLUSH_S`` and answers peers. Both threads may send (a pause's ``Held`` goes at once, from whichever thread made it),
taking turns on the socket under ``sock_lock`` (a ZeroMQ socket may pass between threads with a memory barrier
between uses, which the lock is). The I/O thread never uses the socket to wait: it waits on the socket's file
descriptor (``zmq.FD``), which ZeroMQ signals edge-triggered, so whoever used the socket last looks whether input is
waiting and, if so, wakes it. The I/O thread is woken by its own timeout while vLLM steps, not by vLLM's thread:
handing it each step through an inproc PAIR cost that thread's wake-up every step, 0.07 to 0.13 ms of CPU a step at
GPU size (``bench/probe_cost.py``). Lock order: the probe's lock, then ``sock_lock``; the I/O thread never waits for
the probe's lock while it holds ``sock_lock``.

What a peer may do (``security.py``): nothing before ``Hello``; then watch (a keyframe, every step); pause, step and
run only if vLLM allows control; switch faults only if vLLM allows them. Whatever a peer sends, vLLM is not the
worse for it:
- a message larger than ``MAX_IN_BYTES`` ends that peer's connection (ZeroMQ's ``MAXMSGSIZE``: never read);
- one the wire does not know, or one it is not allowed, is answered with one ``Refused``, at most one a second
  (a flood is not answered message for message), and never reaches vLLM;
- a flood is read ``MAX_BATCH`` messages at a time, the socket let go between batches for vLLM's steps (ZeroMQ's
  high-water mark holds the rest back in the peer's own socket), and keyframes, the one costly answer (the whole
  pool, under the scheduler's lock), go at most one a second to a peer and one every ``KEYFRAME_GAP_S`` in all;
- at most ``MAX_SUBSCRIBERS`` peers subscribe;
- a peer silent for ``SILENT_S`` (heartbeats every second) is gone, and any pause it holds with it.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

import zmq

from . import __version__
from .security import serve_securely
from .wire import (
    PROTOCOL,
    SILENT_S,
    Bye,
    Command,
    Heartbeat,
    Held,
    Hello,
    Pong,
    Refused,
    Resync,
    SetFault,
    Welcome,
    decode_to_probe,
    encode,
)

if TYPE_CHECKING:
    from .probe import Probe

logger = logging.getLogger("kvscope_vllm_probe")

MAX_IN_BYTES = 64 * 1024  # a subscriber's largest message is a Hello of a few hundred bytes
MAX_SUBSCRIBERS = 16
MAX_BATCH = 256  # messages read in a row before the thread sends what vLLM posted
KEYFRAME_EVERY_S = 1.0  # to one peer (a Resync or Hello sooner is answered when the second is up)
KEYFRAME_GAP_S = 0.25  # between any two keyframes
ANSWER_EVERY_S = 1.0  # a Refused to one peer, a Refused to strangers in all
PONG_EVERY_S = 0.5  # a Pong to one peer (its heartbeats come every second)
# The I/O thread sends the steps' records this often while vLLM steps (ProbeIO._flush_locked). Each of its wakes
# costs the process ~0.4 ms of CPU on this 2-core machine whatever it sends (its GIL taken from vLLM's thread, the
# socket's calls): read per thread from /proc on the hybrid pool at GPU size, 0.01 s cost 0.17-0.25 ms of its CPU
# a vLLM step and ZeroMQ's thread 0.04, 0.05 s 0.08-0.13 and 0.02 (2026-12-08). A window 50 ms behind vLLM is
# still live to the eye; a pause's Held and a command's answer go at once, as before.
FLUSH_S = 0.05
MAX_STEP = 10_000  # schedules one Step command may ask for
NAME_CHARS = 80  # of a peer's name, kept for vLLM's log


def clean(text: str) -> str:
    """A peer's own words, fit for one line of vLLM's log: printable, and not long."""
    return "".join(c if c.isprintable() else "?" for c in text[:NAME_CHARS])


def peer_name(client: str, number: int) -> str:
    """A subscriber's name in vLLM's log and in ``Held``: its own, numbered (two may say the same)."""
    return f"{clean(client) or 'a subscriber'} #{number}"


class _Peer:
    __slots__ = ("name", "last_seen", "keyframe_at", "refused_at", "pong_at", "welcome_at")

    def __init__(self, name: str) -> None:
        self.name = name
        self.last_seen = time.monotonic()
        self.keyframe_at = -KEYFRAME_EVERY_S
        self.refused_at = -ANSWER_EVERY_S
        self.pong_at = -PONG_EVERY_S
        self.welcome_at = -ANSWER_EVERY_S


class ProbeIO:
    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.ctx = zmq.Context()  # the probe's own: its ZAP handler must not judge vLLM's sockets
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.SNDHWM, 10_000)  # past it a slow subscriber misses steps and resyncs
        self.router.setsockopt(zmq.RCVHWM, 1_000)
        self.router.setsockopt(zmq.MAXMSGSIZE, MAX_IN_BYTES)
        self.router.setsockopt(zmq.IPV6, int("[" in probe.endpoint))  # tcp://[::1]:PORT
        self.auth = None
        try:
            self.auth = serve_securely(self.ctx, self.router, probe.access)
            self.router.bind(probe.endpoint)
        except Exception:
            self._close_all()
            raise
        self.sock_lock = threading.Lock()  # every use of ``router`` (see the module's docstring)
        self._closed = False  # the router is closed (under sock_lock): the engine thread sends nothing more
        # records posted and not sent yet, each with the subscribers it is for (see _flush_locked): the engine core's
        # thread appends its steps' with no lock (a deque's append and popleft are atomic), whoever sends pops them
        # under sock_lock
        self._pending: deque[tuple[tuple[bytes, ...], bytes]] = deque()
        self._flushed_at = 0.0  # the last send of records (monotonic)
        self._napping = False  # the I/O thread waits 0.1 s, not FLUSH_S (see _send_due_locked)
        self._fd = int(self.router.getsockopt(zmq.FD))
        self._wake_r, self._wake_w = os.pipe()  # stop(), and input the engine thread's send saw first
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.peers: dict[bytes, _Peer] = {}  # those that said Hello
        # those that have had a keyframe: steps go to them (a set: the engine core's thread reads its size)
        self.subscribed: set[bytes] = set()
        self.want_keyframe: dict[bytes, None] = {}  # in the order asked
        self._last_keyframe = -KEYFRAME_GAP_S
        self._refused_strangers_at = -ANSWER_EVERY_S
        self._numbered = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvscope-probe", daemon=True)

    @property
    def has_subscribers(self) -> bool:
        """Someone receives steps (or is about to: the changes until its keyframe are in the keyframe)."""
        return bool(self.subscribed)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake()
        if self._thread.ident is not None:  # started
            self._thread.join(2.0)
        with self.sock_lock:
            if self._pending and not self._closed:
                try:
                    self._flush_locked()  # the last steps' records, to whoever still listens
                except zmq.ZMQError:
                    pass
            self._closed = True
            self.router.close(0)
        self._close_all()
        if not self._thread.is_alive():  # else it may still write a wake-up: a closed number may be reused
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)

    def _close_all(self) -> None:
        if self.auth is not None:
            self.auth.stop()
            self.auth = None
        self.ctx.destroy(linger=0)

    def post(self, data: bytes, but: bytes | None = None, now: bool = True) -> None:
        """To every subscriber (but ``but``), from any thread: the engine core's steps go through this. ``now``
        False (a step's record, from the engine core's thread): it waits for the I/O thread, which sends what waits
        every ``FLUSH_S`` (see ``_flush_locked``); whatever is sent after it goes after it."""
        subscribed = tuple(self.subscribed)  # one read: the I/O thread may add or drop a peer meanwhile
        if but is not None:
            subscribed = tuple(i for i in subscribed if i != but)
        if not subscribed:
            return
        if not now:
            if self._closed:  # read with no lock: a record posted as the socket closes goes nowhere, either way
                return
            self._pending.append((subscribed, data))  # no lock: the engine core's thread does not wait on the I/O
            if self._napping:  # the I/O thread waits long: the first record after a quiet spell wakes it
                self._napping = False
                self._wake()
            return
        with self.sock_lock:
            if self._closed:
                return
            self._pending.append((subscribed, data))
            waiting = self._flush_locked()
        if waiting:  # the send took the descriptor's signal of input the I/O thread has not read
            self._wake()

    def _flush_locked(self) -> bool:
        """Send what waits, in order, each to the subscribers it was posted to (under ``sock_lock``); whether a
        peer's message is waiting to be read.

        The engine core's thread does not send its steps' records itself: the I/O thread sends them every
        ``FLUSH_S``, woken by its own timeout, so that vLLM's thread makes no system call for the probe. A send wakes
        ZeroMQ's I/O thread: when vLLM's thread sent its records itself (every second or third step's, batched by
        ``FLUSH_S``), a post cost it 113 us of wall time a step, 72 of CPU, at GPU size on a hybrid pool
        (2026-12-07); leaving the record in the queue costs it 8.5 us. While vLLM steps, the I/O thread wakes every
        ``FLUSH_S`` and sends whatever its records are; after a ``FLUSH_S`` with none it naps, and the next record
        wakes it through the pipe. A pause, a command's answer, a keyframe and anything the I/O thread sends go at
        once, after what waits."""
        self._flushed_at = time.monotonic()
        pending = self._pending
        while pending:  # what the engine core's thread appends meanwhile goes too, in order
            subscribed, data = pending.popleft()
            for ident in subscribed:
                self._send_locked(ident, data)
        return self._input_waiting()

    def _input_waiting(self) -> bool:
        """A peer's message is waiting to be read (under ``sock_lock``): a use of the socket may have taken the
        edge-triggered descriptor's signal of it, so whoever used the socket asks."""
        return bool(int(self.router.getsockopt(zmq.EVENTS)) & zmq.POLLIN)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"!")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (the thread has wake-ups to read already) or closed

    # -- the thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        # poll(2), not select(2): vLLM raises the open-file limit and opens many, and select takes no descriptor
        # past 1,023
        waiter = select.poll()
        waiter.register(self._fd, select.POLLIN)
        waiter.register(self._wake_r, select.POLLIN)
        try:
            while not self._stop.is_set():
                with self.sock_lock:
                    if self._closed:
                        return
                    batch = []
                    for _ in range(MAX_BATCH):
                        try:
                            batch.append(self.router.recv_multipart(zmq.NOBLOCK))
                        except zmq.Again:
                            break
                for frames in batch:
                    self._handle(frames)
                self._housekeeping()
                with self.sock_lock:  # our own sends may have taken the descriptor's signal: look before waiting
                    if self._closed:
                        return
                    wait_ms = self._send_due_locked()
                    waiting = self._input_waiting()
                if waiting or len(batch) == MAX_BATCH:
                    continue
                ready = {fd for fd, _ in waiter.poll(wait_ms)}
                if self._wake_r in ready:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
        except Exception:  # noqa: BLE001 - the probe must never take vLLM down
            if self._stop.is_set():
                return  # stopping: stop() closes what is left
            logger.exception("kvscope probe: its I/O thread stopped; vLLM runs on unprobed")
            self.probe.gate.run()
            with self.sock_lock:
                self.subscribed.clear()  # the engine thread's steps go nowhere: nobody answers the peers now
                self._pending.clear()
                self._closed = True
                self.router.close(0)

    def _send_due_locked(self) -> float:
        """The steps' records that waited ``FLUSH_S`` go (under ``sock_lock``); how long to wait for the next look,
        in ms: what is left of ``FLUSH_S`` while vLLM steps, 100 once a whole ``FLUSH_S`` passed with no record (a
        nap: the next record wakes this thread, ``post``)."""
        since = time.monotonic() - self._flushed_at
        if since >= FLUSH_S:
            if not self._pending:
                self._napping = True  # then looked at again: a record appended before this was set wakes nobody
                if not self._pending:
                    return 100.0
            self._flush_locked()
            since = 0.0
        self._napping = False
        return (FLUSH_S - since) * 1000

    def _send(self, ident: bytes, data: bytes) -> None:
        with self.sock_lock:
            if not self._closed:
                if self._pending:
                    self._flush_locked()  # what the engine's thread posted goes first
                self._send_locked(ident, data)

    def _send_locked(self, ident: bytes, data: bytes) -> None:
        try:
            self.router.send_multipart([ident, data], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # full or gone: a subscriber that misses a step asks for a keyframe

    def _refuse(self, ident: bytes, reason: str) -> None:
        """One ``Refused``, unless this peer (or, for strangers, any stranger) was refused less than a second ago."""
        now = time.monotonic()
        peer = self.peers.get(ident)
        if peer is not None:
            if now - peer.refused_at < ANSWER_EVERY_S:
                return
            peer.refused_at = now
        else:
            if now - self._refused_strangers_at < ANSWER_EVERY_S:
                return
            self._refused_strangers_at = now
        self._send(ident, encode(Refused(reason)))

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            return  # not a DEALER's one frame: not the wire
        ident, data = frames
        peer = self.peers.get(ident)
        if peer is not None:
            peer.last_seen = time.monotonic()
        try:
            msg = decode_to_probe(data)
        except ValueError:
            self._refuse(ident, "the probe cannot read that message (not kvscope's probe wire)")
            return
        if isinstance(msg, Hello):
            self._hello(ident, peer, msg)
            return
        if peer is None:
            if not isinstance(msg, Heartbeat):  # a stranger's heartbeat (one that knew a vLLM before a restart)
                self._refuse(ident, "say Hello first: the probe answers subscribers only")  # gets silence: it greets
            return
        match msg:
            case Heartbeat():
                now = time.monotonic()
                if now - peer.pong_at >= PONG_EVERY_S:
                    peer.pong_at = now
                    self._send(ident, encode(Pong()))
            case Resync():
                self.want_keyframe[ident] = None
            case Command(op, n):
                self._command(ident, peer, op, n)
            case SetFault(name, on):
                self._set_fault(ident, name, on)
            case Bye():
                self._drop(ident, "said goodbye")

    def _hello(self, ident: bytes, peer: _Peer | None, msg: Hello) -> None:
        if msg.protocol != PROTOCOL:
            self._refuse(
                ident,
                f"the probe in vLLM speaks probe protocol {PROTOCOL} (kvscope-vllm-probe {__version__}), "
                f"{clean(msg.client) or 'the subscriber'} speaks {msg.protocol}: "
                "install the probe from the same kvscope",
            )
            return
        if peer is None:
            if len(self.peers) >= MAX_SUBSCRIBERS:
                self._refuse(ident, f"the probe has {MAX_SUBSCRIBERS} subscribers already")
                return
            self._numbered += 1
            peer = self.peers[ident] = _Peer(peer_name(msg.client, self._numbered))
            logger.info("kvscope probe: %s subscribed", peer.name)
        now = time.monotonic()
        if now - peer.welcome_at < ANSWER_EVERY_S:
            return  # a Hello again within the second: the Welcome and keyframe on their way answer it
        peer.welcome_at = now
        probe, a = self.probe, self.probe.access
        welcome = Welcome(
            PROTOCOL,
            __version__,
            probe.vllm_version,
            probe.instance,
            probe.dp_rank,
            probe.dp_size,
            a.control,
            a.remote_faults,
        )
        self._send(ident, encode(welcome))
        self.want_keyframe[ident] = None

    def _send_keyframe(self, ident: bytes) -> None:
        probe = self.probe
        with probe.lock:
            between = probe.flush_between()  # what others have not been sent yet goes first, to them
            if between is not None:
                self.post(between, but=ident)
            kf = probe.keyframe()
            # subscribed before the lock is let go: a step that ends after this keyframe is this subscriber's. Added
            # after the send, a step ending in between found nobody subscribed and dropped its ops (the rows were
            # then sent whole, their blocks' ref counts never: "ref count 0, tables hold 1" in CI, once in a while)
            self.subscribed.add(ident)
            # sent under the lock too: the engine thread sends its steps itself, and none may overtake this
            self._send(ident, encode(kf))
        self.peers[ident].keyframe_at = self._last_keyframe = time.monotonic()

    def _command(self, ident: bytes, peer: _Peer, op: str, n: int) -> None:
        probe = self.probe
        if op not in ("pause", "step", "run"):
            self._refuse(ident, f"unknown command {op[:NAME_CHARS]!r}: pause, step or run")
            return
        if not probe.access.control:
            self._refuse(
                ident,
                f"vLLM's probe is read-only: {op} refused (start vLLM with KVSCOPE_PROBE_CONTROL=1 to pause and "
                "step it)",
            )
            return
        if op == "pause":
            probe.gate.pause(peer.name, ident)
        elif op == "step":
            n = min(max(1, n), MAX_STEP)
            probe.gate.step(n, peer.name, ident)
        else:
            probe.gate.run()
        logger.info("kvscope probe: %s: %s%s", peer.name, op, f" {n}" if op == "step" else "")
        with probe.lock:  # between two steps: say where vLLM stands (a step in progress says it when it ends)
            if not probe.in_step:
                self.post(encode(Held(probe.gate.paused, probe.step, probe.gate.holder)))

    def _set_fault(self, ident: bytes, name: str, on: bool) -> None:
        probe = self.probe
        if not probe.access.remote_faults:
            self._refuse(
                ident,
                "faults are off: start vLLM with KVSCOPE_PROBE_REMOTE_FAULTS=1 to switch them from a subscriber "
                "(for tests; never in production)",
            )
            return
        try:
            with probe.lock:
                probe.faults.set(name, on)
        except ValueError as e:
            self._refuse(ident, str(e)[:200])
            return
        logger.warning("kvscope probe: %s switched fault %s %s", self.peers[ident].name, name, "on" if on else "off")

    def _drop(self, ident: bytes, why: str) -> None:
        peer = self.peers.pop(ident, None)
        self.want_keyframe.pop(ident, None)
        self.subscribed.discard(ident)
        if peer is None:
            return
        logger.info("kvscope probe: %s %s", peer.name, why)
        gate = self.probe.gate
        if gate.paused and gate.holder_id == ident:
            gate.run()
            logger.warning("kvscope probe: %s held vLLM paused and %s: vLLM runs on", peer.name, why)
            # under the probe's lock: a step ending meanwhile saw the pause and says Held(True) first, not after
            with self.probe.lock:
                self.post(encode(Held(False, self.probe.step, "", f"{peer.name} {why}")))

    def _housekeeping(self) -> None:
        now = time.monotonic()
        for ident in [i for i, p in self.peers.items() if now - p.last_seen > SILENT_S]:
            self._drop(ident, f"went silent for {SILENT_S:.0f} s")
        if self.want_keyframe and now - self._last_keyframe >= KEYFRAME_GAP_S:
            for ident in self.want_keyframe:
                if now - self.peers[ident].keyframe_at >= KEYFRAME_EVERY_S:
                    del self.want_keyframe[ident]
                    self._send_keyframe(ident)
                    break
        if self.has_subscribers and not self.probe.in_step:
            lock = self.probe.lock
            if lock.acquire(blocking=False):
                try:
                    data = self.probe.flush_between()
                    if data is not None:  # under the lock: the next step's record must not overtake it
                        self.post(data)
                finally:
                    lock.release()
