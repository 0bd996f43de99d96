"""Section full_pool: long requests on a pool too small for them, preempted by recompute and by swap.

A 0.4B model of Llama's layout in fp32 (greedy outputs compared exactly: fp16 rounding would flip the
near-ties of random weights): every request's output under pressure equals its output from a pool that
never preempts; the audit (every ref count recomputed from the tables) clean after every step. Swap-out
and swap-in bandwidth (the engine's own swaps, synchronised and timed) beside a pinned-memory copy of
256 MiB each way measured in the same run.
"""

from __future__ import annotations

import time

import torch

from .shared import Ctx, Section, Table, random_native, sync

MiB = 2**20


def pinned_copy_gbs(dev: torch.device, nbytes: int = 256 * MiB) -> tuple[float, float]:
    """(device -> host, host -> device) GB/s of one pinned copy, best of three."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    devbuf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    out = []
    for src, dst in ((devbuf, host), (host, devbuf)):
        best = float("inf")
        for _ in range(3):
            sync(dev)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            sync(dev)
            best = min(best, time.perf_counter() - t0)
        out.append(nbytes / best / 1e9)
    return out[0], out[1]


def timed_swaps(engine, dev) -> dict:
    """Wraps the runner's swaps: bytes and seconds of each direction."""
    runner, stats = engine.runner, {"out_bytes": 0, "out_s": 0.0, "in_bytes": 0, "in_s": 0.0}

    def wrap(fn, key):
        def timed(pairs):
            sync(dev)
            t0 = time.perf_counter()
            fn(pairs)
            sync(dev)
            stats[f"{key}_s"] += time.perf_counter() - t0
            stats[f"{key}_bytes"] += len(pairs) * runner.block_bytes

        return timed

    runner.swap_out_blocks = wrap(runner.swap_out_blocks, "out")
    runner.swap_in_blocks = wrap(runner.swap_in_blocks, "in")
    return stats


def run_all(engine, prompts, max_tokens: int, audit: bool, ctx: Ctx) -> tuple[list[list[int]], int, list[str]]:
    from engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    done, bad, steps = {}, [], 0
    while engine.has_unfinished():
        out = engine.step()
        steps += 1
        if out.error:
            bad.append(f"step {out.step}: {out.error}")
        for o in out.finished:
            done[o.request_id] = o.outputs[0].token_ids
        if audit:
            rep = engine.audit()
            if not rep.ok:
                bad.append(f"audit at step {out.step}: {rep.problems[0]}")
        if ctx.left_s() < 5:
            bad.append("out of time")
            break
    return [list(done.get(i, [])) for i in ids], steps, bad


def run(ctx: Ctx, section: Section) -> None:
    from engine import LLMEngine

    dev = ctx.device
    model = random_native(ctx.small, torch.float32, dev)
    n, max_tokens = ctx.n(24, 6), ctx.n(64, 12)
    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(ctx.n(300, 20), ctx.n(700, 60), (n,), generator=g).tolist()
    prompts = [torch.randint(1, model.lm_head.weight.shape[0], (k,), generator=g).tolist() for k in lengths]
    need = sum(-(-(k + max_tokens) // 16) for k in lengths)
    base = dict(
        block_size=16,
        max_num_seqs=n,
        max_model_len=1024 if not ctx.dry_run else 128,
        max_num_batched_tokens=2048 if not ctx.dry_run else 128,
    )
    ref_engine = LLMEngine.from_model(model, None, name="random llama-small", num_gpu_blocks=need + 16, **base)
    reference, ref_steps, _ = run_all(ref_engine, prompts, max_tokens, False, ctx)
    ref_pre = ref_engine.metrics()["num_preemptions"]
    del ref_engine
    small = max(need // 3, -(-(max(lengths) + max_tokens) // 16) + 2)
    rows = [
        {
            "mode": "no pressure (reference)",
            "blocks": need + 16,
            "steps": ref_steps,
            "preemptions": ref_pre,
            "equal": f"{n} of {n}",
            "audit": "n/a",
        }
    ]
    link = pinned_copy_gbs(dev) if dev.type == "cuda" else (None, None)
    for mode in ("recompute", "swap"):
        engine = LLMEngine.from_model(
            model,
            None,
            name="random llama-small",
            num_gpu_blocks=small,
            preemption_mode=mode,
            num_cpu_blocks=need + 16 if mode == "swap" else None,
            **base,
        )
        stats = timed_swaps(engine, dev) if mode == "swap" else None
        outs, steps, bad = run_all(engine, prompts, max_tokens, True, ctx)
        m = engine.metrics()
        equal = sum(a == b for a, b in zip(outs, reference))
        rows.append(
            {
                "mode": mode,
                "blocks": small,
                "steps": steps,
                "preemptions": m["num_preemptions"],
                "equal": f"{equal} of {n}",
                "audit": "clean" if not bad else bad[0],
            }
        )
        section.check(f"{mode}: outputs equal to the unpressured run", f"{equal} of {n}", f"{n} of {n}", equal == n)
        section.check(f"{mode}: preemptions", m["num_preemptions"], "> 0", m["num_preemptions"] > 0)
        section.check(f"{mode}: audit after every step, failed steps", bad[0] if bad else "clean", "clean", not bad)
        if stats is not None:
            out_gbs = stats["out_bytes"] / stats["out_s"] / 1e9 if stats["out_s"] else None
            in_gbs = stats["in_bytes"] / stats["in_s"] / 1e9 if stats["in_s"] else None
            section.data["swap"] = {
                **stats,
                "out_gbs": out_gbs,
                "in_gbs": in_gbs,
                "pinned_d2h_gbs": link[0],
                "pinned_h2d_gbs": link[1],
            }
            section.tables.append(
                Table(
                    "Swap bandwidth: the engine's swaps (all layers' K and V of the blocks moved, synchronised) beside "
                    "one pinned copy of 256 MiB",
                    [
                        ("dir", "direction", ""),
                        ("mib", "MiB moved", ",.0f"),
                        ("gbs", "GB/s", ".1f"),
                        ("link", "pinned copy GB/s", ".1f"),
                        ("frac", "of the pinned copy", "%"),
                    ],
                    [
                        {
                            "dir": "swap-out (device to CPU)",
                            "mib": stats["out_bytes"] / MiB,
                            "gbs": out_gbs,
                            "link": link[0],
                            "frac": out_gbs / link[0] if out_gbs and link[0] else None,
                        },
                        {
                            "dir": "swap-in (CPU to device)",
                            "mib": stats["in_bytes"] / MiB,
                            "gbs": in_gbs,
                            "link": link[1],
                            "frac": in_gbs / link[1] if in_gbs and link[1] else None,
                        },
                    ],
                )
            )
            if link[0]:
                for d, gbs, ref in (("swap-out", out_gbs, link[0]), ("swap-in", in_gbs, link[1])):
                    section.check(
                        f"{d} bandwidth over a pinned copy",
                        f"{(gbs or 0) / ref:.0%}",
                        ">= 70%",
                        (gbs or 0) >= 0.7 * ref,
                        hard=False,
                    )
        del engine
    section.tables.insert(
        0,
        Table(
            f"{n} requests of {min(lengths)}-{max(lengths)} prompt tokens, {max_tokens} new each, greedy, fp32 "
            f"({'random llama-small' if not ctx.dry_run else 'tiny'})",
            [
                ("mode", "preemption", ""),
                ("blocks", "pool blocks", ",d"),
                ("steps", "steps", "d"),
                ("preemptions", "preemptions", "d"),
                ("equal", "outputs equal", ""),
                ("audit", "audit", ""),
            ],
            rows,
        ),
    )
