"""A fleet of simulated vLLM instances behind a router, on one virtual clock.

Each instance is what ``build_engine`` makes for a single run: its own engine (scheduler, block pool,
prefix cache, preemption) over its own ``SimRunner`` and cost model, and its own ``WorkloadFeeder``
recording its requests. The fleet adds what a single engine has no need of: a router (routers.py) and
one virtual clock, kept as a discrete-event loop over two kinds of event:

- **an arrival** (the trace's next request, at its arrival time): the router chooses an instance,
  reading every instance's state as of that instance's last step; the request joins that instance's
  waiting queue (an idle instance's clock moves on to the arrival);
- **a step** of the instance with work whose clock is earliest: its engine steps once and its clock
  advances by the cost model's step time.

An arrival at or before the earliest busy clock comes first, which is the single engine's own rule
(it adds every arrival its clock has reached before each step), so a fleet of one is exactly
``run_workload``. In ``sequential`` mode one request at a time runs across the whole fleet: the next
is routed when every instance is idle, at the fleet's clock. A request the engine could never run
(longer than the context, or bigger than an instance's whole pool) is counted and skipped before it is
routed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import time
from array import array
from collections import Counter, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from ..config import EngineConfig
from .driver import (
    Skips,
    WorkloadFeeder,
    WorkloadResult,
    build_engine,
    count_skip,
    peak_rss_mb,
    percentile,
    skip_reason,
)
from .reader import TraceRequest, Workload
from .routers import Arrival, Router, make_router
from .sim_config import SimConfig

SESSION_CHUNK = 512  # tokens of a kvscope prompt per session-key block (Mooncake's hash-id block)


class FleetInstance:
    """One simulated vLLM instance, as a router sees it (``routers.Instance``)."""

    def __init__(self, index: int, engine, feeder: WorkloadFeeder) -> None:
        self.index = index
        self.engine = engine
        self.feeder = feeder
        self.scheduler = engine.scheduler
        self.cached = engine.pool.cached  # the pool's hash map: block hash -> block
        self.routed = 0
        self.peak_waiting = 0

    @property
    def clock(self) -> float:
        return self.engine.runner.clock

    def load(self) -> int:
        s = self.scheduler
        return len(s.running) + len(s.waiting) + len(s.swapped)

    def waiting(self) -> int:
        s = self.scheduler
        return len(s.waiting) + len(s.swapped)

    def cached_prefix(self, block_hashes: Sequence[bytes]) -> int:
        """How many of ``block_hashes`` (a request's chained block hashes), from the first, its pool holds."""
        cached, n = self.cached, 0
        for h in block_hashes:
            if h not in cached:
                break
            n += 1
        return n


@dataclass(frozen=True, slots=True)
class Route:
    """One routing decision: what the window shows as a request arrives."""

    line: int
    instance: int
    arrival_s: float
    prompt_tokens: int
    loads: tuple[int, ...]  # each instance's running + waiting requests as the router saw them
    cached_blocks: tuple[int, ...] | None  # each instance's cached prefix, in blocks (the prefix routers')


def session_keys(workload: Workload) -> list[Hashable]:
    """Each request's session key, for session affinity: the trace's own (a kvscope request's ``session``),
    else its first block that at most half of the trace's requests have. A block id names a whole prefix
    (ids are chained), so a system prompt that opens every conversation is skipped: hashing on it would send
    the whole trace to one instance. Token-id prompts are cut into 512-token blocks for this."""
    reqs = workload.requests
    blocks = [r.hash_ids if r.hash_ids is not None else _token_blocks(r.token_ids or []) for r in reqs]
    seen = Counter(b for bs in blocks for b in set(bs))
    half = len(reqs) / 2
    keys: list[Hashable] = []
    for r, bs in zip(reqs, blocks):
        if r.session is not None:
            keys.append(("session", r.session))
            continue
        keys.append(next((b for b in bs if seen[b] <= half), bs[-1]))
    return keys


def _token_blocks(ids: list[int]) -> list[bytes]:
    """A token prompt's 512-token blocks as chained digests (each names the whole prefix up to its end, as a
    hash id does)."""
    out, digest = [], b""
    for i in range(0, len(ids), SESSION_CHUNK):
        digest = hashlib.blake2b(digest + array("q", ids[i : i + SESSION_CHUNK]).tobytes(), digest_size=16).digest()
        out.append(digest)
    return out


class FleetFeeder:
    """Plays a workload over ``instances`` behind ``router``; ``step()`` handles one event (an arrival or one
    instance's step) and returns it, so a window can play the fleet live; ``run()`` plays it to the end."""

    def __init__(
        self,
        instances: list[FleetInstance],
        router: Router,
        workload: Workload,
        sequential: bool = False,
        time_scale: float = 1.0,
        recent: int = 64,
    ) -> None:
        self.instances = instances
        self.router = router
        self.workload = workload
        self.sequential = sequential
        self.time_scale = time_scale
        self.next = 0
        self.sessions = session_keys(workload) if router.name == "session" else None
        first = instances[0]
        self.front = first.feeder  # makes a request's tokens and Request (the same for every instance)
        self.skipped = Skips()
        self.routes: deque[Route] = deque(maxlen=recent)  # the latest decisions
        self.peak_running = 0
        self.peak_waiting = 0
        # Kept as they change (an event costs O(log N), not a pass over the fleet): a heap of (clock, index) with
        # one entry per instance with work (only a step or an idle instance's first request moves a clock), and
        # each instance's running and waiting counts with their totals.
        self._busy: list[tuple[float, int]] = []
        self._running = [0] * len(instances)
        self._running_total = 0
        self._waiting = [0] * len(instances)
        self._waiting_total = 0

    # -- state ---------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.next < len(self.workload.requests) or bool(self._busy)

    @property
    def clock(self) -> float:
        """The fleet's virtual clock: the latest instance clock (where the run ends)."""
        return max(i.clock for i in self.instances)

    @property
    def now(self) -> float:
        """The fleet's present: the time of its next event (the next arrival, or the earliest busy instance's
        clock), or its clock once nothing is left. A busy instance's clock runs ahead by its step."""
        reqs, times = self.workload.requests, []
        if self._busy:
            times.append(self._busy[0][0])
        if self.next < len(reqs) and not self.sequential:
            times.append(reqs[self.next].arrival_s * self.time_scale)
        return min(times) if times else self.clock

    # -- one event -------------------------------------------------------------------------------
    def step(self) -> Route | tuple[FleetInstance, object] | None:
        """Route the next arrival, or step the earliest busy instance; returns the ``Route`` or
        ``(instance, StepOutput)``, or None when the workload is done."""
        reqs, scale, busy = self.workload.requests, self.time_scale, self._busy
        while True:
            if self.sequential:
                if busy:
                    return self._step(self.instances[busy[0][1]])
                if self.next >= len(reqs):
                    return None
                route = self._route(reqs[self.next], self.clock, catch_up=True)
            elif self.next < len(reqs) and (not busy or reqs[self.next].arrival_s * scale <= busy[0][0]):
                r = reqs[self.next]
                route = self._route(r, r.arrival_s * scale, catch_up=False)
            elif not busy:
                return None
            else:
                inst = self.instances[busy[0][1]]
                self.peak_waiting = max(self.peak_waiting, self._waiting_total)
                inst.peak_waiting = max(inst.peak_waiting, self._waiting[inst.index])
                return self._step(inst)
            if route is not None:  # else it was skipped: on to the next event
                return route

    def run(self, progress: Callable[[int, int], None] | None = None) -> None:
        total, n = len(self.workload.requests), 0
        step = self.step
        while step() is not None:
            n += 1
            if progress is not None and n % 1024 == 0:
                progress(self.next, total)

    def _route(self, r: TraceRequest, at: float, catch_up: bool) -> Route | None:
        """Send ``r`` (arriving at ``at``) where the router says; None if it was skipped.
        ``catch_up``: the chosen instance's clock moves on to ``at`` (sequential: the fleet's clock)."""
        self.next += 1
        first = self.instances[0].engine
        why = skip_reason(first, r, self.sequential)
        if why is not None:
            count_skip(self.skipped, why, r)
            return None
        req = self.front.request_for(first, r)
        router = self.router
        hashes = ()
        if router.needs_hashes:  # the hit cap: never the prompt's last token (every instance hashes alike)
            bs = first.config.block_size
            hashes = first.kv.block_hashes(req, (req.num_tokens - 1) // bs * bs)
        arrival = Arrival(r.line, self.sessions[self.next - 1] if self.sessions is not None else None, hashes)
        loads = tuple(x.load() for x in self.instances)
        i = router.choose(arrival, self.instances)
        inst = self.instances[i]
        engine = inst.engine
        idle = not engine.has_unfinished()
        if catch_up or idle:
            engine.runner.clock = max(engine.runner.clock, at)
        inst.feeder.admit(engine, req, r, at)
        if idle:
            heapq.heappush(self._busy, (engine.runner.clock, i))
        self._count(inst)
        inst.routed += 1
        route = Route(
            r.line,
            i,
            at,
            r.prompt_len,
            loads,
            tuple(arrival.cached_prefixes(self.instances)) if router.needs_hashes else None,
        )
        self.routes.append(route)
        return route

    def _step(self, inst: FleetInstance):
        engine = inst.engine
        heapq.heappop(self._busy)  # its entry: the earliest
        out = engine.step()
        inst.feeder.after_step(engine, out)
        if engine.has_unfinished():
            heapq.heappush(self._busy, (engine.runner.clock, inst.index))
        self._count(inst)
        self.peak_running = max(self.peak_running, self._running_total)
        return inst, out

    def _count(self, inst: FleetInstance) -> None:
        i, s = inst.index, inst.scheduler
        running, waiting = len(s.running), len(s.waiting)
        self._running_total += running - self._running[i]
        self._waiting_total += waiting - self._waiting[i]
        self._running[i], self._waiting[i] = running, waiting

    # -- the end ---------------------------------------------------------------------------------
    def finish(self, wall_s: float = 0.0) -> FleetResult:
        """Every instance's totals and the fleet's (call once ``step()`` returned None)."""
        per = []
        for inst in self.instances:
            res = inst.feeder.finish(wall_s)
            res.peak_waiting = inst.peak_waiting
            per.append(res)
        first = per[0]
        n = len(per)
        blocks = sum(r.num_gpu_blocks for r in per)
        pool = first.pool_why if n == 1 else f"{n} x {first.num_gpu_blocks:,} blocks ({first.pool_why})"
        total = WorkloadResult(
            first.workload,
            first.format,
            first.mode,
            first.eviction_policy,
            first.block_size,
            blocks,
            pool,
            first.sim,
            first.max_model_len,
        )
        skipped = self.skipped
        total.skipped_too_long, total.skipped_too_big = skipped.skipped_too_long, skipped.skipped_too_big
        total.skipped_prompt_tokens = skipped.skipped_prompt_tokens
        total.records = sorted((rec for r in per for rec in r.records), key=lambda rec: rec.line)
        for key in (
            "requests",
            "failed",
            "prompt_tokens",
            "cached_tokens",
            "generated_tokens",
            "evictions",
            "preemptions",
            "steps",
            "busy_s",
        ):
            setattr(total, key, sum(getattr(r, key) for r in per))
        total.virtual_s = max(r.virtual_s for r in per)
        total.peak_running, total.peak_waiting = self.peak_running, self.peak_waiting
        total.wall_s, total.peak_rss_mb = wall_s, peak_rss_mb()
        return FleetResult(total, per, self.router)


@dataclass(slots=True)
class FleetResult:
    """The fleet as a whole (``total``: a ``WorkloadResult`` like a single run's) and each instance."""

    total: WorkloadResult
    instances: list[WorkloadResult]
    router: Router

    @property
    def hit_rate(self) -> float:
        return self.total.hit_rate

    def shares(self) -> list[float]:
        n = self.total.requests
        return [r.requests / n if n else 0.0 for r in self.instances]

    @property
    def load_imbalance(self) -> float:
        """The busiest instance's share of the requests over a fair share (1 / N): 1 is even, N is all on one."""
        return max(self.shares()) * len(self.instances)

    def summary(self) -> dict:
        """A single run's ``workload`` object for the fleet as a whole, plus ``router``, ``load_imbalance`` and
        ``instances`` (one entry each). With one instance, everything but these three is the single run's."""
        s = self.total.summary()
        n = len(self.instances)
        s["utilization"] = self.total.busy_s / (n * self.total.virtual_s) if self.total.virtual_s else 0.0
        s["router"] = {"name": self.router.name, **self.router.params()}
        s["load_imbalance"] = self.load_imbalance
        s["instances"] = [
            _instance_entry(i, r, share, self.total.virtual_s)
            for i, (r, share) in enumerate(zip(self.instances, self.shares()))
        ]
        return s


def _instance_entry(i: int, r: WorkloadResult, share: float, fleet_s: float) -> dict:
    """One instance's entry; its ``utilization`` is its busy time over the fleet's whole run."""
    ttfts = sorted(rec.ttft_s for rec in r.records if rec.ttft_s is not None)
    return {
        "instance": i,
        "requests": r.requests,
        "share": share,
        "num_gpu_blocks": r.num_gpu_blocks,
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens,
        "hit_rate": r.hit_rate,
        "evictions": r.evictions,
        "preemptions": r.preemptions,
        "failed": r.failed,
        "ttft_p50_s": percentile(ttfts, 50) if ttfts else None,
        "ttft_p99_s": percentile(ttfts, 99) if ttfts else None,
        "busy_s": r.busy_s,
        "utilization": r.busy_s / fleet_s if fleet_s else 0.0,
        "virtual_s": r.virtual_s,
        "steps": r.steps,
        "peak_running": r.peak_running,
        "peak_waiting": r.peak_waiting,
    }


def instance_sim(sim: SimConfig, instances: int, fleet_kv_tokens: float | None) -> SimConfig:
    """Each instance's ``SimConfig``: ``fleet_kv_tokens`` (the whole fleet's pool) split evenly, else as given."""
    if fleet_kv_tokens is None:
        return sim
    return dataclasses.replace(sim, kv_tokens=fleet_kv_tokens / instances)


def build_fleet(
    workload: Workload,
    config: EngineConfig | None = None,
    sim: SimConfig | None = None,
    instances: int = 1,
    router: str | Router = "round-robin",
    fleet_kv_tokens: float | None = None,
) -> FleetFeeder:
    """``instances`` engines as ``build_engine`` makes them, behind ``router`` (a name or a ``Router``).
    Raises ``ValueError`` (one line) for a bad option, ``WorkloadError`` for a trace this cannot play."""
    if not isinstance(instances, int) or isinstance(instances, bool) or instances < 1:
        raise ValueError(f"--instances must be an integer >= 1, got {instances!r}")
    config, sim = config or EngineConfig(), sim or SimConfig()
    rt = make_router(router) if isinstance(router, str) else router
    each = instance_sim(sim, instances, fleet_kv_tokens)
    members = [FleetInstance(i, *build_engine(workload, config, each)) for i in range(instances)]
    return FleetFeeder(members, rt, workload, sim.sequential, sim.time_scale)


def run_fleet(
    workload: Workload,
    config: EngineConfig | None = None,
    sim: SimConfig | None = None,
    instances: int = 1,
    router: str | Router = "round-robin",
    fleet_kv_tokens: float | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> FleetResult:
    """Play the whole workload over the fleet headless."""
    t0 = time.perf_counter()
    fleet = build_fleet(workload, config, sim, instances, router, fleet_kv_tokens)
    fleet.run(progress)
    return fleet.finish(time.perf_counter() - t0)
