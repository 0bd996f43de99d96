"""Block-grid redraw times (offscreen), medians of 20, side by side in one run.

    QT_QPA_PLATFORM=offscreen python bench/grid_redraw.py

- ``full``: a new snapshot into the whole grid widget (codes, detail image, overview, legend) and a paint;
- ``overview``: the overview alone (downsample by priority, image, paint) for a new snapshot's codes;
- the detail view at the largest pool (1,048,576 blocks) at each level of detail: a new snapshot and a paint of the
  detail plot, and a pan (no new snapshot) and a paint.
The overview's budget is 16 ms at 1,048,576 blocks (one frame at 60 Hz).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import numpy as np  # noqa: E402
from PySide6.QtCore import QPointF  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

from engine.inspect.snapshot import RequestInfo, assemble_snapshot  # noqa: E402
from kvscope.ui.views.block_grid import BlockGridView
from kvscope.ui.views.grid_cells import BORDER_PX, LABEL_PX, DetailLevel, codes_for, slots_px, to_grid

BLOCK_SIZE = 16


def fake_snapshot(n: int, step: int, rng) -> object:
    ref = rng.integers(0, 4, n).astype(np.int32)
    # One request over the first blocks, so the slot level has tokens to draw.
    held = np.flatnonzero(ref[:4096] > 0)[:256]
    tokens = tuple(int(t) for t in rng.integers(0, 50_000, len(held) * BLOCK_SIZE))
    req = RequestInfo("0", 0, "RUNNING", len(tokens), 0, 0, len(tokens), tuple(int(b) for b in held), "", tokens)
    return assemble_snapshot(
        step,
        BLOCK_SIZE,
        ref_cnt=ref,
        has_hash=rng.random(n) < 0.3,
        last_access=rng.integers(0, step + 1, n),
        free_queue=np.flatnonzero(ref == 0),
        requests=[req],
        cached_tokens={},
        block_hashes={},
        counters={},
        num_cpu_blocks=0,
    )


def median_ms(times: list[float]) -> float:
    return 1000 * statistics.median(times[1:])  # the first run warms caches


def _view() -> BlockGridView:
    view = BlockGridView()
    view.resize(1200, 800)
    view.show()
    view.set_decode(lambda ids: " ".join(f"t{i}" for i in ids))
    return view


def _timed(fn, items) -> float:
    times = []
    for it in items:
        t = time.perf_counter()
        fn(it)
        times.append(time.perf_counter() - t)
    return median_ms(times)


def measure_all(sizes=(16_384, 262_144, 1_048_576), repeats: int = 20) -> dict:
    """Full and overview redraws per pool size, and the detail view's levels at the largest (needs a QApplication)."""
    view = _view()
    rng = np.random.default_rng(0)
    out = {"full": [], "overview": [], "detail": []}
    snaps = {}
    for n in sizes:
        snaps[n] = [fake_snapshot(n, i + 1, rng) for i in range(repeats + 1)]
        out["full"].append({"blocks": n, "median_ms": _timed(lambda s: (view.set_snapshot(s), view.grab()), snaps[n])})
        grids = []
        for s in snaps[n]:
            codes, lut = codes_for(s, "state")
            grids.append((to_grid(codes, len(lut) - 1), lut))
        out["overview"].append(
            {"blocks": n, "median_ms": _timed(lambda g: (view.overview.set_grid(*g), view.overview.grab()), grids)}
        )
    n = sizes[-1]
    for level, px in (
        (DetailLevel.CELLS, 1.0),
        (DetailLevel.BORDERS, BORDER_PX * 1.5),
        (DetailLevel.LABELS, LABEL_PX * 1.5),
        (DetailLevel.SLOTS, slots_px(BLOCK_SIZE) * 1.2),
    ):
        view.zoom_to(px, QPointF(20, 10) if level >= DetailLevel.LABELS else None)
        assert view.detail_level == level, (level, view.pixels_per_cell())
        new = _timed(lambda s: (view.set_snapshot(s), view.plot.grab()), snaps[n])
        pan = _timed(lambda i: (view.pan_by(0.02 if i % 2 else -0.02, 0), view.plot.grab()), range(repeats + 1))
        out["detail"].append(
            {
                "blocks": n,
                "level": level.name.lower(),
                "px_per_cell": round(view.pixels_per_cell(), 1),
                "cells_with_text": view.layer.painted_cells,
                "new_snapshot_ms": new,
                "pan_ms": pan,
            }
        )
    view.close()
    return out


def measure(sizes=(16_384, 262_144, 1_048_576), repeats: int = 20) -> list[dict]:
    """Median full-grid redraw per pool size (bench/inspector_cost.py uses it)."""
    view = _view()
    rng = np.random.default_rng(0)
    rows = []
    for n in sizes:
        snaps = [fake_snapshot(n, i + 1, rng) for i in range(repeats + 1)]
        rows.append({"blocks": n, "median_ms": _timed(lambda s: (view.set_snapshot(s), view.grab()), snaps)})
    view.close()
    return rows


def main() -> None:
    app = QApplication.instance() or QApplication([])
    res = measure_all()
    print("| blocks | full grid redraw | overview redraw (budget 16 ms) |\n|---:|---:|---:|")
    for f, o in zip(res["full"], res["overview"]):
        print(f"| {f['blocks']:,} | {f['median_ms']:.1f} ms | {o['median_ms']:.1f} ms |")
    print(
        f"\n| detail level at {res['detail'][0]['blocks']:,} blocks | px/cell | cells with text | new snapshot "
        "| pan |\n|---|---:|---:|---:|---:|"
    )
    for d in res["detail"]:
        print(
            f"| {d['level']} | {d['px_per_cell']} | {d['cells_with_text']} | {d['new_snapshot_ms']:.1f} ms "
            f"| {d['pan_ms']:.1f} ms |"
        )
    (Path(__file__).parent / "results" / "grid_redraw.json").write_text(json.dumps(res, indent=2))
    app.quit()


if __name__ == "__main__":
    main()
