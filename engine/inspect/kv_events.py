"""kvscope's block events on vLLM's KV-event wire format (``vllm.distributed.kv_events``).

vLLM and SGLang publish their prefix cache's changes over ZeroMQ so that routers and
cache managers can follow them; this module speaks that format both ways: it maps
kvscope's events to it and publishes them (``KVEventPublisher``), and it decodes a stream
(``decode_batch``) for ``kvscope --attach``.

Wire format (written from vLLM's schema, none of its code):

- A ZeroMQ PUB socket sends one three-part message per batch: ``topic`` (bytes, may be
  empty), an 8-byte big-endian sequence number (0, 1, 2, ... per publisher), and the msgpack
  payload: an ``EventBatch`` ``[ts, events, data_parallel_rank]``.
- Events are tagged structs: ``BlockStored(block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium, lora_name)``, ``BlockRemoved(block_hashes, medium)``,
  ``AllBlocksCleared()``. ``wire_format="array"`` writes each event as a positional array with
  the tag first (``["BlockStored", [h1, h2], parent, [tokens...], 16, None, "GPU", None]``):
  msgspec's ``array_like=True, tag=True``, which vLLM used until its PR #42892, SGLang still
  uses, and vLLM's example subscriber decodes. ``wire_format="map"`` writes each event as a map
  with the tag under ``"type"`` (``{"type": "BlockStored", "block_hashes": [...], ...}``), as
  vLLM does since #42892; the batch stays positional in both. Decoding accepts either, and a
  map-shaped batch too, so one subscriber reads old and new vLLM and SGLang. Checked against the
  released wheels' struct definitions (tests/test_kv_events_vllm_releases.py): "array" is vLLM 0.11.0
  and 0.20.0's shape, "map" 0.27.0 and 0.33.0's (whose new fields, ``locality``, ``session_id``...,
  the decoder ignores).
- Hashes: vLLM hashes blocks with a 32-byte digest and publishes ``ExternalBlockHash``: by
  default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) the digest's low 64 bits as an unsigned
  int (``int.from_bytes(digest, "big") & (2**64 - 1)``), otherwise the raw bytes.
  ``hash_format`` picks the same two for kvscope's sha256 (or 8-byte builtin) hashes. SGLang
  sends signed 64-bit ints; the decoder takes ints of either sign and bytes.
- Replay: a ROUTER socket answers a request ``[b"", start_seq (8 bytes)]`` (a REQ or a DEALER
  with an empty delimiter frame) with every buffered batch whose sequence number is
  ``>= start_seq``, one message each, ``[b"", topic, seq, payload]``, then an end-of-replay
  marker ``[b"", topic, -1 (8 bytes, signed), b""]``. vLLM added the topic frame in #45177;
  older publishers send ``[b"", seq, payload]``, and the subscriber reads both. The buffer keeps
  the last ``buffer_steps`` batches.
- Data parallelism: each rank publishes on its own port, ``port + rank`` (``offset_endpoint``),
  and stamps ``data_parallel_rank`` into its batches.

Mapping from kvscope's events (``engine.inspect.events``):

===================  ==========================================================================
kvscope              vLLM wire
===================  ==========================================================================
``BlockStored``      ``BlockStored``: ``block_hashes=[hash]``, ``parent_block_hash`` = the event's
                     ``parent_hash`` (the previous block of the request's chain, None for a
                     first block), ``token_ids`` = the block's tokens, ``block_size``, ``medium``
                     "GPU", ``lora_id``/``lora_name`` None. Consecutive stores that extend one
                     chain (each one's parent is the previous one's hash) are merged into one
                     event with several hashes and the tokens concatenated, as vLLM's
                     ``cache_full_blocks`` sends them.
``BlockEvicted``,    ``BlockRemoved(block_hashes=[hash], medium="GPU")``; adjacent removals merge.
``BlockUnpublished`` (a store of a failed step rolled back: the prefix no longer exists; the table
                     in ``cache_rules`` says which events remove a hash)
``CacheReset``       ``AllBlocksCleared()``.
everything else      dropped: allocations, hits, frees (ref counts), owners and request ids, block
                     ids, copy-on-write copies, forks, preemptions, swaps, leaks. The wire names a
                     cached block by its hash only: the consumer sees which prefixes are cached,
                     never which physical block holds them or who uses them.
===================  ==========================================================================

Swaps are not published as a "CPU" medium: kvscope's CPU pool holds a preempted request's
private copy, not a cache other requests can hit, and its device blocks keep their hashes
(cached, free) until they are evicted, so the GPU events already tell the cache's truth.
Order is kept: a batch's events are the step's events in the order they happened.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from .cache_rules import CacheChange, cache_change
from .events import Event

MEDIUM_GPU = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # end-of-replay marker
WIRE_FORMATS = ("array", "map")
HASH_FORMATS = ("int", "bytes")
ExternalHash = int | bytes


def external_hash(hex_hash: str, hash_format: str = "int") -> ExternalHash:
    """kvscope's hex hash as vLLM publishes a hash: the low 64 bits as an int, or the bytes."""
    raw = bytes.fromhex(hex_hash)
    return raw if hash_format == "bytes" else int.from_bytes(raw, "big") & ((1 << 64) - 1)


# --- neutral wire events (what both formats carry) ------------------------------------------

@dataclass(frozen=True, slots=True)
class WireStored:
    block_hashes: tuple[ExternalHash, ...]
    parent_block_hash: ExternalHash | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = MEDIUM_GPU
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class WireRemoved:
    block_hashes: tuple[ExternalHash, ...]
    medium: str | None = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class WireCleared:
    pass


WireEvent = WireStored | WireRemoved | WireCleared


def to_wire_events(events: Iterable[Event], block_size: int, hash_format: str = "int",
                   medium: str = MEDIUM_GPU) -> list[WireEvent]:
    """The vLLM events a step's kvscope events amount to (see the module docstring)."""
    out: list[WireEvent] = []
    chain_tail: str | None = None  # hex hash of the last block of the open BlockStored run
    for ev in events:
        change = cache_change(ev)
        if change is CacheChange.STORED:
            h = external_hash(ev.block_hash, hash_format)
            last = out[-1] if out else None
            if isinstance(last, WireStored) and ev.parent_hash is not None and ev.parent_hash == chain_tail:
                out[-1] = WireStored(last.block_hashes + (h,), last.parent_block_hash,
                                     last.token_ids + tuple(ev.token_ids), block_size, medium)
            else:
                parent = external_hash(ev.parent_hash, hash_format) if ev.parent_hash else None
                out.append(WireStored((h,), parent, tuple(ev.token_ids), block_size, medium))
            chain_tail = ev.block_hash
        elif change is not None and change.removes:  # evicted, or withdrawn: its step failed
            h = external_hash(ev.block_hash, hash_format)
            last = out[-1] if out else None
            if isinstance(last, WireRemoved):
                out[-1] = WireRemoved(last.block_hashes + (h,), medium)
            else:
                out.append(WireRemoved((h,), medium))
            chain_tail = None
        elif change is CacheChange.CLEARED:
            out.append(WireCleared())
            chain_tail = None
    return out


# --- msgspec structs: encoding (exactly vLLM's fields) and decoding (lenient) ----------------

def _encode_structs(array_like: bool):
    class _Event(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(_Event):
        block_hashes: list[ExternalHash]
        parent_block_hash: ExternalHash | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None

    class BlockRemoved(_Event):
        block_hashes: list[ExternalHash]
        medium: str | None

    class AllBlocksCleared(_Event):
        pass

    return BlockStored, BlockRemoved, AllBlocksCleared


def _decode_structs(array_like: bool):
    """Old publishers send fewer fields, new ones more: later fields default, unknown ones are ignored.

    Fields past ``medium`` are typed ``Any`` because publishers disagree on them (SGLang puts a
    metadata map where vLLM has ``lora_name``).
    """
    class _Event(msgspec.Struct, array_like=array_like, gc=False, tag=True):
        pass

    class BlockStored(_Event):
        block_hashes: list[ExternalHash]
        parent_block_hash: ExternalHash | None
        token_ids: list[int | list[int]]  # SGLang's bigram pages send token pairs
        block_size: int
        lora_id: Any = None
        medium: Any = None
        lora_name: Any = None

    class BlockRemoved(_Event):
        block_hashes: list[ExternalHash]
        medium: Any = None

    class AllBlocksCleared(_Event):
        pass

    return BlockStored, BlockRemoved, AllBlocksCleared


class _BatchA(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _RawBatchA(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _RawBatchM(msgspec.Struct, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_ENC = {"array": _encode_structs(True), "map": _encode_structs(False)}
_DEC = {"array": _decode_structs(True), "map": _decode_structs(False)}
_DEC_UNION = {k: msgspec.msgpack.Decoder(v[0] | v[1] | v[2]) for k, v in _DEC.items()}
_BATCH_DEC = {"array": msgspec.msgpack.Decoder(_RawBatchA), "map": msgspec.msgpack.Decoder(_RawBatchM)}
_ENCODER = msgspec.msgpack.Encoder()
KNOWN_TAGS = ("BlockStored", "BlockRemoved", "AllBlocksCleared")


def encode_batch(events: Sequence[WireEvent], ts: float, data_parallel_rank: int | None = 0,
                 wire_format: str = "array") -> bytes:
    """One ``EventBatch`` payload; the batch is positional, its events ``wire_format``-shaped."""
    stored, removed, cleared = _ENC[wire_format]
    structs = []
    for e in events:
        if isinstance(e, WireStored):
            structs.append(stored(list(e.block_hashes), e.parent_block_hash, list(e.token_ids), e.block_size,
                                  e.lora_id, e.medium, e.lora_name))
        elif isinstance(e, WireRemoved):
            structs.append(removed(list(e.block_hashes), e.medium))
        else:
            structs.append(cleared())
    return _ENCODER.encode(_BatchA(ts, structs, data_parallel_rank))


class MalformedBatch(ValueError):
    """A payload that is not an event batch at all (not msgpack, or not ``[ts, events, rank]``)."""


@dataclass(frozen=True, slots=True)
class DecodedBatch:
    ts: float
    data_parallel_rank: int | None
    events: list[WireEvent]
    unknown_tags: int  # events of a kind this decoder does not know (skipped)
    bad_events: int  # known kinds with fields of the wrong type or shape (skipped)


def _shape(raw: bytes) -> str | None:
    """msgpack's first byte says whether a value is an array or a map."""
    if not raw:
        return None
    b = raw[0]
    if 0x90 <= b <= 0x9F or b in (0xDC, 0xDD):
        return "array"
    if 0x80 <= b <= 0x8F or b in (0xDE, 0xDF):
        return "map"
    return None


def _tag_of(raw: bytes) -> object:
    try:
        obj = msgspec.msgpack.decode(raw)
    except msgspec.DecodeError:
        return None
    if isinstance(obj, list) and obj:
        return obj[0]
    if isinstance(obj, dict):
        return obj.get("type")
    return None


def _flat_tokens(tokens: list) -> tuple[int, ...]:
    return tuple(t if isinstance(t, int) else (t[0] if t else 0) for t in tokens)


def decode_batch(payload: bytes) -> DecodedBatch:
    """Decode one payload; events that cannot be read are counted and skipped, not fatal.

    Raises ``MalformedBatch`` when the payload itself is not an event batch.
    """
    shape = _shape(payload)
    if shape is None:
        raise MalformedBatch("payload is not a msgpack array or map")
    try:
        batch = _BATCH_DEC[shape].decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise MalformedBatch(f"not an event batch: {e}") from None
    events: list[WireEvent] = []
    unknown = bad = 0
    for raw in batch.events:
        raw = bytes(raw)
        fmt = _shape(raw)
        try:
            if fmt is None:
                raise msgspec.ValidationError("an event must be an array or a map")
            ev = _DEC_UNION[fmt].decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            if _tag_of(raw) in KNOWN_TAGS:
                bad += 1
            else:
                unknown += 1
            continue
        name = type(ev).__name__
        if name == "BlockStored":
            if ev.block_size < 1:
                bad += 1
                continue
            events.append(WireStored(tuple(ev.block_hashes), ev.parent_block_hash, _flat_tokens(ev.token_ids),
                                     ev.block_size, ev.medium if isinstance(ev.medium, str) else None,
                                     ev.lora_id if isinstance(ev.lora_id, int) else None,
                                     ev.lora_name if isinstance(ev.lora_name, str) else None))
        elif name == "BlockRemoved":
            events.append(WireRemoved(tuple(ev.block_hashes), ev.medium if isinstance(ev.medium, str) else None))
        else:
            events.append(WireCleared())
    return DecodedBatch(batch.ts, batch.data_parallel_rank, events, unknown, bad)


# --- the publisher ---------------------------------------------------------------------------

@dataclass
class KVEventsConfig:
    """vLLM's ``KVEventsConfig`` defaults, plus the two format choices and the rank."""
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None  # e.g. "tcp://*:5558"; None: no replay
    topic: str = ""
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # PUB high-water mark: past it, slow subscribers lose batches (gaps)
    data_parallel_rank: int = 0
    wire_format: str = "array"
    hash_format: str = "int"
    medium: str = MEDIUM_GPU

    def validate(self) -> None:
        if self.wire_format not in WIRE_FORMATS:
            raise ValueError(f"KV events format must be one of {', '.join(WIRE_FORMATS)}, got {self.wire_format!r}")
        if self.hash_format not in HASH_FORMATS:
            raise ValueError(f"KV events hash must be one of {', '.join(HASH_FORMATS)}, got {self.hash_format!r}")
        if self.buffer_steps < 1 or self.hwm < 1:
            raise ValueError("KV events buffer_steps and hwm must be >= 1")
        if self.data_parallel_rank < 0:
            raise ValueError("data_parallel_rank must be >= 0")
        for ep in (self.endpoint, self.replay_endpoint):
            if ep is not None and "://" not in ep:
                raise ValueError(f"KV events endpoint {ep!r} is not a ZeroMQ address (like tcp://127.0.0.1:5557)")


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """A rank's endpoint: ``tcp://h:p`` -> ``tcp://h:p+rank`` (``inproc://x`` -> ``inproc://x_dp{rank}``)."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"cannot offset {endpoint!r} by data-parallel rank {rank}: it has no port number")
    return f"{base}:{int(port) + rank}"


def connectable(endpoint: str) -> str:
    """The address a local subscriber dials for a bound endpoint (``tcp://0.0.0.0:p`` -> loopback)."""
    return endpoint.replace("tcp://0.0.0.0:", "tcp://127.0.0.1:").replace("tcp://*:", "tcp://127.0.0.1:")


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
        payload = encode_batch(wire, time.time() if ts is None else ts, self.config.data_parallel_rank,
                               self.config.wire_format)
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
