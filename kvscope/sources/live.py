"""``LiveSource``: one engine in this process, driven step by step (the window's engine side and ``--headless``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from engine.inspect.trace import TraceWriter
from engine.outputs import StepOutput
from kvscope.scenario import ScenarioRunner
from kvscope.sources.base import LIVE_CAPABILITIES, SourceInfo, StepRecord

if TYPE_CHECKING:
    from engine import LLMEngine


class StepHook(Protocol):
    """Something that drives the engine between steps on the engine's own thread (a scenario, a server).

    ``before_step`` may add and abort requests; ``after_step`` reads the step's outputs;
    ``has_work`` keeps a run going while the hook still has requests to bring.
    """

    def before_step(self, engine: LLMEngine) -> object: ...

    def after_step(self, engine: LLMEngine, out: StepOutput) -> None: ...

    def has_work(self, engine: LLMEngine) -> bool: ...


class LiveSource:
    """Drives one engine: step hooks (a scenario, a server), optional audit after every step, optional trace."""

    def __init__(
        self,
        engine: LLMEngine,
        scenario: ScenarioRunner | None = None,
        trace_path: str | None = None,
        audit: bool = False,
        hooks: list[StepHook] | None = None,
    ) -> None:
        self.engine = engine
        self.scenario = scenario
        self.hooks: list[StepHook] = ([scenario] if scenario else []) + list(hooks or [])
        self.audit_enabled = audit or bool(engine.config.fault)
        if self.audit_enabled:
            engine.enable_write_audit()
        # Called with every record, on the engine's thread, after the trace (e.g. the KV-event
        # publisher). An observer with a ``close()`` is closed with the source.
        self.observers: list[Callable[[StepRecord], None]] = []
        # An engine process sets this: its records carry the raw state (engine.inspect.snapshot.LiveState,
        # or a copied PoolState when a trace is written), and the window's process derives the views.
        self.raw_snapshots = False
        self.trace = None
        if trace_path:
            c = engine.config
            self.trace = TraceWriter(
                trace_path,
                {
                    "model": engine.model_name,
                    "num_blocks": engine.pool.num_blocks,
                    "block_size": c.block_size,
                    "num_cpu_blocks": engine.kv.cpu_pool.num_blocks,
                    "block_bytes": engine.runner.block_bytes,
                    "max_model_len": engine.max_model_len,
                    "config": {k: getattr(c, k) for k in c.__slots__},
                    "scenario": scenario.scenario.name if scenario else None,
                },
            )
        self.info = self._info()

    def _info(self) -> SourceInfo:
        e = self.engine
        sc = self.scenario.scenario if self.scenario else None
        return SourceInfo(
            model_name=e.model_name,
            device=str(e.device),
            dtype=str(e.runner.dtype).split(".")[-1],
            num_blocks=e.pool.num_blocks,
            block_size=e.config.block_size,
            block_bytes=e.runner.block_bytes,
            max_model_len=e.max_model_len,
            load_seconds=e.load_seconds,
            num_cpu_blocks=e.kv.cpu_pool.num_blocks,
            scenario=sc.title if sc else None,
            scenario_name=sc.name if sc else None,
            kv_cache_dtype=e.config.kv_cache_dtype,
            capabilities=LIVE_CAPABILITIES,
            has_tokenizer=e.tokenizer is not None,
            watch=getattr(sc, "watch", "") or (sc.description if sc else ""),
            notes=tuple(getattr(sc, "notes", ()) or ()),
            view=getattr(sc, "view", "") or "",
            plot=getattr(sc, "plot", "") or "",
            kv_layout=e.config.kv_layout,
            prefix_caching=e.pool.enable_caching,
        )

    @property
    def step_count(self) -> int:
        return self.engine.step_count

    def has_work(self) -> bool:
        return self.engine.has_unfinished() or any(h.has_work(self.engine) for h in self.hooks)

    def clock(self) -> float:
        """What a step's ``seconds`` are measured with: the wall clock (a simulated engine's source, its own)."""
        return time.perf_counter()

    def step(self) -> StepRecord:
        t0 = self.clock()
        for h in self.hooks:
            h.before_step(self.engine)
        out = self.engine.step()
        for h in self.hooks:
            h.after_step(self.engine, out)
        return self._record(out, self.clock() - t0)

    def _record(self, out: StepOutput | None, seconds: float = 0.0) -> StepRecord:
        e = self.engine
        audit = e.audit(emit_events=True) if self.audit_enabled else None
        events = (list(out.events) if out else []) + e.ledger.drain_events()
        # raw: with no trace to write, the state is not copied (the wire reads it before the next step)
        if not self.raw_snapshots:
            snap = e.snapshot()
        else:
            snap = e.live_state() if self.trace is None else e.pool_state()
        if self.trace is not None:
            self.trace.record(snap, events, audit.bad_blocks if audit else None, seconds)
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

    def set_audit(self, on: bool) -> None:
        self.audit_enabled = on or bool(self.engine.config.fault)
        if self.audit_enabled:
            self.engine.enable_write_audit()

    def compare_caching(self, prompts: list, max_tokens: int = 16):
        """The same prompts through two fresh engines on these weights, caching on and off (the engine's
        other settings, a planted fault included, kept): ``engine.inspect.compare.Comparison``."""
        import dataclasses

        from engine import LLMEngine
        from engine.inspect.compare import compare_caching

        engine = self.engine
        if engine.weights is None:
            raise ValueError("comparing caching on and off needs an engine that loaded its model by name")

        def make(caching: bool) -> LLMEngine:
            return LLMEngine(dataclasses.replace(engine.config, enable_prefix_caching=caching), weights=engine.weights)

        tok = engine.tokenizer
        decode = (lambda ids: tok.decode(ids, skip_special_tokens=False)) if tok is not None else None
        return compare_caching(make, prompts, max_tokens, decode)

    def decode(self, token_ids: list[int]) -> str | None:
        tok = self.engine.tokenizer
        return tok.decode(list(token_ids), skip_special_tokens=False) if tok is not None else None

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
            self.trace = None
        for observe in self.observers:
            getattr(observe, "close", lambda: None)()
        self.observers = []
