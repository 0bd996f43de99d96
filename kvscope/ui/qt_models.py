"""Qt item models over snapshots and events (no widgets here)."""
from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import QAbstractTableModel, QModelIndex, QSortFilterProxyModel, Qt

from engine.inspect.events import Event
from engine.inspect.snapshot import KVSnapshot, RequestInfo

_ROOT = QModelIndex()  # the invisible root: these models are flat tables


class _FlatTableModel(QAbstractTableModel):
    """A flat table over ``self.rows`` with fixed ``HEADERS``."""

    HEADERS: tuple[str, ...] = ()
    rows: list

    def rowCount(self, parent=_ROOT) -> int:  # noqa: N802 - Qt's name
        return 0 if parent.isValid() else len(self.rows)

    def columnCount(self, parent=_ROOT) -> int:  # noqa: N802
        return len(self.HEADERS)

    def headerData(self, section, orientation, role=Qt.ItemDataRole.DisplayRole):  # noqa: N802
        if role == Qt.ItemDataRole.DisplayRole and orientation == Qt.Orientation.Horizontal:
            return self.HEADERS[section]
        return None


class RequestTableModel(_FlatTableModel):
    HEADERS = ("id", "state", "prompt", "output", "cached", "blocks", "client", "text")

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[RequestInfo] = []

    def set_snapshot(self, snap: KVSnapshot) -> None:
        rows = list(snap.requests)
        if [r.request_id for r in rows] == [r.request_id for r in self.rows]:
            self.rows = rows  # same rows: refresh cells, keep the selection
            if rows:
                self.dataChanged.emit(self.index(0, 0), self.index(len(rows) - 1, len(self.HEADERS) - 1))
            return
        self.beginResetModel()
        self.rows = rows
        self.endResetModel()

    def data(self, index, role=Qt.ItemDataRole.DisplayRole):
        if not index.isValid():
            return None
        r = self.rows[index.row()]
        if role == Qt.ItemDataRole.DisplayRole:
            return (r.request_id, r.status.lower(), r.num_prompt_tokens, r.num_output_tokens,
                    r.num_cached_tokens, len(r.block_ids), r.client, r.text.replace("\n", " ⏎ ")[-200:])[index.column()]
        if role == Qt.ItemDataRole.ToolTipRole:
            return r.error or r.text
        if role == Qt.ItemDataRole.UserRole:
            return r.request_id
        return None

    def row_of(self, request_id: str) -> int:
        return next((i for i, r in enumerate(self.rows) if r.request_id == request_id), -1)


def describe(ev: Event, decode: Callable[[list[int]], str] | None = None) -> str:
    """One line of an event's fields; with ``decode``, token ids are followed by their text."""
    d = ev.to_dict()
    d.pop("kind")
    parts = []
    for k, v in d.items():
        part = f"{k}={v[:12] if k.endswith('_hash') and isinstance(v, str) else v}"
        if decode is not None and k == "token_ids" and v:
            try:
                part += f" {decode(list(v))!r}"
            except Exception:  # noqa: BLE001 - a bad id must not break the log
                pass
        parts.append(part)
    return ", ".join(parts)


class EventLogModel(_FlatTableModel):
    """Every event of every step; append-only, capped so a long run stays light. A row's details are
    written when first shown (or searched): describing every event as it came cost more than the rest of
    a step's bookkeeping in the window."""

    HEADERS = ("step", "kind", "details")
    KIND_ROLE = Qt.ItemDataRole.UserRole + 1
    EVENT_ROLE = Qt.ItemDataRole.UserRole + 2

    def __init__(self, max_rows: int = 200_000, decode: Callable[[list[int]], str] | None = None) -> None:
        super().__init__()
        self.rows: list[tuple[int, Event]] = []
        self._texts: list[str | None] = []  # each row's details, once written
        self.max_rows = max_rows
        self.decode = decode

    def set_decode(self, decode: Callable[[list[int]], str] | None) -> None:
        """Show token ids' text from now on (rows already there are described again)."""
        self.decode = decode
        if self.rows:
            self.beginResetModel()
            self._texts = [None] * len(self.rows)
            self.endResetModel()

    def text(self, row: int) -> str:
        t = self._texts[row]
        if t is None:
            t = self._texts[row] = describe(self.rows[row][1], self.decode)
        return t

    def append(self, step: int, events: list[Event]) -> None:
        self.extend([(step, e) for e in events])

    def extend(self, rows: list[tuple[int, Event]]) -> None:
        """Rows (step, event) at the end, in one insertion."""
        if not rows:
            return
        drop = max(0, len(self.rows) + len(rows) - self.max_rows)
        if drop:
            self.beginRemoveRows(QModelIndex(), 0, drop - 1)
            del self.rows[:drop]
            del self._texts[:drop]
            self.endRemoveRows()
        n = len(self.rows)
        self.beginInsertRows(QModelIndex(), n, n + len(rows) - 1)
        self.rows.extend(rows)
        self._texts.extend([None] * len(rows))
        self.endInsertRows()

    def clear(self) -> None:
        self.beginResetModel()
        self.rows.clear()
        self._texts.clear()
        self.endResetModel()

    def data(self, index, role=Qt.ItemDataRole.DisplayRole):
        if not index.isValid():
            return None
        step, ev = self.rows[index.row()]
        if role == Qt.ItemDataRole.DisplayRole:
            c = index.column()
            return step if c == 0 else ev.kind if c == 1 else self.text(index.row())
        if role == self.KIND_ROLE:
            return ev.kind
        if role == self.EVENT_ROLE:
            return ev
        return None


class EventFilterProxy(QSortFilterProxyModel):
    """Filter by a set of kinds (empty: all), a case-insensitive search over the details, and a
    last step (``max_step``: the timeline's position; None shows every step)."""

    def __init__(self) -> None:
        super().__init__()
        self.kinds: set[str] = set()
        self.text = ""
        self.max_step: int | None = None

    def set_max_step(self, step: int | None) -> None:
        if step != self.max_step:
            self.max_step = step
            self.invalidateFilter()

    def set_kinds(self, kinds: set[str]) -> None:
        self.kinds = set(kinds)
        self.invalidateFilter()

    def set_text(self, text: str) -> None:
        self.text = text.lower().strip()
        self.invalidateFilter()

    def filterAcceptsRow(self, row, parent) -> bool:  # noqa: N802
        model = self.sourceModel()
        step, ev = model.rows[row]
        if self.max_step is not None and step > self.max_step:
            return False
        if self.kinds and ev.kind not in self.kinds:
            return False
        return not self.text or self.text in f"{step} {ev.kind} {model.text(row)}".lower()
