"""The physical block pool: ref counts, the free queue (its order is the eviction policy) and the prefix-cache map."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ..inspect.chunked_map import ChunkedMap
from ..inspect.events import (
    BlockAllocated,
    BlockEvicted,
    BlockFreed,
    BlockStored,
    BlockTouched,
    BlockUnpublished,
    CacheReset,
    Event,
)
from ..inspect.free_order import FreeOrder
from .eviction import make_free_queue
from .kv_cache_utils import BlockHash, KVCacheBlock


class BlockPool:
    """Owns every ``KVCacheBlock``. Every state change appends one event to ``events``.

    A free block may still be cached (ref 0, hash kept): it stays reusable until it is
    handed out again, at which point its hash is dropped (eviction). Handing out from
    the head of the free queue makes eviction "least recently freed first" (the default
    ``lru`` policy; ``lfu`` orders the queue by use counts, see eviction.py).

    Only this class changes a block's hash or the hash map. Publication is two-phase:
    ``cache_block`` stores a block as soon as the step that completes it is scheduled
    (vLLM's same-step hits: each layer stores the whole batch's K/V before attention
    reads it), and remembers it as *tentative*; the engine calls ``commit_step`` once the
    step's forward, sampling and post-processing succeeded, or ``rollback_step`` when
    anything failed, which unpublishes every tentative block (its KV may be unwritten).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, eviction_policy: str = "lru") -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # "lru" is vLLM's FreeKVCacheBlockQueue, unchanged; other policies order the same queue otherwise
        # (engine/core/eviction.py). A policy that counts uses hears of every hit (touch) through note_hit.
        self.eviction_policy = eviction_policy
        self.free_queue = make_free_queue(eviction_policy, self.blocks)
        self._note_hit = getattr(self.free_queue, "note_hit", None)
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        self.events: list[Event] = []
        self.step = 0  # stamped into last_access
        self.num_evictions = 0
        self.tolerate_faults = False  # set when EngineConfig.fault injects a bug on purpose
        self.tentative: list[tuple[KVCacheBlock, BlockHash]] = []  # published since the last commit
        # What a snapshot shows, kept up to date by every change below, so that a snapshot copies arrays
        # (and freezes two chunked maps) instead of walking 65,536 or 1M block objects.
        self.ref_cnt_arr = np.zeros(num_blocks, np.int32)
        self.has_hash_arr = np.zeros(num_blocks, bool)
        self.last_access_arr = np.zeros(num_blocks, np.int64)
        # the same memory as Python-int views, for one-block writes (a numpy scalar write costs ~3x)
        self._ref_mv, self._access_mv = memoryview(self.ref_cnt_arr), memoryview(self.last_access_arr)
        self._hash_mv = memoryview(self.has_hash_arr)
        self.tokens_by_block: ChunkedMap[tuple[int, ...]] = ChunkedMap(num_blocks)
        self.hash_hex_by_block: ChunkedMap[str] = ChunkedMap(num_blocks)
        # The order blocks were freed in: the eviction order under LRU only (under lfu, snapshots' free_queue
        # and PoolReplayer's "allocated == head" rule do not hold; the events still describe every change).
        self.free_order = FreeOrder(num_blocks)
        # Blocks per state kept as they change (with the free queue's length they give every count of
        # ``state_counts``), so a step's record counts its states in O(1), not in a pass over the pool.
        self.num_cached_free = 0  # ref count 0 with a hash: free, but reusable until evicted
        self.num_shared = 0  # ref count > 1

    # -- queries ----------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def state_counts(self) -> tuple[int, ...]:
        """Blocks per ``BlockState`` (free, cached, used, shared, swapped, leaked, reserved), as counting the
        snapshot's state array would give them (swaps live in the CPU pool, leaks are the audit's; this pool
        reserves no block: vLLM's null block is a probed vLLM's)."""
        free, cached, shared = self.free_queue.num_free_blocks, self.num_cached_free, self.num_shared
        return (free - cached, cached, self.num_blocks - free - shared, shared, 0, 0, 0)

    def get_cached_block(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> KVCacheBlock | None:
        b = self.cached.get(block_hash)
        # A hash collision must never serve wrong KV: compare the tokens too.
        if b is None or b.token_ids != token_ids:
            return None
        return b

    # -- state changes ------------------------------------------------------------
    def get_new_blocks(self, n: int, request_id: str) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot get {n} blocks, only {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            b = self.free_queue.popleft()
            if b.block_hash is not None:
                self.num_cached_free -= 1
            self._evict(b)
            assert b.ref_cnt == 0
            b.ref_cnt = 1
            b.last_access = self.step
            b.last_owner = request_id
            b.holders = [request_id]
            self.events.append(BlockAllocated(b.block_id, request_id))
            out.append(b)
        if n == 1:  # a decode crossing into a new block: scalar writes, no index-array temporaries
            i = out[0].block_id
            self.free_order.remove_one(i)
            self._ref_mv[i] = 1
            self._access_mv[i] = self.step
        elif n:
            ids = [b.block_id for b in out]
            self.free_order.removed(ids)
            self.ref_cnt_arr[ids] = 1
            self.last_access_arr[ids] = self.step
        return out

    def _evict(self, b: KVCacheBlock) -> None:
        if b.block_hash is None:
            return
        if self.cached.get(b.block_hash) is b:
            del self.cached[b.block_hash]
        self.events.append(BlockEvicted(b.block_id, b.block_hash.hex()))
        b.block_hash, b.token_ids = None, ()
        self._unmark(b.block_id)
        self.num_evictions += 1

    def _unmark(self, block_id: int) -> None:
        self._hash_mv[block_id] = False
        self.tokens_by_block.pop(block_id)
        self.hash_hex_by_block.pop(block_id)

    def touch(self, blocks: Iterable[KVCacheBlock], request_id: str) -> None:
        """Take one more reference on each block (a prefix hit or a fork)."""
        if not blocks:
            return
        ids, refs, unfreed = [], [], []
        note_hit = self._note_hit  # None under LRU
        for b in blocks:
            if note_hit is not None:
                note_hit(b)
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
                unfreed.append(b.block_id)
                if b.block_hash is not None:
                    self.num_cached_free -= 1
            b.ref_cnt += 1
            if b.ref_cnt == 2:
                self.num_shared += 1
            b.last_access = self.step
            b.last_owner = request_id
            b.holders.append(request_id)
            self.events.append(BlockTouched(b.block_id, request_id, b.ref_cnt))
            ids.append(b.block_id)
            refs.append(b.ref_cnt)
        self.free_order.removed(unfreed)
        self._set_refs(ids, refs)

    def _set_refs(self, ids: list[int], refs: list[int]) -> None:
        if not ids:
            return
        if len(ids) == 1:
            self._ref_mv[ids[0]] = refs[0]
            self._access_mv[ids[0]] = self.step
            return
        if len(set(ids)) < len(ids):  # the same block twice in one call: its last count is its count
            last = dict(zip(ids, refs))
            ids, refs = list(last), list(last.values())
        self.ref_cnt_arr[ids] = refs
        self.last_access_arr[ids] = self.step

    def free_blocks(self, ordered: Iterable[KVCacheBlock], request_id: str) -> None:
        """Drop one reference on each block; at ref 0 it joins the free queue tail.

        Callers pass a request's blocks tail-first, so the end of a prefix chain is
        evicted before its start (the start is the part other requests share).
        """
        ids, refs, freed = [], [], []
        for b in ordered:
            if b.ref_cnt <= 0:
                # Only a deliberate fault (double-free) gets here; audit() reports it.
                assert self.tolerate_faults, f"block {b.block_id} freed with ref_cnt {b.ref_cnt}"
                continue
            b.ref_cnt -= 1
            if b.ref_cnt == 1:
                self.num_shared -= 1
            ids.append(b.block_id)
            refs.append(b.ref_cnt)
            b.last_access = self.step
            b.last_released_by = request_id
            if request_id in b.holders:
                b.holders.remove(request_id)
            self.events.append(BlockFreed(b.block_id, request_id, b.ref_cnt))
            if b.ref_cnt == 0:
                self.free_queue.append(b)
                freed.append(b.block_id)
                if b.block_hash is not None:
                    self.num_cached_free += 1
        self.free_order.appended(freed)
        self._set_refs(ids, refs)

    def cache_block(
        self,
        b: KVCacheBlock,
        block_hash: BlockHash,
        token_ids: tuple[int, ...],
        request_id: str,
        parent_hash: BlockHash | None = None,
    ) -> None:
        """Publish a full block under its chained hash (first writer wins).

        ``parent_hash`` is the hash ``block_hash`` was chained from (None for a first block);
        only the event carries it, for consumers that rebuild the prefix tree.
        """
        if not self.enable_caching or b.block_hash is not None or block_hash in self.cached:
            return
        b.block_hash, b.token_ids = block_hash, token_ids
        self.cached[block_hash] = b
        if b.ref_cnt == 0:  # only a planted fault publishes a free block
            self.num_cached_free += 1
        self.tentative.append((b, block_hash))
        hex_hash = block_hash.hex()
        self._hash_mv[b.block_id] = True
        self.tokens_by_block[b.block_id] = token_ids
        self.hash_hex_by_block[b.block_id] = hex_hash
        self.events.append(
            BlockStored(
                b.block_id, hex_hash, request_id, token_ids, parent_hash.hex() if parent_hash is not None else None
            )
        )

    def commit_step(self) -> None:
        """The step that wrote the tentative blocks' last slots succeeded: they stay published."""
        self.tentative.clear()

    def rollback_step(self, reason: str) -> list[int]:
        """Unpublish every block published since the last commit (newest first); returns their ids.

        A block already evicted (or re-published under another hash) since is left alone:
        each entry is undone only while the block still carries the hash it was given.
        """
        undone = []
        for b, h in reversed(self.tentative):
            if b.block_hash != h or self.cached.get(h) is not b:
                continue
            del self.cached[h]
            b.block_hash, b.token_ids = None, ()
            if b.ref_cnt == 0:
                self.num_cached_free -= 1
            self._unmark(b.block_id)
            self.events.append(BlockUnpublished(b.block_id, h.hex(), reason))
            undone.append(b.block_id)
        self.tentative.clear()
        return undone

    def reset_prefix_cache(self) -> None:
        used = self.num_blocks - self.num_free_blocks
        if used:
            raise RuntimeError(
                f"cannot reset the prefix cache while {used} block(s) are in use; "
                "finish or abort the running requests first"
            )
        for b in self.blocks:
            b.block_hash, b.token_ids = None, ()
        self.cached.clear()
        self.num_cached_free = 0
        self.has_hash_arr[:] = False
        self.tokens_by_block.clear()
        self.hash_hex_by_block.clear()
        self.tentative.clear()
        self.events.append(CacheReset(self.num_blocks))

    def drain_events(self) -> list[Event]:
        ev, self.events = self.events, []
        return ev
