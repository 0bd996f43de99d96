"""Llama-family decoder (Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2) on a paged KV cache.

Weights come by name (transformers' names) from a safetensors checkpoint or a
transformers model in memory: q/k/v and gate/up are fused into one matmul each.
RoPE is ``rotary.build_rotary``: transformers' own formulas for every scaling
variant, without importing its modeling code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.metadata import AttentionMetadata, SampledRows

if TYPE_CHECKING:
    from ..fused import LayerOps

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
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            # the same ops in one call (bitwise the same result): a decode step runs 61 of these
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


# take(name) -> the checkpoint tensor of that name (transformers' names), or None where it has none
# (biases). A loader may hand each tensor out once and forget it, so nothing is held twice.
WeightSource = Callable[[str], "torch.Tensor | None"]


def _linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    """A Linear over tensors already loaded: no fresh initialisation, no copy."""
    out = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(out)
    out.in_features, out.out_features = weight.shape[1], weight.shape[0]
    out.weight = nn.Parameter(weight, requires_grad=False)
    out.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None  # type: ignore[assignment]
    return out


def _need(take: WeightSource, name: str) -> torch.Tensor:
    """A tensor the model cannot run without: a checkpoint that lacks it is refused in one line."""
    t = take(name)
    if t is None:
        raise ValueError(f"the checkpoint has no {name}")
    return t


def _fused(take: WeightSource, prefix: str, names: list[str]) -> nn.Linear:
    """One Linear for several projections that read the same input (q/k/v, gate/up)."""
    weights = [_need(take, f"{prefix}{n}.weight") for n in names]
    biases = [take(f"{prefix}{n}.bias") for n in names]
    w = torch.cat(weights, 0)
    b = None
    if any(x is not None for x in biases):
        b = torch.cat([x if x is not None else w.new_zeros(wi.shape[0]) for x, wi in zip(biases, weights)])
    return _linear(w, b)


def hf_weights(hf_model, consume: bool = False) -> WeightSource:
    """The weights of a loaded transformers model. With ``consume`` each parameter gives up its
    storage as it is taken, so building from a 7B model never holds two copies of it."""
    params = dict(hf_model.named_parameters(remove_duplicate=False))

    def take(name: str) -> torch.Tensor | None:
        p = params.get(name)
        if p is None:
            return None
        t = p.data
        if consume and t.numel():
            p.data = t.new_empty(0)
        return t

    return take


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated: ``rotate_half(x) * sin == x.roll(d / 2, -1) * signed_sin(sin)``
    bitwise (a product's rounding does not depend on its sign), in two calls a layer instead of four."""
    s1, s2 = sin.chunk(2, dim=-1)
    return torch.cat((-s1, s2), dim=-1)


class DecoderLayer(nn.Module):
    def __init__(self, config, take: WeightSource, prefix: str) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scale = self.head_dim**-0.5
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        attn, mlp = f"{prefix}self_attn.", f"{prefix}mlp."
        self.qkv_proj = _fused(take, attn, ["q_proj", "k_proj", "v_proj"])
        self.o_proj = _linear(_need(take, f"{attn}o_proj.weight"), take(f"{attn}o_proj.bias"))
        self.gate_up_proj = _fused(take, mlp, ["gate_proj", "up_proj"])
        self.down_proj = _linear(_need(take, f"{mlp}down_proj.weight"), take(f"{mlp}down_proj.bias"))
        self.input_layernorm = RMSNorm(_need(take, f"{prefix}input_layernorm.weight"), config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(
            _need(take, f"{prefix}post_attention_layernorm.weight"), config.rms_norm_eps
        )

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        attention: AttentionFn,
        store: StoreFn,
        sampled: SampledRows | None = None,
    ) -> torch.Tensor:
        """``sampled``: past the K/V store, only these rows (the model's last layer; see ``SampledRows``)."""
        t = h.shape[0]
        x = self.input_layernorm(h)
        qkv = self.qkv_proj(x)
        # RoPE over q and k at once (their heads side by side), as transformers' q * cos + rotate_half(q) * sin
        qk = qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = qk * cos + qk.roll(self.head_dim // 2, -1) * sin_signed
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        # Store the whole batch's K/V before any attention reads the cache.
        store(k, v, k_cache, v_cache, meta.slot_mapping)
        if sampled is not None:
            if not sampled.rows.numel():
                return h[:0]
            (q, h), meta, t = sampled.take(q, h), sampled.meta, sampled.rows.numel()
        o = attention(q, k_cache, v_cache, meta, self.scale)
        h = h + self.o_proj(o.reshape(t, self.q_size))
        x = self.post_attention_layernorm(h)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return h + self.down_proj(F.silu(gate) * up)

    def forward_fused(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        ops: LayerOps,
        positions: torch.Tensor,
        k_cache,
        v_cache,
        meta: AttentionMetadata,
        attention: AttentionFn,
        sampled: SampledRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same layer in 7 launches besides the matmuls' 4 (vLLM's shape): the residual travels apart and
        each add happens inside the next RMSNorm; rotary and the KV store are one kernel, SiLU-and-mul one.
        Returns (this layer's last output, the residual before it); their sum is ``forward``'s result, for the rows
        of ``sampled`` alone where it is given."""
        t = h.shape[0]
        x, residual = ops.add_rms_norm(h, residual, self.input_layernorm.weight, self.input_layernorm.eps)
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = ops.rope_and_store(
            q.view(t, self.num_heads, self.head_dim),
            k.view(t, self.num_kv_heads, self.head_dim),
            v.view(t, self.num_kv_heads, self.head_dim),
            positions,
            k_cache,
            v_cache,
            meta.slot_mapping,
        )
        if sampled is not None:
            if not sampled.rows.numel():
                return h[:0], residual[:0]
            (q, residual), meta, t = sampled.take(q, residual), sampled.meta, sampled.rows.numel()
        o = attention(q, k_cache, v_cache, meta, self.scale)
        x, residual = ops.add_rms_norm(
            self.o_proj(o.reshape(t, self.q_size)),
            residual,
            self.post_attention_layernorm.weight,
            self.post_attention_layernorm.eps,
        )
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x))), residual


class LlamaForCausalLM(nn.Module):
    """Built from a config and a ``WeightSource``: a checkpoint read straight from safetensors
    (``loader.load_model``) or a transformers model already in memory (``from_hf``)."""

    # declared: nn.Module's __getattr__ would type them as tensors or modules
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __init__(self, config, take: WeightSource, rotary: nn.Module) -> None:
        super().__init__()
        check_supported(config)
        self.config = config
        embed = _need(take, "model.embed_tokens.weight")
        self.embed_tokens = nn.Embedding.from_pretrained(embed, freeze=True)
        self.layers = nn.ModuleList(
            DecoderLayer(config, take, f"model.layers.{i}.") for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(_need(take, "model.norm.weight"), config.rms_norm_eps)
        head = take("lm_head.weight")
        self.lm_head = _linear(head if head is not None and head.numel() else embed)  # tied: one tensor
        self.rotary_emb = rotary
        first = cast(DecoderLayer, self.layers[0])
        self.num_layers = len(self.layers)
        self.num_kv_heads, self.head_dim = first.num_kv_heads, first.head_dim

    @classmethod
    def from_hf(cls, hf_model, consume: bool = False) -> LlamaForCausalLM:
        """From a transformers ``*ForCausalLM``; ``consume=True`` (the engine's own loads) empties
        the source as it goes, a borrowed model is left untouched."""
        check_supported(hf_model.config)  # before reading ``.model.rotary_emb``, which others lack
        return cls(hf_model.config, hf_weights(hf_model, consume), hf_model.model.rotary_emb)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        attention: AttentionFn,
        store: StoreFn,
        ops: LayerOps | None = None,
        sampled: SampledRows | None = None,
    ) -> torch.Tensor:
        """``ops``: the fused kernels (``fused.LayerOps``: the Triton backend's or the CPU's C ones); without them,
        PyTorch's ops one by one with ``store`` (the reference). ``sampled``: the rows whose hidden state the step
        reads (``SampledRows``); the result then holds those rows alone, in their order."""
        h = self.embed_tokens(input_ids)
        last = self.num_layers - 1
        if ops is not None:
            ops.check_step(positions, meta.slot_mapping, kv_caches[0][0])
            residual = None
            for i, (layer, (kc, vc)) in enumerate(zip(self.layers, kv_caches)):
                h, residual = cast(DecoderLayer, layer).forward_fused(
                    h, residual, ops, positions, kc, vc, meta, attention, sampled if i == last else None
                )
            if not h.shape[0]:  # no row is read: the last layer stored its K/V and stopped
                return h
            return ops.add_rms_norm(h, residual, self.norm.weight, self.norm.eps)[0]
        cos, sin = self.rotary_emb(h, positions[None])
        cos, sin = cos[0][:, None, :], signed_sin(sin[0][:, None, :])  # [T, 1, D]: broadcast over heads
        for i, (layer, (kc, vc)) in enumerate(zip(self.layers, kv_caches)):
            h = layer(h, cos, sin, kc, vc, meta, attention, store, sampled if i == last else None)
        return self.norm(h)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
