"""The fragmentation figure: the same requests laid out contiguously (a max-length reservation each) and
paged (whole blocks as they grow), side by side, on one scale of slots, with the counts.

Each request is a row of slots: used (its tokens' KV), wasted (the rest of its last block), reserved (the
contiguous layout's slots past its tokens). The layout this run's engine really uses is marked, and its
pool's own counts (physical blocks, counted once) are printed under the figure.
"""

from __future__ import annotations

from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QBrush, QColor, QFont, QPainter, QPen
from PySide6.QtWidgets import QLabel, QSizePolicy, QVBoxLayout, QWidget

from engine.inspect.fragmentation import Layout, layouts, pool_caption, pool_counts
from engine.inspect.snapshot import KVSnapshot
from kvscope.ui import palette

MAX_ROWS = 12
TEXT = QColor(230, 230, 230)


def _colour(kind: str) -> QColor:
    return QColor(*palette.FRAGMENTS[kind].colour)


class FragmentationCanvas(QWidget):
    def __init__(self) -> None:
        super().__init__()
        self.setMinimumSize(300, 140)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)
        self.pair: tuple[Layout, Layout] | None = None
        self.max_model_len = 0
        self.block_size = 16
        self.running = "paged"
        self.bars_bottom = 0.0  # the lowest bar drawn, in the canvas's pixels, last paint (a test reads it)

    def set_layouts(
        self, pair: tuple[Layout, Layout] | None, max_model_len: int, block_size: int, running: str
    ) -> None:
        self.pair, self.max_model_len, self.block_size, self.running = pair, max_model_len, block_size, running
        # tall enough for its two header lines and every row at a readable height: where the panel is smaller
        # (1.5x text at 1280x720) it scrolls, instead of the legend under it being laid over the bars
        line = self.fontMetrics().height() + 2
        rows = min(len(pair[0].rows), MAX_ROWS) if pair else 0
        self.setMinimumHeight(max(140, int(6 + 2 * line + rows * (max(12, line * 0.7) + 3) + 22)))
        self.update()

    def paintEvent(self, _event) -> None:  # noqa: N802 - Qt's name
        qp = QPainter(self)
        self.bars_bottom = 0.0
        qp.fillRect(self.rect(), QColor(*palette.BACKGROUND))
        qp.setPen(TEXT)
        if not self.pair or not self.pair[0].rows:
            qp.drawText(
                self.rect(),
                Qt.AlignmentFlag.AlignCenter,
                "no request holds KV yet: inject a request or step the scenario",
            )
            return
        gap, label_w = 16, 46
        half = (self.width() - gap) / 2
        for k, layout in enumerate(self.pair):
            self._panel(qp, QRectF(k * (half + gap), 0, half, self.height()), layout, label_w)

    def _panel(self, qp: QPainter, area: QRectF, layout: Layout, label_w: float) -> None:
        qp.setPen(TEXT)
        font = QFont(qp.font())
        font.setBold(True)
        qp.setFont(font)
        mark = "  ← this run's engine" if layout.name == self.running else ""
        line = qp.fontMetrics().height() + 2  # the font's own height: a fixed 18 px cut larger text top and bottom
        qp.drawText(
            QRectF(area.x(), area.y() + 2, area.width(), line), Qt.AlignmentFlag.AlignLeft, f"{layout.name}{mark}"
        )
        font.setBold(False)
        qp.setFont(font)
        qp.drawText(
            QRectF(area.x(), area.y() + 2 + line, area.width(), line), Qt.AlignmentFlag.AlignLeft, layout.header()
        )
        rows = layout.rows[:MAX_ROWS]
        top = area.y() + 6 + 2 * line
        row_h = max(6.0, min(22.0, (area.height() - top - 4) / max(len(rows), 1) - 3))
        scale = (area.width() - label_w - 4) / max(self.max_model_len, 1)  # one scale for both panels
        for i, r in enumerate(rows):
            y = top + i * (row_h + 3)
            qp.setPen(TEXT)
            qp.drawText(
                QRectF(area.x(), y, label_w - 4, row_h),
                Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter,
                r.request_id[:6],
            )
            x = area.x() + label_w
            for kind, n in (("used", r.used), ("wasted", r.wasted), ("reserved", r.reserved)):
                if n:
                    qp.fillRect(QRectF(x, y, n * scale, row_h), QBrush(_colour(kind)))
                    x += n * scale
                    self.bars_bottom = max(self.bars_bottom, y + row_h)
            block_w = self.block_size * scale
            if block_w >= 4:  # block boundaries, where they can be seen
                qp.setPen(QPen(QColor(*palette.BACKGROUND), 1))
                end = area.x() + label_w + (r.used + r.wasted + r.reserved) * scale
                bx = area.x() + label_w + block_w
                while bx < end - 0.5:
                    qp.drawLine(int(bx), int(y), int(bx), int(y + row_h))
                    bx += block_w
        if len(layout.rows) > MAX_ROWS:
            qp.setPen(TEXT)
            qp.drawText(
                QRectF(area.x(), top + MAX_ROWS * (row_h + 3), area.width(), 16),
                Qt.AlignmentFlag.AlignLeft,
                f"+ {len(layout.rows) - MAX_ROWS} more request(s)",
            )


class FragmentationView(QWidget):
    def __init__(self) -> None:
        super().__init__()
        self.canvas = FragmentationCanvas()
        legend = " ".join(
            f"<span style='background:{palette.hex_colour(c.colour)}'>&nbsp;&nbsp;&nbsp;&nbsp;</span> "
            f"<b>{c.name}</b>: {c.meaning}&nbsp;&nbsp;"
            for c in palette.FRAGMENTS.values()
        )
        self.legend = QLabel(legend)
        self.legend.setWordWrap(True)
        self.pool_label = QLabel("")
        self.pool_label.setWordWrap(True)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(4, 4, 4, 4)
        lay.addWidget(self.canvas, 1)
        lay.addWidget(self.legend)
        lay.addWidget(self.pool_label)
        self.max_model_len = 0
        self.running = "paged"
        self.pair: tuple[Layout, Layout] | None = None

    def set_info(self, max_model_len: int, kv_layout: str) -> None:
        self.max_model_len, self.running = max_model_len, kv_layout

    def set_snapshot(self, snap: KVSnapshot | None) -> None:
        if snap is None:
            self.pair = None
            self.canvas.set_layouts(None, self.max_model_len, 16, self.running)
            self.pool_label.setText("")
            return
        self.pair = layouts(snap, self.max_model_len)
        self.canvas.set_layouts(self.pair, self.max_model_len, snap.block_size, self.running)
        self.pool_label.setText(pool_caption(pool_counts(snap), self.running, self.max_model_len))
