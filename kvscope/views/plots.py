"""Time series over steps: block usage, hit rate, running/waiting, tokens/s, memory.

Curve colours come from ``kvscope.palette`` (a block curve takes its state's colour). A series the
history does not record (yet) is simply not drawn. ``set_cursor(step)`` draws a vertical line at
that step on every plot (the timeline's position); ``set_cursor(None)`` hides it.
"""
from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtWidgets import QLabel, QSizePolicy, QVBoxLayout, QWidget

from ..history import RunHistory
from ..palette import SERIES_COLOURS

CURVES = {  # plot title -> series
    "blocks": ["free", "cached", "used", "shared"],
    "prefix-cache hit rate": ["hit_rate"],
    "requests": ["running", "waiting", "swapped"],
    "tokens / s": ["tokens_per_s"],
    "memory (MiB)": ["process_rss", "nvml_used", "torch_allocated", "torch_reserved"],
}
MIB = {"process_rss", "nvml_used", "torch_allocated", "torch_reserved"}
LABELS = {"cached": "cached (free, hashed)", "hit_rate": "hit rate"}


class PlotsPanel(QWidget):
    def __init__(self) -> None:
        super().__init__()
        self.layout_widget = pg.GraphicsLayoutWidget()
        self.layout_widget.setMinimumSize(160, 120)
        self.curves: dict[str, pg.PlotDataItem] = {}
        self.plots: list[pg.PlotItem] = []
        self.cursors: list[pg.InfiniteLine] = []
        self.cursor_step: int | None = None
        for i, (title, series) in enumerate(CURVES.items()):
            p = self.layout_widget.addPlot(row=i // 2, col=i % 2, title=title)
            p.setMinimumSize(60, 50)
            if len(series) > 1:
                p.addLegend(offset=(-5, 5))
            p.showGrid(x=True, y=True, alpha=0.2)
            for name in series:
                self.curves[name] = p.plot([], [], pen=pg.mkPen(SERIES_COLOURS[name], width=2),
                                           name=LABELS.get(name, name))
            line = pg.InfiniteLine(angle=90, movable=False, pen=pg.mkPen((255, 255, 255, 150), width=1,
                                                                           style=pg.QtCore.Qt.PenStyle.DashLine))
            line.setVisible(False)
            p.addItem(line, ignoreBounds=True)
            self.plots.append(p)
            self.cursors.append(line)
        self.memory_label = QLabel("memory: waiting for the engine")
        self.memory_label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(self.layout_widget, 1)
        lay.addWidget(self.memory_label)


    def set_cursor(self, step: int | None) -> None:
        """A vertical line at ``step`` on every plot (None: no line, the live view)."""
        self.cursor_step = step
        for line in self.cursors:
            line.setVisible(step is not None)
            if step is not None:
                line.setValue(step)

    def update_from(self, history: RunHistory, memory=None) -> None:
        x = history.steps
        for name, curve in self.curves.items():
            ys = history.series.get(name)
            if ys is None or len(ys) != len(x):
                curve.setData([], [])
                continue
            if name in MIB:
                ys = [v / 2**20 for v in ys]
            curve.setData(x, ys)
        if memory is not None:
            if memory.nvml_total:
                gpu = f"{memory.nvml_status}: {memory.nvml_used / 2**30:.2f} / {memory.nvml_total / 2**30:.2f} GiB"
            else:
                gpu = memory.nvml_status
            torch_part = ""
            if memory.torch_allocated is not None:
                torch_part = (f" · torch allocated {memory.torch_allocated / 2**30:.2f} GiB,"
                              f" reserved {memory.torch_reserved / 2**30:.2f} GiB")
            self.memory_label.setText(f"{gpu}{torch_part} · process {memory.process_rss / 2**20:.0f} MiB")
