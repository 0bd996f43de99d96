"""vLLM's KV-event wire format, encoded and decoded with msgspec (``kv_events`` says what the events mean).

Encoding writes exactly vLLM's fields in either shape (``WIRE_FORMATS``); decoding is lenient: old publishers
send fewer fields, new ones more, SGLang a metadata map where vLLM has ``lora_name``; an event that cannot be
read is counted and skipped, a payload that is not a batch at all raises ``MalformedBatch``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from .kv_events import ExternalHash, WireCleared, WireEvent, WireRemoved, WireStored

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
_BATCH_DEC: dict[str, msgspec.msgpack.Decoder] = {
    "array": msgspec.msgpack.Decoder(_RawBatchA),
    "map": msgspec.msgpack.Decoder(_RawBatchM),
}
_ENCODER = msgspec.msgpack.Encoder()
KNOWN_TAGS = ("BlockStored", "BlockRemoved", "AllBlocksCleared")


def encode_batch(
    events: Sequence[WireEvent], ts: float, data_parallel_rank: int | None = 0, wire_format: str = "array"
) -> bytes:
    """One ``EventBatch`` payload; the batch is positional, its events ``wire_format``-shaped."""
    stored, removed, cleared = _ENC[wire_format]
    structs = []
    for e in events:
        if isinstance(e, WireStored):
            structs.append(
                stored(
                    list(e.block_hashes),
                    e.parent_block_hash,
                    list(e.token_ids),
                    e.block_size,
                    e.lora_id,
                    e.medium,
                    e.lora_name,
                )
            )
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
        batch: Any = _BATCH_DEC[shape].decode(payload)
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
            events.append(
                WireStored(
                    tuple(ev.block_hashes),
                    ev.parent_block_hash,
                    _flat_tokens(ev.token_ids),
                    ev.block_size,
                    ev.medium if isinstance(ev.medium, str) else None,
                    ev.lora_id if isinstance(ev.lora_id, int) else None,
                    ev.lora_name if isinstance(ev.lora_name, str) else None,
                )
            )
        elif name == "BlockRemoved":
            events.append(WireRemoved(tuple(ev.block_hashes), ev.medium if isinstance(ev.medium, str) else None))
        else:
            events.append(WireCleared())
    return DecodedBatch(batch.ts, batch.data_parallel_rank, events, unknown, bad)
