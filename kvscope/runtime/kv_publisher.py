"""kvscope's engine publishing its KV events the way vLLM does: a ZeroMQ PUB socket and a replay ROUTER.

The events' meaning is ``engine.inspect.kv_events``'s, their bytes ``engine.inspect.kv_wire``'s; this module is
only the sockets (``KVEventsConfig`` are vLLM's defaults plus the format choices and the rank).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable

import zmq

from engine.inspect.events import Event
from engine.inspect.kv_events import END_SEQ, to_wire_events
from engine.inspect.kv_wire import encode_batch
from kvscope.runtime.kv_events_options import KVEventsConfig
from kvscope.sources.endpoints import offset_endpoint

# --- the publisher ---------------------------------------------------------------------------


def _bind(sock: zmq.Socket, endpoint: str) -> str:
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        sock.close(linger=0)
        raise ValueError(f"cannot bind KV events endpoint {endpoint}: {e}") from None
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


class KVEventPublisher:
    """PUB socket + replay ROUTER with a bounded buffer, like vLLM's ``ZmqEventPublisher``.

    Unlike vLLM it always binds (vLLM connects when the address has no wildcard), so
    ``tcp://127.0.0.1:5557`` listens on loopback. ``publish`` encodes and sends on the caller's
    thread (one batch per step, never blocks: past the high-water mark ZeroMQ drops, and the
    subscriber sees a gap); a small thread answers replay requests from the buffer.
    """

    def __init__(self, config: KVEventsConfig, block_size: int) -> None:
        config.validate()
        self.config = config
        self.block_size = block_size
        self.topic = config.topic.encode()
        self._ctx = zmq.Context()
        self._lock = threading.Lock()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self.num_events = 0
        self.replay_requests = 0
        self.bad_replay_requests = 0
        rank = config.data_parallel_rank
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._router = None
        self._thread = None
        self._stop = threading.Event()
        try:
            self.endpoint = _bind(self._pub, offset_endpoint(config.endpoint, rank))
            self.replay_endpoint = None
            if config.replay_endpoint:
                self._router = self._ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = _bind(self._router, offset_endpoint(config.replay_endpoint, rank))
        except ValueError:
            self._pub.close(linger=0)
            self._ctx.term()
            raise
        if self._router is not None:
            self._thread = threading.Thread(target=self._serve_replay, name="kv-events-replay", daemon=True)
            self._thread.start()

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def publish(self, events: Iterable[Event], ts: float | None = None) -> int | None:
        """Publish a step's events as one batch; returns its sequence number (None if nothing to send)."""
        wire = to_wire_events(events, self.block_size, self.config.hash_format, self.config.medium)
        if not wire:
            return None  # vLLM publishes only non-empty batches
        payload = encode_batch(
            wire, time.time() if ts is None else ts, self.config.data_parallel_rank, self.config.wire_format
        )
        return self.publish_payload(payload, len(wire))

    def publish_payload(self, payload: bytes, num_events: int = 0) -> int:
        """Send an already encoded payload under the next sequence number (also used by tests)."""
        with self._lock:
            if self._pub is None:
                raise RuntimeError("the KV event publisher is closed")
            seq = self._next_seq
            self._next_seq += 1
            try:
                self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # over the high-water mark: dropped; the buffer still has it for replay
            self._buffer.append((seq, payload))
            self.num_events += num_events
        return seq

    def _serve_replay(self) -> None:
        router = self._router
        while not self._stop.is_set():
            try:
                if not router.poll(50):
                    continue
                frames = router.recv_multipart()
            except zmq.ZMQError:
                return  # the socket was closed under us
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                self.bad_replay_requests += 1
                continue
            ident, start = frames[0], int.from_bytes(frames[2], "big")
            self.replay_requests += 1
            with self._lock:
                items = [(s, p) for s, p in self._buffer if s >= start]
            try:
                for s, p in items:
                    router.send_multipart((ident, b"", self.topic, s.to_bytes(8, "big"), p))
                router.send_multipart((ident, b"", self.topic, END_SEQ, b""))
            except zmq.ZMQError:
                return

    def close(self) -> None:
        """Stop the replay thread and release both ports; idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            self._thread = None
        with self._lock:
            for sock in (self._pub, self._router):
                if sock is not None:
                    sock.close(linger=0)
            self._pub = self._router = None
        if not self._ctx.closed:
            self._ctx.term()
