"""``python -m engine.workload FILE``: play a workload headless, or sweep its KV capacity.

Only argument parsing and printing live here; ``run_workload``, ``sweep``, ``plot_sweep`` and
``prefix_sharing`` do the work, and kvscope's own command line calls them the same way.
Exit status 2, with one line, for a bad file, line or option.
"""
from __future__ import annotations

import argparse
import json
import sys

from ..config import EVICTION_POLICIES, HASH_ALGOS, PREEMPTION_MODES, EngineConfig
from .costmodel import DEFAULT_GPU, DEFAULT_MODEL, GPUS, MODELS
from .driver import SimConfig, WorkloadResult, run_workload
from .reader import read_workload
from .sweep import format_table, plot_sweep, reference_row, sweep


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m engine.workload",
        description="Play a request trace (Mooncake's JSONL, or kvscope's own) through the engine's scheduler and "
                    "block pool without weights; a cost model's step time stands in for the forward pass.")
    ap.add_argument("file", help="the workload: Mooncake JSONL (timestamp, input_length, output_length, hash_ids) or "
                                 "kvscope JSONL (arrival, prompt, max_tokens)")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--num-gpu-blocks", type=int, help="the pool's size in blocks")
    size.add_argument("--kv-tokens", type=float, help="the pool's size in tokens (1e6, 3e7, ...); default: what fits "
                                                      "beside the weights on the simulated cards")
    ap.add_argument("--sequential", action="store_true",
                    help="one request at a time, each finished before the next, prompts only (Figure 9's assumption)")
    ap.add_argument("--sweep-kv-tokens", metavar="LIST",
                    help="run every capacity in this comma-separated list of token counts (1e4,1e5,1e6,...) and "
                         "print the table")
    ap.add_argument("--eviction-policy", default="lru",
                    help=f"{' or '.join(EVICTION_POLICIES)}, or a comma-separated list to compare them (default lru)")
    ap.add_argument("--sim-model", default=DEFAULT_MODEL, help=f"one of {', '.join(MODELS)} (default {DEFAULT_MODEL})")
    ap.add_argument("--sim-gpu", default=DEFAULT_GPU, help=f"one of {', '.join(GPUS)} (default {DEFAULT_GPU})")
    ap.add_argument("--sim-tp", type=int, help="cards the model is split over (default: the fewest that fit it)")
    ap.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival times by this (default 1)")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="most requests running at once (default 64)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of a step (default 2048)")
    ap.add_argument("--max-model-len", type=int, help="cap the simulated model's context")
    ap.add_argument("--preemption-mode", default="recompute", choices=PREEMPTION_MODES)
    ap.add_argument("--hash-algo", default="sha256", choices=HASH_ALGOS)
    ap.add_argument("--tokenizer", help="a tokenizer (hub id or folder) for text prompts in a kvscope workload")
    ap.add_argument("--limit", type=int, help="only the first N requests")
    ap.add_argument("--json", action="store_true", help="print JSON: {workload: ...} or {sweep: [...], reference: ...}")
    ap.add_argument("--png", help="with --sweep-kv-tokens: the plot of hit rate against capacity (default: "
                                  "TRACE_hit_rate.png in the current folder)")
    return ap


def parse_floats(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--sweep-kv-tokens takes numbers separated by commas (1e4,1e5,...), got {text!r}") from None
    if not out or any(not 1 <= x < 1e13 for x in out):
        raise ValueError(f"--sweep-kv-tokens takes token counts from 1 to 1e13, got {text!r}")
    return out


def policies_of(text: str) -> list[str]:
    out = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in out if p not in EVICTION_POLICIES]
    if not out or bad:
        raise ValueError(f"--eviction-policy takes {', '.join(EVICTION_POLICIES)} (or a comma-separated list), "
                         f"got {text!r}")
    return out


def configs(args: argparse.Namespace) -> tuple[EngineConfig, SimConfig]:
    config = EngineConfig(block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks,
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          max_model_len=args.max_model_len, preemption_mode=args.preemption_mode,
                          hash_algo=args.hash_algo)
    sim = SimConfig(sim_model=args.sim_model, sim_gpu=args.sim_gpu, sim_tp=args.sim_tp, kv_tokens=args.kv_tokens,
                    sequential=args.sequential, time_scale=args.time_scale)
    config.validate()
    sim.validate()
    return config, sim


def describe(res: WorkloadResult) -> str:
    s = res.summary()
    ttft = ("-" if s["ttft_p50_s"] is None else f"{s['ttft_p50_s']:.3g} s p50, {s['ttft_p99_s']:.3g} s p99")
    skipped = s["skipped_too_long"] + s["skipped_too_big"]
    return "\n".join([
        f"{s['workload']} ({s['format']}, {s['mode']}): {s['requests']:,} requests"
        + (f" ({s['skipped_too_long']} longer than the context, {s['skipped_too_big']} bigger than the pool: "
           "skipped)" if skipped else ""),
        f"pool      {s['num_gpu_blocks']:,} blocks x {s['block_size']} = {s['kv_tokens']:,} tokens ({s['pool']}), "
        f"eviction {s['eviction_policy']}",
        f"hit rate  {s['hit_rate']:.2%} ({s['cached_tokens']:,} of {s['prompt_tokens']:,} prompt tokens cached)",
        f"evictions {s['evictions']:,}; preemptions {s['preemptions']:,}; TTFT {ttft}",
        f"virtual   {s['virtual_s']:.1f} s ({s['utilization']:.0%} busy), {s['steps']:,} steps; "
        f"wall {s['wall_s']:.1f} s, peak RSS {s['peak_rss_mb']:.0f} MB",
    ])


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        config, sim = configs(args)
        return play(args.file, config, sim, policies_of(args.eviction_policy),
                    parse_floats(args.sweep_kv_tokens) if args.sweep_kv_tokens else None, png=args.png,
                    as_json=args.json, tokenizer=args.tokenizer, limit=args.limit)
    except (ValueError, OSError) as e:  # a WorkloadError is a ValueError
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2


def one_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def play(path: str, config: EngineConfig, sim: SimConfig, policies: list[str], caps: list[float] | None = None,
         png: str | None = None, as_json: bool = False, tokenizer: str | None = None, limit: int | None = None,
         out=None) -> int:
    """Play a workload once per policy, or sweep its capacities, and print what was found (to ``out``,
    default stdout). Raises ``WorkloadError``, ``ValueError`` or ``OSError`` with a one-line message for
    bad input; ``python -m engine.workload`` and ``kvscope --headless --workload`` both call it."""
    out = out or sys.stdout

    def say(text: str) -> None:
        print(text, file=out, flush=True)

    if png and caps is None:
        raise ValueError("--png draws a sweep: give --sweep-kv-tokens too")
    if caps is not None and config.num_gpu_blocks is not None:
        raise ValueError("--sweep-kv-tokens sets the pool's size: leave out --num-gpu-blocks")
    if caps is not None and sim.kv_tokens is not None:
        raise ValueError("--sweep-kv-tokens sets the pool's size: leave out --kv-tokens")
    tok = None
    if tokenizer:
        from ..runner.models.loader import load_tokenizer
        tok = load_tokenizer(tokenizer)
    workload = read_workload(path, tokenizer=tok, limit=limit)
    cost = sim.cost_model(config)
    if not as_json:
        say(cost.describe())
    ref = reference_row(workload, config, sim)
    if caps is None:
        results = []
        for policy in policies:
            res = run_workload(workload, EngineConfig(**{**_fields(config), "eviction_policy": policy}), sim)
            results.append(res)
            if not as_json:
                say(describe(res))
        if as_json:
            rows = [dict(r.summary(), reference_hit_rate=ref["hit_rate"]) for r in results]
            say(json.dumps({"workload": rows[0]} if len(rows) == 1 else {"workload": rows}, indent=2))
        return 0

    def show(row: dict) -> None:
        if not as_json:
            print(f"  {row['policy']:>4} at {row['kv_tokens']:.3g} tokens: hit rate {row['hit_rate']:.2%} "
                  f"({row['wall_s']:.1f} s)", file=sys.stderr, flush=True)

    rows = sweep(workload, caps, policies, config, sim, progress=show, reference=ref)
    png = png or f"{workload.name}_hit_rate.png"
    plot_sweep(rows, png, [ref])
    if as_json:
        say(json.dumps({"sweep": rows, "reference": ref, "png": png}, indent=2))
    else:
        say(format_table(rows))
        say(f"reference (a pool that never evicts, computed from the trace alone): {ref['hit_rate']:.2%}"
            + (f"; the paper's Table 2: {ref['paper_table2']:.0%}" if ref["paper_table2"] else ""))
        say(f"plot: {png}")
    return 0


def _fields(config: EngineConfig) -> dict:
    return {k: getattr(config, k) for k in config.__slots__}
