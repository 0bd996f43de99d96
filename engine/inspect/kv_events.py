"""kvscope's block events on vLLM's KV-event wire format (``vllm.distributed.kv_events``).

vLLM and SGLang publish their prefix cache's changes over ZeroMQ so that routers and
cache managers can follow them; this module speaks that format both ways: it maps
kvscope's events to it and publishes them (``KVEventPublisher``), and it decodes a stream
(``decode_batch``) for ``kvscope --attach``.

Wire format (written from vLLM's schema, none of its code):

- A ZeroMQ PUB socket sends one three-part message per batch: ``topic`` (bytes, may be
  empty), an 8-byte big-endian sequence number (0, 1, 2, ... per publisher), and the msgpack
  payload: an ``EventBatch`` ``[ts, events, data_parallel_rank]``.
- Events are tagged structs: ``BlockStored(block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium, lora_name)``, ``BlockRemoved(block_hashes, medium)``,
  ``AllBlocksCleared()``. ``wire_format="array"`` writes each event as a positional array with
  the tag first (``["BlockStored", [h1, h2], parent, [tokens...], 16, None, "GPU", None]``):
  msgspec's ``array_like=True, tag=True``, which vLLM used until its PR #42892, SGLang still
  uses, and vLLM's example subscriber decodes. ``wire_format="map"`` writes each event as a map
  with the tag under ``"type"`` (``{"type": "BlockStored", "block_hashes": [...], ...}``), as
  vLLM does since #42892; the batch stays positional in both. Decoding accepts either, and a
  map-shaped batch too, so one subscriber reads old and new vLLM and SGLang. Checked against the
  released wheels' struct definitions (tests/engine/inspect/test_kv_wire_vllm_releases.py): "array" is vLLM 0.11.0
  and 0.20.0's shape, "map" 0.27.0 and 0.33.0's (whose new fields, ``locality``, ``session_id``...,
  the decoder ignores).
- Hashes: vLLM hashes blocks with a 32-byte digest and publishes ``ExternalBlockHash``: by
  default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) the digest's low 64 bits as an unsigned
  int (``int.from_bytes(digest, "big") & (2**64 - 1)``), otherwise the raw bytes.
  ``hash_format`` picks the same two for kvscope's sha256 (or 8-byte builtin) hashes. SGLang
  sends signed 64-bit ints; the decoder takes ints of either sign and bytes.
- Replay: a ROUTER socket answers a request ``[b"", start_seq (8 bytes)]`` (a REQ or a DEALER
  with an empty delimiter frame) with every buffered batch whose sequence number is
  ``>= start_seq``, one message each, ``[b"", topic, seq, payload]``, then an end-of-replay
  marker ``[b"", topic, -1 (8 bytes, signed), b""]``. vLLM added the topic frame in #45177;
  older publishers send ``[b"", seq, payload]``, and the subscriber reads both. The buffer keeps
  the last ``buffer_steps`` batches.
- Data parallelism: each rank publishes on its own port, ``port + rank`` (``offset_endpoint``),
  and stamps ``data_parallel_rank`` into its batches.

Mapping from kvscope's events (``engine.inspect.events``):

===================  ==========================================================================
kvscope              vLLM wire
===================  ==========================================================================
``BlockStored``      ``BlockStored``: ``block_hashes=[hash]``, ``parent_block_hash`` = the event's
                     ``parent_hash`` (the previous block of the request's chain, None for a
                     first block), ``token_ids`` = the block's tokens, ``block_size``, ``medium``
                     "GPU", ``lora_id``/``lora_name`` None. Consecutive stores that extend one
                     chain (each one's parent is the previous one's hash) are merged into one
                     event with several hashes and the tokens concatenated, as vLLM's
                     ``cache_full_blocks`` sends them.
``BlockEvicted``,    ``BlockRemoved(block_hashes=[hash], medium="GPU")``; adjacent removals merge.
``BlockUnpublished`` (a store of a failed step rolled back: the prefix no longer exists; the table
                     in ``cache_rules`` says which events remove a hash)
``CacheReset``       ``AllBlocksCleared()``.
everything else      dropped: allocations, hits, frees (ref counts), owners and request ids, block
                     ids, copy-on-write copies, forks, preemptions, swaps, leaks. The wire names a
                     cached block by its hash only: the consumer sees which prefixes are cached,
                     never which physical block holds them or who uses them.
===================  ==========================================================================

Swaps are not published as a "CPU" medium: kvscope's CPU pool holds a preempted request's
private copy, not a cache other requests can hit, and its device blocks keep their hashes
(cached, free) until they are evicted, so the GPU events already tell the cache's truth.
Order is kept: a batch's events are the step's events in the order they happened.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

from .cache_rules import CacheChange, cache_change
from .events import BlockEvicted, BlockStored, BlockUnpublished, Event

MEDIUM_GPU = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # end-of-replay marker
WIRE_FORMATS = ("array", "map")
HASH_FORMATS = ("int", "bytes")
ExternalHash = int | bytes


def external_hash(hex_hash: str, hash_format: str = "int") -> ExternalHash:
    """kvscope's hex hash as vLLM publishes a hash: the low 64 bits as an int, or the bytes."""
    raw = bytes.fromhex(hex_hash)
    return raw if hash_format == "bytes" else int.from_bytes(raw, "big") & ((1 << 64) - 1)


# --- neutral wire events (what both formats carry) ------------------------------------------


@dataclass(frozen=True, slots=True)
class WireStored:
    block_hashes: tuple[ExternalHash, ...]
    parent_block_hash: ExternalHash | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = MEDIUM_GPU
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class WireRemoved:
    block_hashes: tuple[ExternalHash, ...]
    medium: str | None = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class WireCleared:
    pass


WireEvent = WireStored | WireRemoved | WireCleared


def to_wire_events(
    events: Iterable[Event], block_size: int, hash_format: str = "int", medium: str = MEDIUM_GPU
) -> list[WireEvent]:
    """The vLLM events a step's kvscope events amount to (see the module docstring)."""
    out: list[WireEvent] = []
    chain_tail: str | None = None  # hex hash of the last block of the open BlockStored run
    for ev in events:
        change = cache_change(ev)
        if change is CacheChange.STORED:
            ev = cast(BlockStored, ev)
            h = external_hash(ev.block_hash, hash_format)
            last = out[-1] if out else None
            if isinstance(last, WireStored) and ev.parent_hash is not None and ev.parent_hash == chain_tail:
                out[-1] = WireStored(
                    last.block_hashes + (h,),
                    last.parent_block_hash,
                    last.token_ids + tuple(ev.token_ids),
                    block_size,
                    medium,
                )
            else:
                parent = external_hash(ev.parent_hash, hash_format) if ev.parent_hash else None
                out.append(WireStored((h,), parent, tuple(ev.token_ids), block_size, medium))
            chain_tail = ev.block_hash
        elif change is not None and change.removes:  # evicted, or withdrawn: its step failed
            h = external_hash(cast(BlockEvicted | BlockUnpublished, ev).block_hash, hash_format)
            last = out[-1] if out else None
            if isinstance(last, WireRemoved):
                out[-1] = WireRemoved(last.block_hashes + (h,), medium)
            else:
                out.append(WireRemoved((h,), medium))
            chain_tail = None
        elif change is CacheChange.CLEARED:
            out.append(WireCleared())
            chain_tail = None
    return out
