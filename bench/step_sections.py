"""Where one engine step's time goes: exclusive CPU time per section, step by step, on a served engine.

``StepSections.install(engine, source, bridge)`` wraps the functions a step runs through (the scheduler,
the model's matmuls, attention, the KV store, sampling, the output processor, the inspector's record,
the server's bridge) in timers; each section's time excludes the sections it calls, so the sections of a
step add up to the step. Time is the engine thread's CPU time (``time.thread_time``), not the wall clock:
on a shared machine a wall-clock split would charge other people's work to whichever section was
running. The HTTP server's own thread (uvicorn: the handlers, the SSE chunks) runs beside the engine's;
its CPU time is sampled at each step, so a step is charged what the server did while it ran.

Each step's row keeps its shape (how many requests decoded, how many prompt tokens), so a report can
take the pure-decode steps at a given batch size (``summarise``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

SECTIONS = (
    "matmuls",
    "attention",
    "kv store",
    "norms, rope, activations",
    "step inputs",
    "sampling",
    "scheduler and block bookkeeping",
    "outputs and detokenizing",
    "inspector",
    "server bridge",
    "loop",
)


class StepSections:
    def __init__(self) -> None:
        self.clock = time.thread_time
        self.stack: list[float] = []  # the time each open section's callees took
        self.current: dict[str, float] = {}
        self.rows: list[dict] = []
        self.http_thread: int | None = None
        self._http_clock: int | None = None

    def wrap(self, fn: Callable, name: str) -> Callable:
        clock, stack = self.clock, self.stack

        def timed(*args, **kwargs):
            t0 = clock()
            stack.append(0.0)
            try:
                return fn(*args, **kwargs)
            finally:
                dt = clock() - t0
                inner = stack.pop()
                self.current[name] = self.current.get(name, 0.0) + dt - inner
                if stack:
                    stack[-1] += dt

        return timed

    def patch(self, obj, attr: str, name: str) -> None:
        setattr(obj, attr, self.wrap(getattr(obj, attr), name))

    def install(self, engine, source, bridge) -> None:
        """Time ``engine``'s step inside ``source.step`` (what the host loop calls), the bridge among its hooks."""
        runner, model = engine.runner, engine.runner.model
        for layer in model.layers:
            for proj in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                m = getattr(layer, proj)
                m.forward = self.wrap(m.forward, "matmuls")
        self.patch(model, "compute_logits", "matmuls")
        self.patch(model, "forward", "norms, rope, activations")  # what the model does outside the above
        self.patch(runner, "attention", "attention")
        self.patch(runner, "store", "kv store")
        self.patch(runner, "sample", "sampling")
        self.patch(runner, "execute", "step inputs")  # execute outside the model and the sampler
        self.patch(engine.scheduler, "schedule", "scheduler and block bookkeeping")
        self.patch(engine, "step", "scheduler and block bookkeeping")  # the step outside execute and the rest
        self.patch(engine.output, "append_token", "outputs and detokenizing")
        self.patch(engine, "_outputs", "outputs and detokenizing")
        self.patch(source, "_record", "inspector")
        if runner.write_observer is not None:  # the write audit, before each forward
            runner.write_observer = self.wrap(runner.write_observer, "inspector")
        self.patch(bridge, "before_step", "server bridge")
        self.patch(bridge, "after_step", "server bridge")
        inner_step = source.step

        def step():
            self.current = {}
            http0 = self._http_cpu()
            wall0, sched0 = time.perf_counter(), _schedstat()
            rec = self.wrap(inner_step, "loop")()
            wall1, sched1 = time.perf_counter(), _schedstat()
            out = rec.step_output
            row = dict(self.current)
            row["_step"] = rec.step
            row["_running"] = len(engine.scheduler.running)
            row["_tokens"] = out.num_scheduled_tokens if out is not None else 0
            row["_sampled"] = len(out.new_tokens) if out is not None else 0
            http1 = self._http_cpu()
            row["server streaming (HTTP thread)"] = (http1 - http0) if http0 is not None and http1 else 0.0
            # the step's wall time, and of it: on a CPU, waiting for one (the run queue), neither (the GIL, I/O)
            row["_wall"] = wall1 - wall0
            row["_on_cpu"] = (sched1[0] - sched0[0]) / 1e9
            row["_runqueue"] = (sched1[1] - sched0[1]) / 1e9
            self.rows.append(row)
            return rec

        source.step = step

    def charged(self, fn: Callable, name: str) -> Callable:
        """``fn`` timed and its time added to the last step's row (work the host does after a step: the wire)."""

        def timed(*args, **kwargs):
            t0 = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.rows:
                    row = self.rows[-1]
                    row[name] = row.get(name, 0.0) + self.clock() - t0

        return timed

    def _http_cpu(self) -> float | None:
        """The HTTP server thread's CPU seconds so far."""
        if self._http_clock is None:
            t = next((t for t in threading.enumerate() if t.name == "kvscope-http"), None)
            if t is None or t.ident is None:
                return None
            self._http_clock = time.pthread_getcpuclockid(t.ident)
        return time.clock_gettime(self._http_clock)


def _schedstat() -> tuple[int, int]:
    """(ns on a CPU, ns runnable but waiting for one) of the calling thread, as the kernel counts them."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            on_cpu, waiting, _ = f.read().split()
        return int(on_cpu), int(waiting)
    except (OSError, ValueError):
        return 0, 0


def summarise(rows: list[dict], running: int) -> dict | None:
    """Mean ms per section over the pure-decode steps with ``running`` requests (each sampled one token)."""
    steps = [r for r in rows if r["_running"] == running and r["_tokens"] == running and r["_sampled"] == running]
    if not steps:
        return None
    keys = [k for k in (*SECTIONS, "server streaming (HTTP thread)") if any(k in r for r in steps)]
    mean = {k: 1e3 * sum(r.get(k, 0.0) for r in steps) / len(steps) for k in keys}
    engine_ms = sum(v for k, v in mean.items() if k != "server streaming (HTTP thread)")
    wall = {k[1:]: 1e3 * sum(r.get(k, 0.0) for r in steps) / len(steps) for k in ("_wall", "_on_cpu", "_runqueue")}
    return {
        "running": running,
        "steps": len(steps),
        "engine_thread_ms": engine_ms,
        "sections_ms": mean,
        "wall_ms": wall["wall"],
        "on_cpu_ms": wall["on_cpu"],
        "runqueue_ms": wall["runqueue"],
    }
