"""Beam search on fork + copy-on-write, against transformers' own beam search."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.inspect.events import BlockCopied, RequestFinished, RequestForked
from engine.inspect.replay import PoolReplayer

PROMPTS = [[5, 9, 17, 33, 2, 8, 100], [1, 2, 3, 4, 5, 6, 7, 8], [200, 13]]


def hf_beams(model, prompt, k, max_new, eos=None, early_stopping=False):
    ids = torch.tensor([prompt])
    kw = dict(eos_token_id=eos, pad_token_id=0) if eos is not None else {}
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new,
        num_beams=k,
        num_return_sequences=k,
        do_sample=False,
        early_stopping=early_stopping,
        **kw,
    )
    beams = []
    for row in out[:, len(prompt) :].tolist():
        if eos is not None and eos in row:  # transformers pads a finished beam with more EOS
            row = row[: row.index(eos) + 1]
        beams.append(row)
    return beams


def run_checked(engine, prompt, params):
    """Step to the end, auditing ref counts after every step; return (outputs, events)."""
    rid = engine.add_request(prompt, params)
    events, out = [], None
    while engine.has_unfinished():
        step = engine.step()
        events += step.events
        assert engine.audit().ok, engine.audit()
        out = next((o for o in step.outputs if o.request_id == rid), out)
    assert out is not None and out.finished
    return out, events


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_beams_equal_transformers(tiny_engine, tiny_hf, k, prompt):
    engine = tiny_engine(block_size=4, num_gpu_blocks=64)
    out, events = run_checked(
        engine, prompt, SamplingParams(use_beam_search=True, beam_width=k, n=k, max_tokens=8, ignore_eos=True)
    )
    assert [c.token_ids for c in out.outputs] == hf_beams(tiny_hf, prompt, k, 8)
    scores = [c.cumulative_logprob for c in out.outputs]
    assert scores == sorted(scores, reverse=True)
    if k > 1:
        assert any(isinstance(e, RequestForked) for e in events)
        assert any(isinstance(e, BlockCopied) for e in events)  # beams diverge inside shared blocks
        assert any(isinstance(e, RequestFinished) and e.reason == "pruned" for e in events)
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    rp = PoolReplayer(engine.pool.num_blocks).apply_all(events)
    assert list(rp.free_queue) == engine.pool.free_queue.ids()


@pytest.mark.parametrize("early_stopping", [False, True])
@pytest.mark.parametrize("eos", [9, 103, 130, 255])
def test_beams_with_a_stop_token_equal_transformers(tiny_engine, tiny_hf, eos, early_stopping):
    engine = tiny_engine(block_size=4, num_gpu_blocks=64)
    prompt = PROMPTS[0]
    out, _ = run_checked(
        engine,
        prompt,
        SamplingParams(
            use_beam_search=True, beam_width=3, n=3, max_tokens=10, stop_token_ids=[eos], early_stopping=early_stopping
        ),
    )
    assert [c.token_ids for c in out.outputs] == hf_beams(tiny_hf, prompt, 3, 10, eos, early_stopping)
    for c in out.outputs:
        assert c.finish_reason == ("stop" if c.token_ids[-1] == eos else "length")
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_pruned_beams_free_their_own_blocks(tiny_engine):
    engine = tiny_engine(block_size=2, num_gpu_blocks=64)
    rid = engine.add_request(
        PROMPTS[0], SamplingParams(use_beam_search=True, beam_width=4, max_tokens=12, ignore_eos=True)
    )
    seen_prune = False
    while engine.has_unfinished():
        step = engine.step()
        pruned = [e.request_id for e in step.events if isinstance(e, RequestFinished) and e.reason == "pruned"]
        for p in pruned:
            seen_prune = True
            assert p not in engine.kv.req_to_blocks  # its table is gone ...
        # ... and every block's ref count is the number of live beams that map it.
        holders: dict[int, int] = {}
        for table in engine.kv.req_to_blocks.values():
            for b in table:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        assert all(engine.pool.blocks[b].ref_cnt == n for b, n in holders.items())
        assert engine.pool.num_free_blocks == engine.pool.num_blocks - len(holders)
        live = [r for r in engine.groups[rid] if not r.is_finished]
        assert len(live) <= 4
    assert seen_prune
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_beams_survive_preemption(tiny_engine, tiny_hf, mode):
    engine = tiny_engine(block_size=2, num_gpu_blocks=22, preemption_mode=mode, num_cpu_blocks=64)
    llm = LLM.from_engine(engine)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    beam = SamplingParams(use_beam_search=True, beam_width=3, n=3, max_tokens=8, ignore_eos=True)
    outs = llm.generate([[7] * 9, PROMPTS[0], [11] * 7, PROMPTS[1]], [greedy, beam, greedy, beam])
    assert engine.metrics()["num_preemptions"] > 0
    assert [c.token_ids for c in outs[1].outputs] == hf_beams(tiny_hf, PROMPTS[0], 3, 8)
    assert [c.token_ids for c in outs[3].outputs] == hf_beams(tiny_hf, PROMPTS[1], 3, 8)
    assert engine.audit().ok
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    assert engine.kv.cpu_pool.num_free_blocks == engine.kv.cpu_pool.num_blocks


def test_abort_a_beam_search_frees_every_beam(tiny_engine):
    engine = tiny_engine(block_size=4, num_gpu_blocks=64)
    rid = engine.add_request(
        PROMPTS[0], SamplingParams(use_beam_search=True, beam_width=3, max_tokens=20, ignore_eos=True)
    )
    for _ in range(4):
        engine.step()
    beams = [r.request_id for r in engine.groups[rid] if not r.is_finished]
    assert len(beams) == 3
    assert engine.abort(beams[-1])  # one beam ends the whole search
    assert not engine.has_unfinished() and engine.audit().ok
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_beam_search_bad_input(tiny_engine):
    with pytest.raises(ValueError, match="at most beam_width"):
        SamplingParams(use_beam_search=True, beam_width=2, n=3)
    with pytest.raises(ValueError, match="beam_width"):
        SamplingParams(use_beam_search=True, beam_width=0)
    engine = tiny_engine(block_size=4, num_gpu_blocks=8)
    with pytest.raises(ValueError, match="in 4 beams"):
        engine.add_request(PROMPTS[0], SamplingParams(use_beam_search=True, beam_width=4, max_tokens=16))
    rid = engine.add_request(
        PROMPTS[0], SamplingParams(use_beam_search=True, beam_width=2, max_tokens=4, ignore_eos=True)
    )
    engine.step()
    engine.step()
    with pytest.raises(ValueError, match="is a beam"):
        engine.fork(rid)
