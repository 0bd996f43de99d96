"""The free queue's order as arrays, for snapshots: the linked list stays the pool's source of truth.

Walking a linked list of a million free blocks costs ~100 ms a snapshot. Here every block that joins
the free queue is written, in order, into an append log (``log[position] = block``) and remembers its
position (``pos[block]``); leaving the queue (popped for allocation, or hit while cached) clears its
position. The queue's order is then the log's live entries, read with two array operations. Updates
come in batches, one per pool call, so the hot path pays a few microseconds a call, not per block.
"""

from __future__ import annotations

import numpy as np


class FreeOrder:
    def __init__(self, num_blocks: int) -> None:
        self.log = np.empty(2 * num_blocks + 1, np.int32)
        self.log[:num_blocks] = np.arange(num_blocks, dtype=np.int32)
        self.pos = np.arange(num_blocks, dtype=np.int64)  # -1: not on the free queue
        self.start = 0  # log entries before this are all gone
        self.end = num_blocks
        # Python-int views of the same memory for the one-block calls (a numpy scalar access costs ~5x)
        self._log, self._pos = self.log.data, self.pos.data

    @classmethod
    def from_order(cls, num_blocks: int, order) -> FreeOrder:
        """A queue holding ``order`` (head first): a timeline keyframe's."""
        f = cls(num_blocks)
        order = np.asarray(order, np.int32)
        f.pos[:] = -1
        f.log[: len(order)] = order
        f.pos[order] = np.arange(len(order))
        f.end = len(order)
        return f

    def __contains__(self, block_id: int) -> bool:
        return self._pos[block_id] >= 0

    def head(self) -> int | None:
        """The next block to be handed out (None: nothing free)."""
        log, pos, start, end = self._log, self._pos, self.start, self.end
        while start < end and pos[log[start]] != start:
            start += 1
        self.start = start
        return log[start] if start < end else None

    def appended(self, ids: list[int]) -> None:
        """``ids`` joined the queue's tail, in this order."""
        k = len(ids)
        if not k:
            return
        if self.end + k > len(self.log):
            self._compact()
        self.log[self.end : self.end + k] = ids
        self.pos[ids] = np.arange(self.end, self.end + k)
        self.end += k

    def append_one(self, block_id: int) -> None:
        """``appended([block_id])`` without the array temporaries (a replay applies events one by one)."""
        if self.end == len(self.log):
            self._compact()
        self._log[self.end] = block_id
        self._pos[block_id] = self.end
        self.end += 1

    def remove_one(self, block_id: int) -> None:
        self._pos[block_id] = -1

    def removed(self, ids: list[int]) -> None:
        """``ids`` left the queue (popped from its head or taken from its middle)."""
        if ids:
            self.pos[ids] = -1

    def order(self) -> np.ndarray:
        """The free block ids, head (next to be handed out) first."""
        cand = self.log[self.start : self.end]
        live = cand[self.pos[cand] == np.arange(self.start, self.end)]
        return live

    def _compact(self) -> None:
        live = self.order()
        n = len(live)
        self.log[:n] = live
        self.pos[live] = np.arange(n)
        self.start, self.end = 0, n
