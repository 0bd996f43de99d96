"""``ReplaySource``: plays a recorded trace back step by step; no model, no GPU; commands are refused."""

from __future__ import annotations

from dataclasses import dataclass

from engine.inspect.trace import read_header, replay_trace
from kvscope.sources.base import REPLAY_CAPABILITIES, ReadOnlySource, SourceInfo, StepRecord


@dataclass(frozen=True)
class RecordedAudit:
    """Stands in for an AuditReport in replays: the bad blocks the run's audit flagged."""

    bad_blocks: list[int]

    @property
    def ok(self) -> bool:
        return not self.bad_blocks

    @property
    def problems(self) -> list:
        return []


class ReplaySource(ReadOnlySource):
    refusal = "a replay is read-only: it shows what was recorded"

    def __init__(self, path: str) -> None:
        self.header = read_header(path)
        self.path = path
        self._records = replay_trace(path)
        self._next = next(self._records, None)
        self.step_count = 0
        h = self.header
        self.info = SourceInfo(
            model_name=f"replay of {h.get('model', '?')}",
            device="trace",
            dtype="-",
            num_blocks=h["num_blocks"],
            block_size=h["block_size"],
            block_bytes=int(h.get("block_bytes", 0)),
            max_model_len=int(h.get("max_model_len", 0)),
            load_seconds=0.0,
            num_cpu_blocks=int(h.get("num_cpu_blocks", 0)),
            scenario=h.get("scenario"),
            scenario_name=h.get("scenario"),
            kv_cache_dtype=h.get("config", {}).get("kv_cache_dtype", "auto"),
            capabilities=REPLAY_CAPABILITIES,
        )

    def has_work(self) -> bool:
        return self._next is not None

    def step(self) -> StepRecord:
        if self._next is None:
            raise ValueError("the trace has ended")
        rec = self._next
        self._next = next(self._records, None)
        # Records of commands between steps share the step number: fold them into one.
        events = list(rec.events)
        seconds = rec.seconds
        while self._next is not None and self._next.step == rec.step:
            rec = self._next
            events += rec.events
            seconds += rec.seconds
            self._next = next(self._records, None)
        self.step_count = rec.step
        audit = RecordedAudit(rec.leaked) if rec.leaked else None
        return StepRecord(rec.step, rec.snapshot, events, None, seconds, audit)

    def set_audit(self, on: bool) -> None:
        pass  # the recorded run's audit results are what a replay shows

    def decode(self, token_ids) -> str | None:
        return None

    def close(self) -> None:
        pass
