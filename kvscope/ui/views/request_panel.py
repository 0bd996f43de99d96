"""The requests table and, for the selected request, its block table (logical -> physical).

The table shows what the engine's snapshot carries: the requests in flight and the engine's last
``engine.request_groups.MAX_FINISHED`` finished ones (its header's tooltip says so). A selected request
stays selected while the rows change, and stays in the table, as it last was, after the engine lets it go.
"""

from __future__ import annotations

from PySide6.QtCore import QEvent, Qt, Signal
from PySide6.QtGui import QBrush, QColor
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHeaderView,
    QLabel,
    QSplitter,
    QTableView,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from engine.inspect.snapshot import KVSnapshot, RequestInfo
from kvscope.limits import requests_text
from kvscope.ui import palette
from kvscope.ui.qt_models import RequestTableModel
from kvscope.ui.status_words import WIDEST


class BlockTableView(QTableWidget):
    """One column per logical block: the physical id and its ref count, in the block's colour in the grid
    (``palette.block_state``: green used, orange shared, red where the audit flagged it)."""

    def __init__(self) -> None:
        super().__init__(2, 0)
        self.setVerticalHeaderLabels(["physical", "ref"])
        self.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        # one width for every column, from the widest id (show_table): ResizeToContents measured every column
        # again at each item set, minutes for a workload request's 6,000 blocks
        self.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Fixed)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAsNeeded)
        self._fit_height()

    def _fit_height(self) -> None:
        """Exactly its header, its rows and a scroll bar, at the text size: every row always shows (a
        short panel at 1280x720 kept the physical row and cut the ref row)."""
        row = self.fontMetrics().height() + 8
        self.verticalHeader().setDefaultSectionSize(row)
        self.verticalHeader().setMinimumSectionSize(row)
        head = max(self.horizontalHeader().sizeHint().height(), row)  # its hint is small with no column yet
        bar = self.horizontalScrollBar().sizeHint().height()
        self.setFixedHeight(head + max(self.rowCount(), 2) * row + bar + 2 * self.frameWidth())

    def changeEvent(self, ev) -> None:  # noqa: N802 - Qt's name
        super().changeEvent(ev)
        if ev.type() in (QEvent.Type.FontChange, QEvent.Type.StyleChange):
            self._fit_height()

    def showEvent(self, ev) -> None:  # noqa: N802 - Qt's name
        super().showEvent(ev)
        self._fit_height()  # polished now: the style's header and scroll bar sizes are known

    def show_table(self, snap: KVSnapshot | None, block_ids: tuple[int, ...], flagged=()) -> None:
        if self.rowCount() != 2:
            self.setRowCount(2)
            self.setVerticalHeaderLabels(["physical", "ref"])
            self._fit_height()
        widest = max((str(b) for b in block_ids), key=len, default="0")
        widest = max(widest, str(len(block_ids) - 1), key=len)  # the header's logical index
        self.horizontalHeader().setDefaultSectionSize(self.fontMetrics().horizontalAdvance(widest + "00") + 6)
        self.setColumnCount(len(block_ids))
        self.setHorizontalHeaderLabels([str(i) for i in range(len(block_ids))])
        self.colours: dict[int, tuple[int, int, int]] = {}
        for i, b in enumerate(block_ids):
            ref = int(snap.ref_cnt[b]) if snap is not None else 0
            phys, refc = QTableWidgetItem(str(b)), QTableWidgetItem(str(ref))
            if snap is not None:
                rgb = self.colours[b] = palette.block_state(snap, b, flagged).colour
                for it in (phys, refc):
                    it.setBackground(QBrush(QColor(*rgb)))
                    it.setForeground(QBrush(QColor(*palette.text_on(rgb))))
            self.setItem(0, i, phys)
            self.setItem(1, i, refc)

    def show_tables(self, snap: KVSnapshot, tables: tuple[tuple[int, ...], ...], flagged=()) -> None:
        """A hybrid model's tables, one row per KV cache group (its physical ids; a cell's tooltip its ref count).
        A block a sliding window or a state group gave back is vLLM's null block there: drawn as "–", reserved."""
        labels = [g.label() for g in snap.kv_groups]
        names = [f"group {g}" + (f" · {labels[g]}" if g < len(labels) else "") for g in range(len(tables))]
        if self.rowCount() != len(tables) or [self.verticalHeaderItem(i).text() for i in range(len(tables))] != names:
            self.setRowCount(len(tables))
            self.setVerticalHeaderLabels(names)
            self._fit_height()
        n = max((len(t) for t in tables), default=0)
        widest = max((str(b) for t in tables for b in t), key=len, default="0")
        self.horizontalHeader().setDefaultSectionSize(
            self.fontMetrics().horizontalAdvance(max(widest, str(n - 1), key=len) + "00") + 6
        )
        self.setColumnCount(n)
        self.setHorizontalHeaderLabels([str(i) for i in range(n)])
        self.colours = {}
        reserved = set(snap.reserved)
        for g, table in enumerate(tables):
            for i in range(n):
                if i >= len(table):
                    self.setItem(g, i, QTableWidgetItem(""))
                    continue
                b = table[i]
                null = b in reserved
                it = QTableWidgetItem("–" if null else str(b))
                rgb = palette.block_state(snap, b, flagged).colour
                it.setBackground(QBrush(QColor(*rgb)))
                it.setForeground(QBrush(QColor(*palette.text_on(rgb))))
                it.setToolTip(
                    f"logical {i} of group {g}: vLLM's null block (the group gave this block back)"
                    if null
                    else f"logical {i} of group {g}: physical block {b}, ref {int(snap.ref_cnt[b])}"
                )
                self.setItem(g, i, it)

    def cell_text(self) -> list[tuple[int, int]]:
        return [(int(self.item(0, i).text()), int(self.item(1, i).text())) for i in range(self.columnCount())]


class RequestPanel(QWidget):
    request_selected = Signal(str)  # "" when the selection is cleared

    def __init__(self) -> None:
        super().__init__()
        self.model = RequestTableModel()
        self.table = QTableView()
        self.table.setModel(self.model)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.ExtendedSelection)
        self.table.horizontalHeader().setStretchLastSection(True)
        self._size_columns()
        self.table.verticalHeader().hide()
        self.table.horizontalHeader().setToolTip(
            f"{requests_text()}; a selected request stays in the table after the engine lets it go"
        )
        self.table.selectionModel().selectionChanged.connect(self._on_selection)
        self._kept: dict[str, RequestInfo] = {}  # the selected requests, as they were last shown
        self._restoring = False
        self.block_table = BlockTableView()
        self.caption = QLabel("block table: select a request")
        # why the selected request missed the prefix cache (MainWindow fills it from kvscope.diagnosis)
        self.miss_label = QLabel("prefix cache: select a request")
        self.miss_label.setWordWrap(True)
        self.miss_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.snapshot: KVSnapshot | None = None
        self.flagged: frozenset[int] = frozenset()
        self.selected_id = ""
        lower = QWidget()
        ll = QVBoxLayout(lower)
        ll.setContentsMargins(0, 0, 0, 0)
        ll.addWidget(self.miss_label)  # first: it must stay readable when the panel is short
        ll.addWidget(self.caption)
        ll.addWidget(self.block_table)
        self.lower = lower
        self.split = split = QSplitter(Qt.Orientation.Vertical)
        split.addWidget(self.table)
        split.addWidget(lower)
        split.setStretchFactor(0, 3)
        for i in (0, 1):  # neither side collapses: the block table keeps its two rows, the table its header
            split.setCollapsible(i, False)
        self.table.setMinimumHeight(80)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(split)

    def _size_columns(self) -> None:
        """Each column as wide as its header or its widest likely value, at the current text size (Qt's
        100 px a column pushed `cached` out of a 1280x720 window's panel)."""
        fm = self.table.fontMetrics()
        likely = {
            "id": "000000",
            "prompt": "00000",
            "cached": "00000",
            "output": "00000",
            "blocks": "0000",
            "state": WIDEST,
            "client": "client 00",
        }
        for i, name in enumerate(self.model.HEADERS[:-1]):
            text = max(name, likely.get(name, name), key=fm.horizontalAdvance)
            self.table.setColumnWidth(i, fm.horizontalAdvance(text) + 14)

    def changeEvent(self, ev) -> None:  # noqa: N802 - Qt's name
        super().changeEvent(ev)
        if ev.type() in (QEvent.Type.FontChange, QEvent.Type.StyleChange):  # a new presentation text size
            self._size_columns()

    def set_snapshot(self, snap: KVSnapshot, flagged=()) -> None:
        """``flagged``: the blocks the audit flagged (red in the grid, so red in the block table)."""
        self.snapshot = snap
        self.flagged = frozenset(int(b) for b in flagged)
        for rid in self._kept:
            r = snap.request(rid)
            if r is not None:
                self._kept[rid] = r
        if self.model.set_snapshot(snap, self._kept) and self._kept:
            self._restore_selection()
        self._show_block_table()

    def _restore_selection(self) -> None:
        """The rows changed (the model was reset): select the kept requests again, without a new selection."""
        sm = self.table.selectionModel()
        self._restoring = True
        try:
            for rid in self._kept:
                row = self.model.row_of(rid)
                if row >= 0:
                    sm.select(self.model.index(row, 0), sm.SelectionFlag.Select | sm.SelectionFlag.Rows)
        finally:
            self._restoring = False

    def select(self, request_ids: list[str]) -> None:
        """Select these requests (one selection change: a listener never sees the empty one in between)."""
        sm = self.table.selectionModel()
        sm.blockSignals(True)
        try:
            sm.clearSelection()
            for rid in request_ids:
                row = self.model.row_of(rid)
                if row >= 0:
                    sm.select(self.model.index(row, 0), sm.SelectionFlag.Select | sm.SelectionFlag.Rows)
        finally:
            sm.blockSignals(False)
        self.table.viewport().update()
        self._on_selection()

    def _on_selection(self, *_):
        if self._restoring:
            return
        rows = sorted({i.row() for i in self.table.selectionModel().selectedRows()})
        self._kept = {self.model.rows[r].request_id: self.model.rows[r] for r in rows if r < len(self.model.rows)}
        self.selected_id = self.model.rows[rows[0]].request_id if rows else ""
        self._show_block_table()
        self.request_selected.emit(self.selected_id)

    def selected_ids(self) -> list[str]:
        """Every selected request, in table order."""
        rows = sorted({i.row() for i in self.table.selectionModel().selectedRows()})
        return [self.model.rows[r].request_id for r in rows if r < len(self.model.rows)]

    def selected_block_ids(self) -> tuple[int, ...]:
        info = self.snapshot.request(self.selected_id) if self.snapshot and self.selected_id else None
        return info.block_ids if info else ()

    def _show_block_table(self) -> None:
        info = self.snapshot.request(self.selected_id) if self.snapshot and self.selected_id else None
        if info is not None and info.group_block_ids:  # a hybrid model: a table per KV cache group
            held = f" · held: {info.held_by}" if info.held_by else ""
            self.caption.setText(
                f"block tables of request {self.selected_id}, one per KV cache group: logical -> physical{held}"
            )
            self.block_table.show_tables(self.snapshot, info.group_block_ids, self.flagged)
            return
        ids = self.selected_block_ids()
        held = f" · held: {info.held_by}" if info is not None and info.held_by else ""
        self.caption.setText(
            f"block table of request {self.selected_id}: logical -> physical{held}"
            if self.selected_id
            else "block table: select a request"
        )
        self.block_table.show_table(self.snapshot, ids, self.flagged)

    def set_miss_text(self, text: str, whole: str | None = None) -> None:
        """The selected request's prefix-cache line (its first missed block and why), under its block table;
        ``whole``: the whole explanation, when ``text`` is its short form (the label's tooltip)."""
        self.miss_label.setToolTip(whole or "")
        if text != self.miss_label.text():
            self.miss_label.setText(text)
            self._fit_lower()

    def resizeEvent(self, ev) -> None:  # noqa: N802 - Qt's name
        super().resizeEvent(ev)
        self._fit_lower()

    def _fit_lower(self) -> None:
        """Give the part under the table what its wrapped lines and the block table need (the splitter gave it
        its minimum hint, which counts a wrapped label as one line), the requests table the rest."""
        lay = self.lower.layout()
        width = self.lower.width() or self.width()
        need = (
            self.miss_label.heightForWidth(width)
            + self.caption.sizeHint().height()
            + self.block_table.height()
            + 2 * lay.spacing()
        )
        total = sum(self.split.sizes())
        if total > 0 and self.split.sizes()[1] < need:
            self.split.setSizes([max(self.table.minimumHeight(), total - need), need])
