"""Plain (Qt-free) run history: one snapshot per step for the timeline, and metric series."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.inspect.snapshot import BlockState, KVSnapshot

SERIES = ("free", "cached", "used", "hit_rate", "running", "waiting", "tokens_per_s",
          "nvml_used", "torch_allocated", "torch_reserved", "process_rss")


@dataclass
class RunHistory:
    max_steps: int = 5000
    snapshots: dict[int, KVSnapshot] = field(default_factory=dict)
    steps: list[int] = field(default_factory=list)
    series: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in SERIES})
    _last_tokens: float = 0.0

    def record(self, snap: KVSnapshot, step_seconds: float, memory=None) -> None:
        """Keep the snapshot (replacing one of the same step) and extend the series once per step."""
        new_step = snap.step not in self.snapshots
        self.snapshots[snap.step] = snap
        if not new_step:
            return
        self.steps.append(snap.step)
        if len(self.steps) > self.max_steps:
            old = self.steps.pop(0)
            self.snapshots.pop(old, None)
            for v in self.series.values():
                v.pop(0)
        c = snap.counters
        counts = np.bincount(snap.state, minlength=len(BlockState))
        q = c.get("prefix_cache_queries", 0)
        tokens = c.get("generation_tokens", 0)
        tps = (tokens - self._last_tokens) / step_seconds if step_seconds > 0 else 0.0
        self._last_tokens = tokens
        row = {
            "free": counts[BlockState.FREE], "cached": counts[BlockState.CACHED],
            "used": counts[BlockState.USED] + counts[BlockState.SHARED],
            "hit_rate": (c.get("prefix_cache_hits", 0) / q) if q else 0.0,
            "running": c.get("num_requests_running", 0), "waiting": c.get("num_requests_waiting", 0),
            "tokens_per_s": tps,
            "nvml_used": getattr(memory, "nvml_used", None) or 0,
            "torch_allocated": getattr(memory, "torch_allocated", None) or 0,
            "torch_reserved": getattr(memory, "torch_reserved", None) or 0,
            "process_rss": getattr(memory, "process_rss", 0) or 0,
        }
        for k, v in row.items():
            self.series[k].append(float(v))

    @property
    def latest(self) -> KVSnapshot | None:
        return self.snapshots[self.steps[-1]] if self.steps else None

    def at(self, step: int) -> KVSnapshot | None:
        return self.snapshots.get(step)
