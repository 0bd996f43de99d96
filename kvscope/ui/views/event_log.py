"""The event log: every event, filterable by kind (a compact checkable menu), a search box, and a last step.

``kind_boxes[kind]`` are checkable actions (``setChecked``/``isChecked``/``toggled``); none checked
shows every kind. ``set_max_step(step)`` shows events up to that step (the timeline), None: all.
``set_decode(fn)`` adds tokens' text next to their ids in the details. Events are added to the table a
frame at a time (``append`` collects them; ``flush``, or a timer ~30 times a second, shows them).
The log keeps the last ``kvscope.limits.LIMITS.event_log_rows`` events (the label beside the search box
says so); the oldest go first, but never the rows on screen while the view is not following the end.
"""

from __future__ import annotations

from PySide6.QtCore import QTimer, Signal
from PySide6.QtGui import QAction
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QMenu,
    QTableView,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from engine.inspect.events import EVENT_TYPES, Event
from kvscope.limits import LIMITS, event_log_text
from kvscope.ui.qt_models import EventFilterProxy, EventLogModel


class EventLogView(QWidget):
    event_activated = Signal(object)  # Event

    def __init__(self, decode=None, max_rows: int = LIMITS.event_log_rows) -> None:
        super().__init__()
        self.model = EventLogModel(max_rows, decode=decode)
        self.proxy = EventFilterProxy()
        self.proxy.setSourceModel(self.model)
        self.table = QTableView()
        self.table.setModel(self.proxy)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.horizontalHeader().setStretchLastSection(True)
        self.table.verticalHeader().hide()
        self.table.setMinimumSize(120, 60)
        self.table.clicked.connect(self._on_click)
        self.search = QLineEdit()
        self.search.setPlaceholderText("search events (block id, request id, kind…)")
        self.search.setMinimumWidth(60)
        self.search.textChanged.connect(self.proxy.set_text)
        self.kinds_button = QToolButton()
        self.kinds_button.setPopupMode(QToolButton.ToolButtonPopupMode.InstantPopup)
        self.kinds_menu = QMenu(self.kinds_button)
        all_kinds = QAction("show every kind", self.kinds_menu)
        all_kinds.triggered.connect(lambda: self.set_kinds(set()))
        self.kinds_menu.addAction(all_kinds)
        self.kinds_menu.addSeparator()
        self.kind_boxes: dict[str, QAction] = {}
        for kind in EVENT_TYPES:
            act = QAction(kind, self.kinds_menu)
            act.setCheckable(True)
            act.toggled.connect(self._on_kinds)
            self.kind_boxes[kind] = act
            self.kinds_menu.addAction(act)
        self.kinds_button.setMenu(self.kinds_menu)
        self.step_label = QLabel("")
        self.step_label.setStyleSheet("color: #8a93a5")
        self.bound_label = QLabel("")  # the log's bound: "event log: last 100,000 events"
        self.bound_label.setStyleSheet("color: #8a93a5")
        self.bound_label.setMinimumWidth(1)  # shown whole where there is room; it never widens the window
        filters = QHBoxLayout()
        filters.setContentsMargins(0, 0, 0, 0)
        filters.addWidget(self.kinds_button)
        filters.addWidget(self.search, 1)
        filters.addWidget(self.step_label)
        filters.addWidget(self.bound_label)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addLayout(filters)
        lay.addWidget(self.table, 1)
        self._follow = True
        self._label_kinds()
        self._label_bound()
        self._pending: list[tuple[int, Event]] = []
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setInterval(33)
        self._timer.timeout.connect(self.flush)

    def set_decode(self, fn) -> None:
        self.model.set_decode(fn)

    def append(self, step: int, events: list[Event]) -> None:
        """A step's events, shown at the next ``flush`` (one insertion and one scroll a frame, not a step)."""
        if not events:
            return
        self._pending += [(step, e) for e in events]
        if not self._timer.isActive():
            self._timer.start()

    def flush(self) -> None:
        self._timer.stop()
        if not self._pending:
            return
        rows, self._pending = self._pending, []
        bar = self.table.verticalScrollBar()
        self._follow = bar.value() >= bar.maximum() - 2
        # Looking back (scrolled up, or at a step of the timeline): the rows on screen stay, and stay in view.
        top = None if self._follow and self.proxy.max_step is None else self.first_visible_row()
        dropped = self.model.extend(rows, top)
        if self._follow:
            self.table.scrollToBottom()
        elif top is not None and dropped:
            idx = self.proxy.mapFromSource(self.model.index(top - dropped, 0))
            if idx.isValid():
                self.table.scrollTo(idx, QAbstractItemView.ScrollHint.PositionAtTop)
        if dropped:
            self._label_bound()

    def first_visible_row(self) -> int | None:
        """The model's row at the top of the view (None: no row shown)."""
        r = self.table.rowAt(0)
        if r < 0:
            return None
        return self.proxy.mapToSource(self.proxy.index(r, 0)).row()

    def clear(self) -> None:
        self._pending = []
        self.model.clear()
        self._label_bound()

    def _label_bound(self) -> None:
        m = self.model
        self.bound_label.setText(event_log_text(m.max_rows))
        self.bound_label.setToolTip(
            f"the log keeps the last {m.max_rows:,} events; older ones go first, never the rows on screen"
            + (f" ({m.dropped:,} dropped so far)" if m.dropped else "")
        )

    def set_kinds(self, kinds: set[str]) -> None:
        self.flush()
        for k, box in self.kind_boxes.items():
            box.blockSignals(True)
            box.setChecked(k in kinds)
            box.blockSignals(False)
        self.proxy.set_kinds(kinds)
        self._label_kinds()

    def set_max_step(self, step: int | None) -> None:
        """Show the events up to ``step`` (the timeline's position); None shows all of them."""
        self.flush()
        self.proxy.set_max_step(step)
        self.step_label.setText("" if step is None else f"up to step {step}")
        if step is not None:
            self.table.scrollToBottom()

    def visible_events(self) -> list[Event]:
        self.flush()
        return [self.proxy.index(r, 0).data(EventLogModel.EVENT_ROLE) for r in range(self.proxy.rowCount())]

    def _on_kinds(self, *_):
        self.proxy.set_kinds({k for k, b in self.kind_boxes.items() if b.isChecked()})
        self._label_kinds()

    def _label_kinds(self) -> None:
        on = [k for k, b in self.kind_boxes.items() if b.isChecked()]
        self.kinds_button.setText(
            "kinds: all ▾" if not on else f"kinds: {on[0]} ▾" if len(on) == 1 else f"kinds: {len(on)} ▾"
        )
        self.kinds_button.setToolTip("show only these kinds: " + (", ".join(on) if on else "all"))

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
