"""Block size sweep: throughput, internal waste and prefix-cache hit rate for 8 ... 128 tokens a block.

    python bench/block_size.py [--quick]

24 requests at once on SmolLM2: a 200-token shared system prompt plus a 16-256 token user part,
16-128 output tokens (fixed seed). Small blocks waste little of their last block and share a
prefix at a fine grain (only full blocks are cached); large blocks mean fewer table entries and
bigger copies. Waste = allocated but unfilled slots / allocated slots, averaged over steps.
"""

from __future__ import annotations

import time

from common import (
    engine_for,
    kv_waste,
    length_mix,
    main,
    model_for,
    pyplot,
    random_prompts,
    save_figure,
    table,
    write_results,
)
from engine import SamplingParams

SIZES = [8, 16, 32, 64, 128]


def run(quick: bool) -> dict:
    mtn = model_for(quick)
    vocab = mtn[0].config.vocab_size
    n, sys_len, user_rng, out_rng = (8, 40, (4, 40), (4, 16)) if quick else (24, 200, (16, 256), (16, 128))
    mix = length_mix(n, 5, user_rng, out_rng)
    system = random_prompts([sys_len], vocab, seed=11)[0]
    prompts = [system + u for u in random_prompts([p for p, _ in mix], vocab, seed=12)]
    rows = []
    for bs in SIZES:
        engine = engine_for(mtn, block_size=bs, num_gpu_blocks=max(64, 2 * n * 1024 // bs), max_model_len=2048)
        engine.add_request(prompts[0][:8], SamplingParams(max_tokens=2, temperature=0.0))  # warm up
        while engine.has_unfinished():
            engine.step()
        engine.reset_prefix_cache()
        q0, h0 = engine.kv.prefix_cache_queries, engine.kv.prefix_cache_hits
        for p, (_, o) in zip(prompts, mix):
            engine.add_request(p, SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True))
        alloc = filled = 0
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
            a, f = kv_waste(engine)
            alloc, filled = alloc + a, filled + f
        dt = time.perf_counter() - t0
        q, h = engine.kv.prefix_cache_queries - q0, engine.kv.prefix_cache_hits - h0
        rows.append(
            {
                "block_size": bs,
                "out_tok_s": sum(o for _, o in mix) / dt,
                "waste": 1 - filled / alloc,
                "hit_rate": h / q if q else 0.0,
                "seconds": dt,
            }
        )
    result = {"model": mtn[2], "requests": n, "system_prompt_tokens": sys_len, "rows": rows}
    write_results("block_size", result, quick)
    plt = pyplot()
    fig, ax = plt.subplots(1, 3, figsize=(11, 3))
    for a, key, label in (
        (ax[0], "out_tok_s", "output tok/s"),
        (ax[1], "waste", "internal waste"),
        (ax[2], "hit_rate", "prefix-cache hit rate"),
    ):
        a.plot(SIZES, [r[key] for r in rows], "o-", color="#2a7")
        a.set_xscale("log", base=2)
        a.set_xticks(SIZES, [str(s) for s in SIZES])
        a.set_xlabel("block size (tokens)")
        a.set_title(label)
    save_figure(fig, "block_size", quick)
    print(
        table(
            rows,
            [
                ("block_size", "block size", "d"),
                ("out_tok_s", "output tok/s", ".1f"),
                ("waste", "waste", ".1%"),
                ("hit_rate", "hit rate", ".0%"),
                ("seconds", "seconds", ".1f"),
            ],
        )
    )
    return result


if __name__ == "__main__":
    main(run, __doc__)
