"""``FleetConfig``: what a fleet run adds to a workload run (how many instances, which router, the pools), and
the rules for combining it with the other workload options: one place, for ``python -m engine.workload`` and
for ``kvscope --workload`` with a window or without.

No torch here, so that a command line can make its flags (``kvscope --help``) cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..config import EngineConfig, check_value, option
from .routers import ROUTERS, routers_of
from .sim_config import SimConfig

WINDOW_MAX_INSTANCES = 16  # pools the window draws side by side


@dataclass(slots=True)
class FleetConfig:
    """A fleet of simulated instances behind a router (docs/routing.md). ``instances`` None: one engine."""

    instances: int | None = option(
        None,
        "simulate a fleet of N instances of the simulated card, each with its own "
        "pool, scheduler and cost model, on one virtual clock behind --router",
        ge=1,
        group="workload",
    )
    router: str | None = option(
        None,
        f"with --instances or --sweep-instances: {', '.join(ROUTERS)}, or a "
        "comma-separated list to compare them (default round-robin)",
        group="workload",
    )
    fleet_kv_tokens: float | None = option(
        None,
        "with --instances or --sweep-instances: the whole fleet's KV "
        "capacity in tokens, split evenly over its instances (instead of "
        "--kv-tokens, each instance's)",
        ge=1,
        group="workload",
    )

    def validate(self) -> None:
        for f in fields(self):
            check_value(f, getattr(self, f.name), FleetConfig)
        if self.router is not None:
            routers_of(self.router)

    @property
    def routers(self) -> list[str]:
        return routers_of(self.router) if self.router else ["round-robin"]


def parse_instance_counts(text: str) -> list[int]:
    """``--sweep-instances``' value: instance counts separated by commas."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or any(n < 1 for n in out):
        raise ValueError(f"--sweep-instances takes instance counts >= 1 separated by commas (1,2,4,8,16), got {text!r}")
    return out


def check_fleet(
    fleet: FleetConfig,
    config: EngineConfig,
    sim: SimConfig,
    sweep_kv_tokens: bool = False,
    sweep_instances: list[int] | None = None,
    window: bool = False,
) -> None:
    """Refuse, with one line (``ValueError``), a fleet option that cannot go with the others."""
    fleet.validate()
    wants_fleet = fleet.instances is not None or sweep_instances is not None
    if not wants_fleet:
        for name, value in (("--router", fleet.router), ("--fleet-kv-tokens", fleet.fleet_kv_tokens)):
            if value is not None:
                raise ValueError(f"{name} is for a fleet: give --instances N (or --sweep-instances)")
        return
    if fleet.instances is not None and sweep_instances is not None:
        raise ValueError("--sweep-instances sets the number of instances: leave out --instances")
    if sweep_kv_tokens:
        raise ValueError("--sweep-kv-tokens sweeps one engine's pool: not with --instances or --sweep-instances")
    if fleet.fleet_kv_tokens is not None:
        if sim.kv_tokens is not None:
            raise ValueError("--fleet-kv-tokens sizes the fleet's pools: leave out --kv-tokens")
        if config.num_gpu_blocks is not None:
            raise ValueError("--fleet-kv-tokens sizes the fleet's pools: leave out --num-gpu-blocks")
    if window:
        if sweep_instances is not None:
            raise ValueError("--sweep-instances runs many fleets one after another: use it with --headless")
        if len(fleet.routers) > 1:
            raise ValueError(
                "the window plays one fleet: give --router one policy (a list compares them with --headless)"
            )
        if fleet.instances is not None and fleet.instances > WINDOW_MAX_INSTANCES:
            raise ValueError(
                f"the window draws at most {WINDOW_MAX_INSTANCES} pools side by side: use --headless "
                f"for --instances {fleet.instances}"
            )
