"""Time series over steps: block usage, hit rate, running/waiting, tokens/s, memory."""
from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from ..history import RunHistory

CURVES = {  # plot title -> [(series, colour)]
    "blocks": [("free", (150, 150, 150)), ("cached", (66, 133, 244)), ("used", (52, 168, 83))],
    "prefix-cache hit rate": [("hit_rate", (251, 140, 0))],
    "requests": [("running", (52, 168, 83)), ("waiting", (229, 57, 53))],
    "tokens / s": [("tokens_per_s", (23, 190, 207))],
    "memory (MiB)": [("process_rss", (180, 180, 180)), ("nvml_used", (229, 57, 53)),
                     ("torch_allocated", (66, 133, 244)), ("torch_reserved", (148, 103, 189))],
}
MIB = {"process_rss", "nvml_used", "torch_allocated", "torch_reserved"}


class PlotsPanel(QWidget):
    def __init__(self) -> None:
        super().__init__()
        self.layout_widget = pg.GraphicsLayoutWidget()
        self.curves: dict[str, pg.PlotDataItem] = {}
        for i, (title, series) in enumerate(CURVES.items()):
            p = self.layout_widget.addPlot(row=i // 2, col=i % 2, title=title)
            if len(series) > 1:
                p.addLegend(offset=(-5, 5))
            p.showGrid(x=True, y=True, alpha=0.2)
            for name, colour in series:
                self.curves[name] = p.plot([], [], pen=pg.mkPen(colour, width=2), name=name)
        self.memory_label = QLabel("memory: waiting for the engine")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(self.layout_widget, 1)
        lay.addWidget(self.memory_label)

    def update_from(self, history: RunHistory, memory=None) -> None:
        x = history.steps
        for name, curve in self.curves.items():
            ys = history.series[name]
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
