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
    app.setStyleSheet(STYLE)
    pg.setConfigOptions(antialias=False, background="#15171b", foreground="#d8dee9")
