"""The model's matmuls on the CPU with oneDNN, over weights laid out once for its kernel.

PyTorch's ``F.linear`` on the CPU calls MKL's sgemm, which re-reads the weight in its plain row-major
layout at every call. oneDNN can reorder a weight once into the blocked layout its kernel streams
through (what vLLM-CPU's ``dispatch_cpu_unquantized_gemm`` does); for the skinny matmuls of a decode
step that is 1.3-2x faster here (SmolLM2's lm_head at 8 rows: 33.7 ms with ``F.linear``, 19.2 ms packed,
one thread; docs/performance.md). The packed layout replaces the plain weight, so memory does not grow,
except for an lm_head tied to the embedding table, which the embedding still reads.

Results differ from ``F.linear``'s in the last bits (another summation order), as any two BLAS
libraries do; the oracle tests hold greedy output to transformers' token for token.
"""

from __future__ import annotations

import logging
from typing import cast

import torch
from torch import nn

logger = logging.getLogger("engine")

# the number of rows oneDNN picks the layout for; any count runs, and 32 was as fast as 1, 8 or 128
# from 1 to 512 rows on the shapes of SmolLM2
BATCH_HINT = 32
PACKED_DTYPES = (torch.float32,)  # bf16 packs only where the CPU computes in it (AVX512-BF16, AMX): not measured


class PackedLinear(nn.Module):
    """A ``Linear`` whose weight oneDNN has laid out once; ``weight`` is that packed tensor (its shape and dtype
    are the plain weight's), or the plain weight itself where something else still reads it (a tied lm_head)."""

    def __init__(self, linear: nn.Linear, keep_weight: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), BATCH_HINT)
        self.weight = linear.weight if keep_weight else nn.Parameter(self.packed, requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def can_pack(model: nn.Module) -> bool:
    w = cast(nn.Linear, model.lm_head).weight
    return w.device.type == "cpu" and w.dtype in PACKED_DTYPES and torch.backends.mkldnn.is_available()


def pack_linears(model: nn.Module) -> bool:
    """Replace the decoder's projections and the lm_head with ``PackedLinear``s (once: a model whose weights
    another engine reuses is packed already). Returns whether the model's matmuls run packed."""
    if isinstance(model.lm_head, PackedLinear):
        return True
    if not can_pack(model):
        return False
    for layer in cast(nn.ModuleList, model.layers):
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            setattr(layer, name, PackedLinear(getattr(layer, name)))
    # a tied lm_head is the embedding table: the embedding still reads it, so the plain weight stays
    head, embed = cast(nn.Linear, model.lm_head), cast(nn.Embedding, model.embed_tokens)
    tied = head.weight.data_ptr() == embed.weight.data_ptr()
    model.lm_head = PackedLinear(head, keep_weight=tied)
    logger.info("matmuls: oneDNN over weights packed once (CPU, %s)", str(head.weight.dtype).split(".")[-1])
    return True
