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
import itertools
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

FULL = dict(hidden=4096, heads=32, kv_heads=32, head_dim=128, inter=11008, tokens=[1, 64, 2048],
            decode=[(8, 32768), (64, 512), (1, 4096)], prefill=2048, block_size=16)
TINY = dict(hidden=96, heads=4, kv_heads=2, head_dim=32, inter=80, tokens=[1, 3],
            decode=[(2, 600), (3, 40)], prefill=40, block_size=16)


class Timer:
    """Median milliseconds of a call: ``do_bench`` on CUDA, one wall-clock run (after a warm-up) elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, fn: Callable[[], object]) -> float:
        if self.device.type == "cuda":
            import triton.testing
            return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


def row(op: str, shape: str, fused_ms: float, unfused_ms: float | None, nbytes: float | None = None,
        flops: float | None = None, peak_gbs: float | None = None, **extra) -> dict:
    r = {"op": op, "shape": shape, "fused_us": fused_ms * 1e3,
         "unfused_us": None if unfused_ms is None else unfused_ms * 1e3,
         "speedup": None if unfused_ms is None else unfused_ms / fused_ms}
    if nbytes is not None:
        r["gbs"] = nbytes / fused_ms / 1e6
        r["peak_frac"] = r["gbs"] / peak_gbs if peak_gbs else None
    if flops is not None:
        r["tflops"] = flops / fused_ms / 1e9
    r.update(extra)
    return r


# -- the fused ops -------------------------------------------------------------------------------
def bench_norm(timer: Timer, s: dict, t: int, dtype, dev, peak: float) -> dict:
    h = s["hidden"]
    x, res = torch.randn(t, h, device=dev, dtype=dtype), torch.randn(t, h, device=dev, dtype=dtype)
    norm = RMSNorm(torch.rand(h, device=dev, dtype=dtype), 1e-5)
    fused = timer(lambda: fused_ops.fused_add_rms_norm(x, res, norm.weight, 1e-5))
    unfused = timer(lambda: norm(res + x))
    return row("fused_add_rms_norm", f"T={t} H={h}", fused, unfused, (4 * t * h + h) * x.element_size(),
               peak_gbs=peak)


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

    fused = timer(lambda: fused_ops.rope_and_store(q, k, v, cache, positions, kc, vc, slots))
    nbytes = t * (2 * hq + 4 * hk + d) * d * qkv.element_size()  # q in and out, k and v in and out, cos/sin
    return row("rope_and_store", f"T={t} {hq}x{d} q, {hk} kv", fused, timer(unfused), nbytes, peak_gbs=peak)


def bench_silu(timer: Timer, s: dict, t: int, dtype, dev, peak: float) -> dict:
    i = s["inter"]
    gate_up = torch.randn(t, 2 * i, device=dev, dtype=dtype)

    def unfused() -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    fused = timer(lambda: fused_ops.silu_and_mul(gate_up))
    return row("silu_and_mul", f"T={t} I={i}", fused, timer(unfused), 3 * t * i * gate_up.element_size(),
               peak_gbs=peak)


# -- attention -----------------------------------------------------------------------------------
def decode_meta(batch: int, ctx: int, bs: int, num_blocks: int, dev) -> AttentionMetadata:
    """``batch`` decodes of ``ctx`` tokens each, their blocks drawn at random from the pool."""
    per = -(-ctx // bs)
    tables = torch.randperm(num_blocks, device=dev)[: batch * per].view(batch, per)
    lens = [ctx] * batch
    rows = torch.arange(batch, device=dev)
    slots = tables[:, (ctx - 1) // bs] * bs + (ctx - 1) % bs
    return AttentionMetadata(slots, tables, torch.tensor(lens, device=dev), list(range(batch + 1)), lens, bs,
                             rows, rows, [])


def bench_decode(timer: Timer, s: dict, dtype, dev, peak: float, kv) -> list[dict]:
    hq, hk, d, bs = s["heads"], s["kv_heads"], s["head_dim"], s["block_size"]
    kc, vc = kv
    out = []
    for batch, ctx in s["decode"]:
        meta = decode_meta(batch, ctx, bs, kc.shape[0], dev)
        q = torch.randn(batch, hq, d, device=dev, dtype=dtype)
        nbytes = 2 * batch * ctx * hk * d * kc.element_size() + 2 * q.numel() * q.element_size()
        scale = d ** -0.5
        splits = triton_paged.decode_splits(batch, hk, meta.block_tables.shape[1] * bs, dev)
        fused = timer(lambda: triton_paged.paged_attention(q, kc, vc, meta, scale))  # noqa: B023
        one = timer(lambda: triton_paged.paged_attention(q, kc, vc, meta, scale, num_splits=1))  # noqa: B023
        ref = timer(lambda: torch_ref.paged_attention(q, kc, vc, meta, scale))  # noqa: B023
        out.append(row("decode_attention", f"B={batch} ctx={ctx}", fused, ref, nbytes, peak_gbs=peak, splits=splits,
                       no_split_us=one * 1e3, no_split_peak_frac=nbytes / one / 1e6 / peak if peak else None))
    return out


def sweep_decode(timer: Timer, s: dict, dtype, dev, peak: float, kv) -> list[dict]:
    """Decode tile, warps and stages: the best per shape is what ``TUNING`` should say."""
    hq, hk, d, bs = s["heads"], s["kv_heads"], s["head_dim"], s["block_size"]
    kc, vc = kv
    saved = dict(triton_paged.TUNING)
    rows = []
    try:
        for batch, ctx in s["decode"]:
            meta = decode_meta(batch, ctx, bs, kc.shape[0], dev)
            q = torch.randn(batch, hq, d, device=dev, dtype=dtype)
            nbytes = 2 * batch * ctx * hk * d * kc.element_size()
            for block_n, warps, stages, waves in itertools.product((64, 128), (4, 8), (1, 2, 3), (2, 4, 8)):
                if block_n == 128 and warps == 4 or (waves != 4 and (block_n, warps, stages) != (64, 4, 2)):
                    continue  # 128-token tiles need 8 warps; the wave count is swept at the default tile
                triton_paged.TUNING.update(decode_block_n=block_n, decode_warps=warps, decode_stages=stages,
                                           split_waves=waves)
                ms = timer(lambda: triton_paged.paged_attention(q, kc, vc, meta, d ** -0.5))  # noqa: B023
                rows.append(dict(shape=f"B={batch} ctx={ctx}", block_n=block_n, warps=warps, stages=stages,
                                 waves=waves, us=ms * 1e3, peak_frac=nbytes / ms / 1e6 / peak if peak else None))
    finally:
        triton_paged.TUNING.clear()
        triton_paged.TUNING.update(saved)
    return rows


def bench_prefill(timer: Timer, s: dict, dtype, dev, kv) -> dict:
    hq, d, bs, n = s["heads"], s["head_dim"], s["block_size"], s["prefill"]
    kc, vc = kv
    per = -(-n // bs)
    table = torch.randperm(kc.shape[0], device=dev)[:per][None]
    slots = (table[0, torch.arange(n, device=dev) // bs] * bs + torch.arange(n, device=dev) % bs)
    meta = AttentionMetadata(slots, table, torch.tensor([n], device=dev), [0, n], [n], bs,
                             torch.zeros(0, dtype=torch.long, device=dev), torch.zeros(0, dtype=torch.long, device=dev),
                             [0])
    q = torch.randn(n, hq, d, device=dev, dtype=dtype)
    flops = 4 * hq * d * n * (n + 1) / 2  # QK^T and PV, causal
    fused = timer(lambda: triton_paged.paged_attention(q, kc, vc, meta, d ** -0.5))
    ref = timer(lambda: torch_ref.paged_attention(q, kc, vc, meta, d ** -0.5))
    return row("prefill_attention", f"one prompt of {n}", fused, ref, flops=flops)


# -- report --------------------------------------------------------------------------------------
def _cell(r: dict) -> Callable[[str, str], str]:
    return lambda key, fmt: "" if r.get(key) is None else format(r[key], fmt)


def table(rows: list[dict]) -> str:
    lines = ["| op | shape | fused/Triton us | unfused/torch us | speedup | GB/s | of peak | TFLOP/s | note |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        f = _cell(r)
        note = ""
        if "splits" in r:
            note = f"{r['splits']} splits; 1 split: {r['no_split_us']:.1f} us"
            if r.get("no_split_peak_frac") is not None:
                note += f" ({r['no_split_peak_frac']:.0%})"
        lines.append(f"| {r['op']} | {r['shape']} | {r['fused_us']:.1f} | {f('unfused_us', '.1f')} | "
                     f"{f('speedup', '.2f')} | {f('gbs', '.0f')} | {f('peak_frac', '.0%')} | {f('tflops', '.1f')} | "
                     f"{note} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (with --device cpu: the interpreter)")
    ap.add_argument("--peak-gbs", type=float, default=4800.0, help="the card's peak HBM bandwidth (H200: 4800)")
    ap.add_argument("--sweep", action="store_true", help="also sweep the decode kernel's launch choices")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "gpu_kernels.json"))
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA here: use --device cpu --tiny for a rehearsal")
    s = TINY if args.tiny else FULL
    dtype = torch.float16
    timer = Timer(dev)
    torch.manual_seed(0)
    rows = []
    for t in s["tokens"]:
        for bench in (bench_norm, bench_rope, bench_silu):
            rows.append(bench(timer, s, t, dtype, dev, args.peak_gbs))
    # One layer's cache, big enough for the largest decode batch: 8 x 32k tokens = 2 x 2 GiB in fp16.
    tokens = max(b * c for b, c in s["decode"])
    nb = tokens // s["block_size"] + 8
    kv = tuple(torch.randn(nb, s["block_size"], s["kv_heads"], s["head_dim"], device=dev, dtype=dtype)
               for _ in range(2))
    rows += bench_decode(timer, s, dtype, dev, args.peak_gbs, kv)
    rows.append(bench_prefill(timer, s, dtype, dev, kv))
    report = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (interpreter)",
              "torch": torch.__version__, "triton": __import__("triton").__version__, "peak_gbs": args.peak_gbs,
              "dtype": str(dtype), "tuning": dict(triton_paged.TUNING), "rows": rows}
    if args.sweep:
        report["decode_sweep"] = sweep_decode(timer, s, dtype, dev, args.peak_gbs, kv)
    print(f"{report['device']}, torch {report['torch']}, triton {report['triton']}, fp16\n")
    print(table(rows))
    for r in report.get("decode_sweep", []):
        frac = "" if r["peak_frac"] is None else f" {r['peak_frac']:.0%}"
        print(f"sweep {r['shape']}: BLOCK_N {r['block_n']} warps {r['warps']} stages {r['stages']} "
              f"waves {r['waves']}: {r['us']:.1f} us{frac}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
