"""The fused ops on the CPU: ``FusedOps``' three calls from the C library (``csrc/cpu_fused.c``).

A decode step of a small model spends a tenth of its time in a layer's small ops (two RMSNorms with their residual
adds, rotary, the KV store, SiLU-and-mul), as about 20 PyTorch calls a layer, each a dispatch, an allocation and a
pass over rows the weights' streaming has just pushed out of cache. Here they are 4 calls a layer; the residual
travels apart and is added inside the next norm, in place (vLLM's layer shape, as the Triton backend's).

Rounding: rotary and the store are bitwise the PyTorch path's over the same cos/sin table; the norms sum their
squares in another order, and SiLU takes its exponential from a polynomial within 2 ulp (``cpu_math.h``): the last
bits differ, as two BLAS libraries' do. Greedy output is held to transformers' token for token
(tests/engine/runner/test_cpu_fused.py).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch


def _rows(x: torch.Tensor) -> torch.Tensor:
    """A 2-D tensor whose rows may be strided but whose elements are contiguous."""
    return x if x.stride(-1) == 1 else x.contiguous()


@dataclass(frozen=True, slots=True)
class CpuFusedOps:
    """What ``LlamaForCausalLM.forward(ops=...)`` calls on the CPU: float32 weights, a plain float32 pool."""

    cos_sin_cache: torch.Tensor  # [max_pos, head_dim]: cos in the first half, sin in the second
    lib: ctypes.CDLL

    def check_step(self, positions: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor) -> None:
        """Once a step, before the layers: the C code indexes the rotary table by position and the cache by slot
        with no bounds of its own (PyTorch's ops would raise), so an out-of-range row is refused here."""
        if positions.dtype != torch.int64 or slot_mapping.dtype != torch.int64:
            raise ValueError("positions and slots must be int64")
        if positions.numel() and not 0 <= int(positions.min()) <= int(positions.max()) < self.cos_sin_cache.shape[0]:
            raise ValueError(f"a position outside the rotary table's {self.cos_sin_cache.shape[0]} rows")
        rows = k_cache.shape[0] * k_cache.shape[1]
        if slot_mapping.numel() and int(slot_mapping.max()) >= rows:
            raise ValueError(f"a slot outside the KV cache's {rows} slots")

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(x + residual), x + residual); the residual is updated in place (the layers' own tensor, made
        here from the first layer's input)."""
        x = _rows(x)
        t, n = x.shape
        if residual is None:
            residual, add = x.clone(), 0  # the embedding's rows: copied, nothing outside is written
        else:
            add = 1
        if not (x.dtype == residual.dtype == weight.dtype == torch.float32) or residual.shape != x.shape:
            raise ValueError("add_rms_norm runs float32 rows of one shape")
        if not residual.is_contiguous() or not weight.is_contiguous():
            raise ValueError("add_rms_norm needs a contiguous residual and weight")
        out = torch.empty_like(residual)
        self.lib.kvscope_add_rms_norm(
            x.data_ptr(),
            x.stride(0),
            residual.data_ptr(),
            add,
            weight.data_ptr(),
            out.data_ptr(),
            t,
            n,
            eps,
            torch.get_num_threads(),
        )
        return out, residual

    def rope_and_store(self, q, k, v, positions, k_cache, v_cache, slot_mapping) -> torch.Tensor:
        """``q`` ``[T, H, D]`` rotated in place and returned; ``k`` rotated into the cache (``k`` itself left as it
        was), ``v`` copied beside it, at ``slot_mapping`` (-1: nothing stored)."""
        t, h, d = q.shape
        if t == 0:
            return q
        if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
            raise ValueError("rope_and_store needs q, k and v with a contiguous last dimension")
        kvh = k.shape[1]
        for c in (k_cache, v_cache):
            if c.dtype != torch.float32 or not c.is_contiguous() or tuple(c.shape[-2:]) != (kvh, d):
                raise ValueError(f"rope_and_store needs contiguous float32 caches of [..., {kvh}, {d}]")
        if not (q.dtype == k.dtype == v.dtype == torch.float32):
            raise ValueError("rope_and_store runs float32 q, k and v")
        positions, slot_mapping = positions.contiguous(), slot_mapping.contiguous()
        self.lib.kvscope_rope_and_store(
            q.data_ptr(),
            q.stride(0),
            q.stride(1),
            k.data_ptr(),
            k.stride(0),
            k.stride(1),
            v.data_ptr(),
            v.stride(0),
            v.stride(1),
            self.cos_sin_cache.data_ptr(),
            positions.data_ptr(),
            slot_mapping.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            t,
            h,
            kvh,
            d,
            torch.get_num_threads(),
        )
        return q

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of the fused gate/up projection's output ``[T, 2I]``: ``[T, I]``."""
        gate_up = _rows(gate_up)
        t, i = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty(t, i)
        self.lib.kvscope_silu_and_mul(
            gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), t, i, torch.get_num_threads()
        )
        return out
