"""Rebuild the block pool's state from its event stream alone (no model, no engine)."""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from .chunked_map import ChunkedMap, FrozenChunkedMap
from .events import (
    BlockAllocated,
    BlockCopied,
    BlockEvicted,
    BlockFreed,
    BlockStored,
    BlockTouched,
    BlockUnpublished,
    CacheReset,
    Event,
    RequestForked,
    SwappedIn,
    SwappedOut,
)
from .free_order import FreeOrder
from .indexed_map import OverlayMap


def apply_cache_event(ev: Event, tokens, hashes) -> bool:
    """Keep copies of the prefix cache's maps (block id -> tokens, block id -> hex hash) up to date,
    rule for rule with ``BlockPool``; returns whether the event was one of the cache's."""
    if isinstance(ev, BlockStored):
        tokens[ev.block_id] = tuple(ev.token_ids)
        hashes[ev.block_id] = ev.block_hash
    elif isinstance(ev, (BlockEvicted, BlockUnpublished)):
        # Evicted: handed out again. Unpublished: its step failed (BlockPool.rollback_step).
        tokens.pop(ev.block_id, None)
        hashes.pop(ev.block_id, None)
    elif isinstance(ev, CacheReset):
        tokens.clear()
        hashes.clear()
    else:
        return False
    return True


# which fields of an event name blocks: 1 block_id, 2 src/dst, 3 block_ids (validated before applying)
_BLOCK_FIELDS = {BlockAllocated: 1, BlockTouched: 1, BlockFreed: 1, BlockStored: 1, BlockEvicted: 1,
                 BlockUnpublished: 1, BlockCopied: 2, SwappedOut: 3, SwappedIn: 3, RequestForked: 3}


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
        self.owners: dict[int, list[str]] = {}
        self.cached_tokens: ChunkedMap[tuple[int, ...]] | dict[int, tuple[int, ...]] = ChunkedMap(num_blocks)

    @classmethod
    def from_state(cls, ref_cnt: np.ndarray, last_access: np.ndarray, free_queue, hashes, tokens) -> PoolReplayer:
        """Resume from a pool's state (a timeline keyframe) instead of an empty pool."""
        r = cls(len(ref_cnt))
        r.ref_cnt, r.last_access = ref_cnt.astype(np.int32), last_access.astype(np.int64)
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
        return tuple(m.freeze() if isinstance(m, (ChunkedMap, OverlayMap)) else dict(m)
                     for m in (self.cached_tokens, self.hashes))

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

    def _check(self, ev: Event) -> None:
        kind = _BLOCK_FIELDS.get(type(ev))
        if kind is None:
            return
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
        if isinstance(ev, (BlockAllocated, BlockTouched, BlockFreed)) and not (
                isinstance(ev, BlockFreed) and self.ref_cnt[ev.block_id] <= 0):
            self.last_access[ev.block_id] = step
        if isinstance(ev, BlockAllocated):
            head = self.free_order.head()
            if head != ev.block_id:
                raise ValueError(f"allocated block {ev.block_id} but the free queue head is {head}")
            self.free_order.remove_one(ev.block_id)
            self.ref_cnt[ev.block_id] = 1
            self.owners[ev.block_id] = [ev.request_id]
        elif isinstance(ev, BlockTouched):
            if self.ref_cnt[ev.block_id] == 0:
                if ev.block_id not in self.free_order:
                    raise ValueError(f"hit on block {ev.block_id}, which is neither in use nor free")
                self.free_order.remove_one(ev.block_id)
            self.ref_cnt[ev.block_id] += 1
            self.owners.setdefault(ev.block_id, []).append(ev.request_id)
        elif isinstance(ev, BlockFreed):
            if self.ref_cnt[ev.block_id] <= 0:
                return  # a fault's double free: the pool skipped it too
            self.ref_cnt[ev.block_id] -= 1
            owners = self.owners.get(ev.block_id, [])
            if ev.request_id in owners:
                owners.remove(ev.request_id)
            if self.ref_cnt[ev.block_id] == 0:
                self.free_order.append_one(ev.block_id)
        else:
            apply_cache_event(ev, self.cached_tokens, self.hashes)

    def apply_all(self, events: Iterable[Event], step: int = 0) -> PoolReplayer:
        for ev in events:
            self.apply(ev, step)
        return self
