"""The probe's socket: one ROUTER at the endpoint, owned by one thread, safe to leave on a shared network.

The engine core's thread hands it encoded steps through an inproc PAIR (ZeroMQ sockets are not shared between
threads). What a peer may do (``security.py``): nothing before ``Hello``; then watch (a keyframe, every step);
pause, step and run only if vLLM allows control; switch faults only if vLLM allows them. Whatever a peer sends,
vLLM is not the worse for it:
- a message larger than ``MAX_IN_BYTES`` ends that peer's connection (ZeroMQ's ``MAXMSGSIZE``: never read);
- one the wire does not know, or one it is not allowed, is answered with one ``Refused``, at most one a second
  (a flood is not answered message for message), and never reaches vLLM;
- a flood is read ``MAX_BATCH`` messages at a time between sending vLLM's steps (ZeroMQ's high-water mark holds
  the rest back in the peer's own socket), and keyframes, the one costly answer (the whole pool, under the
  scheduler's lock), go at most one a second to a peer and one every ``KEYFRAME_GAP_S`` in all;
- at most ``MAX_SUBSCRIBERS`` peers subscribe;
- a peer silent for ``SILENT_S`` (heartbeats every second) is gone, and any pause it holds with it.
"""

from __future__ import annotations

import logging
import threading
import time
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
        inproc = f"inproc://kvscope-probe-{probe.instance}"
        self.inbox = self.ctx.socket(zmq.PAIR)
        self.inbox.bind(inproc)
        self.outbox = self.ctx.socket(zmq.PAIR)  # used by the engine core's thread only
        self.outbox.connect(inproc)
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
        self._thread.join(2.0)
        self.outbox.close(0)
        self._close_all()

    def _close_all(self) -> None:
        if self.auth is not None:
            self.auth.stop()
            self.auth = None
        self.ctx.destroy(linger=0)

    def post(self, data: bytes) -> None:
        """From the engine core's thread: to every subscriber."""
        self.outbox.send(data, copy=False)

    # -- the thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.inbox, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(100))
                if self.inbox in ready:
                    while True:
                        try:
                            data = self.inbox.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._broadcast(data)
                if self.router in ready:
                    for _ in range(MAX_BATCH):
                        try:
                            frames = self.router.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._handle(frames)
                self._housekeeping()
        except Exception:  # noqa: BLE001 - the probe must never take vLLM down
            logger.exception("kvscope probe: its I/O thread stopped; vLLM runs on unprobed")
            self.probe.gate.run()
        finally:
            self.router.close(0)
            self.inbox.close(0)

    def _send(self, ident: bytes, data: bytes) -> None:
        try:
            self.router.send_multipart([ident, data], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # full or gone: a subscriber that misses a step asks for a keyframe

    def _broadcast(self, data: bytes) -> None:
        for ident in self.subscribed:
            self._send(ident, data)

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
            others = [i for i in self.subscribed if i != ident]
            kf = probe.keyframe()
            # subscribed before the lock is let go: a step that ends after this keyframe is this subscriber's. Added
            # after the send, a step ending in between found nobody subscribed and dropped its ops (the rows were
            # then sent whole, their blocks' ref counts never: "ref count 0, tables hold 1" in CI, once in a while)
            self.subscribed.add(ident)
        if between is not None:
            for other in others:
                self._send(other, between)
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
                self._broadcast(encode(Held(probe.gate.paused, probe.step, probe.gate.holder)))

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
            self._broadcast(encode(Held(False, self.probe.step, "", f"{peer.name} {why}")))

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
                finally:
                    lock.release()
                if data is not None:
                    self._broadcast(data)
