"""``SimConfig``: what a workload run adds to ``EngineConfig`` (the simulated machine and the mode).

Its own module, without torch, so that a command line can make its flags (``kvscope --help``) cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..config import EngineConfig, check_value, option
from .costmodel import DEFAULT_GPU, DEFAULT_MODEL, GPUS, MODELS, CostModel


@dataclass(slots=True)
class SimConfig:
    """What a workload run adds to ``EngineConfig``: the simulated machine and the mode.

    The fields carry ``EngineConfig``'s option metadata, so a command line can make its flags the same way.
    """

    sim_model: str = option(
        DEFAULT_MODEL,
        "the model whose shape the cost model uses (no weights are loaded)",
        choices=tuple(MODELS),
        group="workload",
    )
    sim_gpu: str = option(
        DEFAULT_GPU, "the card whose bandwidth and compute the cost model uses", choices=tuple(GPUS), group="workload"
    )
    sim_tp: int | None = option(
        None,
        "cards the model is split over (default: the fewest that leave as much memory for KV as the weights take)",
        ge=1,
        group="workload",
    )
    kv_tokens: float | None = option(
        None,
        "the KV pool's capacity in tokens (instead of --num-gpu-blocks; default: "
        "what fits beside the weights on the simulated cards)",
        ge=1,
        group="workload",
    )
    sequential: bool = option(
        False,
        "one request at a time, each finished before the next, prompts only (Mooncake's Figure 9 assumption)",
        group="workload",
    )
    time_scale: float = option(
        1.0,
        "multiply arrival times by this (2: the trace at half its rate, for a smaller "
        "simulated machine than the one that served it)",
        gt=0.0,
        group="workload",
    )

    def validate(self) -> None:
        """Check every field against its metadata; raises ``ValueError`` with one line."""
        for f in fields(self):
            check_value(f, getattr(self, f.name), SimConfig)

    def cost_model(self, config: EngineConfig) -> CostModel:
        return CostModel.named(self.sim_model, self.sim_gpu, self.sim_tp, config.kv_cache_dtype)
