"""``WorkloadSource``: a request trace played live in the window, without weights (``kvscope --workload FILE``).

The engine is ``engine.workload``'s: the real scheduler, block pool, prefix cache and preemption over a
``SimRunner`` whose cost model stands in for the forward pass, at the simulated card's real pool size.
The ``WorkloadFeeder`` is one more step hook: before each step it adds the requests whose arrival the
virtual clock has reached, so the request table fills as the trace's traffic arrives.
"""

from __future__ import annotations

import dataclasses

from kvscope.sources.base import SourceInfo
from kvscope.sources.live import LiveSource


@dataclasses.dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """Which trace, on which simulated machine (picklable: the engine process builds the source)."""

    path: str
    sim: object  # engine.workload.sim_config.SimConfig
    limit: int | None = None


def build_workload_source(spec: WorkloadSpec, config, audit: bool = False, hooks: list | None = None) -> LiveSource:
    """Raises ``ValueError`` (a ``WorkloadError`` is one) with one line for a bad trace or option."""
    from engine.workload.driver import build_engine
    from engine.workload.reader import read_workload

    tokenizer = None
    if config.tokenizer:
        from engine.runner.models.loader import load_tokenizer

        tokenizer = load_tokenizer(config.tokenizer)
    workload = read_workload(spec.path, tokenizer=tokenizer, limit=spec.limit)
    engine, feeder = build_engine(workload, config, spec.sim)
    return WorkloadSource(engine, feeder, audit=audit, hooks=hooks)


class WorkloadSource(LiveSource):
    """A live source whose steps take the simulated card's time: its ``clock`` is the virtual one, so a
    record's ``seconds`` is the clock's advance over the step (an idle wait for the next arrival included)
    and the window's time to first token and tokens per second are the simulated machine's, as the headless
    summary's are."""

    def __init__(self, engine, feeder, audit: bool = False, hooks: list | None = None) -> None:
        self.feeder = feeder
        super().__init__(engine, None, None, audit=audit, hooks=[feeder, *(hooks or [])])

    def clock(self) -> float:
        """The simulated card's seconds (LiveSource measures a step with this clock)."""
        return self.engine.runner.clock

    def _info(self) -> SourceInfo:
        info = super()._info()
        f = self.feeder
        w, r = f.workload, f.result
        sim = r.sim
        title = f"workload {w.name}: {len(w.requests):,} requests"
        watch = (
            f"{w.name} ({w.format} trace, {len(w.requests):,} requests) played at its arrival times"
            + (f" x {sim.get('time_scale'):g}" if sim.get("time_scale", 1.0) != 1.0 else "")
            + f" on {sim.get('model')} over {sim.get('tp', 1)} x simulated {sim.get('gpu')}: no weights, a cost "
            "model's step time stands in for the forward pass, and times (TTFT, tokens/s) are the simulated "
            f"card's. Pool: {r.num_gpu_blocks:,} blocks of {r.block_size} tokens ({r.pool_why}), eviction "
            f"{r.eviction_policy}. Watch the hit rate and "
            "evictions in Plots, and the request table as requests arrive."
        )
        return dataclasses.replace(
            info,
            device=f"simulated {sim.get('gpu')}",
            scenario=title,
            scenario_name=None,
            watch=watch,
            view="plots",
            extra={**info.extra, "workload": w.name},
        )
