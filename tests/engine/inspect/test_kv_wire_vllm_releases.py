"""kvscope's KV-event encoder and subscriber against vLLM's own struct definitions, release by release.

The structs below are written from the released wheels' ``vllm/distributed/kv_events.py`` (``pip download
--no-deps vllm==X``; the file read, not copied): their fields in order, their types and their msgspec options,
which is all a subscriber decodes with. Two shapes exist:
- "array" (events as positional arrays): vLLM 0.11.0 (``BlockStored`` without ``lora_name``) and 0.20.0
  (``lora_name``, then ``extra_keys`` with a default).
- "map" (events as maps with a ``type`` key; the batch still positional): vLLM 0.27.0 and 0.33.0, which adds
  ``group_idx``, the cache-spec fields, ``locality``, ``ownership``, ``session_id`` and ``lookahead_token_ids``.
kvscope's ``--kv-events-format array`` must decode with the first two, ``map`` with the last two; and kvscope's
subscriber (``--attach``) must read what each release publishes, extra fields included.
"""

# No ``from __future__ import annotations``: msgspec resolves the release structs' annotations, which name
# classes local to ``release_structs``.
from typing import Any

import msgspec
import pytest

from engine.inspect.kv_events import WireCleared, WireRemoved, WireStored
from engine.inspect.kv_wire import decode_batch, encode_batch

ExternalBlockHash = bytes | int  # vllm.v1.core.kv_cache_utils.ExternalBlockHash, in every release here


def release_structs(array_events: bool, fields: str):
    """vLLM's structs as one release defines them (``fields``: "0.11", "0.20" or "0.33")."""

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, array_like=array_events, omit_defaults=True, gc=False, tag=True):
        pass

    if fields == "0.11":

        class BlockStored(KVCacheEvent):
            block_hashes: list[ExternalBlockHash]
            parent_block_hash: ExternalBlockHash | None
            token_ids: list[int]
            block_size: int
            lora_id: int | None
            medium: str | None

        class BlockRemoved(KVCacheEvent):
            block_hashes: list[ExternalBlockHash]
            medium: str | None
    elif fields == "0.20":

        class BlockStored(KVCacheEvent):
            block_hashes: list[ExternalBlockHash]
            parent_block_hash: ExternalBlockHash | None
            token_ids: list[int]
            block_size: int
            lora_id: int | None
            medium: str | None
            lora_name: str | None
            extra_keys: list[tuple[Any, ...] | None] | None = None

        class BlockRemoved(KVCacheEvent):
            block_hashes: list[ExternalBlockHash]
            medium: str | None
    else:

        class BlockStored(KVCacheEvent):
            block_hashes: list[ExternalBlockHash]
            parent_block_hash: ExternalBlockHash | None
            token_ids: list[int]
            block_size: int
            lora_id: int | None
            medium: str | None
            lora_name: str | None
            extra_keys: list[tuple[Any, ...] | None] | None = None
            group_idx: int | None = None
            kv_cache_spec_kind: str | None = None
            kv_cache_spec_sliding_window: int | None = None
            locality: str | None = None
            ownership: str | None = None
            session_id: str | None = None
            lookahead_token_ids: list[list[int]] | None = None

        class BlockRemoved(KVCacheEvent):
            block_hashes: list[ExternalBlockHash]
            medium: str | None
            group_idx: int | None = None
            locality: str | None = None
            ownership: str | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared


RELEASES = {
    "0.11.0": ("array", True, "0.11"),
    "0.20.0": ("array", True, "0.20"),
    "0.27.0": ("map", False, "0.20"),
    "0.33.0": ("map", False, "0.33"),
}

STEP = [
    WireStored((11, 12), None, tuple(range(32)), 16, medium="GPU"),
    WireStored((13,), 12, tuple(range(32, 48)), 16, medium="GPU"),
    WireRemoved((7, 8), "GPU"),
    WireCleared(),
]


@pytest.mark.parametrize("release", RELEASES)
def test_kvscopes_batches_decode_with_the_release(release):
    wire_format, array_events, fields = RELEASES[release]
    batch_cls, stored, removed, cleared = release_structs(array_events, fields)
    payload = encode_batch(STEP, 12.5, 3, wire_format=wire_format)
    batch = msgspec.msgpack.Decoder(batch_cls).decode(payload)
    assert batch.ts == 12.5 and batch.data_parallel_rank == 3
    a, b, c, d = batch.events
    assert isinstance(a, stored) and a.block_hashes == [11, 12] and a.parent_block_hash is None
    assert a.token_ids == list(range(32)) and a.block_size == 16 and a.medium == "GPU" and a.lora_id is None
    assert isinstance(b, stored) and b.parent_block_hash == 12 and b.block_hashes == [13]
    assert isinstance(c, removed) and c.block_hashes == [7, 8] and c.medium == "GPU"
    assert isinstance(d, cleared)


@pytest.mark.parametrize("release", RELEASES)
def test_kvscopes_subscriber_reads_what_the_release_publishes(release):
    """vLLM's own encoding (every field its release has, the new ones set) read by ``--attach``'s decoder."""
    _, array_events, fields = RELEASES[release]
    batch_cls, stored, removed, cleared = release_structs(array_events, fields)
    extra = {}
    if fields == "0.20":
        extra = dict(lora_name=None, extra_keys=[("salt",), None])
    elif fields == "0.33":
        extra = dict(
            lora_name=None,
            extra_keys=[None, None],
            group_idx=0,
            kv_cache_spec_kind="full_attention",
            locality="LOCAL",
            ownership="cpu-tier",
            session_id="s1",
            lookahead_token_ids=[[1], [2]],
        )
    events = [
        stored([21, 22], 20, list(range(32)), 16, None, "GPU", **extra),
        removed([20], "GPU", **({"group_idx": 0, "locality": "LOCAL"} if fields == "0.33" else {})),
        cleared(),
    ]
    payload = msgspec.msgpack.Encoder().encode(batch_cls(1.0, events, 0))
    out = decode_batch(payload)
    assert out.unknown_tags == 0 and out.bad_events == 0
    s, r, c = out.events
    assert s.block_hashes == (21, 22) and s.parent_block_hash == 20 and s.token_ids == tuple(range(32))
    assert s.block_size == 16 and s.medium == "GPU"
    assert r.block_hashes == (20,) and isinstance(c, WireCleared)
