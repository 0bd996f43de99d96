"""``PollSummary``: what a source that polls (an attached engine or its replay, a fleet) adds to a headless run.

One type for every polling source: it counts the polls and keeps the last record; the source says what its
last poll means (``source.poll_summary(record, polls, **extra)``: the forest and its counters for an attached
engine, every instance and the fleet in all for a fleet), so a new kind of polling source needs no summary of
its own.
"""

from __future__ import annotations

from typing import Protocol

from kvscope.sources.base import StepRecord


class PollingSource(Protocol):
    def poll_summary(self, rec: StepRecord, polls: int, **extra) -> dict: ...


class PollSummary:
    def __init__(self, source: PollingSource) -> None:
        self.source = source
        self.polls = 0
        self.last: StepRecord | None = None

    def add(self, rec: StepRecord) -> None:
        self.polls += 1
        self.last = rec

    def as_dict(self, **extra) -> dict:
        """The source's account of its last poll (``as_dict`` before any poll is an error: check ``last``)."""
        if self.last is None:
            raise ValueError("no poll ran")
        return self.source.poll_summary(self.last, self.polls, **extra)
