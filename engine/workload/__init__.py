"""Real workloads: play request traces (Mooncake's, or your own) through the engine without weights.

The scheduler, block pool, prefix cache, preemption and events run for real; a cost model's step time
on a virtual clock stands in for the forward pass. See docs/workloads.md.

- ``read_workload(path, tokenizer=None)`` -> ``Workload`` (``WorkloadError``: one line naming file and line)
- ``run_workload(workload, EngineConfig, SimConfig)`` -> ``WorkloadResult`` (``.summary()``: the JSON)
- ``build_engine(workload, EngineConfig, SimConfig)`` -> ``(LLMEngine, WorkloadFeeder)``, to play it step by step
- ``sweep(workload, kv_tokens, policies, ...)`` -> rows; ``plot_sweep(...)`` draws hit rate against capacity
- ``prefix_sharing(workload, block_size)`` -> the infinite-pool reference, computed apart from the engine
- ``run_fleet(workload, EngineConfig, SimConfig, instances, router)`` -> ``FleetResult``: N engines behind a router
  on one virtual clock (fleet.py, routers.py; docs/routing.md); ``build_fleet`` to play it event by event
"""

from .costmodel import GPUS, MODELS, CostModel
from .reader import TraceRequest, Workload, WorkloadError, read_workload
from .sim_config import SimConfig
from .tokens import HashIdTokens

_DRIVER = ("RequestRecord", "WorkloadFeeder", "WorkloadResult", "build_engine", "run_workload")
_FLEET = ("FleetResult", "build_fleet", "run_fleet")


def __getattr__(name: str):
    """The driver and the fleet (they build requests: torch) only when asked for, so that options and the reader
    stay cheap."""
    if name in _DRIVER:
        from . import driver

        return getattr(driver, name)
    if name in _FLEET:
        from . import fleet

        return getattr(fleet, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CostModel",
    "FleetResult",
    "GPUS",
    "MODELS",
    "HashIdTokens",
    "RequestRecord",
    "SimConfig",
    "TraceRequest",
    "Workload",
    "WorkloadError",
    "WorkloadFeeder",
    "WorkloadResult",
    "build_engine",
    "build_fleet",
    "read_workload",
    "run_fleet",
    "run_workload",
]
