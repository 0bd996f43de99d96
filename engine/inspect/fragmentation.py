"""The textbook's fragmentation accounting: where a request's KV slots go under each layout.

``contiguous`` (systems before PagedAttention) reserves ``max_model_len`` slots per request at admission
(whole blocks, as this engine's contiguous layout does): the slots past its tokens are *reserved* (held,
never written yet). ``paged`` gives a request whole blocks as it grows: only the rest of its last block is
*internally wasted*; no hole between requests' memory is ever too small to use (no external fragmentation).
``layouts`` computes both for the same requests (the figure); ``pool_counts`` reads what this run's pool
really holds. Both split slots by one rule, ``split_slots``: the figure's header, its caption and
``--headless --json`` all count with it, so their numbers agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .snapshot import KVSnapshot


def split_slots(tokens, held, block_size: int):
    """``(used, wasted, reserved)`` of ``held`` slots (whole blocks) holding ``tokens`` tokens' KV: used, the rest of
    the last written block (wasted inside it), and the blocks not written at all (reserved). Ints, or numpy arrays
    (one entry a request or a block)."""
    wasted = np.minimum(-np.asarray(tokens) % block_size, np.asarray(held) - tokens)
    if np.ndim(wasted) == 0:
        wasted = int(wasted)
    return tokens, wasted, held - tokens - wasted


def held_slots(layout: str, tokens: int, max_model_len: int, block_size: int) -> int:
    """The slots a request of ``tokens`` tokens holds under ``layout``: a max-length reservation (whole blocks)
    at admission (``contiguous``), or the blocks its tokens fill (``paged``)."""
    want = max(tokens, max_model_len) if layout == "contiguous" else tokens
    return -(-want // block_size) * block_size


@dataclass(frozen=True, slots=True)
class Row:
    request_id: str
    used: int  # slots holding the KV of its computed tokens
    wasted: int  # the rest of its last written block
    reserved: int  # whole blocks held for tokens it has not produced (contiguous)


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

    def counts(self) -> dict:
        """The layout's slots, as ``--headless --json`` prints them (the keys of ``pool_counts``)."""
        return {"used_slots": self.used, "wasted_slots": self.wasted, "reserved_slots": self.reserved}

    def header(self) -> str:
        """The figure's line above this layout's rows."""
        h = self.held or 1
        return (
            f"{self.used:,} used · {self.wasted:,} wasted ({self.wasted / h:.0%}) · "
            f"{self.reserved:,} reserved ({self.reserved / h:.0%}) of {self.held:,} slots"
        )

    def summary(self) -> str:
        h = self.held or 1
        return (
            f"{self.name}: {self.held:,} slots held for {len(self.rows)} request(s): {self.used:,} used, "
            f"{self.wasted:,} wasted inside blocks ({self.wasted / h:.0%}), "
            f"{self.reserved:,} reserved and empty ({self.reserved / h:.0%})"
        )


def layouts(snap: KVSnapshot, max_model_len: int) -> tuple[Layout, Layout]:
    """(contiguous, paged) for the requests that hold KV in ``snap``, each request alone."""
    bs = snap.block_size
    live = [r for r in snap.requests if r.block_ids and r.num_computed_tokens > 0]

    def layout(name: str) -> Layout:
        return Layout(
            name,
            tuple(
                Row(
                    r.request_id,
                    *split_slots(r.num_computed_tokens, held_slots(name, r.num_computed_tokens, max_model_len, bs), bs),
                )
                for r in live
            ),
        )

    return layout("contiguous"), layout("paged")


def pool_counts(snap: KVSnapshot) -> dict:
    """What the pool holds now, physical blocks counted once: slots written, slots wasted in partly
    written blocks, slots in blocks held but not written at all (a reservation)."""
    held = snap.ref_cnt > 0
    bs = snap.block_size
    used, wasted, reserved = split_slots(snap.filled[held].astype(np.int64), bs, bs)  # one block at a time
    return {
        "blocks_held": int(held.sum()),
        "used_slots": int(used.sum()),
        "wasted_slots": int(wasted.sum()),
        "reserved_slots": int(reserved.sum()),
    }


def pool_caption(counts: dict, layout: str, max_model_len: int) -> str:
    """The line under the figure: this run's pool, physical blocks counted once (``pool_counts``)."""
    return (
        f"This run's pool ({layout}, physical blocks counted once): {counts['blocks_held']} blocks held = "
        f"{counts['used_slots']:,} slots used, {counts['wasted_slots']:,} wasted inside blocks, "
        f"{counts['reserved_slots']:,} in blocks reserved and not written. Rows above: each request alone "
        f"(a block shared by several is in each of their rows), max_model_len {max_model_len} per "
        f"contiguous reservation."
    )
