"""Rebuild the block pool's state from its event stream alone (no model, no engine)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from . import cache_rules
from .cache_rules import CACHE_CHANGES, CacheChange, cache_change
from .chunked_map import ChunkedMap, FrozenChunkedMap
from .event_codec import FIELDS_OF, PACKED_TYPES, packed_rows
from .events import (
    BlockAllocated,
    BlockCopied,
    BlockEvicted,
    BlockFreed,
    BlockStored,
    BlockTouched,
    BlockUnpublished,
    Event,
    RequestForked,
    SwappedIn,
    SwappedOut,
)
from .free_order import FreeOrder
from .indexed_map import OverlayMap


def apply_cache_event(ev: Event, tokens, hashes) -> bool:
    """Keep copies of the prefix cache's maps (block id -> tokens, block id -> hex hash) up to date by
    ``cache_rules``; returns whether the event was one of the cache's."""
    change = cache_change(ev)
    if change is None:
        return False
    cache_rules.RULES[change](tokens, hashes, *FIELDS_OF[type(ev)](ev))
    return True


# which fields of an event name blocks: 1 block_id, 2 src/dst, 3 block_ids (validated before applying)
_BLOCK_FIELDS = {
    BlockAllocated: 1,
    BlockTouched: 1,
    BlockFreed: 1,
    BlockStored: 1,
    BlockEvicted: 1,
    BlockUnpublished: 1,
    BlockCopied: 2,
    SwappedOut: 3,
    SwappedIn: 3,
    RequestForked: 3,
}


def _writable(m):
    if isinstance(m, OverlayMap):
        return m
    return m.thaw() if isinstance(m, FrozenChunkedMap) else dict(m)


class PoolReplayer:
    """Applies events in order; every rule here mirrors one in ``BlockPool``.

    An event that names a block the pool does not have (out of range, negative) raises
    ``ValueError`` before anything changes: a trace is outside input. ``apply(ev, step)``
    stamps ``last_access`` as the pool does (an allocation, a hit or a release).
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_cnt = np.zeros(num_blocks, np.int32)
        self.last_access = np.zeros(num_blocks, np.int64)
        self.hashes: ChunkedMap[str] | dict[int, str] = ChunkedMap(num_blocks)  # block id -> hex hash
        # arrays, not an OrderedDict of every block: a timeline scrub builds one of these per move
        self.free_order = FreeOrder(num_blocks)
        self.cached_tokens: ChunkedMap[tuple[int, ...]] | dict[int, tuple[int, ...]] = ChunkedMap(num_blocks)
        self._set_arrays(self.ref_cnt, self.last_access)

    @classmethod
    def from_state(cls, ref_cnt: np.ndarray, last_access: np.ndarray, free_queue, hashes, tokens) -> PoolReplayer:
        """Resume from a pool's state (a timeline keyframe) instead of an empty pool."""
        r = cls.__new__(cls)  # not __init__: its empty pool would be thrown away (~1 ms at 65,536 blocks)
        r.num_blocks = len(ref_cnt)
        r._set_arrays(ref_cnt.astype(np.int32), last_access.astype(np.int64))
        r.free_order = FreeOrder.from_order(len(ref_cnt), free_queue)
        # an OverlayMap (a timeline keyframe's index array) is written over, not copied; frozen chunked
        # maps thaw in O(chunks)
        r.hashes = _writable(hashes)
        r.cached_tokens = _writable(tokens)
        return r

    @property
    def free_queue(self) -> np.ndarray:
        """The free block ids in eviction order (head first)."""
        return self.free_order.order()

    def frozen_maps(self):
        """(cached_tokens, hashes) as read-only mappings for a snapshot."""
        return tuple(
            m.freeze() if isinstance(m, (ChunkedMap, OverlayMap)) else dict(m)
            for m in (self.cached_tokens, self.hashes)
        )

    @property
    def block_hash(self) -> list[str | None]:
        """Per block id, its hex hash or None."""
        out: list[str | None] = [None] * self.num_blocks
        for b, h in self.hashes.items():
            out[b] = h
        return out

    @property
    def has_hash(self) -> np.ndarray:
        if isinstance(self.hashes, OverlayMap):
            return self.hashes.mask()
        a = np.zeros(self.num_blocks, bool)
        a[list(self.hashes)] = True
        return a

    def _check(self, event: Event) -> None:
        kind = _BLOCK_FIELDS.get(type(event))
        if kind is None:
            return
        ev: Any = event  # its fields, by the kind the table gave
        if kind == 1:
            ids: tuple[int, ...] = (ev.block_id,)
        elif kind == 2:
            ids = (ev.src_block_id, ev.dst_block_id)
        else:
            ids = ev.block_ids
        for b in ids:
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"{ev.kind} event names block {b}, but the pool has blocks 0..{self.num_blocks - 1}")

    def apply(self, ev: Event, step: int = 0) -> None:
        self._check(ev)
        rule = _POOL_RULES.get(type(ev))
        if rule is not None:
            rule(self, step, *FIELDS_OF[type(ev)](ev))

    def apply_all(self, events: Iterable[Event], step: int = 0) -> PoolReplayer:
        for ev in events:
            self.apply(ev, step)
        return self

    def apply_packed(self, data: bytes, step: int = 0) -> None:
        """``apply_all(unpack_events(data), step)`` without building the events: a timeline scrub replays
        thousands. For events this process recorded itself (the window's history): their block ids
        were checked when they came in, so they are not checked again."""
        rules = _RULES_BY_CODE
        for row in packed_rows(data):
            rule = rules[row[0]]
            if rule is not None:
                rule(self, step, *row[1:])

    def _set_arrays(self, ref_cnt: np.ndarray, last_access: np.ndarray) -> None:
        self.ref_cnt, self.last_access = ref_cnt, last_access
        # the same memory as Python-int views: the rules below touch one block at a time
        self._ref, self._access = ref_cnt.data, last_access.data

    # -- the pool's rules, mirroring BlockPool
    def _allocated(self, step: int, block_id: int, request_id: str) -> None:
        head = self.free_order.head()
        if head != block_id:
            raise ValueError(f"allocated block {block_id} but the free queue head is {head}")
        ref, access = self._ref, self._access
        access[block_id] = step
        self.free_order.remove_one(block_id)
        ref[block_id] = 1

    def _touched(self, step: int, block_id: int, request_id: str, ref_cnt: int = 0) -> None:
        ref, access = self._ref, self._access
        if ref[block_id] == 0:
            if block_id not in self.free_order:
                raise ValueError(f"hit on block {block_id}, which is neither in use nor free")
            self.free_order.remove_one(block_id)
        access[block_id] = step
        ref[block_id] += 1

    def _freed(self, step: int, block_id: int, request_id: str, ref_cnt: int = 0) -> None:
        ref, access = self._ref, self._access
        if ref[block_id] <= 0:
            return  # a fault's double free: the pool skipped it too
        access[block_id] = step
        ref[block_id] -= 1
        if ref[block_id] == 0:
            self.free_order.append_one(block_id)


def _cache_rule(change: CacheChange):
    rule = cache_rules.RULES[change]

    def apply(self: PoolReplayer, step: int, *fields) -> None:
        rule(self.cached_tokens, self.hashes, *fields)

    return apply


_POOL_RULES = {
    BlockAllocated: PoolReplayer._allocated,
    BlockTouched: PoolReplayer._touched,
    BlockFreed: PoolReplayer._freed,
    **{cls: _cache_rule(change) for cls, change in CACHE_CHANGES.items()},
}
# the same by the packed code (event_codec's), None for events that change no pool state
_RULES_BY_CODE = [_POOL_RULES.get(cls) for cls in PACKED_TYPES]
