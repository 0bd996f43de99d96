"""The Triton kernels against the PyTorch reference (interpreter on the CPU, compiled on CUDA)."""
from __future__ import annotations

import copy
import random

import pytest
import torch

from engine import LLM, LLMEngine, SamplingParams
from engine.runner.attention import torch_ref, triton_paged
from engine.runner.attention.metadata import AttentionMetadata
from tests.conftest import hf_greedy

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def make_meta(seqs: list[tuple[int, int]], bs: int, num_blocks: int, seed: int = 0) -> AttentionMetadata:
    """``seqs``: (cached tokens, new tokens) each; block tables draw shuffled physical ids."""
    rng = random.Random(seed)
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables, qsl, lens, slots = [], [0], [], []
    for cached, new in seqs:
        total = cached + new
        table = [ids.pop() for _ in range(-(-total // bs))]
        tables.append(table)
        qsl.append(qsl[-1] + new)
        lens.append(total)
        slots += [table[p // bs] * bs + p % bs for p in range(cached, total)]
    width = max(len(t) for t in tables)
    decode = [i for i, (_, n) in enumerate(seqs) if n == 1]
    t = lambda x: torch.tensor(x, dtype=torch.long, device=DEVICE)  # noqa: E731
    return AttentionMetadata(t(slots), t([b + [0] * (width - len(b)) for b in tables]), t(lens), qsl, lens, bs,
                             t(decode), t([qsl[i] for i in decode]), [i for i, (_, n) in enumerate(seqs) if n != 1])


# Ragged: fresh prompts, one-token decodes, chunks over a cached prefix, a single-token prompt.
SEQS = [(0, 7), (5, 1), (20, 13), (33, 1), (0, 1), (40, 24), (16, 16), (1, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_store_kv_writes_each_slot_and_skips_padding(dtype):
    kvh, d, bs = 2, 64, 8
    kc = torch.zeros(16, bs, kvh, d, dtype=dtype, device=DEVICE)
    vc = torch.zeros_like(kc)
    slots = torch.tensor([9, -1, 70, 0, -1, 127], device=DEVICE)
    k = torch.randn(6, kvh, d, device=DEVICE).to(dtype)
    v = torch.randn(6, kvh, d, device=DEVICE).to(dtype)
    triton_paged.store_kv(k, v, kc, vc, slots)
    ref_k, ref_v = torch.zeros_like(kc), torch.zeros_like(vc)
    torch_ref.store_kv(k, v, ref_k, ref_v, slots)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)
    assert int((kc.flatten(0, 1).abs().sum((1, 2)) != 0).sum()) == 4  # the two -1 rows wrote nothing


@pytest.mark.parametrize("bs,heads,kv_heads,head_dim", [
    (8, 4, 4, 64),   # GQA ratio 1
    (16, 6, 2, 64),  # 3
    (32, 8, 2, 128),  # 4
    (16, 8, 1, 128),  # 8
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_paged_attention_matches_reference(bs, heads, kv_heads, head_dim, dtype):
    torch.manual_seed(bs + heads)
    meta = make_meta(SEQS, bs, 64, seed=heads)
    tokens = meta.query_start_loc[-1]
    kc = torch.randn(64, bs, kv_heads, head_dim, device=DEVICE).to(dtype)
    vc = torch.randn(64, bs, kv_heads, head_dim, device=DEVICE).to(dtype)
    q = torch.randn(tokens, heads, head_dim, device=DEVICE).to(dtype)
    scale = head_dim ** -0.5
    exact = torch_ref.paged_attention(q.double(), kc.double(), vc.double(), meta, scale)
    out = triton_paged.paged_attention(q, kc, vc, meta, scale)
    assert out.dtype == dtype and out.shape == q.shape
    err = (out.double() - exact).abs().max().item()
    # As accurate as the reference itself in that dtype (a 16-bit output rounds once).
    ref_err = (torch_ref.paged_attention(q, kc, vc, meta, scale).double() - exact).abs().max().item()
    assert err <= max(2 * ref_err, EPS[dtype]), (err, ref_err)


def test_decode_masks_the_partly_filled_last_block():
    bs, kvh, d = 16, 2, 64
    meta = make_meta([(20, 1)], bs, 8)  # 21 tokens: the second block holds 5
    kc = torch.randn(8, bs, kvh, d, device=DEVICE)
    vc = torch.randn(8, bs, kvh, d, device=DEVICE)
    q = torch.randn(1, 4, d, device=DEVICE)
    before = triton_paged.paged_attention(q, kc, vc, meta, 0.125)
    last = int(meta.block_tables[0, 1])
    kc[last, 5:] = 1e4  # garbage past the end must not leak in
    vc[last, 5:] = 1e4
    assert torch.equal(triton_paged.paged_attention(q, kc, vc, meta, 0.125), before)


@pytest.mark.parametrize("block_size", [8, 16])
def test_engine_with_triton_equals_torch_and_transformers(tiny_hf, block_size):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    shared = list(range(30, 60))
    prompts = [shared + [1, 2, 3], shared + [4], list(range(100, 137)), [7]]
    outs = {}
    model = copy.deepcopy(tiny_hf).to(DEVICE)
    for backend in ("torch", "triton"):
        # A small token budget chunks the long prompts; the shared prefix hits the cache.
        engine = LLMEngine.from_hf_model(model, None, name="tiny-llama", block_size=block_size, num_gpu_blocks=64,
                                         attention_backend=backend, max_num_batched_tokens=24)
        res = LLM.from_engine(engine).generate(prompts, params)
        outs[backend] = [r.outputs[0].token_ids for r in res]
        assert engine.metrics()["prefix_cache_hits"] > 0
    assert outs["triton"] == outs["torch"]
    assert outs["triton"] == [hf_greedy(tiny_hf, p, 8) for p in prompts]


def test_triton_backend_on_cpu_without_the_interpreter_is_a_clear_error(tiny_engine, monkeypatch):
    # On the CPU (here, or a CPU engine on a GPU machine) Triton needs its interpreter.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="runs on CUDA"):
        tiny_engine(attention_backend="triton")
    assert tiny_engine(attention_backend="torch").add_request([1, 2, 3])
