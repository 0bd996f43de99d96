"""Presentation's page: one lesson on one 1280x720 screen, for a room to read (View ▸ Presentation, F11).

Laid out for a projector, not the normal window scaled: the lesson's panel (the paper's figure, or the panel the
lesson is about) takes the top and most of the screen; under it the step's note in full beside a compact grid of
the whole pool and a legend of the states present; a one-line status and the keys at the bottom. The window moves
its own lesson panel and pool in (``place``) and takes them back when presentation ends.

Text sizes follow the text scale (``present_px``): the note at 12 px times the scale (18 px at presentation's 1.5),
nothing smaller than ``SMALL_RATIO`` of it (15 px), and the band under the lesson as tall as the note needs, never
a scroll bar.
"""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QHBoxLayout, QLabel, QSizePolicy, QVBoxLayout, QWidget

from kvscope.ui.palette import LegendEntry, hex_colour
from kvscope.ui.style import text_scale

BODY_PX = 12.0  # times the text scale: the note's and the figure's text (18 px at 1.5)
SMALL_RATIO = 0.85  # the status line, the keys and the legend: 15 px at 1.5, never under 14
MIN_BAND_PX = 150  # the grid's least height beside the note
KEYS = "F10 step · PgDn/PgUp lesson · Esc follow · F11 leave"


def present_px() -> int:
    return round(BODY_PX * text_scale())


def small_px() -> int:
    return max(14, round(present_px() * SMALL_RATIO))


def _label(wrap: bool = True) -> QLabel:
    w = QLabel("")
    w.setWordWrap(wrap)
    w.setTextFormat(Qt.TextFormat.PlainText)
    w.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
    return w


class PresentationPage(QWidget):
    """``place(lesson, pool)`` / ``take()``; ``set_note(title, step, text)``, ``set_legend(entries)``,
    ``set_status(text)``, ``set_banner(text)``; ``clipped()`` lists the texts shown shorter than they need."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.lesson: QWidget | None = None
        self.pool: QWidget | None = None
        self.banner = _label()
        self.banner.setStyleSheet("background: #b71c1c; color: white; font-weight: bold; padding: 4px 8px")
        self.banner.hide()
        self.lesson_box = QVBoxLayout()
        self.lesson_box.setContentsMargins(0, 0, 0, 0)
        self.title = _label()
        self.note = _label()
        self.note.setStyleSheet("border-left: 4px solid #d8dee9; padding-left: 10px")
        self.legend = _label()
        self.legend.setTextFormat(Qt.TextFormat.RichText)
        self.status = _label(wrap=False)
        self.keys = QLabel(KEYS)
        self.keys.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Preferred)
        self.pool_box = QVBoxLayout()
        self.pool_box.setContentsMargins(0, 0, 0, 0)
        left = QVBoxLayout()
        left.setContentsMargins(8, 4, 8, 4)
        left.setSpacing(4)
        left.addWidget(self.title)
        left.addWidget(self.note)
        left.addStretch(1)
        right = QVBoxLayout()
        right.setContentsMargins(0, 0, 0, 0)
        right.setSpacing(2)
        right.addLayout(self.pool_box, 1)
        right.addWidget(self.legend)
        self.band = QWidget()
        band = QHBoxLayout(self.band)
        band.setContentsMargins(0, 0, 0, 0)
        band.addLayout(left, 11)
        band.addLayout(right, 9)
        foot = QHBoxLayout()
        foot.setContentsMargins(8, 0, 8, 0)
        foot.addWidget(self.status, 1)
        foot.addWidget(self.keys)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 2)
        lay.setSpacing(4)
        lay.addWidget(self.banner)
        lay.addLayout(self.lesson_box, 1)
        lay.addWidget(self.band)
        lay.addLayout(foot)
        self.apply_sizes()

    # -- the window's panels ----------------------------------------------------------------
    def place(self, lesson: QWidget, pool: QWidget) -> None:
        """Show the window's ``lesson`` panel and ``pool`` here (they leave wherever they were)."""
        if self.lesson is not lesson:
            self.take_lesson()
            self.lesson = lesson
            self.lesson_box.addWidget(lesson)
            lesson.show()
        if self.pool is not pool:
            self.pool = pool
            self.pool_box.addWidget(pool)
            pool.show()
        self.fit_band()

    def take_lesson(self) -> QWidget | None:
        """The lesson panel, taken out (the window puts it back in its dock)."""
        w, self.lesson = self.lesson, None
        if w is not None:
            self.lesson_box.removeWidget(w)
        return w

    def take_pool(self) -> QWidget | None:
        w, self.pool = self.pool, None
        if w is not None:
            self.pool_box.removeWidget(w)
        return w

    # -- what it says ---------------------------------------------------------------------------
    def apply_sizes(self) -> None:
        """Every text at the presentation's sizes (the text scale changed)."""
        body, small = present_px(), small_px()
        self.title.setStyleSheet(f"font-size: {body}px; font-weight: bold")
        self.note.setStyleSheet(f"font-size: {body}px; border-left: 4px solid #d8dee9; padding-left: 10px")
        for w in (self.status, self.keys, self.legend):
            w.setStyleSheet(f"font-size: {small}px")
        self.keys.setStyleSheet(f"font-size: {small}px; color: #8a93a5")
        self.banner.setStyleSheet(
            f"font-size: {small}px; background: #b71c1c; color: white; font-weight: bold; padding: 4px 8px"
        )
        self.fit_band()

    def set_note(self, title: str, step: int | None, text: str) -> None:
        self.title.setText(f"{title} · step {step}" if step is not None else title)
        self.note.setText(text)
        self.note.setVisible(bool(text))
        self.fit_band()

    def set_legend(self, entries: list[LegendEntry]) -> None:
        """The states actually present, each with its swatch and count (on as many lines as they need)."""
        parts = [
            f"<span style='background:{hex_colour(e.colours[0])}; color:{hex_colour(e.colours[0])}'>"
            f"&nbsp;&nbsp;&nbsp;</span>&nbsp;{e.name}&nbsp;<b>{e.count:,}</b>"
            for e in entries
            if e.count
        ]
        text = " &nbsp; ".join(parts)
        if text != self.legend.text():
            self.legend.setText(text)
            self.fit_band()

    def set_status(self, text: str) -> None:
        self.status.setText(text)

    def set_banner(self, text: str) -> None:
        self.banner.setText(text)
        self.banner.setVisible(bool(text))

    # -- fitting ---------------------------------------------------------------------------------------
    def resizeEvent(self, ev) -> None:  # noqa: N802 - Qt's name
        super().resizeEvent(ev)
        self.fit_band()

    def fit_band(self) -> None:
        """The band under the lesson: as tall as the title and the note need at its width (never scrolled), and
        at least ``MIN_BAND_PX`` for the grid; the lesson gets the rest."""
        width = max(100, int(self.width() * 11 / 20) - 16)
        need = self.title.heightForWidth(width) + 12
        if self.note.isVisibleTo(self) or self.note.text():
            need += self.note.heightForWidth(width) + 4
        legend_w = max(100, int(self.width() * 9 / 20))
        need = max(need, MIN_BAND_PX, 90 + self.legend.heightForWidth(legend_w))
        self.band.setFixedHeight(need)
        self.keys.setVisible(self.width() >= 900)

    def clipped(self) -> list[str]:
        """The texts shown shorter than they need (a test holds this empty at every step of every lesson)."""
        out = []
        for w in (self.title, self.note, self.legend, self.banner):
            if w.isVisible() and w.text() and w.height() < w.heightForWidth(w.width()):
                out.append(w.text()[:40])
        fm = self.status.fontMetrics()
        if self.status.isVisible() and fm.horizontalAdvance(self.status.text()) > self.status.contentsRect().width():
            out.append(self.status.text()[:40])
        return out
