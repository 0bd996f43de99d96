"""What one step of a simulated fleet yields (``FleetFrame``): each pool as its window draws it, the latest routes.
Apart from ``fleet_sim`` so that ``base.StepRecord`` can name it, as ``fleet_record`` is apart from ``fleet``.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True, slots=True)
class InstanceFrame:
    """One instance as the window draws it."""

    index: int
    states: np.ndarray  # each block's BlockState (uint8)
    usage: float  # blocks in use over the pool
    running: int
    waiting: int
    routed: int  # requests the router sent it so far
    hit_rate: float | None  # prefix-cache hits over queries so far, in tokens (vLLM's counters); None before any
    busy_s: float


@dataclasses.dataclass(frozen=True, slots=True)
class FleetFrame:
    clock: float  # the fleet's virtual seconds: its present (the next event's time)
    instances: tuple[InstanceFrame, ...]
    routes: tuple  # the latest routing decisions (engine.workload.fleet.Route), oldest first
    routed: int
    skipped: int
    requests: int  # in the trace
    hit_rate: float | None  # the fleet's, as each instance's
    done: bool
