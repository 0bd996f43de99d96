"""KV pool budgeting: how many blocks fit, and what that means in requests (vLLM's rule)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GiB = 2**30


@dataclass(frozen=True, slots=True)
class KVPoolPlan:
    """``total x utilization - weights - other tensors - activation peak - CUDA graphs - memory others hold``
    goes to KV blocks (vLLM's rule: everything measured at the profile is subtracted, not only the weights)."""

    total_bytes: int
    weights_bytes: int
    activation_peak_bytes: int
    other_bytes: int  # held outside this process's tensors (CUDA context, other processes)
    utilization: float
    block_bytes: int
    block_size: int
    max_model_len: int
    # Tensors this process holds besides the engine's weights (a caller's transformers model that the
    # engine borrowed from: its unfused projections stay allocated).
    held_bytes: int = 0
    # What the decode CUDA graphs' private memory pool will keep: the largest captured batch's activations
    # and logits, measured by an eager forward of that batch at the profile (estimate; 0 without graphs).
    graph_bytes: int = 0

    @property
    def planned_bytes(self) -> int:
        """What the plan lets the card's memory reach: ``total x utilization``."""
        return int(self.total_bytes * self.utilization)

    @property
    def kv_budget_bytes(self) -> int:
        return max(
            0,
            self.planned_bytes
            - self.weights_bytes
            - self.held_bytes
            - self.activation_peak_bytes
            - self.graph_bytes
            - self.other_bytes,
        )

    @property
    def num_blocks(self) -> int:
        return self.kv_budget_bytes // self.block_bytes

    @property
    def max_concurrency(self) -> float:
        """How many requests of the model's full context length fit at once."""
        return self.num_blocks * self.block_size / self.max_model_len

    def describe(self) -> str:
        held = f"other tensors {self.held_bytes / GiB:.2f} GiB, " if self.held_bytes else ""
        graphs = f"CUDA graphs {self.graph_bytes / GiB:.2f} GiB, " if self.graph_bytes else ""
        return (
            f"GPU memory {self.total_bytes / GiB:.2f} GiB x {self.utilization:.2f}: weights "
            f"{self.weights_bytes / GiB:.2f} GiB, {held}activation peak "
            f"{self.activation_peak_bytes / GiB:.2f} GiB, {graphs}held elsewhere {self.other_bytes / GiB:.2f} GiB "
            f"-> KV pool {self.kv_budget_bytes / GiB:.2f} GiB = "
            f"{self.num_blocks} blocks of {self.block_size} tokens; maximum concurrency at "
            f"{self.max_model_len} tokens: {self.max_concurrency:.2f}x"
        )

    def check(self) -> None:
        """Refuse a pool that cannot hold one request of the model's context length."""
        need = -(-self.max_model_len // self.block_size)
        if self.num_blocks < need:
            raise ValueError(
                f"the KV pool cannot hold one request of {self.max_model_len} tokens: it would get "
                f"{self.num_blocks} blocks ({self.kv_budget_bytes / GiB:.2f} GiB) but needs {need} blocks "
                f"({need * self.block_bytes / GiB:.2f} GiB). {self.describe()}. Raise --gpu-memory-utilization, "
                f"lower --max-model-len, or use a smaller --dtype or --kv-cache-dtype"
            )


def weights_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, pin: bool = False) -> torch.Tensor:
    """A zeroed tensor; on the CPU its pages are mapped lazily (calloc), so a 2 GiB pool costs
    nothing until blocks are written (``torch.zeros`` touches every page: ~0.5 s a GiB). The engine's pool (not the
    swap pool) then has its pages made resident just ahead of use, off the engine's thread (``page_populate.py``)."""
    device = torch.device(device)
    if device.type != "cpu" or pin:
        return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)
    n = 1
    for s in shape:
        n *= s
    raw = np.zeros(n * torch.empty((), dtype=dtype).element_size(), np.uint8)
    return torch.from_numpy(raw).view(dtype).reshape(shape)
