"""Typed events: one for every change of a block's or a request's state.

The stream is the inspector's feed and a test oracle: replaying it from the
start (``engine.replay.PoolReplayer``) rebuilds the block pool exactly.
"""

from __future__ import annotations

import functools
import typing
from dataclasses import asdict, dataclass, fields
from typing import Any, cast

from .slot_init import slot_init


@dataclass(frozen=True, slots=True)
class Event:
    kind = "event"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["kind"] = self.kind
        return d


# --- block events -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BlockAllocated(Event):
    """A block left the head of the free queue for ``request_id`` (ref 0 -> 1)."""

    block_id: int
    request_id: str
    kind = "allocated"


@dataclass(frozen=True, slots=True)
class BlockTouched(Event):
    """A cached block was reused by ``request_id`` (prefix hit): ref += 1.

    If the block was free (ref 0) it leaves the free queue from the middle.
    """

    block_id: int
    request_id: str
    ref_cnt: int  # after the touch
    kind = "hit"


@dataclass(frozen=True, slots=True)
class BlockFreed(Event):
    """``request_id`` dropped its reference; at ref 0 the block joins the free queue tail."""

    block_id: int
    request_id: str
    ref_cnt: int  # after the release
    kind = "freed"


@dataclass(frozen=True, slots=True)
class BlockStored(Event):
    """A full block's hash entered the prefix cache.

    ``parent_hash`` is the hash of the previous block in the request's chain (the hash this
    one was chained from), ``None`` for a request's first block; traces older than the field
    read it as ``None``. It is what vLLM's ``BlockStored.parent_block_hash`` carries.
    """

    block_id: int
    block_hash: str  # hex
    request_id: str
    token_ids: tuple[int, ...] = ()
    parent_hash: str | None = None  # hex
    kind = "stored"


@dataclass(frozen=True, slots=True)
class BlockCopied(Event):
    """Copy-on-write: ``request_id`` was about to write into shared block ``src``; it now owns ``dst``.

    ``dst`` was allocated (its own event) and ``src`` lost one reference (a freed event).
    """

    src_block_id: int
    dst_block_id: int
    request_id: str
    num_slots: int  # filled slots copied
    kind = "cow"


@dataclass(frozen=True, slots=True)
class SwappedOut(Event):
    """A preempted request's KV was copied to the CPU pool; its device blocks were freed."""

    request_id: str
    block_ids: tuple[int, ...]
    cpu_block_ids: tuple[int, ...]
    kind = "swap_out"


@dataclass(frozen=True, slots=True)
class SwappedIn(Event):
    """The KV came back from the CPU pool into (possibly different) device blocks."""

    request_id: str
    cpu_block_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    kind = "swap_in"


@dataclass(frozen=True, slots=True)
class BlockEvicted(Event):
    """A cached free block was handed out again, so its hash left the cache."""

    block_id: int
    block_hash: str
    kind = "evicted"


@dataclass(frozen=True, slots=True)
class BlockUnpublished(Event):
    """A block published during a step that then failed: its hash left the cache again.

    Publication is two-phase (see ``BlockPool``): a block completed by a step is stored
    while that step is scheduled (so a request admitted in the same step can hit it) and
    committed once the step's forward, sampling and post-processing all succeeded. When the
    step fails its KV may never have been written, so every publication of that step is
    rolled back, one ``unpublished`` event a block. The block itself (ref count, free
    queue position) is untouched.
    """

    block_id: int
    block_hash: str
    reason: str = ""
    kind = "unpublished"


@dataclass(frozen=True, slots=True)
class CacheReset(Event):
    """``reset_prefix_cache``: every hash dropped (all blocks were free)."""

    num_blocks: int
    kind = "cache_reset"


# --- request events ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestAdmitted(Event):
    request_id: str
    num_prompt_tokens: int
    num_cached_tokens: int
    kind = "admitted"


@dataclass(frozen=True, slots=True)
class RequestForked(Event):
    """``child_id`` now shares every block of ``parent_id`` (each block's ref count + 1)."""

    parent_id: str
    child_id: str
    block_ids: tuple[int, ...]
    kind = "forked"


@dataclass(frozen=True, slots=True)
class RequestPreempted(Event):
    request_id: str
    mode: str  # "recompute" | "swap"
    reason: str = ""
    kind = "preempted"


@dataclass(frozen=True, slots=True)
class RequestFinished(Event):
    request_id: str
    reason: str  # "stop" | "length" | "error"
    kind = "finished"


@dataclass(frozen=True, slots=True)
class RequestAborted(Event):
    request_id: str
    kind = "aborted"


@dataclass(frozen=True, slots=True)
class LeakFound(Event):
    block_id: int
    problem: str
    kind = "leak"


EVENT_TYPES: dict[str, type[Event]] = {
    cls.kind: cls
    for cls in (
        BlockAllocated,
        BlockTouched,
        BlockFreed,
        BlockStored,
        BlockEvicted,
        BlockUnpublished,
        BlockCopied,
        CacheReset,
        SwappedOut,
        SwappedIn,
        RequestAdmitted,
        RequestForked,
        RequestPreempted,
        RequestFinished,
        RequestAborted,
        LeakFound,
    )
}


for _cls in EVENT_TYPES.values():
    slot_init(_cls)  # the pool makes an event for every block change: tens a decode step


@functools.cache
def _field_types(cls: type[Event]) -> dict[str, object]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


def _well_typed(tp: object, v: object) -> bool:
    if tp is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if tp is str:
        return isinstance(v, str)
    if typing.get_origin(tp) is tuple:
        return isinstance(v, tuple) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
    return True


def event_from_dict(d: dict) -> Event:
    """Inverse of ``Event.to_dict``; raises ``ValueError`` on an unknown kind, missing or ill-typed fields.

    Only types are checked here; whether a block id exists is the replayer's to say (it knows the pool).
    """
    if not isinstance(d, dict):
        raise ValueError(f"an event must be an object, got {type(d).__name__}")
    kind = d.get("kind")
    cls = EVENT_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"unknown event kind {kind!r}")
    types: dict[str, Any] = _field_types(cast(Any, cls))
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in types}
    for k, v in values.items():
        if not _well_typed(types[k], v):
            want = {int: "an integer", str: "a string"}.get(types[k], "a list of integers")
            raise ValueError(f"bad {kind} event: {k} = {v!r} is not {want}")
    try:
        return cls(**values)
    except TypeError as e:
        raise ValueError(f"bad {kind} event: {e}") from None
