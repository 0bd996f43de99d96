"""A subscriber's end of the probe's wire: a DEALER on its own thread, with heartbeats and reconnection.

``get()`` hands over, in order, what the probe sent (decoded ``wire`` messages) and what happened to the
connection (``Link`` notices: silent, answering again, an unreadable message). The subscriber applies
keyframes and steps; when it sees a gap in ``seq`` it calls ``resync()``. A probe that stops answering is
greeted again every ``HELLO_EVERY_S`` until one answers: a restarted vLLM answers with a new ``instance``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import zmq

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


@dataclass(frozen=True, slots=True)
class Link:
    """What happened to the connection: ``kind`` is "silent", "answering" or "unreadable"."""

    kind: str
    text: str


class ProbeClient:
    def __init__(self, endpoint: str, client: str) -> None:
        self.endpoint = endpoint
        self.client = client
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

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 500)  # long enough for the goodbye to leave
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        # queue nothing for a probe that is not there yet: a vLLM started later must not get a backlog of hellos
        sock.setsockopt(zmq.IMMEDIATE, 1)
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
            sock.close()
