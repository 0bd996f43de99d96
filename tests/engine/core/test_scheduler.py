"""The scheduler alone, with fake requests and no model (as vLLM's tests/v1/core test theirs): the token budget,
chunked prefill, running before waiting, latecomer preemption by recompute or swap, prefix hits at admission."""

from __future__ import annotations

from engine.config import EngineConfig, SamplingParams
from engine.core.block_pool import BlockPool
from engine.core.cpu_pool import CpuBlockPool
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.inspect.pool_ledger import PoolLedger

BS = 4


def make(num_blocks: int = 32, **kw) -> Scheduler:
    config = EngineConfig(block_size=BS, num_gpu_blocks=num_blocks, **kw)
    cpu = CpuBlockPool(kw.get("num_cpu_blocks") or 0)
    return Scheduler(
        config,
        KVCacheManager(
            BlockPool(num_blocks, config.enable_prefix_caching, listener=PoolLedger(num_blocks)), BS, cpu_pool=cpu
        ),
    )


_count = [0]


def request(prompt: list[int], max_tokens: int = 8) -> Request:
    _count[0] += 1
    return Request(f"r{_count[0]}", _count[0], list(prompt), SamplingParams(max_tokens=max_tokens))


def run_step(s: Scheduler):
    """One schedule, then what the engine would do after a forward: computed tokens advance, a sampled token is
    appended to each request that reached its end."""
    out = s.schedule()
    for sr in out.scheduled:
        sr.request.num_computed_tokens += sr.num_new_tokens
        if sr.samples:
            sr.request.output_token_ids.append(7)
    return out


def test_the_token_budget_chunks_a_long_prompt_and_decodes_come_first():
    s = make(max_num_batched_tokens=10)
    a = request(list(range(1, 6)))
    s.add_request(a)
    out = run_step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [(a.request_id, 5)]
    b = request(list(range(100, 125)))  # 25 tokens: three chunks at this budget
    s.add_request(b)
    out = run_step(s)
    # the running request's decode comes before the waiting one, which gets the budget's rest
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [(a.request_id, 1), (b.request_id, 9)]
    assert not out.scheduled[1].samples  # a chunk short of the prompt's end samples nothing
    out = run_step(s)
    assert [x.num_new_tokens for x in out.scheduled] == [1, 9]
    out = run_step(s)
    assert [x.num_new_tokens for x in out.scheduled] == [1, 7] and out.scheduled[1].samples
    assert out.num_scheduled_tokens == 8


def test_max_num_seqs_keeps_the_rest_waiting_in_order():
    s = make(max_num_seqs=2)
    reqs = [request([i + 1] * 3) for i in range(4)]
    for r in reqs:
        s.add_request(r)
    out = run_step(s)
    assert [x.request for x in out.scheduled] == reqs[:2] and list(s.waiting) == reqs[2:]


def test_when_blocks_run_out_the_latest_admitted_is_preempted_by_recompute():
    s = make(num_blocks=6)  # 24 slots
    first, second = request(list(range(1, 12))), request(list(range(20, 31)))  # 11 tokens: 3 blocks each
    s.add_request(first)
    s.add_request(second)
    run_step(s)  # prefills: 3 blocks each, the last slot of each third block left for the first decode
    assert s.kv.pool.num_free_blocks == 0
    run_step(s)  # that decode fills the slot
    out = run_step(s)  # both cross into a fourth block: only one can
    assert out.preempted == [second] and second.status == RequestStatus.PREEMPTED
    assert [x.request for x in out.scheduled] == [first] and second.num_computed_tokens == 0
    assert s.waiting[0] is second and s.num_preemptions == 1
    assert second.request_id not in s.kv.req_to_blocks  # its blocks were freed (they stay cached)


def test_swap_preemption_moves_the_blocks_and_brings_the_request_back_first():
    s = make(num_blocks=6, preemption_mode="swap", num_cpu_blocks=8)
    first, second = request(list(range(1, 12)), max_tokens=2), request(list(range(20, 31)))
    s.add_request(first)
    s.add_request(second)
    run_step(s)
    run_step(s)
    out = run_step(s)
    assert out.preempted == [second] and second.status == RequestStatus.SWAPPED
    assert len(out.swap_out) == 3 and second.cpu_block_ids
    late = request([99] * 3)
    s.add_request(late)
    s.finish_request(first, RequestStatus.FINISHED_LENGTH)  # blocks come free
    out = run_step(s)
    # the swapped request comes back before any waiting one, and nothing waiting is admitted with it pending
    assert [x.request for x in out.scheduled][0] is second and len(out.swap_in) == 3
    assert second.status == RequestStatus.RUNNING


def test_a_prefix_hit_at_admission_counts_full_blocks_and_leaves_the_last_token():
    s = make()
    a = request(list(range(1, 14)), max_tokens=1)  # 13 tokens: 3 full blocks
    s.add_request(a)
    run_step(s)
    s.kv.pool.commit_step()
    s.finish_request(a, RequestStatus.FINISHED_LENGTH)
    b = request(list(range(1, 13)), max_tokens=1)  # 12 tokens: 3 full blocks, all cached; the last recomputed
    s.add_request(b)
    out = run_step(s)
    assert b.num_cached_tokens == 8 and out.scheduled[0].num_new_tokens == 4
    assert s.kv.prefix_cache_hits == 8 and s.kv.prefix_cache_queries == 13 + 12


def test_a_decode_entry_is_made_once_kept_current_and_let_go_when_the_request_ends():
    """A decoding request's entry is made once and updated each step (no object a request a step): it says the
    step's computed count and the table as it is now (a new block included), and a request that ends goes with
    its last reference (nothing the scheduler keeps holds it; the collector is not needed)."""
    import gc
    import weakref

    s = make()
    a = request(list(range(1, 4)), max_tokens=20)  # 3 tokens: the fourth lands in block 0, the fifth needs block 1
    s.add_request(a)
    run_step(s)  # the prefill
    entries = []
    for _ in range(3):
        (e,) = run_step(s).scheduled
        entries.append((e, e.num_computed_tokens, list(e.block_ids)))
    assert entries[0][0] is entries[1][0] is entries[2][0]  # one object, updated
    assert [n for _, n, _ in entries] == [3, 4, 5]
    assert len(entries[0][2]) == 1 and len(entries[1][2]) == 2 and entries[2][2] == s.kv.req_to_block_ids[a.request_id]
    gc.disable()
    try:
        gone = weakref.ref(a)
        s.finish_request(a, RequestStatus.FINISHED_ABORTED)
        del a, e, entries
        assert gone() is None
    finally:
        gc.enable()
