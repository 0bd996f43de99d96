"""An error / audit banner above the grid: says what went wrong, can be closed, clears on success."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QHBoxLayout, QLabel, QSizePolicy, QToolButton, QWidget

KINDS = {  # kind -> (background, text)
    "error": ("#b71c1c", "#ffffff"),
    "engine": ("#b71c1c", "#ffffff"),  # the engine process died or hung: only a restart clears it
    "audit": ("#b71c1c", "#ffffff"),
    "warning": ("#8d6e00", "#ffffff"),
    "info": ("#2e3440", "#d8dee9"),
}


class Banner(QWidget):
    """``show_message(text, kind)``, ``clear()`` (the integrator calls it when the next action succeeds),
    ``text()``; a close button hides it (``closed`` signal). ``setText`` + ``show`` also work, as on a QLabel.
    """

    closed = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.kind = "error"
        self.label = QLabel()
        self.label.setWordWrap(True)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.close_button = QToolButton()
        self.close_button.setText("✕")
        self.close_button.setToolTip("close this message")
        self.close_button.setAutoRaise(True)
        self.close_button.clicked.connect(self._on_close)
        lay = QHBoxLayout(self)
        lay.setContentsMargins(6, 3, 3, 3)
        lay.addWidget(self.label, 1)
        lay.addWidget(self.close_button, 0, Qt.AlignmentFlag.AlignTop)
        self.setAttribute(Qt.WidgetAttribute.WA_StyledBackground, True)
        self._style()
        self.hide()

    def show_message(self, text: str, kind: str = "error") -> None:
        self.kind = kind if kind in KINDS else "error"
        self._style()
        self.label.setText(text if text.startswith("⚠") or self.kind == "info" else f"⚠ {text}")
        self.show()

    def setText(self, text: str) -> None:  # noqa: N802 - QLabel's name, so the banner drops in for one
        self.label.setText(text)

    def text(self) -> str:
        return self.label.text()

    def clear(self) -> None:
        """Hide and forget the message (the next action succeeded)."""
        self.label.setText("")
        self.hide()

    def _on_close(self) -> None:
        self.clear()
        self.closed.emit()

    def _style(self) -> None:
        bg, fg = KINDS[self.kind]
        self.setStyleSheet(
            f"Banner {{ background: {bg}; }} QLabel {{ background: {bg}; color: {fg}; "
            f"font-weight: bold; }} QToolButton {{ background: {bg}; color: {fg}; border: 0; }}"
        )
