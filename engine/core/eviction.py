"""Eviction policies: the order in which the block pool hands out its free blocks.

A free block (ref count 0) may still be cached: it keeps its hash and stays reusable until the
pool hands it out again, which evicts it. So the free queue's order *is* the eviction policy.
``BlockPool`` needs four things of a free queue: ``popleft`` (the next block to hand out),
``remove`` (a cached free block that a request hits leaves the queue wherever it is),
``append`` (a block whose last reference was dropped) and ``num_free_blocks``; iterating it
walks the queue in eviction order (the audit does).

- ``lru``: vLLM's ``FreeKVCacheBlockQueue`` (kv_cache_utils.py), unchanged: least recently freed
  first. A request frees its blocks tail first, so a prefix's end goes before its start. Blocks
  without a hash (a partial last block, a block never published) queue in the same order, so a
  cached block can be evicted while an empty block waits behind it, as in vLLM.
- ``lfu``: least frequently used first, with dynamic ageing (LFU-DA: Arlitt et al., "Evaluating
  content management techniques for Web proxy caches", 2000). Its reason to exist: under LRU one
  burst of long one-off prompts (a document read once) flushes the prefixes that many requests
  share (system prompts, a popular document, a long conversation's history); LFU keeps the blocks
  hit often. Plain LFU would keep yesterday's hot prefix forever: the ageing term fixes that. And
  an empty block (no hash) holds nothing to lose, so it is handed out before any cached block.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from ..config import EVICTION_POLICIES
from .kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock


class LFUFreeQueue:
    """Free blocks in LFU-DA order: the smallest key is handed out first.

    Each block counts its uses since its content was computed: the allocation that computed it
    (``popleft`` hands a block out only to be allocated), then every hit or fork (``note_hit``,
    called by ``BlockPool.touch``). A block that joins the queue gets the key ``age + uses``, where
    ``age`` is the key of the last cached block evicted: it only grows, so a block used often long
    ago ends up below one used a few times lately (the ageing). A block without a hash gets key -1
    (handed out first). Equal keys go least recently freed first, as under LRU.

    A parent is never evicted before its cached child: every use of a block is also a use of the
    blocks before it (a prefix hit takes the whole prefix, a new request computes it), so a parent's
    count is at least its child's, it is freed no earlier (a request frees tail first) and ``age``
    only grows, so its key is at least the child's and its place in a tie is later. (The exception
    is a block that two concurrent requests computed twice: only the first copy is published, and
    the second request's next block hangs under the first's.)

    A binary heap with lazy deletion: ``append`` and ``popleft`` are O(log n), ``remove`` is O(1)
    (its heap entry goes stale and is skipped, or dropped when stale entries outnumber live ones).
    """

    policy = "lfu"

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.blocks = blocks
        self.num_free_blocks = 0
        self.age = 0  # LFU-DA's L: the key of the last cached block evicted
        self._heap: list[tuple[int, int, int]] = []  # (key, seq, block id); seq orders ties and marks liveness
        self._seq_of = [-1] * len(blocks)  # the seq of a queued block's live heap entry; -1: not queued
        self._uses = [0] * len(blocks)
        self._seq = itertools.count()
        for b in blocks:
            self.append(b)

    def note_hit(self, b: KVCacheBlock) -> None:
        """One more use of a block's content: a prefix hit or a fork took a reference on it."""
        self._uses[b.block_id] += 1

    def popleft(self) -> KVCacheBlock:
        heap, seq_of = self._heap, self._seq_of
        while heap:
            key, seq, bid = heapq.heappop(heap)
            if seq_of[bid] == seq:
                break
        else:
            raise ValueError("no free block")
        b = self.blocks[bid]
        seq_of[bid] = -1
        self.num_free_blocks -= 1
        if b.block_hash is not None:  # about to be evicted: the ageing takes its key
            self.age = key
        self._uses[bid] = 1  # handed out to be allocated: the first use of its new content
        self._maybe_compact()
        return b

    def queued(self, b: KVCacheBlock) -> bool:
        return self._seq_of[b.block_id] != -1

    def remove(self, b: KVCacheBlock) -> None:
        assert self.queued(b), f"block {b.block_id} is not on the free queue"
        self._seq_of[b.block_id] = -1
        self.num_free_blocks -= 1
        self._maybe_compact()

    def _maybe_compact(self) -> None:
        """Drop the stale entries once they outnumber the live ones (plus 64): O(n) once per n/2 stale
        entries made, so O(1) a call amortized, and the heap never holds more than 2 x free + 64."""
        if len(self._heap) > 2 * self.num_free_blocks + 64:
            seq_of = self._seq_of
            self._heap = [e for e in self._heap if seq_of[e[2]] == e[1]]
            heapq.heapify(self._heap)

    def append(self, b: KVCacheBlock) -> None:
        assert not self.queued(b), f"block {b.block_id} is already on the free queue"
        bid = b.block_id
        seq = next(self._seq)
        key = -1 if b.block_hash is None else self.age + self._uses[bid]
        heapq.heappush(self._heap, (key, seq, bid))
        self._seq_of[bid] = seq
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """The queued blocks in eviction order (a sort: for audits and tests, not the hot path)."""
        seq_of = self._seq_of
        for _, _, bid in sorted(e for e in self._heap if seq_of[e[2]] == e[1]):
            yield self.blocks[bid]

    def ids(self) -> list[int]:
        return [b.block_id for b in self]


def make_free_queue(policy: str, blocks: list[KVCacheBlock]) -> FreeKVCacheBlockQueue | LFUFreeQueue:
    """The free queue of an ``EngineConfig.eviction_policy``, holding ``blocks`` (all free) in id order."""
    if policy == "lru":
        return FreeKVCacheBlockQueue(blocks)
    if policy == "lfu":
        return LFUFreeQueue(blocks)
    raise ValueError(f"eviction_policy must be one of {', '.join(EVICTION_POLICIES)}, got {policy!r}")
