"""Time series over steps: block usage, hit rate, evictions, requests, tokens/s, time to first token, memory.

Curve colours come from ``kvscope.ui.palette`` (a block curve takes its state's colour). A series the
history does not record (yet) is simply not drawn. A plot's legend is its title's second line (it never
covers a line); every plot keeps a least height at the text size, and below it the panel scrolls.
``set_cursor(step)`` draws a vertical line at that step on every plot (the timeline's position);
``set_cursor(None)`` hides it.

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
from PySide6.QtGui import QFont
from PySide6.QtWidgets import QFrame, QLabel, QScrollArea, QSizePolicy, QVBoxLayout, QWidget

from kvscope.history import RunHistory
from kvscope.limits import timeline_text
from kvscope.ui.palette import SERIES_COLOURS
from kvscope.ui.style import text_scale

CURVES = {  # plot title -> series, four plots a row
    "blocks": ["free", "cached", "used"],
    "prefix-cache hit rate": ["hit_rate"],
    "evictions / s": ["evictions_per_s"],
    "requests": ["running", "waiting", "swapped"],
    "tokens / s": ["tokens_per_s", "decode_tokens_per_s"],
    "time to first token (ms)": ["ttft"],
    "memory vs pool (MiB, log)": [
        "pool_bytes",
        "pool_used",
        "device_free",
        "process_rss",
        "nvml_used",
        "torch_allocated",
        "torch_reserved",
    ],
}
MEMORY_PLOT = "memory vs pool (MiB, log)"
MIB = {"process_rss", "nvml_used", "torch_allocated", "torch_reserved", "device_free"}
COLUMNS = 4
MIN_PLOT_H = 100  # px at text scale 1: below it tick labels overlap; the panel scrolls instead (1280x720)
LABELS = {
    "cached": "cached",
    "hit_rate": "hit rate",
    "tokens_per_s": "all output",
    "decode_tokens_per_s": "decode only",
    "pool_bytes": "KV pool",
    "pool_used": "in use",
    "device_free": "device free",
    "process_rss": "process",
    "nvml_used": "GPU used (nvml)",
    "torch_allocated": "torch allocated",
    "torch_reserved": "torch reserved",
}
HIDDEN_EVERY_S = 1.0  # plots behind another tab are redrawn at most this often once their series are long
LONG = 5_000  # steps: a redraw copies every series (a long served run: megabytes a frame)
FULL = 0.95  # a pool this full (at some step of the last RECENT), with requests preempted or waiting, is exhausted
RECENT = 16


def pool_story(usage: float, waiting: int, preemptions: int, pool_bytes: int, device_free: int | None) -> str:
    """One line: how full the pool is against what the device has free, and what that means."""
    pool = f"KV pool {pool_bytes / 2**20:,.1f} MiB, {usage:.0%} in use at its fullest of the last {RECENT} steps"
    free = f" · device free {device_free / 2**30:,.1f} GiB" if device_free else ""
    if usage >= FULL and (waiting or preemptions) and device_free and device_free > pool_bytes:
        return (
            f"{pool}{free}: the pool is exhausted while the device has memory free. Its size was fixed at "
            f"start-up: raise --num-gpu-blocks or --gpu-memory-utilization, or hold less in the prefix cache"
        )
    return pool + free


def reach_text(history: RunHistory) -> str:
    """Where the plots (the timeline's series) begin, once the timeline's bounds have dropped older steps."""
    first = history.reach[0] if history.reach else 0
    return (
        f"plots from step {first:,} ({history.dropped_steps:,} older steps dropped: "
        f"{timeline_text(history.budget_bytes, history.max_requests)})"
    )


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
        # a plot's legend is a second line of its title, each label in its line's colour: it never covers a
        # line and needs no room of its own; a series not recorded on this machine (no nvml) is not listed
        self.in_legend: set[str] = set()
        self.titles: list[str] = []
        for i, (title, series) in enumerate(CURVES.items()):
            row, col = i // COLUMNS, i % COLUMNS
            p = self.layout_widget.addPlot(row=row, col=col, title=title)
            p.setMinimumSize(60, 50)
            p.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Expanding)
            p.setPreferredWidth(100)  # every column the same (the stretch shares what is left equally)
            p.showGrid(x=True, y=True, alpha=0.2)
            # a long session's series: drawn at most a few points a pixel, and only the part in view
            p.setDownsampling(auto=True, mode="peak")
            p.setClipToView(True)
            if title == MEMORY_PLOT:
                p.setLogMode(y=True)
            for name in series:
                colour = SERIES_COLOURS[name]
                if name == "ttft":  # one point a request, not a line
                    item = p.plot([], [], pen=None, symbol="o", symbolSize=7, symbolBrush=colour, symbolPen=None)
                else:
                    width = 3 if name == "pool_bytes" else 2
                    item = p.plot([], [], pen=pg.mkPen(colour, width=width))
                if len(series) > 1:
                    self.in_legend.add(name)
                self.curves[name] = item
            line = pg.InfiniteLine(
                angle=90,
                movable=False,
                pen=pg.mkPen((255, 255, 255, 150), width=1, style=pg.QtCore.Qt.PenStyle.DashLine),
            )
            line.setVisible(False)
            p.addItem(line, ignoreBounds=True)
            if self.plots:
                p.setXLink(self.plots[0])  # one step axis for every plot
            self.plots.append(p)
            self.titles.append(title)
            self.cursors.append(line)
        # a readable least height per plot; below it the panel scrolls (a squashed plot's labels overlap)
        self.scroll = QScrollArea()
        self.scroll.setWidgetResizable(True)
        self.scroll.setFrameShape(QFrame.Shape.NoFrame)
        self.scroll.setWidget(self.layout_widget)
        self.set_text_scale(text_scale())
        self.memory_label = QLabel("memory: waiting for the engine")
        self.memory_label.setWordWrap(True)
        self.memory_label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.memory_label.setToolTip(f"the plots reach as far back as the timeline: {timeline_text()}")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(self.scroll, 1)
        lay.addWidget(self.memory_label)

    def set_text_scale(self, scale: float) -> None:
        """Titles (with their legends), tick labels and each plot's least height at the presentation scale."""
        tick = QFont()
        tick.setPointSizeF(8 * scale)
        self._scale = scale
        for i, p in enumerate(self.plots):
            self._set_title(i)
            for side in ("left", "bottom"):
                p.getAxis(side).setStyle(tickFont=tick)
        for c in range(COLUMNS):  # equal columns: a long title or wide ticks must not take a neighbour's room
            self.layout_widget.ci.layout.setColumnStretchFactor(c, 1)
        rows = -(-len(self.plots) // COLUMNS)
        title_h = 2 * 18 * scale
        self.layout_widget.setMinimumHeight(int(rows * (MIN_PLOT_H * scale + title_h)) + 8)

    def _set_title(self, i: int) -> None:
        title, names = self.titles[i], CURVES[self.titles[i]]
        scale = self._scale
        text = title
        if len(names) > 1:
            labels = [
                f"<span style='color: {_hex(SERIES_COLOURS[n])}'>\u2501 {LABELS.get(n, n)}</span>"
                for n in names
                if n in self.in_legend
            ]
            lines = [" &nbsp; ".join(labels[k : k + 3]) for k in range(0, len(labels), 3)]  # 3 fit a quarter of 1280
            text += "".join(f"<br><span style='font-size: {8.5 * scale:.1f}pt'>{line}</span>" for line in lines)
        self.plots[i].setTitle(text, size=f"{10 * scale:.1f}pt")

    def _list(self, name: str, shown: bool) -> None:
        """List a series in its plot's legend only while it has data here (no nvml on a CPU: no such line)."""
        if shown == (name in self.in_legend) or not any(name in v and len(v) > 1 for v in CURVES.values()):
            return
        if shown:
            self.in_legend.add(name)
        else:
            self.in_legend.discard(name)
        i = next(i for i, t in enumerate(self.titles) if name in CURVES[t])
        self._set_title(i)

    def show_series(self, name: str) -> None:
        """Scroll the plot that draws ``name`` into view (the panel scrolls when the window is short)."""
        i = next((i for i, t in enumerate(self.titles) if name in CURVES[t]), None)
        if i is None:
            return
        self.layout_widget.ci.layout.activate()
        box = self.plots[i].mapRectToScene(self.plots[i].boundingRect())
        self.scroll.ensureVisible(
            int(box.center().x()), int(box.center().y()), int(box.width() / 2), int(box.height() / 2)
        )

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
            blocks = (
                np.asarray(s["used"])
                if name == "pool_used"
                else np.asarray(s["free"]) + np.asarray(s["cached"]) + np.asarray(s["used"])
            )
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
        if not self.isVisible() and len(history.steps) > LONG and time.monotonic() - self._drawn_at < HIDDEN_EVERY_S:
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
                self._list(name, False)
                continue
            self._list(name, True)
            if name in MIB or name.startswith("pool"):
                ys = np.maximum(ys, 1e-3)  # a log axis has no 0
            curve.setData(x, ys)
            if name == "evictions_per_s":  # from 0 (none yet reads as a flat line at the bottom, not at the middle)
                curve.getViewBox().setYRange(0, max(float(ys.max()) if len(ys) else 0.0, 1.0) * 1.15)
        self.memory_label.setText(self.memory_text(history, memory))
        tip = "the plots reach as far back as the timeline: " + timeline_text(
            history.budget_bytes, history.max_requests
        )
        if self.memory_label.toolTip() != tip:  # the window's own bounds (--timeline-mib, --timeline-requests)
            self.memory_label.setToolTip(tip)

    def memory_text(self, history: RunHistory, memory=None) -> str:
        parts = []
        s = history.series
        if self.block_bytes and history.steps:
            total = s["free"][-1] + s["cached"][-1] + s["used"][-1]
            usage = max(s["used"][-RECENT:]) / total if total else 0.0
            c = history.counters_at(history.steps[-1])
            parts.append(
                pool_story(
                    usage,
                    int(s["waiting"][-1]),
                    int(c.get("num_preemptions", 0)),
                    int(total * self.block_bytes),
                    getattr(memory, "device_free", None),
                )
            )
        if memory is not None:
            if memory.nvml_total:
                parts.append(
                    f"{memory.nvml_status}: {memory.nvml_used / 2**30:.2f} / {memory.nvml_total / 2**30:.2f} GiB"
                )
            else:
                parts.append(memory.nvml_status)
            if memory.torch_allocated is not None:
                parts.append(
                    f"torch allocated {memory.torch_allocated / 2**30:.2f} GiB, "
                    f"reserved {memory.torch_reserved / 2**30:.2f} GiB"
                )
            parts.append(f"process {memory.process_rss / 2**20:.0f} MiB")
        _, seconds = history.ttft_arrays()
        if len(seconds):
            ms = np.sort(seconds) * 1000
            parts.append(f"time to first token: median {ms[len(ms) // 2]:.0f} ms over {len(ms)} requests")
        if history.dropped_steps:
            parts.append(reach_text(history))
        return " · ".join(parts) if parts else "memory: waiting for the engine"


def _hex(rgb: tuple[int, int, int]) -> str:
    return "#{:02x}{:02x}{:02x}".format(*rgb)
