"""Parallel sampling with copy-on-write, on-demand forks, swap preemption, and deliberate faults."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.inspect.events import BlockCopied, RequestForked, RequestPreempted, SwappedIn, SwappedOut
from engine.inspect.replay import PoolReplayer
from tests.conftest import TINY_VOCAB, hf_greedy


def drain(engine):
    events = []
    while engine.has_unfinished():
        events += engine.step().events
        assert engine.audit().ok
    return events


@pytest.mark.parametrize("prompt_len", [8, 10, 13])
def test_parallel_sampling_shares_the_prompt_and_copies_on_write(tiny_engine, tiny_hf, prompt_len):
    bs, k = 4, 3
    engine = tiny_engine(block_size=bs, num_gpu_blocks=64)
    prompt = list(range(1, prompt_len + 1))
    rid = engine.add_request(prompt, SamplingParams(n=k, max_tokens=6, temperature=0.0, ignore_eos=True))
    first = engine.step()  # the whole prefill, then the fork
    forks = [e for e in first.events if isinstance(e, RequestForked)]
    assert len(forks) == k - 1
    table = engine.kv.get_block_ids(rid)
    assert len(table) == -(-prompt_len // bs)
    for b in table:
        assert engine.pool.blocks[b].ref_cnt == k
    second = engine.step()  # every sample writes its first generated token
    copies = [e for e in second.events if isinstance(e, BlockCopied)]
    partial = prompt_len % bs != 0
    # The last writer into the shared partial block owns it alone by then: no copy for it.
    assert len(copies) == (k - 1 if partial else 0)
    if partial:
        assert {c.src_block_id for c in copies} == {table[-1]}
        assert all(c.num_slots == prompt_len % bs for c in copies)
        assert engine.pool.blocks[table[-1]].ref_cnt == 1
    for b in table[: prompt_len // bs]:
        assert engine.pool.blocks[b].ref_cnt == k  # full prompt blocks stay shared
    events = first.events + second.events + drain(engine)
    outs = engine.finished_log
    ref = hf_greedy(tiny_hf, prompt, 6)
    group = [r for r in outs if r.group_id == rid]
    assert len(group) == k and all(r.output_token_ids == ref for r in group)
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    rp = PoolReplayer(engine.pool.num_blocks).apply_all(events)
    assert list(rp.free_queue) == engine.pool.free_queue.ids()


def test_n_samples_through_generate(tiny_engine):
    llm = LLM.from_engine(tiny_engine(num_gpu_blocks=128))
    out = llm.generate([[3, 1, 4, 1, 5]], SamplingParams(n=4, max_tokens=10, temperature=1.0, seed=9, ignore_eos=True))[
        0
    ]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    samples = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(samples)) > 1 and all(len(s) == 10 for s in samples)
    again = llm.generate(
        [[3, 1, 4, 1, 5]], SamplingParams(n=4, max_tokens=10, temperature=1.0, seed=9, ignore_eos=True)
    )[0]
    assert [tuple(c.token_ids) for c in again.outputs] == samples
    assert llm.llm_engine.metrics()["cow_copies"] > 0


def test_fork_on_demand(tiny_engine, tiny_hf):
    engine = tiny_engine(block_size=4, num_gpu_blocks=64)
    prompt = [7, 7, 8, 9, 10, 11]
    rid = engine.add_request(prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    engine.step()
    engine.step()
    child = engine.fork(rid)
    assert engine.kv.get_block_ids(child) == engine.kv.get_block_ids(rid)
    assert all(engine.pool.blocks[b].ref_cnt == 2 for b in engine.kv.get_block_ids(rid))
    with pytest.raises(ValueError, match="not running"):
        engine.fork("nope")
    events = drain(engine)
    assert any(isinstance(e, BlockCopied) for e in events)
    done = {r.request_id: r for r in engine.finished_log}
    ref = hf_greedy(tiny_hf, prompt, 10)
    assert done[rid].output_token_ids == ref and done[child].output_token_ids == ref
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def pressure_prompts(seed=3, n=8):
    rng = random.Random(seed)
    return [[rng.randrange(TINY_VOCAB) for _ in range(rng.randrange(5, 30))] for _ in range(n)]


@pytest.mark.parametrize("caching", [True, False])
def test_swap_preemption_keeps_outputs_identical(tiny_engine, tiny_hf, caching):
    prompts = pressure_prompts()
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine = tiny_engine(
        block_size=4, num_gpu_blocks=16, preemption_mode="swap", num_cpu_blocks=64, enable_prefix_caching=caching
    )
    outs = LLM.from_engine(engine).generate(prompts, params)
    m = engine.metrics()
    assert m["swap_outs"] > 0 and m["swap_ins"] == m["swap_outs"]
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(tiny_hf, p, 24)
    assert engine.pool.num_free_blocks == 16 and m["num_free_cpu_blocks"] == 64
    assert engine.audit().ok


def test_full_cpu_pool_falls_back_to_recompute_and_says_so(tiny_engine, tiny_hf):
    prompts = pressure_prompts(seed=4)
    engine = tiny_engine(block_size=4, num_gpu_blocks=16, preemption_mode="swap", num_cpu_blocks=3)
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    events = drain(engine)
    pre = [e for e in events if isinstance(e, RequestPreempted)]
    assert any(e.mode == "recompute" and "CPU swap pool is full" in e.reason for e in pre)
    assert any(isinstance(e, SwappedOut) for e in events) and any(isinstance(e, SwappedIn) for e in events)
    by_id = {r.request_id: r for r in engine.finished_log}
    for i, p in enumerate(prompts):
        assert by_id[str(i)].output_token_ids == hf_greedy(tiny_hf, p, 24)
    rp = PoolReplayer(16).apply_all(events)
    assert rp.ref_cnt.tolist() == [0] * 16 and list(rp.free_queue) == engine.pool.free_queue.ids()


def test_snapshot_shows_the_swapped_request_in_the_cpu_pool(tiny_engine):
    engine = tiny_engine(block_size=4, num_gpu_blocks=16, preemption_mode="swap", num_cpu_blocks=32)
    for p in pressure_prompts(seed=5):
        engine.add_request(p, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    seen = False
    while engine.has_unfinished():
        engine.step()
        snap = engine.snapshot()
        swapped = [r for r in snap.requests if r.status == "SWAPPED"]
        for r in swapped:
            seen = True
            assert r.block_ids == () and r.cpu_block_ids
            assert (snap.cpu_state[list(r.cpu_block_ids)] == 4).all()
            assert (snap.cpu_owner[list(r.cpu_block_ids)] == r.index).all()
    assert seen


@pytest.mark.parametrize(
    "fault,problem", [("abort-leak", "leaked"), ("cow-leak", "leaked"), ("double-free", "use_after_free")]
)
def test_each_fault_is_found_by_audit(tiny_engine, fault, problem):
    engine = tiny_engine(block_size=4, num_gpu_blocks=64, fault=fault)
    shared = list(range(1, 11))  # 2 full blocks + a partial one; b's prompt ends mid-block too
    a = engine.add_request(shared + [20], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.add_request(shared + [21, 22, 23], SamplingParams(n=2, max_tokens=8, temperature=0.0, ignore_eos=True))
    engine.step()
    engine.step()
    if fault == "abort-leak":
        victim = set(engine.kv.get_block_ids(a))
        engine.abort(a)
    found = None
    for _ in range(40):
        report = engine.audit(emit_events=True)
        if not report.ok:
            found = report
            break
        if not engine.has_unfinished():
            break
        engine.step()
    assert found is not None, f"{fault} was never detected"
    kinds = {p.problem for p in found.problems}
    assert problem in kinds, str(found)
    named = [p for p in found.problems if p.problem == problem]
    assert all(p.last_owner for p in named)
    if fault == "abort-leak":  # the aborted request is named: it still holds what it never freed
        assert set(found.leaked_blocks) == victim and all(p.last_owner == a for p in named)
    if fault == "double-free":  # a finished before b: a released a shared block twice
        assert all(p.last_owner == a for p in named)
    assert any(e.kind == "leak" for e in engine.ledger.drain_events())
    assert engine.audit(emit_events=True).problems  # found again, but reported once
    assert not [e for e in engine.ledger.drain_events() if e.kind == "leak"]


def test_long_random_run_without_faults_is_clean(tiny_engine):
    rng = random.Random(11)
    engine = tiny_engine(
        block_size=4, num_gpu_blocks=24, preemption_mode="swap", num_cpu_blocks=12, max_num_batched_tokens=48
    )
    shared = [rng.randrange(TINY_VOCAB) for _ in range(9)]
    events = []
    for step in range(300):
        if rng.random() < 0.35:
            prompt = (shared if rng.random() < 0.5 else []) + [
                rng.randrange(TINY_VOCAB) for _ in range(rng.randrange(1, 14))
            ]
            engine.add_request(
                prompt,
                SamplingParams(
                    n=rng.choice([1, 1, 2, 3]),
                    max_tokens=rng.randrange(1, 14),
                    temperature=rng.choice([0.0, 1.0]),
                    ignore_eos=True,
                ),
            )
        running = [r for r in engine.scheduler.running if r.num_computed_tokens >= r.num_prompt_tokens]
        if running and rng.random() < 0.05:
            engine.fork(rng.choice(running).request_id)
        if engine.requests and rng.random() < 0.08:
            engine.abort(rng.choice(sorted(engine.requests)))
        events += engine.step().events
        assert engine.audit().ok, f"step {step}: {engine.audit()}"
    events += drain(engine)
    m = engine.metrics()
    assert m["num_preemptions"] > 0 and m["cow_copies"] > 0 and m["swap_outs"] > 0
    assert engine.pool.num_free_blocks == 24 and m["num_free_cpu_blocks"] == 12
    rp = PoolReplayer(24).apply_all(events)
    assert rp.ref_cnt.tolist() == [0] * 24 and list(rp.free_queue) == engine.pool.free_queue.ids()
