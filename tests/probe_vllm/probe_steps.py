"""The probe's cost per step on vLLM's real scheduler at GPU size (runs in the vLLM environment; bench/probe_cost.py
starts it): a pool of ``--num-blocks`` blocks, ``--running`` requests decoding, stepped with made-up outputs, with
the probe on and a subscriber attached, or with no probe. Prints one JSON object: the step times (schedule to the
end of update_from_output, the probe's end-of-step work included) and, with the probe, its end-of-step time alone;
each as wall time and as CPU time (the process's, all its threads, the probe's I/O thread included; the end of the
step's, its own thread's), which other jobs on a shared machine do not stretch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import add, make_scheduler, step  # noqa: E402

SUBSCRIBER = """
import sys, time, zmq
from kvscope_vllm_probe.wire import Hello, Heartbeat, PROTOCOL, encode
s = zmq.Context().socket(zmq.DEALER); s.connect(sys.argv[1]); s.send(encode(Hello(PROTOCOL, "bench subscriber")))
beat = time.monotonic()
while True:
    if s.poll(200):
        while True:
            try:
                s.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
    if time.monotonic() - beat > 1:
        s.send(encode(Heartbeat())); beat = time.monotonic()
"""


def thread_cpu() -> dict[int, tuple[str, float]]:
    """Each thread of this process: its name and CPU seconds so far (Linux's /proc; empty elsewhere). The clock
    ticks every 10 ms here: read over hundreds of steps."""
    out: dict[int, tuple[str, float]] = {}
    tick = os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / tick)  # utime, stime
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-blocks", type=int, default=65_536)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--endpoint", default=None, help="the probe's endpoint (none: no probe)")
    ap.add_argument("--no-subscriber", action="store_true", help="the probe on, nobody listening")
    ap.add_argument("--groups", default="full", help="KV cache groups (harness.py): e.g. sliding:512,full")
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="one process, the probe switched off and on a cycle at a time (probe_switch.py): bare_step_s too",
    )
    args = ap.parse_args()
    sub = None
    switch = None
    if args.interleave:
        from probe_switch import ProbeSwitch
        from vllm.v1.core.block_pool import BlockHashToBlockMap
        from vllm.v1.core.kv_cache_utils import KVCacheBlock

        switch = ProbeSwitch(KVCacheBlock, BlockHashToBlockMap)  # vLLM's own class attributes, before the probe
    if args.endpoint:
        os.environ["KVSCOPE_PROBE_ENDPOINT"] = args.endpoint
        from kvscope_vllm_probe.plugin import register

        register()
    s = make_scheduler(
        args.num_blocks,
        args.block_size,
        max_num_seqs=args.running,
        max_num_batched_tokens=args.running * args.prompt,
        groups=args.groups,
    )
    probe = getattr(s, "_kvscope_probe", None)
    if switch is not None:
        assert probe is not None, "--interleave needs the probe (--endpoint)"
        switch.attach(s)
    if args.endpoint and not args.no_subscriber:
        assert probe is not None, "the probe did not start"
        sub = subprocess.Popen([sys.executable, "-c", SUBSCRIBER, args.endpoint])
        deadline = time.monotonic() + 30
        while not probe.io.has_subscribers and time.monotonic() < deadline:
            time.sleep(0.05)
        assert probe.io.has_subscribers, "the subscriber did not join"
    for i in range(args.running):  # distinct prompts sharing a system prompt of 256 tokens
        add(s, f"r{i}", list(range(1000, 1256)) + [5000 + i] * (args.prompt - 256), max_tokens=10_000)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in s.requests.values()):
        step(s)  # the prefills, not timed
    import gc

    gc.collect()
    gc.freeze()  # as vLLM's engine core does once it is built (freeze_gc_heap): the pool is not scanned again
    end_step, end_step_cpu = [], []
    if probe is not None:
        original = probe.end_step

        def timed_end_step():
            t, c = time.perf_counter(), time.thread_time()
            original()
            end_step.append(time.perf_counter() - t)
            end_step_cpu.append(time.thread_time() - c)

        probe.end_step = timed_end_step
    times, cpu = [], []
    bare_times, bare_cpu = [], []
    threads_before = thread_cpu()

    def timed_step(wall: list[float], cpu_s: list[float]) -> None:
        t, c = time.perf_counter(), time.process_time()
        step(s)
        wall.append(time.perf_counter() - t)
        cpu_s.append(time.process_time() - c)

    if switch is None:
        for _ in range(args.steps):
            timed_step(times, cpu)
    else:
        # Whole cycles of the load (all requests cross a block's end together: a cycle is a block's tokens), in
        # turn: one without the probe, one with it untimed (it forgot what it sent: that step sends every row
        # whole), one with it timed; ``--steps`` timed with the probe and as many without.
        cycle = args.block_size
        while len(times) < args.steps:
            switch.off()
            for _ in range(cycle):
                timed_step(bare_times, bare_cpu)
            switch.on()
            mark = len(end_step)
            for _ in range(cycle):
                step(s)
            del end_step[mark:], end_step_cpu[mark:]  # the untimed cycle's: the timed cycles' alone are kept
            for _ in range(cycle):
                timed_step(times, cpu)
    threads_after = thread_cpu()
    # the CPU of the threads that are not vLLM's (the probe's I/O thread, ZeroMQ's) over the steps timed: the share
    # of the step's process CPU that a wake-up of theirs costs, read per thread (in --interleave, over both turns)
    before = {tid: cpu_s for tid, (_name, cpu_s) in threads_before.items()}
    spent = {tid: (name, cpu_s - before.get(tid, 0.0)) for tid, (name, cpu_s) in threads_after.items()}
    io_cpu = spent.get(probe.io._thread.native_id, ("", 0.0))[1] if probe is not None else 0.0
    zmq_cpu = sum(cpu_s for name, cpu_s in spent.values() if name.startswith("ZMQbg"))
    used = args.num_blocks - s.kv_cache_manager.block_pool.get_num_free_blocks()
    if len(s.running) != args.running:  # the load ran past the pool: the steps measured preemption, not the probe
        raise SystemExit(f"{len(s.running)} of {args.running} requests still running: fewer --steps, or more blocks")
    print(
        json.dumps(
            {
                "step_s": times,
                "step_cpu_s": cpu,
                "bare_step_s": bare_times,
                "bare_step_cpu_s": bare_cpu,
                "end_step_s": end_step,
                "end_step_cpu_s": end_step_cpu,
                "blocks_used": used,
                "cycle": args.block_size if switch is not None else 0,  # the steps of a turn (--interleave)
                "probe_io_cpu_s": io_cpu,
                "zmq_cpu_s": zmq_cpu,
                "running": len(s.running),
            }
        )
    )
    if sub is not None:
        sub.kill()
    if hasattr(s, "shutdown"):
        s.shutdown()


if __name__ == "__main__":
    main()
