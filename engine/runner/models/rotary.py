"""Rotary position embedding, built from the config without transformers' modeling code.

Importing a transformers model class costs about 3 s at start-up; this module needs only the config and
``modeling_rope_utils`` (the scaling formulas: linear, llama3, yarn, ...), so every static RoPE variant has
the very ``inv_freq`` and the same cos/sin arithmetic as transformers. Variants that change their
frequencies with the sequence length (dynamic, longrope) use the checkpoint's own module instead.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")


def rope_type(config) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params.get("rope_type", params.get("type", "default"))


def default_inv_freq(config) -> torch.Tensor:
    params = getattr(config, "rope_parameters", None) or {}
    base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


class RotaryEmbedding(nn.Module):
    """cos/sin for positions, as transformers' ``LlamaRotaryEmbedding.forward`` computes them."""

    attention_scaling: float
    inv_freq: torch.Tensor

    def __init__(self, config) -> None:
        super().__init__()
        kind = rope_type(config)
        if kind == "default":
            inv_freq, self.attention_scaling = default_inv_freq(config), 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[kind](config, None)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def build_rotary(config) -> nn.Module:
    """The native module for static RoPE; the checkpoint's own class for the dynamic kinds."""
    if rope_type(config) not in DYNAMIC_ROPE_TYPES:
        return RotaryEmbedding(config)
    mt = config.model_type
    module = importlib.import_module(f"transformers.models.{mt}.modeling_{mt}")
    cls = next(getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding"))
    return cls(config)


@torch.no_grad()
def build_cos_sin_cache(
    rotary_module: nn.Module, max_pos: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """``[max_pos, D]``: cos of every position in the first ``D/2`` columns, sin in the last ``D/2``,
    from the rotary module's own forward (transformers' formulas, attention scaling included, cast
    to ``dtype`` as the model's path casts them). Static RoPE kinds only: the dynamic ones
    (``rotary.DYNAMIC_ROPE_TYPES``) change their frequencies with the sequence length."""
    probe = torch.empty(1, dtype=dtype, device=device)
    positions = torch.arange(max_pos, device=device)[None]
    cos, sin = rotary_module(probe, positions)
    half = cos.shape[-1] // 2
    return torch.cat((cos[0, :, :half], sin[0, :, :half]), dim=-1).to(dtype).contiguous()
