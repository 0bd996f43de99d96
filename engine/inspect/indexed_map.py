"""The prefix cache's maps (block id -> tokens, block id -> hex hash) for a timeline: one append-only log
of every value ever stored, and per keyframe only an int32 array of indices into it.

A keyframe that copied the maps themselves held ~6 MB at 65,536 blocks (two dicts of every cached
block), 156 keyframes over 10,000 steps about 1 GB; an index array is 256 KB. Scrubbing builds an
``OverlayMap`` over a keyframe's array: the events replayed after the keyframe land in a small overlay,
and ``freeze`` hands the snapshot a read-only ``IndexedView`` without copying the base.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Mapping
from typing import Generic, TypeVar

import numpy as np

V = TypeVar("V")
_GONE = object()


class _Column:
    """A read-only list view: ``column[i]`` decodes the i-th stored value."""

    __slots__ = ("_get", "_len")

    def __init__(self, get, length) -> None:
        self._get, self._len = get, length

    def __getitem__(self, i: int):
        return self._get(int(i))

    def __len__(self) -> int:
        return self._len()


class StoreLog:
    """Every (tokens, hash) a block was ever stored with, in order, packed: token ids in one int32 array,
    hashes as raw bytes in one bytearray (a tuple of Python ints and a hex string cost ~10x more)."""

    def __init__(self) -> None:
        self._tokens = array("i")
        self._tok_off = array("q", [0])
        self._hashes = bytearray()
        self._hash_off = array("q", [0])
        self.tokens = _Column(self._token_at, self.__len__)
        self.hashes = _Column(self._hash_at, self.__len__)

    def add(self, tokens: tuple[int, ...], block_hash: str) -> int:
        self._tokens.extend(tokens)
        self._tok_off.append(len(self._tokens))
        try:  # the engine's hashes are hex: kept as their bytes; anything else (a hand-written trace) as text
            self._hashes += b"\x01" + bytes.fromhex(block_hash)
        except ValueError:
            self._hashes += b"\x00" + block_hash.encode()
        self._hash_off.append(len(self._hashes))
        return len(self._tok_off) - 2

    def __len__(self) -> int:
        return len(self._tok_off) - 1

    @property
    def nbytes(self) -> int:
        return (
            self._tokens.itemsize * len(self._tokens)
            + 8 * len(self._tok_off)
            + len(self._hashes)
            + 8 * len(self._hash_off)
        )

    def _token_at(self, i: int) -> tuple[int, ...]:
        return tuple(self._tokens[self._tok_off[i] : self._tok_off[i + 1]])

    def _hash_at(self, i: int) -> str:
        raw = self._hashes[self._hash_off[i] : self._hash_off[i + 1]]
        return raw[1:].hex() if raw[0] == 1 else raw[1:].decode()


class IndexedView(Mapping[int, V], Generic[V]):
    """Read-only: ``index[b]`` into ``values`` (-1: none), with ``overlay`` changes on top."""

    __slots__ = ("_index", "_values", "_overlay")

    def __init__(self, index: np.ndarray, values: list, overlay: dict | None = None) -> None:
        self._index, self._values, self._overlay = index, values, overlay or {}

    def __getitem__(self, key: int) -> V:
        v = self._overlay.get(key, None)
        if v is _GONE:
            raise KeyError(key)
        if v is not None:
            return v
        if not isinstance(key, (int, np.integer)) or not 0 <= key < len(self._index) or self._index[key] < 0:
            raise KeyError(key)
        return self._values[self._index[key]]

    def __contains__(self, key: object) -> bool:
        try:
            self[key]  # type: ignore[index]
        except KeyError:
            return False
        return True

    def __iter__(self) -> Iterator[int]:
        for b in np.flatnonzero(self._index >= 0).tolist():
            if b not in self._overlay:
                yield b
        for b, v in self._overlay.items():
            if v is not _GONE:
                yield b

    def __len__(self) -> int:
        base = int((self._index >= 0).sum())
        for b, v in self._overlay.items():
            present = 0 <= b < len(self._index) and self._index[b] >= 0
            base += (v is not _GONE) - present
        return base

    def mask(self) -> np.ndarray:
        """A bool per block: holds a value."""
        m = self._index >= 0
        for b, v in self._overlay.items():
            m[b] = v is not _GONE
        return m


class OverlayMap(Generic[V]):
    """Writable for a replay: a keyframe's index array underneath, the replayed changes on top."""

    __slots__ = ("_index", "_values", "_overlay")

    def __init__(self, index: np.ndarray, values: list) -> None:
        self._index, self._values = index, values
        self._overlay: dict[int, object] = {}

    def __setitem__(self, key: int, value: V) -> None:
        self._overlay[key] = value

    def pop(self, key: int, default=None):
        try:
            v = self._view()[key]
        except KeyError:
            return default
        self._overlay[key] = _GONE
        return v

    def clear(self) -> None:
        self._index = np.full(len(self._index), -1, np.int32)
        self._overlay = {}

    def get(self, key: int, default=None):
        return self._view().get(key, default)

    def __contains__(self, key: int) -> bool:
        return key in self._view()

    def __iter__(self) -> Iterator[int]:
        return iter(self._view())

    def __len__(self) -> int:
        return len(self._view())

    def items(self):
        return self._view().items()

    def mask(self) -> np.ndarray:
        return self._view().mask()

    def freeze(self) -> IndexedView[V]:
        return IndexedView(self._index, self._values, dict(self._overlay))

    def _view(self) -> IndexedView[V]:
        return IndexedView(self._index, self._values, self._overlay)
