"""Soak: thousands of requests under pressure, audited after every step.

    python bench/soak.py [--requests 5000] [--seed 0]

On the tiny random Llama, a small pool (48 blocks of 4 tokens) and a small CPU swap pool, so
preemption (by recompute, by swap, and swap falling back to recompute), eviction and
copy-on-write happen all the time. Requests arrive at random with random shared prefixes and
lengths, n = 1-3 and some beam searches; random aborts hit requests waiting, mid-prefill,
mid-decode and swapped. Half the requests run with preemption_mode="recompute", half with "swap".
Checked: ``audit()`` clean after every step; at the end every block (device and CPU) is free and
every sequence finished or was aborted exactly once; a fixed-seed greedy subset, never aborted,
is token-identical to the same prompts run without pressure. ``run_soak`` is also the CI test.
"""
from __future__ import annotations

import argparse
import random
import time
from collections import Counter

from common import engine_for, tiny_model, write_results
from engine import LLM, SamplingParams
from engine.core.request import RequestStatus
from engine.inspect.events import LeakFound, RequestAborted, RequestFinished, RequestPreempted


def _abort_category(engine, rid: str) -> str:
    r = engine.requests.get(rid) or next((m for m in engine.groups.get(rid, []) if not m.is_finished), None)
    if r is None:
        return "finished"
    if r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
        return "waiting"
    if r.status == RequestStatus.SWAPPED:
        return "swapped"
    return "mid-prefill" if r.num_computed_tokens < r.num_prompt_tokens else "mid-decode"


def run_soak(num_requests: int, seed: int = 0, mode: str = "recompute", num_blocks: int = 48) -> dict:
    rng = random.Random(seed)
    mtn = tiny_model()
    vocab = mtn[0].config.vocab_size
    engine = engine_for(mtn, block_size=4, num_gpu_blocks=num_blocks, num_cpu_blocks=24, preemption_mode=mode,
                        max_num_seqs=16, max_num_batched_tokens=64, max_model_len=256)
    prefixes = [[rng.randrange(1, vocab) for _ in range(n)] for n in (0, 8, 16, 24)]
    greedy_every = max(1, num_requests // 20)
    greedy: dict[str, tuple[list[int], int]] = {}  # protected requests: prompt, max_tokens
    outputs: dict[str, list[int]] = {}
    terminal: Counter[str] = Counter()
    aborts: Counter[str] = Counter()
    preempt_modes: Counter[str] = Counter()
    leaks = 0
    added = refused = 0
    t0 = time.perf_counter()
    while added < num_requests or engine.has_unfinished():
        for _ in range(rng.choice((0, 0, 0, 1, 1, 2)) if added < num_requests else 0):
            # Some prompts exceed the step's token budget (64), so they prefill in chunks.
            tail = rng.randint(60, 140) if rng.random() < 0.15 else rng.randint(1, 30)
            prompt = rng.choice(prefixes) + [rng.randrange(1, vocab) for _ in range(tail)]
            max_tokens = rng.randint(1, 24)
            if added % greedy_every == 0:
                params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            elif rng.random() < 0.05:
                params = SamplingParams(max_tokens=max_tokens, use_beam_search=True, beam_width=2, ignore_eos=True)
            else:
                params = SamplingParams(max_tokens=max_tokens, temperature=rng.choice((0.0, 0.8)),
                                        n=rng.choice((1, 1, 1, 2, 3)), seed=rng.randrange(1000), ignore_eos=True)
            before = len(engine.requests)
            try:
                rid = engine.add_request(prompt, params)
            except ValueError:  # e.g. two beams of a long prompt cannot fit this small pool: refused
                refused += 1
                assert len(engine.requests) == before  # and nothing else changed
                continue
            if added % greedy_every == 0:
                greedy[rid] = (prompt, max_tokens)
            added += 1
        if rng.random() < 0.08 and engine.requests:
            # Half the aborts aim at sequences on the device (mid-prefill, mid-decode), which the
            # long waiting queue would otherwise outnumber.
            u = rng.random()
            pool = (engine.scheduler.running if u < 0.4 else engine.scheduler.swapped if u < 0.6
                    else engine.requests.values())
            live = sorted({r.group_id for r in pool} - set(greedy)) or sorted(
                {r.group_id for r in engine.requests.values()} - set(greedy))
            if live:
                rid = rng.choice(live)
                aborts[_abort_category(engine, rid)] += 1
                engine.abort(rid)
        out = engine.step()
        report = engine.audit(emit_events=True)
        if not report.ok:
            raise AssertionError(f"step {engine.step_count}: {report}")
        for ev in out.events + engine.pool.drain_events():
            if isinstance(ev, (RequestFinished, RequestAborted)):
                terminal[ev.request_id] += 1
            elif isinstance(ev, RequestPreempted):
                preempt_modes[ev.mode] += 1
            elif isinstance(ev, LeakFound):
                leaks += 1
        for o in out.outputs:
            if o.finished and o.request_id in greedy:
                outputs[o.request_id] = o.outputs[0].token_ids
    seconds = time.perf_counter() - t0
    sequences = {r.request_id for members in engine.groups.values() for r in members}
    twice = [rid for rid in sequences if terminal[rid] != 1]
    assert not twice, f"sequences not ended exactly once: {twice[:10]}"
    assert engine.pool.num_free_blocks == engine.pool.num_blocks, "blocks still held at the end"
    assert engine.kv.cpu_pool.num_free_blocks == engine.kv.cpu_pool.num_blocks, "CPU blocks still held"
    # The protected greedy subset, against the same prompts without pressure.
    calm = LLM.from_engine(engine_for(mtn, block_size=4, num_gpu_blocks=4096, max_model_len=256))
    ref = calm.generate([p for p, _ in greedy.values()],
                        [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in greedy.values()])
    mismatched = [rid for rid, r in zip(greedy, ref) if outputs.get(rid) != r.outputs[0].token_ids]
    assert not mismatched, f"greedy outputs changed under pressure: {mismatched}"
    m = engine.metrics()
    return {"mode": mode, "requests": added, "refused": refused, "sequences": len(sequences),
            "steps": engine.step_count,
            "aborts": sum(aborts.values()), "aborts_by_state": dict(aborts), "preemptions": m["num_preemptions"],
            "preemptions_by_mode": dict(preempt_modes), "swap_outs": m["swap_outs"], "swap_ins": m["swap_ins"],
            "cow_copies": m["cow_copies"], "evictions": m["evictions"], "leaks_found": leaks,
            "greedy_checked": len(greedy), "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rows = [run_soak(args.requests // 2, args.seed, "recompute"), run_soak(args.requests - args.requests // 2,
                                                                           args.seed + 1, "swap")]
    write_results("soak", {"rows": rows}, quick=False)
    keys = ["requests", "refused", "sequences", "steps", "aborts", "preemptions", "swap_outs", "swap_ins", "cow_copies",
            "evictions", "leaks_found", "greedy_checked", "seconds"]
    print("| mode | " + " | ".join(keys) + " | aborts by state |")
    print("|---" * (len(keys) + 2) + "|")
    for r in rows:
        cells = [f"{r[k]:.0f}" if k == "seconds" else str(r[k]) for k in keys]
        print(f"| {r['mode']} | " + " | ".join(cells) + f" | {r['aborts_by_state']} |")


if __name__ == "__main__":
    main()
