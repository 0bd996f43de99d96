"""Greedy output must equal transformers' generate, token for token, on a tiny random model."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, LLMEngine, SamplingParams
from tests.conftest import TINY_VOCAB, hf_greedy, make_tiny_hf

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def prompts_for(block_size: int, seed: int = 1) -> list[list[int]]:
    """Shorter than, equal to and longer than a block, plus two sharing a long prefix."""
    rng = random.Random(seed)
    lens = sorted({1, 2, max(block_size - 1, 1), block_size, block_size + 1, 3 * block_size + 2, 37})
    ps = [[rng.randrange(TINY_VOCAB) for _ in range(n)] for n in lens]
    shared = [rng.randrange(TINY_VOCAB) for _ in range(2 * block_size + 3)]
    ps += [shared + [rng.randrange(TINY_VOCAB) for _ in range(k)] for k in (1, 5)]
    ps.append(list(ps[-1]))  # an exact repeat: a full-prefix hit (the last token is recomputed)
    return ps


@pytest.fixture(scope="module")
def references(tiny_hf):
    cache: dict[tuple, list[int]] = {}

    def ref(prompt: list[int], n: int = GREEDY.max_tokens) -> list[int]:
        key = (tuple(prompt), n)
        if key not in cache:
            cache[key] = hf_greedy(tiny_hf, prompt, n)
        return cache[key]

    return ref


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("caching", [True, False])
def test_greedy_matches_transformers(tiny_engine, references, block_size, caching):
    engine = tiny_engine(block_size=block_size, num_gpu_blocks=4096 // block_size, enable_prefix_caching=caching)
    prompts = prompts_for(block_size)
    outs = LLM.from_engine(engine).generate(prompts, GREEDY)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == references(p), f"prompt of {len(p)} tokens"
    m = engine.metrics()
    if caching:
        assert m["prefix_cache_hits"] > 0
    else:
        assert m["prefix_cache_hits"] == 0 and m["num_cached_blocks"] == 0
    assert engine.audit().ok
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_second_round_hits_cache_and_still_matches(tiny_engine, references):
    engine = tiny_engine(block_size=4, num_gpu_blocks=512)
    llm = LLM.from_engine(engine)
    prompts = prompts_for(4, seed=7)
    llm.generate(prompts, GREEDY)
    hits_before = engine.metrics()["prefix_cache_hits"]
    outs = llm.generate(prompts, GREEDY)  # every prompt is cached now
    assert engine.metrics()["prefix_cache_hits"] > hits_before
    assert all(o.num_cached_tokens <= len(o.prompt_token_ids) - 1 for o in outs)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == references(p)


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_keeps_output_identical(tiny_engine, references, caching):
    rng = random.Random(3)
    prompts = [[rng.randrange(TINY_VOCAB) for _ in range(rng.randrange(5, 30))] for _ in range(10)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    # 16 blocks of 4 tokens: each request alone needs up to 14; ten at once cannot fit.
    engine = tiny_engine(block_size=4, num_gpu_blocks=16, enable_prefix_caching=caching)
    outs = LLM.from_engine(engine).generate(prompts, params)
    assert engine.metrics()["num_preemptions"] > 0
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == references(p, 24)
    assert engine.audit().ok and engine.pool.num_free_blocks == 16


def test_chunked_prefill_matches(tiny_engine, references):
    rng = random.Random(5)
    prompts = [[rng.randrange(TINY_VOCAB) for _ in range(n)] for n in (40, 9, 23)]
    engine = tiny_engine(block_size=4, num_gpu_blocks=256, max_num_batched_tokens=7)
    outs = LLM.from_engine(engine).generate(prompts, GREEDY)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == references(p)


def test_max_num_seqs_bounds_the_batch(tiny_engine):
    engine = tiny_engine(max_num_seqs=2)
    for i in range(5):
        engine.add_request([i + 1] * 5, GREEDY)
    engine.step()
    assert engine.metrics()["num_requests_running"] == 2
    assert engine.metrics()["num_requests_waiting"] == 3


@pytest.mark.parametrize(
    "kind,extra",
    [
        ("qwen2", {}),  # q/k/v biases
        ("mistral", {}),
        (
            "llama",
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                }
            },
        ),
        ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
        ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
        ("llama", {"num_key_value_heads": 4, "head_dim": 32}),
    ],
)
def test_architecture_variants(kind, extra):
    model = make_tiny_hf(kind, seed=11, **extra)
    engine = LLMEngine.from_hf_model(model, None, name=f"tiny-{kind}", num_gpu_blocks=128, block_size=4)
    rng = random.Random(2)
    prompts = [[rng.randrange(TINY_VOCAB) for _ in range(n)] for n in (3, 13, 30)]
    outs = LLM.from_engine(engine).generate(prompts, GREEDY)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(model, p, GREEDY.max_tokens)


def test_loads_from_a_folder_and_casts_dtype(tiny_dir, tiny_hf):
    llm = LLM(tiny_dir, num_gpu_blocks=32, block_size=4, dtype="bfloat16")
    assert llm.llm_engine.runner.dtype == torch.bfloat16
    out = llm.generate([[1, 2, 3, 4, 5]], GREEDY)[0]
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
    # fp32 from the same folder matches transformers exactly
    llm32 = LLM(tiny_dir, num_gpu_blocks=32, block_size=4)
    assert llm32.generate([[1, 2, 3, 4, 5]], GREEDY)[0].outputs[0].token_ids == hf_greedy(tiny_hf, [1, 2, 3, 4, 5], 12)


def test_pool_sized_by_bytes_and_by_cpu_default(tiny_hf):
    one = LLMEngine.from_hf_model(tiny_hf, None, num_gpu_blocks=1, block_size=4)
    block_bytes = one.runner.block_bytes
    assert block_bytes == 2 * 2 * 2 * 16 * 4 * 4  # 2 x layers x kv_heads x head_dim x fp32 x block_size
    eng = LLMEngine.from_hf_model(tiny_hf, None, kv_cache_memory_bytes=10 * block_bytes + 7, block_size=4)
    assert eng.pool.num_blocks == 10
    dflt = LLMEngine.from_hf_model(tiny_hf, None, block_size=4, max_num_seqs=3)
    assert dflt.pool.num_blocks == 3 * 512 // 4  # every sequence at full length fits in the 2 GiB default
