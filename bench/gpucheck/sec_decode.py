"""Section decode (issue 29): a GPU step profiled, decode against the memory roofline, prefill against the
tensor-core peak, chunked prefill mixed into decode, and the attention kernel alone at long context.

Decode: random Llama-2-7B weights in fp16, prompts of 128 tokens, 128 new tokens each; the decode steps are
timed alone (after every prompt is prefilled), ``LLMEngine.step`` whole (host work included). Bytes a step
must read: every weight but the embedding table (one row a sequence), plus the KV of every context; over the
step's time, as a fraction of the card's datasheet bandwidth. Beside it: the same with the fused kernels
off, and eager (no CUDA graphs), so the levers show one by one; transformers' ``generate`` on the same
weights. The profile: ``torch.profiler`` over a few decode steps, kernels summed by name, the GPU's busy
time against the step's, the host's syncs counted.
"""

from __future__ import annotations

import gc
import json
import statistics
import subprocess
import sys
import time

import torch

from .shared import ROOT, Ctx, Section, Table, card, random_hf, random_native, sync

PROMPT, NEW, HF_NEW = 128, 128, 16
BLOCK = 16


def new_engine(model, max_seqs: int, max_len: int, blocks: int | None = None, **kw):
    from engine import LLMEngine

    blocks = blocks or max_seqs * -(-max_len // BLOCK) + 8
    # The Triton backend also in the rehearsal (its interpreter, slow): the fused kernels the card compiles, run
    # once here; the unfused baselines take PyTorch's path there.
    on_cpu = next(model.parameters()).device.type == "cpu"
    kw.setdefault("attention_backend", "torch" if on_cpu and kw.get("fuse_ops") is False else "triton")
    return LLMEngine.from_model(
        model,
        None,
        name="random llama-2-7b",
        max_num_seqs=max_seqs,
        max_model_len=max_len,
        block_size=BLOCK,
        num_gpu_blocks=blocks,
        **kw,
    )


def read_bytes(model) -> int:
    """Weights a decode step reads: all of them but the embedding table."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)


def prefill_all(engine, prompts, max_tokens):
    from engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()
    ):
        engine.step()
    return ids


def decode_run(engine, prompts, max_tokens, device) -> dict:
    """Every prompt prefilled, then the decode steps timed alone."""
    prefill_all(engine, prompts, max_tokens)
    sync(device)
    steps, kv_tokens = 0, 0
    t0 = time.perf_counter()
    while engine.has_unfinished():
        kv_tokens += sum(r.num_tokens for r in engine.scheduler.running)
        engine.step()
        steps += 1
    sync(device)
    return {"seconds": time.perf_counter() - t0, "steps": steps, "kv_tokens": kv_tokens}


def hf_run(hf, prompts, new: int, device) -> float:
    ids = torch.tensor(prompts, device=device)
    with torch.inference_mode():
        hf.generate(ids[:, :8], attention_mask=torch.ones_like(ids[:, :8]), max_new_tokens=2, do_sample=False)
        sync(device)
        t0 = time.perf_counter()
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False)
        sync(device)
    return len(prompts) * new / (time.perf_counter() - t0)


def profile(engine, prompts, steps: int, device) -> dict:
    """Kernels by name over ``steps`` decode steps, the GPU's busy time against the wall, syncs a step."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    prefill_all(engine, prompts, steps + 8)
    for _ in range(3):
        engine.step()
    sync(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync(device)
        wall = time.perf_counter() - t0
    while engine.has_unfinished():
        engine.step()
    kernels, syncs, copies = {}, 0, 0
    for e in prof.key_averages():
        dev = getattr(e, "self_device_time_total", None)
        if dev is None:
            dev = getattr(e, "self_cuda_time_total", 0)
        if dev and e.key not in ("cudaGraphLaunch",) and not e.key.startswith(("aten::", "cuda")):
            kernels[e.key] = (e.count, dev)
        if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"):
            syncs += e.count
        if e.key in ("aten::_local_scalar_dense", "aten::item"):
            syncs += e.count if e.key == "aten::_local_scalar_dense" else 0
        if e.key == "cudaMemcpyAsync":
            copies += e.count
    busy_us = sum(t for _, t in kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:12]
    return {
        "steps": steps,
        "wall_ms": wall * 1e3 / steps,
        "gpu_busy_ms": busy_us / 1e3 / steps,
        "kernels_per_step": sum(c for c, _ in kernels.values()) / steps,
        "syncs_per_step": syncs / steps,
        "copies_per_step": copies / steps,
        "top": [
            {"kernel": k[:70], "calls": c / steps, "us": t / steps, "share": t / max(busy_us, 1)} for k, (c, t) in top
        ],
    }


def prefill_time(engine, vocab: int, n: int, reps: int, device) -> float:
    """Median seconds of the one step that prefills an ``n``-token prompt (nothing cached)."""
    from engine import SamplingParams

    g = torch.Generator().manual_seed(7)
    times = []
    for _ in range(reps + 1):
        engine.add_request(torch.randint(1, vocab, (n,), generator=g).tolist(), SamplingParams(max_tokens=1))
        sync(device)
        t0 = time.perf_counter()
        engine.step()
        sync(device)
        times.append(time.perf_counter() - t0)
        while engine.has_unfinished():
            engine.step()
    return statistics.median(times[1:])


def mixed_ratio(engine, vocab: int, batch: int, budget: int, long_prompt: int, device, prompt: int = PROMPT) -> dict:
    """Decode steps of ``batch`` requests alone, then with a long prompt's chunks mixed in (``budget`` tokens a
    step): the mixed steps' mean time over the pure steps'."""
    import dataclasses

    from engine import SamplingParams

    engine.scheduler.config = dataclasses.replace(engine.config, max_num_batched_tokens=budget)
    g = torch.Generator().manual_seed(9)
    prompts = torch.randint(1, vocab, (batch, prompt), generator=g).tolist()
    prefill_all(engine, prompts, 400)
    pure = []
    for _ in range(12 if device.type == "cuda" else 4):
        sync(device)
        t0 = time.perf_counter()
        engine.step()
        sync(device)
        pure.append(time.perf_counter() - t0)
    engine.add_request(torch.randint(1, vocab, (long_prompt,), generator=g).tolist(), SamplingParams(max_tokens=1))
    mixed = []
    while engine.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()
    ):
        sync(device)
        t0 = time.perf_counter()
        out = engine.step()
        sync(device)
        if out.num_scheduled_tokens > batch:
            mixed.append(time.perf_counter() - t0)
    for rid in list(engine.requests):
        engine.abort(rid)
    engine.step()
    engine.scheduler.config = engine.config
    p, m = statistics.median(pure[1:]), statistics.mean(mixed) if mixed else float("nan")
    return {
        "budget": budget,
        "batch": batch,
        "pure_ms": p * 1e3,
        "mixed_ms": m * 1e3,
        "ratio": m / p,
        "mixed_steps": len(mixed),
    }


def matmul_tflops(device) -> float | None:
    if device.type != "cuda":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.float16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.float16)
    for _ in range(3):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    sync(device)
    return 10 * 2 * 8192**3 / (time.perf_counter() - t0) / 1e12


def run(ctx: Ctx, section: Section) -> None:
    dev, dtype = ctx.device, ctx.dtype
    info = card()
    peak_gbs, peak_tf = info["peak_gbs"], info["peak_tflops"]
    batches = [1, 16, 64] if not ctx.dry_run else [1, 4]
    prompt, new = (PROMPT, NEW) if not ctx.dry_run else (8, 4)
    model = random_native(ctx.big, dtype, dev)
    vocab = model.lm_head.weight.shape[0]
    w_read = read_bytes(model)
    g = torch.Generator().manual_seed(1)
    prompts = {b: torch.randint(1, vocab, (b, prompt), generator=g).tolist() for b in batches}
    max_len = prompt + new + 16
    rows, profiles = [], {}
    variants = [
        ("graphs + fused kernels", {}),
        ("graphs, ops unfused", {"fuse_ops": False}),
        ("eager, ops unfused", {"fuse_ops": False, "enforce_eager": True}),
    ]
    for label, kw in variants:
        bs = batches if not kw else [b for b in batches if b in ((1, 64, 4) if "graphs" in label else (1,))]
        t0 = time.perf_counter()
        engine = new_engine(model, max(bs), max_len, **kw)
        setup = time.perf_counter() - t0
        kv_token = engine.runner.block_bytes // BLOCK
        for b in bs:
            r = decode_run(engine, prompts[b], new, dev)
            step = r["seconds"] / r["steps"]
            gbs = (w_read * r["steps"] + kv_token * r["kv_tokens"]) / r["seconds"] / 1e9
            rows.append(
                {
                    "variant": label,
                    "batch": b,
                    "tok_s": b * r["steps"] / r["seconds"],
                    "step_ms": step * 1e3,
                    "gbs": gbs,
                    "frac": gbs / peak_gbs if peak_gbs else None,
                    "setup_s": setup,
                }
            )
        if label != variants[2][0]:
            for b in (1, max(bs)) if not ctx.dry_run and not kw else (1,):
                profiles[f"{label}, batch {b}"] = profile(engine, prompts[b], 6 if not ctx.dry_run else 1, dev)
        del engine
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    # Prefill of one 2,048-token prompt, then chunked prefill mixed into decode: an engine of its own (the
    # decode engine's pool is sized for short prompts), a pool for 64 short requests and the long one.
    mb = 64 if not ctx.dry_run else 4
    long_prompt = 2048 if not ctx.dry_run else 24
    blocks = mb * -(-(PROMPT + 400) // BLOCK) + 2 * long_prompt // BLOCK + 8
    engine = new_engine(model, mb + 1, long_prompt + 512, blocks=blocks)
    t = prefill_time(engine, vocab, long_prompt, 3 if not ctx.dry_run else 1, dev)
    lin = sum(
        p.numel()
        for name, p in model.named_parameters()
        if "embed_tokens" not in name and "lm_head" not in name and p.dim() == 2
    )
    cfg = model.config
    flops = 2 * lin * long_prompt + 2 * long_prompt * long_prompt * cfg.hidden_size * cfg.num_hidden_layers
    section.data["prefill"] = {"tokens": long_prompt, "seconds": t, "tflops": flops / t / 1e12}
    budgets = (256,) if not ctx.dry_run else (16,)
    mixed = [mixed_ratio(engine, vocab, mb, budget, long_prompt, dev, prompt) for budget in budgets]
    del engine
    gc.collect()
    # transformers' generate on the same weights (HF_NEW new tokens: it is slow at batch 1).
    del model
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    hf = random_hf(ctx.big, dtype, dev)
    hf_new = HF_NEW if not ctx.dry_run else 4
    for b in batches:
        tok_s = hf_run(hf, prompts[b], hf_new, dev)
        for r in rows:
            if r["batch"] == b:
                r["hf_tok_s"] = tok_s
                r["vs_hf"] = r["tok_s"] / tok_s
    del hf
    gc.collect()
    mm = matmul_tflops(dev)
    kernels = kernel_bench(ctx)  # on the card: the figures bench/gpu_kernels.py took there earlier this session

    section.tables.append(
        Table(
            f"Decode, random Llama-2-7B weights in fp16, {prompt}-token prompts, {new} new tokens; GB/s = weights "
            "(all but the embedding) + every context's KV read per step, over the step",
            [
                ("variant", "variant", ""),
                ("batch", "batch", "d"),
                ("tok_s", "engine tok/s", ",.1f"),
                ("step_ms", "ms a step", ".2f"),
                ("gbs", "GB/s", ",.0f"),
                ("frac", "of peak", "%"),
                ("hf_tok_s", "transformers tok/s", ",.1f"),
                ("vs_hf", "x transformers", ".1f"),
            ],
            rows,
        )
    )
    for name, p in profiles.items():
        section.tables.append(
            Table(
                f"Profile, {name}: {p['wall_ms']:.2f} ms a step, GPU busy {p['gpu_busy_ms']:.2f} ms "
                f"({p['kernels_per_step']:.0f} kernels, {p['syncs_per_step']:.1f} syncs and "
                f"{p['copies_per_step']:.1f} copies a step); the host's gaps {p['wall_ms'] - p['gpu_busy_ms']:.2f} ms",
                [
                    ("kernel", "kernel", ""),
                    ("calls", "calls a step", ".0f"),
                    ("us", "µs a step", ",.1f"),
                    ("share", "of GPU time", "%"),
                ],
                p["top"],
            )
        )
    pf = section.data["prefill"]
    section.tables.append(
        Table(
            "Prefill of one prompt (one step), and chunked prefill mixed into decode",
            [("what", "what", ""), ("value", "value", "")],
            [
                {
                    "what": f"{pf['tokens']}-token prompt",
                    "value": f"{pf['seconds'] * 1e3:.1f} ms, {pf['tflops']:.0f} TFLOP/s"
                    + (f" = {pf['tflops'] / peak_tf:.0%} of the datasheet's {peak_tf} (fp16 dense)" if peak_tf else "")
                    + (f", {pf['tflops'] / mm:.0%} of an 8192³ fp16 matmul here ({mm:.0f})" if mm else ""),
                }
            ]
            + [
                {
                    "what": f"{m['batch']} decoding + a {long_prompt}-token prompt, {m['budget']} tokens a step",
                    "value": f"pure decode {m['pure_ms']:.2f} ms, mixed {m['mixed_ms']:.2f} ms: {m['ratio']:.2f}x "
                    f"({m['mixed_steps']} mixed steps)",
                }
                for m in mixed
            ],
        )
    )
    if kernels and kernels.get("rows"):
        where = f" (from {kernels['from']}, this card's earlier run)" if kernels.get("from") else ""
        section.tables.append(
            Table(
                f"Kernels alone (bench/gpu_kernels.py, do_bench medians{where}): fused against the PyTorch ops they "
                "replace; attention against the reference",
                [
                    ("op", "op", ""),
                    ("shape", "shape", ""),
                    ("fused_us", "µs", ",.1f"),
                    ("unfused_us", "unfused µs", ",.1f"),
                    ("speedup", "speed-up", ".1f"),
                    ("gbs", "GB/s", ",.0f"),
                    ("peak_frac", "of peak", "%"),
                    ("splits", "splits", ""),
                    ("tflops", "TFLOP/s", ",.0f"),
                ],
                kernels["rows"],
            )
        )
    elif kernels:
        section.notes.append(f"bench/gpu_kernels.py failed: {kernels.get('error')}")
    section.data.update(
        {
            "decode": rows,
            "profiles": profiles,
            "mixed": mixed,
            "matmul_tflops": mm,
            "kernels": kernels,
            "peak_gbs": peak_gbs,
            "peak_tflops": peak_tf,
        }
    )
    best = {r["batch"]: r for r in rows if r["variant"] == variants[0][0]}
    if peak_gbs:
        aims = {1: 0.75, 16: 0.70, 64: 0.70}
        for b, aim in aims.items():
            if b in best:
                section.check(
                    f"decode batch {b}, fraction of peak bandwidth",
                    f"{best[b]['frac']:.0%}",
                    f">= {aim:.0%}",
                    best[b]["frac"] >= aim,
                    hard=False,
                )
        section.check(
            "prefill 2,048 tokens, fraction of dense fp16 peak",
            f"{pf['tflops'] / peak_tf:.0%}",
            ">= 50%",
            pf["tflops"] / peak_tf >= 0.5,
            hard=False,
        )
        section.check(
            f"mixed step / decode step ({mixed[0]['budget']} tokens a step)",
            f"{mixed[0]['ratio']:.2f}x",
            "<= 1.3x",
            mixed[0]["ratio"] <= 1.3,
            hard=False,
        )
        lc = next(
            (
                r.get("peak_frac")
                for r in (kernels or {}).get("rows", [])
                if r["op"] == "decode_attention" and r["shape"].startswith("B=8 ") and "32768" in r["shape"]
            ),
            None,
        )
        if lc is not None:
            section.check(
                "attention alone, batch 8 x 32k tokens, fraction of peak bandwidth",
                f"{lc:.0%}",
                ">= 60%",
                lc >= 0.6,
                hard=False,
            )


def kernel_bench(ctx: Ctx) -> dict | None:
    """``bench/gpu_kernels.py`` in its own process (its 4 GiB long-context cache is freed with it). On a card
    whose run of it is committed already (``bench/results/gpu_kernels.json``, the same card's name), that run's
    figures, not a second run: a device call's minutes are few."""
    script = ROOT / "bench" / "gpu_kernels.py"
    committed = ROOT / "bench" / "results" / "gpu_kernels.json"
    if not ctx.dry_run and committed.exists() and torch.cuda.is_available():
        data = json.loads(committed.read_text())
        if data.get("device") == torch.cuda.get_device_name():
            return {**data, "from": str(committed.relative_to(ROOT))}
    if not script.exists():
        return None
    out = ctx.out / "gpu_kernels.json"
    cmd = [sys.executable, str(script), "--out", str(out)] + (["--device", "cpu", "--tiny"] if ctx.dry_run else [])
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(30, ctx.left_s() - 5))
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    if proc.returncode or not out.exists():
        return {"rows": [], "error": proc.stderr.strip().splitlines()[-1:] if proc.stderr else proc.returncode}
    return json.loads(out.read_text())
