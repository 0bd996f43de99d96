"""A peer of the probe written with plain pyzmq and msgpack, none of kvscope's code: it can send what kvscope never
would (no Hello, unknown messages, huge frames, floods) and die without a goodbye.

The probe's wire is msgspec's tagged array structs: a message is ``[TypeName, field, field, ...]``.
"""

from __future__ import annotations

import time

import msgspec
import zmq

from kvscope_vllm_probe.constants import PROTOCOL  # the number the probe speaks, not its client's code


class RawPeer:
    def __init__(self, endpoint: str, keys: tuple[bytes, bytes, bytes] | None = None) -> None:
        """``keys``: CURVE (this peer's public key, its secret key, the probe's public key)."""
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)  # queue everything a flood sends: the probe's side must cope
        if keys is not None:
            self.sock.curve_publickey, self.sock.curve_secretkey, self.sock.curve_serverkey = keys
        self.sock.connect(endpoint)

    def send(self, *items) -> None:
        self.sock.send(msgspec.msgpack.encode(list(items)))

    def send_bytes(self, data: bytes) -> None:
        self.sock.send(data)

    def hello(self, name: str = "a raw peer") -> None:
        self.send("Hello", PROTOCOL, name)

    def heartbeat(self) -> None:
        self.send("Heartbeat")

    def received(self, timeout: float) -> list[list]:
        """Every message that arrives within ``timeout`` (each a list: its type's name first)."""
        out, deadline = [], time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if self.sock.poll(int(left * 1000) + 1):
                out.append(msgspec.msgpack.decode(self.sock.recv()))
        return out

    def wait_for(self, kind: str, timeout: float = 10.0, beat: bool = False) -> list | None:
        """The first message of type ``kind`` within ``timeout`` (None if none came); ``beat``: heartbeats meanwhile,
        as a live peer sends them."""
        deadline = time.monotonic() + timeout
        last_beat = 0.0
        while (left := deadline - time.monotonic()) > 0:
            if beat and time.monotonic() - last_beat > 1.0:
                self.heartbeat()
                last_beat = time.monotonic()
            if self.sock.poll(int(min(left, 0.5) * 1000) + 1):
                msg = msgspec.msgpack.decode(self.sock.recv())
                if msg[0] == kind:
                    return msg
        return None

    def refused(self, *items, timeout: float = 5.0) -> str | None:
        """Send a message and return the probe's ``Refused`` reason for it (sent again once a second: the probe
        answers refusals once a second at most, among all peers that never said Hello), or None."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.send(*items)
            got = self.wait_for("Refused", min(1.2, max(0.0, deadline - time.monotonic())))
            if got is not None:
                return got[1]
        return None

    def die(self) -> None:
        """Gone without a goodbye (a killed process, a cable pulled)."""
        self.sock.close(0)
        self.ctx.term()

    close = die
