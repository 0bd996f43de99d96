"""Throughput: paged engine vs transformers' generate (static batches) vs a contiguous KV layout.

    python bench/throughput.py [--quick]

64 requests, prompt and output lengths from a fixed seed (prompts 16-512, outputs 16-192
tokens), on SmolLM2; every system gets the same requests. Paged and contiguous get the same
KV byte budget and max_model_len; contiguous reserves max_model_len per request at admission,
as systems before PagedAttention did, so fewer requests run at once. transformers runs static
batches of 16 (left-padded, its default cache); a batch runs until its longest output, and only
the requested output tokens count. Output tokens/s and ratios, measured side by side.
"""

from __future__ import annotations

import time

import torch

from common import (
    engine_for,
    length_mix,
    main,
    model_for,
    pyplot,
    random_prompts,
    save_figure,
    table,
    write_results,
)
from engine import LLM, SamplingParams


def run_engine(mtn, prompts, outputs, **kw) -> dict:
    engine = engine_for(mtn, **kw)
    llm = LLM.from_engine(engine)
    llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2, temperature=0.0))  # warm up
    peak = 0
    params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for o in outputs]
    for p, sp in zip(prompts, params):
        engine.add_request(p, sp)
    t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    dt = time.perf_counter() - t
    return {
        "seconds": dt,
        "output_tokens": sum(outputs),
        "peak_running": peak,
        "preemptions": engine.scheduler.num_preemptions,
        "num_blocks": engine.pool.num_blocks,
    }


def run_hf(model, prompts, outputs, batch: int, pad_id: int) -> dict:
    t = time.perf_counter()
    for i in range(0, len(prompts), batch):
        ps, os_ = prompts[i : i + batch], outputs[i : i + batch]
        width = max(len(p) for p in ps)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in ps])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
        with torch.inference_mode():
            model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max(os_), min_new_tokens=max(os_), do_sample=False
            )
    return {
        "seconds": time.perf_counter() - t,
        "output_tokens": sum(outputs),
        "peak_running": batch,
        "preemptions": 0,
        "num_blocks": None,
    }


def run(quick: bool) -> dict:
    mtn = model_for(quick)
    model = mtn[0]
    n, prompt_rng, out_rng, max_len, budget = (
        (8, (8, 48), (4, 16), 128, 2 << 20) if quick else (64, (16, 512), (16, 192), 2048, 1 << 30)
    )
    mix = length_mix(n, 0, prompt_rng, out_rng)
    prompts = random_prompts([p for p, _ in mix], model.config.vocab_size, seed=1)
    outputs = [o for _, o in mix]
    common = dict(kv_cache_memory_bytes=budget, max_model_len=max_len, max_num_seqs=n)
    rows = []
    for name, fn in (
        ("engine (paged)", lambda: run_engine(mtn, prompts, outputs, **common)),
        (
            "engine (contiguous max_model_len)",
            lambda: run_engine(mtn, prompts, outputs, kv_layout="contiguous", **common),
        ),
        (
            "transformers generate (batches of 16)",
            lambda: run_hf(model, prompts, outputs, 16, model.generation_config.pad_token_id or 0),
        ),
    ):
        r = fn()
        r["system"] = name
        r["tok_s"] = r["output_tokens"] / r["seconds"]
        rows.append(r)
    base = rows[0]["tok_s"]
    for r in rows:
        r["paged_over_this"] = base / r["tok_s"]
    result = {
        "requests": n,
        "prompt_range": prompt_rng,
        "output_range": out_rng,
        "max_model_len": max_len,
        "kv_budget_bytes": budget,
        "model": mtn[2],
        "rows": rows,
    }
    write_results("throughput", result, quick)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.barh([r["system"] for r in rows][::-1], [r["tok_s"] for r in rows][::-1], color=["#888", "#c84", "#2a7"])
    ax.set_xlabel("output tokens / s")
    ax.set_title(f"{n} requests, {mtn[2]}")
    save_figure(fig, "throughput", quick)
    print(
        table(
            rows,
            [
                ("system", "system", ""),
                ("tok_s", "output tok/s", ".1f"),
                ("paged_over_this", "paged / this", ".2f"),
                ("peak_running", "peak running", "d"),
                ("preemptions", "preemptions", "d"),
                ("seconds", "seconds", ".1f"),
            ],
        )
    )
    return result


if __name__ == "__main__":
    main(run, __doc__)
