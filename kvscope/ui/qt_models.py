"""Qt item models over snapshots and events (no widgets here)."""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import QAbstractTableModel, QModelIndex, QSortFilterProxyModel, Qt

from engine.inspect.events import Event
from engine.inspect.snapshot import KVSnapshot, RequestInfo
from kvscope.limits import LIMITS
from kvscope.ui.status_words import status_tip, status_words

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
    """The snapshot's requests (those in flight and the engine's last finished ones: the engine bounds
    them), and after them any ``keep`` row the snapshot no longer has (a selected request stays)."""

    # The key columns first (a narrow panel at 1280x720 shows them without scrolling): what a lesson watches
    # is how many prompt tokens came from the cache.
    HEADERS = ("id", "prompt", "cached", "output", "blocks", "state", "client", "text")

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[RequestInfo] = []
        self.kept: set[str] = set()  # ids of rows shown only because they were kept

    def set_snapshot(self, snap: KVSnapshot, keep: dict[str, RequestInfo] | None = None) -> bool:
        """Returns True when the rows changed (the model was reset: a view's selection is gone)."""
        rows = list(snap.requests)
        if keep:
            ids = {r.request_id for r in rows}
            extra = [r for rid, r in keep.items() if rid not in ids]
            self.kept = {r.request_id for r in extra}
            rows += extra
        else:
            self.kept = set()
        if [r.request_id for r in rows] == [r.request_id for r in self.rows]:
            self.rows = rows  # same rows: refresh cells, keep the selection
            if rows:
                self.dataChanged.emit(self.index(0, 0), self.index(len(rows) - 1, len(self.HEADERS) - 1))
            return False
        self.beginResetModel()
        self.rows = rows
        self.endResetModel()
        return True

    def data(self, index, role=Qt.ItemDataRole.DisplayRole):
        if not index.isValid():
            return None
        r = self.rows[index.row()]
        if role == Qt.ItemDataRole.DisplayRole:
            state = status_words(r.status) + (" (kept: selected)" if r.request_id in self.kept else "")
            return (
                r.request_id,
                r.num_prompt_tokens,
                r.num_cached_tokens,
                r.num_output_tokens,
                len(r.block_ids),
                state,
                r.client,
                r.text.replace("\n", " ⏎ ")[-200:],
            )[index.column()]
        if role == Qt.ItemDataRole.ToolTipRole:
            if index.column() == self.HEADERS.index("state"):  # vLLM's own word for the state
                return status_tip(r.status)
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
    """Every event of every step; append-only, the last ``max_rows`` kept (``kvscope.limits``), so a long
    run stays light. A row's details are written when first shown (or searched): describing every event as
    it came cost more than the rest of a step's bookkeeping in the window."""

    HEADERS = ("step", "kind", "details")
    KIND_ROLE = Qt.ItemDataRole.UserRole + 1
    EVENT_ROLE = Qt.ItemDataRole.UserRole + 2

    def __init__(self, max_rows: int = LIMITS.event_log_rows, decode: Callable[[list[int]], str] | None = None) -> None:
        super().__init__()
        self.rows: list[tuple[int, Event]] = []
        self._texts: list[str | None] = []  # each row's details, once written
        self.max_rows = max_rows
        self.dropped = 0  # rows dropped by the bound so far
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

    def extend(self, rows: list[tuple[int, Event]], keep_from: int | None = None) -> int:
        """Rows (step, event) at the end, in one insertion; past ``max_rows`` the oldest go first, but not the
        rows from ``keep_from`` on (those on screen) unless the log would hold twice its bound. Returns how
        many rows were dropped."""
        if not rows:
            return 0
        if len(rows) > self.max_rows:  # more at once than the log holds: the newest of them
            self.dropped += len(rows) - self.max_rows
            rows = rows[-self.max_rows :]
        total = len(self.rows) + len(rows)
        drop = max(0, total - self.max_rows)
        if keep_from is not None and drop > keep_from:
            drop = max(keep_from, total - 2 * self.max_rows)
        drop = min(drop, len(self.rows))
        if drop:
            self.beginRemoveRows(QModelIndex(), 0, drop - 1)
            del self.rows[:drop]
            del self._texts[:drop]
            self.endRemoveRows()
            self.dropped += drop
        n = len(self.rows)
        self.beginInsertRows(QModelIndex(), n, n + len(rows) - 1)
        self.rows.extend(rows)
        self._texts.extend([None] * len(rows))
        self.endInsertRows()
        return drop

    def clear(self) -> None:
        self.beginResetModel()
        self.rows.clear()
        self._texts.clear()
        self.dropped = 0
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
