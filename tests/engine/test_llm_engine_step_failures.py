"""Every failure inside a step, forced: it fails that step's requests and leaves no wrong KV behind.

After each one: the audit is clean and the replayed event stream equals the live pool after
every step (``Checked``), and the greedy output of later requests equals a fresh engine's.
"""

from __future__ import annotations

import random

import pytest

from engine import SamplingParams
from engine.beam_search import BeamGroup
from engine.inspect.events import BlockUnpublished, RequestPreempted
from tests.checked import GREEDY, Boom, Checked, failing_copy, failing_execute, greedy_tokens


def fresh(tiny_engine, prompts, max_tokens):
    return greedy_tokens(tiny_engine(num_gpu_blocks=256), prompts, max_tokens)


def test_a_failed_decode_step_unpublishes_the_block_it_was_completing(tiny_engine, monkeypatch):
    engine = tiny_engine(block_size=4, num_gpu_blocks=32)
    run = Checked(engine)
    a = engine.add_request([5, 9, 13, 17, 21, 25], SamplingParams(max_tokens=10, **GREEDY))
    run.step()  # the prefill: block 0 full, block 1 holds 2 of 4 slots
    run.step()  # slot 6
    # This step writes slot 7, the last of block 1 (allocated two steps ago): it is published while
    # scheduling, and the step dies after writing noise where the KV should be.
    monkeypatch.setattr(engine.runner, "execute", failing_execute(engine.runner))
    out = run.step()
    monkeypatch.undo()
    assert out.error == "Boom: the forward died half-way"
    assert [o.request_id for o in out.outputs] == [a] and out.outputs[0].finished and out.outputs[0].error
    failed = engine.finished_log[-1]
    unpublished = [e for e in out.events if isinstance(e, BlockUnpublished)]
    assert len(unpublished) == 1 and "step 3 failed" in unpublished[0].reason
    tokens = list(failed.prompt_token_ids + failed.output_token_ids)
    assert len(tokens) == 8
    # A later request with that prefix must not get the noise as "cached" tokens.
    later = [tokens + [3, 4, 5], tokens[:4] + [7, 7, 7, 7, 7]]
    ids = [engine.add_request(p, SamplingParams(max_tokens=8, **GREEDY)) for p in later]
    run.drain()
    assert [run.tokens(i) for i in ids] == fresh(tiny_engine, later, 8)
    assert run.outputs[ids[0]].num_cached_tokens == 4  # block 0 (written by a step that succeeded) only


def test_a_failed_chunk_of_a_chunked_prefill_unpublishes_what_it_was_completing(tiny_engine, monkeypatch):
    # Chunks of 6 tokens over blocks of 4: the second chunk completes block 1 (allocated by the first).
    engine = tiny_engine(block_size=4, num_gpu_blocks=32, max_num_batched_tokens=6)
    run = Checked(engine)
    prompt = list(range(30, 50))
    a = engine.add_request(prompt, SamplingParams(max_tokens=4, **GREEDY))
    run.step()
    monkeypatch.setattr(engine.runner, "execute", failing_execute(engine.runner))
    out = run.step()
    monkeypatch.undo()
    assert out.error and out.outputs[0].request_id == a and out.outputs[0].error
    # Blocks 1 (allocated by the first chunk) and 2 (by this one) were to be completed by this chunk.
    assert sorted(e.block_id for e in out.events if isinstance(e, BlockUnpublished)) == [1, 2]
    later = [prompt + [1, 2], prompt[:9] + [60, 61]]
    ids = [engine.add_request(p, SamplingParams(max_tokens=6, **GREEDY)) for p in later]
    run.drain()
    assert [run.tokens(i) for i in ids] == fresh(tiny_engine, later, 6)
    assert run.outputs[ids[0]].num_cached_tokens == 4  # only the block the good chunk completed


def pressure(seed: int, n: int = 8) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 256) for _ in range(rng.randrange(5, 30))] for _ in range(n)]


def run_under_pressure(tiny_engine, kind: str, monkeypatch, seed: int = 3):
    engine = tiny_engine(block_size=4, num_gpu_blocks=16, preemption_mode="swap", num_cpu_blocks=64)
    state = failing_copy(engine.runner, kind)
    run = Checked(engine)
    prompts = pressure(seed)
    ids = [engine.add_request(p, SamplingParams(max_tokens=24, **GREEDY)) for p in prompts]
    run.drain()
    assert state["failed"] == 1, f"no {kind} happened"
    expected = dict(zip(ids, fresh(tiny_engine, prompts, 24)))
    failed = [i for i in ids if run.outputs[i].error]
    for i in ids:
        if i not in failed:
            assert run.tokens(i) == expected[i], f"request {i} resumed on KV its failed copy never moved"
    # Later requests over the same prefixes are served exactly.
    later = [p[:12] + [1, 2, 3] for p in prompts[:4]]
    more = [engine.add_request(p, SamplingParams(max_tokens=8, **GREEDY)) for p in later]
    run.drain()
    assert [run.tokens(i) for i in more] == fresh(tiny_engine, later, 8)
    return run, failed


def test_a_failed_swap_out_copy_recomputes_the_swapped_request(tiny_engine, monkeypatch):
    run, failed = run_under_pressure(tiny_engine, "swap_out", monkeypatch)
    requeued = [e for e in run.events if isinstance(e, RequestPreempted) and "swap-out" in e.reason]
    assert requeued and requeued[0].mode == "recompute"
    assert requeued[0].request_id not in failed  # it was not lost: it ran again from its tokens


def test_a_failed_swap_in_copy_fails_the_requests_it_was_bringing_back(tiny_engine, monkeypatch):
    run, failed = run_under_pressure(tiny_engine, "swap_in", monkeypatch)
    swapped_in = {e.request_id for e in run.events if e.kind == "swap_in"}
    assert failed and set(failed) & swapped_in


def test_a_failed_copy_on_write_fails_the_step(tiny_engine, monkeypatch):
    engine = tiny_engine(block_size=4, num_gpu_blocks=32)
    run = Checked(engine)
    state = failing_copy(engine.runner, "copy_on_write")
    prompt = list(range(1, 11))  # 2 full blocks + a shared partial one
    rid = engine.add_request(prompt, SamplingParams(n=3, max_tokens=6, **GREEDY))
    run.step()  # prefill and the fork
    out = run.step()  # the first writes into the shared partial block copy it first
    assert state["failed"] == 1 and out.error.startswith("DeviceCopyError: copy-on-write copy failed")
    assert out.outputs[0].request_id == rid and out.outputs[0].finished
    assert all(c.finish_reason == "error" for c in out.outputs[0].outputs)
    later = [prompt + [11], prompt[:8] + [40, 41]]
    ids = [engine.add_request(p, SamplingParams(max_tokens=6, **GREEDY)) for p in later]
    run.drain()
    assert [run.tokens(i) for i in ids] == fresh(tiny_engine, later, 6)


def test_a_failing_sampler_fails_the_step(tiny_engine, monkeypatch):
    engine = tiny_engine(block_size=4, num_gpu_blocks=32)
    run = Checked(engine)
    a = engine.add_request(list(range(3, 12)), SamplingParams(max_tokens=6, **GREEDY))
    b = engine.add_request(list(range(50, 55)), SamplingParams(max_tokens=6, **GREEDY))
    run.step()
    real = engine.runner.sample
    monkeypatch.setattr(engine.runner, "sample", lambda logits, reqs: (_ for _ in ()).throw(Boom("sampler")))
    out = run.step()
    assert out.error == "Boom: sampler" and {o.request_id for o in out.outputs} == {a, b}
    monkeypatch.setattr(engine.runner, "sample", real)
    later = [list(range(3, 12)) + [1], list(range(50, 60))]
    ids = [engine.add_request(p, SamplingParams(max_tokens=6, **GREEDY)) for p in later]
    run.drain()
    assert [run.tokens(i) for i in ids] == fresh(tiny_engine, later, 6)


def test_a_failure_while_spawning_the_samples_of_n_fails_the_group(tiny_engine, monkeypatch):
    engine = tiny_engine(block_size=4, num_gpu_blocks=32)
    run = Checked(engine)
    calls = []
    real = engine.kv.fork

    def fork(parent, child):
        calls.append(child.request_id)
        if len(calls) == 2:
            raise Boom("fork")
        real(parent, child)

    monkeypatch.setattr(engine.kv, "fork", fork)
    rid = engine.add_request(list(range(1, 11)), SamplingParams(n=3, max_tokens=5, **GREEDY))
    out = run.step()  # the first child took its references, the second raised
    assert out.error == "Boom: fork" and calls == [f"{rid}#1", f"{rid}#2"]
    assert out.outputs[0].request_id == rid and out.outputs[0].finished and out.outputs[0].error
    assert not engine.requests and engine.pool.num_free_blocks == engine.pool.num_blocks
    monkeypatch.undo()
    ids = [engine.add_request(list(range(1, 12)), SamplingParams(max_tokens=5, **GREEDY))]
    run.drain()
    assert [run.tokens(i) for i in ids] == fresh(tiny_engine, [list(range(1, 12))], 5)


def test_the_largest_seed_works_for_every_sample(tiny_engine):
    engine = tiny_engine(block_size=4, num_gpu_blocks=64)
    run = Checked(engine)
    params = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=2**64 - 1, ignore_eos=True)
    a, b = engine.add_request([4, 5, 6], params), engine.add_request([4, 5, 6], params)
    run.drain()
    assert not run.outputs[a].error and len(run.outputs[a].outputs) == 3
    assert [c.token_ids for c in run.outputs[a].outputs] == [c.token_ids for c in run.outputs[b].outputs]


def test_a_failing_beam_round_fails_the_whole_search(tiny_engine, monkeypatch):
    engine = tiny_engine(block_size=2, num_gpu_blocks=64)
    run = Checked(engine)
    real, rounds = BeamGroup.advance, []

    def advance(self, limit):
        rounds.append(1)
        if len(rounds) == 3:
            raise Boom("beam round")
        return real(self, limit)

    monkeypatch.setattr(BeamGroup, "advance", advance)
    rid = engine.add_request(
        [9, 8, 7, 6, 5], SamplingParams(use_beam_search=True, beam_width=3, max_tokens=8, ignore_eos=True)
    )
    other = engine.add_request([1, 2, 3], SamplingParams(max_tokens=12, **GREEDY))
    while rid not in run.outputs:
        run.step()
    assert run.outputs[rid].error == "Boom: beam round"
    assert all(c.finish_reason == "error" for c in run.outputs[rid].outputs)
    assert rid not in engine.beam_groups and not [r for r in engine.requests.values() if r.group_id == rid]
    monkeypatch.undo()
    run.drain()
    assert run.outputs[other].error is not None  # it shared the failed step ...
    later = engine.add_request([9, 8, 7, 6, 5, 4], SamplingParams(max_tokens=6, **GREEDY))
    run.drain()
    assert run.tokens(later) == fresh(tiny_engine, [[9, 8, 7, 6, 5, 4]], 6)[0]  # ... and the engine serves


def test_a_stop_rule_that_raises_fails_the_step(tiny_engine):
    engine = tiny_engine(block_size=4, num_gpu_blocks=32)
    run = Checked(engine)
    params = SamplingParams(max_tokens=6, stop=["x"], **GREEDY)
    rid = engine.add_request([1, 2, 3], params)
    params.stop.append(None)  # changed after admission: the check raises inside the step
    out = run.step()
    assert out.error.startswith("TypeError") and out.outputs[0].request_id == rid and out.outputs[0].finished
    ids = [engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=6, **GREEDY))]
    run.drain()
    assert [run.tokens(i) for i in ids] == fresh(tiny_engine, [[1, 2, 3, 4]], 6)


class FlakyTokenizer:
    """Encodes characters as token ids; its decode raises once, on the call it is told."""

    eos_token_id = None
    name_or_path = "flaky"
    chat_template = None

    def __init__(self, fail_at: int) -> None:
        self.calls, self.fail_at = 0, fail_at

    def __len__(self) -> int:
        return 256

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 256 for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        self.calls += 1
        if self.calls == self.fail_at:
            raise Boom("decode")
        return "".join(chr(65 + i % 26) for i in ids)


def test_a_detokenizer_that_raises_fails_the_step(tiny_hf):
    from engine import LLMEngine

    engine = LLMEngine.from_hf_model(tiny_hf, FlakyTokenizer(fail_at=3), name="tiny", block_size=4, num_gpu_blocks=32)
    run = Checked(engine)
    rid = engine.add_request("hello", SamplingParams(max_tokens=6, **GREEDY))
    for _ in range(3):
        out = run.step()
    assert out.error == "Boom: decode" and out.outputs[0].request_id == rid and out.outputs[0].finished
    again = engine.add_request("hello", SamplingParams(max_tokens=6, **GREEDY))
    run.drain()
    assert len(run.tokens(again)) == 6 and not run.outputs[again].error


def test_a_failure_while_scheduling_frees_what_the_step_had_taken(tiny_engine, monkeypatch):
    engine = tiny_engine(block_size=4, num_gpu_blocks=32)
    run = Checked(engine)
    real, calls = engine.kv.get_computed_blocks, []

    def lookup(req):
        calls.append(req.request_id)
        if len(calls) == 2:  # the first request is admitted (blocks taken) when the second raises
            raise Boom("lookup")
        return real(req)

    monkeypatch.setattr(engine.kv, "get_computed_blocks", lookup)
    a = engine.add_request(list(range(1, 10)), SamplingParams(max_tokens=6, **GREEDY))
    b = engine.add_request(list(range(1, 7)), SamplingParams(max_tokens=6, **GREEDY))
    out = run.step()
    assert out.error == "scheduling failed: Boom: lookup"
    assert [o.request_id for o in out.outputs] == [a] and out.outputs[0].error
    run.drain()
    assert run.tokens(b) == fresh(tiny_engine, [list(range(1, 7))], 6)[0]  # it waited, then ran


def test_a_scheduling_failure_after_a_swap_out_recomputes_the_swapped_request(tiny_engine, monkeypatch):
    engine = tiny_engine(block_size=4, num_gpu_blocks=16, preemption_mode="swap", num_cpu_blocks=64)
    run = Checked(engine)
    swapped, real_swap, real_work = [], engine.kv.swap_out, engine.kv.take_device_work

    def swap_out(req):
        ok = real_swap(req)
        swapped.append(ok)
        return ok

    def device_work():
        if len(swapped) == 1 and swapped[0]:
            swapped.append("raised")
            raise Boom("late in scheduling")
        return real_work()

    monkeypatch.setattr(engine.kv, "swap_out", swap_out)
    monkeypatch.setattr(engine.kv, "take_device_work", device_work)  # the scheduler's last call of a step
    prompts = pressure(3)
    ids = [engine.add_request(p, SamplingParams(max_tokens=24, **GREEDY)) for p in prompts]
    run.drain()
    assert "raised" in swapped
    requeued = [e for e in run.events if isinstance(e, RequestPreempted) and "swap-out" in e.reason]
    assert len(requeued) == 1
    expected = dict(zip(ids, fresh(tiny_engine, prompts, 24)))
    for i in ids:
        if not run.outputs[i].error:
            assert run.tokens(i) == expected[i]
    assert not run.outputs[requeued[0].request_id].error


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_failing_device_work_call_of_any_kind_is_contained(tiny_engine, monkeypatch, mode):
    """Not a copy of ours: anything apply_device_work raises counts as a lost swap-out."""
    engine = tiny_engine(block_size=4, num_gpu_blocks=16, preemption_mode=mode, num_cpu_blocks=64)
    run = Checked(engine)
    real, n = engine.runner.apply_device_work, []

    def work(sched):
        if sched.swap_out or (mode == "recompute" and sched.preempted):
            n.append(1)
            if len(n) == 1:
                raise Boom("device")
        return real(sched)

    monkeypatch.setattr(engine.runner, "apply_device_work", work)
    prompts = pressure(5)
    ids = [engine.add_request(p, SamplingParams(max_tokens=24, **GREEDY)) for p in prompts]
    run.drain()
    assert n, "no preemption happened"
    expected = dict(zip(ids, fresh(tiny_engine, prompts, 24)))
    good = [i for i in ids if not run.outputs[i].error]
    assert good and len(good) < len(ids)
    assert all(run.tokens(i) == expected[i] for i in good)


def test_a_trace_of_failed_steps_replays_to_the_live_snapshots(tiny_hf, tmp_path, monkeypatch):
    from engine import LLMEngine
    from engine.inspect.trace import replay_trace
    from kvscope.sources.live import LiveSource
    from tests.kvscope.sources.test_scenario_traces import assert_same_snapshot

    engine = LLMEngine.from_hf_model(
        tiny_hf, None, name="tiny", block_size=4, num_gpu_blocks=16, preemption_mode="swap", num_cpu_blocks=32
    )
    failing_copy(engine.runner, "swap_out")
    session = LiveSource(engine, trace_path=str(tmp_path / "t.trace"))
    real = engine.runner.execute
    live = {}
    for p in pressure(7):
        session.inject(p, SamplingParams(max_tokens=16, **GREEDY))
    for step in range(60):
        monkeypatch.setattr(engine.runner, "execute", failing_execute(engine.runner) if step in (2, 9) else real)
        rec = session.step()
        live[rec.step] = rec.snapshot
    session.close()
    kinds = {e.kind for r in replay_trace(tmp_path / "t.trace") for e in r.events}
    assert {"unpublished", "swap_out"} <= kinds
    seen = {r.step: r.snapshot for r in replay_trace(tmp_path / "t.trace")}
    for step, snap in live.items():
        assert_same_snapshot(seen[step], snap)
