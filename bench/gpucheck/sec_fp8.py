"""Section fp8: an fp8 KV cache against fp16 on the card: blocks in the same memory, decode speed, drift.

Random Llama-2-7B weights in fp16. Blocks: the pool each format gets from the same 16 GiB. Speed: 64
requests of 512 prompt tokens, 128 new tokens, the decode steps timed alone (as section decode).
Drift, as ``bench/kv_quant.py`` reports it: a 1,024-token prompt, 128 greedy tokens from the fp16
cache as the reference; a copy in the fp8 engine fed the reference tokens (teacher-forced) gives the
KL divergence of its next-token distribution at every position, a free-running copy the greedy
agreement with the reference.
"""

from __future__ import annotations

import gc

import torch

from .sec_decode import decode_run
from .shared import Ctx, Section, Table, random_native

GiB = 2**30


def run(ctx: Ctx, section: Section) -> None:
    from kv_quant import Recorder, agreement, first_divergence

    from engine import LLMEngine, SamplingParams

    dev = ctx.device
    model = random_native(ctx.big, ctx.dtype, dev)
    vocab = model.lm_head.weight.shape[0]
    batch, prompt, new = ctx.n(64, 4), ctx.n(512, 16), ctx.n(128, 8)
    g = torch.Generator().manual_seed(13)
    prompts = torch.randint(1, vocab, (batch, prompt), generator=g).tolist()
    drift_prompt = torch.randint(1, vocab, (ctx.n(1024, 32),), generator=g).tolist()
    drift_new = ctx.n(128, 8)
    budget = ctx.n(16, 1) * GiB // (1 if not ctx.dry_run else 64)
    rows, reference = [], None
    for kv in ("auto", "fp8"):
        kw = dict(block_size=16, max_num_seqs=batch + 2, max_model_len=ctx.n(2048, 128), kv_cache_dtype=kv)
        engine = LLMEngine.from_model(model, None, name="random llama-2-7b", kv_cache_memory_bytes=budget, **kw)
        blocks = engine.pool.num_blocks
        r = decode_run(engine, prompts, new, dev)
        tok_s = batch * r["steps"] / r["seconds"]
        # drift: the reference (fp16) records its tokens and log-probs; fp8 runs a forced and a free copy
        greedy = SamplingParams(max_tokens=drift_new, temperature=0.0, ignore_eos=True)
        engine.add_request(drift_prompt, greedy, request_id="free")
        forced = {}
        if reference is not None:
            engine.add_request(drift_prompt, greedy, request_id="forced")
            forced = {"forced": reference["tokens"]}
        rec = Recorder(engine, forced)
        done = {}
        while engine.has_unfinished():
            for o in engine.step().finished:
                done[o.request_id] = list(o.outputs[0].token_ids)
        row = {
            "kv": "fp16" if kv == "auto" else kv,
            "blocks": blocks,
            "tok_s": tok_s,
            "step_ms": r["seconds"] / r["steps"] * 1e3,
        }
        if reference is None:
            reference = {"tokens": done["free"], "logprobs": torch.stack(rec.logprobs["free"])}
        else:
            q = torch.stack(rec.logprobs["forced"])
            p = reference["logprobs"]
            kl = (p.exp() * (p - q)).sum(-1).clamp_min(0)
            row.update(
                kl_mean=float(kl.mean()),
                kl_max=float(kl.max()),
                agree32=agreement(done["free"], reference["tokens"], 32),
                agree_all=agreement(done["free"], reference["tokens"], drift_new),
                first_diff=first_divergence(done["free"], reference["tokens"]),
            )
        rows.append(row)
        del engine, rec
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    f16, f8 = rows
    section.tables.append(
        Table(
            f"fp8 against fp16 KV: blocks in {budget / GiB:g} GiB; decode of {batch} x {prompt}-token prompts; "
            f"drift over "
            f"{drift_new} tokens after {len(drift_prompt)}",
            [
                ("kv", "KV", ""),
                ("blocks", "blocks", ",d"),
                ("tok_s", "decode tok/s", ",.0f"),
                ("step_ms", "ms a step", ".2f"),
                ("kl_mean", "KL mean", ".2e"),
                ("kl_max", "KL max", ".2e"),
                ("agree32", "greedy agreement (32)", "%"),
                ("agree_all", f"agreement ({drift_new})", "%"),
                ("first_diff", "first differing token", ""),
            ],
            rows,
        )
    )
    section.data.update(rows=rows)
    section.check(
        "fp8 blocks / fp16 blocks",
        f"{f8['blocks'] / f16['blocks']:.2f}x",
        ">= 1.95x",
        f8["blocks"] >= 1.95 * f16["blocks"],
    )
    section.check(
        "fp8 decode speed / fp16",
        f"{f8['tok_s'] / f16['tok_s']:.2f}x",
        ">= 0.9x",
        f8["tok_s"] >= 0.9 * f16["tok_s"],
        hard=False,
    )
