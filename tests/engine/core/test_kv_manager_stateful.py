"""Hypothesis state machine over the KV cache manager: add, allocate, decode, free, hit."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.config import SamplingParams
from engine.core.block_pool import BlockPool
from engine.core.cpu_pool import CpuBlockPool
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.inspect.audit import audit_pool
from engine.inspect.pool_ledger import PoolLedger
from engine.inspect.replay import PoolReplayer
from tests.checked import assert_pool_arrays_match, assert_tables_match

BS, NB = 4, 12
# Few distinct prefixes, so that hits and shared blocks are common.
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [7, 7, 7, 7]]


class KVMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(BlockPool(NB, listener=PoolLedger(NB)), BS)
        self.live: dict[str, Request] = {}
        self.n = 0
        self.events = []

    @rule(prefix=st.sampled_from(range(len(PREFIXES))), tail=st.lists(st.integers(0, 30), max_size=9))
    def add(self, prefix, tail):
        r = Request(str(self.n), self.n, PREFIXES[prefix] + tail, SamplingParams())
        self.n += 1
        hits, n_hit = self.kv.get_computed_blocks(r)
        assert n_hit < r.num_tokens
        for i, b in enumerate(hits):
            assert b.token_ids == tuple(r.token_slice(i * BS, (i + 1) * BS))
        before = [b.ref_cnt for b in self.kv.pool.blocks]
        if self.kv.allocate_slots(r, r.num_tokens - n_hit, hits) is None:
            assert [b.ref_cnt for b in self.kv.pool.blocks] == before
            return
        r.num_computed_tokens = r.num_tokens
        self.live[r.request_id] = r

    @precondition(lambda self: self.live)
    @rule(data=st.data(), tok=st.integers(0, 30))
    def decode(self, data, tok):
        r = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        r.output_token_ids.append(tok)
        if self.kv.allocate_slots(r, 1) is None:
            r.output_token_ids.pop()
        else:
            r.num_computed_tokens += 1

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        r = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.kv.free(r)

    @precondition(lambda self: not self.live)
    @rule()
    def reset(self):
        self.kv.reset_prefix_cache()

    @invariant()
    def audit_clean_and_replay_matches(self):
        assert audit_pool(self.kv.pool, self.kv.req_to_blocks, self.kv.pool.listener).ok
        self.events += self.kv.pool.listener.drain_events()
        rp = PoolReplayer(NB).apply_all(self.events)
        pool = self.kv.pool
        assert rp.ref_cnt.tolist() == [b.ref_cnt for b in pool.blocks]
        assert list(rp.free_queue) == pool.free_queue.ids()
        assert rp.block_hash == [b.block_hash.hex() if b.block_hash else None for b in pool.blocks]
        assert_pool_arrays_match(pool, pool.listener)  # what a snapshot copies, kept up to date op by op
        assert_tables_match(self.kv)

    def teardown(self):
        for r in list(self.live.values()):
            self.kv.free(r)
        assert self.kv.pool.num_free_blocks == NB
        assert audit_pool(self.kv.pool, self.kv.req_to_blocks, self.kv.pool.listener).ok


class KVForkSwapMachine(KVMachine):
    """The rules above plus fork, copy-on-write (a decode into a shared partial block), swap out
    and in, and abort of swapped requests, on a small pool where eviction is common."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(BlockPool(NB, listener=PoolLedger(NB)), BS, cpu_pool=CpuBlockPool(8))
        self.swapped: dict[str, Request] = {}

    def _new(self, tokens) -> Request:
        r = Request(str(self.n), self.n, list(tokens), SamplingParams())
        self.n += 1
        return r

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        child = self._new(parent.prompt_token_ids)
        child.output_token_ids = list(parent.output_token_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        self.kv.fork(parent, child)
        self.live[child.request_id] = child

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def swap_out(self, data):
        r = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        if self.kv.swap_out(r):
            self.swapped[r.request_id] = self.live.pop(r.request_id)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        r = self.swapped[data.draw(st.sampled_from(sorted(self.swapped)))]
        if self.kv.can_swap_in(r, 0):
            self.kv.swap_in(r)
            self.live[r.request_id] = self.swapped.pop(r.request_id)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def abort_swapped(self, data):
        self.kv.free(self.swapped.pop(data.draw(st.sampled_from(sorted(self.swapped)))))

    @invariant()
    def audit_clean_and_replay_matches(self):
        assert audit_pool(self.kv.pool, self.kv.req_to_blocks, self.kv.pool.listener).ok
        self.kv.take_device_work()
        self.events += self.kv.pool.listener.drain_events()
        rp = PoolReplayer(NB).apply_all(self.events)
        pool = self.kv.pool
        assert rp.ref_cnt.tolist() == [b.ref_cnt for b in pool.blocks]
        assert list(rp.free_queue) == pool.free_queue.ids()
        assert_pool_arrays_match(pool, pool.listener)
        assert_tables_match(self.kv)
        cpu = self.kv.cpu_pool
        assert cpu.num_free_blocks + sum(len(r.cpu_block_ids) for r in self.swapped.values()) == cpu.num_blocks
        for r in self.live.values():  # every table covers its computed tokens
            assert len(self.kv.req_to_blocks[r.request_id]) * BS >= r.num_computed_tokens

    def teardown(self):
        for r in list(self.live.values()) + list(self.swapped.values()):
            self.kv.free(r)
        assert self.kv.pool.num_free_blocks == NB
        assert self.kv.cpu_pool.num_free_blocks == self.kv.cpu_pool.num_blocks


TestKVManager = KVMachine.TestCase
TestKVManager.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestKVForkSwap = KVForkSwapMachine.TestCase
TestKVForkSwap.settings = settings(
    max_examples=80, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
