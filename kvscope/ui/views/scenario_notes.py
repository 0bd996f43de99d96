"""The running scenario's "what to watch" text and the note for the current step, in a side panel."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QLabel,
    QListWidget,
    QListWidgetItem,
    QScrollArea,
    QSizePolicy,
    QVBoxLayout,
    QWidget,
)


class ScenarioNotesPanel(QWidget):
    """``set_scenario(watch, notes, title="")`` with notes [(step, text)]; ``set_step(step)``;
    ``current_note()`` -> (step, text) or None. A note holds from its step until the next one."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.watch = ""
        self.notes: list[tuple[int, str]] = []
        self.step: int | None = None
        self.title = QLabel("No scenario running")
        self.title.setStyleSheet("font-weight: bold")
        self.title.setWordWrap(True)
        self.watch_label = QLabel("Pick one from the Scenario menu: each says what to watch, step by step.")
        self.watch_label.setWordWrap(True)
        self.watch_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.now_caption = QLabel("")
        self.now_caption.setStyleSheet("color: #8a93a5")
        self.now = QLabel("")
        self.now.setWordWrap(True)
        self.now.setStyleSheet("background: #2e3440; padding: 6px; border-left: 3px solid #d8dee9")
        self.now.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.list = QListWidget()
        self.list.setWordWrap(True)
        self.list.setSelectionMode(QListWidget.SelectionMode.NoSelection)
        for w in (self.title, self.watch_label, self.now):
            # Preferred (not Ignored) width, so that the layout asks a wrapped label its height for the width it
            # gets: with Ignored it got one line's height and the text was cut. A small minimum keeps the dock narrow.
            w.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Preferred)
            w.setMinimumWidth(60)
        self.list.setMinimumHeight(60)
        # the list of every note takes what the title, the text and the current note leave
        self.list.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Ignored)
        body = QWidget()
        lay = QVBoxLayout(body)
        lay.setContentsMargins(6, 6, 6, 6)
        # The note of the step comes first, under the title: it is what changes as the class steps, and a
        # short panel (1280x720) must show it whole. The scenario's text follows; where the panel is too
        # short for everything, it scrolls instead of cutting lines off.
        lay.addWidget(self.title)
        lay.addWidget(self.now_caption)
        lay.addWidget(self.now)
        lay.addWidget(self.watch_label)
        lay.addWidget(QLabel("all notes"))
        lay.addWidget(self.list, 1)
        self.scroll = QScrollArea()
        self.scroll.setWidget(body)
        self.scroll.setWidgetResizable(True)
        self.scroll.setFrameShape(QScrollArea.Shape.NoFrame)
        self.scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.addWidget(self.scroll)
        self._render()

    def resizeEvent(self, ev) -> None:  # noqa: N802 - Qt's name
        super().resizeEvent(ev)
        self._fit_labels()

    def _fit_labels(self) -> None:
        """Each wrapped text as tall as its lines at the panel's width: a scroll area otherwise squeezes them
        (a wrapped label's minimum height is one line's)."""
        width = self.scroll.viewport().width() - 12  # the body's margins
        for w in (self.title, self.now, self.watch_label):
            w.setMinimumHeight(w.heightForWidth(width) if w.isVisibleTo(self) and width > 0 else 0)

    def clipped(self) -> list[str]:
        """The texts shown shorter than they need (none: a test holds the panel to it at 1280x720)."""
        return [
            w.text()[:40]
            for w in (self.title, self.now, self.watch_label)
            if w.isVisible() and w.height() < w.heightForWidth(w.width())
        ]

    def set_scenario(self, watch: str, notes: list[tuple[int, str]], title: str = "") -> None:
        self.watch = watch or ""
        self.notes = sorted(((int(a), str(t)) for a, t in notes), key=lambda n: n[0])
        self.title.setText(title or ("What to watch" if watch or notes else "No scenario running"))
        self.watch_label.setText(self.watch or "This scenario has no notes.")
        self.list.clear()
        for at, text in self.notes:
            self.list.addItem(QListWidgetItem(f"step {at}: {text}"))
        self._render()

    def clear(self) -> None:
        self.set_scenario("", [])
        self.title.setText("No scenario running")
        self.watch_label.setText("Pick one from the Scenario menu: each says what to watch, step by step.")
        self.step = None
        self._render()

    def set_step(self, step: int | None) -> None:
        self.step = step
        self._render()

    def current_note(self) -> tuple[int, str] | None:
        if self.step is None:
            return None
        return next((n for n in reversed(self.notes) if n[0] <= self.step), None)

    def _render(self) -> None:
        cur = self.current_note()
        if not self.notes:
            self.now_caption.setText("")
            self.now.setText("")
            self.now.hide()
        else:
            self.now.show()
            nxt = next((n for n in self.notes if self.step is None or n[0] > self.step), None)
            self.now_caption.setText(f"now (step {self.step})" if self.step is not None else "before step 1")
            self.now.setText(cur[1] if cur else f"Step to {nxt[0]}: the first note appears there." if nxt else "")
        self._fit_labels()
        for i, (at, _text) in enumerate(self.notes):
            item = self.list.item(i)
            f = item.font()
            f.setBold(cur is not None and at == cur[0])
            item.setFont(f)
