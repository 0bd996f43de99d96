"""The roofline of the acceptance run's decode and prefill, drawn from its report (here, not on the card).

    python bench/gpu_roofline.py [--report bench/results/gpu_report.json] [--out bench/results/gpu_roofline.png]

x: arithmetic intensity (FLOPs a step over the bytes it must read: the weights but the embedding table, the
KV of every context); y: achieved TFLOP/s. The roof: the card's datasheet bandwidth times the intensity,
capped by its dense fp16 rate; where a point sits under the slanted roof, the gap is memory traffic lost
(launch gaps, host time, small kernels), under the flat one, arithmetic. Decode rows of every variant, the
2,048-token prefill, and the long-context attention kernel alone.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
# Llama-2-7B's shapes (the run's model): linear weights a token multiplies, and the KV bytes a context token
# holds (32 layers x K and V x 4,096 x fp16).
LINEAR_PARAMS = 32 * (4096 * 3 * 4096 + 4096 * 4096 + 3 * 4096 * 11008) + 32000 * 4096
KV_TOKEN_BYTES = 32 * 2 * 4096 * 2
PROMPT, NEW = 128, 128


def decode_point(row: dict) -> tuple[float, float]:
    """(FLOP/byte, TFLOP/s) of a decode row: batch b, contexts PROMPT..PROMPT+NEW (mean in the middle)."""
    b, step_s = row["batch"], row["step_ms"] / 1e3
    ctx = PROMPT + NEW / 2
    flops = 2 * LINEAR_PARAMS * b + 4 * b * ctx * 4096 * 32  # matmuls + attention (QK and PV)
    read = 2 * LINEAR_PARAMS + KV_TOKEN_BYTES * b * ctx
    return flops / read, flops / step_s / 1e12


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--report", default=str(RESULTS / "gpu_report.json"))
    ap.add_argument("--out", default=str(RESULTS / "gpu_roofline.png"))
    args = ap.parse_args()
    report = json.loads(Path(args.report).read_text())
    card = report["card"]
    gbs, tflops = card.get("peak_gbs") or 4800, card.get("peak_tflops") or 989.5
    decode = next(s for s in report["sections"] if s["name"] == "decode")["data"]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.6), dpi=120)
    xs = [10 ** (i / 20) for i in range(-20, 101)]
    ax.plot(
        xs,
        [min(tflops, x * gbs / 1e3) for x in xs],
        color="black",
        lw=1.5,
        label=f"roof: {gbs:,.0f} GB/s, {tflops:g} TFLOP/s (datasheet)",
    )
    styles = {
        "graphs + fused kernels": ("o", "#1f77b4"),
        "graphs, ops unfused": ("s", "#ff7f0e"),
        "eager, ops unfused": ("^", "#7f7f7f"),
    }
    for variant, (marker, color) in styles.items():
        rows = [r for r in decode.get("decode", []) if r["variant"] == variant]
        if not rows:
            continue
        pts = [decode_point(r) for r in rows]
        ax.plot(
            [p[0] for p in pts], [p[1] for p in pts], marker=marker, color=color, ls=":", label=f"decode, {variant}"
        )
        for r, (x, y) in zip(rows, pts):
            ax.annotate(
                f"b={r['batch']}: {r['frac']:.0%}" if r.get("frac") else f"b={r['batch']}",
                (x, y),
                textcoords="offset points",
                xytext=(6, -12),
                fontsize=9,
                color=color,
            )
    pf = decode.get("prefill")
    if pf:
        n = pf["tokens"]
        x = (2 * LINEAR_PARAMS * n + 2 * n * n * 4096 * 32) / (2 * LINEAR_PARAMS + KV_TOKEN_BYTES * n)
        ax.plot(
            [x],
            [pf["tflops"]],
            marker="*",
            ms=14,
            color="#2ca02c",
            ls="",
            label=f"prefill, {n} tokens: {pf['tflops'] / tflops:.0%} of the flat roof",
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per byte read)", fontsize=11)
    ax.set_ylabel("achieved TFLOP/s", fontsize=11)
    ax.set_title(f"kvscope on {card['name']}: random Llama-2-7B weights, fp16", fontsize=12)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=9, loc="upper left")
    fig.tight_layout()
    fig.savefig(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
