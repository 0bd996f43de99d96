"""Eviction policies (engine/core/eviction.py): LRU stays vLLM's queue; LFU with dynamic ageing keeps its
invariants: empty blocks first, frequency with ageing, a parent never before its child, O(log n) heap,
and events that still describe every change."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import invariant

from engine.config import EngineConfig, SamplingParams
from engine.core.block_pool import BlockPool
from engine.core.eviction import LFUFreeQueue, make_free_queue
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_cache_utils import FreeKVCacheBlockQueue
from engine.core.request import Request
from engine.inspect.audit import audit_pool
from engine.inspect.events import (
    BlockAllocated,
    BlockEvicted,
    BlockFreed,
    BlockStored,
    BlockTouched,
    BlockUnpublished,
    CacheReset,
)
from engine.inspect.pool_ledger import PoolLedger
from tests.engine.core.test_kv_manager_stateful import BS, NB, KVMachine

_n = 0


def _req(tokens) -> Request:
    global _n
    _n += 1
    return Request(f"r{_n}", _n, list(tokens), SamplingParams(max_tokens=1))


def _run(kv: KVCacheManager, tokens) -> Request:
    """Admit a request (its prefix hits first), compute its prompt, and keep it (the caller frees it)."""
    r = _req(tokens)
    hits, n_hit = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - n_hit, hits) is not None
    kv.record_prefix_query(r.num_tokens, n_hit)
    r.num_cached_tokens = n_hit
    r.num_computed_tokens = r.num_tokens
    return r


def _cached_prefixes(kv: KVCacheManager, tokens) -> int:
    """How many leading full blocks of ``tokens`` are cached now."""
    return kv.get_computed_blocks(_req(list(tokens) + [0]))[1] // kv.block_size


def test_lru_is_vllms_queue_and_the_default():
    assert isinstance(BlockPool(4).free_queue, FreeKVCacheBlockQueue)
    assert BlockPool(4).free_queue.policy == EngineConfig().eviction_policy == "lru"
    assert isinstance(BlockPool(4, eviction_policy="lfu").free_queue, LFUFreeQueue)
    with pytest.raises(ValueError, match="eviction_policy must be one of lru, lfu"):
        make_free_queue("mru", [])
    with pytest.raises(ValueError, match="eviction_policy must be one of lru, lfu"):
        EngineConfig(eviction_policy="fifo").validate()


def test_lfu_hands_out_empty_blocks_before_cached_ones():
    """Under LRU an empty block freed after a cached one waits behind it; under LFU it goes first."""
    out = {}
    for policy in ("lru", "lfu"):
        kv = KVCacheManager(BlockPool(4, eviction_policy=policy, listener=PoolLedger(4)), 2)
        kv.free(_run(kv, [1, 2, 3]))  # one full (cached) block, one partial (empty): the queue is e e E [1,2]
        kv.free(_run(kv, [7]))  # one more empty block, freed after [1, 2]: the queue is e E [1,2] E
        kv.free(_run(kv, [9, 9, 9, 9, 9, 9]))  # three blocks: two empty ones, then [1, 2] or the last empty one
        out[policy] = _cached_prefixes(kv, [1, 2])
    assert out == {"lru": 0, "lfu": 1}  # LRU evicted the cached [1, 2]; LFU took the empty block


def test_lfu_keeps_the_block_used_most_until_ageing_catches_up():
    kv = KVCacheManager(BlockPool(3, eviction_policy="lfu", listener=PoolLedger(3)), 2)
    hot = [1, 1]
    for _ in range(3):  # used three times
        kv.free(_run(kv, hot + [0]))
    kv.free(_run(kv, [2, 2, 0]))  # used once, freed after hot: LRU would evict hot first
    kv.free(_run(kv, [3, 3, 3, 3]))  # needs two blocks: one empty... then one cached
    assert _cached_prefixes(kv, hot) == 1 and _cached_prefixes(kv, [2, 2]) == 0
    # each eviction raises the age; blocks used once lately overtake a block used three times long ago
    for i in range(4, 12):
        kv.free(_run(kv, [i, i, i, i]))
    assert _cached_prefixes(kv, hot) == 0
    q = kv.pool.free_queue
    assert q.age > 3


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_parent_is_never_evicted_before_its_cached_child(policy):
    """One request at a time over a small prefix tree with hot branches: after every request, every cached
    block's parent is cached too (no orphan: a block that can never hit again while it takes a slot)."""
    rng = random.Random(7)
    kv = KVCacheManager(BlockPool(24, eviction_policy=policy, listener=PoolLedger(24)), 4)
    parent_of: dict[str, str | None] = {}
    trunks = [[rng.randrange(50) for _ in range(4 * rng.randint(1, 4))] for _ in range(6)]
    for _ in range(400):
        base = trunks[min(int(rng.expovariate(0.8)), len(trunks) - 1)]
        tokens = base[: 4 * rng.randint(0, len(base) // 4)] + [rng.randrange(50) for _ in range(rng.randint(1, 14))]
        kv.free(_run(kv, tokens))
        for ev in kv.pool.listener.drain_events():
            if isinstance(ev, BlockStored):
                parent_of[ev.block_hash] = ev.parent_hash
        cached = {h.hex() for h in kv.pool.cached}
        orphans = [h for h in cached if parent_of[h] is not None and parent_of[h] not in cached]
        assert not orphans
    assert kv.pool.num_evictions > 100


def test_lfu_heap_stays_proportional_to_the_free_blocks():
    """Removal is lazy (a stale heap entry), so the heap is rebuilt when stale entries outnumber the live."""
    kv = KVCacheManager(BlockPool(64, eviction_policy="lfu", listener=PoolLedger(64)), 2)
    rng = random.Random(3)
    live = []
    for _ in range(3000):
        if live and (rng.random() < 0.5 or kv.pool.num_free_blocks < 8):
            kv.free(live.pop(rng.randrange(len(live))))
        else:
            live.append(_run(kv, [rng.randrange(4) for _ in range(rng.randint(1, 9))]))
        q = kv.pool.free_queue
        assert len(q._heap) <= 2 * q.num_free_blocks + 64 + 1
        assert q.num_free_blocks == kv.pool.num_free_blocks == len(q.ids())


def _fold(events, num_blocks: int):
    """Ref counts and hashes rebuilt from the events alone."""
    ref, hashes = [0] * num_blocks, [None] * num_blocks
    for ev in events:
        if isinstance(ev, BlockAllocated):
            ref[ev.block_id] = 1
        elif isinstance(ev, (BlockTouched, BlockFreed)):
            ref[ev.block_id] = ev.ref_cnt
        elif isinstance(ev, BlockStored):
            hashes[ev.block_id] = ev.block_hash
        elif isinstance(ev, (BlockEvicted, BlockUnpublished)):
            hashes[ev.block_id] = None
        elif isinstance(ev, CacheReset):
            hashes = [None] * num_blocks
    return ref, hashes


class LFUMachine(KVMachine):
    """The KV manager's state machine (add, decode, free, reset) over an LFU pool. Its free queue is not
    in free order, so the replayer's rule "an allocation takes the queue's head" does not apply: the
    events must still give every ref count and every hash, and the audit stays clean."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(BlockPool(NB, eviction_policy="lfu", listener=PoolLedger(NB)), BS)

    @invariant()
    def audit_clean_and_replay_matches(self):
        pool = self.kv.pool
        assert audit_pool(pool, self.kv.req_to_blocks, pool.listener).ok
        self.events += pool.listener.drain_events()
        ref, hashes = _fold(self.events, NB)
        assert ref == [b.ref_cnt for b in pool.blocks]
        assert hashes == [b.block_hash.hex() if b.block_hash else None for b in pool.blocks]
        assert sorted(pool.free_queue.ids()) == sorted(b.block_id for b in pool.blocks if b.ref_cnt == 0)
        assert pool.listener.state_counts()[0] + pool.listener.state_counts()[1] == pool.num_free_blocks


TestLFUMachine = LFUMachine.TestCase
TestLFUMachine.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
