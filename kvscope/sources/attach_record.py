"""What one poll of an attached engine yields (``AttachRecord``) and a sequence gap (``Gap``); no sockets.

Apart from ``attached`` so that ``base.StepRecord`` can name it: an attached source's step records carry
their poll as the snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.inspect.events import Event
from kvscope.sources.remote_cache import ForestSummary


@dataclass(frozen=True)
class Gap:
    """Batches ``first..last`` (inclusive) of a stream that never reached the model."""

    stream: int
    first: int
    last: int
    reason: str

    @property
    def size(self) -> int:
        return self.last - self.first + 1

    def as_dict(self) -> dict:
        return {
            "stream": self.stream,
            "first": self.first,
            "last": self.last,
            "batches": self.size,
            "reason": self.reason,
        }


@dataclass(frozen=True)
class AttachRecord:
    """One poll: what arrived, the forest's summary after it, and the counters so far."""

    tick: int
    t: float  # seconds since the source started
    events: tuple[Event, ...]  # RemoteStored / RemoteEvicted / RemoteCleared, for the event log
    summary: ForestSummary
    counters: dict[str, int]
    rates: dict[str, float]  # blocks stored / removed per second over the rate window
    gaps: tuple[Gap, ...]  # unrepaired gaps so far (the latest 100)
    batches: int  # batches applied in this poll
    # What changed the model in this poll, in order: ("ev", rank, wire event) or ("clear", rank);
    # replayed onto a copy of an earlier model, it rebuilds the forest at this poll (the timeline).
    ops: tuple = ()

    @property
    def step(self) -> int:  # what timelines index by
        return self.tick
