"""The grid's legend: each class of the colour mode with its swatch, its name and its count of blocks.

It follows the colour mode (state, owner, ref count, age) and the snapshot; the classes and counts
come from ``kvscope.ui.palette.legend_entries``, the same function the grid's colours agree with.
"""

from __future__ import annotations

import numpy as np
from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QPainter, QPixmap
from PySide6.QtWidgets import QGridLayout, QLabel, QSizePolicy, QVBoxLayout, QWidget

from engine.inspect.snapshot import KVSnapshot
from kvscope.ui.palette import RGB, LegendEntry, legend_entries

SWATCH = 14
TITLES = {
    "state": "colour = block state",
    "owner": "colour = owning request",
    "ref count": "colour = ref count",
    "age": "colour = age (steps since last use)",
    "KV group": "colour = KV cache group",
}


def swatch(colours: tuple[RGB, ...], size: int = SWATCH) -> QPixmap:
    """A square of one colour, or vertical stripes of several."""
    pm = QPixmap(size, size)
    pm.fill(QColor(0, 0, 0, 0))
    p = QPainter(pm)
    w = size / len(colours)
    for i, c in enumerate(colours):
        p.fillRect(int(i * w), 0, int((i + 1) * w) - int(i * w), size, QColor(*c))
    p.setPen(QColor(200, 200, 200, 120))
    p.drawRect(0, 0, size - 1, size - 1)
    p.end()
    return pm


class LegendView(QWidget):
    """``set_snapshot(snap, leaked)``, ``set_mode(mode)``; ``entries`` are the rows shown."""

    def __init__(self, parent: QWidget | None = None, cpu: bool = False, meanings: bool = True) -> None:
        super().__init__(parent)
        self.cpu = cpu
        self.show_meanings = meanings  # a grey line under each state saying what it means
        self.mode = "state"
        self.snapshot: KVSnapshot | None = None
        self.leaked: np.ndarray | None = None
        self.flag_name: str | None = None
        self.entries: list[LegendEntry] = []
        self.title = QLabel(TITLES["state"])
        self.title.setStyleSheet("font-weight: bold")
        self.title.setWordWrap(True)
        self.rows = QGridLayout()
        self.rows.setContentsMargins(0, 0, 0, 0)
        self.rows.setHorizontalSpacing(6)
        self.rows.setVerticalSpacing(1)
        self.rows.setColumnStretch(1, 1)
        self.step_label = QLabel("")
        self.step_label.setStyleSheet("color: #8a93a5")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(4, 4, 4, 4)
        lay.setSpacing(3)
        lay.addWidget(self.title)
        lay.addLayout(self.rows)
        lay.addWidget(self.step_label)
        lay.addStretch(1)
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Preferred)
        self._widgets: list[tuple[QLabel, QLabel, QLabel, QLabel]] = []  # one row of widgets per entry
        self._names: list[tuple] = []  # what each row shows now

    def set_meanings_shown(self, on: bool) -> None:
        """The grey line under each state (the side panel turns it off where the rows would not all fit)."""
        if on != self.show_meanings:
            self.show_meanings = on
            self._show_rows()

    def height_needed(self, meanings: bool) -> int:
        """The legend's height with or without the meaning lines (estimated from the font: no layout pass)."""
        fm = self.fontMetrics()
        line = fm.lineSpacing() + 2
        rows = max(len(self.entries), 6 if self.mode == "state" else len(self.entries))
        extra = 2.2 * line * 0.85 if meanings and self.mode == "state" else 0
        return int(2 * line + rows * (line + extra) + line + 12)  # title (two lines at most), rows, step line

    def set_mode(self, mode: str) -> None:
        self.mode = mode
        self.title.setText(TITLES.get(mode, mode))
        self._refresh()

    def set_snapshot(
        self, snap: KVSnapshot | None, leaked: np.ndarray | None = None, flag_name: str | None = None
    ) -> None:
        """``leaked``: the blocks the audit flagged; ``flag_name``: what is wrong with them (their kinds)."""
        self.snapshot, self.leaked, self.flag_name = snap, leaked, flag_name
        self._refresh()

    def counts(self) -> dict[str, int]:
        """name -> count, as shown (for tests and the window's status)."""
        return {e.name: e.count for e in self.entries}

    def _refresh(self) -> None:
        if self.snapshot is None:
            self.entries = []
            self.step_label.setText("")
        else:
            self.entries = legend_entries(self.snapshot, self.mode, self.leaked, cpu=self.cpu, flag_name=self.flag_name)
            n = len(self.snapshot.cpu_state) if self.cpu else self.snapshot.num_blocks
            self.step_label.setText(f"step {self.snapshot.step} · {n:,} blocks")
        self._show_rows()

    def _row(self, i: int) -> tuple[QLabel, QLabel, QLabel, QLabel]:
        """Row ``i``'s widgets (swatch, name, count, meaning), made once and reused: redraws stay cheap."""
        while len(self._widgets) <= i:
            k = len(self._widgets)
            sw, name, count, meaning = QLabel(), QLabel(), QLabel(), QLabel()
            name.setWordWrap(True)
            count.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
            meaning.setWordWrap(True)
            meaning.setTextFormat(Qt.TextFormat.RichText)  # <small>: smaller than the rows, at any text size
            self.rows.addWidget(sw, 2 * k, 0)
            self.rows.addWidget(name, 2 * k, 1)
            self.rows.addWidget(count, 2 * k, 2)
            self.rows.addWidget(meaning, 2 * k + 1, 1, 1, 2)
            self._widgets.append((sw, name, count, meaning))
        return self._widgets[i]

    def _show_rows(self) -> None:
        meanings = self.show_meanings and self.mode == "state"
        for i, e in enumerate(self.entries):
            sw, name, count, meaning = self._row(i)
            key = (e.name, e.colours, e.meaning, meanings)
            if self._names[i : i + 1] != [key]:
                sw.setPixmap(swatch(e.colours))
                name.setText(e.name)
                meaning.setText(f"<small style='color:#8a93a5'>{e.meaning}</small>")
                for w in (sw, name, count):
                    w.setToolTip(e.meaning)
                if i < len(self._names):
                    self._names[i] = key
                else:
                    self._names.append(key)
            count.setText(f"{e.count:,}")
            for w in (sw, name, count):
                w.setVisible(True)
            meaning.setVisible(meanings and bool(e.meaning))
        for sw, name, count, meaning in self._widgets[len(self.entries) :]:
            for w in (sw, name, count, meaning):
                w.setVisible(False)
