"""The engine with the fused kernels (Triton backend, ``fuse_ops``) against PyTorch's ops and transformers.

Under Triton's interpreter on the CPU, as on a card: token-identical greedy output in fp32, through
prefix hits, chunked prefill, decode graphs' buffers (emulated), and every quantized KV format.
"""

from __future__ import annotations

import copy

import pytest
import torch

from engine import LLM, LLMEngine, SamplingParams
from engine.runner.cuda_graphs import DecodeGraphs
from tests.conftest import hf_greedy

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # on a card: compiled, graphs captured
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SHARED = list(range(30, 60))
PROMPTS = [SHARED + [1, 2, 3], SHARED + [4], list(range(100, 137)), [7]]


def on_device(tiny_hf):
    return copy.deepcopy(tiny_hf).to(DEVICE)


def run(model, **kw) -> tuple[list[list[int]], LLMEngine]:
    kw.setdefault("num_gpu_blocks", 64)
    kw.setdefault("block_size", 8)
    engine = LLMEngine.from_hf_model(on_device(model), None, name="tiny-llama", max_num_batched_tokens=24, **kw)
    return [r.outputs[0].token_ids for r in LLM.from_engine(engine).generate(PROMPTS, PARAMS)], engine


def emulated_decode_graphs(engine: LLMEngine) -> None:
    """The decode graphs' buffers on the CPU (emulated: the same buffers, padding and one copy a step), with the
    fused kernels, for up to 5 sequences."""
    r = engine.runner
    r.decode_graphs = DecodeGraphs(
        r.model,
        r.kv_caches,
        r.attention,
        r.store,
        r.device,
        5,
        -(-engine.max_model_len // 4),
        4,
        emulate=True,
        ops=r.ops,
    )


def test_fused_kernels_equal_pytorch_ops_and_transformers(tiny_hf):
    fused, engine = run(tiny_hf, attention_backend="triton")
    assert engine.runner.ops is not None  # the fused path really ran
    unfused, other = run(tiny_hf, attention_backend="triton", fuse_ops=False)
    assert other.runner.ops is None
    assert fused == unfused == [hf_greedy(tiny_hf, p, 8) for p in PROMPTS]
    assert engine.metrics()["prefix_cache_hits"] > 0


def test_fused_kernels_through_the_decode_graphs_buffers(tiny_hf):
    engine = LLMEngine.from_hf_model(
        on_device(tiny_hf),
        None,
        name="tiny-llama",
        block_size=4,
        num_gpu_blocks=64,
        max_num_seqs=5,
        attention_backend="triton",
    )
    emulated_decode_graphs(engine)
    out = LLM.from_engine(engine).generate(PROMPTS[:3], PARAMS)
    assert engine.runner.decode_graphs.num_replays >= 7
    assert [o.outputs[0].token_ids for o in out] == [hf_greedy(tiny_hf, p, 8) for p in PROMPTS[:3]]


@pytest.mark.parametrize("kv", ["fp8", "int8", "int4"])
def test_fused_store_writes_the_same_quantized_cache_as_the_unfused_store(tiny_hf, kv):
    """Quantized pools: the fused rotary+store quantizes by the store kernel's one rule, so both paths give
    the same tokens and the same cache bytes."""
    fused, a = run(tiny_hf, attention_backend="triton", kv_cache_dtype=kv)
    unfused, b = run(tiny_hf, attention_backend="triton", kv_cache_dtype=kv, fuse_ops=False)
    assert fused == unfused
    for (ka, va), (kb, vb) in zip(a.runner.kv_caches, b.runner.kv_caches):
        for x, y in ((ka, kb), (va, vb)):
            assert torch.equal(x.data.view(torch.uint8), y.data.view(torch.uint8))
            assert torch.equal(x.scale, y.scale)


def test_dynamic_rotary_falls_back_to_pytorch_ops(tiny_hf):
    model = on_device(tiny_hf)
    model.config.rope_scaling = {"rope_type": "dynamic", "factor": 2.0}
    engine = LLMEngine.from_hf_model(
        model, None, name="tiny-llama", block_size=4, num_gpu_blocks=64, attention_backend="triton"
    )
    assert engine.runner.ops is None


def _trace(engine, steps: int = 60) -> list:
    """Every step's events and snapshot (pool arrays, requests' tables and tokens), as plain values."""
    prompts = [SHARED + [1, 2, 3], SHARED + [4], list(range(100, 137)), [7], SHARED + [9, 9]]
    params = [SamplingParams(max_tokens=6 + i, temperature=0.0, ignore_eos=True) for i in range(len(prompts))]
    for p, sp in zip(prompts, params):
        engine.add_request(p, sp)
    out = []
    while engine.has_unfinished() and len(out) < steps:
        res = engine.step()
        snap = engine.snapshot()
        out.append(
            (
                res.num_scheduled_tokens,
                [repr(e) for e in res.events],
                snap.state.tolist(),
                snap.ref_cnt.tolist(),
                [(r.request_id, r.status, r.block_ids, r.token_ids, r.num_computed_tokens) for r in snap.requests],
            )
        )
    return out


def test_the_inspector_sees_the_same_run_with_decode_graphs_and_without(tiny_hf):
    """The decode graphs' path (emulated here: the same buffers, padding and one copy a step) changes nothing the
    inspector shows: every step's events and snapshot are equal with it and without, and so are the tokens."""
    runs = []
    for graphs in (False, True):
        engine = LLMEngine.from_hf_model(
            on_device(tiny_hf),
            None,
            name="tiny-llama",
            block_size=4,
            num_gpu_blocks=40,
            max_num_seqs=5,
            max_num_batched_tokens=24,
            attention_backend="triton",
            enforce_eager=True,
        )
        if graphs:
            emulated_decode_graphs(engine)
        runs.append(_trace(engine))
        if graphs:
            assert engine.runner.decode_graphs.num_replays >= 5  # the decode-only steps
    assert len(runs[0]) > 10 and runs[0] == runs[1]
