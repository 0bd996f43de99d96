"""The event stream replays to the live pool; snapshots and audits tell the truth."""

from __future__ import annotations

import random

import pytest

from engine import SamplingParams
from engine.config import FAULTS
from engine.inspect.events import BlockAllocated, RequestAdmitted, RequestFinished, RequestPreempted
from engine.inspect.replay import PoolReplayer
from engine.inspect.snapshot import BlockState


def run_random_workload(engine, seed: int, steps: int = 120):
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(10)]
    events = []
    for _ in range(steps):
        if rng.random() < 0.4:
            prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(256) for _ in range(rng.randrange(1, 20))]
            engine.add_request(
                prompt, SamplingParams(max_tokens=rng.randrange(1, 12), temperature=0.0, ignore_eos=True)
            )
        if rng.random() < 0.1 and engine.requests:
            engine.abort(rng.choice(sorted(engine.requests)))
        events += engine.step().events
        assert engine.audit().ok
    while engine.has_unfinished():
        events += engine.step().events
    return events


def test_replay_rebuilds_pool_exactly(tiny_engine):
    engine = tiny_engine(num_gpu_blocks=20, block_size=4)
    events = run_random_workload(engine, seed=1)
    kinds = {type(e) for e in events}
    assert {BlockAllocated, RequestAdmitted, RequestFinished, RequestPreempted} <= kinds
    rp = PoolReplayer(engine.pool.num_blocks).apply_all(events)
    assert rp.ref_cnt.tolist() == [b.ref_cnt for b in engine.pool.blocks]
    assert list(rp.free_queue) == engine.pool.free_queue.ids()
    assert rp.block_hash == [b.block_hash.hex() if b.block_hash else None for b in engine.pool.blocks]
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_replay_matches_at_every_step(tiny_engine):
    engine = tiny_engine(num_gpu_blocks=16, block_size=4)
    rp = PoolReplayer(16)
    for i in range(6):
        engine.add_request([i + 1] * (4 + 3 * i), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        rp.apply_all(engine.step().events)
        snap = engine.snapshot()
        assert rp.ref_cnt.tolist() == snap.ref_cnt.tolist()
        assert list(rp.free_queue) == snap.free_queue.tolist()


def test_snapshot_is_a_consistent_copy(tiny_engine):
    engine = tiny_engine(num_gpu_blocks=16, block_size=4)
    a = engine.add_request(list(range(1, 10)), SamplingParams(max_tokens=4, temperature=0.0))
    b = engine.add_request(list(range(1, 10)), SamplingParams(max_tokens=4, temperature=0.0))
    engine.step()
    snap = engine.snapshot()
    ta, tb = snap.block_tables[a], snap.block_tables[b]
    assert ta[:2] == tb[:2]  # the shared two full blocks
    for bid in ta[:2]:
        assert snap.state[bid] == BlockState.SHARED and snap.ref_cnt[bid] == 2
        assert snap.has_hash[bid] and snap.cached_tokens[bid] and len(snap.block_hashes[bid]) == 64
    assert snap.state[ta[2]] == BlockState.USED and snap.filled[ta[2]] == 1
    assert snap.owner[ta[0]] == snap.request(a).index
    assert snap.counters["num_requests_running"] == 2
    assert snap.counters["kv_cache_usage_perc"] == (16 - engine.pool.num_free_blocks) / 16
    engine.step()  # the live state moves on; the snapshot does not
    assert snap.request(a).num_computed_tokens == 9
    while engine.has_unfinished():
        engine.step()
    snap2 = engine.snapshot()
    assert (snap2.state[list(ta[:2])] == BlockState.CACHED).all()
    assert (snap2.ref_cnt == 0).all()


def test_audit_finds_a_leaked_block(tiny_engine):
    engine = tiny_engine(num_gpu_blocks=16, block_size=4)
    rid = engine.add_request(list(range(1, 10)), SamplingParams(max_tokens=4, temperature=0.0))
    engine.step()
    # Simulate an abort path that forgets to free: drop the table but keep the refs.
    blocks = engine.kv.req_to_blocks.pop(rid)
    report = engine.audit()
    assert not report.ok
    assert report.leaked_blocks == sorted(b.block_id for b in blocks)
    assert all(p.last_owner == rid for p in report.problems if p.problem == "leaked")


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_the_pool_counts_blocks_per_state_as_they_change(tiny_engine, fault, mode):
    """What an engine process sends for a step it does not copy the arrays of: the pool's own counts of free,
    cached, used and shared blocks, kept as blocks change, equal a count over the snapshot's states at every
    step; under preemption, samples, aborts and every planted fault too (a leak, a double free...)."""
    engine = tiny_engine(num_gpu_blocks=24, block_size=4, num_cpu_blocks=16, preemption_mode=mode, fault=fault)
    rng = random.Random(1)
    shared = [rng.randrange(256) for _ in range(9)]
    for i in range(12):
        engine.add_request(
            shared + [rng.randrange(256) for _ in range(rng.randrange(1, 12))],
            SamplingParams(max_tokens=rng.randrange(3, 20), n=rng.choice([1, 1, 2]), temperature=1.0, seed=i),
        )
    steps, seen = 0, set()
    while engine.has_unfinished() and steps < 400:
        engine.step()
        steps += 1
        if steps % 7 == 0 and engine.requests:
            engine.abort(next(iter(engine.requests)))
        counts = engine.ledger.state_counts()
        assert counts == engine.snapshot().state_counts, f"step {steps}"
        seen.update(BlockState(i) for i, c in enumerate(counts) if c)
    assert {BlockState.FREE, BlockState.CACHED, BlockState.USED, BlockState.SHARED} <= seen
