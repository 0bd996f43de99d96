"""Capacity under a fixed KV byte budget: how many requests run at once, and the slots wasted.

    python bench/capacity.py [--quick]

One budget (512 MiB of SmolLM2-135M fp32 KV: 46,080 bytes a token), 256 requests with prompts of
16-512 and outputs of 16-256 tokens from a fixed seed. Layouts: contiguous (max_model_len = 2048
reserved per request at admission), paged, and paged + prefix caching with 0%, 50% and 80% of
each prompt drawn from one common prefix. The scheduler and block manager run for real; the
model is a fake runner (capacity is bookkeeping, not arithmetic). Waste = allocated but unfilled
slots / allocated slots of the blocks in use, averaged over steps (a shared block counts once).
"""

from __future__ import annotations

from common import (
    engine_for,
    install_fake_runner,
    kv_waste,
    length_mix,
    main,
    pyplot,
    random_prompts,
    save_figure,
    table,
    tiny_model,
    write_results,
)
from engine import SamplingParams

SMOLLM2_TOKEN_BYTES = 2 * 30 * 3 * 64 * 4  # K and V x layers x kv heads x head dim x fp32


def run_layout(label: str, n_blocks: int, bs: int, prompts, outputs, **kw) -> dict:
    engine = engine_for(
        tiny_model(),
        num_gpu_blocks=n_blocks,
        block_size=bs,
        max_num_seqs=len(prompts),
        max_model_len=2048,
        max_num_batched_tokens=4096,
        **kw,
    )
    install_fake_runner(engine)
    for p, o in zip(prompts, outputs):
        engine.add_request(p, SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True))
    peak, running_sum, steps, alloc, filled = 0, 0, 0, 0, 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        r = len(engine.scheduler.running)
        peak = max(peak, r)
        running_sum += r
        a, f = kv_waste(engine)
        alloc += a
        filled += f
    m = engine.metrics()
    return {
        "layout": label,
        "peak_running": peak,
        "mean_running": running_sum / steps,
        "steps": steps,
        "waste": 1 - filled / alloc if alloc else 0.0,
        "preemptions": m["num_preemptions"],
        "hit_rate": m["prefix_cache_hits"] / m["prefix_cache_queries"] if m["prefix_cache_queries"] else 0.0,
    }


def run(quick: bool) -> dict:
    bs = 16
    n, budget = (24, 128 << 20) if quick else (256, 512 << 20)
    n_blocks = budget // (SMOLLM2_TOKEN_BYTES * bs)
    mix = length_mix(n, 0, (16, 512), (16, 256))
    outputs = [o for _, o in mix]
    vocab = tiny_model()[0].config.vocab_size
    shared = random_prompts([512], vocab, seed=99)[0]
    rows = [
        run_layout(
            "contiguous (2048 reserved)",
            n_blocks,
            bs,
            random_prompts([p for p, _ in mix], vocab, 1),
            outputs,
            kv_layout="contiguous",
        ),
        run_layout(
            "paged", n_blocks, bs, random_prompts([p for p, _ in mix], vocab, 1), outputs, enable_prefix_caching=False
        ),
    ]
    for frac in (0.0, 0.5, 0.8):
        prompts = [
            shared[: int(frac * p)] + random_prompts([p - int(frac * p)], vocab, 1000 + i)[0]
            for i, (p, _) in enumerate(mix)
        ]
        rows.append(run_layout(f"paged + caching, {frac:.0%} shared", n_blocks, bs, prompts, outputs))
    base = rows[0]["peak_running"]
    for r in rows:
        r["vs_contiguous"] = r["peak_running"] / base
    result = {"budget_bytes": budget, "num_blocks": n_blocks, "block_size": bs, "requests": n, "rows": rows}
    write_results("capacity", result, quick)
    plt = pyplot()
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.2))
    labels = [r["layout"] for r in rows]
    ax[0].barh(labels[::-1], [r["peak_running"] for r in rows][::-1], color="#2a7")
    ax[0].set_xlabel("most requests running at once")
    ax[1].barh(labels[::-1], [100 * r["waste"] for r in rows][::-1], color="#c84")
    ax[1].set_xlabel("internal waste, % of allocated slots")
    ax[1].set_yticklabels([])
    fig.suptitle(f"{budget >> 20} MiB of KV ({n_blocks} blocks of {bs}), {n} requests")
    save_figure(fig, "capacity", quick)
    print(
        table(
            rows,
            [
                ("layout", "layout", ""),
                ("peak_running", "most running", "d"),
                ("vs_contiguous", "x contiguous", ".1f"),
                ("mean_running", "mean running", ".1f"),
                ("waste", "waste", ".1%"),
                ("hit_rate", "hit rate", ".0%"),
                ("preemptions", "preemptions", "d"),
            ],
        )
    )
    return result


if __name__ == "__main__":
    main(run, __doc__)
