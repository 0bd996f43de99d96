"""``PoolLedger``: the inspector's record of a block pool, kept as the pool changes.

The pool (engine/core) keeps what scheduling needs; it tells its listener of every change
(``engine.core.pool_listener``). The ledger is that listener. From each call it makes the event the
window, traces, replay and the KV-event publisher read (one event a change: the stream is the
contract), and keeps what a snapshot copies and what an audit names, so that neither walks the
pool's block objects:

- per-block arrays (ref count, hashed, last access step) and the prefix cache's maps (block id ->
  tokens, block id -> hex hash) as chunked maps that a snapshot freezes in O(chunks);
- the free queue's order as an append log (``FreeOrder``): walking a linked list of a million free
  blocks costs ~100 ms a snapshot;
- blocks per state (cached-free, shared) as they change, so a step's record counts states in O(1);
- who holds each block now, who last took a reference and who last released one: the audit blames
  the request whose table lost a block, not just the block.

It records the pool's values; it does not derive them (``replay.PoolReplayer`` does that from a
trace, by the same rules the pool follows).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..core.kv_cache_utils import BlockHash, KVCacheBlock
from ..core.pool_listener import PoolListener
from .chunked_map import ChunkedMap
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
    RequestAborted,
    RequestAdmitted,
    RequestFinished,
    RequestForked,
    RequestPreempted,
    SwappedIn,
    SwappedOut,
)
from .free_order import FreeOrder


class PoolLedger(PoolListener):
    __slots__ = (
        "num_blocks",
        "events",
        "step",
        "ref_cnt_arr",
        "has_hash_arr",
        "last_access_arr",
        "_ref",
        "_access",
        "_hashed",
        "tokens_by_block",
        "hash_hex_by_block",
        "free_order",
        "num_free",
        "num_cached_free",
        "num_shared",
        "holders",
        "last_owner",
        "last_released_by",
    )

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.events: list[Event] = []
        self.step = 0  # stamped into last_access (the engine sets it each step)
        self.ref_cnt_arr = np.zeros(num_blocks, np.int32)
        self.has_hash_arr = np.zeros(num_blocks, bool)
        self.last_access_arr = np.zeros(num_blocks, np.int64)
        # the same memory as Python-int views, for one-block writes (a numpy scalar write costs ~3x)
        self._ref, self._access = self.ref_cnt_arr.data, self.last_access_arr.data
        self._hashed = self.has_hash_arr.data
        self.tokens_by_block: ChunkedMap[tuple[int, ...]] = ChunkedMap(num_blocks)
        self.hash_hex_by_block: ChunkedMap[str] = ChunkedMap(num_blocks)
        # The order blocks were freed in: the eviction order under LRU only (under lfu, snapshots' free_queue
        # and PoolReplayer's "allocated == head" rule do not hold; the events still describe every change).
        self.free_order = FreeOrder(num_blocks)
        self.num_free = num_blocks  # on the free queue
        self.num_cached_free = 0  # ref count 0 with a hash: free, but reusable until evicted
        self.num_shared = 0  # ref count > 1
        # block id -> who holds a reference now, in the order taken: the one request's id (most blocks), or a list
        # of them when shared. A list for every block allocated was a new garbage-collected object each time: the
        # collector's passes cost the bookkeeping bench about 3% (a string is not tracked)
        self.holders: dict[int, str | list[str]] = {}
        self.last_owner = [""] * num_blocks  # the request that last took a reference
        self.last_released_by = [""] * num_blocks

    # -- what the inspector reads ---------------------------------------------------------------
    def drain_events(self) -> list[Event]:
        ev, self.events = self.events, []
        return ev

    def state_counts(self) -> tuple[int, ...]:
        """Blocks per ``BlockState`` (free, cached, used, shared, swapped, leaked, reserved), as counting the
        snapshot's state array would give them (swaps live in the CPU pool, leaks are the audit's)."""
        free = self.num_free
        cached, shared = self.num_cached_free, self.num_shared
        return (free - cached, cached, self.num_blocks - free - shared, shared, 0, 0, 0)

    def holders_of(self, block_id: int) -> list[str]:
        held = self.holders.get(block_id)
        return [] if held is None else [held] if isinstance(held, str) else list(held)

    # -- the pool's changes (PoolListener) --------------------------------------------------------
    def allocated(self, block: KVCacheBlock, request_id: str) -> None:
        i = block.block_id
        self.free_order.remove_one(i)
        self.num_free -= 1
        self._ref[i] = 1
        self._access[i] = self.step
        self.last_owner[i] = request_id
        self.holders[i] = request_id
        self.events.append(BlockAllocated(i, request_id))

    def touched(self, block: KVCacheBlock, request_id: str, left_queue: bool) -> None:
        i, ref = block.block_id, block.ref_cnt
        if left_queue:
            self.free_order.remove_one(i)
            self.num_free -= 1
            if block.block_hash is not None:
                self.num_cached_free -= 1
        if ref == 2:
            self.num_shared += 1
        self._ref[i] = ref
        self._access[i] = self.step
        self.last_owner[i] = request_id
        held = self.holders.get(i)
        if held is None:
            self.holders[i] = request_id
        elif isinstance(held, str):
            self.holders[i] = [held, request_id]
        else:
            held.append(request_id)
        self.events.append(BlockTouched(i, request_id, ref))

    def freed(self, block: KVCacheBlock, request_id: str) -> None:
        i, ref = block.block_id, block.ref_cnt
        if ref == 1:
            self.num_shared -= 1
        elif ref == 0:
            self.free_order.append_one(i)
            self.num_free += 1
            if block.block_hash is not None:
                self.num_cached_free += 1
        self._ref[i] = ref
        self._access[i] = self.step
        self.last_released_by[i] = request_id
        held = self.holders.get(i)
        if held is None:
            pass
        elif isinstance(held, str):
            if held == request_id:
                del self.holders[i]
        elif request_id in held:
            held.remove(request_id)
            if len(held) == 1:
                self.holders[i] = held[0]
        self.events.append(BlockFreed(i, request_id, ref))

    def evicted(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        self.num_cached_free -= 1  # only a cached free block, popped from the queue, is evicted
        self._unmark(block.block_id)
        self.events.append(BlockEvicted(block.block_id, block_hash.hex()))

    def stored(
        self,
        block: KVCacheBlock,
        block_hash: BlockHash,
        token_ids: tuple[int, ...],
        request_id: str,
        parent_hash: BlockHash | None,
    ) -> None:
        i = block.block_id
        if block.ref_cnt == 0:  # only a planted fault publishes a free block
            self.num_cached_free += 1
        hex_hash = block_hash.hex()
        self._hashed[i] = True
        self.tokens_by_block[i] = token_ids
        self.hash_hex_by_block[i] = hex_hash
        parent = parent_hash.hex() if parent_hash is not None else None
        self.events.append(BlockStored(i, hex_hash, request_id, token_ids, parent))

    def unpublished(self, block: KVCacheBlock, block_hash: BlockHash, reason: str) -> None:
        if block.ref_cnt == 0:
            self.num_cached_free -= 1
        self._unmark(block.block_id)
        self.events.append(BlockUnpublished(block.block_id, block_hash.hex(), reason))

    def cleared(self, num_blocks: int) -> None:
        self.num_cached_free = 0
        self.has_hash_arr[:] = False
        self.tokens_by_block.clear()
        self.hash_hex_by_block.clear()
        self.events.append(CacheReset(num_blocks))

    def _unmark(self, block_id: int) -> None:
        self._hashed[block_id] = False
        self.tokens_by_block.pop(block_id)
        self.hash_hex_by_block.pop(block_id)

    # -- tables and requests ------------------------------------------------------------------------
    def copied(self, src: int, dst: int, request_id: str, num_tokens: int) -> None:
        self.events.append(BlockCopied(src, dst, request_id, num_tokens))

    def forked(self, parent_id: str, child_id: str, block_ids: Sequence[int]) -> None:
        self.events.append(RequestForked(parent_id, child_id, tuple(block_ids)))

    def swapped_out(self, request_id: str, block_ids: Sequence[int], cpu_block_ids: Sequence[int]) -> None:
        self.events.append(SwappedOut(request_id, tuple(block_ids), tuple(cpu_block_ids)))

    def swapped_in(self, request_id: str, cpu_block_ids: Sequence[int], block_ids: Sequence[int]) -> None:
        self.events.append(SwappedIn(request_id, tuple(cpu_block_ids), tuple(block_ids)))

    def admitted(self, request_id: str, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.events.append(RequestAdmitted(request_id, num_prompt_tokens, num_hit_tokens))

    def preempted(self, request_id: str, mode: str, reason: str) -> None:
        self.events.append(RequestPreempted(request_id, mode, reason))

    def finished(self, request_id: str, reason: str) -> None:
        self.events.append(RequestFinished(request_id, reason))

    def aborted(self, request_id: str) -> None:
        self.events.append(RequestAborted(request_id))
