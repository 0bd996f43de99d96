"""The Triton backend's fused kernels (``fused_ops``) bound to one engine: its rotary table, built once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .models.rotary import DYNAMIC_ROPE_TYPES, rope_type


@dataclass(frozen=True, slots=True)
class FusedOps:
    """What ``LlamaForCausalLM.forward(ops=...)`` calls instead of PyTorch's ops one by one."""

    cos_sin_cache: torch.Tensor  # [max_pos, head_dim]: cos in the first half, sin in the second

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


def fused_ops_for(model, max_pos: int) -> tuple[FusedOps | None, str]:
    """The model's fused ops, or None and why not: rotary that changes with the sequence length (dynamic,
    longrope) has no fixed table, and the kernels tile a head by powers of two."""
    if rope_type(model.config) in DYNAMIC_ROPE_TYPES:
        return None, f"{rope_type(model.config)} rotary has no fixed table"
    if model.head_dim & (model.head_dim - 1):
        return None, f"head_dim {model.head_dim} is not a power of two"
    from .fused_ops import build_cos_sin_cache

    device = model.embed_tokens.weight.device
    dtype = model.embed_tokens.weight.dtype
    return FusedOps(build_cos_sin_cache(model.rotary_emb, max_pos, dtype, device)), ""
