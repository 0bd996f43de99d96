"""Sampling controls: seeds, top-k/top-p, stop tokens, stop strings, eos, max_tokens."""

from __future__ import annotations

import torch

from engine import LLM, SamplingParams
from engine.runner.sampler import sample
from tests.conftest import hf_greedy


def test_seeded_sampling_is_reproducible_and_differs_from_greedy(tiny_engine):
    llm = LLM.from_engine(tiny_engine(num_gpu_blocks=256))
    p = SamplingParams(max_tokens=16, temperature=1.5, seed=42, ignore_eos=True)
    a = llm.generate([[1, 2, 3]] * 3, p)
    b = llm.generate([[1, 2, 3]], p)[0]
    assert a[0].outputs[0].token_ids == a[1].outputs[0].token_ids == b.outputs[0].token_ids
    other = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=16, temperature=1.5, seed=7, ignore_eos=True))[0]
    assert other.outputs[0].token_ids != b.outputs[0].token_ids


def test_top_k_one_is_greedy(tiny_engine, tiny_hf):
    llm = LLM.from_engine(tiny_engine())
    out = llm.generate([[4, 5, 6]], SamplingParams(max_tokens=8, temperature=0.8, top_k=1, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == hf_greedy(tiny_hf, [4, 5, 6], 8)


def test_top_p_keeps_the_nucleus():
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0]])
    probs = torch.softmax(logits[0], 0)
    assert probs[0] < 0.9 < probs[0] + probs[1]
    gen = torch.Generator().manual_seed(0)
    seen = {sample(logits, [SamplingParams(temperature=1.0, top_p=0.9)], [gen])[0] for _ in range(200)}
    assert seen == {0, 1}
    seen_k = {sample(logits, [SamplingParams(temperature=1.0, top_k=1)], [gen])[0] for _ in range(50)}
    assert seen_k == {0}


def test_stop_token_ids_eos_and_max_tokens(tiny_engine, tiny_hf):
    llm = LLM.from_engine(tiny_engine())
    ref = hf_greedy(tiny_hf, [9, 8, 7], 10)
    stop_at = ref[4]
    first = ref.index(stop_at)
    out = llm.generate([[9, 8, 7]], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_at]))[0]
    assert out.outputs[0].token_ids == ref[: first + 1] and out.outputs[0].finish_reason == "stop"
    out = llm.generate([[9, 8, 7]], SamplingParams(max_tokens=5, temperature=0))[0]
    assert out.outputs[0].token_ids == ref[:5] and out.outputs[0].finish_reason == "length"
    engine = llm.llm_engine
    engine.eos_token_ids = frozenset({stop_at})
    rid = engine.add_request([9, 8, 7], SamplingParams(max_tokens=10, temperature=0))
    assert engine.requests[rid].eos_token_ids == {stop_at}
    ignoring = engine.add_request([9, 8, 7], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    done = {}
    while engine.has_unfinished():
        for o in engine.step().finished:
            done[o.request_id] = o
    assert done[rid].outputs[0].token_ids == ref[: first + 1]
    assert done[ignoring].outputs[0].token_ids == ref
