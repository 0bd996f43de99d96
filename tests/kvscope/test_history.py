"""The timeline's history rebuilds every step's snapshot exactly, from keyframes and events, within a budget."""

from __future__ import annotations

import random

import numpy as np

from engine import SamplingParams
from kvscope.history import RunHistory
from kvscope.sources.live import LiveSource

ARRAYS = ("state", "ref_cnt", "owner", "has_hash", "last_access", "filled", "free_queue", "cpu_state", "cpu_owner")


def assert_same(a, b) -> None:
    for f in ARRAYS:
        assert np.array_equal(getattr(a, f), getattr(b, f)), f
    assert a.step == b.step and a.counters == b.counters
    assert dict(a.cached_tokens) == dict(b.cached_tokens) and dict(a.block_hashes) == dict(b.block_hashes)
    assert [r.request_id for r in a.requests] == [r.request_id for r in b.requests]
    for ra, rb in zip(a.requests, b.requests):
        assert ra == rb, (ra, rb)


def busy_run(engine, steps: int, seed: int = 0):
    """Shared prefixes, n > 1 (CoW), aborts, preemption by swap and recompute; yields every record."""
    rng = random.Random(seed)
    src = LiveSource(engine)
    prefix = list(range(20, 32))
    yield src.current()
    for i in range(steps):
        if rng.random() < 0.5:
            n = rng.choice([1, 1, 2])
            prompt = prefix[: rng.randint(0, 12)] + [rng.randrange(1, 255) for _ in range(rng.randint(1, 9))]
            src.inject(
                prompt, SamplingParams(max_tokens=rng.randint(2, 12), n=n, temperature=0.0 if n == 1 else 1.0, seed=i)
            )
            yield src.current()
        if rng.random() < 0.1 and engine.requests:
            src.abort(rng.choice(sorted(engine.requests)))
            yield src.current()
        yield src.step()


def test_every_step_rebuilds_exactly_from_keyframes_and_events(tiny_engine):
    engine = tiny_engine(num_gpu_blocks=24, preemption_mode="swap", num_cpu_blocks=8)
    hist = RunHistory(keyframe_every=7)
    truth = {}
    for rec in busy_run(engine, 120):
        hist.record(rec.snapshot, rec.seconds, None, rec.events)
        truth[rec.step] = rec.snapshot
    assert engine.kv.num_swap_outs and engine.kv.num_cow_copies and engine.scheduler.num_preemptions
    assert hist.steps == sorted(truth)
    for step, snap in truth.items():
        assert_same(hist.at(step), snap)


def test_steps_kept_as_digests_rebuild_exactly_and_plot_the_same(tiny_engine):
    """The window digests a record a newer one came with (no arrays): the timeline keeps the same
    series and still rebuilds every step exactly, from keyframes taken at the whole ones."""
    from engine.inspect.snapshot import StepDigest, state_counts

    engine = tiny_engine(num_gpu_blocks=24, preemption_mode="swap", num_cpu_blocks=8)
    whole, mixed = RunHistory(keyframe_every=7), RunHistory(keyframe_every=7)
    truth = {}
    for i, rec in enumerate(busy_run(engine, 120, seed=3)):
        snap = rec.snapshot
        counts = state_counts(snap.ref_cnt, snap.has_hash)
        assert counts == snap.state_counts  # the digest counts what the assembled state shows
        whole.record(snap, rec.seconds, None, rec.events)
        if i and i % 5:
            snap = StepDigest(
                snap.step,
                snap.block_size,
                snap.num_blocks,
                snap.requests,
                snap.counters,
                counts,
                snap.num_cpu_blocks,
                snap.block_bytes,
                snap.model_name,
            )
        mixed.record(snap, rec.seconds, None, rec.events)
        truth[rec.step] = rec.snapshot
    assert mixed.steps == whole.steps
    assert {k: list(v) for k, v in mixed.series.items()} == {k: list(v) for k, v in whole.series.items()}
    for step, snap in truth.items():
        assert_same(mixed.at(step), snap)


def test_the_budget_drops_the_oldest_steps_and_says_how_far_back_it_reaches(tiny_engine):
    engine = tiny_engine(num_gpu_blocks=24)
    hist = RunHistory(keyframe_every=5, budget_bytes=60_000)
    truth = {}
    for rec in busy_run(engine, 200, seed=1):
        hist.record(rec.snapshot, rec.seconds, None, rec.events)
        truth[rec.step] = rec.snapshot
        assert hist.nbytes <= 60_000 or len(hist._keyframes) < 2
    first, last = hist.reach
    assert first > 0 and last == max(truth) and hist.dropped_steps == first
    assert hist.at(first - 1) is None
    for step in range(first, last + 1):
        assert_same(hist.at(step), truth[step])
    assert len(hist.series["free"]) == len(hist.steps)


def test_the_cache_index_follows_evictions_and_a_reset(tiny_engine):
    """Keyframes keep an index into one log of stored blocks: every step still rebuilds its maps exactly."""
    engine = tiny_engine(num_gpu_blocks=12)
    src = LiveSource(engine)
    hist = RunHistory(keyframe_every=4)
    truth = {}

    def record(rec):
        hist.record(rec.snapshot, rec.seconds, None, rec.events)
        truth[rec.step] = rec.snapshot

    record(src.current())
    for round_ in range(3):
        for j in range(4):  # more distinct prompts than the pool holds: cached blocks are evicted
            src.inject([10 * round_ + j + 1] * 13, SamplingParams(max_tokens=3, temperature=0.0))
            while src.has_work():
                record(src.step())
        src.reset_prefix_cache()
        record(src.current())
    assert engine.pool.num_evictions > 0
    for step, snap in truth.items():
        assert_same(hist.at(step), snap)
    assert len(hist._store.tokens) >= len({h for s in truth.values() for h in s.block_hashes.values()})


def test_a_digest_cannot_open_a_pool_it_has_no_arrays_for():
    """A pool's first record must be whole (the reader always decodes the first after a load so):
    a digest first is refused with one line, and the history is left empty."""
    import pytest

    from engine.inspect.snapshot import StepDigest

    hist = RunHistory()
    digest = StepDigest(1, 16, 8, (), {}, (8, 0, 0, 0, 0, 0))
    with pytest.raises(ValueError, match="first record must carry its whole snapshot"):
        hist.record(digest, 0.0)
    assert hist.steps == [] and hist.latest is None and hist.at(1) is None
