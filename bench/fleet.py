"""A fleet behind a router: Mooncake's traces over N = 1 to 16 simulated instances under each routing policy.

    python bench/fleet.py [--quick] [--workers 2]

On the full traces in ../shared/traces/mooncake/ (the quick run: the 200-line excerpts in resources/workloads/,
their first 40 requests, N = 1, 2, 4: a check that every point runs and both references hold), llama-3.1-8b on
simulated H100s (the cost model's defaults):

1. reference: round robin at N = 2, 4, 8, 16, one request at a time, every pool one that never evicts (block
   size 512, the traces' own), caches exactly what ``reference.round_robin_sharing`` says: each instance a
   cache over every N-th request, computed from the hash ids alone;
2. equality: with N = 1 every policy's ``workload`` object is the single engine's (at a quarter of the rate,
   each pool one card's); those fleet runs are the sweep's N = 1 points at that rate. At the real rate the
   N = 1 point is one run shared by every policy (a fleet of one has no choice, as 2 checks);
3. the sweep, block size 64 (a quarter of the blocks of 16, for time): every policy at N = 1, 2, 4, 8, 16
   - each pool one card's (426,788 tokens), at the traces' real rate and at a quarter of it;
   - the fleet's capacity fixed at eight cards' (3.41 M tokens split evenly), at the real rate (N = 8 is
     the same run as in the first);
   hit rate, TTFT p50 and p99, load imbalance (the busiest instance's share over 1 / N), utilisation;
4. speed: ``python -m engine.workload`` on the conversation trace at N = 8 behind prefix-aware (block 16,
   each pool one card's, the real rate), in a process of its own, against the aim (<= 5 min).

The runs of 1 to 3 go to ``--workers`` processes (default 2: this machine's cores), the longest first.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from common import plot_path, pyplot, table, write_results
from engine import EngineConfig
from engine.workload import SimConfig, read_workload, run_workload
from engine.workload.fleet import run_fleet
from engine.workload.fleet_sweep import ROUTER_STYLE, draw_fleet_axes, fleet_row
from engine.workload.reference import round_robin_sharing
from engine.workload.routers import ROUTERS
from engine.workload.sweep import format_table

ROOT = Path(__file__).resolve().parents[1]
FULL = ROOT.parent / "shared" / "traces" / "mooncake"
EXCERPTS = ROOT / "resources" / "workloads"
BLOCK = 64
REFERENCE_BLOCK = 512
CARD_TOKENS = 426_788  # llama-3.1-8b's KV beside its weights on one H100 at 0.9 (the cost model's default pool)
QUARTER = 4.0  # time scale: a quarter of the trace's rate
ROUTER_NAMES = tuple(ROUTERS)
AIM_S = 300
MACHINE_COST = {"wall_s", "peak_rss_mb"}


@dataclasses.dataclass(frozen=True)
class Plan:
    quick: bool
    counts: tuple[int, ...]
    per_instance: float  # each pool's tokens
    fleet_total: float  # the fixed total
    shared_n: int  # the N at which both capacities give the same pools
    reference_counts: tuple[int, ...]
    limit: int | None


def plan(quick: bool) -> Plan:
    if quick:
        return Plan(True, (1, 2, 4), 2e5, 4e5, 2, (2, 4), 40)
    return Plan(False, (1, 2, 4, 8, 16), CARD_TOKENS, 8 * CARD_TOKENS, 8, (2, 4, 8, 16), None)


def traces(quick: bool) -> dict[str, Path]:
    if quick or not (FULL / "conversation_trace.jsonl").exists():
        return {
            "conversation": EXCERPTS / "mooncake_conversation_200.jsonl",
            "synthetic": EXCERPTS / "mooncake_synthetic_200.jsonl",
        }
    return {"conversation": FULL / "conversation_trace.jsonl", "synthetic": FULL / "synthetic_trace.jsonl"}


# -- one run (in a worker process) -------------------------------------------------------------------
_LOADED: dict = {}


def _workload(path: str, limit: int | None):
    key = (path, limit)
    if key not in _LOADED:
        _LOADED[key] = read_workload(path, limit=limit)
    return _LOADED[key]


def one(task: dict) -> dict:
    """A task: ``kind`` "fleet" (a sweep point), "single" (the single engine) or "reference" (round robin in
    sequential mode with pools that never evict, against the reference). Returns a plain dict."""
    w = _workload(task["path"], task["limit"])
    labels = {k: task[k] for k in ("trace_key", "kind", "rate", "capacity") if k in task}
    if task["kind"] == "reference":
        n = task["instances"]
        refs = round_robin_sharing(w, n, REFERENCE_BLOCK, 131072)
        t0 = time.perf_counter()
        pool = max(r.blocks_allocated for r in refs)  # every instance's never evicts
        res = run_fleet(
            w,
            EngineConfig(block_size=REFERENCE_BLOCK, num_gpu_blocks=pool),
            SimConfig(sequential=True),
            n,
            "round-robin",
        )
        engine, ref = [i.cached_tokens for i in res.instances], [r.cached_tokens for r in refs]
        return {
            **labels,
            "instances": n,
            "block_size": REFERENCE_BLOCK,
            "requests": res.total.requests,
            "engine_cached_tokens": engine,
            "reference_cached_tokens": ref,
            "equal": engine == ref,
            "evictions": res.total.evictions,
            "hit_rate": res.hit_rate,
            "reference_hit_rate": sum(ref) / sum(r.prompt_tokens for r in refs),
            "seconds": time.perf_counter() - t0,
            "peak_rss_mb": res.total.peak_rss_mb,
        }
    cfg = EngineConfig(block_size=BLOCK)
    sim = SimConfig(kv_tokens=task["kv_tokens"], time_scale=task["time_scale"])
    if task["kind"] == "single":
        return {**labels, "summary": run_workload(w, cfg, sim).summary()}
    res = run_fleet(w, cfg, sim, task["instances"], task["router"])
    row = fleet_row(w, res, task["capacity"])
    return {**row, **labels, "kv_tokens_per_instance": task["kv_tokens"]}


def tasks(p: Plan, paths: dict[str, Path]) -> list[dict]:
    out = []
    for key, path in paths.items():
        base = {"trace_key": key, "path": str(path), "limit": p.limit}
        for n in p.reference_counts:
            out.append({**base, "kind": "reference", "instances": n, "cost": 1})
        quarter = {
            **base,
            "rate": "quarter",
            "time_scale": QUARTER,
            "capacity": "per instance",
            "kv_tokens": p.per_instance,
        }
        out.append({**quarter, "kind": "single", "cost": 4})
        real = {**base, "rate": "real", "time_scale": 1.0}
        for router in ROUTER_NAMES:
            for n in p.counts:
                out.append({**quarter, "kind": "fleet", "router": router, "instances": n, "cost": 4 + n})
                if n > 1:
                    out.append(
                        {
                            **real,
                            "kind": "fleet",
                            "capacity": "per instance",
                            "kv_tokens": p.per_instance,
                            "router": router,
                            "instances": n,
                            "cost": 4 + n,
                        }
                    )
                if n > 1 and n != p.shared_n:
                    out.append(
                        {
                            **real,
                            "kind": "fleet",
                            "capacity": "fleet",
                            "kv_tokens": p.fleet_total / n,
                            "router": router,
                            "instances": n,
                            "cost": 4 + n,
                        }
                    )
        for capacity, kv in (("per instance", p.per_instance), ("fleet", p.fleet_total)):  # N = 1 at the real rate
            out.append(
                {
                    **real,
                    "kind": "fleet",
                    "capacity": capacity,
                    "kv_tokens": kv,
                    "router": "round-robin",
                    "instances": 1,
                    "cost": 6,
                }
            )
    for t in out:  # the conversation trace costs about 6x the synthetic one
        t["cost"] *= 6 if t["trace_key"] == "conversation" else 1
    return sorted(out, key=lambda t: -t["cost"])


def run_all(todo: list[dict], workers: int) -> list[dict]:
    done = []
    t0 = time.perf_counter()

    def note(r: dict) -> None:
        done.append(r)
        what = f"{r['trace_key']} {r['kind']} " + (
            f"{r.get('router', '')} x {r.get('instances', '')} {r.get('rate', '')} {r.get('capacity', '')}"
        )
        hit = r.get("hit_rate", r.get("summary", {}).get("hit_rate"))
        print(f"  [{len(done)}/{len(todo)} at {time.perf_counter() - t0:.0f} s] {what}: hit rate {hit:.2%}", flush=True)

    if workers <= 1:
        for t in todo:
            note(one(t))
    else:
        with ProcessPoolExecutor(workers) as pool:
            for r in pool.map(one, todo):
                note(r)
    return done


# -- the checks, the rows, the figures ---------------------------------------------------------------------
def equality(results: list[dict]) -> list[dict]:
    """Each policy's N = 1 fleet at a quarter of the rate against the single engine: the whole object."""
    out = []
    for key in dict.fromkeys(r["trace_key"] for r in results):
        single = next(r["summary"] for r in results if r["kind"] == "single" and r["trace_key"] == key)
        for r in results:
            if r["kind"] == "fleet" and r["trace_key"] == key and r["instances"] == 1 and r["rate"] == "quarter":
                fleet = {k: v for k, v in r.items() if k in single}
                diff = sorted(k for k in single if k not in MACHINE_COST and single[k] != fleet.get(k))
                out.append(
                    {
                        "trace": key,
                        "router": r["router"],
                        "equal": not diff,
                        "differs": diff,
                        "hit_rate": r["hit_rate"],
                        "ttft_p99_s": r["ttft_p99_s"],
                        "requests": r["requests"],
                    }
                )
    return out


def sweep_rows(results: list[dict], p: Plan) -> list[dict]:
    """Every sweep point, the shared runs given to each policy they stand for (marked ``shared``)."""
    fleet = [r for r in results if r["kind"] == "fleet"]
    rows = [dict(r, shared=None) for r in fleet if not (r["instances"] == 1 and r["rate"] == "real")]
    for r in fleet:
        if r["instances"] == 1 and r["rate"] == "real":  # one run, every policy's N = 1 point
            rows += [dict(r, router=name, shared="N = 1: one run for every policy") for name in ROUTER_NAMES]
        if r["instances"] == p.shared_n and r["rate"] == "real" and r["capacity"] == "per instance":
            rows.append(dict(r, capacity="fleet", shared=f"N = {p.shared_n}: the per-instance run (the same pools)"))
    order = {"real": 0, "quarter": 1}
    return sorted(
        rows,
        key=lambda r: (
            r["trace_key"],
            order[r["rate"]],
            r["capacity"] != "per instance",
            ROUTER_NAMES.index(r["router"]),
            r["instances"],
        ),
    )


def select(rows: list[dict], trace: str, rate: str, capacity: str) -> list[dict]:
    return [r for r in rows if (r["trace_key"], r["rate"], r["capacity"]) == (trace, rate, capacity)]


def save(fig, name: str, quick: bool) -> None:
    """Laid out above the legend (common.save_figure's tight_layout would put the panels over it)."""
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    fig.savefig(plot_path(name, quick), dpi=100)
    pyplot().close(fig)


def legend_below(fig, ax) -> None:
    """One legend for the figure, under every panel (over no line)."""
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(
        handles, labels, loc="lower center", bbox_to_anchor=(0.5, 0.0), ncol=len(labels), fontsize=10, frameon=False
    )


def plot_per_instance(rows: list[dict], keys: list[str], quick: bool) -> None:
    """Per trace: hit rate (real rate), TTFT at the real rate, TTFT at a quarter of it, load imbalance."""
    plt = pyplot()
    fig, axes = plt.subplots(len(keys), 4, figsize=(19, 4.6 * len(keys)), squeeze=False)
    for row_axes, key in zip(axes, keys):
        real, quarter = select(rows, key, "real", "per instance"), select(rows, key, "quarter", "per instance")
        draw_fleet_axes(real, row_axes[0], row_axes[1], row_axes[3])
        draw_fleet_axes(quarter, ttft_ax=row_axes[2], label=False)
        row_axes[0].set_title(f"{key}: fleet hit rate (each pool one card's)", fontsize=10)
        row_axes[1].set_title(f"{key}: TTFT at the trace's real rate", fontsize=10)
        row_axes[2].set_title(f"{key}: TTFT at a quarter of the rate", fontsize=10)
        row_axes[3].set_title(f"{key}: load imbalance (real rate)", fontsize=10)
    legend_below(fig, axes[0][0])
    fig.suptitle(
        "A fleet of N instances (llama-3.1-8b on simulated H100s, each pool 426,788 tokens): p50 solid, p99 dashed",
        fontsize=11,
    )
    save(fig, "fleet", quick)


def plot_fixed_total(rows: list[dict], keys: list[str], total: float, quick: bool) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(len(keys), 3, figsize=(15, 4.6 * len(keys)), squeeze=False)
    for row_axes, key in zip(axes, keys):
        draw_fleet_axes(select(rows, key, "real", "fleet"), *row_axes)
        per = select(rows, key, "real", "per instance")  # the same fleets with a card each, faint, to compare
        for router in ROUTER_NAMES:
            pts = sorted((r for r in per if r["router"] == router), key=lambda r: r["instances"])
            row_axes[0].plot(
                [r["instances"] for r in pts],
                [r["hit_rate"] for r in pts],
                ":",
                color=ROUTER_STYLE[router][0],
                alpha=0.5,
            )
        row_axes[0].set_title(f"{key}: fleet hit rate (dotted: a card's pool each)", fontsize=10)
        row_axes[1].set_title(f"{key}: TTFT at the real rate", fontsize=10)
        row_axes[2].set_title(f"{key}: load imbalance", fontsize=10)
    legend_below(fig, axes[0][0])
    fig.suptitle(
        f"The same {total / 1e6:.2f} M tokens of KV split over N instances (real rate): p50 solid, p99 dashed",
        fontsize=11,
    )
    save(fig, "fleet_total", quick)


def speed(conversation: Path) -> dict:
    """``python -m engine.workload`` at N = 8 behind prefix-aware, in a process of its own."""
    args = [str(conversation), "--instances", "8", "--router", "prefix-aware"]
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "engine.workload", *args, "--json"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    s = json.loads(out.stdout)["workload"]
    process_s = time.perf_counter() - t0
    return {
        "command": "python -m engine.workload " + " ".join(args),
        "process_s": process_s,
        "run_s": s["wall_s"],
        "peak_rss_mb": s["peak_rss_mb"],
        "aim_s": AIM_S,
        "met": process_s <= AIM_S,
        "load_before": load,
        "hit_rate": s["hit_rate"],
        "ttft_p50_s": s["ttft_p50_s"],
        "ttft_p99_s": s["ttft_p99_s"],
        "load_imbalance": s["load_imbalance"],
        "steps": s["steps"],
        "requests": s["requests"],
    }


COLUMNS = [
    ("trace_key", "trace", ""),
    ("rate", "rate", ""),
    ("capacity", "capacity", ""),
    ("router", "router", ""),
    ("instances", "N", "d"),
    ("hit_rate", "hit rate", ".1%"),
    ("ttft_p50_s", "TTFT p50 s", ".3g"),
    ("ttft_p99_s", "TTFT p99 s", ".3g"),
    ("load_imbalance", "imbalance", ".2f"),
    ("utilization", "busy", ".0%"),
    ("preemptions", "preempt", "d"),
    ("wall_s", "wall s", ".0f"),
]


def run(quick: bool, workers: int = 1) -> dict:
    p = plan(quick)
    paths = traces(quick)
    t0 = time.perf_counter()
    results = run_all(tasks(p, paths), workers)
    refs = sorted((r for r in results if r["kind"] == "reference"), key=lambda r: (r["trace_key"], r["instances"]))
    print(
        table(
            refs,
            [
                ("trace_key", "trace", ""),
                ("instances", "N", "d"),
                ("requests", "requests", "d"),
                ("hit_rate", "engine", ".2%"),
                ("reference_hit_rate", "reference", ".2%"),
                ("equal", "equal", ""),
                ("seconds", "s", ".1f"),
            ],
        ),
        flush=True,
    )
    assert all(r["equal"] for r in refs), "round robin's hits differ from the reference"
    eq = equality(results)
    print(
        table(
            eq,
            [
                ("trace", "trace", ""),
                ("router", "router", ""),
                ("equal", "N = 1 = single", ""),
                ("hit_rate", "hit rate", ".2%"),
            ],
        ),
        flush=True,
    )
    assert eq and all(r["equal"] for r in eq), f"a fleet of one differs from the single engine: {eq}"
    rows = sweep_rows(results, p)
    print(format_table(rows, [(k, h, f) for k, h, f in COLUMNS]), flush=True)
    keys = list(paths)
    plot_per_instance(rows, keys, quick)
    plot_fixed_total(rows, keys, p.fleet_total, quick)
    fast = [] if quick else [speed(paths["conversation"])]
    for s in fast:
        print(f"  speed: {s['command']}: {s['process_s']:.0f} s (aim {AIM_S} s), {s['peak_rss_mb']:.0f} MB", flush=True)
    for r in rows:
        r.pop("path", None)
    result = {
        "traces": {
            k: str(v.relative_to(ROOT.parent) if v.is_relative_to(ROOT.parent) else v) for k, v in paths.items()
        },
        "limit": p.limit,
        "sim": "llama-3.1-8b on h100 (cost model defaults)",
        "block_size": BLOCK,
        "capacity_per_instance_tokens": p.per_instance,
        "fleet_capacity_tokens": p.fleet_total,
        "time_scales": {"real": 1.0, "quarter": QUARTER},
        "counts": list(p.counts),
        "routers": ROUTER_NAMES,
        "reference": refs,
        "equality": eq,
        "rows": rows,
        "speed": fast,
        "workers": workers,
        "seconds": time.perf_counter() - t0,
    }
    write_results("fleet", result, quick)
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small run (CI checks its JSON's shape, not speed)")
    ap.add_argument("--workers", type=int, default=2, help="processes for the runs (default 2)")
    a = ap.parse_args()
    run(a.quick, a.workers)
