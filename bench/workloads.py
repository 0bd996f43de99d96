"""Real workloads: Mooncake's published traces through kvscope's scheduler and block pool, without weights.

    python bench/workloads.py [--quick]

On the full traces in ../shared/traces/mooncake/ (the quick run: the 200-line excerpts in
resources/workloads/):

1. reference: each trace's own prefix sharing by the engine's rules (reference.py, over hash ids),
   the hit rate a pool that never evicts reaches;
2. equality: the engine, one request at a time with such a pool, caches exactly as many prompt
   tokens as the reference (whole traces, block sizes 512 and 16);
3. Figure 9: the sequential sweep (one request at a time, prompts only: the paper's assumption),
   hit rate against capacity from 1e4 to 1e8 tokens, per trace and eviction policy, at block size
   512 (the traces' own), beside Table 2 and the paper's text about Figure 9;
4. what the paper leaves out: arrivals on the virtual clock (llama-3.1-8b on one simulated H100),
   64 and 256 requests at once, chunked prefill, preemption, and blocks in use that cannot be
   evicted, per capacity and policy, at block size 64 (a quarter of the blocks of 16, for time):
   the traces at a quarter of their rate (one card keeps up), and at their real rate (a cluster's
   traffic: one card cannot, the queue grows and the running requests reach the cap);
5. speed: ``python -m engine.workload`` in a process of its own on the conversation trace, against
   the aims (sequential at 1e7 tokens: <= 60 s at block size 512, <= 5 min at 16; full mode at
   1e6 tokens: <= 5 min; <= 2 GB).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import main, pyplot, save_figure, table, write_results
from engine import EngineConfig
from engine.workload import SimConfig, read_workload, run_workload
from engine.workload.reference import prefix_sharing
from engine.workload.sweep import FIGURE9_TEXT, format_table, paper_ratio, reference_row, sweep

ROOT = Path(__file__).resolve().parents[1]
FULL = ROOT.parent / "shared" / "traces" / "mooncake"
EXCERPTS = ROOT / "resources" / "workloads"
ARRIVAL_BLOCK = 64
TIME_SCALE = 4.0
AIMS = {"sequential_bs512_s": 60, "sequential_bs16_s": 300, "full_1e6_s": 300, "rss_mb": 2048}


def traces(quick: bool) -> dict[str, Path]:
    if quick or not (FULL / "conversation_trace.jsonl").exists():
        return {
            "conversation": EXCERPTS / "mooncake_conversation_200.jsonl",
            "synthetic": EXCERPTS / "mooncake_synthetic_200.jsonl",
        }
    return {"conversation": FULL / "conversation_trace.jsonl", "synthetic": FULL / "synthetic_trace.jsonl"}


def equality(w, bs: int) -> dict:
    """The engine with a pool that never evicts, one request at a time, against the reference."""
    ref = prefix_sharing(w, bs, 131072)
    t0 = time.perf_counter()
    res = run_workload(w, EngineConfig(block_size=bs, num_gpu_blocks=ref.blocks_allocated), SimConfig(sequential=True))
    return {
        "trace": w.name,
        "block_size": bs,
        "requests": res.requests,
        "skipped_too_long": res.skipped_too_long,
        "prompt_tokens": res.prompt_tokens,
        "engine_cached_tokens": res.cached_tokens,
        "reference_cached_tokens": ref.cached_tokens,
        "equal": res.cached_tokens == ref.cached_tokens,
        "hit_rate": res.hit_rate,
        "paper_table2": paper_ratio(w.name),
        "evictions": res.evictions,
        "num_gpu_blocks": ref.blocks_allocated,
        "seconds": time.perf_counter() - t0,
    }


def timed(args: list[str]) -> dict:
    """``python -m engine.workload ... --json`` in a process of its own: its summary, wall time, peak RSS."""
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "engine.workload", *args, "--json"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    s = json.loads(out.stdout)["workload"]
    return {
        "command": "python -m engine.workload " + " ".join(args),
        "process_s": time.perf_counter() - t0,
        "run_s": s["wall_s"],
        "peak_rss_mb": s["peak_rss_mb"],
        "hit_rate": s["hit_rate"],
        "requests": s["requests"],
        "evictions": s["evictions"],
        "preemptions": s["preemptions"],
        "ttft_p50_s": s["ttft_p50_s"],
        "ttft_p99_s": s["ttft_p99_s"],
    }


def plot_figure9(rows: list[dict], refs: list[dict], quick: bool) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9.5, 5.4))
    colours = {"conversation": "#1f77b4", "synthetic": "#d62728"}
    styles = {"lru": "-", "lfu": "--"}
    for trace, policy in dict.fromkeys((r["trace_key"], r["policy"]) for r in rows):
        pts = [r for r in rows if (r["trace_key"], r["policy"]) == (trace, policy)]
        c = colours[trace]
        ax.plot(
            [r["kv_tokens"] for r in pts],
            [r["hit_rate"] for r in pts],
            styles[policy],
            color=c,
            label=f"{trace}: kvscope, {policy}",
        )
        for r in pts:
            ax.plot(
                [r["kv_tokens"]],
                [r["hit_rate"]],
                "o",
                color=c,
                markersize=4,
                markerfacecolor="white" if r["skipped_too_big"] else c,
            )
    for ref in refs:
        c = colours[ref["trace_key"]]
        ax.axhline(ref["hit_rate"], color=c, lw=0.8, ls=(0, (5, 3)))
        ax.annotate(
            f"{ref['trace_key']}: its own sharing {ref['hit_rate']:.1%} (reference)",
            (1.1e4, ref["hit_rate"]),
            textcoords="offset points",
            xytext=(0, 3),
            fontsize=7,
            color=c,
        )
        paper = ref["paper_table2"]
        ax.axhline(paper, color=c, lw=0.8, ls=":")
        ax.annotate(
            f"paper, Table 2: {paper:.0%}",
            (1.1e4, paper),
            textcoords="offset points",
            xytext=(0, 3),
            fontsize=7,
            color=c,
            alpha=0.8,
        )
        (x1, _), (x2, _) = FIGURE9_TEXT
        ax.plot([x1], [paper / 2], "v", color=c, markersize=9, alpha=0.6)
        ax.plot([x2], [paper], "o", color=c, markersize=11, markerfacecolor="none")
    ax.plot([], [], "v", color="grey", label="paper (Figure 9's text): under half the maximum at 3M tokens")
    ax.plot([], [], "o", color="grey", markerfacecolor="none", label="paper (Figure 9's text): nearly it at 50M")
    ax.plot([], [], "o", color="grey", markerfacecolor="white", label="hollow: prompts bigger than the pool skipped")
    ax.set_xscale("log")
    ax.set_ylim(0, 0.8)
    ax.set_xlabel("KV cache capacity, tokens (block size 512)")
    ax.set_ylabel("hit rate: cached prompt tokens / prompt tokens")
    ax.set_title("Mooncake's traces, one request at a time (Figure 9's assumption)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower left", bbox_to_anchor=(0.005, 0.19))  # under the ceilings, over no point
    save_figure(fig, "workloads", quick)


def plot_arrivals(rows: list[dict], seq_rows: list[dict], quick: bool) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 7))
    colours = {"conversation": "#1f77b4", "synthetic": "#d62728"}
    lines = [  # (time scale, at once, policy, style, marker, label)
        (TIME_SCALE, 64, "lru", "-", "o", f"1/{TIME_SCALE:g} rate, 64 at once, lru"),
        (TIME_SCALE, 64, "lfu", "--", "o", f"1/{TIME_SCALE:g} rate, 64 at once, lfu"),
        (TIME_SCALE, 256, "lru", "-", "s", f"1/{TIME_SCALE:g} rate, 256 at once, lru"),
        (1.0, 64, "lru", "-.", "^", "real rate, 64 at once, lru"),
        (1.0, 256, "lru", ":", "v", "real rate, 256 at once, lru"),
    ]
    for trace, c in colours.items():
        seq = [
            r
            for r in seq_rows
            if r["trace_key"] == trace
            and r["policy"] == "lru"
            and r["kv_tokens"] >= min((x["kv_tokens"] for x in rows), default=0)
        ]
        if seq:
            axes[0].plot(
                [r["kv_tokens"] for r in seq],
                [r["hit_rate"] for r in seq],
                color=c,
                lw=4,
                alpha=0.25,
                label=f"{trace}: one at a time (Figure 9's mode)",
            )
        for scale, seqs, policy, ls, mk, label in lines:
            pts = [
                r
                for r in rows
                if (r["trace_key"], r["time_scale"], r["max_num_seqs"], r["policy"]) == (trace, scale, seqs, policy)
            ]
            if not pts:
                continue
            x = [r["kv_tokens"] for r in pts]
            axes[0].plot(
                x, [r["hit_rate"] for r in pts], ls, color=c, marker=mk, markersize=4, label=f"{trace}: {label}"
            )
            if policy == "lru":
                axes[1].plot(
                    x, [r["ttft_p50_s"] for r in pts], ls, color=c, marker=mk, markersize=4, label=f"{trace}: {label}"
                )
    for ax in axes:
        ax.set_xscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.set_xlabel(f"KV pool, tokens (block size {ARRIVAL_BLOCK})")
    axes[0].set_ylabel("hit rate")
    axes[0].set_title("with arrival times (blocks in use cannot be evicted)", fontsize=10)
    axes[0].legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)  # below: over no line
    axes[1].set_yscale("log")
    axes[1].set_ylabel("TTFT p50, s (virtual clock)")
    axes[1].set_title("llama-3.1-8b on one simulated H100", fontsize=10)
    axes[1].legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
    save_figure(fig, "workloads_arrivals", quick)


def run(quick: bool) -> dict:
    paths = traces(quick)
    full = not quick and paths["conversation"].parent == FULL
    loaded = {k: read_workload(p) for k, p in paths.items()}
    t0 = time.perf_counter()

    # 1-2: the reference, and the engine with a pool that never evicts
    eq_sizes = (
        {"conversation": (512, 16), "synthetic": (512, 16)}
        if full
        else {"conversation": (512, 16), "synthetic": (512,)}
    )
    eq_rows = [dict(equality(w, bs), trace_key=k) for k, w in loaded.items() for bs in eq_sizes[k]]
    print(
        table(
            eq_rows,
            [
                ("trace_key", "trace", ""),
                ("block_size", "block", "d"),
                ("requests", "requests", "d"),
                ("hit_rate", "engine = reference", ".2%"),
                ("equal", "equal", ""),
                ("paper_table2", "paper (Table 2)", ".0%"),
                ("seconds", "s", ".1f"),
            ],
        ),
        flush=True,
    )
    assert all(r["equal"] for r in eq_rows), "the engine's hits differ from the reference"

    # 3: Figure 9, one request at a time
    caps = [1e4, 1e5, 1e6, 3e6, 1e7, 5e7, 1e8] if full else [2e4, 1e5, 1e6, 3e6]
    cfg512, seq = EngineConfig(block_size=512), SimConfig(sequential=True)
    refs, seq_rows = [], []
    for k, w in loaded.items():
        ref = dict(reference_row(w, cfg512, seq), trace_key=k, paper_table2=paper_ratio(k))
        refs.append(ref)
        seq_rows += [dict(r, trace_key=k) for r in sweep(w, caps, ("lru", "lfu"), cfg512, seq, reference=ref)]
    print(format_table(seq_rows), flush=True)
    plot_figure9(seq_rows, refs, quick)
    for ref in refs:  # the paper's statements, checked on kvscope's lru curve
        lru = {r["kv_tokens_asked"]: r for r in seq_rows if r["trace_key"] == ref["trace_key"] and r["policy"] == "lru"}
        ref["of_max_at_3e6"] = lru[3e6]["of_max"] if 3e6 in lru else None
        ref["of_max_at_5e7"] = lru[5e7]["of_max"] if 5e7 in lru else None

    # 4: with arrivals, concurrency and preemption: at a quarter of the traces' rate one card keeps up; at their
    # real rate (a cluster's traffic) it cannot, so the queue grows and the running requests reach the cap
    grid = ((TIME_SCALE, [1e6, 3e6, 1e7, 5e7, 1e8] if full else [1e5]), (1.0, [1e6, 1e7] if full else [1e5]))
    arr_rows = []
    for k, w in loaded.items():
        if quick:
            w = read_workload(paths[k], limit=40)
        arr_ref = reference_row(w, EngineConfig(block_size=ARRIVAL_BLOCK), SimConfig())  # of_max at this block size
        for scale, arr_caps in grid:
            for seqs in (64, 256):
                cfg = EngineConfig(block_size=ARRIVAL_BLOCK, max_num_seqs=seqs)
                sim = SimConfig(time_scale=scale)
                for r in sweep(w, arr_caps, ("lru", "lfu"), cfg, sim, reference=arr_ref):
                    arr_rows.append(dict(r, trace_key=k, max_num_seqs=seqs, time_scale=scale))
                    print(
                        f"  arrivals: {k} at 1/{scale:g} rate, {seqs} at once, {r['policy']} at "
                        f"{r['kv_tokens']:.0e}: hit rate {r['hit_rate']:.1%}, {r['wall_s']:.0f} s",
                        flush=True,
                    )
    cols = [
        ("trace_key", "trace", ""),
        ("time_scale", "time x", "g"),
        ("max_num_seqs", "at once", "d"),
        ("policy", "policy", ""),
        ("kv_tokens", "KV tokens", ".0e"),
        ("hit_rate", "hit rate", ".1%"),
        ("evictions", "evictions", ","),
        ("preemptions", "preemptions", ","),
        ("peak_running", "peak running", "d"),
        ("peak_waiting", "peak waiting", "d"),
        ("ttft_p50_s", "TTFT p50 s", ".3g"),
        ("ttft_p99_s", "TTFT p99 s", ".3g"),
        ("utilization", "card busy", ".0%"),
        ("wall_s", "wall s", ".0f"),
    ]
    print(table(arr_rows, cols), flush=True)
    plot_arrivals(arr_rows, seq_rows, quick)

    # 5: speed, each in a process of its own
    conv = str(paths["conversation"])
    speed = []
    if full:
        for label, args, aim in (
            (
                "sequential, block 512, 1e7 tokens",
                [conv, "--block-size", "512", "--kv-tokens", "1e7", "--sequential"],
                AIMS["sequential_bs512_s"],
            ),
            (
                "sequential, block 16, 1e7 tokens",
                [conv, "--block-size", "16", "--kv-tokens", "1e7", "--sequential"],
                AIMS["sequential_bs16_s"],
            ),
            (
                "full mode, block 16, 1e6 tokens, 64 at once",
                [conv, "--block-size", "16", "--kv-tokens", "1e6"],
                AIMS["full_1e6_s"],
            ),
        ):
            r = dict(timed(args), what=label, aim_s=aim, load_before=os.getloadavg()[0])  # others' work slows it
            r["met"] = r["process_s"] <= aim and r["peak_rss_mb"] <= AIMS["rss_mb"]
            speed.append(r)
            print(f"  speed: {label}: {r['process_s']:.1f} s (aim {aim} s), {r['peak_rss_mb']:.0f} MB", flush=True)
    result = {
        "traces": {
            k: str(p.relative_to(ROOT.parent) if p.is_relative_to(ROOT.parent) else p) for k, p in paths.items()
        },
        "requests": {k: len(w.requests) for k, w in loaded.items()},
        "prompt_tokens": {k: w.prompt_tokens for k, w in loaded.items()},
        "sim": "llama-3.1-8b on h100 (cost model defaults)",
        "arrivals_block_size": ARRIVAL_BLOCK,
        "arrivals_time_scale": TIME_SCALE,
        "equality": eq_rows,
        "reference": refs,
        "rows": seq_rows,
        "arrivals": arr_rows,
        "speed": speed,
        "aims": AIMS,
        "seconds": time.perf_counter() - t0,
    }
    write_results("workloads", result, quick)
    return result


if __name__ == "__main__":
    main(run, __doc__)
