"""Start-up: how long until the window is ready, cold (the GGUF converted) and warm (read from the cache),
and how long a scenario picked from the menu takes (the weights stay in memory).

    python bench/startup.py [--quick]

Each start is a fresh process (``python -c``: an offscreen window with the engine in its own process, as
``kvscope`` runs), timed from the process's start to the first snapshot on screen. The cold start uses an
empty cache folder (``KVSCOPE_CACHE_DIR``), the warm ones the same folder afterwards. ``--quick`` uses the
tiny random model (no conversion), for CI.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import main, table, tiny_model, write_results

ROOT = Path(__file__).resolve().parents[1]
PROBE = r"""
import json, os, sys, time
t0 = float(sys.argv[1])
os.environ["QT_QPA_PLATFORM"] = "offscreen"
def run():
    # the order of kvscope's own start (kvscope/__main__.py): the engine process first, then Qt
    from engine import EngineConfig
    from kvscope.sources import protocol as p
    from kvscope.runtime.build import SourceSpec
    from kvscope.runtime.engine_process import spawn_engine
    spec = SourceSpec(EngineConfig(model=sys.argv[2] or None))
    early = spawn_engine(spec, 20, p.Load(None))
    from PySide6.QtCore import QSettings
    from PySide6.QtWidgets import QApplication
    from kvscope.ui.main_window import MainWindow
    from kvscope.ui.worker import ProcessBackend
    app = QApplication([])
    settings = QSettings(os.devnull, QSettings.Format.IniFormat)
    win = MainWindow(ProcessBackend(spec, early=early), settings)
    win.show(); win.start()
    def wait(cond):
        while not cond():
            app.processEvents(); time.sleep(0.005)
    wait(lambda: win.latest is not None)
    ready = time.time() - t0
    load = win.info.load_seconds  # this start's; the scenario below reuses the weights
    t1 = time.time()
    win.load_scenario(sys.argv[3])
    wait(lambda: win.info is not None and win.latest is not None)
    out = {"ready_s": ready, "scenario_s": time.time() - t1, "load_s": load}
    win.close()
    print("RESULT " + json.dumps(out))
if __name__ == "__main__":
    run()
"""


def start(cache: str, model: str, scenario: str) -> dict:
    env = {**os.environ, "KVSCOPE_CACHE_DIR": cache, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    import time

    t0 = time.time()
    r = subprocess.run(
        [sys.executable, "-c", PROBE, str(t0), model, scenario],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"the probe failed: {r.stderr[-2000:]}")
    return json.loads(line[len("RESULT ") :])


def run(quick: bool) -> dict:
    if quick:
        folder = tempfile.mkdtemp()
        tiny_model()[0].save_pretrained(folder)
        model, scenario = folder, ""
    else:
        model, scenario = "", "four-score"
    cache = tempfile.mkdtemp(prefix="kvscope-cache-")
    cold = start(cache, model, scenario)
    warm = [start(cache, model, scenario) for _ in range(1 if quick else 3)]
    rows = [
        {"start": "cold (converts the GGUF)" if not quick else "first", **cold},
        *({"start": f"warm {i + 1} (the cached conversion)", **w} for i, w in enumerate(warm)),
    ]
    result = {
        "model": "tiny random Llama" if quick else "SmolLM2-135M-Instruct (embedded)",
        "rows": rows,
        "warm_ready_median_s": statistics.median(w["ready_s"] for w in warm),
        "scenario_median_s": statistics.median(w["scenario_s"] for w in warm),
    }
    write_results("startup", result, quick)
    print(
        table(
            rows,
            [
                ("start", "start", ""),
                ("ready_s", "window ready, s", ".1f"),
                ("load_s", "engine load, s", ".1f"),
                ("scenario_s", "pick a scenario, s", ".1f"),
            ],
        )
    )
    return result


if __name__ == "__main__":
    main(run, __doc__)
