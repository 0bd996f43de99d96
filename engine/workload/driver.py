"""Play a workload through the engine on a virtual clock, and count what its prefix cache did.

Two modes:

- **full**: each request is added when the virtual clock reaches its arrival; the scheduler runs as
  it always does (up to ``max_num_seqs`` at once, chunked prefill within ``max_num_batched_tokens``,
  preemption when blocks run out; blocks in use cannot be evicted), and each request generates its
  trace's output length (``ignore_eos``). Every step advances the clock by the cost model's step
  time, so arrivals queue and time to first token grows as on the simulated card.
- **sequential** (Mooncake's Figure 9 assumption): one request at a time, each finished before the
  next is added, arrival times ignored. A request only prefills its prompt (``max_tokens=1``, and
  that one token is not counted): the trace's later hash ids already stand for any output that a
  later turn sends back. Its prompt is prefilled in one step (the step budget is raised to the
  context length), which changes no hit.

The hit count is the engine's own: ``Request.num_cached_tokens``, the prefix-cache hit at the
request's first admission (vLLM's rule: whole blocks, never the prompt's last token). A request
longer than the simulated model's context, or needing more blocks than the whole pool, is counted
and skipped.

``WorkloadFeeder`` is the part that feeds requests and records them; it has the step-hook shape
(``before_step``, ``after_step``, ``has_work``) that a window's live source calls around each
``engine.step()``, so the same feeder plays a trace headless (``run_workload``) or live.
"""

from __future__ import annotations

import dataclasses
import math
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..config import EngineConfig, RequestOutputKind, SamplingParams
from ..core.kv_cache_manager import cdiv
from ..core.request import Request
from .reader import TraceRequest, Workload, WorkloadError
from .sim_config import SimConfig
from .sim_runner import SimRunner, pool_blocks
from .tokens import HashIdTokens


@dataclass(slots=True)
class RequestRecord:
    """One request as it ran (virtual seconds)."""

    line: int
    arrival_s: float
    prompt_tokens: int
    cached_tokens: int = 0
    ttft_s: float | None = None
    finish_s: float | None = None
    preemptions: int = 0
    error: str | None = None


@dataclass(slots=True)
class WorkloadResult:
    """What a run found. ``summary()`` is the ``workload`` object of the headless JSON."""

    workload: str
    format: str
    mode: str  # "full" or "sequential"
    eviction_policy: str
    block_size: int
    num_gpu_blocks: int
    pool_why: str
    sim: dict
    max_model_len: int
    requests: int = 0  # that ran
    skipped_too_long: int = 0  # prompt >= the simulated model's context
    skipped_too_big: int = 0  # needs more blocks than the whole pool
    failed: int = 0  # finished with an error (an engine step failed)
    prompt_tokens: int = 0  # of the requests that ran
    cached_tokens: int = 0
    skipped_prompt_tokens: int = 0
    generated_tokens: int = 0
    evictions: int = 0
    preemptions: int = 0
    steps: int = 0
    virtual_s: float = 0.0  # the virtual clock at the end
    busy_s: float = 0.0  # of which the simulated card was busy
    peak_running: int = 0
    peak_waiting: int = 0
    wall_s: float = 0.0
    peak_rss_mb: float = 0.0  # this process's, so far (a whole sweep's peak if several runs share it)
    records: list[RequestRecord] = field(default_factory=list, repr=False)

    @property
    def kv_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size

    @property
    def hit_rate(self) -> float:
        """Cached prompt tokens over prompt tokens, of the requests that ran."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def ttft(self, q: float) -> float | None:
        xs = sorted(r.ttft_s for r in self.records if r.ttft_s is not None)
        return percentile(xs, q) if xs else None

    def summary(self) -> dict:
        ttfts = sorted(r.ttft_s for r in self.records if r.ttft_s is not None)
        return {
            "workload": self.workload,
            "format": self.format,
            "mode": self.mode,
            "eviction_policy": self.eviction_policy,
            "block_size": self.block_size,
            "num_gpu_blocks": self.num_gpu_blocks,
            "kv_tokens": self.kv_tokens,
            "pool": self.pool_why,
            "max_model_len": self.max_model_len,
            "sim": self.sim,
            "requests": self.requests,
            "skipped_too_long": self.skipped_too_long,
            "skipped_too_big": self.skipped_too_big,
            "failed": self.failed,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "hit_rate": self.hit_rate,
            "skipped_prompt_tokens": self.skipped_prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "evictions": self.evictions,
            "preemptions": self.preemptions,
            "ttft_p50_s": percentile(ttfts, 50) if ttfts else None,
            "ttft_p99_s": percentile(ttfts, 99) if ttfts else None,
            "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else None,
            "steps": self.steps,
            "virtual_s": self.virtual_s,
            "busy_s": self.busy_s,
            "utilization": self.busy_s / self.virtual_s if self.virtual_s else 0.0,
            "peak_running": self.peak_running,
            "peak_waiting": self.peak_waiting,
            "wall_s": self.wall_s,
            "peak_rss_mb": self.peak_rss_mb,
        }


def percentile(sorted_xs: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list."""
    i = min(len(sorted_xs) - 1, max(0, math.ceil(q / 100 * len(sorted_xs)) - 1))
    return sorted_xs[i]


def peak_rss_mb() -> float:
    """This process's peak resident memory. On Linux, VmHWM: ru_maxrss of a process started by a big one
    keeps the parent's peak from before the exec."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / 2**20 if sys.platform == "darwin" else r / 1024


def skip_reason(engine, r: TraceRequest, sequential: bool = False) -> str | None:
    """Why the engine cannot run ``r`` at all ("too_long": the prompt fills the simulated model's context;
    "too_big": it needs more blocks than the whole pool), or None."""
    if r.prompt_len >= engine.max_model_len:
        return "too_long"
    max_tokens = 1 if sequential else r.max_tokens
    if cdiv(min(r.prompt_len + max_tokens, engine.max_model_len), engine.config.block_size) > engine.pool.num_blocks:
        return "too_big"
    return None


@dataclass(slots=True)
class Skips:
    """The skip counters of a ``WorkloadResult``, alone (a fleet counts them before routing)."""

    skipped_too_long: int = 0
    skipped_too_big: int = 0
    skipped_prompt_tokens: int = 0


def count_skip(result: WorkloadResult | Skips, why: str, r: TraceRequest) -> None:
    if why == "too_long":
        result.skipped_too_long += 1
    else:
        result.skipped_too_big += 1
    result.skipped_prompt_tokens += r.prompt_len


class WorkloadFeeder:
    """Adds a workload's requests to an engine over a ``SimRunner`` as its virtual clock reaches them, and
    records each request (a step hook: ``before_step`` / ``after_step`` around every ``engine.step()``)."""

    def __init__(
        self,
        engine,
        workload: Workload,
        sequential: bool = False,
        tokens: HashIdTokens | None = None,
        pool_why: str = "",
        sim: dict | None = None,
        time_scale: float = 1.0,
    ) -> None:
        self.engine = engine
        self.workload = workload
        self.sequential = sequential
        self.time_scale = time_scale
        self.tokens = tokens
        self.next = 0  # the next request of the workload to add
        self.live: dict[str, tuple[RequestRecord, Request]] = {}  # request id -> (record, Request)
        self.result = WorkloadResult(
            workload.name,
            workload.format,
            "sequential" if sequential else "full",
            engine.config.eviction_policy,
            engine.config.block_size,
            engine.pool.num_blocks,
            pool_why,
            sim or {},
            engine.max_model_len,
        )
        self._params = (
            SamplingParams(max_tokens=1, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
            if sequential
            else None
        )

    @property
    def clock(self) -> float:
        return self.engine.runner.clock

    # -- the step hook ------------------------------------------------------------------
    def has_work(self, engine=None) -> bool:
        """Requests not added yet."""
        return self.next < len(self.workload.requests)

    def before_step(self, engine=None) -> None:
        engine = engine or self.engine
        reqs, runner = self.workload.requests, engine.runner
        if self.sequential:
            while not engine.has_unfinished() and self.next < len(reqs):
                self.next += 1
                self._add(engine, reqs[self.next - 1], runner.clock)
            return
        scale = self.time_scale
        while True:
            if not engine.has_unfinished() and self.next < len(reqs):
                runner.clock = max(runner.clock, reqs[self.next].arrival_s * scale)  # idle: on to the next arrival
            while self.next < len(reqs) and reqs[self.next].arrival_s * scale <= runner.clock:
                r = reqs[self.next]
                self.next += 1
                self._add(engine, r, r.arrival_s * scale)
            if engine.has_unfinished() or self.next >= len(reqs):
                break  # idle after adding only skipped requests: on to the next arrival, not an empty step
        res = self.result
        res.peak_waiting = max(res.peak_waiting, len(engine.scheduler.waiting))

    def after_step(self, engine, out) -> None:
        clock, live, res = engine.runner.clock, self.live, self.result
        res.peak_running = max(res.peak_running, len(engine.scheduler.running))
        for rid in out.new_tokens:
            entry = live.get(rid)
            if entry is not None and entry[0].ttft_s is None:
                entry[0].ttft_s = clock - entry[0].arrival_s
        for o in out.outputs:
            if o.finished and o.request_id in live:
                rec, req = live.pop(o.request_id)
                rec.cached_tokens = max(req.num_cached_tokens, 0)
                rec.preemptions = req.num_preemptions
                rec.finish_s = clock
                rec.error = o.error
                res.records.append(rec)

    # -- adding one request -------------------------------------------------------------------
    def _add(self, engine, r: TraceRequest, arrival: float) -> bool:  # noqa: D401
        """Add ``r``, or count it as skipped; returns whether it was added."""
        why = skip_reason(engine, r, self.sequential)
        if why is not None:
            count_skip(self.result, why, r)
            return False
        self.admit(engine, self.request_for(engine, r), r, arrival)
        return True

    def request_for(self, engine, r: TraceRequest) -> Request:
        """``r`` as the engine's ``Request``, not added yet (``admit`` adds it and gives it its index)."""
        if r.hash_ids is not None:
            assert self.tokens is not None  # a Mooncake trace's feeder has its token maker
            ids = self.tokens.prompt(r.hash_ids, r.prompt_len)
        else:
            assert r.token_ids is not None  # a kvscope trace's request: its own token ids
            ids = r.token_ids
            top = max(ids)
            if top >= engine.vocab_size:
                raise WorkloadError(
                    f"{self.workload.path}:{r.line}: token id {top} is outside the simulated "
                    f"model's vocabulary (0..{engine.vocab_size - 1})"
                )
        max_tokens = 1 if self.sequential else r.max_tokens
        params = self._params or SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
        )
        return Request(f"L{r.line}", -1, ids, params, eos_token_ids=engine.eos_token_ids)

    def admit(self, engine, req: Request, r: TraceRequest, arrival: float) -> None:
        """Queue ``req`` (made by ``request_for``) in ``engine`` and record it from ``arrival`` on.

        What LLMEngine.add_request does, without its per-token type and range checks (40 ns a token: 6 s of
        the conversation trace's 145 M tokens). Everything they check is checked by ``skip_reason`` and
        ``request_for`` or holds by construction: a list of ints in the vocabulary, shorter than the context,
        fitting the pool, n = 1."""
        groups = engine.request_groups
        if groups.is_live(req.request_id):
            raise WorkloadError(f"{self.workload.path}:{r.line}: request id {req.request_id} is already in use")
        req.index = groups.next_index()
        groups.add(req)
        self.live[req.request_id] = (RequestRecord(r.line, arrival, r.prompt_len), req)

    # -- the end -----------------------------------------------------------------------------
    def finish(self, wall_s: float = 0.0) -> WorkloadResult:
        """Totals from the records and the engine's counters (call once the engine has no work left)."""
        e, res = self.engine, self.result
        res.records.sort(key=lambda rec: rec.line)
        ok = [rec for rec in res.records if rec.error is None]
        res.failed = len(res.records) - len(ok)
        res.requests = len(res.records)
        res.prompt_tokens = sum(rec.prompt_tokens for rec in res.records)
        res.cached_tokens = sum(rec.cached_tokens for rec in res.records)
        res.generated_tokens = 0 if self.sequential else e.num_generated_tokens
        res.evictions = e.pool.num_evictions
        res.preemptions = e.scheduler.num_preemptions
        res.steps = e.step_count
        res.virtual_s = e.runner.clock
        res.busy_s = e.runner.busy_s
        res.wall_s = wall_s
        res.peak_rss_mb = peak_rss_mb()
        return res


def build_engine(workload: Workload, config: EngineConfig | None = None, sim: SimConfig | None = None):
    """An engine over a ``SimRunner`` for this workload, and the feeder that plays it: ``(engine, feeder)``.

    Raises ``WorkloadError`` when the trace cannot be played at this block size, ``ValueError`` for a
    bad option. A window plays it live by calling ``feeder.before_step(engine)``, ``engine.step()``,
    ``feeder.after_step(engine, out)`` while ``feeder.has_work() or engine.has_unfinished()``.
    """
    from ..llm_engine import LLMEngine  # torch: loaded only when a run starts

    config = config or EngineConfig()
    sim = sim or SimConfig()
    config.validate()
    sim.validate()
    cost = sim.cost_model(config)
    ctx = cost.model.context_length
    max_model_len = min(ctx, config.max_model_len or ctx)
    if sim.sequential:  # a whole prompt in one step: faster, and the same hits
        config = dataclasses.replace(config, max_num_batched_tokens=max(config.max_num_batched_tokens, max_model_len))
    num_blocks, why = pool_blocks(config, cost, sim.kv_tokens)
    tokens = None
    if workload.format == "mooncake":
        tokens = HashIdTokens(cost.model.vocab_size, workload.hash_block_size)
        tokens.check_block_size(config.block_size, workload.max_hash_id, workload.path)
    else:  # token ids the simulated model cannot have: said before the run starts
        for r in workload.requests:
            top = max(r.token_ids or [0])
            if top >= cost.model.vocab_size:
                raise WorkloadError(
                    f"{workload.path}:{r.line}: token id {top} is outside the simulated "
                    f"model's vocabulary (0..{cost.model.vocab_size - 1})"
                )
    runner = SimRunner(config, cost, num_blocks)
    engine = LLMEngine.from_runner(runner, config, name=f"{cost.model.name} (simulated, {cost.gpu.name})")
    feeder = WorkloadFeeder(
        engine, workload, sim.sequential, tokens, why, {**cost.to_json(), "time_scale": sim.time_scale}, sim.time_scale
    )
    return engine, feeder


def run_workload(
    workload: Workload,
    config: EngineConfig | None = None,
    sim: SimConfig | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> WorkloadResult:
    """Play the whole workload headless; ``progress(requests added, requests)`` hears of it now and then."""
    t0 = time.perf_counter()
    engine, feeder = build_engine(workload, config, sim)
    total = len(workload.requests)
    step = engine.step
    while feeder.has_work() or engine.has_unfinished():
        feeder.before_step(engine)
        if not engine.has_unfinished():
            break  # the last requests were all skipped
        out = step()
        feeder.after_step(engine, out)
        if progress is not None and engine.step_count % 256 == 0:
            progress(feeder.next, total)
    return feeder.finish(time.perf_counter() - t0)
