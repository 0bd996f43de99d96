"""Trace replay's memory: does a large trace replay in bounded memory?

    python bench/replay_memory.py [--quick]

A trace is recorded with a fake runner (``common.install_fake_runner``) on a 2,912-block pool with 60
requests of steady traffic (prompts 100-400 tokens, outputs 32-320), each finished one replaced, until
the file reaches its target size (13 MB: the size whose replay held 240 MB before replay streamed).
Then, in a fresh process, ``ReplaySource`` steps through every record while the process's resident
memory is sampled each step: the growth over the replay (peak minus start) is what replay costs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from snapshot_scale import _traffic

from common import engine_for, install_fake_runner, main, pyplot, save_figure, table, write_results

TARGET_MB = 13


def record(path: Path, target_mb: float) -> int:
    from common import tiny_model
    from kvscope.sources.live import LiveSource

    running = 60
    engine = engine_for(
        tiny_model(),
        block_size=16,
        num_gpu_blocks=2_912,
        max_num_seqs=running,
        max_num_batched_tokens=max(2048, running * 400),
        max_model_len=4096,
    )
    install_fake_runner(engine)
    src = LiveSource(engine, trace_path=str(path))
    traffic = iter(_traffic(100_000))
    steps = 0
    while True:
        for _ in range(len(engine.scheduler.waiting), running - len(engine.scheduler.running)):
            src.inject(*next(traffic))
        src.step()
        steps += 1
        if steps % 100 == 0 and path.stat().st_size >= target_mb * 2**20:
            break
    src.close()
    return steps


REPLAY = """
import sys
from kvscope.sources.replay import ReplaySource
from kvscope.sysinfo import process_rss
start = process_rss()
src = ReplaySource(sys.argv[1])
peak = process_rss()
n = 0
while src.has_work():
    src.step()
    n += 1
    peak = max(peak, process_rss())
src.close()
print(n, start, peak)
"""


def replay(path: Path) -> tuple[int, int, int]:
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", REPLAY, str(path)],
        capture_output=True,
        text=True,
        check=True,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    n, start, peak = map(int, out.stdout.split()[-3:])
    return n, start, peak


def run(quick: bool) -> dict:
    target = 1 if quick else TARGET_MB
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "big.kvtrace"
        steps = record(path, target)
        size = path.stat().st_size
        n, start, peak = replay(path)
    row = {
        "trace_mb": size / 2**20,
        "steps": steps,
        "replayed": n,
        "rss_start_mb": start / 2**20,
        "rss_growth_mb": (peak - start) / 2**20,
    }
    write_results("replay_memory", {"rows": [row]}, quick)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 2.5))
    ax.barh(["trace file", "replay's memory growth"], [row["trace_mb"], row["rss_growth_mb"]], color=["#888", "#2a7"])
    ax.set_xlabel("MB")
    save_figure(fig, "replay_memory", quick)
    print(
        table(
            [row],
            [
                ("trace_mb", "trace MB", ".1f"),
                ("steps", "steps", "d"),
                ("replayed", "replayed", "d"),
                ("rss_start_mb", "RSS at start, MB", ".0f"),
                ("rss_growth_mb", "RSS growth, MB", ".0f"),
            ],
        )
    )
    return {"rows": [row]}


if __name__ == "__main__":
    main(run, __doc__)
