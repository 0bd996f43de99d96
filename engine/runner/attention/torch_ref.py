"""Pure-PyTorch paged attention: gather K/V by block table, then SDPA.

Runs on any device; it is the reference the Triton kernels are tested against.
Cache layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``, a plain tensor
or a ``QuantizedKV`` (indexing it by block ids dequantizes just those blocks).
"""

from __future__ import annotations

import math
from typing import NamedTuple

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
    if slot_mapping.numel() and int(slot_mapping.min()) < 0:  # one reduction: (slots >= 0).all() took 3x longer
        valid = slot_mapping >= 0
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    kc.index_copy_(0, slot_mapping, key.to(kc.dtype))
    vc.index_copy_(0, slot_mapping, value.to(vc.dtype))


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """The blocks ``block_ids`` (any shape ``S``) of a cache: ``[*S, block_size, kvh, d]``.

    A plain tensor's blocks are rows of its ``[num_blocks, block_size * kvh * d]`` view: ``index_select``
    copies each block whole, ~4x faster here than advanced indexing, which copies element by element. A
    ``QuantizedKV`` dequantizes just those blocks.
    """
    if isinstance(cache, QuantizedKV):
        return cache[block_ids]
    rows = cache.view(cache.shape[0], -1).index_select(0, block_ids.reshape(-1))
    return rows.view(*block_ids.shape, *cache.shape[1:])


def _decode_plan(meta: AttentionMetadata, block_size: int, dtype: torch.dtype, device: torch.device):
    """The decoding sequences' block ids (``[B, nb]``, up to the longest one's last block) and the mask of
    the slots each one holds (``[B, 1, 1, nb * block_size]``, 0 or -inf: what SDPA would make of a boolean
    mask in every layer): built once a step, read by every layer (and built again if the lengths change under
    the same metadata, as a captured graph's replays do)."""
    key = tuple(meta.seq_lens_host)
    plan = meta.backend_state.get("torch_decode")
    if plan is None or plan[0] != key:
        lens = meta.seq_lens[meta.decode_seqs]
        nb = -(-int(lens.max()) // block_size)
        ids = meta.block_tables[meta.decode_seqs, :nb]
        past = torch.arange(nb * block_size, device=device)[None, :] >= lens[:, None]
        plan = meta.backend_state["torch_decode"] = (key, ids, past[:, None, None, :], {})
    masks: dict[torch.dtype, torch.Tensor] = plan[3]
    mask = masks.get(dtype)
    if mask is None:
        mask = masks[dtype] = torch.zeros(plan[2].shape, dtype=dtype, device=device).masked_fill_(plan[2], -math.inf)
    return plan[1], mask


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """``q``: ``[T, H, D]`` for the step's tokens; returns ``[T, H, D]``.

    Each query attends to its sequence's cached prefix and, causally, to the new tokens.
    """
    decode_only = not meta.prefill_seqs and meta.decode_seqs.numel() > 0  # then row i is sequence i's one token
    out = None if decode_only else torch.empty_like(q)
    if meta.decode_seqs.numel():
        # One new token per sequence, all in one call: the contexts padded to the longest one's last block
        # (the slots past each context masked).
        ids, mask = _decode_plan(meta, k_cache.shape[1], q.dtype, q.device)
        k = gather_blocks(k_cache, ids).flatten(1, 2).transpose(1, 2)  # [B, kvh, L, D]
        v = gather_blocks(v_cache, ids).flatten(1, 2).transpose(1, 2)
        qd = (q if decode_only else q[meta.decode_tokens]).unsqueeze(2)  # [B, H, 1, D]
        o = F.scaled_dot_product_attention(
            qd, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=True
        ).squeeze(2)
        if decode_only:
            return o
        assert out is not None
        out[meta.decode_tokens] = o
    assert out is not None  # a step with prefills writes them into one output
    prefill_attention(q, k_cache, v_cache, meta, scale, out)
    return out


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
) -> None:
    """The rows of ``out`` of every sequence with more than one new token (``meta.prefill_seqs``)."""
    for ids, seqs in _prefill_plan(meta, k_cache.shape[1], q.device):
        # the blocks of a group of prefilling sequences in one gather a layer (K, then V); each reads its own slice
        k_all = gather_blocks(k_cache, ids).to(q.dtype)
        v_all = gather_blocks(v_cache, ids).to(q.dtype)
        for p in seqs:
            # batched shapes ([1, heads, tokens, D]): with 3-D inputs the CPU's SDPA takes its math path (the
            # heads repeated for GQA, the scores materialised), ~6x slower on a 150-token prompt here
            k = k_all[p.first : p.first + p.num_blocks].flatten(0, 1)[: p.seq_len].transpose(0, 1)[None]
            v = v_all[p.first : p.first + p.num_blocks].flatten(0, 1)[: p.seq_len].transpose(0, 1)[None]
            qs = q[p.start : p.end].transpose(0, 1)[None]  # [1, H, n, D]
            if p.mask is None:
                o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=True)
            else:
                o = F.scaled_dot_product_attention(qs, k, v, attn_mask=p.mask, scale=scale, enable_gqa=True)
            out[p.start : p.end] = o[0].transpose(0, 1)


GATHER_TOKENS = 16384  # a gather's most context tokens: the copies a layer holds at once stay near one long prompt's


class PrefillSeq(NamedTuple):
    start: int  # its rows in the step
    end: int
    seq_len: int
    first: int  # where its blocks start in its group's ids
    num_blocks: int
    mask: torch.Tensor | None  # [n, seq_len] for a sequence with a cached prefix; None: plain causal


def _prefill_plan(
    meta: AttentionMetadata, block_size: int, device: torch.device
) -> list[tuple[torch.Tensor, list[PrefillSeq]]]:
    """The prefilling sequences in groups of at most ``GATHER_TOKENS`` context tokens (a longer one alone): each
    group's block ids end to end, and its sequences. Built once a step and read by every layer (a step of seven
    cached prompts spent 7% of its time rebuilding the slices and masks in every layer)."""
    key = tuple(meta.seq_lens_host)
    plan = meta.backend_state.get("torch_prefill")
    if plan is None or plan[0] != key:
        groups: list[tuple[torch.Tensor, list[PrefillSeq]]] = []
        ids: list[torch.Tensor] = []
        seqs: list[PrefillSeq] = []
        first = 0
        for i in meta.prefill_seqs:
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            seq_len, n = meta.seq_lens_host[i], end - start
            nb = -(-seq_len // block_size)
            if seqs and (first + nb) * block_size > GATHER_TOKENS:
                groups.append((torch.cat(ids), seqs))
                ids, seqs, first = [], [], 0
            ids.append(meta.block_tables[i, :nb])
            mask = None
            if n != seq_len:  # query j sits at position seq_len - n + j and sees every key up to it
                qpos = torch.arange(seq_len - n, seq_len, device=device)
                mask = torch.arange(seq_len, device=device)[None, :] <= qpos[:, None]
            seqs.append(PrefillSeq(start, end, seq_len, first, nb, mask))
            first += nb
        if seqs:
            groups.append((torch.cat(ids), seqs))
        plan = meta.backend_state["torch_prefill"] = (key, groups)
    return plan[1]
