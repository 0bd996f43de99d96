"""The event log: every event, filterable by kind, with a search box."""
from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QAbstractItemView, QCheckBox, QHBoxLayout, QLineEdit, QTableView, QVBoxLayout, QWidget

from engine.inspect.events import EVENT_TYPES, Event

from ..qt_models import EventFilterProxy, EventLogModel


class EventLogView(QWidget):
    event_activated = Signal(object)  # Event

    def __init__(self) -> None:
        super().__init__()
        self.model = EventLogModel()
        self.proxy = EventFilterProxy()
        self.proxy.setSourceModel(self.model)
        self.table = QTableView()
        self.table.setModel(self.proxy)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.horizontalHeader().setStretchLastSection(True)
        self.table.verticalHeader().hide()
        self.table.clicked.connect(self._on_click)
        self.search = QLineEdit()
        self.search.setPlaceholderText("search events (block id, request id, kind…)")
        self.search.textChanged.connect(self.proxy.set_text)
        self.kind_boxes: dict[str, QCheckBox] = {}
        filters = QHBoxLayout()
        for kind in EVENT_TYPES:
            box = QCheckBox(kind)
            box.toggled.connect(self._on_kinds)
            self.kind_boxes[kind] = box
            filters.addWidget(box)
        filters.addStretch(1)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addLayout(filters)
        lay.addWidget(self.search)
        lay.addWidget(self.table, 1)
        self._follow = True

    def append(self, step: int, events: list[Event]) -> None:
        bar = self.table.verticalScrollBar()
        self._follow = bar.value() >= bar.maximum() - 2
        self.model.append(step, events)
        if self._follow:
            self.table.scrollToBottom()

    def set_kinds(self, kinds: set[str]) -> None:
        for k, box in self.kind_boxes.items():
            box.blockSignals(True)
            box.setChecked(k in kinds)
            box.blockSignals(False)
        self.proxy.set_kinds(kinds)

    def visible_events(self) -> list[Event]:
        return [self.proxy.index(r, 0).data(EventLogModel.EVENT_ROLE) for r in range(self.proxy.rowCount())]

    def _on_kinds(self, *_):
        self.proxy.set_kinds({k for k, b in self.kind_boxes.items() if b.isChecked()})

    def _on_click(self, index) -> None:
        ev = index.data(EventLogModel.EVENT_ROLE) if index.isValid() else None
        if ev is None:
            ev = self.proxy.index(index.row(), 0).data(EventLogModel.EVENT_ROLE)
        if ev is not None:
            self.event_activated.emit(ev)

    def activate_row(self, row: int) -> None:
        """Same as a click on the row (used by tests and keyboard navigation)."""
        idx = self.proxy.index(row, 0)
        self.table.setCurrentIndex(idx)
        self._on_click(idx)

