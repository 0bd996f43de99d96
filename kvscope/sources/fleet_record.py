"""What one poll of a fleet yields (``FleetRecord``): each instance's row and the fleet's totals; no sockets.

Apart from ``fleet`` so that ``base.StepRecord`` can name it, as ``attach_record`` is apart from ``attached``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvscope.messages import count_text
from kvscope.sources.fleet_index import Duplication


@dataclass(frozen=True)
class InstanceRow:
    """One instance at one poll."""

    name: str
    endpoint: str
    state: str  # "up", "down" (it was up and went) or "connecting" (never reached); the worst of its ranks
    state_s: float  # seconds in that state
    blocks: int
    tokens: int
    bytes: int | None  # blocks x its bytes per block
    stored_per_s: float  # over the last rate window (10 s)
    removed_per_s: float
    shared_blocks: int  # its blocks another instance holds too
    shared_bytes: int | None
    restarts: int
    gaps_unrepaired: int
    batches_missing: int
    last_batch_s: float | None  # seconds since its last batch
    reproducible: bool
    hashes: str  # HashCheck.describe()
    metrics: dict | None  # its /metrics (Scrape.as_dict), None without a URL

    @property
    def flags(self) -> tuple[str, ...]:
        """What is wrong with it, in words (empty: nothing)."""
        out = []
        if self.state != "up":
            out.append(f"{self.state} {self.state_s:.0f} s")
        if self.restarts:
            out.append(f"restarted {self.restarts}x")
        if self.gaps_unrepaired:
            out.append(f"{count_text(self.batches_missing, 'batch', 'batches')} missing")
        if self.metrics and self.metrics.get("error"):
            out.append("metrics unreachable")
        return tuple(out)

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["stored_per_s"], d["removed_per_s"] = round(self.stored_per_s, 3), round(self.removed_per_s, 3)
        d["state_s"] = round(self.state_s, 1)
        d["last_batch_s"] = None if self.last_batch_s is None else round(self.last_batch_s, 1)
        d["flags"] = list(self.flags)
        return d


@dataclass(frozen=True)
class FleetRecord:
    """One poll of the whole fleet."""

    tick: int
    t: float  # seconds since the fleet was opened
    instances: tuple[InstanceRow, ...]
    blocks: int  # every instance's blocks added up (a block two instances hold counts twice)
    distinct_blocks: int  # hashes held by at least one instance
    duplication: Duplication
    notices: tuple[str, ...]  # what changed about the instances in this poll, one line each

    @property
    def step(self) -> int:
        return self.tick

    def in_all(self) -> dict:
        return {
            "instances": len(self.instances),
            "up": sum(r.state == "up" for r in self.instances),
            "blocks": self.blocks,
            "distinct_blocks": self.distinct_blocks,
            **self.duplication.as_dict(),
        }
