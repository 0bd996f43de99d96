"""``SimFleetSource``: a request trace played over a simulated fleet, event by event, for the fleet window
(``kvscope --workload FILE --instances N --router POLICY``).

The fleet is ``engine.workload.fleet``'s: N engines, each with its own pool, scheduler and cost model, on
one virtual clock behind a router. It is a ``Source`` like the others (read-only; capability SIM_FLEET):
a step plays one slice of events (by default as much virtual time as the window's speed says a timer tick
is, within a wall-clock budget; or a count of events, ``play_events``), and its record's ``sim_fleet`` is the
``frame`` the window draws, read straight from the engines between events: each pool's block states, queue
and hit rate, and the latest routing decisions. Played to the end, ``result`` is the same ``FleetResult`` the
headless run prints.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from engine.inspect.snapshot import block_states
from kvscope.sources.base import SIM_FLEET_CAPABILITIES, ReadOnlySource, SourceInfo, StepRecord

TICK_S = 0.05  # the wall seconds a step stands for when it plays virtual time (the window's timer period)


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


class SimFleetSource(ReadOnlySource):
    """Plays a ``FleetFeeder`` in slices, one a step; ``frame()`` is what is on screen."""

    refusal = "a simulated fleet plays its trace: it takes no requests"

    def __init__(self, fleet) -> None:
        self.fleet = fleet
        self.events = 0
        self.step_count = 0
        self.speed: float | None = 1.0  # virtual seconds a wall second (None: as fast as this machine simulates)
        self._events_next: int | None = None  # the next step plays this many events instead
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

        engine = first.engine
        self.info = SourceInfo(
            model_name=self.title,
            device="simulated",
            dtype=str(sim.get("gpu", "")),
            num_blocks=engine.pool.num_blocks,
            block_size=engine.config.block_size,
            block_bytes=0,
            max_model_len=engine.max_model_len,
            load_seconds=0.0,
            capabilities=SIM_FLEET_CAPABILITIES,
            events_rebuild_pool=False,
        )

    def has_work(self) -> bool:
        return self.fleet.has_work()

    def set_speed(self, speed: float | None) -> None:
        """Virtual seconds a step plays per ``TICK_S`` wall seconds, times ``TICK_S`` (None: all it can)."""
        self.speed = speed

    def play_events(self, n: int) -> None:
        """The next step plays ``n`` events (a screenshot's ``--steps``), whatever the speed."""
        self._events_next = n

    def step(self) -> StepRecord:
        t0 = time.perf_counter()
        if self._events_next is not None:
            self.advance(events=self._events_next)
            self._events_next = None
        else:
            now = self.fleet.now
            until = None if self.speed is None else now + self.speed * TICK_S
            self.advance(until_s=until, budget_s=0.8 * TICK_S)
        self.step_count += 1
        frame = self.frame()
        return StepRecord(self.step_count, None, [], None, time.perf_counter() - t0, sim_fleet=frame)

    def set_audit(self, on: bool) -> None:
        pass  # every instance's pool is the engine's own: the simulation checks none of them

    def decode(self, token_ids) -> str | None:
        return None

    def close(self) -> None:
        pass

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
