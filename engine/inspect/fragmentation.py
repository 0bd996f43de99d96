"""The textbook's fragmentation accounting: where a request's KV slots go under each layout.

``contiguous`` (systems before PagedAttention) reserves ``max_model_len`` slots per request at admission:
the slots past its tokens are *reserved* (held, never written yet). ``paged`` gives a request whole
blocks as it grows: only the rest of its last block is *internally wasted*. ``layouts`` computes both
for the same requests (the figure); ``pool_counts`` reads what this run's pool really holds.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .snapshot import KVSnapshot


@dataclass(frozen=True, slots=True)
class Row:
    request_id: str
    used: int  # slots holding the KV of its computed tokens
    wasted: int  # the rest of its last block (paged)
    reserved: int  # reserved for tokens it has not produced (contiguous)


@dataclass(frozen=True, slots=True)
class Layout:
    name: str
    rows: tuple[Row, ...]

    @property
    def used(self) -> int:
        return sum(r.used for r in self.rows)

    @property
    def wasted(self) -> int:
        return sum(r.wasted for r in self.rows)

    @property
    def reserved(self) -> int:
        return sum(r.reserved for r in self.rows)

    @property
    def held(self) -> int:
        return self.used + self.wasted + self.reserved

    def summary(self) -> str:
        h = self.held or 1
        return (f"{self.name}: {self.held:,} slots held for {len(self.rows)} request(s): {self.used:,} used, "
                f"{self.wasted:,} wasted inside blocks ({self.wasted / h:.0%}), "
                f"{self.reserved:,} reserved and empty ({self.reserved / h:.0%})")


def layouts(snap: KVSnapshot, max_model_len: int) -> tuple[Layout, Layout]:
    """(contiguous, paged) for the requests that hold KV in ``snap``."""
    bs = snap.block_size
    live = [r for r in snap.requests if r.block_ids and r.num_computed_tokens > 0]
    contiguous = tuple(Row(r.request_id, r.num_computed_tokens, 0, max(0, max_model_len - r.num_computed_tokens))
                       for r in live)
    paged = tuple(Row(r.request_id, r.num_computed_tokens, -r.num_computed_tokens % bs, 0) for r in live)
    return Layout("contiguous", contiguous), Layout("paged", paged)


def pool_counts(snap: KVSnapshot) -> dict:
    """What the pool holds now, physical blocks counted once: slots written, slots wasted in partly
    written blocks, slots in blocks held but not written at all (a reservation)."""
    held = snap.ref_cnt > 0
    filled = snap.filled[held].astype(np.int64)
    bs = snap.block_size
    return {"blocks_held": int(held.sum()), "used_slots": int(filled.sum()),
            "wasted_slots": int((bs - filled[filled > 0]).sum()), "reserved_slots": int(bs * (filled == 0).sum())}
