"""Scheduler and block-manager overhead: microseconds of Python per step, without a model.

    python bench/scheduler_overhead.py [--quick] [--nano-vllm PATH]

A fake runner replaces the model (``common.install_fake_runner``): everything else of
``LLMEngine.step`` runs for real (scheduling, slot allocation, block hashing and caching, events,
stop checks, outputs). N requests decode together (prompts of 100-400 tokens, 256 output tokens);
the steps where all N are running are timed. Requests ask for their final output only
(``RequestOutputKind.FINAL_ONLY``, what ``LLM.generate`` asks for; nano-vllm also returns finished
sequences only); one row at 256 shows the cost of a cumulative output every step (the server's
streams). For scale: one decode step of a 7B model on a current GPU takes about 3 ms. With
``--nano-vllm PATH`` (a checkout of nano-vllm, see ``bench/nano_vllm_peer.py``) its scheduler and
block manager run the same workload side by side.
"""

from __future__ import annotations

import statistics
import time

from common import (
    engine_for,
    install_fake_runner,
    length_mix,
    pyplot,
    random_prompts,
    save_figure,
    table,
    tiny_model,
    write_results,
)
from engine import RequestOutputKind, SamplingParams

GPU_DECODE_STEP_US = 3000


def workload(n: int) -> list[list[int]]:
    vocab = tiny_model()[0].config.vocab_size
    return random_prompts([p for p, _ in length_mix(n, 31, (100, 400), (1, 1))], vocab, seed=32)


def stepper(n: int, steps: int, caching: bool, kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY):
    """A function running one timed engine step with all ``n`` requests decoding; it returns the step's
    seconds. The prompts' prefill is done before the first."""
    engine = engine_for(
        tiny_model(),
        block_size=16,
        num_gpu_blocks=n * 48 + 64,
        max_num_seqs=n,
        max_num_batched_tokens=max(2048, n * 400),
        enable_prefix_caching=caching,
        max_model_len=4096,
    )
    install_fake_runner(engine)
    for p in workload(n):
        engine.add_request(p, SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True, output_kind=kind))
    engine.step()  # every prompt prefills in this step (the budget covers them all)

    def step() -> float:
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        assert len(engine.scheduler.running) == n
        return dt

    return step


def measure(n: int, steps: int, caching: bool, kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY) -> dict:
    step = stepper(n, steps, caching, kind)
    us = 1e6 * statistics.median(step() for _ in range(steps))
    return {
        "running": n,
        "prefix_caching": "on" if caching else "off",
        "outputs": kind.name.lower(),
        "us_per_step": us,
        "us_per_request": us / n,
        "fraction_of_gpu_step": us / GPU_DECODE_STEP_US,
    }


def side_by_side(n: int, steps: int, nano_vllm: str, chunk: int = 5) -> dict:
    """kvscope and nano-vllm stepped in turns, ``chunk`` steps each, over the same ``steps``: a slow spell
    of this shared machine lands on both alike (whole runs one after the other differed by up to 2x)."""
    from nano_vllm_peer import stepper as peer

    vocab = tiny_model()[0].config.vocab_size
    ours, theirs = stepper(n, steps, True), peer(nano_vllm, workload(n), steps, 16, n * 48 + 64, vocab)
    a, b = [], []
    for _ in range(0, steps, chunk):
        a += [ours() for _ in range(chunk)]
        b += [theirs() for _ in range(chunk)]
    a_us, b_us = 1e6 * statistics.median(a), 1e6 * statistics.median(b)
    return {"running": n, "kvscope_us": a_us, "nano_vllm_us": b_us, "ratio": a_us / b_us}


def run(quick: bool, nano_vllm: str | None = None) -> dict:
    steps = 20 if quick else 200
    rows = [measure(n, steps, caching) for caching in (True, False) for n in (1, 64, 256)]
    rows.append(measure(256, steps, True, RequestOutputKind.CUMULATIVE))
    # nano-vllm always caches prefixes: the comparison is with caching on.
    peers = [side_by_side(n, steps, nano_vllm) for n in (1, 64, 256)] if nano_vllm else []
    result = {"steps_timed": steps, "gpu_decode_step_us": GPU_DECODE_STEP_US, "rows": rows, "nano_vllm": peers}
    write_results("scheduler_overhead", result, quick)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3))
    for caching, c in (("on", "#2a7"), ("off", "#888")):
        rs = [r for r in rows if r["prefix_caching"] == caching and r["outputs"] == "final_only"]
        ax.plot(
            [r["running"] for r in rs], [r["us_per_step"] for r in rs], "o-", color=c, label=f"prefix caching {caching}"
        )
    ax.axhline(GPU_DECODE_STEP_US, color="#c44", ls="--", label="7B decode step on a GPU (~3 ms)")
    ax.set_xlabel("running requests")
    ax.set_ylabel("µs of Python per step")
    ax.legend(fontsize=8)
    save_figure(fig, "scheduler_overhead", quick)
    print(
        table(
            rows,
            [
                ("running", "running", "d"),
                ("prefix_caching", "caching", ""),
                ("outputs", "outputs", ""),
                ("us_per_step", "µs / step", ".0f"),
                ("us_per_request", "µs / request", ".1f"),
                ("fraction_of_gpu_step", "of a 3 ms GPU step", ".0%"),
            ],
        )
    )
    if peers:
        print(
            table(
                peers,
                [
                    ("running", "running", "d"),
                    ("kvscope_us", "kvscope µs / step", ".0f"),
                    ("nano_vllm_us", "nano-vllm µs / step", ".0f"),
                    ("ratio", "kvscope / nano-vllm", ".2f"),
                ],
            )
        )
    return result


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a small run (CI checks its JSON's shape, not speed)")
    ap.add_argument("--nano-vllm", metavar="PATH", help="a nano-vllm checkout to measure side by side")
    args = ap.parse_args()
    run(args.quick, args.nano_vllm)
