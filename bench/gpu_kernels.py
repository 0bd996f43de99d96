"""Kernel speed on a GPU: the fused ops against their unfused torch ops, and paged attention against the roofline.

    python bench/gpu_kernels.py [--peak-gbs 4800] [--sweep] [--out bench/results/gpu_kernels.json]
    python bench/gpu_kernels.py --device cpu --tiny   # a rehearsal under the Triton interpreter

Llama-2-7B's shapes in fp16 (H 4096, 32 heads of 128, 32 KV heads, I 11008): each fused op
(``engine.runner.fused_ops``) at T = 1, 64, 2048 tokens against the torch ops it replaces (the
medians of ``triton.testing.do_bench``), with the bytes it must move over its time; decode attention
(``triton_paged``) at batch 8 x 32,768, 64 x 512 and 1 x 4,096 tokens of context (block size 16,
shuffled block tables) as GB/s and the fraction of ``--peak-gbs``, beside the same kernel without
split-K and the torch reference; prefill attention over one 2,048-token prompt in TFLOP/s.
``--sweep`` also times the decode kernel's tile, warp and stage choices (``triton_paged.TUNING``).
On the CPU (``--device cpu --tiny``) the shapes are tiny and each op runs once: the numbers mean
nothing, the run checks that the script works end to end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--tiny" in sys.argv and not os.environ.get("TRITON_INTERPRET"):
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine.runner import fused_ops  # noqa: E402
from engine.runner.attention import torch_ref, triton_paged  # noqa: E402
from engine.runner.attention.metadata import AttentionMetadata  # noqa: E402
from engine.runner.models.llama import RMSNorm, rotate_half  # noqa: E402

FULL = dict(
    hidden=4096,
    heads=32,
    kv_heads=32,
    head_dim=128,
    inter=11008,
    tokens=[1, 64, 2048],
    decode=[(8, 32768), (64, 512), (1, 4096)],
    prefill=2048,
    block_size=16,
)
TINY = dict(
    hidden=96,
    heads=4,
    kv_heads=2,
    head_dim=32,
    inter=80,
    tokens=[1, 3],
    decode=[(2, 600), (3, 40)],
    prefill=40,
    block_size=16,
)


class Timer:
    """Median milliseconds of a call on CUDA: ``do_bench`` over a CUDA graph of ``GRAPH_CALLS`` calls
    (what a captured decode step pays: no Python, no launch latency) or, with ``graph=False``, over
    eager calls (Python and launches included). Elsewhere one wall-clock run after a warm-up."""

    GRAPH_CALLS = 10

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, fn: Callable[[], object], graph: bool = True) -> float:
        if self.device.type != "cuda":
            fn()
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        import triton.testing

        if not graph:
            return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # compiles, and warms the allocator outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(self.GRAPH_CALLS):
                fn()
        ms = float(triton.testing.do_bench(g.replay, warmup=10, rep=100, return_mode="median"))
        return ms / self.GRAPH_CALLS


def row(
    op: str,
    shape: str,
    fused_ms: float,
    unfused_ms: float | None,
    nbytes: float | None = None,
    flops: float | None = None,
    peak_gbs: float | None = None,
    **extra,
) -> dict:
    r = {
        "op": op,
        "shape": shape,
        "fused_us": fused_ms * 1e3,
        "unfused_us": None if unfused_ms is None else unfused_ms * 1e3,
        "speedup": None if unfused_ms is None else unfused_ms / fused_ms,
    }
    if nbytes is not None:
        r["gbs"] = nbytes / fused_ms / 1e6
        r["peak_frac"] = r["gbs"] / peak_gbs if peak_gbs else None
    if flops is not None:
        r["tflops"] = flops / fused_ms / 1e9
    r.update(extra)
    return r


# -- the fused ops -------------------------------------------------------------------------------
def with_eager(
    timer: Timer, op: str, shape: str, fused: Callable, unfused: Callable, nbytes: float, peak: float
) -> dict:
    """A row timed in CUDA graphs (the columns), with the eager times beside (Python and launches)."""
    return row(
        op,
        shape,
        timer(fused),
        timer(unfused),
        nbytes,
        peak_gbs=peak,
        fused_eager_us=timer(fused, graph=False) * 1e3,
        unfused_eager_us=timer(unfused, graph=False) * 1e3,
    )


def bench_norm(timer: Timer, s: dict, t: int, dtype, dev, peak: float) -> dict:
    h = s["hidden"]
    x, res = torch.randn(t, h, device=dev, dtype=dtype), torch.randn(t, h, device=dev, dtype=dtype)
    norm = RMSNorm(torch.rand(h, device=dev, dtype=dtype), 1e-5)
    return with_eager(
        timer,
        "fused_add_rms_norm",
        f"T={t} H={h}",
        lambda: fused_ops.fused_add_rms_norm(x, res, norm.weight, 1e-5),
        lambda: norm(res + x),
        (4 * t * h + h) * x.element_size(),
        peak,
    )


def bench_rope(timer: Timer, s: dict, t: int, dtype, dev, peak: float) -> dict:
    hq, hk, d, bs = s["heads"], s["kv_heads"], s["head_dim"], s["block_size"]
    qkv = torch.randn(t, (hq + 2 * hk) * d, device=dev, dtype=dtype)
    q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hk * d, hk * d], dim=-1))
    nb = t // bs + 2
    kc, vc = (torch.zeros(nb, bs, hk, d, device=dev, dtype=dtype) for _ in range(2))
    slots = torch.randperm(nb * bs, device=dev)[:t]
    positions = torch.randint(0, 4096, (t,), device=dev)
    freqs = positions[:, None].float() * (10000.0 ** (-torch.arange(0, d, 2, device=dev).float() / d))
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]
    cos_sin = torch.cat((cos[:, 0, : d // 2], sin[:, 0, : d // 2]), -1)
    cache = torch.zeros(4096, d, device=dev, dtype=dtype)
    cache[positions] = cos_sin  # the positions this run reads; the rest does not matter for timing

    def unfused() -> torch.Tensor:
        qr = q * cos + rotate_half(q) * sin
        kr = k * cos + rotate_half(k) * sin
        triton_paged.store_kv(kr, v, kc, vc, slots)
        return qr

    nbytes = t * ((2 * hq + 4 * hk) * d + d) * qkv.element_size()  # q in and out, k and v in and out, cos/sin
    return with_eager(
        timer,
        "rope_and_store",
        f"T={t} {hq}x{d} q, {hk} kv",
        lambda: fused_ops.rope_and_store(q, k, v, cache, positions, kc, vc, slots),
        unfused,
        nbytes,
        peak,
    )


def bench_silu(timer: Timer, s: dict, t: int, dtype, dev, peak: float) -> dict:
    i = s["inter"]
    gate_up = torch.randn(t, 2 * i, device=dev, dtype=dtype)

    def unfused() -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    return with_eager(
        timer,
        "silu_and_mul",
        f"T={t} I={i}",
        lambda: fused_ops.silu_and_mul(gate_up),
        unfused,
        3 * t * i * gate_up.element_size(),
        peak,
    )


# -- attention -----------------------------------------------------------------------------------
def decode_meta(batch: int, ctx: int, bs: int, num_blocks: int, dev) -> AttentionMetadata:
    """``batch`` decodes of ``ctx`` tokens each, their blocks drawn at random from the pool."""
    per = -(-ctx // bs)
    tables = torch.randperm(num_blocks, device=dev)[: batch * per].view(batch, per)
    lens = [ctx] * batch
    rows = torch.arange(batch, device=dev)
    slots = tables[:, (ctx - 1) // bs] * bs + (ctx - 1) % bs
    return AttentionMetadata(
        slots, tables, torch.tensor(lens, device=dev), list(range(batch + 1)), lens, bs, rows, rows, []
    )


def bench_decode(timer: Timer, s: dict, dtype, dev, peak: float, kv) -> list[dict]:
    hq, hk, d, bs = s["heads"], s["kv_heads"], s["head_dim"], s["block_size"]
    kc, vc = kv
    out = []
    for batch, ctx in s["decode"]:
        meta = decode_meta(batch, ctx, bs, kc.shape[0], dev)
        q = torch.randn(batch, hq, d, device=dev, dtype=dtype)
        nbytes = 2 * batch * ctx * hk * d * kc.element_size() + 2 * q.numel() * q.element_size()
        scale = d**-0.5
        splits = triton_paged.decode_splits(batch, hk, meta.block_tables.shape[1] * bs, dev)
        fused = timer(lambda: triton_paged.paged_attention(q, kc, vc, meta, scale))  # noqa: B023
        one = timer(lambda: triton_paged.paged_attention(q, kc, vc, meta, scale, num_splits=1))  # noqa: B023
        ref = timer(lambda: torch_ref.paged_attention(q, kc, vc, meta, scale), graph=False)  # noqa: B023 (syncs)
        out.append(
            row(
                "decode_attention",
                f"B={batch} ctx={ctx}",
                fused,
                ref,
                nbytes,
                peak_gbs=peak,
                splits=splits,
                no_split_us=one * 1e3,
                no_split_peak_frac=nbytes / one / 1e6 / peak if peak else None,
            )
        )
    return out


# (BLOCK_N, warps, stages, split waves, min split tokens): around the defaults, one knob at a time.
SWEEP = [
    (64, 4, 3, 4, 256),
    (64, 4, 2, 4, 256),
    (32, 4, 3, 4, 256),
    (128, 4, 3, 4, 256),
    (64, 8, 3, 4, 256),
    (64, 4, 3, 2, 256),
    (64, 4, 3, 8, 256),
    (64, 4, 3, 4, 64),
    (64, 4, 3, 4, 128),
    (64, 4, 3, 4, 512),
]


def sweep_decode(timer: Timer, s: dict, dtype, dev, peak: float, kv, seconds: float) -> list[dict]:
    """Decode tile, warps and stages: the best per shape is what ``TUNING`` should say."""
    hq, hk, d, bs = s["heads"], s["kv_heads"], s["head_dim"], s["block_size"]
    kc, vc = kv
    saved = dict(triton_paged.TUNING)
    rows: list[dict] = []
    deadline = time.monotonic() + seconds
    try:
        for batch, ctx in s["decode"]:
            meta = decode_meta(batch, ctx, bs, kc.shape[0], dev)
            q = torch.randn(batch, hq, d, device=dev, dtype=dtype)
            nbytes = 2 * batch * ctx * hk * d * kc.element_size()
            for block_n, warps, stages, waves, min_split in SWEEP:
                if time.monotonic() > deadline:
                    return rows
                triton_paged.TUNING.update(
                    decode_block_n=block_n,
                    decode_warps=warps,
                    decode_stages=stages,
                    split_waves=waves,
                    min_split_tokens=min_split,
                )
                ms = timer(lambda: triton_paged.paged_attention(q, kc, vc, meta, d**-0.5))  # noqa: B023
                rows.append(
                    dict(
                        shape=f"B={batch} ctx={ctx}",
                        block_n=block_n,
                        warps=warps,
                        stages=stages,
                        waves=waves,
                        min_split_tokens=min_split,
                        us=ms * 1e3,
                        peak_frac=nbytes / ms / 1e6 / peak if peak else None,
                    )
                )
                print(f"sweep {rows[-1]}", flush=True)
    finally:
        triton_paged.TUNING.clear()
        triton_paged.TUNING.update(saved)
    return rows


def bench_prefill(timer: Timer, s: dict, dtype, dev, kv) -> dict:
    q, meta, flops = prefill_case(s, dtype, dev, kv)
    kc, vc = kv
    d, n = s["head_dim"], s["prefill"]
    fused = timer(lambda: triton_paged.paged_attention(q, kc, vc, meta, d**-0.5))
    ref = timer(lambda: torch_ref.paged_attention(q, kc, vc, meta, d**-0.5), graph=False)  # it syncs
    return row("prefill_attention", f"one prompt of {n}", fused, ref, flops=flops)


def prefill_case(s: dict, dtype, dev, kv) -> tuple[torch.Tensor, AttentionMetadata, float]:
    hq, d, bs, n = s["heads"], s["head_dim"], s["block_size"], s["prefill"]
    per = -(-n // bs)
    table = torch.randperm(kv[0].shape[0], device=dev)[:per][None]
    slots = table[0, torch.arange(n, device=dev) // bs] * bs + torch.arange(n, device=dev) % bs
    none = torch.zeros(0, dtype=torch.long, device=dev)
    meta = AttentionMetadata(slots, table, torch.tensor([n], device=dev), [0, n], [n], bs, none, none, [0])
    return torch.randn(n, hq, d, device=dev, dtype=dtype), meta, 4 * hq * d * n * (n + 1) / 2


def sweep_prefill(timer: Timer, s: dict, dtype, dev, kv) -> list[dict]:
    """Prefill tiles, warps and stages over the one long prompt."""
    q, meta, flops = prefill_case(s, dtype, dev, kv)
    saved = dict(triton_paged.TUNING)
    rows = []
    try:
        for bm, bn, warps, stages in [
            (128, 64, 8, 3),
            (128, 64, 8, 2),
            (128, 128, 8, 2),
            (128, 32, 4, 3),
            (64, 64, 4, 3),
            (64, 128, 4, 2),
            (128, 64, 4, 3),
        ]:
            triton_paged.TUNING.update(
                prefill_block_m=bm, prefill_block_n=bn, prefill_warps=warps, prefill_stages=stages
            )
            try:
                ms = timer(lambda: triton_paged.paged_attention(q, *kv, meta, s["head_dim"] ** -0.5))
                rows.append(
                    dict(block_m=bm, block_n=bn, warps=warps, stages=stages, us=ms * 1e3, tflops=flops / ms / 1e9)
                )
            except Exception as e:  # noqa: BLE001 - a config out of shared memory, say
                rows.append(dict(block_m=bm, block_n=bn, warps=warps, stages=stages, error=str(e)[:300]))
            print(f"prefill sweep {rows[-1]}", flush=True)
    finally:
        triton_paged.TUNING.clear()
        triton_paged.TUNING.update(saved)
    return rows


# -- report --------------------------------------------------------------------------------------
def section(rows: list[dict], name: str, run: Callable[[], list[dict]]) -> None:
    """Run one benchmark; a failure (a kernel that does not compile here, say) is reported, not fatal."""
    try:
        new = run()
    except Exception as e:  # noqa: BLE001 - the other sections' numbers are still worth having
        new = [{"op": name, "shape": "", "error": f"{type(e).__name__}: {e}"[:2000]}]
    for r in new:
        print(f"row {r}", flush=True)
    rows += new


def _cell(r: dict) -> Callable[[str, str], str]:
    return lambda key, fmt: "" if r.get(key) is None else format(r[key], fmt)


def table(rows: list[dict]) -> str:
    lines = [
        "| op | shape | fused/Triton us | unfused/torch us | speedup | GB/s | of peak | TFLOP/s | note |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        f = _cell(r)
        note = ""
        if "fused_eager_us" in r:
            note = f"eager: {r['fused_eager_us']:.1f} vs {r['unfused_eager_us']:.1f} us"
        if "splits" in r:
            note = f"{r['splits']} splits; 1 split: {r['no_split_us']:.1f} us"
            if r.get("no_split_peak_frac") is not None:
                note += f" ({r['no_split_peak_frac']:.0%})"
        lines.append(
            f"| {r['op']} | {r['shape']} | {r['fused_us']:.1f} | {f('unfused_us', '.1f')} | "
            f"{f('speedup', '.2f')} | {f('gbs', '.0f')} | {f('peak_frac', '.0%')} | {f('tflops', '.1f')} | "
            f"{note} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (with --device cpu: the interpreter)")
    ap.add_argument("--peak-gbs", type=float, default=4800.0, help="the card's peak HBM bandwidth (H200: 4800)")
    ap.add_argument("--sweep", action="store_true", help="also sweep the decode kernel's launch choices")
    ap.add_argument("--sweep-seconds", type=float, default=120.0, help="stop the sweep after this long")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "gpu_kernels.json"))
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA here: use --device cpu --tiny for a rehearsal")
    s = TINY if args.tiny else FULL
    dtype = torch.float16
    timer = Timer(dev)
    torch.manual_seed(0)
    rows: list[dict] = []
    for t in s["tokens"]:
        for bench in (bench_norm, bench_rope, bench_silu):
            section(rows, bench.__name__, lambda: [bench(timer, s, t, dtype, dev, args.peak_gbs)])  # noqa: B023
    # One layer's cache, big enough for the largest decode batch: 8 x 32k tokens = 2 x 2 GiB in fp16.
    tokens = max(b * c for b, c in s["decode"])
    nb = tokens // s["block_size"] + 8
    kv = tuple(
        torch.randn(nb, s["block_size"], s["kv_heads"], s["head_dim"], device=dev, dtype=dtype) for _ in range(2)
    )
    section(rows, "decode", lambda: bench_decode(timer, s, dtype, dev, args.peak_gbs, kv))
    section(rows, "prefill", lambda: [bench_prefill(timer, s, dtype, dev, kv)])
    report = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (interpreter)",
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "peak_gbs": args.peak_gbs,
        "dtype": str(dtype),
        "tuning": dict(triton_paged.TUNING),
        "rows": rows,
    }
    if args.sweep:
        report["decode_sweep"] = sweep_decode(timer, s, dtype, dev, args.peak_gbs, kv, args.sweep_seconds)
        report["prefill_sweep"] = sweep_prefill(timer, s, dtype, dev, kv)
    print(f"{report['device']}, torch {report['torch']}, triton {report['triton']}, fp16\n")
    print(table([r for r in rows if "error" not in r]))
    for r in rows:
        if "error" in r:
            print(f"FAILED {r['op']}: {r['error']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    if any("error" in r for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
