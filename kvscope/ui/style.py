"""A dark theme that keeps the grid's colours readable."""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtWidgets import QApplication

STYLE = """
QWidget { background: #1e2127; color: #d8dee9; }
QTableView, QTableWidget, QPlainTextEdit, QLineEdit, QSpinBox, QComboBox, QDoubleSpinBox {
    background: #15171b; border: 1px solid #3b4252; selection-background-color: #4c566a; }
QHeaderView::section { background: #2e3440; color: #d8dee9; border: 0; padding: 2px 4px; }
QToolBar { border: 0; spacing: 6px; }
QToolButton { padding: 3px 8px; border: 1px solid #3b4252; border-radius: 3px; }
QToolButton:hover { background: #3b4252; }
QDockWidget::title { background: #2e3440; padding: 3px; }
QPushButton { padding: 3px 8px; border: 1px solid #3b4252; border-radius: 3px; background: #2e3440; }
QPushButton:hover { background: #3b4252; }
QToolButton:disabled, QPushButton:disabled, QComboBox:disabled, QSpinBox:disabled, QDoubleSpinBox:disabled,
QLineEdit:disabled, QPlainTextEdit:disabled {
    color: #5c6370; background: #1a1c21; border-color: #2a2e36; }
QCheckBox:disabled, QRadioButton:disabled, QLabel:disabled { color: #5c6370; }
QMenu::item:disabled { color: #5c6370; }
"""


def apply_style(app: QApplication) -> None:
    app.setStyle("Fusion")
    app.setStyleSheet(_sheet(app))
    pg.setConfigOptions(antialias=False, background="#15171b", foreground="#d8dee9")


# -- the presentation scale: every view's text, together (a projector wants 125-150%) ----------------
_TEXT_SCALE = [1.0]
TEXT_SCALES = (1.0, 1.25, 1.5, 1.75, 2.0)


_MIN_TEXT_PX: list[float | None] = [None]


def min_text_px() -> float | None:
    """Presentation's floor for drawn text, in pixels (None: no floor). A view that draws its own text leaves out
    a label that would be smaller, rather than draw what a back row cannot read."""
    return _MIN_TEXT_PX[0]


def set_min_text_px(px: float | None) -> None:
    _MIN_TEXT_PX[0] = px


def text_scale() -> float:
    """The presentation scale now (1.0: the platform's sizes)."""
    return _TEXT_SCALE[0]


def set_text_scale(app: QApplication, scale: float) -> None:
    """Scale the application's font (what every label, table and menu draws with) and remember the scale for the
    views that draw their own text (the grid's labels, the paper's figure, the plots' axes)."""
    base = app.property("kvscope_base_font_pt")
    if base is None:
        base = app.font().pointSizeF() or 10.0
        app.setProperty("kvscope_base_font_pt", base)
    _TEXT_SCALE[0] = scale
    f = app.font()
    f.setPointSizeF(float(base) * scale)
    app.setFont(f)
    # Under a style sheet a new application font does not reach widgets already polished: the sheet says it. The
    # same sheet again is skipped: setting it repolishes every widget (0.3-0.7 s of a window's start).
    sheet = _sheet(app)
    if sheet != app.styleSheet():
        app.setStyleSheet(sheet)


def _sheet(app: QApplication) -> str:
    base = app.property("kvscope_base_font_pt") or app.font().pointSizeF() or 10.0
    return f"* {{ font-size: {float(base) * text_scale():.2f}pt; }}\n" + STYLE
