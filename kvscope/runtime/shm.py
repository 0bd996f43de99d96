"""Snapshot arrays through shared memory, in three slots: the window's reader holds one batch until it
knows what follows it, one release may still be on its way back, and the engine writes the third.

The window's process creates (and unlinks) the slots, so they outlive a crashed engine process;
the engine process attaches by name. Each slot holds the raw per-block arrays of one step (a batch's
last, ``PoolState``'s); the window's process derives the rest (``PoolState.assembled``).
"""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np

from engine.inspect.snapshot import RAW_ARRAYS

NUM_SLOTS = 3  # with two, every other record at full speed found none free and pickled its arrays
# each raw array a record carries, with its dtype; one entry per device block (the free queue at most that many)
_DTYPES = {"ref_cnt": "i4", "has_hash": "?", "last_access": "i8", "free_queue": "i4"}
FIELDS: tuple[tuple[str, str], ...] = tuple((name, _DTYPES[name]) for name in RAW_ARRAYS)


def _layout(n: int) -> tuple[dict[str, tuple[int, np.dtype, int]], int]:
    out, off = {}, 0
    for name, dt in FIELDS:
        dtype = np.dtype(dt)
        off = -(-off // 8) * 8  # 8-byte alignment for every array
        out[name] = (off, dtype, n)
        off += dtype.itemsize * n
    return out, max(off, 8)


@dataclass(frozen=True, slots=True)
class SlotSpec:
    names: tuple[str, ...]
    num_blocks: int


class ShmSlots:
    """Both ends use this class: ``create`` in the window's process, ``attach`` in the engine's."""

    def __init__(self, shms: list[shared_memory.SharedMemory], n: int, owner: bool) -> None:
        self.shms, self.n, self.owner = shms, n, owner
        self.layout, self.size = _layout(n)

    @classmethod
    def create(cls, n: int) -> ShmSlots:
        _, size = _layout(n)
        return cls([shared_memory.SharedMemory(create=True, size=size) for _ in range(NUM_SLOTS)], n, owner=True)

    @classmethod
    def attach(cls, spec: SlotSpec) -> ShmSlots:
        # A spawned engine process shares its parent's resource tracker, so attaching (which
        # registers the name again, Python < 3.13) changes nothing: the creator alone unlinks.
        shms = [shared_memory.SharedMemory(name=name) for name in spec.names]
        return cls(shms, spec.num_blocks, owner=False)

    @property
    def spec(self) -> SlotSpec:
        return SlotSpec(tuple(shm.name for shm in self.shms), self.n)

    def fits(self, n: int) -> bool:
        return n == self.n

    def write(self, slot: int, arrays: dict[str, np.ndarray]) -> dict[str, int]:
        """Copy the arrays in; returns the lengths used (the free queue's varies)."""
        buf = self.shms[slot].buf
        lengths = {}
        for name, (off, dtype, cap) in self.layout.items():
            a = arrays[name]
            k = min(len(a), cap)
            np.ndarray((cap,), dtype, buf, off)[:k] = a[:k]
            lengths[name] = k
        return lengths

    def read(self, slot: int, lengths: dict[str, int]) -> dict[str, np.ndarray]:
        """Copies out of the slot (the engine may overwrite it once released)."""
        buf = self.shms[slot].buf
        return {
            name: np.ndarray((cap,), dtype, buf, off)[: lengths[name]].copy()
            for name, (off, dtype, cap) in self.layout.items()
        }

    def close(self) -> None:
        for shm in self.shms:
            try:
                shm.close()
            except BufferError:  # a view still exported: the OS frees it with the process
                pass
            if self.owner:
                try:
                    shm.unlink()
                except FileNotFoundError:
                    pass
        self.shms = []
