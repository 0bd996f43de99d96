"""Block-grid redraw time (offscreen): set a new snapshot and paint the widget, median of 20.

    QT_QPA_PLATFORM=offscreen python bench/grid_redraw.py
"""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import numpy as np  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

from engine.inspect.snapshot import assemble_snapshot  # noqa: E402
from kvscope.views.block_grid import BlockGridView  # noqa: E402


def fake_snapshot(n: int, step: int, rng) -> object:
    ref = rng.integers(0, 4, n).astype(np.int32)
    return assemble_snapshot(step, 16, ref_cnt=ref, has_hash=rng.random(n) < 0.3,
                             last_access=rng.integers(0, step + 1, n), free_queue=np.flatnonzero(ref == 0),
                             requests=[], cached_tokens={}, block_hashes={}, counters={}, num_cpu_blocks=0)


def measure(sizes=(16_384, 262_144, 1_048_576), repeats: int = 20) -> list[dict]:
    """Median redraw time per pool size (needs a QApplication)."""
    view = BlockGridView()
    view.resize(900, 900)
    view.show()
    rng = np.random.default_rng(0)
    rows = []
    for n in sizes:
        snaps = [fake_snapshot(n, i + 1, rng) for i in range(repeats + 1)]
        times = []
        for s in snaps:
            t = time.perf_counter()
            view.set_snapshot(s)
            view.grab()  # forces the paint that ImageItem defers
            times.append(time.perf_counter() - t)
        rows.append({"blocks": n, "median_ms": 1000 * statistics.median(times[1:])})
    view.close()
    return rows


def main() -> None:
    app = QApplication.instance() or QApplication([])
    rows = measure()
    print("| blocks | redraw (median of 20) |\n|---:|---:|")
    for r in rows:
        print(f"| {r['blocks']:,} | {r['median_ms']:.1f} ms |")
    (Path(__file__).parent / "results" / "grid_redraw.json").write_text(json.dumps(rows, indent=2))
    app.quit()


if __name__ == "__main__":
    main()
