"""Fused Triton kernels for a decoder layer's small ops: one launch where the torch path takes several.

* ``fused_add_rms_norm``: the residual add and transformers' LlamaRMSNorm (about 8 torch ops -> 1);
* ``rope_and_store``: rotary embedding of q (in place) and k, and the store of k and v into the
  paged KV cache, plain or quantized (about 12 torch ops and the store kernel -> 1);
* ``silu_and_mul``: ``silu(gate) * up`` of the fused gate/up projection (3 ops -> 1).

Each keeps transformers' rounding points, so fp32 results agree with the torch path to fp32
rounding and 16-bit ones to an ulp (rotary rounds once where torch rounds each op). On the CPU they
run under the Triton interpreter (``TRITON_INTERPRET=1``), which is how the tests check them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention.triton_paged import _parts, _store_values, interpreted


def _row_warps(block: int) -> int:
    """Warps for a one-row-per-program kernel: about 16 elements a thread (two 16-byte fp16 vectors),
    so a 4096-wide row gets 8 warps, and small rows are not spread over idle threads."""
    return max(1, min(16, block // 512)) if not interpreted() else 1


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every output's allocation (the tests fill them with NaN to see that each element is written)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """A 2-D view whose rows may be strided but whose elements are contiguous."""
    return x if x.stride(-1) == 1 else x.contiguous()


# -- rounding --------------------------------------------------------------------------------------
@triton.jit
def _round(x, DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """fp32 ``x`` rounded to nearest-even in ``DTYPE``, as torch rounds. A GPU's conversion does that;
    Triton's interpreter truncates to bf16, so there the rounding is done on the bits first (exact then)."""
    if INTERPRETED and DTYPE == tl.bfloat16:
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        x = u.to(tl.float32, bitcast=True)
    return x.to(DTYPE)


# -- residual add + RMSNorm ------------------------------------------------------------------------
@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    eps,
    H: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # h + o in the model dtype: the fp32 sum of two 16-bit values rounds like a 16-bit add.
        x = _round(x.to(tl.float32) + res.to(tl.float32), x_ptr.dtype.element_ty, INTERPRETED)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    hf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.math.div_rn(tl.sum(hf * hf, axis=0), H) + eps)  # IEEE division, as torch's mean
    y = _round(hf * rstd, x_ptr.dtype.element_ty, INTERPRETED)  # LlamaRMSNorm rounds to the input dtype
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = _round(w.to(tl.float32) * y.to(tl.float32), out_ptr.dtype.element_ty, INTERPRETED)
    tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight * rmsnorm(r), r)`` with ``r = residual + x`` rounded to the model dtype; with no
    ``residual``, a plain RMSNorm and ``r`` is ``x`` itself. ``x``, ``residual``: ``[T, H]``.

    Both outputs are new tensors (the inputs are left as they are). The output's dtype is torch's
    promotion of ``weight`` and ``x`` (the model dtype when both are in it)."""
    t, h = x.shape
    x = _rows(x)
    out = _empty((t, h), torch.promote_types(weight.dtype, x.dtype), x.device)
    if residual is None:
        res, res_out = x, x
    else:
        res = _rows(residual)
        res_out = _empty((t, h), x.dtype, x.device)
    if t:
        block = triton.next_power_of_2(h)
        _add_rms_norm_kernel[(t,)](
            x,
            res,
            weight.contiguous(),
            out,
            res_out,
            x.stride(0),
            res.stride(0),
            out.stride(0),
            res_out.stride(0),
            eps,
            H=h,
            BLOCK=block,
            HAS_RESIDUAL=residual is not None,
            INTERPRETED=interpreted(),
            num_warps=_row_warps(block),
        )
    return out, res_out


# -- rotary embedding + KV store -------------------------------------------------------------------
@triton.jit
def _rotate(x_ptr, row_off, hmask, d, c, s, sign, HEAD_DIM: tl.constexpr, INTERPRETED: tl.constexpr):
    """``x * cos + rotate_half(x) * sin`` of the head rows at ``x_ptr + row_off``: computed in fp32
    and rounded once to the dtype. ``rotate_half`` reads each element's partner half a head away
    (``sign`` negates the first half's), so no tile is split or concatenated."""
    x = tl.load(x_ptr + row_off[:, None] + d[None, :], mask=hmask[:, None], other=0.0)
    partner = tl.load(
        x_ptr + row_off[:, None] + ((d + HEAD_DIM // 2) % HEAD_DIM)[None, :], mask=hmask[:, None], other=0.0
    )
    r = x.to(tl.float32) * c[None, :] + (sign[None, :] * partner.to(tl.float32)) * s[None, :]
    return _round(r, x_ptr.dtype.element_ty, INTERPRETED)


@triton.jit
def _rope_store_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cs_ptr,
    pos_ptr,
    slot_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QH_BLOCK: tl.constexpr,
    KVH_BLOCK: tl.constexpr,
    K_MODE: tl.constexpr,
    V_MODE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """One program: token ``t``'s query heads and KV heads of head group ``g``."""
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    # cos and sin repeat after half a head (transformers' emb = cat(freqs, freqs)): the cache keeps one half.
    c = tl.load(cs_ptr + pos * stride_cs + d % (HEAD_DIM // 2)).to(tl.float32)
    s = tl.load(cs_ptr + pos * stride_cs + HEAD_DIM // 2 + d % (HEAD_DIM // 2)).to(tl.float32)
    sign = tl.where(d < HEAD_DIM // 2, -1.0, 1.0)

    hq = g * QH_BLOCK + tl.arange(0, QH_BLOCK)
    qmask = hq < NUM_HEADS
    q_rows = q_ptr + t * stride_qt
    qr = _rotate(q_rows, hq * stride_qh, qmask, d, c, s, sign, HEAD_DIM, INTERPRETED)
    # In place: every element's partner was loaded above, by this program, before this store.
    tl.store(q_rows + (hq * stride_qh)[:, None] + d[None, :], qr, mask=qmask[:, None])

    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # -1: a padded row, nothing to store
        hk = g * KVH_BLOCK + tl.arange(0, KVH_BLOCK)
        kmask = hk < NUM_KV_HEADS
        kr = _rotate(k_ptr + t * stride_kt, hk * stride_kh, kmask, d, c, s, sign, HEAD_DIM, INTERPRETED)
        _store_values(kr, hk, kmask, k_cache_ptr, k_scale_ptr, slot, K_MODE, NUM_KV_HEADS, KVH_BLOCK, HEAD_DIM)
        v = tl.load(v_ptr + t * stride_vt + (hk * stride_vh)[:, None] + d[None, :], mask=kmask[:, None], other=0.0)
        _store_values(v, hk, kmask, v_cache_ptr, v_scale_ptr, slot, V_MODE, NUM_KV_HEADS, KVH_BLOCK, HEAD_DIM)


def _head_groups(tokens: int, num_heads: int, num_kv_heads: int) -> tuple[int, int, int]:
    """(groups, query heads a group, KV heads a group). Few tokens: split the heads over up to 8
    programs a token so a decode step uses more than a handful of SMs; many tokens fill the card
    with one program a token, which reads cos/sin and the slot once."""
    groups = 1 if tokens >= 128 else min(8, num_kv_heads)
    kvh_block = triton.next_power_of_2(triton.cdiv(num_kv_heads, groups))
    qh_block = triton.next_power_of_2(triton.cdiv(num_heads, groups))
    return max(triton.cdiv(num_heads, qh_block), triton.cdiv(num_kv_heads, kvh_block)), qh_block, kvh_block


def rope_and_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    k_cache,
    v_cache,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotate ``q`` in place and ``k`` (NeoX / transformers' ``rotate_half`` style) at ``positions``,
    then store the rotated k and v at ``slot_mapping`` (-1: store nothing) into the paged caches,
    plain tensors or ``QuantizedKV``, exactly as ``store_kv`` would. Returns ``q``.

    ``q``: ``[T, H, D]``, ``k``/``v``: ``[T, KVH, D]``, each with a contiguous last dim (views into
    the fused qkv output are fine); ``k`` itself is left unrotated (only the cache gets its rotation).
    ``cos_sin_cache``: ``[max_pos, D]`` from ``rotary.build_cos_sin_cache``; positions must be below max_pos.
    """
    t, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("rope_and_store needs q, k and v with a contiguous last dimension")
    if head_dim & (head_dim - 1) or cos_sin_cache.shape[1] != head_dim or cos_sin_cache.stride(1) != 1:
        raise ValueError(
            f"head_dim must be a power of two matching the cos/sin cache, got {head_dim} and "
            f"{tuple(cos_sin_cache.shape)}"
        )
    if t == 0:
        return q
    kc, ks, km = _parts(k_cache)
    vc, vs, vm = _parts(v_cache)
    groups, qh_block, kvh_block = _head_groups(t, num_heads, num_kv_heads)
    _rope_store_kernel[(t, groups)](
        q,
        k,
        v,
        cos_sin_cache,
        positions,
        slot_mapping,
        kc,
        vc,
        ks,
        vs,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos_sin_cache.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        QH_BLOCK=qh_block,
        KVH_BLOCK=kvh_block,
        K_MODE=km,
        V_MODE=vm,
        INTERPRETED=interpreted(),
        num_warps=max(2, min(8, qh_block * head_dim // 512)),
        # No fused multiply-adds: x*cos and rot*sin round apart, as torch's fp32 ops do.
        enable_fp_fusion=False,
    )
    return q


# -- SiLU and multiply -----------------------------------------------------------------------------
@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_x + inter + cols, mask=mask, other=0.0)
    # torch's silu: x / (1 + exp(-x)) in fp32, rounded to the dtype; then a dtype multiply.
    act = _round(tl.math.div_rn(gate, 1.0 + tl.exp(-gate)), out_ptr.dtype.element_ty, INTERPRETED)
    out = _round(act.to(tl.float32) * up.to(tl.float32), out_ptr.dtype.element_ty, INTERPRETED)
    tl.store(out_ptr + t * stride_o + cols, out, mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up = cat(gate, up)``: ``[T, 2I]`` -> a new ``[T, I]``."""
    t, two_i = gate_up.shape
    inter = two_i // 2
    gate_up = _rows(gate_up)
    out = _empty((t, inter), gate_up.dtype, gate_up.device)
    if t:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(t, triton.cdiv(inter, block))](
            gate_up,
            out,
            gate_up.stride(0),
            out.stride(0),
            inter,
            BLOCK=block,
            INTERPRETED=interpreted(),
            num_warps=_row_warps(block) * 2,
        )
    return out
