"""``SimFleetSource``: a request trace played over a simulated fleet, event by event, for the fleet window
(``kvscope --workload FILE --instances N --router POLICY``).

The fleet is ``engine.workload.fleet``'s: N engines, each with its own pool, scheduler and cost model, on
one virtual clock behind a router. A ``Source`` yields one engine's step records (the main window's grid,
tables and timeline); a fleet has N pools and its events are arrivals as well as steps, so this is its
own small source: ``advance`` plays events (up to a count, a virtual time or a wall-clock budget) and
``frame`` reads what the window draws straight from the engines between events: each pool's block
states, queue and hit rate, and the latest routing decisions. Played to the end, ``result`` is the same
``FleetResult`` the headless run prints.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from engine.inspect.snapshot import block_states


@dataclasses.dataclass(frozen=True, slots=True)
class SimFleetSpec:
    """Which trace, on which simulated machine, over which fleet."""

    path: str
    sim: object  # engine.workload.sim_config.SimConfig
    fleet: object  # engine.workload.fleet_config.FleetConfig (one router)
    limit: int | None = None


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


def build_sim_fleet_source(spec: SimFleetSpec, config) -> SimFleetSource:
    """Raises ``ValueError`` (a ``WorkloadError`` is one) with one line for a bad trace or option."""
    from engine.workload.fleet import build_fleet
    from engine.workload.reader import read_workload

    tokenizer = None
    if config.tokenizer:
        from engine.runner.models.loader import load_tokenizer

        tokenizer = load_tokenizer(config.tokenizer)
    workload = read_workload(spec.path, tokenizer=tokenizer, limit=spec.limit)
    (router,) = spec.fleet.routers
    return SimFleetSource(
        build_fleet(workload, config, spec.sim, spec.fleet.instances, router, spec.fleet.fleet_kv_tokens)
    )


class SimFleetSource:
    """Plays a ``FleetFeeder`` in slices; ``frame()`` is what is on screen."""

    def __init__(self, fleet) -> None:
        self.fleet = fleet
        self.events = 0
        self._result = None
        self._t0 = time.perf_counter()
        first = fleet.instances[0]
        w, sim = fleet.workload, first.feeder.result.sim
        self.title = (
            f"{len(fleet.instances)} x {sim.get('model')} on simulated {sim.get('gpu')} behind "
            f"{fleet.router.name} · {w.name} ({len(w.requests):,} requests)"
        )
        self.pool_text = (
            f"each pool {first.engine.pool.num_blocks:,} blocks of {first.engine.config.block_size} "
            f"tokens ({first.feeder.result.pool_why})"
        )

    def has_work(self) -> bool:
        return self.fleet.has_work()

    def advance(self, events: int | None = None, until_s: float | None = None, budget_s: float | None = None) -> int:
        """Play events until ``events`` were played, the fleet's clock passed ``until_s``, ``budget_s`` wall
        seconds went by, or the trace ended (whichever comes first); returns how many were played."""
        fleet, n = self.fleet, 0
        t0 = time.perf_counter()
        while events is None or n < events:
            if fleet.step() is None:
                break
            n += 1
            if until_s is not None and fleet.now >= until_s:
                break
            if budget_s is not None and n % 64 == 0 and time.perf_counter() - t0 >= budget_s:
                break
        self.events += n
        return n

    def frame(self) -> FleetFrame:
        fleet = self.fleet
        shown = []
        hits = queries = 0
        for inst in fleet.instances:
            pool, kv, ledger = inst.engine.pool, inst.engine.kv, inst.engine.ledger
            hits, queries = hits + kv.prefix_cache_hits, queries + kv.prefix_cache_queries
            shown.append(
                InstanceFrame(
                    inst.index,
                    block_states(ledger.ref_cnt_arr, ledger.has_hash_arr),
                    pool.usage(),
                    len(inst.scheduler.running),
                    inst.waiting(),
                    inst.routed,
                    kv.prefix_cache_hits / kv.prefix_cache_queries if kv.prefix_cache_queries else None,
                    inst.engine.runner.busy_s,
                )
            )
        s = fleet.skipped
        return FleetFrame(
            fleet.now,
            tuple(shown),
            tuple(fleet.routes),
            sum(i.routed for i in fleet.instances),
            s.skipped_too_long + s.skipped_too_big,
            len(fleet.workload.requests),
            hits / queries if queries else None,
            not fleet.has_work(),
        )

    def result(self):
        """The run's ``FleetResult`` (play it to the end first)."""
        if self._result is None:
            self._result = self.fleet.finish(time.perf_counter() - self._t0)
        return self._result
