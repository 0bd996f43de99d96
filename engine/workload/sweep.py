"""Hit rate against KV capacity: one run per (capacity, eviction policy), a table and a plot.

The plot has Mooncake's Figure 9 axes (hit rate against cache capacity in tokens, log x). What the
paper gives to compare with, and only that (no value is read off its figure):

- Table 2: the cache ratio of each trace, 40 % (conversation) and 66 % (synthetic): the hit rate
  with unlimited capacity; drawn as a dotted line.
- Figure 9's text: 3 M tokens of cache reach under half of the theoretical maximum, 50 M tokens
  nearly reach it; drawn as a down-triangle at (3 M, half of Table 2's ratio) and a circle at
  (50 M, Table 2's ratio).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

from ..config import EngineConfig
from .driver import SimConfig, run_workload
from .reader import Workload
from .reference import prefix_sharing

PAPER_TABLE2 = {"conversation": 0.40, "synthetic": 0.66}  # Mooncake, Table 2: cache ratio
FIGURE9_TEXT = ((3e6, "under half of the maximum"), (5e7, "nearly the maximum"))
DEFAULT_KV_TOKENS = (1e4, 1e5, 1e6, 3e6, 1e7, 5e7, 1e8)
TABLE_COLUMNS = (
    ("trace", "trace", ""),
    ("policy", "policy", ""),
    ("mode", "mode", ""),
    ("kv_tokens", "KV tokens", ".0e"),
    ("requests", "requests", "d"),
    ("skipped", "skipped", "d"),
    ("hit_rate", "hit rate", ".1%"),
    ("of_max", "of max", ".0%"),
    ("evictions", "evictions", ","),
    ("preemptions", "preempt", "d"),
    ("ttft_p50_s", "TTFT p50 s", ".3g"),
    ("ttft_p99_s", "TTFT p99 s", ".3g"),
    ("wall_s", "wall s", ".1f"),
)


def paper_ratio(trace: str) -> float | None:
    """Table 2's cache ratio for a trace named like Mooncake's files (conversation_trace, synthetic_trace, or an
    excerpt of one: mooncake_conversation_200)."""
    for key, ratio in PAPER_TABLE2.items():
        if key in trace.lower():
            return ratio
    return None


def reference_row(workload: Workload, config: EngineConfig | None = None, sim: SimConfig | None = None) -> dict:
    """The infinite-pool reference (reference.py) with the run's block size and context length."""
    config, sim = config or EngineConfig(), sim or SimConfig()
    ctx = sim.cost_model(config).model.context_length
    ref = prefix_sharing(workload, config.block_size, min(ctx, config.max_model_len or ctx))
    return {
        "trace": workload.name,
        "block_size": config.block_size,
        "requests": ref.requests,
        "prompt_tokens": ref.prompt_tokens,
        "cached_tokens": ref.cached_tokens,
        "hit_rate": ref.hit_rate,
        "blocks_to_never_evict": ref.blocks_allocated,
        "paper_table2": paper_ratio(workload.name),
    }


def sweep(
    workload: Workload,
    kv_tokens: Sequence[float] = DEFAULT_KV_TOKENS,
    policies: Sequence[str] = ("lru",),
    config: EngineConfig | None = None,
    sim: SimConfig | None = None,
    progress: Callable[[dict], None] | None = None,
    reference: dict | None = None,
) -> list[dict]:
    """One run per policy and capacity (in tokens); returns a row each: the run's ``summary()`` plus
    ``trace``, ``policy``, ``skipped`` and ``of_max`` (the hit rate over the reference's).
    ``progress(row)`` hears of each row as it is made."""
    config, sim = config or EngineConfig(), sim or SimConfig()
    ref = reference or reference_row(workload, config, sim)
    rows = []
    for policy in policies:
        for cap in kv_tokens:
            res = run_workload(
                workload,
                dataclasses.replace(config, eviction_policy=policy, num_gpu_blocks=None),
                dataclasses.replace(sim, kv_tokens=cap),
            )
            s = res.summary()
            row = {
                "trace": workload.name,
                "policy": policy,
                "kv_tokens_asked": cap,
                **s,
                "skipped": s["skipped_too_long"] + s["skipped_too_big"],
                "of_max": s["hit_rate"] / ref["hit_rate"] if ref["hit_rate"] else None,
            }
            rows.append(row)
            if progress is not None:
                progress(row)
    return rows


def format_table(rows: Sequence[dict], columns=TABLE_COLUMNS) -> str:
    """Markdown, one row per run; a missing value is a dash."""
    lines = [
        "| " + " | ".join(h for _, h, _ in columns) + " |",
        "|" + "|".join("---" if not f else "---:" for _, _, f in columns) + "|",
    ]
    for r in rows:
        cells = []
        for key, _, fmt in columns:
            v = r.get(key)
            cells.append("-" if v is None else format(v, fmt) if fmt and isinstance(v, (int, float)) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_sweep(
    rows: Sequence[dict],
    path: str | Path,
    references: Sequence[dict] = (),
    paper: bool = True,
    title: str = "Prefix-cache hit rate against KV capacity",
) -> Path:
    """Hit rate against capacity in tokens (log x): one line per (trace, policy, mode); each trace's
    reference (its own prefix sharing, dashed) and, with ``paper``, Mooncake's Table 2 ratio (dotted)
    and Figure 9's two statements (markers). A point where requests were skipped (bigger than the
    whole pool) is hollow. Returns the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, ax = plt.subplots(figsize=(9, 5.2))
    traces = list(dict.fromkeys(r["trace"] for r in rows))
    colours = dict(zip(traces, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4))
    styles = ["-", "--", "-.", ":"]
    series = list(dict.fromkeys((r["trace"], r["policy"], r["mode"]) for r in rows))
    kinds = list(dict.fromkeys((p, m) for _, p, m in series))
    for trace, policy, mode in series:
        pts = sorted(
            (r["kv_tokens"], r["hit_rate"], r.get("skipped_too_big", 0))
            for r in rows
            if (r["trace"], r["policy"], r["mode"]) == (trace, policy, mode)
        )
        c, ls = colours[trace], styles[kinds.index((policy, mode)) % len(styles)]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], ls, color=c, label=f"{trace}: {policy}, {mode}")
        for x, y, skipped in pts:
            ax.plot([x], [y], "o", color=c, markerfacecolor="white" if skipped else c, markersize=5)
    xs = [r["kv_tokens"] for r in rows] or [1e4, 1e8]
    for ref in references:
        c = colours.get(ref["trace"], "grey")
        ax.axhline(ref["hit_rate"], color=c, lw=0.8, ls=(0, (5, 3)))
        ax.annotate(
            f"{ref['trace']}: its own sharing {ref['hit_rate']:.1%}",
            (min(xs), ref["hit_rate"]),
            textcoords="offset points",
            xytext=(2, 3),
            fontsize=7,
            color=c,
        )
    if paper:
        for trace in traces:
            ratio = paper_ratio(trace)
            if ratio is None:
                continue
            c = colours[trace]
            ax.axhline(ratio, color=c, lw=0.8, ls=":")
            ax.annotate(
                f"paper, Table 2: {ratio:.0%}",
                (max(xs), ratio),
                textcoords="offset points",
                xytext=(-90, 3),
                fontsize=7,
                color=c,
            )
            (x1, _), (x2, _) = FIGURE9_TEXT
            ax.plot([x1], [ratio / 2], "v", color=c, markersize=8, alpha=0.6)
            ax.plot([x2], [ratio], "o", color=c, markersize=10, markerfacecolor="none", alpha=0.8)
        ax.plot([], [], "v", color="grey", label="paper, Figure 9's text: under half the maximum at 3M")
        ax.plot([], [], "o", color="grey", markerfacecolor="none", label="paper, Figure 9's text: nearly it at 50M")
    ax.set_xscale("log")
    ax.set_xlabel("KV cache capacity, tokens")
    ax.set_ylabel("prefix-cache hit rate (cached prompt tokens / prompt tokens)")
    ax.set_ylim(0, 1 if not rows else min(1.0, max(0.75, max(r["hit_rate"] for r in rows) + 0.1)))
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
