"""``python -m engine.workload FILE``: play a workload headless, or sweep its KV capacity.

Only argument parsing and printing live here; ``run_workload``, ``sweep``, ``plot_sweep`` and
``prefix_sharing`` do the work, and kvscope's own command line calls them the same way.
Exit status 2, with one line, for a bad file, line or option.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import fields

from ..config import EVICTION_POLICIES, EngineConfig
from ..config_options import OneLineParser, add_fields, choice_list
from ..messages import one_line
from .driver import SimConfig, WorkloadResult, run_workload
from .fleet import run_fleet
from .fleet_config import FleetConfig, check_fleet, parse_instance_counts
from .fleet_sweep import describe_fleet, format_fleet_table, plot_fleet, sweep_fleet
from .reader import Workload, read_workload
from .sweep import format_table, plot_sweep, reference_row, sweep


def parser() -> argparse.ArgumentParser:
    ap = OneLineParser(
        prog="python -m engine.workload",
        description="Play a request trace (Mooncake's JSONL, or kvscope's own) through the engine's scheduler and "
        "block pool without weights; a cost model's step time stands in for the forward pass.",
    )
    ap.add_argument(
        "file",
        help="the workload: Mooncake JSONL (timestamp, input_length, output_length, hash_ids) or "
        "kvscope JSONL (arrival, prompt, max_tokens)",
    )
    # The engine's and the simulated machine's flags, made from their config fields as kvscope's own parser makes
    # them (engine/config_options.py): the same names, types, bounds, choices and help.
    engine = ap.add_argument_group("engine (EngineConfig: the same flags as kvscope's)")
    add_fields(engine, EngineConfig, ("block_size",))
    size = engine.add_mutually_exclusive_group()  # the pool's size: in blocks, or in tokens (SimConfig's)
    add_fields(size, EngineConfig, ("num_gpu_blocks",))
    add_fields(size, SimConfig, ("kv_tokens",))
    add_fields(
        engine,
        EngineConfig,
        ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "preemption_mode", "hash_algo", "tokenizer"),
    )
    ev = next(f for f in fields(EngineConfig) if f.name == "eviction_policy")
    engine.add_argument(
        "--eviction-policy",
        type=choice_list("eviction_policy", EVICTION_POLICIES),
        default=[ev.default],
        metavar="POLICY[,POLICY]",
        help=f"{ev.metadata['help']}; a comma-separated list ({','.join(EVICTION_POLICIES)}) runs each and compares "
        f"them (default {ev.default})",
    )
    sim = ap.add_argument_group("the simulated machine (SimConfig)")
    add_fields(sim, SimConfig, [f.name for f in fields(SimConfig) if f.name != "kv_tokens"])
    ap.add_argument(
        "--sweep-kv-tokens",
        metavar="LIST",
        help="run every capacity in this comma-separated list of token counts (1e4,1e5,1e6,...) and print the table",
    )
    ap.add_argument("--limit", type=int, help="only the first N requests")
    ap.add_argument("--json", action="store_true", help="print JSON: {workload: ...} or {sweep: [...], reference: ...}")
    ap.add_argument(
        "--png",
        help="with --sweep-kv-tokens: the plot of hit rate against capacity (default: "
        "TRACE_hit_rate.png in the current folder); with --sweep-instances: hit rate, "
        "TTFT and load imbalance against N (default: TRACE_fleet.png)",
    )
    g = ap.add_argument_group("fleet (docs/routing.md)")
    add_fields(g, FleetConfig)
    g.add_argument(
        "--sweep-instances",
        metavar="LIST",
        help="run a fleet of each size in this comma-separated list (1,2,4,8,16) per --router, print the "
        "table and draw hit rate, TTFT and load imbalance against N",
    )
    return ap


def parse_floats(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--sweep-kv-tokens takes numbers separated by commas (1e4,1e5,...), got {text!r}") from None
    if not out or any(not 1 <= x < 1e13 for x in out):
        raise ValueError(f"--sweep-kv-tokens takes token counts from 1 to 1e13, got {text!r}")
    return out


def configs(args: argparse.Namespace) -> tuple[EngineConfig, SimConfig]:
    given = {f.name for f in fields(EngineConfig)} & set(vars(args)) - {"eviction_policy", "tokenizer"}
    config = EngineConfig(**{name: getattr(args, name) for name in given})
    sim = SimConfig(**{f.name: getattr(args, f.name) for f in fields(SimConfig)})
    config.validate()
    sim.validate()
    return config, sim


def describe(res: WorkloadResult | dict) -> str:
    """A run's lines: its ``summary()`` (or the summary itself: a fleet's)."""
    s = res if isinstance(res, dict) else res.summary()
    ttft = "-" if s["ttft_p50_s"] is None else f"{s['ttft_p50_s']:.3g} s p50, {s['ttft_p99_s']:.3g} s p99"
    skipped = s["skipped_too_long"] + s["skipped_too_big"]
    return "\n".join(
        [
            f"{s['workload']} ({s['format']}, {s['mode']}): {s['requests']:,} requests"
            + (
                f" ({s['skipped_too_long']} longer than the context, {s['skipped_too_big']} bigger than the pool: "
                "skipped)"
                if skipped
                else ""
            ),
            f"pool      {s['num_gpu_blocks']:,} blocks x {s['block_size']} = {s['kv_tokens']:,} tokens ({s['pool']}), "
            f"eviction {s['eviction_policy']}",
            f"hit rate  {s['hit_rate']:.2%} ({s['cached_tokens']:,} of {s['prompt_tokens']:,} prompt tokens cached)",
            f"evictions {s['evictions']:,}; preemptions {s['preemptions']:,}; TTFT {ttft}",
            f"virtual   {s['virtual_s']:.1f} s ({s['utilization']:.0%} busy), {s['steps']:,} steps; "
            f"wall {s['wall_s']:.1f} s, peak RSS {s['peak_rss_mb']:.0f} MB",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        config, sim = configs(args)
        fleet = FleetConfig(**{f.name: getattr(args, f.name) for f in fields(FleetConfig)})
        return play(
            args.file,
            config,
            sim,
            args.eviction_policy,
            parse_floats(args.sweep_kv_tokens) if args.sweep_kv_tokens else None,
            png=args.png,
            as_json=args.json,
            tokenizer=args.tokenizer,
            limit=args.limit,
            fleet=fleet,
            counts=parse_instance_counts(args.sweep_instances) if args.sweep_instances else None,
        )
    except (ValueError, OSError) as e:  # a WorkloadError is a ValueError
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2


def check_sweeps(
    config: EngineConfig,
    sim: SimConfig,
    fleet: FleetConfig,
    caps: list[float] | None,
    counts: list[int] | None,
    png: str | None,
    window: bool = False,
) -> None:
    """What the sweeps and the fleet cannot be combined with (one line, ``ValueError``), with a window or
    without; the window's own refusals with ``window``."""
    if png and caps is None and counts is None:
        raise ValueError("--png draws a sweep: give --sweep-kv-tokens or --sweep-instances too")
    if caps is not None and config.num_gpu_blocks is not None:
        raise ValueError("--sweep-kv-tokens sets the pool's size: leave out --num-gpu-blocks")
    if caps is not None and sim.kv_tokens is not None:
        raise ValueError("--sweep-kv-tokens sets the pool's size: leave out --kv-tokens")
    check_fleet(fleet, config, sim, caps is not None, counts, window)


def play(
    path: str,
    config: EngineConfig,
    sim: SimConfig,
    policies: list[str],
    caps: list[float] | None = None,
    png: str | None = None,
    as_json: bool = False,
    tokenizer: str | None = None,
    limit: int | None = None,
    out=None,
    fleet: FleetConfig | None = None,
    counts: list[int] | None = None,
) -> int:
    """Play a workload once per policy, or sweep its capacities; or a fleet (``fleet.instances``, once per
    policy and router), or sweep its size (``counts``); and print what was found (to ``out``, default
    stdout). Raises ``WorkloadError``, ``ValueError`` or ``OSError`` with a one-line message for bad input;
    ``python -m engine.workload`` and ``kvscope --headless --workload`` both call it."""
    out = out or sys.stdout

    def say(text: str) -> None:
        print(text, file=out, flush=True)

    fleet = fleet or FleetConfig()
    check_sweeps(config, sim, fleet, caps, counts, png)
    if counts is not None and len(policies) > 1:
        raise ValueError("--sweep-instances draws one eviction policy: give --eviction-policy one")
    tok = None
    if tokenizer:
        from ..runner.models.loader import load_tokenizer

        tok = load_tokenizer(tokenizer)
    workload = read_workload(path, tokenizer=tok, limit=limit)
    cost = sim.cost_model(config)
    if not as_json:
        say(cost.describe())
    ref = reference_row(workload, config, sim)
    if fleet.instances is not None or counts is not None:
        return _play_fleet(workload, config, sim, policies, fleet, counts, ref, png, as_json, say)
    if caps is None:
        rows = []
        for policy in policies:
            res = run_workload(workload, EngineConfig(**{**_fields(config), "eviction_policy": policy}), sim)
            rows.append(dict(res.summary(), reference_hit_rate=ref["hit_rate"]))
            if not as_json:
                say(describe(res))
        return _said_runs(rows, as_json, say)

    def show(row: dict) -> None:
        if not as_json:
            print(
                f"  {row['policy']:>4} at {row['kv_tokens']:.3g} tokens: hit rate {row['hit_rate']:.2%} "
                f"({row['wall_s']:.1f} s)",
                file=sys.stderr,
                flush=True,
            )

    rows = sweep(workload, caps, policies, config, sim, progress=show, reference=ref)
    png = png or f"{workload.name}_hit_rate.png"
    plot_sweep(rows, png, [ref])
    if as_json:
        say(json.dumps({"sweep": rows, "reference": ref, "png": png}, indent=2))
    else:
        say(format_table(rows))
        say(
            f"reference (a pool that never evicts, computed from the trace alone): {ref['hit_rate']:.2%}"
            + (f"; the paper's Table 2: {ref['paper_table2']:.0%}" if ref["paper_table2"] else "")
        )
        say(f"plot: {png}")
    return 0


def _said_runs(rows: list[dict], as_json: bool, say) -> int:
    """The runs' ``workload`` objects as JSON (one, or a list), when asked for; the lines were said already."""
    if as_json:
        say(json.dumps({"workload": rows[0]} if len(rows) == 1 else {"workload": rows}, indent=2))
    return 0


def _play_fleet(
    workload: Workload,
    config: EngineConfig,
    sim: SimConfig,
    policies: list[str],
    fleet: FleetConfig,
    counts: list[int] | None,
    ref: dict,
    png: str | None,
    as_json: bool,
    say,
) -> int:
    if counts is None:
        rows = []
        for policy in policies:
            for router in fleet.routers:
                res = run_fleet(
                    workload,
                    dataclasses.replace(config, eviction_policy=policy),
                    sim,
                    fleet.instances,
                    router,
                    fleet.fleet_kv_tokens,
                )
                rows.append(dict(res.summary(), reference_hit_rate=ref["hit_rate"]))
                if not as_json:
                    say(describe(rows[-1]) + "\n" + describe_fleet(res))
        return _said_runs(rows, as_json, say)

    def show(row: dict) -> None:
        if not as_json:
            print(
                f"  {row['router']:>12} x {row['instances']:>2}: hit rate {row['hit_rate']:.2%}, TTFT p50 "
                f"{row['ttft_p50_s']:.3g} s ({row['wall_s']:.1f} s)",
                file=sys.stderr,
                flush=True,
            )

    rows = sweep_fleet(
        workload,
        counts,
        fleet.routers,
        dataclasses.replace(config, eviction_policy=policies[0]),
        sim,
        fleet.fleet_kv_tokens,
        progress=show,
    )
    png = png or f"{workload.name}_fleet.png"
    plot_fleet(rows, png)
    if as_json:
        say(json.dumps({"sweep": rows, "reference": ref, "png": png}, indent=2))
    else:
        say(format_fleet_table(rows))
        say(f"reference (one pool that never evicts, computed from the trace alone): {ref['hit_rate']:.2%}")
        say(f"plot: {png}")
    return 0


def _fields(config: EngineConfig) -> dict:
    return {k: getattr(config, k) for k in config.__slots__}
