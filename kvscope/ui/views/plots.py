"""Time series over steps: block usage, hit rate, requests, tokens/s, time to first token, memory vs pool.

Curve colours come from ``kvscope.ui.palette`` (a block curve takes its state's colour). A series the
history does not record (yet) is simply not drawn. ``set_cursor(step)`` draws a vertical line at
that step on every plot (the timeline's position); ``set_cursor(None)`` hides it.

The plots draw the timeline's series (``kvscope.history``), so they reach as far back as it does: its
bounds (``kvscope.limits``) are theirs, and the line under the plots says where the reach begins.

Two plots carry the diagnosis labs: "time to first token" (one point a request) beside "tokens / s"
split into all output and decode, so a prefix-cache hit that shortens the first but not the second
shows as what it is; and "memory vs pool" on a log axis, the pool's fixed size and its use against
what the device (or, on a CPU, the machine) still has free.
"""
from __future__ import annotations

import time

import numpy as np
import pyqtgraph as pg
from PySide6.QtWidgets import QLabel, QSizePolicy, QVBoxLayout, QWidget

from kvscope.history import RunHistory
from kvscope.limits import timeline_text
from kvscope.ui.palette import SERIES_COLOURS

CURVES = {  # plot title -> series
    "blocks": ["free", "cached", "used"],
    "prefix-cache hit rate": ["hit_rate"],
    "requests": ["running", "waiting", "swapped"],
    "tokens / s": ["tokens_per_s", "decode_tokens_per_s"],
    "time to first token (ms), one point a request": ["ttft"],
    "memory vs pool (MiB, log scale)": ["pool_bytes", "pool_used", "device_free", "process_rss", "nvml_used",
                                        "torch_allocated", "torch_reserved"],
}
MEMORY_PLOT = "memory vs pool (MiB, log scale)"
MIB = {"process_rss", "nvml_used", "torch_allocated", "torch_reserved", "device_free"}
LABELS = {"cached": "cached (free, hashed)", "hit_rate": "hit rate", "tokens_per_s": "all output",
          "decode_tokens_per_s": "decode only", "pool_bytes": "KV pool (sized at start-up)",
          "pool_used": "pool in use", "device_free": "device free", "process_rss": "process",
          "nvml_used": "GPU used (nvml)", "torch_allocated": "torch allocated", "torch_reserved": "torch reserved"}
HIDDEN_EVERY_S = 1.0  # plots behind another tab are redrawn at most this often once their series are long
LONG = 5_000  # steps: a redraw copies every series (a long served run: megabytes a frame)
FULL = 0.95  # a pool this full (at some step of the last RECENT), with requests preempted or waiting, is exhausted
RECENT = 16


def pool_story(usage: float, waiting: int, preemptions: int, pool_bytes: int, device_free: int | None) -> str:
    """One line: how full the pool is against what the device has free, and what that means."""
    pool = f"KV pool {pool_bytes / 2**20:,.1f} MiB, {usage:.0%} in use at its fullest of the last {RECENT} steps"
    free = f" · device free {device_free / 2**30:,.1f} GiB" if device_free else ""
    if usage >= FULL and (waiting or preemptions) and device_free and device_free > pool_bytes:
        return (f"{pool}{free}: the pool is exhausted while the device has memory free. Its size was fixed at "
                f"start-up: raise --num-gpu-blocks or --gpu-memory-utilization, or hold less in the prefix cache")
    return pool + free


def reach_text(history: RunHistory) -> str:
    """Where the plots (the timeline's series) begin, once the timeline's bounds have dropped older steps."""
    first = history.reach[0] if history.reach else 0
    return (f"plots from step {first:,} ({history.dropped_steps:,} older steps dropped: "
            f"{timeline_text(history.budget_bytes, history.max_requests)})")


class PlotsPanel(QWidget):
    def __init__(self) -> None:
        super().__init__()
        self.layout_widget = pg.GraphicsLayoutWidget()
        self.layout_widget.setMinimumSize(160, 120)
        self.curves: dict[str, pg.PlotDataItem] = {}
        self.plots: list[pg.PlotItem] = []
        self.cursors: list[pg.InfiniteLine] = []
        self.cursor_step: int | None = None
        self.block_bytes = 0  # set_pool(): the pool's curves need a block's size
        self._pending: tuple | None = None  # the last (history, memory) asked for
        self._drawn_at = 0.0
        for i, (title, series) in enumerate(CURVES.items()):
            p = self.layout_widget.addPlot(row=i // 3, col=i % 3, title=title)
            p.setMinimumSize(60, 50)
            if len(series) > 1:
                p.addLegend(offset=(-5, 5), labelTextSize="8pt")
            p.showGrid(x=True, y=True, alpha=0.2)
            # a long session's series: drawn at most a few points a pixel, and only the part in view
            p.setDownsampling(auto=True, mode="peak")
            p.setClipToView(True)
            if title == MEMORY_PLOT:
                p.setLogMode(y=True)
            for name in series:
                colour = SERIES_COLOURS[name]
                if name == "ttft":  # one point a request, not a line
                    item = p.plot([], [], pen=None, symbol="o", symbolSize=7, symbolBrush=colour,
                                  symbolPen=None, name="request")
                else:
                    width = 3 if name == "pool_bytes" else 2
                    item = p.plot([], [], pen=pg.mkPen(colour, width=width), name=LABELS.get(name, name))
                self.curves[name] = item
            line = pg.InfiniteLine(angle=90, movable=False, pen=pg.mkPen((255, 255, 255, 150), width=1,
                                                                           style=pg.QtCore.Qt.PenStyle.DashLine))
            line.setVisible(False)
            p.addItem(line, ignoreBounds=True)
            if self.plots:
                p.setXLink(self.plots[0])  # one step axis for every plot
            self.plots.append(p)
            self.cursors.append(line)
        self.memory_label = QLabel("memory: waiting for the engine")
        self.memory_label.setWordWrap(True)
        self.memory_label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.memory_label.setToolTip(f"the plots reach as far back as the timeline: {timeline_text()}")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(self.layout_widget, 1)
        lay.addWidget(self.memory_label)

    def set_pool(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes

    def set_cursor(self, step: int | None) -> None:
        """A vertical line at ``step`` on every plot (None: no line, the live view)."""
        self.cursor_step = step
        for line in self.cursors:
            line.setVisible(step is not None)
            if step is not None:
                line.setValue(step)

    def _series(self, history: RunHistory, name: str) -> np.ndarray | None:
        """A series as an array (each frame redraws the whole run: array arithmetic, not a Python loop)."""
        s = history.series
        if name in ("pool_bytes", "pool_used"):
            if not self.block_bytes or "free" not in s:
                return None
            blocks = np.asarray(s["used"]) if name == "pool_used" else \
                np.asarray(s["free"]) + np.asarray(s["cached"]) + np.asarray(s["used"])
            return blocks * (self.block_bytes / 2**20)
        ys = s.get(name)
        if ys is None:
            return None
        ys = np.array(ys, np.float64)  # a copy: the history's array must stay free to grow
        return ys / 2**20 if name in MIB else ys

    def update_from(self, history: RunHistory, memory=None) -> None:
        """Draw the history's series. Plots no one can see (another tab in front) with long series are
        redrawn at most every ``HIDDEN_EVERY_S``, and at once when they are shown."""
        self._pending = (history, memory)
        if not self.isVisible() and len(history.steps) > LONG \
                and time.monotonic() - self._drawn_at < HIDDEN_EVERY_S:
            return
        self._draw(history, memory)

    def showEvent(self, event) -> None:  # noqa: N802 - Qt's name
        super().showEvent(event)
        if self._pending is not None:
            self._draw(*self._pending)

    def _draw(self, history: RunHistory, memory=None) -> None:
        self._drawn_at = time.monotonic()
        x = np.asarray(history.steps)
        for name, curve in self.curves.items():
            if name == "ttft":
                steps, seconds = history.ttft_arrays()
                ms = seconds * 1000
                curve.setData(steps, ms)
                top = float(ms.max()) if len(ms) else 1.0
                curve.getViewBox().setYRange(0, top * 1.15)  # from 0: short vs long reads true
                continue
            ys = self._series(history, name)
            if ys is None or len(ys) != len(x) or (name in MIB and not ys.any()):
                curve.setData([], [])  # not recorded, or not on this machine (no nvml, no CUDA)
                continue
            if name in MIB or name.startswith("pool"):
                ys = np.maximum(ys, 1e-3)  # a log axis has no 0
            curve.setData(x, ys)
        self.memory_label.setText(self.memory_text(history, memory))

    def memory_text(self, history: RunHistory, memory=None) -> str:
        parts = []
        s = history.series
        if self.block_bytes and history.steps:
            total = s["free"][-1] + s["cached"][-1] + s["used"][-1]
            usage = max(s["used"][-RECENT:]) / total if total else 0.0
            c = history.counters_at(history.steps[-1])
            parts.append(pool_story(usage, int(s["waiting"][-1]), int(c.get("num_preemptions", 0)),
                                    int(total * self.block_bytes), getattr(memory, "device_free", None)))
        if memory is not None:
            if memory.nvml_total:
                parts.append(f"{memory.nvml_status}: {memory.nvml_used / 2**30:.2f} / "
                             f"{memory.nvml_total / 2**30:.2f} GiB")
            else:
                parts.append(memory.nvml_status)
            if memory.torch_allocated is not None:
                parts.append(f"torch allocated {memory.torch_allocated / 2**30:.2f} GiB, "
                             f"reserved {memory.torch_reserved / 2**30:.2f} GiB")
            parts.append(f"process {memory.process_rss / 2**20:.0f} MiB")
        _, seconds = history.ttft_arrays()
        if len(seconds):
            ms = np.sort(seconds) * 1000
            parts.append(f"time to first token: median {ms[len(ms) // 2]:.0f} ms over {len(ms)} requests")
        if history.dropped_steps:
            parts.append(reach_text(history))
        return " · ".join(parts) if parts else "memory: waiting for the engine"
