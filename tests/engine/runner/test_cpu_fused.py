"""The CPU's fused ops (``cpu_fused``, ``csrc/cpu_fused.c``) against PyTorch's ops, and the engine on them.

The engine's oracle tests (test_llm_engine_oracle.py, the SmolLM2 one) run on these kernels too, since they are the
CPU's default: greedy output equal to transformers' through prefix hits, chunked prefill and preemption.
"""

from __future__ import annotations

import copy
import logging
import os

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, LLMEngine, SamplingParams
from engine.runner import cpu_kernels
from engine.runner.cpu_fused import CpuFusedOps
from engine.runner.models.llama import signed_sin
from tests.conftest import hf_greedy

if cpu_kernels.library() is None and os.environ.get("KVSCOPE_REQUIRE_COMPILER") == "1":  # CI: a fail, not a skip
    raise RuntimeError("no C compiler: the CPU kernels cannot be built (scripts/setup_display.sh installs gcc)")
pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler: the kernels cannot be built")

SHAPES = [(9, 3, 64), (4, 4, 20), (8, 1, 128)]  # (heads, kv heads, head dim): SmolLM2's, odd-sized, Llama-7B-like
ROWS = [0, 1, 8, 40]  # 40: past PARALLEL_ROWS, split over two threads
PROMPTS = [list(range(30, 60)) + [1, 2, 3], list(range(30, 60)) + [4], list(range(100, 137)), [7]]


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def ops_for(head_dim: int, max_pos: int = 300) -> CpuFusedOps:
    torch.manual_seed(head_dim)
    return CpuFusedOps(torch.randn(max_pos, head_dim), cpu_kernels.library())


@pytest.mark.parametrize("t", ROWS)
def test_add_rms_norm_is_pytorchs_and_keeps_the_residual_apart(t, two_threads):
    n = 576
    ops = ops_for(64)
    x, residual, w = torch.randn(t, n), torch.randn(t, n), torch.randn(n)
    x_before = x.clone()
    out, res = ops.add_rms_norm(x, residual.clone(), w, 1e-5)
    assert torch.equal(res, residual + x)  # the add is exact: one rounding, as PyTorch's
    torch.testing.assert_close(out, F.rms_norm(residual + x, (n,), w, 1e-5), rtol=2e-6, atol=2e-6)
    first, res0 = ops.add_rms_norm(x, None, w, 1e-5)  # the first layer: the residual is a copy of the input
    torch.testing.assert_close(first, F.rms_norm(x, (n,), w, 1e-5), rtol=2e-6, atol=2e-6)
    assert torch.equal(res0, x) and torch.equal(x, x_before)
    if t:
        assert res0.data_ptr() != x.data_ptr()
        strided = torch.randn(t, 2 * n)[:, :n]  # rows apart in memory, as a split's views are
        torch.testing.assert_close(
            ops.add_rms_norm(strided, None, w, 1e-5)[0], F.rms_norm(strided, (n,), w, 1e-5), rtol=2e-6, atol=2e-6
        )
        out, res = ops.add_rms_norm(strided, residual.clone(), w, 1e-5)  # the add reads the strided rows
        assert torch.equal(res, residual + strided)
        torch.testing.assert_close(out, F.rms_norm(residual + strided, (n,), w, 1e-5), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("t", ROWS)
def test_rope_and_store_is_the_pytorch_paths_bit_for_bit(t, heads, kv_heads, head_dim, two_threads):
    """q rotated in place, k rotated into the cache and v beside it at each slot, -1 storing nothing: the same
    bits as the PyTorch path's q * cos + roll(q) * signed_sin and index_copy_."""
    ops = ops_for(head_dim)
    bs, num_blocks = 4, 32
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = q.view(t, heads, head_dim), k.view(t, kv_heads, head_dim), v.view(t, kv_heads, head_dim)
    positions = torch.randint(0, 300, (t,))
    slots = torch.randperm(num_blocks * bs)[:t]
    if t > 1:
        slots[1] = -1  # a token whose KV is not stored (a prefix-cached or padded row)
    half = head_dim // 2
    cos = ops.cos_sin_cache[positions, :half].repeat(1, 2)[:, None]
    sin = signed_sin(ops.cos_sin_cache[positions, half:].repeat(1, 2)[:, None])
    ref_q, ref_k = q * cos + q.roll(half, -1) * sin, k * cos + k.roll(half, -1) * sin
    k_before, v_before = k.clone(), v.clone()
    kc = torch.zeros(num_blocks, bs, kv_heads, head_dim)
    vc = torch.zeros_like(kc)

    out = ops.rope_and_store(q, k, v, positions, kc, vc, slots)

    assert out.data_ptr() == q.data_ptr() and torch.equal(q, ref_q)
    assert torch.equal(k, k_before) and torch.equal(v, v_before)
    flat_k, flat_v = kc.view(-1, kv_heads, head_dim), vc.view(-1, kv_heads, head_dim)
    stored = slots[slots >= 0]
    assert torch.equal(flat_k[stored], ref_k[slots >= 0]) and torch.equal(flat_v[stored], v[slots >= 0])
    untouched = torch.ones(num_blocks * bs, dtype=torch.bool)
    untouched[stored] = False
    assert not flat_k[untouched].any() and not flat_v[untouched].any()


@pytest.mark.parametrize("t", ROWS)
def test_silu_and_mul_is_pytorchs_to_float_rounding(t, two_threads):
    inter = 1536
    ops = ops_for(64)
    gate_up = torch.randn(t, 2 * inter) * 8
    if t:
        gate_up[0, :6] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-30, -1e-30])  # the polynomial's edges
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_and_mul(gate_up), F.silu(gate) * up, rtol=1e-6, atol=1e-30)


def run(tiny_hf, **kw) -> tuple[list[list[int]], LLMEngine]:
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    engine = LLMEngine.from_hf_model(
        tiny_hf, None, name="tiny", block_size=4, num_gpu_blocks=kw.pop("num_gpu_blocks", 64), **kw
    )
    outs = LLM.from_engine(engine).generate(PROMPTS, params)
    return [o.outputs[0].token_ids for o in outs], engine


def test_the_cpu_engine_fuses_by_default_and_equals_pytorchs_ops_and_transformers(tiny_hf):
    fused, engine = run(tiny_hf, max_num_batched_tokens=16)  # chunked prefill, prefix hits
    assert isinstance(engine.runner.ops, CpuFusedOps) and engine.runner.backend == "cpu"
    unfused, other = run(tiny_hf, max_num_batched_tokens=16, fuse_ops=False)
    assert other.runner.ops is None
    assert fused == unfused == [hf_greedy(tiny_hf, p, 10) for p in PROMPTS]
    assert engine.metrics()["prefix_cache_hits"] > 0
    tight, small = run(tiny_hf, num_gpu_blocks=14)  # four requests in 14 blocks: preempted and recomputed
    assert small.metrics()["num_preemptions"] > 0 and tight == fused
    assert small.audit().ok


@pytest.mark.parametrize(
    "kw,why",
    [
        ({"kv_cache_dtype": "int8"}, "store a plain pool, not int8"),
        ({"dtype": "bfloat16"}, "run float32, not bfloat16"),
        ({"attention_backend": "torch"}, None),  # PyTorch's ops throughout: the reference, nothing fused
    ],
)
def test_where_the_c_kernels_do_not_apply_pytorchs_ops_run_and_the_log_says_why(tiny_hf, kw, why, caplog):
    model = copy.deepcopy(tiny_hf).to(torch.bfloat16) if kw.get("dtype") == "bfloat16" else tiny_hf
    kw = {k: v for k, v in kw.items() if k != "dtype"}
    with caplog.at_level(logging.INFO, logger="engine"):
        out, engine = run(model, **kw)
    assert engine.runner.ops is None
    said = [r.getMessage() for r in caplog.records if "no fused kernels" in r.getMessage()]
    assert said == ([f"no fused kernels: the CPU's fused kernels {why}"] if why else [])
    reference, _ = run(model, fuse_ops=False, **kw)
    assert out == reference  # the same path as switching them off


def test_what_the_c_code_cannot_check_is_refused_in_one_line():
    """The C code has no bounds of its own: a position past the rotary table, a slot past the cache, ids of another
    dtype, a cache of another layout or dtype, rows of another dtype are refused before it runs (nothing written)."""
    ops = ops_for(64, max_pos=300)
    kc = torch.zeros(8, 4, 3, 64)
    positions, slots = torch.tensor([0, 299]), torch.tensor([0, 31])
    ops.check_step(positions, slots, kc)  # the last row of each: fine
    bad = [
        (torch.tensor([0, 300]), slots, "outside the rotary table's 300 rows"),
        (torch.tensor([-1, 3]), slots, "outside the rotary table"),
        (positions, torch.tensor([0, 32]), "outside the KV cache's 32 slots"),
        (positions.int(), slots, "must be int64"),
    ]
    for pos, sl, why in bad:
        with pytest.raises(ValueError, match=why):
            ops.check_step(pos, sl, kc)
    q, k, v = torch.randn(2, 9, 64), torch.randn(2, 3, 64), torch.randn(2, 3, 64)
    for cache in (kc.to(torch.bfloat16), torch.zeros(8, 4, 64, 3).transpose(-1, -2), torch.zeros(8, 4, 1, 64)):
        with pytest.raises(ValueError, match="contiguous float32 caches"):
            ops.rope_and_store(q, k, v, positions, cache, cache, slots)
    with pytest.raises(ValueError, match="float32 rows"):
        ops.add_rms_norm(torch.randn(2, 8, dtype=torch.bfloat16), None, torch.randn(8), 1e-5)
    with pytest.raises(ValueError, match="contiguous residual"):
        ops.add_rms_norm(torch.randn(2, 8), torch.randn(8, 2).t(), torch.randn(8), 1e-5)
    assert not kc.any()


def test_the_engine_refuses_a_step_past_the_rotary_table(tiny_hf):
    """Once a step the model checks its rows against the C code's tables: a position past max_model_len (a runner
    bug) is one clear error, not a read past the table."""
    _, engine = run(tiny_hf)
    ops = engine.runner.ops
    with pytest.raises(ValueError, match="outside the rotary table"):
        ops.check_step(torch.tensor([ops.cos_sin_cache.shape[0]]), torch.tensor([0]), engine.runner.kv_caches[0][0])
