"""``KVSnapshot``: a copy of the pool and request state that a GUI may keep and read freely."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np


class BlockState(enum.IntEnum):
    """Colour codes of the block grid (uint8)."""
    FREE = 0  # empty, on the free queue
    CACHED = 1  # free but still hashed: reusable until evicted
    USED = 2  # ref count 1
    SHARED = 3  # ref count > 1
    SWAPPED = 4  # a CPU-pool block holding a swapped-out request
    LEAKED = 5  # flagged by audit()


@dataclass(frozen=True, slots=True)
class RequestInfo:
    request_id: str
    index: int
    status: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_computed_tokens: int
    block_ids: tuple[int, ...]
    text: str
    token_ids: tuple[int, ...]
    error: str | None = None


@dataclass(frozen=True, slots=True)
class KVSnapshot:
    step: int
    block_size: int
    num_blocks: int
    state: np.ndarray  # uint8 [num_blocks], BlockState
    ref_cnt: np.ndarray  # int32
    owner: np.ndarray  # int32: index of the earliest owning request, -1 if none
    has_hash: np.ndarray  # bool
    last_access: np.ndarray  # int64, engine step
    filled: np.ndarray  # int16, slots holding computed KV
    free_queue: np.ndarray  # int32 block ids in eviction order
    requests: tuple[RequestInfo, ...]
    cached_tokens: dict[int, tuple[int, ...]]  # token ids of every hashed block
    block_hashes: dict[int, str]  # hex hash of every hashed block
    counters: dict[str, float]
    block_bytes: int = 0
    model_name: str = ""
    leaked: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))

    @property
    def block_tables(self) -> dict[str, tuple[int, ...]]:
        return {r.request_id: r.block_ids for r in self.requests}

    def owners_of(self, block_id: int) -> list[str]:
        return [r.request_id for r in self.requests if block_id in r.block_ids]

    def request(self, request_id: str) -> RequestInfo | None:
        return next((r for r in self.requests if r.request_id == request_id), None)
