"""Rebuild the block pool's state from its event stream alone (no model, no engine)."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import numpy as np

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


class PoolReplayer:
    """Applies events in order; every rule here mirrors one in ``BlockPool``.

    An event that names a block the pool does not have (out of range, negative) raises
    ``ValueError`` before anything changes: a trace is outside input.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_cnt = np.zeros(num_blocks, np.int32)
        self.block_hash: list[str | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.owners: list[list[str]] = [[] for _ in range(num_blocks)]
        self.cached_tokens: dict[int, tuple[int, ...]] = {}

    def _check(self, ev: Event) -> None:
        ids: tuple[int, ...] = ()
        if isinstance(ev, BlockCopied):
            ids = (ev.src_block_id, ev.dst_block_id)
        elif isinstance(ev, (SwappedOut, SwappedIn, RequestForked)):
            ids = ev.block_ids
        elif isinstance(ev, (BlockAllocated, BlockTouched, BlockFreed, BlockStored, BlockEvicted, BlockUnpublished)):
            ids = (ev.block_id,)
        for b in ids:
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"{ev.kind} event names block {b}, but the pool has blocks 0..{self.num_blocks - 1}")

    def apply(self, ev: Event) -> None:
        self._check(ev)
        if isinstance(ev, BlockAllocated):
            head = next(iter(self.free_queue), None)
            if head != ev.block_id:
                raise ValueError(f"allocated block {ev.block_id} but the free queue head is {head}")
            del self.free_queue[ev.block_id]
            self.ref_cnt[ev.block_id] = 1
            self.owners[ev.block_id] = [ev.request_id]
        elif isinstance(ev, BlockTouched):
            if self.ref_cnt[ev.block_id] == 0:
                if ev.block_id not in self.free_queue:
                    raise ValueError(f"hit on block {ev.block_id}, which is neither in use nor free")
                del self.free_queue[ev.block_id]
            self.ref_cnt[ev.block_id] += 1
            self.owners[ev.block_id].append(ev.request_id)
        elif isinstance(ev, BlockFreed):
            if self.ref_cnt[ev.block_id] <= 0:
                return  # a fault's double free: the pool skipped it too
            self.ref_cnt[ev.block_id] -= 1
            owners = self.owners[ev.block_id]
            if ev.request_id in owners:
                owners.remove(ev.request_id)
            if self.ref_cnt[ev.block_id] == 0:
                self.free_queue[ev.block_id] = None
        elif isinstance(ev, BlockStored):
            self.block_hash[ev.block_id] = ev.block_hash
            self.cached_tokens[ev.block_id] = tuple(ev.token_ids)
        elif isinstance(ev, (BlockEvicted, BlockUnpublished)):
            # Evicted: handed out again. Unpublished: its step failed (BlockPool.rollback_step).
            self.block_hash[ev.block_id] = None
            self.cached_tokens.pop(ev.block_id, None)
        elif isinstance(ev, CacheReset):
            self.block_hash = [None] * self.num_blocks
            self.cached_tokens.clear()

    def apply_all(self, events: Iterable[Event]) -> PoolReplayer:
        for ev in events:
            self.apply(ev)
        return self
