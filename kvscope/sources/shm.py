"""Snapshot arrays through shared memory: two slots, so the engine writes one while the window reads the other.

The window's process creates (and unlinks) the slots, so they outlive a crashed engine process;
the engine process attaches by name. Each slot holds the per-block arrays of one snapshot.
"""
from __future__ import annotations

from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np

# name -> (dtype, length: "n" device blocks or "m" CPU blocks)
FIELDS: tuple[tuple[str, str, str], ...] = (
    ("state", "u1", "n"), ("ref_cnt", "i4", "n"), ("owner", "i4", "n"), ("has_hash", "?", "n"),
    ("last_access", "i8", "n"), ("filled", "i2", "n"), ("free_queue", "i4", "n"),
    ("cpu_state", "u1", "m"), ("cpu_owner", "i4", "m"),
)


def _layout(n: int, m: int) -> tuple[dict[str, tuple[int, np.dtype, int]], int]:
    out, off = {}, 0
    for name, dt, which in FIELDS:
        dtype = np.dtype(dt)
        length = n if which == "n" else m
        off = -(-off // 8) * 8  # 8-byte alignment for every array
        out[name] = (off, dtype, length)
        off += dtype.itemsize * length
    return out, max(off, 8)


@dataclass(frozen=True, slots=True)
class SlotSpec:
    names: tuple[str, str]
    num_blocks: int
    num_cpu_blocks: int


class ShmSlots:
    """Both ends use this class: ``create`` in the window's process, ``attach`` in the engine's."""

    def __init__(self, shms: list[shared_memory.SharedMemory], n: int, m: int, owner: bool) -> None:
        self.shms, self.n, self.m, self.owner = shms, n, m, owner
        self.layout, self.size = _layout(n, m)

    @classmethod
    def create(cls, n: int, m: int) -> ShmSlots:
        _, size = _layout(n, m)
        return cls([shared_memory.SharedMemory(create=True, size=size) for _ in range(2)], n, m, owner=True)

    @classmethod
    def attach(cls, spec: SlotSpec) -> ShmSlots:
        # A spawned engine process shares its parent's resource tracker, so attaching (which
        # registers the name again, Python < 3.13) changes nothing: the creator alone unlinks.
        shms = [shared_memory.SharedMemory(name=name) for name in spec.names]
        return cls(shms, spec.num_blocks, spec.num_cpu_blocks, owner=False)

    @property
    def spec(self) -> SlotSpec:
        return SlotSpec((self.shms[0].name, self.shms[1].name), self.n, self.m)

    def fits(self, n: int, m: int) -> bool:
        return n == self.n and m == self.m

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
        return {name: np.ndarray((cap,), dtype, buf, off)[:lengths[name]].copy()
                for name, (off, dtype, cap) in self.layout.items()}

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
