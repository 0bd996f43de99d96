"""The pool audit's rules on kvscope's own pool, each broken by hand: a leak, a use after free, a block missing
from the free queue, a block queued twice, a cycle, a wrong free count, a hash the map does not hold. The fast scan
(C loops over the blocks, what every step runs) and the block-by-block walk must report the same problems."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.inspect import audit
from engine.inspect.audit import _audit_walking, audit_pool


@pytest.fixture
def served(tiny_engine):
    """An engine that served a few requests (prefix-cached blocks on the queue) and holds two running ones."""
    engine = tiny_engine(num_gpu_blocks=48, block_size=4)
    shared = list(range(30, 50))
    LLM.from_engine(engine).generate(
        [shared + [1, 2], shared + [3]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    )
    for i in range(2):
        engine.add_request(shared + [60 + i] * 5, SamplingParams(max_tokens=50, ignore_eos=True), request_id=f"run{i}")
    for _ in range(3):
        engine.step()
    assert engine.audit().ok
    return engine


def audits(engine, monkeypatch):
    """The fast scan's report (the walk kept out of it: the queue is a plain list here), held equal to the walk's."""
    pool, tables = engine.pool, engine.kv.req_to_blocks
    walked = _audit_walking(pool, tables, engine.ledger)

    def no_walk(*_args):
        raise AssertionError("the scan fell back to the walk on an intact queue")

    with monkeypatch.context() as m:
        m.setattr(audit, "_audit_walking", no_walk)
        fast = audit_pool(pool, tables, engine.ledger)
    assert fast == walked  # the scan and the walk agree
    return fast


def kinds(report) -> list[tuple[int, str]]:
    return [(p.block_id, p.problem) for p in report.problems]


def held_block(engine, rid="run0", index=0):
    return engine.kv.req_to_blocks[rid][index]


def test_a_leak_names_the_block_and_who_held_it(served, monkeypatch):
    b = held_block(served, "run1", 1)
    b.ref_cnt += 1
    report = audits(served, monkeypatch)
    assert kinds(report) == [(b.block_id, "leaked")] and report.problems[0].last_owner


def test_a_block_freed_while_a_table_reads_it(served, monkeypatch):
    b = held_block(served, "run0", -1)  # its own last block: ref count 1
    assert b.ref_cnt == 1
    b.ref_cnt -= 1
    served.pool.free_queue.append(b)
    assert kinds(audits(served, monkeypatch)) == [(b.block_id, "use_after_free")]


def test_a_free_block_missing_from_the_queue_and_a_wrong_count(served, monkeypatch):
    q = served.pool.free_queue
    b = next(iter(q))
    q.remove(b)
    assert kinds(audits(served, monkeypatch)) == [(b.block_id, "not_in_free_queue")]
    q.num_free_blocks += 1  # the count says it is there
    assert kinds(audits(served, monkeypatch)) == [(b.block_id, "not_in_free_queue"), (-1, "double_free")]


def test_a_cycle_in_the_free_queue_ends_the_walk_with_a_double_free(served):
    q = served.pool.free_queue
    first = q.head
    q.tail.next_free = first  # a cycle: the walk must stop, not loop for ever
    report = audit_pool(served.pool, served.kv.req_to_blocks, served.ledger)
    assert kinds(report)[0] == (first.block_id, "double_free")


def test_a_hash_the_map_does_not_hold(served, monkeypatch):
    b = next(b for b in served.pool.blocks if b.block_hash is not None)
    served.pool.cached.pop(b.block_hash)
    assert (b.block_id, "hash_map") in kinds(audits(served, monkeypatch))


def test_random_damage_is_reported_alike_by_the_scan_and_the_walk(served, monkeypatch):
    """Many blocks' ref counts and hashes changed at random: the scan finds what the walk finds, in its order."""
    rng = random.Random(7)
    blocks = served.pool.blocks
    for b in rng.sample(blocks, 12):
        b.ref_cnt = max(-1, b.ref_cnt + rng.choice([-1, 1, 2]))
    for b in rng.sample([b for b in blocks if b.block_hash is not None], 2):
        served.pool.cached.pop(b.block_hash, None)
    report = audits(served, monkeypatch)
    assert len(report.problems) >= 12
