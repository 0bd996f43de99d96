"""The CPU swap pool: plain block ids with a free list (no caching, no sharing)."""

from __future__ import annotations

from collections import deque


class CpuBlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.owner: dict[int, str] = {}  # cpu block id -> request id

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def allocate(self, n: int, request_id: str) -> list[int] | None:
        if n > len(self.free):
            return None
        ids = [self.free.popleft() for _ in range(n)]
        for i in ids:
            self.owner[i] = request_id
        return ids

    def release(self, ids: list[int]) -> None:
        for i in ids:
            assert self.owner.pop(i, None) is not None, f"CPU block {i} released twice"
            self.free.append(i)
