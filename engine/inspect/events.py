"""Typed events: one for every change of a block's or a request's state.

The stream is the inspector's feed and a test oracle: replaying it from the
start (``engine.replay.PoolReplayer``) rebuilds the block pool exactly.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields


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
    for cls in (BlockAllocated, BlockTouched, BlockFreed, BlockStored, BlockEvicted, BlockCopied, CacheReset,
                SwappedOut, SwappedIn, RequestAdmitted, RequestForked, RequestPreempted, RequestFinished,
                RequestAborted, LeakFound)
}


def event_from_dict(d: dict) -> Event:
    """Inverse of ``Event.to_dict``; raises ``ValueError`` on an unknown kind or fields."""
    kind = d.get("kind")
    cls = EVENT_TYPES.get(kind)
    if cls is None:
        raise ValueError(f"unknown event kind {kind!r}")
    names = {f.name for f in fields(cls)}
    try:
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in names})
    except TypeError as e:
        raise ValueError(f"bad {kind} event: {e}") from None
