"""A checkpoint's config.json, read without transformers' model-specific config classes when it can be.

Importing ``transformers.models.llama.configuration_llama`` pulls in torch.distributed and sympy (about
2 s at every start). A config.json that states every value the engine reads is loaded as a plain
``PreTrainedConfig`` instead; one that leaves a value to its class's default (a missing
``tie_word_embeddings`` means False for Llama, True for the base class) or uses a RoPE scaling goes
through ``AutoConfig``, so no default is ever guessed.
"""

from __future__ import annotations

import json
from pathlib import Path

# what the engine reads from a config; each must be in the file for the plain path
STATED = (
    "model_type",
    "hidden_size",
    "num_attention_heads",
    "num_hidden_layers",
    "num_key_value_heads",
    "rms_norm_eps",
    "tie_word_embeddings",
    "max_position_embeddings",
    "vocab_size",
    "eos_token_id",
)
PLAIN_MODEL_TYPES = ("llama", "qwen2", "mistral")


def stated_plainly(d: dict) -> bool:
    if d.get("model_type") not in PLAIN_MODEL_TYPES or any(k not in d for k in STATED):
        return False
    if d.get("quantization_config") or d.get("hidden_act", "silu") != "silu":
        return False
    if d["model_type"] in ("mistral", "qwen2") and "sliding_window" not in d:
        return False
    rope = d.get("rope_parameters")
    if rope is None:  # the older layout: rope_theta beside rope_scaling
        return d.get("rope_scaling") is None and "rope_theta" in d
    return rope.get("rope_type", "default") == "default" and "rope_theta" in rope


def read_config(folder: Path):
    """The config of a checkpoint folder: a plain ``PreTrainedConfig`` if the file states everything."""
    d = json.loads((folder / "config.json").read_text())
    if stated_plainly(d):
        from transformers.configuration_utils import PreTrainedConfig

        return PreTrainedConfig.from_dict(d)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(folder))
