"""Step records across the process boundary: arrays through shared memory, the rest pickled.

The prefix cache's token and hash maps are sent once after a load; afterwards the window
keeps its own copy up to date from the events (the event stream is the contract), so a step
costs its events, its request rows and a copy of the per-block arrays.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.inspect.chunked_map import ChunkedMap
from engine.inspect.events import Event
from engine.inspect.replay import apply_cache_event
from engine.inspect.snapshot import KVSnapshot
from engine.outputs import StepOutput

from ..sysinfo import MemoryReading
from .base import StepRecord
from .protocol import Stepped
from .shm import FIELDS, ShmSlots

ARRAYS = tuple(name for name, _, _ in FIELDS)
SCALARS = ("step", "block_size", "num_blocks", "block_bytes", "model_name")


@dataclass(frozen=True, slots=True)
class WireStepped:
    """A ``Stepped`` result with its arrays in shared-memory slot ``slot`` (or inline when none was free)."""
    scalars: dict
    requests: tuple
    counters: dict
    slot: int | None
    lengths: dict[str, int] | None
    inline: dict[str, np.ndarray] | None
    cache: tuple[dict, dict] | None  # (cached_tokens, block_hashes): only the first record after a load
    events: list[Event]
    has_output: bool  # False for the record of a command between steps
    error: str | None
    num_scheduled_tokens: int
    seconds: float
    audit: object
    memory: MemoryReading


class RecordEncoder:
    """Engine-process side."""

    def __init__(self) -> None:
        self.slots: ShmSlots | None = None
        self.free: set[int] = set()
        self.cache_sent = False

    def attach(self, slots: ShmSlots) -> None:
        self.detach()
        self.slots, self.free = slots, {0, 1}

    def detach(self) -> None:
        if self.slots is not None:
            self.slots.close()
        self.slots, self.free = None, set()

    def release(self, slot: int) -> None:
        self.free.add(slot)

    def loaded(self) -> None:
        """A new source: the next record carries the prefix cache's maps whole."""
        self.cache_sent = False

    def encode(self, st: Stepped) -> WireStepped:
        rec, snap = st.record, st.record.snapshot
        arrays = {name: getattr(snap, name) for name in ARRAYS}
        slot = lengths = inline = None
        if self.slots is not None and self.free and self.slots.fits(snap.num_blocks, len(snap.cpu_state)):
            slot = min(self.free)
            self.free.discard(slot)
            lengths = self.slots.write(slot, arrays)
        else:
            inline = arrays
        cache = None
        if not self.cache_sent:
            cache = (dict(snap.cached_tokens), dict(snap.block_hashes))
            self.cache_sent = True
        out = rec.step_output
        return WireStepped({k: getattr(snap, k) for k in SCALARS}, snap.requests, snap.counters, slot, lengths,
                           inline, cache, rec.events, out is not None, out.error if out else None,
                           out.num_scheduled_tokens if out else 0, rec.seconds, rec.audit, st.memory)


class RecordDecoder:
    """Window side: rebuilds the ``Stepped`` result the engine process emitted."""

    def __init__(self) -> None:
        self.slots: ShmSlots | None = None
        self.tokens: ChunkedMap = ChunkedMap(0)
        self.hashes: ChunkedMap = ChunkedMap(0)

    def decode(self, w: WireStepped) -> Stepped:
        if w.cache is not None:
            n = w.scalars["num_blocks"]
            self.tokens, self.hashes = ChunkedMap(n), ChunkedMap(n)
            for b, v in w.cache[0].items():
                self.tokens[b] = v
            for b, v in w.cache[1].items():
                self.hashes[b] = v
        else:
            for ev in w.events:
                apply_cache_event(ev, self.tokens, self.hashes)
        arrays = self.slots.read(w.slot, w.lengths) if w.slot is not None else dict(w.inline)
        for a in arrays.values():
            a.flags.writeable = False
        snap = KVSnapshot(**w.scalars, **arrays, requests=w.requests, counters=w.counters,
                          cached_tokens=self.tokens.freeze(), block_hashes=self.hashes.freeze())
        out = StepOutput(w.scalars["step"], [], [], w.num_scheduled_tokens, {}, w.error) if w.has_output else None
        return Stepped(StepRecord(w.scalars["step"], snap, w.events, out, w.seconds, w.audit), w.memory)
