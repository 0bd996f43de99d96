"""Paged attention backends: ``torch_ref`` (any device, the oracle) and ``triton_paged`` (CUDA)."""

from .metadata import AttentionMetadata

__all__ = ["AttentionMetadata"]
