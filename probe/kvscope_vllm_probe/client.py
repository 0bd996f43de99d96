"""A subscriber's end of the probe's wire: a DEALER on its own thread, with heartbeats and reconnection.

``get()`` hands over, in order, what the probe sent (decoded ``wire`` messages) and what happened to the
connection (``Link`` notices: silent, answering again, an unreadable message). The subscriber applies
keyframes and steps; when it sees a gap in ``seq`` it calls ``resync()``. A probe that stops answering is
greeted again every ``HELLO_EVERY_S`` until one answers: a restarted vLLM answers with a new ``instance``.
With ``keys`` (``security.client_keys``) the connection is CURVE: authenticated both ways, and encrypted. A
handshake the probe refuses (no key, a key it does not know, the wrong probe key) is a ``Link`` "refused".
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from .wire import (
    HEARTBEAT_S,
    PROTOCOL,
    Bye,
    Command,
    Heartbeat,
    Hello,
    Message,
    Resync,
    SetFault,
    Welcome,
    decode_from_probe,
    encode,
)

SILENCE_S = 3.0  # nothing from the probe this long (it answers every heartbeat): it is gone
HELLO_EVERY_S = 1.0
MAX_MESSAGE_BYTES = 512 * 2**20  # a keyframe of a million blocks is a few tens of MB
MAX_INBOX = 20_000  # messages kept for a reader that does not read; past it they are dropped and a keyframe asked for


@dataclass(frozen=True, slots=True)
class Link:
    """What happened to the connection: ``kind`` is "silent", "answering", "unreadable", "behind" (messages dropped
    unread: resync) or "refused" (the handshake: keys)."""

    kind: str
    text: str


MECHANISM_MISMATCH = 0x11000002  # ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: one end has keys, the other none


def handshake_failure(endpoint: str, event: int, value: int, keys: bool) -> str | None:
    """One line for a failed handshake as the socket monitor reports it, or None for one that says nothing."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (
            f"the probe at {endpoint} refused kvscope's key (status {value}): its public certificate is not in the "
            "folder KVSCOPE_PROBE_AUTHORIZED_KEYS names in vLLM's environment"
        )
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == MECHANISM_MISMATCH:
        if keys:
            return f"the probe at {endpoint} has no keys: connect without --probe-key and --probe-server-key"
        return (
            f"the probe at {endpoint} asks for CURVE keys: give kvscope --probe-key (your secret certificate) and "
            "--probe-server-key (the probe's public one)"
        )
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and keys:
        return (
            f"the handshake with the probe at {endpoint} failed: is --probe-server-key the public certificate of "
            "the probe's KVSCOPE_PROBE_SECRET_KEY?"
        )
    return None


class ProbeClient:
    def __init__(self, endpoint: str, client: str, keys: tuple[bytes, bytes, bytes] | None = None) -> None:
        """``keys``: (this subscriber's public key, its secret key, the probe's public key) for CURVE."""
        self.endpoint = endpoint
        self.client = client
        self.keys = keys
        self.inbox: queue.Queue = queue.Queue()
        self._out: deque[bytes] = deque()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvscope-probe-client", daemon=True)
        self.instance = ""  # the probe's, from its last Welcome
        self.unreadable = 0

    def start(self) -> None:
        self._thread.start()

    def get(self, timeout: float | None) -> Message | Link | None:
        try:
            return self.inbox.get(timeout=timeout) if timeout else self.inbox.get_nowait()
        except queue.Empty:
            return None

    def send(self, msg: Message) -> None:
        self._out.append(encode(msg))

    def command(self, op: str, n: int = 1) -> None:
        self.send(Command(op, n))

    def resync(self) -> None:
        self.send(Resync())

    def set_fault(self, name: str, on: bool) -> None:
        self.send(SetFault(name, on))

    def close(self, timeout: float = 2.0) -> None:
        """Say goodbye (a pause this subscriber holds ends with it) and stop."""
        if self._thread.is_alive():
            self.send(Bye())
            self._stop.set()
            self._thread.join(timeout)

    def _drop_inbox(self) -> None:
        dropped = 0
        while True:
            try:
                self.inbox.get_nowait()
            except queue.Empty:
                break
            dropped += 1
        self.inbox.put(Link("behind", f"kvscope fell {dropped} messages behind the probe: reading its pool again"))

    def _run(self) -> None:
        ctx: zmq.Context = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 500)  # long enough for the goodbye to leave
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        # queue nothing for a probe that is not there yet: a vLLM started later must not get a backlog of hellos
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.IPV6, int("[" in self.endpoint))  # tcp://[::1]:PORT
        if self.keys is not None:
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = self.keys
        failures = (
            zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_SUCCEEDED
        )
        monitor = sock.get_monitor_socket(failures, addr=f"inproc://kvscope-probe-monitor-{uuid.uuid4().hex}")
        said_refused = ""
        sock.connect(self.endpoint)
        hello = encode(Hello(PROTOCOL, self.client))

        def send(data: bytes) -> None:
            try:
                sock.send(data, zmq.NOBLOCK)
            except zmq.Again:
                pass  # no probe connected: heartbeats and hellos are sent again, commands wait for one

        send(hello)
        now = time.monotonic()
        last_heard, last_beat, last_hello, silent = now, now, now, False
        subscribed = False
        try:
            while True:
                while self._out:
                    send(self._out.popleft())
                if self._stop.is_set():
                    break
                while monitor.poll(0):
                    ev = recv_monitor_message(monitor)
                    if ev["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                        said_refused = ""
                        continue
                    text = handshake_failure(self.endpoint, ev["event"], ev["value"], self.keys is not None)
                    if text is not None and text != said_refused:  # said once, not at every reconnection
                        said_refused = text
                        self.inbox.put(Link("refused", text))
                if sock.poll(50):
                    while True:
                        try:
                            data = sock.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        last_heard = time.monotonic()
                        if silent:
                            silent = False
                            self.inbox.put(Link("answering", f"the probe at {self.endpoint} answers again"))
                        try:
                            msg = decode_from_probe(data)
                        except ValueError as e:
                            self.unreadable += 1
                            self.inbox.put(
                                Link(
                                    "unreadable",
                                    f"a message kvscope cannot read was skipped ({str(e).splitlines()[0]})",
                                )
                            )
                            continue
                        if isinstance(msg, Welcome):
                            self.instance = msg.instance
                            subscribed = True
                        if self.inbox.qsize() >= MAX_INBOX:  # nobody reads (a window paused for hours): start over
                            self._drop_inbox()
                        self.inbox.put(msg)
                now = time.monotonic()
                if now - last_beat >= HEARTBEAT_S:
                    send(encode(Heartbeat()))
                    last_beat = now
                if now - last_heard > SILENCE_S:
                    if not silent:
                        silent = True
                        self.inbox.put(
                            Link("silent", f"the probe at {self.endpoint} has not answered for {SILENCE_S:.0f} s")
                        )
                    subscribed = False
                if not subscribed and now - last_hello >= HELLO_EVERY_S:
                    send(hello)  # a restarted probe does not know us: greet it again
                    last_hello = now
        finally:
            sock.disable_monitor()
            monitor.close(0)
            sock.close()
