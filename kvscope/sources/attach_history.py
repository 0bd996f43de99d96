"""The attach timeline: the remote cache's forest at any earlier poll, in O(events), within a budget.

Like ``kvscope.history.RunHistory`` for the engine's own pool: every poll keeps its record (the
events, summary and counters) and the operations that changed the model; every ``keyframe_every``
polls a keyframe keeps a copy of the model (``RemoteCacheModel.copy`` shares the nodes). ``at(tick)``
copies the nearest keyframe at or before the tick and replays the operations in between. Past
``max_ops`` kept operations, the oldest keyframe and the polls it covers are dropped.
"""

from __future__ import annotations

import bisect

from kvscope.sources.attached import AttachRecord
from kvscope.sources.remote_cache import RemoteCacheModel


class AttachHistory:
    def __init__(self, keyframe_every: int = 100, max_ops: int = 500_000) -> None:
        self.keyframe_every = keyframe_every
        self.max_ops = max_ops
        self.ticks: list[int] = []
        self._records: dict[int, AttachRecord] = {}
        self._keyframes: list[tuple[int, RemoteCacheModel]] = []  # (tick, the model after that tick)
        self._ops = 0
        self.dropped = 0

    def record(self, rec: AttachRecord, model: RemoteCacheModel) -> None:
        """Keep a poll; ``model`` is the live model after it."""
        self.ticks.append(rec.tick)
        self._records[rec.tick] = rec
        self._ops += len(rec.ops)
        if not self._keyframes or rec.tick - self._keyframes[-1][0] >= self.keyframe_every:
            self._keyframes.append((rec.tick, model.copy()))
        while len(self._keyframes) >= 2 and self._ops > self.max_ops:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        self._keyframes.pop(0)
        first = self._keyframes[0][0]
        i = bisect.bisect_left(self.ticks, first)
        for t in self.ticks[:i]:
            self._ops -= len(self._records.pop(t).ops)
        del self.ticks[:i]
        self.dropped += i

    @property
    def reach(self) -> tuple[int, int] | None:
        return (self.ticks[0], self.ticks[-1]) if self.ticks else None

    def record_at(self, tick: int) -> AttachRecord | None:
        return self._records.get(tick)

    def at(self, tick: int) -> RemoteCacheModel | None:
        """The forest as it was after poll ``tick`` (None outside the reach)."""
        if not self.ticks or not self.ticks[0] <= tick <= self.ticks[-1]:
            return None
        k = bisect.bisect_right([t for t, _ in self._keyframes], tick) - 1
        start, base = self._keyframes[k]
        model = base.copy()
        for t in self.ticks[bisect.bisect_right(self.ticks, start) : bisect.bisect_right(self.ticks, tick)]:
            for op in self._records[t].ops:
                if op[0] == "ev":
                    model.apply(op[2], op[1], t)
                else:
                    model.clear(op[1])
        return model
