"""A fleet's numbers against its size: one run per (router, N), a table, a text summary and a plot.

The capacity is held one of two ways: each instance's pool as given (``--kv-tokens``, or the simulated
card's), so a bigger fleet has more memory in all; or the whole fleet's (``--fleet-kv-tokens``), split
evenly, so a bigger fleet cuts the same memory into smaller pools.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from ..config import EngineConfig
from .fleet import FleetResult, run_fleet
from .reader import Workload
from .sim_config import SimConfig
from .sweep import format_table

FLEET_COLUMNS = (
    ("trace", "trace", ""),
    ("router", "router", ""),
    ("instances", "N", "d"),
    ("kv_tokens", "KV tokens (fleet)", ".3g"),
    ("requests", "requests", "d"),
    ("hit_rate", "hit rate", ".1%"),
    ("ttft_p50_s", "TTFT p50 s", ".3g"),
    ("ttft_p99_s", "TTFT p99 s", ".3g"),
    ("load_imbalance", "imbalance", ".2f"),
    ("utilization", "busy", ".0%"),
    ("preemptions", "preempt", "d"),
    ("wall_s", "wall s", ".1f"),
)

# one colour and marker per policy, in every fleet figure
ROUTER_STYLE = {
    "round-robin": ("#7f7f7f", "o"),
    "least-loaded": ("#9467bd", "v"),
    "session": ("#2ca02c", "s"),
    "prefix-aware": ("#1f77b4", "D"),
    "prefix-load": ("#d62728", "^"),
}


def fleet_row(workload: Workload, res: FleetResult, capacity: str) -> dict:
    """A sweep's row: the run's ``summary()`` plus ``trace``, ``router``, ``instances`` (N) and ``capacity``."""
    s = res.summary()
    return {
        "trace": workload.name,
        **s,
        "router": res.router.name,
        "router_params": s["router"],
        "instances": len(res.instances),
        "per_instance": s["instances"],
        "capacity": capacity,
    }


def sweep_fleet(
    workload: Workload,
    counts: Sequence[int],
    routers: Sequence[str],
    config: EngineConfig | None = None,
    sim: SimConfig | None = None,
    fleet_kv_tokens: float | None = None,
    progress: Callable[[dict], None] | None = None,
) -> list[dict]:
    """One fleet run per router and instance count, in that order; a row each (``fleet_row``)."""
    config, sim = config or EngineConfig(), sim or SimConfig()
    capacity = "fleet" if fleet_kv_tokens is not None else "per instance"
    rows = []
    for router in routers:
        for n in counts:
            row = fleet_row(workload, run_fleet(workload, config, sim, n, router, fleet_kv_tokens), capacity)
            rows.append(row)
            if progress is not None:
                progress(row)
    return rows


def format_fleet_table(rows: Sequence[dict]) -> str:
    return format_table(rows, FLEET_COLUMNS)


def describe_fleet(res: FleetResult) -> str:
    """The fleet's lines after a single run's (``cli.describe`` of its total): the router, then each instance."""
    s = res.summary()
    lines = [
        f"fleet     {len(res.instances)} instances behind {res.router.name}"
        + (f" ({', '.join(f'{k} {v}' for k, v in res.router.params().items())})" if res.router.params() else "")
        + f"; load imbalance {s['load_imbalance']:.2f} (busiest share x N)",
        "  instance  share  requests  hit rate  TTFT p50 s  TTFT p99 s  busy s  busy  preempt",
    ]
    for e in s["instances"]:
        p50 = "-" if e["ttft_p50_s"] is None else f"{e['ttft_p50_s']:.3g}"
        p99 = "-" if e["ttft_p99_s"] is None else f"{e['ttft_p99_s']:.3g}"
        lines.append(
            f"  {e['instance']:>8}  {e['share']:>5.1%}  {e['requests']:>8,}  {e['hit_rate']:>8.2%}  "
            f"{p50:>10}  {p99:>10}  {e['busy_s']:>6.0f}  {e['utilization']:>4.0%}  {e['preemptions']:>7,}"
        )
    return "\n".join(lines)


def plot_fleet(rows: Sequence[dict], path: str | Path, title: str | None = None) -> Path:
    """Hit rate, TTFT (p50 solid, p99 dashed, log y) and load imbalance against N, one line per router.
    Returns the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.6))
    draw_fleet_axes(rows, *axes)
    fig.suptitle(
        title or f"{rows[0]['trace']}: a fleet of N instances, {rows[0]['capacity']} capacity held", fontsize=11
    )
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def draw_fleet_axes(rows: Sequence[dict], hit_ax=None, ttft_ax=None, imb_ax=None, label: bool = True) -> None:
    """``plot_fleet``'s panels, each on the axes given (the benchmark draws several sets in one figure): hit rate,
    TTFT (p50 solid, p99 dashed, log y), load imbalance, against N, one line per router."""
    counts = sorted({r["instances"] for r in rows})
    for router in dict.fromkeys(r["router"] for r in rows):
        pts = sorted((r for r in rows if r["router"] == router), key=lambda r: r["instances"])
        colour, marker = ROUTER_STYLE.get(router, ("black", "x"))
        x = [r["instances"] for r in pts]
        if hit_ax is not None:
            hit_ax.plot(
                x, [r["hit_rate"] for r in pts], "-", color=colour, marker=marker, label=router if label else None
            )
        if ttft_ax is not None:
            for key, ls in (("ttft_p50_s", "-"), ("ttft_p99_s", "--")):
                ttft_ax.plot(
                    x,
                    [r[key] if r[key] is not None else float("nan") for r in pts],
                    ls,
                    color=colour,
                    marker=marker,
                    markersize=4,
                    label=router if label and hit_ax is None and key == "ttft_p50_s" else None,
                )
        if imb_ax is not None:
            imb_ax.plot(x, [r["load_imbalance"] for r in pts], "-", color=colour, marker=marker)
    for ax in (hit_ax, ttft_ax, imb_ax):
        if ax is None:
            continue
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(n) for n in counts])
        ax.set_xlabel("instances (N)")
        ax.grid(True, which="both", alpha=0.3)
    if hit_ax is not None:
        hit_ax.set_ylabel("fleet hit rate (cached / prompt tokens)")
        hit_ax.set_ylim(bottom=0)
    if ttft_ax is not None:
        ttft_ax.set_yscale("log")
        ttft_ax.set_ylabel("TTFT, s: p50 solid, p99 dashed")
    if imb_ax is not None:
        imb_ax.set_ylabel("load imbalance: busiest share x N")
        imb_ax.set_ylim(bottom=0.9)
