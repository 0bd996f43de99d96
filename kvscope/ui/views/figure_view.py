"""The PagedAttention paper's figures, live: logical KV blocks, block table, physical KV blocks.

For one request (the paper's figure 4) or two side by side (figure 5: two requests interleaved in
one pool; figure 6: two samples sharing blocks, then copy-on-write): each request's logical blocks
with the tokens in their slots, its block table (logical -> physical, # filled, ref count), and the
pool's physical blocks (the mapped ones plus neighbours, so interleaving shows) with arrows from
the table's rows to them. A token already sampled but not yet written to the cache (it is written
at the next step) is drawn dashed in the slot it will take.

API: ``FigureView()``; ``set_snapshot(snap)``, ``set_requests([ids])`` (one or two),
``set_decode(fn)``, ``set_events(events)`` (optional: names the step's copy-on-write copies);
``cells()`` returns what is drawn (tests). The item count is bounded by ``MAX_FIGURE_BLOCKS``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

from PySide6.QtCore import QPointF, QRectF, QSize, Qt
from PySide6.QtGui import QBrush, QColor, QFont, QFontMetricsF, QPainter, QPainterPath, QPen, QPolygonF
from PySide6.QtWidgets import (
    QComboBox,
    QGraphicsScene,
    QGraphicsSimpleTextItem,
    QGraphicsView,
    QLabel,
    QSizePolicy,
    QVBoxLayout,
    QWidget,
)

from engine.inspect.snapshot import KVSnapshot, RequestInfo
from kvscope.ui import palette
from kvscope.ui.status_words import status_words
from kvscope.ui.style import min_text_px, text_scale
from kvscope.ui.views.banner import block_ranges
from kvscope.ui.views.token_text import BlockTokens, TokenDecoder, request_block_tokens, request_filled

MAX_FIGURE_BLOCKS = 24  # logical blocks drawn per request (the first 2 and the last ones)
MAX_PHYSICAL_SPAN = 20  # show every block between the lowest and highest mapped one up to this span
MIN_PHYSICAL_ROWS = 8  # and at least this many, so the pool looks like a pool
SLOT_W, SLOT_H = 72.0, 26.0
SLOTS_PER_LINE = 8  # a block of 16 is drawn as two lines of 8 slots (or four of 4 where the panel is narrow)
MIN_TEXT_PX = 10.0  # the smallest text on screen: the figure scrolls rather than shrink below it
LABEL_W = 56.0
TABLE_COLS = (("logical", 48.0), ("physical", 60.0), ("# filled", 58.0), ("ref", 34.0))
GAP = 46.0  # between columns (room for the arrows)
PHYS_LABEL_W = 90.0
ROW_GAP = 8.0
PRESENT_TEXT_PX = 12.0  # presenting: every text of the figure is this times the text scale (18 px at 1.5), unzoomed
MIN_PRESENT_ROWS = 3  # presenting: a request's logical blocks are cut to no fewer rows than this (with a gap row)
INK = QColor(216, 222, 233)
DIM = QColor(138, 147, 165)
EMPTY = QColor(34, 38, 45)
PAPER = QColor(30, 33, 39)
FOCUS = QColor(255, 255, 255)


def _qc(rgb, alpha: int = 255) -> QColor:
    c = QColor(*rgb)
    c.setAlpha(alpha)
    return c


def presenting() -> bool:
    return min_text_px() is not None


def present_text_px() -> int:
    """The figure's text while presenting: 12 px times the text scale (18 px at presentation's 1.5), drawn 1:1."""
    return round(PRESENT_TEXT_PX * text_scale())


def _font(px: float, bold: bool = False) -> QFont:
    f = QFont()
    f.setPixelSize(max(1, round(px)))
    f.setBold(bold)
    return f


def _text_item(s: str, px: int, bold: bool, italic: bool, elide: float) -> QGraphicsSimpleTextItem:
    """``s`` at ``px``, elided to ``elide`` pixels where it is longer (0: never)."""
    it = QGraphicsSimpleTextItem(s)
    f = _font(px, bold)
    f.setItalic(italic)
    it.setFont(f)
    if elide and it.boundingRect().width() > elide:
        # by the font's metrics in one pass (a workload's prompt is 100k tokens: trimming a character at a
        # time and measuring each try took minutes)
        it.setText(QFontMetricsF(f).elidedText(s[: int(elide) + 2], Qt.TextElideMode.ElideRight, elide))
    return it


@functools.lru_cache(maxsize=8192)
def _text_box(
    s: str, px: int, bold: bool, italic: bool, elide: float, _family: str
) -> tuple[float, float, float, float]:
    """The box ``_text_item`` would take (x, y, width, height at position 0): a step's figure repeats most texts
    (``_family``: the application's font, part of the key)."""
    r = _text_item(s, px, bold, italic, elide).boundingRect()
    return r.x(), r.y(), r.width(), r.height()


def _aligned(x: float, w: float, align: str, width: float) -> float:
    if align == "centre":
        return x + (width - w) / 2
    if align == "right":
        return x + width - w
    return x


@dataclass(frozen=True, slots=True)
class Metrics:
    """The figure's sizes in scene pixels: the paper's proportions at 12 px (zoomed to the panel), or, while
    presenting, measured from the presentation's text size (drawn unzoomed: the text is what a room reads)."""

    px: float  # body text
    small: float  # secondary text (the prompt line, "ref" labels): the body's size while presenting
    head: float  # a request's title
    slot_w: float
    slot_h: float
    label_w: float
    table: tuple[tuple[str, float], ...]
    gap: float
    phys_label_w: float
    row_gap: float
    bar_w: float  # a block drawn as one bar of its text (a large block while presenting)

    @property
    def table_w(self) -> float:
        return sum(w for _, w in self.table)

    @property
    def line(self) -> float:
        return round(self.px * 1.45)

    @staticmethod
    def now() -> Metrics:
        if not presenting():  # each table column at least as wide as its bold head ("logical physical" ran together)
            bold = QFontMetricsF(_font(12, True))
            table = tuple((n, max(w, bold.horizontalAdvance(n) + 8)) for n, w in TABLE_COLS)
            return Metrics(12, 11, 14, SLOT_W, SLOT_H, LABEL_W, table, GAP, PHYS_LABEL_W, ROW_GAP, 6 * SLOT_W)
        px = present_text_px()
        fm, bold = QFontMetricsF(_font(px)), QFontMetricsF(_font(px, True))
        slot_w = max(max(fm.horizontalAdvance(w) for w in ("score", "seven", "years", "times")) + 10, 3.2 * px)
        table = tuple((n, max(bold.horizontalAdvance(n), fm.horizontalAdvance("000")) + 14) for n, _ in TABLE_COLS)
        return Metrics(
            px,
            px,
            px,
            slot_w,
            round(px * 1.6),
            fm.horizontalAdvance("block 00") + 12,
            table,
            round(1.8 * px),
            fm.horizontalAdvance("block 00") + fm.horizontalAdvance("ref 00") + 18,
            round(px * 0.35),
            5.5 * slot_w,
        )


@dataclass(frozen=True, slots=True)
class Layout:
    """How the figure is laid out: what presentation changes, one step at a time, until the lesson fits."""

    per_line: int = SLOTS_PER_LINE  # slots a line of a block
    stacked: bool = False  # two requests: one above the other (the pool on their right), not either side of it
    bars: bool = False  # each block as one bar of its text (its slots as ticks), not a slot a token
    mapped_only: bool = False  # the pool's rows: only the blocks drawn (with gaps), not their neighbours
    legend: bool = True  # the line under the figure that says what a dashed slot is
    compact: bool = False  # no prompt line over a request, no "logical" column in its table (its rows say it)
    max_rows: int | None = None  # a request's logical blocks: the first and the last ones, a gap row between


def present_layouts(block_size: int, two: bool, longest: int) -> list[Layout]:
    """Presentation's layouts, the paper's own first, then by what each gives up, least first: two requests
    stacked instead of either side of the pool; narrower blocks (more lines each), or blocks as bars; a pool of
    the drawn blocks only; no line saying what a dashed slot is; compact heads and tables; then fewer logical rows.
    The first that fits is drawn: the text never shrinks."""
    lines = [n for n in (min(block_size, SLOTS_PER_LINE), 4, 2) if n <= block_size and block_size / n <= 4]
    shapes = [(n, False) for n in dict.fromkeys(lines)] + ([(block_size, True)] if block_size > 4 else [])
    rows = [None] + list(range(longest - 1, MIN_PRESENT_ROWS - 1, -1))
    out = []
    for cut, max_rows in enumerate(rows):
        for compact in (False, True):
            for legend in (True, False):
                for mapped_only in (False, True):
                    for k, (per_line, bars) in enumerate(shapes):
                        for stacked in (False, True) if two else (False,):
                            cost = (cut, compact, not legend, mapped_only, k, stacked)
                            out.append((cost, Layout(per_line, stacked, bars, mapped_only, legend, compact, max_rows)))
    return [lay for _, lay in sorted(out, key=lambda t: t[0])]


class _Bounds:
    """A scene that only measures: what ``FigureView._draw`` would draw, as one bounding rectangle (a layout is
    tried this way, and only the one that fits is drawn)."""

    def __init__(self) -> None:
        self.rect = QRectF()

    def _unite(self, r: QRectF) -> None:
        self.rect = r if self.rect.isNull() else self.rect.united(r)

    def addRect(self, r: QRectF, *_):  # noqa: N802 - QGraphicsScene's names
        self._unite(QRectF(r))

    def addLine(self, x1, y1, x2, y2, *_):  # noqa: N802
        self._unite(QRectF(QPointF(x1, y1), QPointF(x2, y2)).normalized())

    def addPath(self, path, *_):  # noqa: N802
        self._unite(path.boundingRect())

    def addPolygon(self, poly, *_):  # noqa: N802
        self._unite(poly.boundingRect())

    def addItem(self, item) -> None:  # noqa: N802
        self._unite(item.sceneBoundingRect())

    def itemsBoundingRect(self) -> QRectF:  # noqa: N802
        return QRectF(self.rect)

    def clear(self) -> None:
        self.rect = QRectF()

    def setSceneRect(self, r: QRectF) -> None:  # noqa: N802
        self.scene_rect = QRectF(r)

    def sceneRect(self) -> QRectF:  # noqa: N802
        return self.scene_rect


def slot_offset(j: int, per_line: int, m: Metrics) -> tuple[float, float]:
    """(dx, dy) of slot ``j`` inside a block drawn as lines of ``per_line`` slots."""
    return (j % per_line) * m.slot_w, (j // per_line) * m.slot_h


def block_size_px(block_size: int, lay: Layout, m: Metrics) -> tuple[float, float]:
    """(width, height) of a block's slots (or its bar)."""
    if lay.bars:
        return m.bar_w, m.slot_h
    return min(block_size, lay.per_line) * m.slot_w, math.ceil(block_size / lay.per_line) * m.slot_h


def figure_width(block_size: int, two: bool, per_line: int) -> float:
    """The scene's width at the paper's layout: [A logical][A table] [physical] ([B table][B logical])."""
    m, lay = Metrics.now(), Layout(per_line)
    blk = block_size_px(block_size, lay, m)[0]
    one = m.label_w + blk + 16 + m.table_w + m.gap + m.phys_label_w + blk
    return one + (m.gap + m.table_w + 16 + m.label_w + blk if two else 0.0)


def _soft(rgb, t: float) -> QColor:
    """``rgb`` mixed with white by ``t`` (a paper-like fill that black text reads on)."""
    return QColor(*(int(c + (255 - c) * t) for c in rgb))


class _FitView(QGraphicsView):
    def __init__(self, scene: QGraphicsScene, on_resize) -> None:
        super().__init__(scene)
        self._on_resize = on_resize

    def resizeEvent(self, ev) -> None:  # noqa: N802 - Qt's name
        super().resizeEvent(ev)
        self._on_resize()


class FigureView(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.snapshot: KVSnapshot | None = None
        self.request_ids: list[str] = []
        self.focus_blocks: list[int] = []  # blocks the lesson names (a leak's), outlined and drawn in the pool
        self.why = ""  # the rule that chose what is drawn (``kvscope.ui.focus``), the figure's first line
        self.flagged: set[int] = set()
        self.flag_kinds: dict[int, str] = {}
        self.layout_used = Layout()  # the layout of the last drawing (presentation picks one that fits)
        self.decoder = TokenDecoder()
        self.events: list = []
        self._cells: dict = {"requests": {}, "physical": {}, "arrows": []}
        self._lesson = None
        self._holding = 0  # held(): a step's changes drawn once, at its end
        self.scene = QGraphicsScene(self)
        self.view = _FitView(self.scene, self._fit)
        self.view.setRenderHint(QPainter.RenderHint.Antialiasing, True)
        self.view.setRenderHint(QPainter.RenderHint.TextAntialiasing, True)
        self.view.setBackgroundBrush(QBrush(PAPER))
        self.view.setAlignment(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignTop)
        self.view.setMinimumSize(200, 120)
        self.caption = QLabel("")
        self.caption.setWordWrap(True)
        self.caption.setTextFormat(Qt.TextFormat.RichText)
        self.caption.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        # a hybrid model's KV cache groups (a probed vLLM's): which group's tables the figure draws
        self.group = -1  # -1: the request's first table (the full-attention group's)
        self.group_box = QComboBox()
        self.group_box.setToolTip("a hybrid model has a block table per KV cache group: the group drawn")
        self.group_box.currentIndexChanged.connect(self._group_picked)
        self.group_box.hide()
        lay = QVBoxLayout(self)
        lay.setContentsMargins(2, 2, 2, 2)
        lay.addWidget(self.group_box)
        lay.addWidget(self.view, 1)
        lay.addWidget(self.caption)
        self._redraw()

    @property
    def per_line(self) -> int:
        return self.layout_used.per_line

    def _group_picked(self, i: int) -> None:
        self.group = int(self.group_box.itemData(i)) if i >= 0 and self.group_box.itemData(i) is not None else -1
        self._redraw()

    def set_group(self, group: int) -> None:
        """Draw KV cache group ``group``'s tables (-1: each request's first table)."""
        i = self.group_box.findData(group)
        if i >= 0:
            self.group_box.setCurrentIndex(i)
        else:
            self.group = group
            self._redraw()

    def _group_items(self, snap: KVSnapshot) -> None:
        """The picker's groups, shown only when the pool has several."""
        labels = [g.label() for g in snap.kv_groups]
        items = [
            (f"KV cache group {g}" + (f": {labels[g]}" if g < len(labels) else ""), g) for g in range(snap.num_groups)
        ]
        if snap.num_groups < 2:
            self.group_box.hide()
            return
        if [self.group_box.itemText(i) for i in range(self.group_box.count())] != [t for t, _ in items]:
            self.group_box.blockSignals(True)
            self.group_box.clear()
            for text, g in items:
                self.group_box.addItem(text, g)
            first = next((g for g, x in enumerate(snap.kv_groups) if x.holds_every_token), 0)
            self.group_box.setCurrentIndex(self.group if 0 <= self.group < len(items) else first)
            self.group = int(self.group_box.currentData())
            self.group_box.blockSignals(False)
        self.group_box.show()

    def sizeHint(self) -> QSize:  # noqa: N802
        return QSize(900, 420)

    # -- API ----------------------------------------------------------------------------
    def set_snapshot(self, snap: KVSnapshot | None, flagged=None, flag_kinds: dict[int, str] | None = None) -> None:
        """``flagged``: blocks the audit found wrong (drawn red, as in the grid); ``flag_kinds``: each one's problem."""
        self.snapshot = snap
        self.flagged = set(int(b) for b in flagged) if flagged is not None else set()
        self.flag_kinds = dict(flag_kinds or {})
        self._redraw()

    def _state(self, b: int):
        """Block ``b``'s colour class: its state's, or the audit's where the audit flagged it (one colour
        language with the grid: ``palette.STATES``)."""
        return palette.block_state(self.snapshot, b, self.flagged)

    def set_requests(self, request_ids: list[str]) -> None:
        """Draw these requests (the first two: a third would not fit the paper's layout)."""
        self.set_focus(request_ids, self.focus_blocks, self.why)

    def set_focus(self, request_ids: list[str], blocks=(), why: str = "") -> None:
        """Draw these requests (one or two) and the pool's ``blocks`` (a lesson's: a leak's, outlined), and say
        ``why`` these (the rule that chose them) on the figure's first line."""
        self.request_ids = [r for r in request_ids if r][:2]
        self.focus_blocks = sorted({int(b) for b in blocks})
        self.why = why
        self._redraw()

    def set_decode(self, fn) -> None:
        self.decoder.set_decode(fn)
        self._redraw()

    def set_events(self, events: list) -> None:
        """The step's events (optional): copy-on-write copies are named under the figure."""
        self.events = list(events or [])
        self._redraw()

    def cells(self) -> dict:
        """What is drawn: ``requests[id]`` = {"logical": [(i, [slot labels])], "table": [(i, physical,
        filled, ref)], "pending": (i, slot, label) | None}; ``physical`` = {block: [slot labels]};
        ``arrows`` = [(request id, logical, physical)]; ``state_colours`` = {block: the RGB its ref cell is
        filled with, its state's}."""
        self._ensure()
        return self._cells

    # -- drawing --------------------------------------------------------------------------
    def _text(
        self,
        s: str,
        x: float,
        y: float,
        colour: QColor = INK,
        size: float | None = None,
        bold: bool = False,
        italic: bool = False,
        align: str = "left",
        width: float = 0.0,
        elide: float = 0.0,
    ) -> QGraphicsSimpleTextItem | None:
        """A text item; ``size`` defaults to the body's; while presenting no text is smaller than the body's. None
        while a layout is only measured (``_Bounds``)."""
        m = self._m
        px = m.px if size is None or presenting() else size
        if isinstance(self.scene, _Bounds):
            # a layout being measured: the text's box, measured once by the same item (most of a step's figure
            # time went to making text items that were only measured)
            x0, y0, w, h = _text_box(s, round(px), bold, italic, elide, QFont().family())
            self.scene.addRect(QRectF(_aligned(x, w, align, width) + x0, y + y0, w, h))
            return None
        it = _text_item(s, round(px), bold, italic, elide)
        it.setBrush(QBrush(colour))
        it.setPos(_aligned(x, it.boundingRect().width(), align, width), y)
        self.scene.addItem(it)
        return it

    def _slot(
        self,
        x: float,
        y: float,
        label: str | None,
        fill: QColor,
        ink: QColor | None = None,
        pending: bool = False,
        border: QColor | None = None,
    ) -> None:
        m = self._m
        ink = ink or QColor(0, 0, 0)
        pen = QPen(border or QColor(90, 96, 110))
        pen.setWidthF(1.2)
        if pending:
            pen = QPen(INK)
            pen.setStyle(Qt.PenStyle.DashLine)
        self.scene.addRect(QRectF(x, y, m.slot_w, m.slot_h), pen, QBrush(fill))
        if label:
            self._text(
                label, x + 4, y + (m.slot_h - m.line) / 2, DIM if pending else ink, italic=pending, elide=m.slot_w - 8
            )

    def _bar(
        self,
        x: float,
        y: float,
        toks: tuple[int, ...],
        size: int,
        fill: QColor,
        ink: QColor,
        border: QColor,
        pending: int | None = None,
    ) -> None:
        """A block as one bar: its filled slots in ``fill``, the rest empty, its text over the filled part, a tick
        between slots; ``pending``: the slot of a token sampled but not yet written (dashed)."""
        m = self._m
        tick = m.bar_w / size
        n = len(toks)
        self.scene.addRect(QRectF(x, y, m.bar_w, m.slot_h), QPen(border), QBrush(EMPTY))
        if n:
            self.scene.addRect(QRectF(x, y, tick * n, m.slot_h), QPen(Qt.PenStyle.NoPen), QBrush(fill))
        pen = QPen(border.darker(130))
        for j in range(1, size):
            self.scene.addLine(x + j * tick, y + m.slot_h - 5, x + j * tick, y + m.slot_h, pen)
        if pending is not None and pending < size:
            dash = QPen(INK)
            dash.setStyle(Qt.PenStyle.DashLine)
            self.scene.addRect(QRectF(x + pending * tick, y, tick, m.slot_h), dash, QBrush(Qt.BrushStyle.NoBrush))
        if n:
            text = self.decoder.join(toks).replace("\n", "⏎").strip() or "␣"
            self._text(text, x + 4, y + (m.slot_h - m.line) / 2, ink, elide=max(tick * n - 8, m.slot_w))

    def _arrow(self, a: QPointF, b: QPointF, colour: QColor) -> None:
        path = QPainterPath(a)
        mid = (a.x() + b.x()) / 2
        path.cubicTo(QPointF(mid, a.y()), QPointF(mid, b.y()), b)
        pen = QPen(colour)
        pen.setWidthF(1.8 if not presenting() else 2.5)
        self.scene.addPath(path, pen)
        ang = math.atan2(0.0, b.x() - mid)  # the curve arrives horizontally
        size = 8.0 if not presenting() else 11.0
        head = QPolygonF(
            [
                b,
                QPointF(b.x() - size * math.cos(ang - 0.45), b.y() - size * math.sin(ang - 0.45)),
                QPointF(b.x() - size * math.cos(ang + 0.45), b.y() - size * math.sin(ang + 0.45)),
            ]
        )
        self.scene.addPolygon(head, QPen(colour), QBrush(colour))

    def _shown_logical(self, r: RequestInfo, lay: Layout) -> list[int | None]:
        """Logical block indices drawn (None: a gap row): all, or the first two and the last ones."""
        n = len(r.block_ids)
        most = min(MAX_FIGURE_BLOCKS, lay.max_rows or MAX_FIGURE_BLOCKS)
        if n <= most:
            return list(range(n))
        head = 2 if most > 4 else 1
        return list(range(head)) + [None] + list(range(n - (most - head - 1), n))

    def _shown_physical(self, mapped: set[int], lay: Layout) -> list[int | None]:
        n = self.snapshot.num_blocks
        if not mapped:
            return []
        if lay.mapped_only:
            keep = sorted(mapped)
        else:
            lo, hi = max(0, min(mapped) - 1), min(n - 1, max(mapped) + 1)
            least = 0 if presenting() else MIN_PHYSICAL_ROWS  # presenting: the height is the lesson's
            if hi - lo + 1 < least:
                hi = min(n - 1, lo + least - 1)
                lo = max(0, hi - least + 1)
            if hi - lo + 1 <= MAX_PHYSICAL_SPAN:
                return list(range(lo, hi + 1))
            keep = sorted({x for b in mapped for x in (b - 1, b, b + 1) if 0 <= x < n})
        out: list[int | None] = []
        for b in keep:
            if out and out[-1] is not None and b != out[-1] + 1:
                out.append(None)
            out.append(b)
        return out

    def _pending(self, r: RequestInfo) -> tuple[int, int, int] | None:
        """(logical block, slot, token) of the token sampled but not yet in the cache."""
        if r.status != "RUNNING" or len(r.token_ids) <= r.num_computed_tokens:
            return None
        i = r.num_computed_tokens
        return i // self.snapshot.block_size, i % self.snapshot.block_size, r.token_ids[i]

    def _redraw(self) -> None:
        """Draw again now if the figure is on screen; else when it is shown or asked what it draws (a hidden
        figure, under another tab or another lesson's panel, costs nothing a step). While ``held``, at its end."""
        self._stale = True
        if self.isVisible() and not self._holding:
            self._ensure()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The window's step sets the snapshot, the events and the focus one after another: drawn once at the
        end, not after each (three drawings a step were most of the window's time in a lesson). What asks the
        figure what it draws meanwhile still gets it drawn first (``_ensure``)."""
        self._holding += 1
        try:
            yield
        finally:
            self._holding -= 1
            if not self._holding and getattr(self, "_stale", False):
                self._redraw()

    def _ensure(self) -> None:
        if getattr(self, "_stale", True):
            self._stale = False
            self._draw_now()

    def showEvent(self, ev) -> None:  # noqa: N802 - Qt's name
        super().showEvent(ev)
        self._ensure()

    def _draw_now(self) -> None:
        self._m = Metrics.now()
        s = self.snapshot
        self._lesson = None
        if s is None:
            self._message("waiting for the engine")
            return
        self._group_items(s)
        reqs = [r for r in (s.request(rid) for rid in self.request_ids) if r is not None]
        g = self.group
        if s.num_groups > 1 and g >= 0:  # the picked group's tables in place of each request's first
            reqs = [replace(r, block_ids=r.group_block_ids[g]) if g < len(r.group_block_ids) else r for r in reqs]
        blocks = [b for b in self.focus_blocks if 0 <= b < s.num_blocks]
        if not reqs and not blocks:
            self._message(
                "Select a request (or two, with Ctrl+click) to draw it as in the PagedAttention paper:\n"
                "its logical KV blocks, its block table, and where its blocks sit in the physical pool."
            )
            return
        if not presenting():
            self._draw(reqs, blocks, Layout(self._per_line_for_width(s.block_size, len(reqs) == 2)))
            self._fit()
            return
        # Presenting: the text keeps its size; the layout changes until the lesson fits the panel.
        vw, vh = self._viewport_size()
        self._fitted_to = (vw, vh)
        longest = max((len(r.block_ids) for r in reqs), default=0)
        tries = present_layouts(s.block_size, len(reqs) == 2, longest)
        # Start from the layout that fitted last (a lesson grows step by step: its layout rarely changes); a layout
        # before it is tried again only for other requests or another panel size.
        key = (tuple(self.request_ids), s.block_size, vw, vh)
        last = getattr(self, "_last_fit", None)
        first = last[1] if last is not None and last[0] == key else 0
        first = min(first, len(tries) - 1)
        scene, self.scene = self.scene, _Bounds()  # measured, not drawn, until one fits
        try:
            for i in range(first, len(tries)):
                self._draw(reqs, blocks, tries[i])
                rect = self.scene.sceneRect()
                if rect.width() <= vw and rect.height() <= vh:
                    break
        finally:
            self.scene = scene
            self._m = Metrics.now()
        self._last_fit = (key, i)
        self._draw(reqs, blocks, tries[i])
        self._fit()

    def _viewport_size(self) -> tuple[float, float]:
        """The panel's room for the scene (its viewport less a frame's width: no scroll bar when it fits)."""
        vp = self.view.viewport()
        return max(1.0, vp.width() - 2.0), max(1.0, vp.height() - 2.0)

    def _draw(self, reqs: list[RequestInfo], blocks: list[int], lay: Layout) -> None:
        self.scene.clear()
        self._cells = {"requests": {}, "physical": {}, "arrows": []}
        self.layout_used = lay
        self._m = Metrics.now()  # each layout from the same sizes (a compact one's table is its own)
        if lay.compact:  # the table without its "logical" column (each row's label is its logical block, a number
            # under the "logical KV blocks" head), the pool's labels without "ref N" (the table's ref column says it)
            fm = QFontMetricsF(_font(self._m.px))
            self._m = dataclasses.replace(
                self._m,
                table=tuple(c for c in self._m.table if c[0] != "logical"),
                label_w=fm.horizontalAdvance("00") + 12,
                phys_label_w=fm.horizontalAdvance("block 00") + 12,
            )
        s, m = self.snapshot, self._m
        bs = s.block_size
        tokens = BlockTokens(s)
        blk_w, _ = block_size_px(bs, lay, m)
        logical_w = m.label_w + blk_w
        request_w = logical_w + 16 + m.table_w
        phys_w = m.phys_label_w + blk_w
        two = len(reqs) == 2
        side = two and not lay.stacked
        top = 0.0
        if self.why:
            names = " and ".join(r.request_id for r in reqs) if reqs else ""
            what = (f"request{'s' if len(reqs) > 1 else ''} {names}" if reqs else "") + (
                f"{' · ' if reqs else ''}block{'s' if len(blocks) > 1 else ''} {block_ranges(blocks)}" if blocks else ""
            )
            room = self._viewport_size()[0] - 12 if presenting() else 0.0  # one line, never wider than the panel
            self._text(f"showing {what}: {self.why}", 0, 0, DIM, italic=True, elide=room)
            top = m.line + 4
        head_h = self._head_h(lay)
        y_rows = top + head_h + m.line  # the first row (under the column headers)
        # x of each column: [A logical][A table] [physical] ([B table][B logical]); stacked: B under A
        x_phys = (request_w + m.gap) if reqs else 0.0
        self._table_y: dict[str, dict[int, float]] = {}
        notes: list[str] = []
        places = []
        y = y_rows
        for k, r in enumerate(reqs):
            if side and k == 1:
                x_tab = x_phys + phys_w + m.gap
                places.append((x_tab + m.table_w + 16, x_tab, y_rows, True))
            else:
                places.append((0.0, logical_w + 16, y, False))
            bottom = self._request(r, lay, *places[-1], _qc(palette.owner_colour(r.index)), notes)
            y = bottom + m.line + head_h + m.line  # the next request (stacked) starts under this one
        mapped = {b for r in reqs for b in r.block_ids} | set(blocks)
        # the pool's rows: the blocks the drawn rows map (a cut table's hidden rows map none drawn here)
        drawn = {r.block_ids[i] for r in reqs for i in self._table_y[r.request_id]} | set(blocks)
        self._physical(x_phys, y_rows, drawn if lay.max_rows else mapped, tokens, reqs, lay)
        for k, r in enumerate(reqs):
            colour = _qc(palette.owner_colour(r.index))
            for i, ty in self._table_y[r.request_id].items():
                b = r.block_ids[i]
                if b not in self._phys_y:
                    continue
                yb = self._phys_y[b] + m.slot_h / 2
                _x_log, x_tab, _y0, right = places[k]
                if right:
                    self._arrow(QPointF(x_tab - 2, ty + m.slot_h / 2), QPointF(x_phys + phys_w + 10, yb), colour)
                else:
                    self._arrow(QPointF(x_tab + m.table_w + 2, ty + m.slot_h / 2), QPointF(x_phys - 10, yb), colour)
                self._cells["arrows"].append((r.request_id, i, b))
        self._notes(reqs, mapped, notes)
        self._lesson = self.scene.itemsBoundingRect()  # the requests, their tables and the physical blocks
        if lay.legend and any(c["pending"] for c in self._cells["requests"].values()):
            bottom = self.scene.itemsBoundingRect().bottom() + 10
            self._slot(m.label_w, bottom, None, EMPTY, pending=True)
            self._text(
                "dashed: the token just sampled, written into the cache at the next step"
                if presenting()
                else "dashed: the token just sampled; its K and V are written into the cache at the next step",
                m.label_w + m.slot_w + 10,
                bottom + (m.slot_h - m.line) / 2,
                DIM,
            )
        if isinstance(self.scene, _Bounds):  # measuring a layout: nothing to show yet
            self.scene.setSceneRect(self.scene.itemsBoundingRect().adjusted(-6, -6, 6, 6))
            return
        self.caption.setText("<br>".join(f"• {n}" for n in notes))
        self.caption.setVisible(bool(notes) and not presenting())  # presenting: the lesson's note says it
        self.scene.setSceneRect(self.scene.itemsBoundingRect().adjusted(-6, -6, 6, 6))

    def _head_h(self, lay: Layout) -> float:
        """A request's head above its column headers: its title and its prompt line (compact: the title)."""
        return (1 if lay.compact else 2) * self._m.line + 4

    def _notes(self, reqs: list[RequestInfo], mapped: set[int], notes: list[str]) -> None:
        """What to notice, under the figure."""
        s = self.snapshot
        flagged = sorted(b for b in mapped if b in self.flagged)
        if flagged:
            notes.append(
                f"physical block{'s' if len(flagged) > 1 else ''} {', '.join(map(str, flagged))}: flagged by "
                f"the audit (red, as in the grid): the banner above the grid says what is wrong"
            )
        shared = [b for b in mapped if s.ref_cnt[b] > 1 and b not in self.flagged]
        if shared:
            notes.append(
                f"physical block{'s' if len(shared) > 1 else ''} {', '.join(map(str, sorted(shared)))} "
                f"{'are' if len(shared) > 1 else 'is'} shared (ref count > 1): one copy of the KV, "
                f"mapped by several block tables"
            )
        for b in sorted(shared):
            writers = [
                r.request_id
                for r in reqs
                if (p := self._pending(r)) is not None and p[0] < len(r.block_ids) and r.block_ids[p[0]] == b
            ]
            if writers and s.filled[b] < s.block_size:
                notes.append(
                    f"block {b} is shared and has a free slot that {' and '.join(writers)} "
                    f"{'both want' if len(writers) > 1 else 'wants'} to write: the first write copies it "
                    f"(copy-on-write), so the other tables never see the new token"
                )
        for ev in self.events:
            if getattr(ev, "kind", "") == "cow" and ev.request_id in self.request_ids:
                notes.append(
                    f"copy-on-write this step: request {ev.request_id} was about to write into shared "
                    f"block {ev.src_block_id}, so it got a copy, block {ev.dst_block_id} "
                    f"({ev.num_slots} slots copied); block {ev.src_block_id}'s ref count dropped by one"
                )
        if len(reqs) == 2 and not shared and len(mapped) > 1:
            a, b = (set(r.block_ids) for r in reqs)
            if a and b and min(a | b) < max(a | b) and not (max(a) < min(b) or max(b) < min(a)):
                notes.append("the two requests' blocks interleave in one pool: neither needs contiguous memory")
        g = self.group
        if s.num_groups > 1 and 0 <= g < len(s.kv_groups) and s.reserved:
            x = s.kv_groups[g]
            notes.append(
                f"KV cache group {g}, {x.label()}: {x.rules()}"
                + (f" (block {s.reserved[0]}, reserved)" if any(s.reserved[0] in r.block_ids for r in reqs) else "")
            )

    def _message(self, text: str) -> None:
        self.scene.clear()
        self._cells = {"requests": {}, "physical": {}, "arrows": []}
        self._text(text, 10, 10, DIM, size=13)
        self.scene.setSceneRect(self.scene.itemsBoundingRect().adjusted(-10, -10, 10, 10))
        self.caption.setText("")
        self.caption.hide()
        self._fit()

    def _request(
        self,
        r: RequestInfo,
        lay: Layout,
        x_log: float,
        x_tab: float,
        y0: float,
        right: bool,
        colour: QColor,
        notes: list[str],
    ) -> float:
        """Request ``r``'s title, logical blocks and block table, its rows from ``y0``; returns its bottom."""
        s, m, bs = self.snapshot, self._m, self.snapshot.block_size
        prompt = self.decoder.join(r.token_ids[: r.num_prompt_tokens])
        out = self.decoder.join(r.token_ids[r.num_prompt_tokens :])
        x_head = min(x_log, x_tab)  # the right-hand request's head starts over its table: inside the figure
        width = m.label_w + block_size_px(bs, lay, m)[0] + 16 + m.table_w
        y_head = y0 - m.line - self._head_h(lay)
        self._text(f"request {r.request_id} · {status_words(r.status)}", x_head, y_head, colour, size=m.head, bold=True)
        if not lay.compact:  # compact: the logical blocks show the prompt's tokens; no line of it above them
            line = f"prompt {prompt!r}" + (f" → {out!r}" if out else "")
            self._text(line[: int(width) + 2], x_head, y_head + m.line, DIM, size=m.small, elide=width)
        head = "logical KV blocks"  # shortened where it would run into the table's head (narrow blocks, large text)
        if QFontMetricsF(_font(m.px, True)).horizontalAdvance(head) > block_size_px(bs, lay, m)[0] + 10:
            head = "logical"
        x = x_tab
        for name, w in m.table if r.block_ids else ():  # no table: no heads over nothing (the line says why)
            self._text(name, x, y0 - m.line, INK, bold=True, align="centre", width=w)
            x += w
        if r.block_ids:
            self._text(head, x_log + m.label_w, y0 - m.line, INK, bold=True)
        cell = {"logical": [], "table": [], "pending": None}
        self._cells["requests"][r.request_id] = cell
        self._table_y[r.request_id] = {}
        pend = self._pending(r)
        if pend is not None:
            cell["pending"] = (pend[0], pend[1], self.decoder.label(pend[2]))
        if not r.block_ids:
            why = {
                "WAITING": "waiting: no blocks yet (it is admitted when the scheduler has room)",
                "SWAPPED": f"swapped out: its KV sits in CPU blocks {block_ranges(r.cpu_block_ids)}",
                "PREEMPTED": "preempted: its blocks were freed; it will be prefilled again",
            }.get(r.status, "finished: its blocks went back to the pool (cached ones stay reusable)")
            if r.status.startswith("FINISHED") and self.focus_blocks and self.flagged & set(self.focus_blocks):
                why = "ended: no table holds the red blocks now"
            self._text(why, x_log, y0 + 4, DIM, elide=max(width, 2 * m.table_w))
            return y0 + m.slot_h
        y = y0
        light = _qc(palette.text_on((0, 0, 0)))
        blk_h = block_size_px(bs, lay, m)[1]
        for i in self._shown_logical(r, lay):
            if i is None:
                self._text("⋮", x_log + m.label_w + 10, y - 2, DIM)
                y += m.line
                continue
            self._text(f"{i}" if lay.compact else f"block {i}", x_log, y + (m.slot_h - m.line) / 2, DIM)
            toks = request_block_tokens(r, i, bs)
            labels = [self.decoder.label(t) for t in toks]
            fill, border = _soft(colour.getRgb()[:3], 0.45), colour.darker(130)
            if lay.bars:
                here = pend[1] if pend is not None and pend[0] == i else None
                self._bar(x_log + m.label_w, y, toks, bs, fill, QColor(0, 0, 0), border, here)
            else:
                for j in range(bs):
                    dx, dy = slot_offset(j, lay.per_line, m)
                    xs, ys = x_log + m.label_w + dx, y + dy
                    if j < len(labels):
                        self._slot(xs, ys, labels[j], fill, border=border)
                    elif pend is not None and pend[0] == i and pend[1] == j:
                        self._slot(xs, ys, self.decoder.label(pend[2]), EMPTY, pending=True)
                    else:
                        self._slot(xs, ys, None, EMPTY)
            cell["logical"].append((i, labels))
            b = r.block_ids[i]
            filled, ref = request_filled(r, i, bs), int(s.ref_cnt[b])
            cell["table"].append((i, b, filled, ref))
            self._cells.setdefault("state_colours", {})[b] = self._state(b).colour
            self._table_y[r.request_id][i] = y
            x = x_tab
            ref_fill = _qc(self._state(b).colour)  # the block's state colour, as in the grid (shared: orange)
            values = {"logical": (str(i), EMPTY), "physical": (str(b), EMPTY), "# filled": (str(filled), EMPTY)}
            values["ref"] = (str(ref), ref_fill)
            for name, w in m.table:  # a compact layout has no "logical" column: the row's label says it
                v, fill_ = values[name]
                self.scene.addRect(QRectF(x, y, w, m.slot_h), QPen(QColor(90, 96, 110)), QBrush(fill_))
                ink = QColor(*palette.text_on(fill_.getRgb()[:3])) if fill_ is not EMPTY else light
                bold = name == "physical"
                self._text(v, x, y + (m.slot_h - m.line) / 2, ink, align="centre", width=w, bold=bold)
                x += w
            y += blk_h + m.row_gap
        if pend is not None and pend[0] >= len(r.block_ids):
            # The last block is full: the next token needs a new physical block (allocated next step).
            label = f"{pend[0]}" if lay.compact else f"block {pend[0]}"
            self._text(label, x_log, y + (m.slot_h - m.line) / 2, DIM, italic=True)
            self._slot(x_log + m.label_w, y, self.decoder.label(pend[2]), EMPTY, pending=True)
            self._text("new block at the next step", x_tab, y + (m.slot_h - m.line) / 2, DIM, italic=True)
            notes.append(
                f"request {r.request_id}'s last block is full: its next token "
                f"{self.decoder.label(pend[2])!r} needs a new physical block"
            )
            y += m.slot_h + m.row_gap
        return y

    def _physical(
        self, x0: float, y0: float, mapped: set[int], tokens: BlockTokens, reqs: list[RequestInfo], lay: Layout
    ) -> None:
        s, m, bs = self.snapshot, self._m, self.snapshot.block_size
        self._phys_y: dict[int, float] = {}
        blk_w, blk_h = block_size_px(bs, lay, m)
        self._text("physical KV blocks (the pool)", x0 + m.phys_label_w, y0 - m.line, INK, bold=True)
        y = y0
        focus = set(self.focus_blocks)
        for b in self._shown_physical(mapped, lay):
            if b is None:
                self._text("⋮", x0 + m.phys_label_w + 10, y - 2, DIM)
                y += m.line
                continue
            state = self._state(b)
            holders = [k for k, r in enumerate(reqs) if b in r.block_ids]
            ref = int(s.ref_cnt[b])
            mine = bool(holders) or b in focus
            self._text(f"block {b}", x0, y + (m.slot_h - m.line) / 2, INK if mine else DIM, bold=mine)
            if not lay.compact:
                self._text(
                    f"ref {ref}" if ref else "null" if b in s.reserved else state.name,  # vLLM's null block: "null"
                    x0,
                    y + (m.slot_h - m.line) / 2,
                    _qc(state.line_colour) if ref else DIM,
                    size=m.small,
                    align="right",
                    width=m.phys_label_w - 8,
                )
            toks = tokens.of(b)
            labels = [self.decoder.label(t) for t in toks]
            self._cells["physical"][b] = labels
            if b in self.flagged:  # flagged by the audit: red, as in the grid and its legend
                fill, border = _soft(palette.LEAKED, 0.45), _qc(palette.LEAKED)
            elif ref > 1:  # shared: orange, as everywhere
                fill, border = _soft(palette.SHARED, 0.45), _qc(palette.SHARED)
            elif holders:  # this request's block: its colour, as in the paper's figures
                rc = palette.owner_colour(reqs[holders[0]].index)
                fill, border = _soft(rc, 0.45), _qc(rc).darker(130)
            else:  # someone else's, or cached, or free: its state's colour, dimmed
                fill, border = _soft(state.colour, 0.0).darker(170), _qc(state.colour).darker(150)
            ink = QColor(0, 0, 0) if holders or b in self.flagged else INK
            if lay.bars:
                self._bar(x0 + m.phys_label_w, y, toks, bs, fill, ink, border)
            else:
                for j in range(bs):
                    dx, dy = slot_offset(j, lay.per_line, m)
                    xs, ys = x0 + m.phys_label_w + dx, y + dy
                    if j < len(labels):
                        self._slot(xs, ys, labels[j], fill, ink=ink, border=border)
                    else:
                        self._slot(xs, ys, None, EMPTY, border=border.darker(140))
            if b in focus:  # the lesson names it: outlined, as the grid outlines it
                pen = QPen(FOCUS)
                pen.setWidthF(2.5)
                self.scene.addRect(QRectF(x0 + m.phys_label_w - 2, y - 2, blk_w + 4, blk_h + 4), pen)
            # who maps it: a bar in the request's colour, on the side its arrows come from
            for k in holders:
                bx = x0 - 8 if k == 0 or lay.stacked else x0 + m.phys_label_w + blk_w + 3
                self.scene.addRect(
                    QRectF(bx, y, 5, blk_h), QPen(Qt.PenStyle.NoPen), QBrush(_qc(palette.owner_colour(reqs[k].index)))
                )
            self._phys_y[b] = y
            y += blk_h + m.row_gap
        if not mapped:
            self._text("(no blocks mapped)", x0 + m.phys_label_w, y0 + 4, DIM)

    def _per_line_for_width(self, block_size: int, two: bool) -> int:
        """Slots a line: the one whose figure, fitted to the panel's width, draws the largest text."""
        vw = max(1, self.view.viewport().width())
        return max((8, 4), key=lambda n: (min(1.3 * text_scale(), vw / figure_width(block_size, two, n)), n))

    def scale(self) -> float:
        """The figure's zoom: it fills the panel's width (up to 1.3x the text scale), the height scrolls where it
        must, and its smallest text (11 px in the scene) never shows below ``MIN_TEXT_PX`` times the text scale:
        then the figure scrolls sideways too. Presenting: 1, always (the layout fits the panel, the text does not
        shrink)."""
        if presenting():
            return 1.0
        rect = self.scene.sceneRect()
        vw, vh = max(1, self.view.viewport().width()), max(1, self.view.viewport().height())
        top = 1.3 * text_scale()
        fit = min(vw / max(rect.width(), 1), top)
        if rect.height() * fit <= vh:  # it all fits
            fit = min(top, vw / max(rect.width(), 1), vh / max(rect.height(), 1))
        return max(fit, MIN_TEXT_PX * text_scale() / 11)

    def lesson_in_view(self) -> bool:
        """Whether the lesson (every request's head, logical blocks and table rows, and the physical blocks) is
        inside the panel's viewport as it is scrolled now: seen whole, without scrolling."""
        self._ensure()
        lesson = self._lesson
        if lesson is None:
            return False
        shown = self.view.mapFromScene(lesson).boundingRect()
        self.last_lesson = (shown, self.view.viewport().rect())  # what was compared (a failing test says it)
        return self.view.viewport().rect().adjusted(-1, -1, 1, 1).contains(shown)

    def min_text_px(self) -> float:
        """The smallest text drawn, in screen pixels (a test keeps it readable at 1280x720)."""
        self._ensure()
        sizes = [it.font().pixelSize() for it in self.scene.items() if isinstance(it, QGraphicsSimpleTextItem)]
        return min(sizes, default=0) * self.view.transform().m11()

    def _fit(self) -> None:
        s = self.snapshot
        if s is not None and (self.request_ids or self.focus_blocks):
            if presenting():
                vw, vh = self._viewport_size()
                size = (vw, vh)
                if size != getattr(self, "_fitted_to", None):  # the panel changed: lay the lesson out again
                    self._fitted_to = size
                    self._redraw()
                    return
                rect = self.scene.sceneRect()
                if (rect.width() > vw or rect.height() > vh) and getattr(self, "_rechosen_for", None) != size:
                    self._rechosen_for = size  # what fitted does not now: choose again from the first, once a size
                    self._last_fit = None
                    self._redraw()
                    return
            else:
                want = self._per_line_for_width(s.block_size, len(self.request_ids) == 2)
                if want != self.per_line:  # the panel's width changed enough to draw the blocks another way
                    self._redraw()
                    return
        sc = self.scale()
        self.view.resetTransform()
        self.view.scale(sc, sc)
