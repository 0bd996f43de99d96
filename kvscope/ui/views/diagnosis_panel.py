"""The "Why?" panel: a selected block's life story, and caching on vs off for the run's requests.

The story is a table (step, what happened, detail, who held a reference after it); a leak's diagnosis
(the request that ended still holding the block) is a red row. Clicking a row moves the timeline to
that step. The comparison replays the run's own prompts greedily through two fresh engines on the
same weights, prefix caching on and off, and says where their outputs part.
"""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QBrush, QColor
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPushButton,
    QSizePolicy,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from engine.inspect.block_story import StoryLine
from kvscope.ui import palette

COLUMNS = ("step", "what", "detail", "held by after it")
SUSPECT = palette.LEAKED


class DiagnosisPanel(QWidget):
    step_activated = Signal(int)  # a story row clicked: show the pool at that step
    compare_requested = Signal()

    def __init__(self) -> None:
        super().__init__()
        self.block_id: int | None = None
        self.title = QLabel("Block story: click a block in the grid to read everything that happened to it")
        self.title.setWordWrap(True)
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.verticalHeader().hide()
        head = self.table.horizontalHeader()
        head.setSectionResizeMode(0, QHeaderView.ResizeMode.ResizeToContents)
        head.setSectionResizeMode(1, QHeaderView.ResizeMode.ResizeToContents)
        head.setSectionResizeMode(2, QHeaderView.ResizeMode.Stretch)
        head.setSectionResizeMode(3, QHeaderView.ResizeMode.ResizeToContents)
        self.table.setWordWrap(False)  # one line a row; the whole text is the row's tooltip
        self.table.cellClicked.connect(self._on_row)
        self.compare_button = QPushButton("Compare caching on / off")
        self.compare_button.setToolTip(
            "replay this run's prompts greedily with prefix caching on and off, on the "
            "same weights, and show the first output token where they differ"
        )
        self.compare_button.clicked.connect(self.compare_requested)
        self.compare_label = QLabel("Caching on vs off: not run yet")
        self.compare_label.setWordWrap(True)
        self.compare_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        row = QHBoxLayout()
        row.addWidget(self.compare_button)
        row.addWidget(self.compare_label, 1)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(4, 4, 4, 4)
        # the verdict first: its lines keep their height where the panel is short (1.5x text at 1280x720), and
        # the story's table, which scrolls, takes what is left
        lay.addLayout(row)
        lay.addWidget(self.title)
        lay.addWidget(self.table, 1)
        self.table.setMinimumHeight(40)
        # the table takes the height left, and scrolls: its preferred height (every row) would make the dock's
        # scroll area as tall as the whole story (the wrapped title gives the panel a height for its width, which
        # a scroll area grants in full), and the suspect row, scrolled to in the table, fell below the dock's edge
        self.table.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Ignored)
        self._steps: list[int] = []

    def show_story(self, block_id: int, lines: list[StoryLine], reach: tuple[int, int] | None) -> None:
        self.block_id = block_id
        span = f" (steps {reach[0]}–{reach[1]}, the timeline's reach)" if reach else ""
        suspects = [ln for ln in lines if ln.kind == "suspect"]
        verdict = f" · suspect: {suspects[-1].text}" if suspects else ""
        self.title.setText(
            f"Block {block_id}: {len(lines)} event(s){span}{verdict}"
            if lines
            else f"Block {block_id}: no event names it{span}; it was never allocated"
        )
        self.table.setRowCount(len(lines))
        self._steps = [ln.step for ln in lines]
        for i, ln in enumerate(lines):
            cells = (str(ln.step), ln.kind, ln.text, ", ".join(ln.holders) or "nobody")
            for j, text in enumerate(cells):
                item = QTableWidgetItem(text)
                item.setToolTip(ln.text)
                if ln.kind == "suspect":
                    item.setBackground(QBrush(QColor(*SUSPECT)))
                    item.setForeground(QBrush(QColor(*palette.text_on(SUSPECT))))
                self.table.setItem(i, j, item)
        if lines:
            self.table.scrollToBottom()

    def clear_story(self) -> None:
        self.block_id = None
        self.table.setRowCount(0)
        self.title.setText("Block story: click a block in the grid to read everything that happened to it")

    def show_comparison(self, text: str, divergence: dict | None) -> None:
        colour = palette.hex_colour(SUSPECT) if divergence else palette.hex_colour(palette.USED)
        verdict = "outputs differ" if divergence else "identical outputs"
        self.compare_label.setText(f"<b style='color:{colour}'>Caching on vs off: {verdict}.</b> {text}")
        self.compare_label.setToolTip(_token_ids(divergence) if divergence else "")
        self.compare_button.setEnabled(True)

    def comparison_running(self, n: int) -> None:
        self.compare_button.setEnabled(False)
        self.compare_label.setText(f"Caching on vs off: running {n} request(s) twice…")

    def _on_row(self, row: int, _col: int) -> None:
        if 0 <= row < len(self._steps):
            self.step_activated.emit(self._steps[row])

    def rows(self) -> list[tuple[str, ...]]:
        return [tuple(self.table.item(i, j).text() for j in range(len(COLUMNS))) for i in range(self.table.rowCount())]

    def reset_compare(self, can_run: bool) -> None:
        """A new source: nothing compared yet; the button works where the source can run engines."""
        self.compare_label.setText("Caching on vs off: not run yet")
        self.compare_button.setEnabled(can_run)

    def compare_failed(self, message: str) -> None:
        """A comparison that was running ended in an error: say so beside the button, and let it run again."""
        if not self.compare_button.isEnabled():
            self.compare_button.setEnabled(True)
            self.compare_label.setText(f"Caching on vs off: {message}")


def _token_ids(d: dict) -> str:
    """The parting outputs as token ids (the label says them as text; the ids are for an engineer's hover)."""
    t = d["token_index"]
    return (
        f"request #{d['request_index']} ({d['request_id']}), output token {t} on, as token ids:\n"
        f"with caching:    {d['with_caching'][t : t + 8]}\nwithout caching: {d['without_caching'][t : t + 8]}"
    )
