"""Quantized KV caches: bytes, round trips, the Triton kernels against the torch path, the engine."""

from __future__ import annotations

import copy

import pytest
import torch

from engine import LLM, LLMEngine, SamplingParams
from engine.runner.attention import torch_ref, triton_paged
from engine.runner.kv_quant import QuantizedKV, part_formats, token_bytes
from tests.conftest import hf_greedy
from tests.engine.runner.test_triton_paged import DEVICE, SEQS, make_meta

FORMATS = ["fp8", "int8", "int4"]


def pools(kv_cache_dtype: str, nb: int, bs: int, kvh: int, d: int, dtype=torch.float32):
    fk, fv = part_formats(kv_cache_dtype)
    scale = torch.full((kvh,), 0.05)
    return tuple(QuantizedKV(f, nb, bs, kvh, d, dtype, DEVICE, head_scale=scale) for f in (fk, fv))


@pytest.mark.parametrize("fmt,bound", [("int8", 1 / 254), ("int4", 1 / 14), ("fp8", 1 / 16)])
def test_round_trip_error_is_within_the_format(fmt, bound):
    torch.manual_seed(0)
    cache = QuantizedKV(fmt, 4, 8, 2, 64, torch.float32, DEVICE, head_scale=torch.full((2,), 0.05))
    x = torch.randn(32, 2, 64, device=DEVICE) * torch.tensor([0.5, 3.0], device=DEVICE)[None, :, None]
    cache.store(torch.arange(32, device=DEVICE), x)
    back = cache[torch.arange(4, device=DEVICE)].flatten(0, 1)
    err = (back - x).abs()
    if fmt == "fp8":  # relative to each value: 3 mantissa bits (values far above the fp8 underflow here)
        assert (err <= bound * x.abs() + 0.05 * 2**-9).all()
    else:  # relative to the token's largest value in that head
        assert (err <= bound * x.abs().amax(-1, keepdim=True) * 1.001 + 1e-6).all()


def test_bytes_per_token_and_pool_capacity(tiny_hf):
    assert token_bytes("none", 8, 128, 2) == 2048
    assert token_bytes("fp8", 8, 128, 2) == 1024  # exactly half of a 16-bit cache
    assert token_bytes("int8", 8, 128, 2) == 8 * 130  # + an fp16 scale per token and head
    assert token_bytes("int4", 8, 128, 2) == 8 * 66
    budget = 1 << 20
    blocks = {
        dt: LLMEngine.from_hf_model(
            tiny_hf, None, kv_cache_memory_bytes=budget, block_size=4, kv_cache_dtype=dt
        ).pool.num_blocks
        for dt in ["auto"] + FORMATS
    }
    per_token = {"auto": 2 * 2 * 16 * 4, "fp8": 2 * 2 * 16, "int8": 2 * 2 * 18, "int4": 2 * (18 + 10)}
    for dt, n in blocks.items():  # 2 layers x (K + V) per token, 4 tokens a block
        assert n == budget // (2 * per_token[dt] * 4), dt
    assert blocks["fp8"] == 4 * blocks["auto"]  # 4x against this fp32 model, 2x against a 16-bit one


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_triton_store_writes_the_same_bytes_as_torch(kv_cache_dtype):
    torch.manual_seed(1)
    bs, kvh, d = 8, 4, 64
    meta = make_meta([(0, 13), (5, 1), (3, 9)], bs, 16)
    t = meta.query_start_loc[-1]
    k = torch.randn(t, kvh, d, device=DEVICE) * 2
    v = torch.randn(t, kvh, d, device=DEVICE)
    ref, tri = pools(kv_cache_dtype, 16, bs, kvh, d), pools(kv_cache_dtype, 16, bs, kvh, d)
    torch_ref.store_kv(k, v, *ref, meta.slot_mapping)
    triton_paged.store_kv(k, v, *tri, meta.slot_mapping)
    for a, b in zip(ref, tri):
        assert torch.equal(a._raw(), b._raw())
        if a.fmt != "fp8":
            assert torch.equal(a.scale, b.scale)


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_attention_reads_quantized_pools_like_torch(kv_cache_dtype, dtype):
    torch.manual_seed(2)
    bs, heads, kvh, d = 16, 8, 2, 64
    meta = make_meta(SEQS, bs, 64)
    t = meta.query_start_loc[-1]
    kc, vc = pools(kv_cache_dtype, 64, bs, kvh, d, dtype)
    everything = torch.arange(64 * bs, device=DEVICE)
    kc.store(everything, torch.randn(64 * bs, kvh, d, device=DEVICE))
    vc.store(everything, torch.randn(64 * bs, kvh, d, device=DEVICE))
    q = torch.randn(t, heads, d, device=DEVICE).to(dtype)
    ref = torch_ref.paged_attention(q.float(), *pools_as(kc, vc, torch.float32), meta, d**-0.5)
    out = triton_paged.paged_attention(q, kc, vc, meta, d**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 4e-3
    assert (out.float() - ref).abs().max().item() < tol


def pools_as(kc: QuantizedKV, vc: QuantizedKV, dtype) -> tuple[QuantizedKV, QuantizedKV]:
    out = []
    for c in (kc, vc):
        c2 = copy.copy(c)
        c2.out_dtype = dtype
        out.append(c2)
    return tuple(out)


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_engine_backends_agree_and_pressure_changes_nothing(tiny_hf, kv_cache_dtype):
    """Same tokens from the torch and Triton paths, and with CoW (n = 2) and swap preemption."""
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [list(range(30, 60)) + [1, 2], list(range(30, 60)) + [3], [9, 8, 7, 6, 5]]
    outs = {}
    for backend in ("torch", "triton"):
        engine = LLMEngine.from_hf_model(
            tiny_hf,
            None,
            name="tiny",
            num_gpu_blocks=64,
            block_size=4,
            kv_cache_dtype=kv_cache_dtype,
            attention_backend=backend,
        )
        outs[backend] = [o.outputs[0].token_ids for o in LLM.from_engine(engine).generate(prompts, params)]
    assert outs["torch"] == outs["triton"]
    tight = LLMEngine.from_hf_model(
        tiny_hf,
        None,
        name="tiny",
        num_gpu_blocks=16,
        block_size=4,
        kv_cache_dtype=kv_cache_dtype,
        preemption_mode="swap",
        num_cpu_blocks=64,
    )
    twin = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, n=2)
    res = LLM.from_engine(tight).generate(prompts, twin)
    assert tight.metrics()["swap_outs"] > 0 and tight.metrics()["cow_copies"] > 0
    assert [[c.token_ids for c in o.outputs] for o in res] == [[t, t] for t in outs["torch"]]
    assert tight.pool.num_free_blocks == tight.pool.num_blocks


def test_int8_stays_close_to_the_unquantized_cache(tiny_hf):
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 17, 33, 2, 8, 100] * 3, [1, 2, 3], list(range(40, 90))]
    engine = LLMEngine.from_hf_model(
        tiny_hf, None, name="tiny", num_gpu_blocks=128, block_size=4, kv_cache_dtype="int8"
    )
    got = [o.outputs[0].token_ids for o in LLM.from_engine(engine).generate(prompts, params)]
    ref = [hf_greedy(tiny_hf, p, 16) for p in prompts]
    agree = sum(a == b for g, r in zip(got, ref) for a, b in zip(g, r))
    assert agree >= 0.9 * 16 * len(prompts)  # drift is measured properly in bench/kv_quant.py


def test_bad_kv_cache_dtype_is_refused(tiny_hf):
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        LLMEngine.from_hf_model(tiny_hf, None, kv_cache_dtype="int2")
