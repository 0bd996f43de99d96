"""Paged attention on the CPU: decode from a small C kernel (``csrc/cpu_decode.c``), prefill as ``torch_ref``.

PyTorch's decode attention (``torch_ref``) gathers every decoding sequence's blocks into a contiguous copy, padded
to the longest context, then runs SDPA over it: K and V are read, written and read again, every layer. The kernel
reads each sequence's K and V rows once, where they lie in the pool, and stops at its own length (what vLLM-CPU's
``cpu_attention_with_kv_cache`` does). At 32 decoding sequences of ~240 tokens on SmolLM2-135M that took 3.8x
less time than the gather and SDPA, 2.6x at 8 (docs/performance.md).

The kernel is part of the CPU kernels' library (``cpu_kernels``, built on first use). Where it cannot be built
(no compiler), or with ``KVSCOPE_CPU_ATTENTION=torch``, the CPU runs ``torch_ref`` instead: the same results up to
float rounding.
"""

from __future__ import annotations

import torch

from .. import cpu_kernels
from ..kv_quant import QuantizedKV
from . import torch_ref
from .metadata import AttentionMetadata

ENV_SWITCH = "KVSCOPE_CPU_ATTENTION"  # "torch": PyTorch's ops for attention (the fused ops still run)


def kernel():
    """The compiled kernel (a ctypes function), or None where it is switched off or cannot be built."""
    return cpu_kernels.function("kvscope_decode_attention", ENV_SWITCH)


def usable(k_cache, dtype: torch.dtype) -> bool:
    """Whether the kernel runs this cache: a plain float32 pool on the CPU (quantized pools dequantize per block)."""
    return (
        not isinstance(k_cache, QuantizedKV)
        and k_cache.device.type == "cpu"
        and k_cache.dtype == dtype == torch.float32
        and k_cache.is_contiguous()
        and kernel() is not None
    )


def _decode_tables(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoding sequences' block tables and lengths, taken once a step (every layer reads them)."""
    state = meta.backend_state.get("cpu_decode")
    if state is None:
        if not meta.prefill_seqs:  # every sequence decodes, in order
            state = (meta.block_tables, meta.seq_lens)
        else:
            state = (meta.block_tables[meta.decode_seqs], meta.seq_lens[meta.decode_seqs])
        meta.backend_state["cpu_decode"] = state
    return state


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``q``: ``[B, H, D]`` contiguous float32, one token per sequence; ``tables``: ``[B, >= its blocks]`` and
    ``lens``: ``[B]``, int64. Returns ``[B, H, D]``."""
    b, h, d = q.shape
    num_blocks, bs, kvh, _ = k_cache.shape
    tables, lens = tables.contiguous(), lens.contiguous()
    out = torch.empty_like(q)
    rc = kernel()(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        lens.data_ptr(),
        out.data_ptr(),
        b,
        h,
        kvh,
        d,
        bs,
        tables.shape[1],
        scale,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise MemoryError("CPU decode attention: no memory for its scratch")
    return out


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """``torch_ref.paged_attention``'s contract (``q``: ``[T, H, D]``, returns ``[T, H, D]``), its decode rows from
    the kernel where it runs this cache."""
    if not meta.decode_seqs.numel() or not usable(k_cache, q.dtype):
        return torch_ref.paged_attention(q, k_cache, v_cache, meta, scale)
    tables, lens = _decode_tables(meta)
    decode_only = not meta.prefill_seqs
    qd = q if decode_only else q[meta.decode_tokens]
    o = decode_attention(qd.contiguous(), k_cache, v_cache, tables, lens, scale)
    if decode_only:
        return o
    out = torch.empty_like(q)
    out[meta.decode_tokens] = o
    torch_ref.prefill_attention(q, k_cache, v_cache, meta, scale, out)
    return out
