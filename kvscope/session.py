"""A run of the engine (or of a recorded trace), with no Qt: the worker and ``--headless`` share it."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from engine import LLMEngine
from engine.inspect.audit import AuditReport
from engine.inspect.events import Event
from engine.inspect.snapshot import KVSnapshot
from engine.inspect.trace import TraceWriter, read_header, replay_trace
from engine.outputs import StepOutput

from .scenario import ScenarioRunner


@dataclass(frozen=True, slots=True)
class StepRecord:
    step: int
    snapshot: KVSnapshot
    events: list[Event]
    step_output: StepOutput | None
    seconds: float
    audit: AuditReport | None = None

    @property
    def leaked(self) -> list[int]:
        return self.audit.bad_blocks if self.audit is not None else []


@dataclass
class Summary:
    """What a run did; the same from a live run and from its trace."""
    requests: dict[str, dict] = field(default_factory=dict)
    peak_usage: float = 0.0
    peak_blocks_used: int = 0
    last: StepRecord | None = None

    def add(self, rec: StepRecord) -> None:
        self.last = rec
        c = rec.snapshot.counters
        self.peak_usage = max(self.peak_usage, float(c["kv_cache_usage_perc"]))
        self.peak_blocks_used = max(self.peak_blocks_used, int(c["num_blocks"] - c["num_free_blocks"]))
        for r in rec.snapshot.requests:
            self.requests[r.request_id] = {
                "request_id": r.request_id, "status": r.status.lower(), "prompt_tokens": r.num_prompt_tokens,
                "output_tokens": r.num_output_tokens, "cached_tokens": r.num_cached_tokens, "text": r.text}

    def as_dict(self) -> dict:
        snap = self.last.snapshot
        c = snap.counters
        return {
            "model": snap.model_name, "steps": snap.step, "num_blocks": snap.num_blocks,
            "block_size": snap.block_size, "requests": list(self.requests.values()),
            "kv_cache_usage_perc": c["kv_cache_usage_perc"], "kv_cache_usage_perc_peak": self.peak_usage,
            "blocks_used_peak": self.peak_blocks_used,
            "prefix_cache_queries": c["prefix_cache_queries"], "prefix_cache_hits": c["prefix_cache_hits"],
            "num_preemptions": c["num_preemptions"], "cow_copies": c["cow_copies"], "evictions": c["evictions"],
            "swap_outs": c["swap_outs"], "swap_ins": c["swap_ins"], "leaked_blocks": len(self.last.leaked),
            "generation_tokens": c["generation_tokens"],
        }


class StepHook(Protocol):
    """Something that drives the engine between steps on the engine's own thread (a scenario, a server).

    ``before_step`` may add and abort requests; ``after_step`` reads the step's outputs;
    ``has_work`` keeps a run going while the hook still has requests to bring.
    """

    def before_step(self, engine: LLMEngine) -> object: ...

    def after_step(self, engine: LLMEngine, out: StepOutput) -> None: ...

    def has_work(self, engine: LLMEngine) -> bool: ...


class Session:
    """Drives one engine: scenario injections, optional audit after every step, optional trace."""

    read_only = False

    def __init__(self, engine: LLMEngine, scenario: ScenarioRunner | None = None, trace_path: str | None = None,
                 audit: bool = False, hooks: list[StepHook] | None = None) -> None:
        self.engine = engine
        self.scenario = scenario
        self.hooks: list[StepHook] = ([scenario] if scenario else []) + list(hooks or [])
        self.audit_enabled = audit or bool(engine.config.fault)
        # Called with every record, on the engine's thread, after the trace (e.g. the KV-event
        # publisher). An observer with a ``close()`` is closed with the session.
        self.observers: list[Callable[[StepRecord], None]] = []
        self.trace = None
        if trace_path:
            c = engine.config
            self.trace = TraceWriter(trace_path, {
                "model": engine.model_name, "num_blocks": engine.pool.num_blocks, "block_size": c.block_size,
                "num_cpu_blocks": engine.kv.cpu_pool.num_blocks, "block_bytes": engine.runner.block_bytes,
                "config": {k: getattr(c, k) for k in c.__slots__},
                "scenario": scenario.scenario.name if scenario else None})

    @property
    def step_count(self) -> int:
        return self.engine.step_count

    def describe(self) -> dict:
        e = self.engine
        return {"model_name": e.model_name, "device": str(e.device), "dtype": str(e.runner.dtype).split(".")[-1],
                "num_blocks": e.pool.num_blocks, "block_size": e.config.block_size,
                "block_bytes": e.runner.block_bytes, "max_model_len": e.max_model_len,
                "load_seconds": e.load_seconds, "num_cpu_blocks": e.kv.cpu_pool.num_blocks,
                "decode": e.tokenizer.decode if e.tokenizer is not None else None,
                "scenario": self.scenario.scenario.title if self.scenario else None,
                "kv_cache_dtype": e.config.kv_cache_dtype}

    def has_work(self) -> bool:
        return self.engine.has_unfinished() or any(h.has_work(self.engine) for h in self.hooks)

    def step(self) -> StepRecord:
        t0 = time.perf_counter()
        for h in self.hooks:
            h.before_step(self.engine)
        out = self.engine.step()
        for h in self.hooks:
            h.after_step(self.engine, out)
        seconds = time.perf_counter() - t0
        return self._record(out, seconds)

    def _record(self, out: StepOutput | None, seconds: float = 0.0) -> StepRecord:
        e = self.engine
        audit = e.audit(emit_events=True) if self.audit_enabled else None
        events = (list(out.events) if out else []) + e.pool.drain_events()
        snap = e.snapshot()
        if self.trace is not None:
            self.trace.record(snap, events, audit.bad_blocks if audit else None)
        rec = StepRecord(e.step_count, snap, events, out, seconds, audit)
        for observe in self.observers:
            observe(rec)
        return rec

    def current(self) -> StepRecord:
        """A record of the state now (after a command between steps), with its events."""
        return self._record(None)

    # -- commands between steps --------------------------------------------------------
    def inject(self, prompt, params, request_id: str | None = None) -> str:
        return self.engine.add_request(prompt, params, request_id=request_id)

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def fork(self, request_id: str) -> str:
        return self.engine.fork(request_id)

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
            self.trace = None
        for observe in self.observers:
            getattr(observe, "close", lambda: None)()
        self.observers = []


class ReplaySession:
    """Plays a trace back step by step: no model, no GPU; commands are refused."""

    read_only = True

    def __init__(self, path: str) -> None:
        self.header = read_header(path)
        self.path = path
        self._records = replay_trace(path)
        self._next = next(self._records, None)
        self.step_count = 0

    def describe(self) -> dict:
        h = self.header
        return {"model_name": f"replay of {h.get('model', '?')}", "device": "trace", "dtype": "-",
                "num_blocks": h["num_blocks"], "block_size": h["block_size"], "block_bytes": h.get("block_bytes", 0),
                "max_model_len": 0, "load_seconds": 0.0, "num_cpu_blocks": h.get("num_cpu_blocks", 0),
                "decode": None, "scenario": h.get("scenario"),
                "kv_cache_dtype": h.get("config", {}).get("kv_cache_dtype", "auto")}

    def has_work(self) -> bool:
        return self._next is not None

    def step(self) -> StepRecord:
        if self._next is None:
            raise ValueError("the trace has ended")
        rec = self._next
        self._next = next(self._records, None)
        # Records of commands between steps share the step number: fold them into one.
        events = list(rec.events)
        while self._next is not None and self._next.step == rec.step:
            rec = self._next
            events += rec.events
            self._next = next(self._records, None)
        self.step_count = rec.step
        audit = _LeakList(rec.leaked)
        return StepRecord(rec.step, rec.snapshot, events, None, 0.0, audit if rec.leaked else None)

    def current(self) -> StepRecord:
        raise ValueError("a replay is read-only")

    def _refuse(self, *_a, **_k):
        raise ValueError("a replay is read-only: it shows what was recorded")

    inject = abort = fork = reset_prefix_cache = _refuse

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class _LeakList:
    """Stands in for an AuditReport in replays: the recorded bad blocks."""
    bad_blocks: list[int]

    @property
    def ok(self) -> bool:
        return not self.bad_blocks

    @property
    def problems(self) -> list:
        return []
