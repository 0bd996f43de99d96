"""The first lesson in a real window: how long after the command a class reads it, and can step it.

    python bench/lesson_start.py [--runs 3] [--scenario four-score]

Each run is ``kvscope --scenario NAME --window-size 1280x720`` (the engine in its own process, as a teacher runs
it) in a real X window (Xvfb, ``tests/real_window.py``'s driver: the times are taken in the window's process and
measured from the moment the test started the command). Three times a run:

- ``lesson_s``: the window on screen with the lesson's title and first note (it reads while the model loads);
- ``ready_s``: the engine loaded and step 0 drawn (the pool on screen);
- ``first_step_s``: F10 pressed as soon as the window showed, step 1 drawn (a Step pressed early runs when the
  engine is up).

The machine's load average is written beside them: on a shared machine it moves every number.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from real_window import RealWindow, Xvfb  # noqa: E402


def one(display: Xvfb, scenario: str) -> dict:
    with RealWindow(display, ["--scenario", scenario, "--window-size", "1280x720"], env={"OMP_NUM_THREADS": "1"}) as w:
        while True:  # as soon as the window is on screen: F10, as an impatient teacher would
            shown = w.ask({"do": "window"}, timeout=300)
            if shown["x_window"] and shown["exposed_s"] is not None:
                break
            time.sleep(0.05)
        w.key("F10")
        first = w.ask({"do": "wait", "for": "step", "step": 1}, timeout=600)
        w.close()
    return {"lesson_s": shown["exposed_s"], "ready_s": first["ready_s"], "first_step_s": first["at_s"]}


def run() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--scenario", default="four-score")
    args = ap.parse_args()
    runs = []
    with Xvfb((1280, 720)) as display:
        for _ in range(args.runs):
            load = os.getloadavg()[0]
            r = one(display, args.scenario)
            r["load_average"] = load
            runs.append(r)
            print(json.dumps(r), flush=True)
    median = {k: statistics.median(r[k] for r in runs) for k in ("lesson_s", "ready_s", "first_step_s")}
    out = {"scenario": args.scenario, "runs": runs, "median": median, "cpus": os.cpu_count()}
    path = ROOT / "bench" / "results" / "lesson_start.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"median: {median} ({os.cpu_count()} CPUs) -> {path}")


if __name__ == "__main__":
    run()
