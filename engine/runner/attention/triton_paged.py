"""Triton paged attention: store K/V by slot mapping, decode and prefill through block tables.

Cache layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (as in
``torch_ref``), plain or quantized (``kv_quant``: the store kernel quantizes, the attention
kernels dequantize each tile as they load it). KV tiles of ``BLOCK_N`` tokens are gathered page by page inside the
kernels (token ``n`` lives in block ``table[n // block_size]`` at ``n % block_size``), so
any block size works with a tile big enough for ``tl.dot``, and cached prefixes are read
in place: no gather into a contiguous copy. Query heads of one KV head share its K/V
(GQA) by indexing, never by repeating it in memory.

On the CPU the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``): that
is how the tests check them against ``torch_ref``.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ..kv_quant import QUANT_MODES, QuantizedKV
from .metadata import AttentionMetadata


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# -- store (and quantize) -------------------------------------------------------------------
@triton.jit
def _store_values(
    x,
    h,
    hm,
    cache_ptr,
    scale_ptr,
    slot,
    MODE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    KVH_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """Write (and quantize) ``x``, one token's ``[KVH_PAD, HEAD_DIM]`` rows of the KV heads ``h`` (``hm``
    masks the padding), at ``slot``. The one copy of the quantization rule: ``store_kv`` and the fused
    rotary + store kernel (``fused_ops``) both call it, so both write the bytes ``QuantizedKV.store`` does.
    Divisions are IEEE-rounded (``div_rn``): a GPU's default fp32 ``/`` is approximate, which moves a
    quotient that lands on a rounding tie (frequent with bf16 inputs) to the other side."""
    if MODE == 3:  # int4: a scale per head, two values a byte (even d low nibble, odd d high)
        xe, xo = tl.split(tl.reshape(x.to(tl.float32), (KVH_PAD, HEAD_DIM // 2, 2)))
        half = tl.arange(0, HEAD_DIM // 2)
        amax = tl.maximum(tl.max(tl.abs(xe), axis=1), tl.max(tl.abs(xo), axis=1))
        scale = tl.maximum(tl.math.div_rn(amax, 7.0), 6.2e-5).to(tl.float16)
        sf = scale.to(tl.float32)[:, None]
        qe = tl.minimum(tl.maximum(tl.floor(tl.math.div_rn(xe, sf) + 0.5), -7.0), 7.0) + 8.0
        qo = tl.minimum(tl.maximum(tl.floor(tl.math.div_rn(xo, sf) + 0.5), -7.0), 7.0) + 8.0
        packed = qe.to(tl.uint8) | (qo.to(tl.uint8) << 4)
        dst = cache_ptr + slot * (NUM_KV_HEADS * HEAD_DIM // 2) + h[:, None] * (HEAD_DIM // 2) + half[None, :]
        tl.store(dst, packed, mask=hm[:, None])
        tl.store(scale_ptr + slot * NUM_KV_HEADS + h, scale, mask=hm)
    else:
        d = tl.arange(0, HEAD_DIM)
        dst = cache_ptr + slot * (NUM_KV_HEADS * HEAD_DIM) + h[:, None] * HEAD_DIM + d[None, :]
        if MODE == 0:
            tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=hm[:, None])
        elif MODE == 1:  # fp8 e4m3 with a static scale per head
            hs = tl.load(scale_ptr + h, mask=hm, other=1.0)
            y = tl.minimum(tl.maximum(tl.math.div_rn(x.to(tl.float32), hs[:, None]), -448.0), 448.0)
            # Round to the e4m3 grid by hand (3 mantissa bits; subnormal below 2^-6), so the cast is
            # exact: Triton 3.9's interpreter drops the carry when rounding overflows the mantissa.
            a = tl.abs(y)
            e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
            step = ((e + 124) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3)
            r = tl.minimum(tl.floor(a / step + 0.5) * step, 448.0)
            tl.store(dst, tl.where(y < 0, -r, r).to(tl.float8e4nv), mask=hm[:, None])
        else:  # int8: a scale per token and head
            xf = x.to(tl.float32)
            scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(xf), axis=1), 127.0), 6.2e-5).to(tl.float16)
            q = tl.minimum(tl.maximum(tl.floor(tl.math.div_rn(xf, scale.to(tl.float32)[:, None]) + 0.5), -127.0), 127.0)
            tl.store(dst, q.to(tl.int8), mask=hm[:, None])
            tl.store(scale_ptr + slot * NUM_KV_HEADS + h, scale, mask=hm)


@triton.jit
def _store_part(
    x_ptr,
    stride_t,
    cache_ptr,
    scale_ptr,
    t,
    slot,
    MODE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    KVH_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    h = tl.arange(0, KVH_PAD)
    hm = h < NUM_KV_HEADS
    d = tl.arange(0, HEAD_DIM)
    x = tl.load(x_ptr + t * stride_t + h[:, None] * HEAD_DIM + d[None, :], mask=hm[:, None], other=0.0)
    _store_values(x, h, hm, cache_ptr, scale_ptr, slot, MODE, NUM_KV_HEADS, KVH_PAD, HEAD_DIM)


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_ptr,
    stride_kt,
    stride_vt,
    K_MODE: tl.constexpr,
    V_MODE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    KVH_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # -1: a padded row, nothing to store
        _store_part(key_ptr, stride_kt, k_cache_ptr, k_scale_ptr, t, slot, K_MODE, NUM_KV_HEADS, KVH_PAD, HEAD_DIM)
        _store_part(value_ptr, stride_vt, v_cache_ptr, v_scale_ptr, t, slot, V_MODE, NUM_KV_HEADS, KVH_PAD, HEAD_DIM)


def _parts(cache) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(data, scale, mode) of a plain or quantized pool; a plain pool passes itself as a dummy scale."""
    if isinstance(cache, QuantizedKV):
        return cache.data, cache.scale, QUANT_MODES[cache.fmt]
    return cache, cache, 0


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache, v_cache, slot_mapping: torch.Tensor) -> None:
    """``key``/``value``: ``[T, kvh, D]``; one program per token writes (and quantizes) its rows."""
    t, kvh, d = key.shape
    if t == 0:
        return
    key, value = key.reshape(t, kvh * d), value.reshape(t, kvh * d)
    kc, ks, km = _parts(k_cache)
    vc, vs, vm = _parts(v_cache)
    _store_kv_kernel[(t,)](
        key,
        value,
        kc,
        vc,
        ks,
        vs,
        slot_mapping,
        key.stride(0),
        value.stride(0),
        K_MODE=km,
        V_MODE=vm,
        NUM_KV_HEADS=kvh,
        KVH_PAD=triton.next_power_of_2(kvh),
        HEAD_DIM=d,
    )


@triton.jit
def _load_tile(
    cache_ptr, scale_ptr, slot, kvh, d, nmask, MODE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr
):
    """``[BLOCK_N, HEAD_DIM]`` fp32 K or V of one KV head at the given slots, dequantized."""
    if MODE == 3:
        off = slot[:, None] * (NUM_KV_HEADS * HEAD_DIM // 2) + kvh * (HEAD_DIM // 2) + (d // 2)[None, :]
        byte = tl.load(cache_ptr + off, mask=nmask[:, None], other=0)
        nib = (byte >> ((d % 2) * 4).to(tl.uint8)[None, :]) & 0xF
        scale = tl.load(scale_ptr + slot * NUM_KV_HEADS + kvh, mask=nmask, other=0.0).to(tl.float32)
        x = (nib.to(tl.float32) - 8.0) * scale[:, None]
    else:
        off = slot[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kvh * HEAD_DIM + d[None, :]
        x = tl.load(cache_ptr + off, mask=nmask[:, None], other=0.0).to(tl.float32)
        if MODE == 1:
            x = x * tl.load(scale_ptr + kvh)
        elif MODE == 2:
            scale = tl.load(scale_ptr + slot * NUM_KV_HEADS + kvh, mask=nmask, other=0.0).to(tl.float32)
            x = x * scale[:, None]
    return x


# -- decode: one query token per sequence, split-K over the context (flash-decoding) -------------
@triton.jit
def _decode_tile_dot(q, k, v, nmask, m_i, l_i, acc, scale, DOT_FP32: tl.constexpr):
    """Online-softmax update of a KV head's query heads (padded to 16 rows: one tensor-core product a
    tile, which on an H200 reads the cache 1.7x faster than a broadcast product of a single MHA row)
    over a ``[BLOCK_N, D]`` tile."""
    if DOT_FP32:
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    else:
        s = tl.dot(q, tl.trans(k.to(q.dtype))) * scale
    s = tl.where(nmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DOT_FP32:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,
    work_ptr,
    tables_ptr,
    seq_lens_ptr,
    seq_idx_ptr,
    tok_idx_ptr,
    scale,
    num_splits,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_tb,
    BLOCK_SIZE: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    Q_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    K_MODE: tl.constexpr,
    V_MODE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """One program: the query heads of one KV head of one decode sequence, over one split of its
    context. The split's token range comes from ``seq_len`` on the device, so the grid is fixed for
    a batch size (CUDA-graph safe) while contexts grow between replays."""
    i = tl.program_id(0)  # the i-th decode sequence
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    seq = tl.load(seq_idx_ptr + i)
    tok = tl.load(tok_idx_ptr + i)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Whole tiles per split, so only the last tile of the context is partly masked.
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    lo = sp * per_split
    hi = tl.minimum(lo + per_split, seq_len)
    heads = kvh * QUERIES_PER_KV + tl.arange(0, Q_PAD)
    hmask = tl.arange(0, Q_PAD) < QUERIES_PER_KV
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + tok * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=hmask[:, None], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    m_i = tl.full([Q_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([Q_PAD], tl.float32)
    acc = tl.zeros([Q_PAD, HEAD_DIM], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        nmask = n < hi  # masks the partly filled last block
        phys = tl.load(tables_ptr + seq * stride_tb + n // BLOCK_SIZE, mask=nmask, other=0)
        slot = phys.to(tl.int64) * BLOCK_SIZE + n % BLOCK_SIZE
        k = _load_tile(k_cache_ptr, k_scale_ptr, slot, kvh, d, nmask, K_MODE, NUM_KV_HEADS, HEAD_DIM)
        v = _load_tile(v_cache_ptr, v_scale_ptr, slot, kvh, d, nmask, V_MODE, NUM_KV_HEADS, HEAD_DIM)
        m_i, l_i, acc = _decode_tile_dot(q, k, v, nmask, m_i, l_i, acc, scale, DOT_FP32)
    if SPLIT:
        # Partial (m, l, acc) rows of [B, H, splits, HEAD_DIM + 2]; an empty split (its range past
        # seq_len) never ran the loop and writes m = -inf, l = 0, acc = 0, which the combine drops.
        row = ((i * NUM_HEADS + heads) * num_splits + sp).to(tl.int64) * (HEAD_DIM + 2)
        tl.store(work_ptr + row[:, None] + d[None, :], acc, mask=hmask[:, None])
        tl.store(work_ptr + row + HEAD_DIM, m_i, mask=hmask)
        tl.store(work_ptr + row + HEAD_DIM + 1, l_i, mask=hmask)
    else:
        o = acc / l_i[:, None]
        tl.store(
            out_ptr + tok * stride_ot + heads[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=hmask[:, None],
        )


@triton.jit
def _combine_kernel(
    work_ptr,
    out_ptr,
    tok_idx_ptr,
    num_splits,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLIT_PAD: tl.constexpr,
):
    """Merge one head's split partials by their log-sum-exp weights into ``out``."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLIT_PAD)
    smask = sp < num_splits
    d = tl.arange(0, HEAD_DIM)
    row = ((i * NUM_HEADS + h) * num_splits + sp).to(tl.int64) * (HEAD_DIM + 2)
    m = tl.load(work_ptr + row + HEAD_DIM, mask=smask, other=float("-inf"))
    l_s = tl.load(work_ptr + row + HEAD_DIM + 1, mask=smask, other=0.0)
    acc = tl.load(work_ptr + row[:, None] + d[None, :], mask=smask[:, None], other=0.0)
    m_max = tl.max(m, axis=0)  # finite: the first split always holds a token
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))
    o = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * l_s, axis=0)
    tok = tl.load(tok_idx_ptr + i)
    tl.store(out_ptr + tok * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty))


# -- prefill: new tokens over a cached prefix, causal among themselves --------------------
@triton.jit
def _prefill_tile(
    q,
    m_i,
    l_i,
    acc,
    start,
    end,
    qpos,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    tables_ptr,
    seq,
    stride_tb,
    kvh,
    d,
    scale,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    K_MODE: tl.constexpr,
    V_MODE: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One ``BLOCK_N`` tile of keys: the online-softmax update. ``MASKED`` tiles straddle the causal
    diagonal or the end of the context; the others are seen whole by every query of the tile."""
    n = start + tl.arange(0, BLOCK_N)
    nmask = n < end
    phys = tl.load(tables_ptr + seq * stride_tb + n // BLOCK_SIZE, mask=nmask, other=0)
    slot = phys.to(tl.int64) * BLOCK_SIZE + n % BLOCK_SIZE
    k = _load_tile(k_cache_ptr, k_scale_ptr, slot, kvh, d, nmask, K_MODE, NUM_KV_HEADS, HEAD_DIM).to(q.dtype)
    v = _load_tile(v_cache_ptr, v_scale_ptr, slot, kvh, d, nmask, V_MODE, NUM_KV_HEADS, HEAD_DIM).to(q.dtype)
    if DOT_FP32:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * scale
    if MASKED:
        keep = (n[None, :] <= qpos[:, None]) & nmask[None, :]
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # padded query rows see no key
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DOT_FP32:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,
    tables_ptr,
    seq_idx_ptr,
    q_start_ptr,
    q_len_ptr,
    ctx_len_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_tb,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    K_MODE: tl.constexpr,
    V_MODE: tl.constexpr,
):
    i = tl.program_id(0)  # the i-th prefill sequence
    mt = tl.program_id(1)  # its query tile
    h = tl.program_id(2)
    q_len = tl.load(q_len_ptr + i)
    if mt * BLOCK_M < q_len:
        seq = tl.load(seq_idx_ptr + i)
        q_start = tl.load(q_start_ptr + i)
        seq_len = tl.load(ctx_len_ptr + i)  # cached prefix + this step's tokens
        prefix = seq_len - q_len
        kvh = h // QUERIES_PER_KV
        m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
        mmask = m < q_len
        qpos = prefix + m  # absolute positions of the queries
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(
            q_ptr + (q_start + m)[:, None] * stride_qt + h * stride_qh + d[None, :], mask=mmask[:, None], other=0.0
        )
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        end = tl.minimum(seq_len, prefix + (mt + 1) * BLOCK_M)  # causal: no key past the tile's last query
        # Keys before the tile's first query are seen by all its queries: whole tiles, no mask.
        full = (prefix + mt * BLOCK_M) // BLOCK_N * BLOCK_N
        for start in range(0, full, BLOCK_N):
            m_i, l_i, acc = _prefill_tile(
                q,
                m_i,
                l_i,
                acc,
                start,
                end,
                qpos,
                k_cache_ptr,
                v_cache_ptr,
                k_scale_ptr,
                v_scale_ptr,
                tables_ptr,
                seq,
                stride_tb,
                kvh,
                d,
                scale,
                BLOCK_SIZE,
                NUM_KV_HEADS,
                HEAD_DIM,
                BLOCK_N,
                DOT_FP32,
                K_MODE,
                V_MODE,
                False,
            )
        for start in range(full, end, BLOCK_N):
            m_i, l_i, acc = _prefill_tile(
                q,
                m_i,
                l_i,
                acc,
                start,
                end,
                qpos,
                k_cache_ptr,
                v_cache_ptr,
                k_scale_ptr,
                v_scale_ptr,
                tables_ptr,
                seq,
                stride_tb,
                kvh,
                d,
                scale,
                BLOCK_SIZE,
                NUM_KV_HEADS,
                HEAD_DIM,
                BLOCK_N,
                DOT_FP32,
                K_MODE,
                V_MODE,
                True,
            )
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + (q_start + m)[:, None] * stride_ot + h * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=mmask[:, None],
        )


def _dot_fp32(dtype: torch.dtype) -> bool:
    """fp32 inputs get exact fp32 dots (not tf32). Triton 3.9's interpreter multiplies bf16
    operands of ``tl.dot`` as raw bits, so under it bf16 tiles are widened first; on a GPU
    bf16 dots stay native."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpreted())


def _prefill_tensors(meta: AttentionMetadata, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Per prefill sequence: batch index, first query row, query count, context length (once per step)."""
    cached = meta.backend_state.get("triton_prefill")
    if cached is None:
        seqs = meta.prefill_seqs
        qsl = meta.query_start_loc
        rows = [
            seqs,
            [qsl[i] for i in seqs],
            [qsl[i + 1] - qsl[i] for i in seqs],
            [meta.seq_lens_host[i] for i in seqs],
        ]
        cached = tuple(torch.tensor(r, dtype=torch.int64, device=device) for r in rows)
        cached += (max(rows[2]),)
        meta.backend_state["triton_prefill"] = cached
    return cached


# -- launch configuration ----------------------------------------------------------------
# Knobs the GPU benchmark (bench/gpu_kernels.py) may sweep; the defaults are the choices for sm_90.
TUNING = {
    # On an H200 (fp16, 32 KV heads of 128, batch 8 x 32k tokens) 64-token tiles, 4 warps and 3 stages read
    # the cache at 92% of 4.8 TB/s; 32- or 128-token tiles, 8 warps or fewer stages at 67-90%.
    "decode_block_n": 64,  # tokens a decode tile gathers across pages
    "decode_warps": 4,
    "decode_stages": 3,
    "split_waves": 4,  # split-K aims at this many programs per SM ...
    "min_split_tokens": 256,  # ... but never splits a context finer than this
    "max_splits": 64,
    # prefill overrides (None: chosen by the query count and dtype in _prefill_config)
    "prefill_block_m": None,
    "prefill_block_n": None,
    "prefill_warps": None,
    "prefill_stages": None,
}


def _tuned(name: str) -> int:
    """A tuning value that is always set (the decode kernel's; only prefill's may be None)."""
    v = TUNING[name]
    assert v is not None, name
    return v


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Multiprocessors of the card; off CUDA (the interpreter) an H200's 132, so the tests exercise
    the split choices a GPU makes."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


def decode_splits(batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """How many splits of the context (a power of two) decode uses: enough programs for a few waves
    over the SMs when batch x KV heads alone cannot fill them and contexts are long; 1 otherwise.
    Depends only on values that are static under a CUDA graph (batch size, block-table width)."""
    programs = batch * num_kv_heads
    target = _tuned("split_waves") * _sm_count(device)
    if programs >= target:
        return 1
    by_ctx = max(1, max_seq_len // _tuned("min_split_tokens"))
    want = triton.next_power_of_2(triton.cdiv(target, programs))
    cap = 1 << (min(by_ctx, _tuned("max_splits")).bit_length() - 1)  # the largest power of two under both
    return min(want, cap)


def _prefill_config(
    max_q: int, dtype: torch.dtype, bs: int, head_dim: int, device: torch.device
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the prefill kernel. On an H200, over a 2,048-token
    prompt: 128 x 128 tiles with 8 warps ran at 177 TFLOP/s, 64 x 64 with 4 at 175, 128 x 64 at 165."""
    if interpreted():  # small tiles keep the interpreted tests fast; the masking logic is the same
        return (16 if max_q <= 16 else 32), max(16, min(64, triton.next_power_of_2(bs))), 4, 1
    block_m = min(128, max(16, triton.next_power_of_2(max_q)))
    if dtype == torch.float32:  # exact fp32 dots: registers and shared memory run out at bigger tiles
        block_m, block_n, warps, stages = min(block_m, 64), 32, 4, 2
    elif block_m == 128:
        block_n, warps, stages = 128, 8, 2
    else:
        block_n, warps, stages = 64, 4, 3
    block_m, block_n, stages = _fit_smem(device, block_m, block_n, stages, head_dim, dtype.itemsize)
    return block_m, block_n, warps, stages


@functools.cache
def _smem_limit(device: torch.device) -> int:
    """Shared memory a program may take: 227 KiB on Hopper, 163 on an A100, 99 on Ada and Ampere cards."""
    if device.type != "cuda":
        return 227 * 1024
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "shared_memory_per_block_optin", 99 * 1024))


def _fit_smem(
    device: torch.device, block_m: int, block_n: int, stages: int, head_dim: int, elem: int
) -> tuple[int, int, int]:
    """Shrink (stages, then BLOCK_N, then BLOCK_M) until the Q tile and ``stages`` K and V tiles fit in
    the card's shared memory (with room for the compiler's scratch), so no card fails to compile."""

    def need() -> int:
        return (block_m + 2 * stages * block_n) * head_dim * elem + 16 * 1024

    limit = _smem_limit(device)
    while need() > limit and stages > 1:
        stages -= 1
    while need() > limit and block_n > 16:
        block_n //= 2
    while need() > limit and block_m > 16:
        block_m //= 2
    return block_m, block_n, stages


def _decode(
    q: torch.Tensor,
    kc,
    vc,
    ks,
    vs,
    km: int,
    vm: int,
    out: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    max_seq_len: int | None,
    num_splits: int | None,
) -> None:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kc.shape[2]
    qpk = num_heads // num_kv_heads
    batch = meta.decode_seqs.numel()
    tables = meta.block_tables
    if max_seq_len is None:
        max_seq_len = tables.shape[1] * meta.block_size  # the table's width: static under a graph
    splits = num_splits or decode_splits(batch, num_kv_heads, max_seq_len, q.device)
    q_pad = max(16, triton.next_power_of_2(qpk))  # tl.dot's smallest M
    # Partials (acc, m, l) of each split: fp32, allocated per call (free inside a CUDA graph's pool).
    work = torch.empty(
        batch * num_heads * splits * (head_dim + 2) if splits > 1 else 1, dtype=torch.float32, device=q.device
    )
    warps = _tuned("decode_warps") * (2 if q.element_size() == 4 and not interpreted() else 1)
    block_n, stages = _tuned("decode_block_n"), _tuned("decode_stages")
    _, block_n, stages = _fit_smem(q.device, q_pad, block_n, stages, head_dim, max(q.element_size(), 2))
    _decode_kernel[(batch, num_kv_heads, splits)](
        q,
        kc,
        vc,
        ks,
        vs,
        out,
        work,
        tables,
        meta.seq_lens,
        meta.decode_seqs,
        meta.decode_tokens,
        scale,
        splits,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        tables.stride(0),
        BLOCK_SIZE=meta.block_size,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        QUERIES_PER_KV=qpk,
        Q_PAD=q_pad,
        BLOCK_N=block_n,
        K_MODE=km,
        V_MODE=vm,
        DOT_FP32=_dot_fp32(q.dtype),
        SPLIT=splits > 1,
        num_warps=warps,
        num_stages=stages,
    )
    if splits > 1:
        _combine_kernel[(batch, num_heads)](
            work,
            out,
            meta.decode_tokens,
            splits,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            SPLIT_PAD=triton.next_power_of_2(splits),
            num_warps=4,
        )


def _prefill(
    q: torch.Tensor, kc, vc, ks, vs, km: int, vm: int, out: torch.Tensor, meta: AttentionMetadata, scale: float
) -> None:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kc.shape[2]
    tables = meta.block_tables
    seq_idx, q_start, q_len, ctx_len, max_q = _prefill_tensors(meta, q.device)
    chosen = _prefill_config(int(max_q), q.dtype, meta.block_size, head_dim, q.device)
    keys = ("prefill_block_m", "prefill_block_n", "prefill_warps", "prefill_stages")
    block_m, block_n, warps, stages = (c if TUNING[k] is None else TUNING[k] for c, k in zip(chosen, keys))
    grid = (len(meta.prefill_seqs), triton.cdiv(max_q, block_m), num_heads)
    _prefill_kernel[grid](
        q,
        kc,
        vc,
        ks,
        vs,
        out,
        tables,
        seq_idx,
        q_start,
        q_len,
        ctx_len,
        scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        tables.stride(0),
        BLOCK_SIZE=meta.block_size,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        QUERIES_PER_KV=num_heads // num_kv_heads,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_FP32=_dot_fp32(q.dtype),
        K_MODE=km,
        V_MODE=vm,
        num_warps=warps,
        num_stages=stages,
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """``q``: ``[T, H, D]``; the same contract as ``torch_ref.paged_attention``.

    ``max_seq_len`` (a bound on the decode contexts; default: the block table's width in tokens) and
    ``num_splits`` (forces the split-K count) only tune decode: each must stay fixed across the
    replays of a captured CUDA graph, which the defaults do.
    """
    kc, ks, km = _parts(k_cache)
    vc, vs, vm = _parts(v_cache)
    out = torch.empty_like(q)
    if meta.decode_seqs.numel():
        _decode(q, kc, vc, ks, vs, km, vm, out, meta, scale, max_seq_len, num_splits)
    if meta.prefill_seqs:
        _prefill(q, kc, vc, ks, vs, km, vm, out, meta, scale)
    return out
