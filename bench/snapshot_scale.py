"""The inspector at GPU-workstation pool sizes: a snapshot's cost and the timeline's memory and scrub time.

    python bench/snapshot_scale.py [--quick]

A fake runner replaces the model (``common.install_fake_runner``), so the pool can have the size of a
7B model's on a large GPU without the memory: 2,912 blocks (a 24 GB card's share), 65,536 and
1,048,576. Steady traffic: 256 requests running (prompts 100-400 tokens, outputs 32-320), each
finished one replaced at once. Measured per size: ``LLMEngine.snapshot()`` (median, ms); the timeline
(``kvscope.history.RunHistory``, what the window keeps) recording every step: what it holds, counted
object by object (``deep_size``: every object reachable from it, once; numpy arrays with their data),
its own running estimate (what its memory budget acts on), the process's resident memory growth
(engine and timeline: the engine's prefix cache fills too), and the time ``at(step)`` takes to rebuild
a random earlier step (median and worst, ms); and what a step's record costs the engine process (what
``kvscope`` runs: the live state read, the record added to its batch, and, when a batch is due, the pool's
arrays copied into a shared-memory slot and the batch pickled). The garbage collector is set as in kvscope's processes
(``engine.gc_policy.tune_gc``: the loaded heap frozen, the youngest generation collected every 50,000
allocations): with CPython's default a snapshot at 65,536 blocks took 8.5 ms instead of 5.
"""

from __future__ import annotations

import gc
import pickle
import random
import statistics
import time

from common import engine_for, install_fake_runner, length_mix, main, random_prompts, table, tiny_model, write_results
from engine import SamplingParams
from engine.gc_policy import tune_gc
from kvscope.history import RunHistory
from kvscope.runtime import protocol as p
from kvscope.runtime.shm import ShmSlots
from kvscope.runtime.wire import RecordEncoder
from kvscope.sources.base import StepRecord
from kvscope.sysinfo import MemoryReading, process_rss

SIZES = (2_912, 65_536, 1_048_576)
RUNNING = 256


def _traffic(n_total: int):
    vocab = tiny_model()[0].config.vocab_size
    mix = length_mix(n_total, 41, (100, 400), (32, 320))
    prompts = random_prompts([p for p, _ in mix], vocab, seed=42)
    return [(p, SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True)) for p, (_, o) in zip(prompts, mix)]


def deep_size(root, exclude=()) -> int:
    """Bytes of every object reachable from ``root``, each counted once (classes and modules excluded,
    and ``exclude``: the latest snapshot, which is the engine's present state, not the timeline's past)."""
    import sys
    import types

    seen, stack, total = {id(x) for x in exclude}, [root], 0
    skip = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        stack.extend(gc.get_referents(obj))
    return total


def measure(num_blocks: int, steps: int, scrubs: int = 30) -> dict:
    running = min(RUNNING, num_blocks // 48)  # a 2,912-block pool holds ~60 such requests
    engine = engine_for(
        tiny_model(),
        block_size=16,
        num_gpu_blocks=num_blocks,
        max_num_seqs=running,
        max_num_batched_tokens=max(2048, running * 400),
        max_model_len=4096,
    )
    install_fake_runner(engine)
    traffic = iter(_traffic(steps * running // 100 + 4 * running))
    for _ in range(running):
        engine.add_request(*next(traffic))
    tune_gc()  # what kvscope's engine process does after a load (engine.gc_policy)
    history = RunHistory(budget_bytes=10 * 2**30)  # no budget cut: measure what 10,000 steps cost
    rss0 = process_rss()
    snap_ms = []
    t_run = time.perf_counter()
    for _ in range(steps):
        out = engine.step()
        for _ in range(len(engine.scheduler.waiting), running - len(engine.scheduler.running)):
            engine.add_request(*next(traffic))  # steady traffic: a finished request is replaced
        t0 = time.perf_counter()
        snap = engine.snapshot()
        snap_ms.append(1000 * (time.perf_counter() - t0))
        history.record(snap, 0.001, None, list(out.events))
    run_s = time.perf_counter() - t_run
    rss = process_rss() - rss0
    record_ms, per_batch = _records(engine, traffic, running, max(100, steps // 10))
    rng = random.Random(7)
    scrub = []
    for s in rng.sample(history.steps, min(scrubs, len(history.steps))):
        t0 = time.perf_counter()
        got = history.at(s)
        scrub.append(1000 * (time.perf_counter() - t0))
        assert got is not None and got.step == s
    held = deep_size(history, (history.latest,))
    return {
        "blocks": num_blocks,
        "running": running,
        "steps": steps,
        "timeline_mb": held / 2**20,
        "snapshot_ms": statistics.median(snap_ms),
        "snapshot_p90_ms": sorted(snap_ms)[int(0.9 * len(snap_ms))],
        "timeline_mb_estimate": history.nbytes / 2**20,
        "timeline_rss_mb": rss / 2**20,
        "scrub_ms": statistics.median(scrub),
        "scrub_max_ms": max(scrub),
        "run_s": run_s,
        "record_ms": record_ms,
        "steps_per_batch": per_batch,
    }


def _records(engine, traffic, running: int, steps: int) -> tuple[float, float]:
    """The engine process's side of the wire, as kvscope runs it, at the engine's own pace: each step's
    live state read and added to the batch, and, when a batch is due, the pool's arrays copied into a
    shared-memory slot and the batch pickled. Returns (ms a step, steps a batch)."""
    slots = ShmSlots.create(engine.pool.num_blocks)
    enc = RecordEncoder()
    enc.attach(slots)
    record_s, batches = 0.0, 0
    try:
        for _ in range(steps):
            out = engine.step()
            for _ in range(len(engine.scheduler.waiting), running - len(engine.scheduler.running)):
                engine.add_request(*next(traffic))
            t0 = time.perf_counter()
            enc.add(
                p.Stepped(
                    StepRecord(engine.step_count, engine.live_state(), list(out.events), out, 0.0), MemoryReading()
                )
            )
            if enc.due:
                batch = enc.flush()
                pickle.dumps(batch, pickle.HIGHEST_PROTOCOL)
                enc.release(batch.slot)
                batches += 1
            record_s += time.perf_counter() - t0
    finally:
        enc.flush()
        enc.detach()
        slots.close()
    return 1000 * record_s / steps, steps / max(batches, 1)


def run(quick: bool) -> dict:
    steps = 300 if quick else 10_000
    sizes = SIZES[:2] if quick else SIZES
    rows = [measure(n, steps if n != 1_048_576 else min(steps, 2_000)) for n in sizes]
    result = {"rows": rows}
    write_results("snapshot_scale", result, quick)
    print(
        table(
            rows,
            [
                ("blocks", "blocks", ",d"),
                ("running", "running", "d"),
                ("steps", "steps", ",d"),
                ("snapshot_ms", "snapshot ms (median)", ".2f"),
                ("snapshot_p90_ms", "p90", ".2f"),
                ("timeline_mb", "timeline MB (held)", ".0f"),
                ("timeline_mb_estimate", "its estimate", ".0f"),
                ("timeline_rss_mb", "RSS growth MB", ".0f"),
                ("scrub_ms", "scrub ms (median)", ".1f"),
                ("scrub_max_ms", "scrub ms (max)", ".1f"),
                ("record_ms", "engine-process record ms/step", ".2f"),
            ],
        )
    )
    return result


if __name__ == "__main__":
    main(run, __doc__)
