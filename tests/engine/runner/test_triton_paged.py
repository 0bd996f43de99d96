"""The Triton kernels against the PyTorch reference (interpreter on the CPU, compiled on CUDA)."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from engine import LLM, LLMEngine, SamplingParams
from engine.runner.attention import torch_ref, triton_paged
from engine.runner.attention.metadata import AttentionMetadata
from engine.runner.kv_quant import QuantizedKV, part_formats
from tests.conftest import hf_greedy

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def make_meta(
    seqs: list[tuple[int, int]], bs: int, num_blocks: int, seed: int = 0, device: torch.device | str = DEVICE
) -> AttentionMetadata:
    """``seqs``: (cached tokens, new tokens) each; block tables draw shuffled physical ids, on ``device``."""
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
    t = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
    return AttentionMetadata(
        t(slots),
        t([b + [0] * (width - len(b)) for b in tables]),
        t(lens),
        qsl,
        lens,
        bs,
        t(decode),
        t([qsl[i] for i in decode]),
        [i for i, (_, n) in enumerate(seqs) if n != 1],
    )


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


@pytest.mark.parametrize(
    "bs,heads,kv_heads,head_dim",
    [
        (8, 4, 4, 64),  # GQA ratio 1
        (16, 6, 2, 64),  # 3
        (32, 8, 2, 128),  # 4
        (16, 8, 1, 128),  # 8
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_paged_attention_matches_reference(bs, heads, kv_heads, head_dim, dtype):
    torch.manual_seed(bs + heads)
    meta = make_meta(SEQS, bs, 64, seed=heads)
    tokens = meta.query_start_loc[-1]
    kc = torch.randn(64, bs, kv_heads, head_dim, device=DEVICE).to(dtype)
    vc = torch.randn(64, bs, kv_heads, head_dim, device=DEVICE).to(dtype)
    q = torch.randn(tokens, heads, head_dim, device=DEVICE).to(dtype)
    scale = head_dim**-0.5
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
        engine = LLMEngine.from_hf_model(
            model,
            None,
            name="tiny-llama",
            block_size=block_size,
            num_gpu_blocks=64,
            attention_backend=backend,
            max_num_batched_tokens=24,
        )
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


# -- split-K decode (flash-decoding) over long contexts ------------------------------------------
# Decodes only: contexts past 1,000 tokens, none a multiple of a tile or block, and a short one whose
# later splits are empty.
LONG = [(1036, 1), (1499, 1), (2, 1), (777, 1)]


def _decode_case(bs: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seqs=LONG, seed: int = 0):
    torch.manual_seed(seed)
    nb = sum(-(-(c + n) // bs) for c, n in seqs) + 4
    meta = make_meta(seqs, bs, nb, seed=seed)
    kc = torch.randn(nb, bs, kv_heads, head_dim, device=DEVICE).to(dtype)
    vc = torch.randn(nb, bs, kv_heads, head_dim, device=DEVICE).to(dtype)
    q = torch.randn(len(seqs), heads, head_dim, device=DEVICE).to(dtype)
    return meta, kc, vc, q


def _assert_close_to_exact(out, q, kc, vc, meta, scale):
    exact = torch_ref.paged_attention(q.double(), kc.double(), vc.double(), meta, scale)
    err = (out.double() - exact).abs().max().item()
    ref_err = (torch_ref.paged_attention(q, kc, vc, meta, scale).double() - exact).abs().max().item()
    assert err <= max(2 * ref_err, EPS[q.dtype]), (err, ref_err)


@pytest.mark.parametrize("bs", [8, 16, 32])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (8, 1)])  # GQA 1, 4, 8
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_split_k_decode_matches_reference_on_long_contexts(bs, heads, kv_heads, dtype):
    meta, kc, vc, q = _decode_case(bs, heads, kv_heads, 64, dtype, seed=bs + heads)
    assert triton_paged.decode_splits(len(LONG), kv_heads, meta.block_tables.shape[1] * bs, DEVICE) > 1
    out = triton_paged.paged_attention(q, kc, vc, meta, 0.125)
    _assert_close_to_exact(out, q, kc, vc, meta, 0.125)


@pytest.mark.parametrize("splits", [1, 3, 16])
def test_every_split_count_gives_the_same_attention(splits):
    # 16 splits of the 2-token context leave 15 empty (m = -inf, l = 0): the combine must drop them.
    meta, kc, vc, q = _decode_case(16, 8, 2, 128, torch.float32)
    out = triton_paged.paged_attention(q, kc, vc, meta, 0.1, num_splits=splits)
    _assert_close_to_exact(out, q, kc, vc, meta, 0.1)


def test_split_grid_is_fixed_while_contexts_grow():
    # A captured graph keeps its launch: the same table width and batch, other seq_lens on the device.
    meta, kc, vc, q = _decode_case(16, 4, 4, 64, torch.float16)
    width = meta.block_tables.shape[1] * 16
    for lens in ([1037, 1500, 3, 778], [1, 1450, 2, 64]):  # within each table's blocks
        meta.seq_lens.copy_(torch.tensor(lens, device=DEVICE))
        meta.seq_lens_host[:] = lens
        out = triton_paged.paged_attention(q, kc, vc, meta, 0.125, max_seq_len=width)
        _assert_close_to_exact(out, q, kc, vc, meta, 0.125)


def test_split_choice_fills_the_card_only_when_it_must():
    cuda = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    sms = triton_paged._sm_count(cuda)
    splits = triton_paged.decode_splits
    assert splits(64, 32, 512, cuda) == 1  # batch x heads fill the card already
    assert splits(1, 32, 100, cuda) == 1  # too short to split
    assert splits(1, 32, 4096, cuda) == 16  # 256 tokens a split at most 16
    many = splits(8, 32, 32768, cuda)
    assert many & (many - 1) == 0 and 8 * 32 * many >= 2 * sms  # several programs per SM


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_k_decode_reads_quantized_pools(kv_cache_dtype, dtype):
    torch.manual_seed(3)
    bs, heads, kvh, d = 16, 8, 2, 64
    nb = sum(-(-(c + n) // bs) for c, n in LONG) + 4
    meta = make_meta(LONG, bs, nb)
    fk, fv = part_formats(kv_cache_dtype)
    kc, vc = (QuantizedKV(f, nb, bs, kvh, d, dtype, DEVICE, head_scale=torch.full((kvh,), 0.05)) for f in (fk, fv))
    everything = torch.arange(nb * bs, device=DEVICE)
    kc.store(everything, torch.randn(nb * bs, kvh, d, device=DEVICE))
    vc.store(everything, torch.randn(nb * bs, kvh, d, device=DEVICE))
    q = torch.randn(len(LONG), heads, d, device=DEVICE).to(dtype)
    kc32, vc32 = copy.copy(kc), copy.copy(vc)
    kc32.out_dtype = vc32.out_dtype = torch.float32
    ref = torch_ref.paged_attention(q.float(), kc32, vc32, meta, d**-0.5)
    out = triton_paged.paged_attention(q, kc, vc, meta, d**-0.5, num_splits=8)
    tol = 1e-5 if dtype == torch.float32 else 4e-3
    assert (out.float() - ref).abs().max().item() < tol


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_prefill_over_long_prefixes_matches_reference(heads, kv_heads, dtype):
    # Several query tiles, whole unmasked key tiles before each diagonal, and a decode beside them.
    seqs = [(0, 70), (203, 41), (70, 1)]
    torch.manual_seed(heads)
    meta = make_meta(seqs, 16, 32, seed=heads)
    kc = torch.randn(32, 16, kv_heads, 64, device=DEVICE).to(dtype)
    vc = torch.randn(32, 16, kv_heads, 64, device=DEVICE).to(dtype)
    q = torch.randn(meta.query_start_loc[-1], heads, 64, device=DEVICE).to(dtype)
    _assert_close_to_exact(triton_paged.paged_attention(q, kc, vc, meta, 0.125), q, kc, vc, meta, 0.125)
