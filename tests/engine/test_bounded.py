"""A long run keeps the engine's own containers bounded: the last 64 finished requests, plus counters."""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

from engine import SamplingParams
from engine.request_groups import MAX_FINISHED

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from common import install_fake_runner  # noqa: E402


def containers(engine) -> dict[str, int]:
    g, kv, pool = engine.request_groups, engine.kv, engine.pool
    return {
        "requests": len(g.requests),
        "groups": len(g.groups),
        "beam_groups": len(g.beam_groups),
        "finished_log": len(g.finished_log),
        "ended": len(g._ended),
        "maybe_ended": len(g._maybe_ended),
        "created": len(g.created),
        "req_to_blocks": len(kv.req_to_blocks),
        "req_to_block_ids": len(kv.req_to_block_ids),
        "num_cached_blocks": len(kv.num_cached_blocks),
        "tentative": len(pool.tentative),
        "events": len(engine.ledger.events),
        "cached": len(pool.cached),
        "waiting": len(engine.scheduler.waiting),
        "running": len(engine.scheduler.running),
        "swapped": len(engine.scheduler.swapped),
        "cpu_owner": len(kv.cpu_pool.owner),
        "reported_problems": len(engine.reported_problems),
    }


def test_100k_finished_requests_keep_every_container_bounded(tiny_engine):
    engine = tiny_engine(block_size=4, num_gpu_blocks=512, max_num_seqs=256, max_num_batched_tokens=4096)
    install_fake_runner(engine)  # the scheduler, block pool and request bookkeeping run for real
    rng = random.Random(0)
    total, added, aborted, finished = 100_000, 0, 0, 0
    peak: dict[str, int] = {}
    t0 = time.perf_counter()
    while added < total or engine.has_unfinished():
        for _ in range(min(250, total - added)):
            # Some prompts fill blocks, so hashing, caching and eviction run too.
            prompt = [rng.randrange(1, 256) for _ in range(rng.choice((1, 2, 9)))]
            rid = engine.add_request(prompt, SamplingParams(max_tokens=rng.choice((1, 1, 2)), temperature=0.0))
            added += 1
            if rng.random() < 0.01:
                aborted += engine.abort(rid)
        finished += len(engine.step().finished)
        live = len(engine.requests)
        for k, v in containers(engine).items():
            peak[k] = max(peak.get(k, 0), v - (live if k in ("groups", "requests", "waiting") else 0))
    seconds = time.perf_counter() - t0
    assert finished + aborted == total
    assert engine.metrics()["num_requests_finished"] == total
    end = containers(engine)
    assert end["requests"] == end["beam_groups"] == end["req_to_blocks"] == end["num_cached_blocks"] == 0
    assert end["req_to_block_ids"] == 0
    assert end["finished_log"] == MAX_FINISHED and end["groups"] <= MAX_FINISHED
    assert peak["groups"] <= MAX_FINISHED and peak["finished_log"] <= MAX_FINISHED
    assert peak["tentative"] <= 512 and peak["events"] == 0 and peak["cached"] <= 512
    assert peak["running"] <= 256 and peak["created"] == 0 and peak["reported_problems"] == 0
    assert len(engine.snapshot().requests) == MAX_FINISHED
    assert seconds < 120  # a sanity bound, not a speed test: the loop must not grow with the history


def test_samples_forks_and_beams_leave_when_they_end(tiny_engine):
    engine = tiny_engine(block_size=4, num_gpu_blocks=128)
    rng = random.Random(1)
    seen_groups = set()
    for i in range(150):
        kind = i % 3
        params = (
            SamplingParams(n=2, max_tokens=3, temperature=1.0, seed=i)
            if kind == 0
            else SamplingParams(use_beam_search=True, beam_width=2, max_tokens=3, ignore_eos=True)
            if kind == 1
            else SamplingParams(max_tokens=4, temperature=0.0)
        )
        seen_groups.add(engine.add_request([rng.randrange(1, 256) for _ in range(5)], params))
        engine.step()
        running = [
            r
            for r in engine.scheduler.running
            if r.num_computed_tokens >= r.num_prompt_tokens and r.group_id not in engine.beam_groups
        ]
        if running and rng.random() < 0.3:
            seen_groups.add(engine.fork(running[0].request_id))
        assert len(engine.groups) <= MAX_FINISHED + len(engine.requests)
    while engine.has_unfinished():
        engine.step()
    assert len(seen_groups) > MAX_FINISHED + 20
    assert not engine.beam_groups and not engine.requests
    assert len(engine.groups) == MAX_FINISHED and len(engine.finished_log) == MAX_FINISHED
    assert engine.pool.num_free_blocks == engine.pool.num_blocks and engine.audit().ok
