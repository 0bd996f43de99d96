"""The first screen: what kvscope shows and what to do first (a scenario, Inject, the keys)."""

from __future__ import annotations

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QGridLayout,
    QLabel,
    QPushButton,
    QScrollArea,
    QSizePolicy,
    QVBoxLayout,
    QWidget,
)

SHORTCUTS = [
    ("F10", "Step: run the scheduler one step"),
    ("F5", "Run / Pause"),
    ("Ctrl+I", "Inject a request (a prompt, n samples, beams…)"),
    ("Del", "Abort the selected requests"),
    ("Ctrl+F", "Fork the selected request (its blocks are shared: copy-on-write)"),
    ("F or Home", "grid: fit the blocks in use"),
    ("A", "grid: the whole pool"),
    ("wheel, + / −", "grid: zoom (ids, ref counts, then tokens appear)"),
    ("drag, arrows", "grid: pan"),
]


def first_sentence(text: str) -> str:
    """The first sentence (up to 160 characters); a sentence's end, not a colon after a label ("Question:
    why ...?"), except when no sentence ends soon enough."""
    text = " ".join(text.split()) + " "
    for ends in ((". ", "? ", "! "), (": ",)):
        i = min((i for i in (text.find(e) for e in ends) if 0 < i < 160), default=-1)
        if i > 0:
            return text[: i + 1]
    return text[:160].rstrip()


ORDER = [
    "four-score",
    "parallel-sampling",
    "shared-system-prompt",
    "multi-turn-chat",
    "beam-search",
    "pool-exhaustion",
    "leak-hunt",
]  # a classroom's order: the paper's figures first


def lesson_order(names: list[str]) -> list[str]:
    """Scenario names in a classroom's order: the paper's figures first, then the rest by name."""
    return sorted(names, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n))


def scenario_lines() -> list[tuple[str, str, str]]:
    """(name, title, one line) of every scenario that loads, the paper's figures first."""
    from kvscope.scenario import available, load_scenario

    out = []
    names = available()
    for name in lesson_order(names):
        try:
            sc = load_scenario(name)
        except ValueError:
            continue
        out.append((name, sc.title, first_sentence(sc.watch or sc.description)))
    return out


class WelcomeView(QWidget):
    """Signals ``scenario_chosen(name)``, ``inject_requested()``. ``scenarios`` defaults to the files'.

    The lessons come first, every button on screen at once: one a line with its one-line summary where the page is
    tall enough, else two columns of buttons, each summary then the button's tooltip (1280x720 with 1.5x text)."""

    scenario_chosen = Signal(str)
    inject_requested = Signal()

    def __init__(self, scenarios: list[tuple[str, str, str]] | None = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.scenarios = scenarios_ = scenario_lines() if scenarios is None else scenarios
        self.buttons: dict[str, QPushButton] = {}
        self.lines: dict[str, QLabel] = {}
        self.columns = 0
        inner = QWidget()
        lay = QVBoxLayout(inner)
        lay.setContentsMargins(18, 12, 18, 12)
        # sizes relative to the text size (the presentation scale): rich text's x-large, not points
        title = QLabel(
            "<span style='font-size:x-large; font-weight:bold'>kvscope: watch a paged KV cache at work</span>"
        )
        title.setWordWrap(True)
        lay.addWidget(title)
        lay.addWidget(self._heading("1. Pick a lesson, then press F10 to step through it (F11: presentation)"))
        self.grid = QGridLayout()
        self.grid.setHorizontalSpacing(10)
        self.grid.setVerticalSpacing(4)
        for name, sc_title, line in scenarios_:
            b = QPushButton(sc_title)
            b.setToolTip(f"{line}\nkvscope --scenario {name}")
            b.setStyleSheet("text-align: left; padding: 3px 8px")
            b.clicked.connect(lambda _c=False, n=name: self.scenario_chosen.emit(n))
            self.buttons[name] = b
            text = QLabel(line)
            text.setWordWrap(True)
            text.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
            self.lines[name] = text
        lay.addLayout(self.grid)
        lay.addSpacing(6)
        intro = QLabel(
            "A real model runs step by step. Each request's KV cache lives in fixed-size <b>blocks</b> "
            "of a shared pool, mapped by its <b>block table</b>, as in the PagedAttention paper. "
            "The grid shows the pool (one cell per block; the legend says what each colour means), "
            "the figure view shows a selected request's logical blocks, table and physical blocks."
        )
        intro.setWordWrap(True)
        lay.addWidget(intro)
        lay.addSpacing(6)
        lay.addWidget(self._heading("2. Or inject your own request"))
        self.inject_button = QPushButton("Inject a request…  (Ctrl+I)")
        self.inject_button.clicked.connect(self.inject_requested.emit)
        lay.addWidget(self.inject_button, 0, Qt.AlignmentFlag.AlignLeft)
        lay.addSpacing(6)
        lay.addWidget(self._heading("Keys"))
        keys = QGridLayout()
        for row, (key, what) in enumerate(SHORTCUTS):
            k = QLabel(f"<b>{key}</b>")
            keys.addWidget(k, row // 2, 2 * (row % 2))
            w = QLabel(what)
            w.setWordWrap(True)
            keys.addWidget(w, row // 2, 2 * (row % 2) + 1)
        keys.setColumnStretch(1, 1)
        keys.setColumnStretch(3, 1)
        lay.addLayout(keys)
        lay.addStretch(1)
        self.scroll = QScrollArea()
        self.scroll.setWidget(inner)
        self.scroll.setWidgetResizable(True)
        self.scroll.setFrameShape(QScrollArea.Shape.NoFrame)
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.addWidget(self.scroll)
        self._arrange(1)

    def _arrange(self, columns: int) -> None:
        """The lesson buttons in ``columns`` columns (one: each with its summary beside it)."""
        if columns == self.columns:
            return
        self.columns = columns
        for w in list(self.buttons.values()) + list(self.lines.values()):
            self.grid.removeWidget(w)
        for i, name in enumerate(self.buttons):
            if columns == 1:
                self.grid.addWidget(self.buttons[name], i, 0)
                self.grid.addWidget(self.lines[name], i, 1)
                self.lines[name].show()
            else:
                self.grid.addWidget(self.buttons[name], i // columns, i % columns)
                self.lines[name].hide()
        for c in range(3):
            self.grid.setColumnStretch(c, 1 if (columns == 1 and c == 1) or (columns > 1 and c < columns) else 0)

    def resizeEvent(self, ev) -> None:  # noqa: N802 - Qt's name
        super().resizeEvent(ev)
        self.fit()

    def fit(self) -> None:
        """One column where every button and its summary fit the page's height, else two (checked once the layout
        has placed them: a wrapped summary's height is known then)."""
        self._arrange(1)
        QTimer.singleShot(0, self._check_fit)

    def _check_fit(self) -> None:
        room = self.scroll.viewport().height()
        lines = [ln for ln in self.lines.values() if ln.isVisible()]
        bottom = max([b.geometry().bottom() for b in self.buttons.values()] + [ln.geometry().bottom() for ln in lines])
        short = any(ln.height() < ln.heightForWidth(ln.width()) for ln in lines)
        if self.columns == 1 and (bottom > room or short):
            self._arrange(2)

    @staticmethod
    def _heading(text: str) -> QLabel:
        h = QLabel(f"<span style='font-size:large'>{text}</span>")
        h.setStyleSheet("font-weight: bold; color: #eceff4")
        h.setWordWrap(True)
        return h
