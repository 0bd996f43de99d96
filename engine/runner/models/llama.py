"""Llama-family decoder (Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2) on a paged KV cache.

Weights come from a transformers model: q/k/v and gate/up are fused into one
matmul each. RoPE reuses the checkpoint's own rotary module, so every scaling
variant (linear, dynamic, llama3, yarn, ...) matches transformers exactly.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.metadata import AttentionMetadata

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor]
StoreFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def check_supported(config) -> None:
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported architecture {mt!r}: kvscope runs {', '.join(SUPPORTED_MODEL_TYPES)}")
    sw = getattr(config, "sliding_window", None)
    if sw is not None and (mt == "mistral" or getattr(config, "use_sliding_window", False)):
        if sw < getattr(config, "max_position_embeddings", 0):
            raise ValueError(f"{mt} with a sliding window of {sw} tokens is not supported")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported activation {config.hidden_act!r}")


class RMSNorm(nn.Module):
    """Same arithmetic as transformers' LlamaRMSNorm: normalise in fp32, scale in the model dtype."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def _fuse(linears: list[nn.Linear], consume: bool = False) -> nn.Linear:
    """One Linear for several that read the same input. With ``consume`` the sources give
    up their storage as soon as it is copied, so loading a 7B model never holds two copies."""
    w = torch.cat([lin.weight.data for lin in linears], 0)
    has_bias = any(lin.bias is not None for lin in linears)
    out = nn.Linear(w.shape[1], w.shape[0], bias=has_bias, device=w.device, dtype=w.dtype)
    out.weight = nn.Parameter(w, requires_grad=False)
    if has_bias:
        out.bias = nn.Parameter(torch.cat([
            lin.bias.data if lin.bias is not None else torch.zeros(lin.out_features, dtype=w.dtype, device=w.device)
            for lin in linears]), requires_grad=False)
    if consume:
        for lin in linears:
            lin.weight = nn.Parameter(lin.weight.data.new_empty(0), requires_grad=False)
            if lin.bias is not None:
                lin.bias = nn.Parameter(lin.bias.data.new_empty(0), requires_grad=False)
    return out


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class DecoderLayer(nn.Module):
    def __init__(self, hf_layer, config, consume: bool = False) -> None:
        super().__init__()
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scale = self.head_dim ** -0.5
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = _fuse([attn.q_proj, attn.k_proj, attn.v_proj], consume)
        self.o_proj = attn.o_proj
        self.gate_up_proj = _fuse([mlp.gate_proj, mlp.up_proj], consume)
        self.down_proj = mlp.down_proj
        self.input_layernorm = RMSNorm(hf_layer.input_layernorm.weight.data, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hf_layer.post_attention_layernorm.weight.data, config.rms_norm_eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, attention: AttentionFn, store: StoreFn) -> torch.Tensor:
        t = h.shape[0]
        x = self.input_layernorm(h)
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # Store the whole batch's K/V before any attention reads the cache.
        store(k, v, k_cache, v_cache, meta.slot_mapping)
        o = attention(q, k_cache, v_cache, meta, self.scale)
        h = h + self.o_proj(o.reshape(t, self.q_size))
        x = self.post_attention_layernorm(h)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return h + self.down_proj(F.silu(gate) * up)


class LlamaForCausalLM(nn.Module):
    """Built from a transformers ``*ForCausalLM``; the source model can be dropped afterwards.

    ``consume=True`` (the engine's own loads) empties the source's fused projections as it goes.
    """

    def __init__(self, hf_model, consume: bool = False) -> None:
        super().__init__()
        config = hf_model.config
        check_supported(config)
        self.config = config
        inner = hf_model.model
        self.embed_tokens = inner.embed_tokens
        self.layers = nn.ModuleList(DecoderLayer(layer, config, consume) for layer in inner.layers)
        self.norm = RMSNorm(inner.norm.weight.data, config.rms_norm_eps)
        self.lm_head = hf_model.lm_head
        self.rotary_emb = inner.rotary_emb
        first = self.layers[0]
        self.num_layers = len(self.layers)
        self.num_kv_heads, self.head_dim = first.num_kv_heads, first.head_dim

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                attention: AttentionFn, store: StoreFn) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(h, positions[None])
        cos, sin = cos[0][:, None, :], sin[0][:, None, :]  # [T, 1, D]: broadcast over heads
        for layer, (kc, vc) in zip(self.layers, kv_caches):
            h = layer(h, cos, sin, kc, vc, meta, attention, store)
        return self.norm(h)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
