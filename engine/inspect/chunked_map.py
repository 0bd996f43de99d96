"""A block-id keyed map that hands out frozen copies in O(chunks), copying on write.

Snapshots and timeline keyframes need the prefix cache's maps (block id -> tokens, hash)
as they were at one step. Copying a dict of 65,536 entries per snapshot costs milliseconds;
here a frozen copy shares every chunk, and a later write copies only the chunk it touches.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Generic, TypeVar

V = TypeVar("V")
CHUNK_BITS = 10  # 1,024 block ids a chunk


class FrozenChunkedMap(Mapping[int, V], Generic[V]):
    __slots__ = ("_chunks", "_len")

    def __init__(self, chunks: tuple[dict[int, V], ...], length: int) -> None:
        self._chunks = chunks
        self._len = length

    def __getitem__(self, key: int) -> V:
        i = key >> CHUNK_BITS
        if not 0 <= i < len(self._chunks):
            raise KeyError(key)
        return self._chunks[i][key]

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, int):
            return False
        i = key >> CHUNK_BITS
        return 0 <= i < len(self._chunks) and key in self._chunks[i]

    def get(self, key, default=None):
        try:
            return self[key]
        except KeyError:
            return default

    def __iter__(self) -> Iterator[int]:
        for c in self._chunks:
            yield from c

    def __len__(self) -> int:
        return self._len

    def __repr__(self) -> str:
        return f"FrozenChunkedMap({dict(self)!r})"

    def __reduce__(self):  # pickles as its contents, not as shared chunks
        return (_rebuild, (dict(self), len(self._chunks)))

    def thaw(self) -> ChunkedMap[V]:
        """A writable map starting from this one (chunks are shared until written)."""
        m: ChunkedMap[V] = ChunkedMap(len(self._chunks) << CHUNK_BITS)
        m._chunks = list(self._chunks)
        m._shared = [True] * len(self._chunks)
        m._len = self._len
        return m


def _rebuild(items: dict, num_chunks: int) -> FrozenChunkedMap:
    m: ChunkedMap = ChunkedMap(num_chunks << CHUNK_BITS)
    for k, v in items.items():
        m[k] = v
    return m.freeze()


class ChunkedMap(Generic[V]):
    """Keys are block ids in ``[0, capacity)``."""

    __slots__ = ("_chunks", "_shared", "_len")

    def __init__(self, capacity: int) -> None:
        n = max(1, (capacity + (1 << CHUNK_BITS) - 1) >> CHUNK_BITS)
        self._chunks: list[dict[int, V]] = [{} for _ in range(n)]
        self._shared = [False] * n
        self._len = 0

    def _own(self, i: int) -> dict[int, V]:
        if self._shared[i]:
            self._chunks[i] = dict(self._chunks[i])
            self._shared[i] = False
        return self._chunks[i]

    def __setitem__(self, key: int, value: V) -> None:
        c = self._own(key >> CHUNK_BITS)
        if key not in c:
            self._len += 1
        c[key] = value

    def pop(self, key: int, default=None):
        i = key >> CHUNK_BITS
        if key not in self._chunks[i]:
            return default
        self._len -= 1
        return self._own(i).pop(key)

    def clear(self) -> None:
        self._chunks = [{} for _ in self._chunks]
        self._shared = [False] * len(self._chunks)
        self._len = 0

    def __getitem__(self, key: int) -> V:
        return self._chunks[key >> CHUNK_BITS][key]

    def get(self, key: int, default=None):
        return self._chunks[key >> CHUNK_BITS].get(key, default)

    def __contains__(self, key: int) -> bool:
        return key in self._chunks[key >> CHUNK_BITS]

    def __len__(self) -> int:
        return self._len

    def values(self):
        for c in self._chunks:
            yield from c.values()

    def __iter__(self):
        for c in self._chunks:
            yield from c

    def items(self):
        for c in self._chunks:
            yield from c.items()

    def freeze(self) -> FrozenChunkedMap[V]:
        """An immutable copy in O(chunks): every chunk becomes shared, later writes copy it first."""
        self._shared = [True] * len(self._chunks)
        return FrozenChunkedMap(tuple(self._chunks), self._len)
