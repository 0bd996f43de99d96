"""Pure-PyTorch paged attention: gather K/V by block table, then SDPA.

Runs on any device; it is the reference the Triton kernels are tested against.
Cache layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``, a plain tensor
or a ``QuantizedKV`` (indexing it by block ids dequantizes just those blocks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kv_quant import QuantizedKV
from .metadata import AttentionMetadata


def store_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write each token's K/V at its slot (block_id * block_size + offset); -1 is skipped."""
    if isinstance(k_cache, QuantizedKV):
        k_cache.store(slot_mapping, key)
        v_cache.store(slot_mapping, value)
        return
    kvh, d = k_cache.shape[-2:]
    kc, vc = k_cache.view(-1, kvh, d), v_cache.view(-1, kvh, d)
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    kc.index_copy_(0, slot_mapping, key.to(kc.dtype))
    vc.index_copy_(0, slot_mapping, value.to(vc.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` tokens of one sequence, contiguous: ``[seq_len, kvh, d]``."""
    bs = cache.shape[1]
    nb = -(-seq_len // bs)
    return cache[block_table[:nb]].flatten(0, 1)[:seq_len]


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """``q``: ``[T, H, D]`` for the step's tokens; returns ``[T, H, D]``.

    Each query attends to its sequence's cached prefix and, causally, to the new tokens.
    """
    out = torch.empty_like(q)
    if meta.decode_seqs.numel():
        # One new token per sequence: pad the contexts to the longest and mask.
        bt = meta.block_tables[meta.decode_seqs]
        lens = meta.seq_lens[meta.decode_seqs]
        max_len = int(lens.max())
        nb = -(-max_len // k_cache.shape[1])
        k = k_cache[bt[:, :nb]].flatten(1, 2)[:, :max_len].transpose(1, 2)  # [B, kvh, L, D]
        v = v_cache[bt[:, :nb]].flatten(1, 2)[:, :max_len].transpose(1, 2)
        mask = torch.arange(max_len, device=q.device)[None, :] < lens[:, None]
        qd = q[meta.decode_tokens].unsqueeze(2)  # [B, H, 1, D]
        o = F.scaled_dot_product_attention(
            qd, k.to(q.dtype), v.to(q.dtype), attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
        )
        out[meta.decode_tokens] = o.squeeze(2)
    for i in meta.prefill_seqs:
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        seq_len = meta.seq_lens_host[i]
        n = end - start
        k = gather_kv(k_cache, meta.block_tables[i], seq_len).transpose(0, 1).to(q.dtype)  # [kvh, L, D]
        v = gather_kv(v_cache, meta.block_tables[i], seq_len).transpose(0, 1).to(q.dtype)
        qs = q[start:end].transpose(0, 1)  # [H, n, D]
        if n == seq_len:
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            # Query j sits at position seq_len - n + j and sees every key up to it.
            qpos = torch.arange(seq_len - n, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= qpos[:, None]
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:end] = o.transpose(0, 1)
    return out
