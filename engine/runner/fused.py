"""A decoder layer's small ops fused (``LayerOps``), bound to one engine with its rotary table, built once: the
Triton backend's kernels (``fused_ops``) on a card, the C library's (``cpu_fused``) on the CPU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .models.rotary import DYNAMIC_ROPE_TYPES, build_cos_sin_cache, rope_type


class LayerOps(Protocol):
    """What ``LlamaForCausalLM.forward(ops=...)`` calls instead of PyTorch's ops one by one. ``add_rms_norm``
    returns (the normed sum, the new residual) and may update the residual it is given in place (the CPU's does):
    a caller passes a residual it owns and reads only the one returned."""

    @property
    def cos_sin_cache(self) -> torch.Tensor: ...  # [max_pos, head_dim]: cos in the first half, sin in the second

    def check_step(self, positions, slot_mapping, k_cache) -> None: ...

    def add_rms_norm(self, x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rope_and_store(self, q, k, v, positions, k_cache, v_cache, slot_mapping) -> torch.Tensor: ...

    def silu_and_mul(self, gate_up) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class FusedOps:
    """The Triton kernels."""

    cos_sin_cache: torch.Tensor  # [max_pos, head_dim]: cos in the first half, sin in the second

    @staticmethod
    def check_step(positions, slot_mapping, k_cache) -> None:
        """Nothing: on a card a check would wait for the device (the kernels mask their loads by the step's own
        lengths, and the scheduler keeps positions below the table's max_model_len)."""

    @staticmethod
    def add_rms_norm(x, residual, weight, eps):
        from .fused_ops import fused_add_rms_norm

        return fused_add_rms_norm(x, residual, weight, eps)

    def rope_and_store(self, q, k, v, positions, k_cache, v_cache, slot_mapping):
        from .fused_ops import rope_and_store

        return rope_and_store(q, k, v, self.cos_sin_cache, positions, k_cache, v_cache, slot_mapping)

    @staticmethod
    def silu_and_mul(gate_up):
        from .fused_ops import silu_and_mul

        return silu_and_mul(gate_up)


def fused_ops_for(
    model, max_pos: int, backend: str = "triton", kv_cache_dtype: str = "auto"
) -> tuple[LayerOps | None, str]:
    """The model's fused ops for an attention backend ("triton" or "cpu"), or None and why not: rotary that changes
    with the sequence length (dynamic, longrope) has no fixed table; the Triton kernels tile a head by powers of two;
    the C kernels run float32 over a plain pool."""
    if rope_type(model.config) in DYNAMIC_ROPE_TYPES:
        return None, f"{rope_type(model.config)} rotary has no fixed table"
    device = model.embed_tokens.weight.device
    dtype = model.embed_tokens.weight.dtype
    if backend == "cpu":
        from . import cpu_kernels
        from .cpu_fused import CpuFusedOps

        if dtype != torch.float32:
            return None, f"the CPU's fused kernels run float32, not {str(dtype).split('.')[-1]}"
        if kv_cache_dtype != "auto":
            return None, f"the CPU's fused kernels store a plain pool, not {kv_cache_dtype}"
        lib = cpu_kernels.library()
        if lib is None:
            return None, "the CPU kernels could not be built"
        return CpuFusedOps(build_cos_sin_cache(model.rotary_emb, max_pos, dtype, device), lib), ""
    if model.head_dim & (model.head_dim - 1):
        return None, f"head_dim {model.head_dim} is not a power of two"
    return FusedOps(build_cos_sin_cache(model.rotary_emb, max_pos, dtype, device)), ""
