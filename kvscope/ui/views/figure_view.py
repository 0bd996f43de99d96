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

import math
from dataclasses import replace

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
from kvscope.ui.style import min_text_px, text_scale
from kvscope.ui.views.token_text import BlockTokens, TokenDecoder, request_block_tokens, request_filled

MAX_FIGURE_BLOCKS = 24  # logical blocks drawn per request (the first 2 and the last ones)
MAX_PHYSICAL_SPAN = 20  # show every block between the lowest and highest mapped one up to this span
MIN_PHYSICAL_ROWS = 8  # and at least this many, so the pool looks like a pool
SLOT_W, SLOT_H = 72.0, 26.0
# Presentation (a projector at 1280x720): narrower slots and larger text in the scene, so the whole figure of two
# requests fits the window's width with every text at least the presentation's floor (12 px).
PRESENT_SLOT_W = 48.0
PRESENT_TABLE_COLS = (("logical", 58.0), ("physical", 66.0), ("# filled", 62.0), ("ref", 36.0))  # 13 px headers
PRESENT_GAP = 36.0
PRESENT_PHYS_LABEL_W = 104.0  # "block 12" and "ref 2" side by side at 13 px
PRESENT_SCENE_TEXT = 13  # no text in the scene smaller than this while presenting
SLOTS_PER_LINE = 8  # a block of 16 is drawn as two lines of 8 slots (or four of 4 where the panel is narrow)
MIN_TEXT_PX = 10.0  # the smallest text on screen: the figure scrolls rather than shrink below it
LABEL_W = 56.0
TABLE_COLS = (("logical", 48.0), ("physical", 60.0), ("# filled", 58.0), ("ref", 34.0))
GAP = 46.0  # between columns (room for the arrows)
HEAD_H = 62.0
PHYS_LABEL_W = 90.0
ROW_GAP = 8.0
INK = QColor(216, 222, 233)
DIM = QColor(138, 147, 165)
EMPTY = QColor(34, 38, 45)
PAPER = QColor(30, 33, 39)


def _qc(rgb, alpha: int = 255) -> QColor:
    c = QColor(*rgb)
    c.setAlpha(alpha)
    return c


def slot_w() -> float:
    """A token slot's width in the scene: narrower while presenting."""
    return PRESENT_SLOT_W if min_text_px() is not None else SLOT_W


def table_cols() -> tuple[tuple[str, float], ...]:
    return PRESENT_TABLE_COLS if min_text_px() is not None else TABLE_COLS


def gap() -> float:
    return PRESENT_GAP if min_text_px() is not None else GAP


def phys_label_w() -> float:
    return PRESENT_PHYS_LABEL_W if min_text_px() is not None else PHYS_LABEL_W


def slot_offset(j: int, per_line: int = SLOTS_PER_LINE) -> tuple[float, float]:
    """(dx, dy) of slot ``j`` inside a block drawn as lines of ``per_line`` slots."""
    return (j % per_line) * slot_w(), (j // per_line) * SLOT_H


def block_size_px(block_size: int, per_line: int = SLOTS_PER_LINE) -> tuple[float, float]:
    """(width, height) of a block's slots."""
    return min(block_size, per_line) * slot_w(), math.ceil(block_size / per_line) * SLOT_H


def figure_width(block_size: int, two: bool, per_line: int) -> float:
    """The scene's width: [A logical][A table] [physical] ([B table][B logical])."""
    blk = block_size_px(block_size, per_line)[0]
    one = LABEL_W + blk + 16 + sum(w for _, w in table_cols()) + gap() + phys_label_w() + blk
    return one + (gap() + sum(w for _, w in table_cols()) + 16 + LABEL_W + blk if two else 0.0)


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
        self.flagged: set[int] = set()
        self.per_line = SLOTS_PER_LINE  # slots a line of a block, chosen for the panel's width (``_layout``)
        self.decoder = TokenDecoder()
        self.events: list = []
        self._cells: dict = {"requests": {}, "physical": {}, "arrows": []}
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
    def set_snapshot(self, snap: KVSnapshot | None, flagged=None) -> None:
        """``flagged``: blocks the audit found wrong (drawn red, as in the grid)."""
        self.snapshot = snap
        self.flagged = set(int(b) for b in flagged) if flagged is not None else set()
        self._redraw()

    def _state(self, b: int):
        """Block ``b``'s colour class: its state's, or the audit's where the audit flagged it (one colour
        language with the grid: ``palette.STATES``)."""
        return palette.block_state(self.snapshot, b, self.flagged)

    def set_requests(self, request_ids: list[str]) -> None:
        """Draw these requests (the first two: a third would not fit the paper's layout)."""
        self.request_ids = [r for r in request_ids if r][:2]
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
        return self._cells

    # -- drawing --------------------------------------------------------------------------
    def _text(
        self,
        s: str,
        x: float,
        y: float,
        colour: QColor = INK,
        size: int = 12,
        bold: bool = False,
        italic: bool = False,
        align: str = "left",
        width: float = 0.0,
    ) -> QGraphicsSimpleTextItem:
        it = QGraphicsSimpleTextItem(s)
        f = QFont()
        if min_text_px() is not None:
            size = max(size, PRESENT_SCENE_TEXT)
        f.setPixelSize(size)
        f.setBold(bold)
        f.setItalic(italic)
        it.setFont(f)
        it.setBrush(QBrush(colour))
        w = it.boundingRect().width()
        if align == "centre":
            x += (width - w) / 2
        elif align == "right":
            x += width - w
        it.setPos(x, y)
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
        ink = ink or QColor(0, 0, 0)
        pen = QPen(border or QColor(90, 96, 110))
        pen.setWidthF(1.2)
        if pending:
            pen = QPen(INK)
            pen.setStyle(Qt.PenStyle.DashLine)
        w = slot_w()
        self.scene.addRect(QRectF(x, y, w, SLOT_H), pen, QBrush(fill))
        if label:
            it = self._text(label, x + 4, y + 5, DIM if pending else ink, italic=pending)
            if it.boundingRect().width() > w - 8:  # elide long tokens
                s = label
                while s and it.boundingRect().width() > w - 8:
                    s = s[:-1]
                    it.setText(s + "…")

    def _arrow(self, a: QPointF, b: QPointF, colour: QColor) -> None:
        path = QPainterPath(a)
        mid = (a.x() + b.x()) / 2
        path.cubicTo(QPointF(mid, a.y()), QPointF(mid, b.y()), b)
        pen = QPen(colour)
        pen.setWidthF(1.8)
        self.scene.addPath(path, pen)
        ang = math.atan2(0.0, b.x() - mid)  # the curve arrives horizontally
        size = 8.0
        head = QPolygonF(
            [
                b,
                QPointF(b.x() - size * math.cos(ang - 0.45), b.y() - size * math.sin(ang - 0.45)),
                QPointF(b.x() - size * math.cos(ang + 0.45), b.y() - size * math.sin(ang + 0.45)),
            ]
        )
        self.scene.addPolygon(head, QPen(colour), QBrush(colour))

    def _shown_logical(self, r: RequestInfo) -> list[int | None]:
        """Logical block indices drawn (None: a gap row)."""
        n = len(r.block_ids)
        if n <= MAX_FIGURE_BLOCKS:
            return list(range(n))
        return [0, 1, None] + list(range(n - (MAX_FIGURE_BLOCKS - 3), n))

    def _shown_physical(self, mapped: set[int]) -> list[int | None]:
        n = self.snapshot.num_blocks
        if not mapped:
            return []
        lo, hi = max(0, min(mapped) - 1), min(n - 1, max(mapped) + 1)
        least = MIN_PHYSICAL_ROWS if min_text_px() is None else 0  # presenting: the height is the lesson's
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
        self.scene.clear()
        self._cells = {"requests": {}, "physical": {}, "arrows": []}
        s = self.snapshot
        if s is None:
            self._message("waiting for the engine")
            return
        self._group_items(s)
        reqs = [s.request(rid) for rid in self.request_ids]
        reqs = [r for r in reqs if r is not None]
        g = self.group
        if s.num_groups > 1 and g >= 0:  # the picked group's tables in place of each request's first
            reqs = [replace(r, block_ids=r.group_block_ids[g]) if g < len(r.group_block_ids) else r for r in reqs]
        if not reqs:
            self._message(
                "Select a request (or two, with Ctrl+click) to draw it as in the PagedAttention paper:\n"
                "its logical KV blocks, its block table, and where its blocks sit in the physical pool."
            )
            self.caption.setText("")
            return
        bs = s.block_size
        self.per_line = self._layout(bs, len(reqs) == 2)
        tokens = BlockTokens(s)
        table_w = sum(w for _, w in table_cols())
        blk_w = block_size_px(bs, self.per_line)[0]
        logical_w = LABEL_W + blk_w
        phys_w = phys_label_w() + blk_w
        two = len(reqs) == 2
        # x of each column: [A logical][A table] [physical] ([B table][B logical])
        xa_log = 0.0
        xa_tab = xa_log + logical_w + 16
        x_phys = xa_tab + table_w + gap()
        xb_tab = x_phys + phys_w + gap()
        xb_log = xb_tab + table_w + 16
        mapped = {b for r in reqs for b in r.block_ids}
        notes: list[str] = []
        self._table_y: dict[str, dict[int, float]] = {}
        y_top = HEAD_H
        for k, r in enumerate(reqs):
            colour = _qc(palette.owner_colour(r.index))
            x_log, x_tab = (xa_log, xa_tab) if k == 0 else (xb_log, xb_tab)
            self._request(r, k, x_log, x_tab, y_top, colour, notes)
        self._physical(x_phys, y_top, mapped, tokens, reqs)
        # arrows: table row (physical cell) -> physical block
        rows_y = self._phys_y
        for k, r in enumerate(reqs):
            colour = _qc(palette.owner_colour(r.index))
            for i, y in self._table_y[r.request_id].items():
                b = r.block_ids[i]
                if b not in rows_y:
                    continue
                yb = rows_y[b] + SLOT_H / 2
                if k == 0:
                    a = QPointF(xa_tab + table_w + 2, y + SLOT_H / 2)
                    self._arrow(a, QPointF(x_phys - 10, yb), colour)
                else:
                    a = QPointF(xb_tab - 2, y + SLOT_H / 2)
                    self._arrow(a, QPointF(x_phys + phys_w + 10, yb), colour)
                self._cells["arrows"].append((r.request_id, i, b))
        # what to notice
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
        if two and not shared and len(mapped) > 1:
            own = {r.request_id: set(r.block_ids) for r in reqs}
            a, b = (own[r.request_id] for r in reqs)
            if a and b and min(a | b) < max(a | b) and not (max(a) < min(b) or max(b) < min(a)):
                notes.append("the two requests' blocks interleave in one pool: neither needs contiguous memory")
        self._lesson = self.scene.itemsBoundingRect()  # the requests, their tables and the physical blocks
        if any(c["pending"] for c in self._cells["requests"].values()):
            bottom = self.scene.itemsBoundingRect().bottom() + 10
            self._slot(xa_log + LABEL_W, bottom, "token", EMPTY, pending=True)
            self._text(
                "dashed: the token just sampled; its K and V are written into the cache at the next step",
                xa_log + LABEL_W + slot_w() + 10,
                bottom + 5,
                DIM,
            )
        if s.num_groups > 1 and 0 <= g < len(s.kv_groups) and s.reserved:
            x = s.kv_groups[g]
            notes.append(
                f"KV cache group {g}, {x.label()}: {x.rules()}"
                + (f" (block {s.reserved[0]}, reserved)" if any(s.reserved[0] in r.block_ids for r in reqs) else "")
            )
        self.caption.setText("<br>".join(f"• {n}" for n in notes))
        self.scene.setSceneRect(self.scene.itemsBoundingRect().adjusted(-10, -10, 10, 10))
        self._fit()

    def _message(self, text: str) -> None:
        self._text(text, 10, 10, DIM, size=13)
        self.scene.setSceneRect(self.scene.itemsBoundingRect().adjusted(-10, -10, 10, 10))
        self.caption.setText("")
        self._fit()

    def _request(
        self, r: RequestInfo, k: int, x_log: float, x_tab: float, y0: float, colour: QColor, notes: list[str]
    ) -> None:
        s, bs = self.snapshot, self.snapshot.block_size
        prompt = self.decoder.join(r.token_ids[: r.num_prompt_tokens])
        out = self.decoder.join(r.token_ids[r.num_prompt_tokens :])
        status = r.status.lower().replace("_", " ")
        x_head = min(x_log, x_tab)  # the right-hand request's head starts over its table: inside the figure
        self._text(f"request {r.request_id} · {status}", x_head, 0, colour, size=14, bold=True)
        line = f"prompt {prompt!r}" + (f" → {out!r}" if out else "")
        max_w = LABEL_W + block_size_px(bs, self.per_line)[0] + 16 + sum(w for _, w in table_cols())
        # elided by the font's metrics in one pass (a workload's prompt is 100k tokens: trimming a character
        # at a time and measuring each try took minutes); no line wider than max_w holds more than max_w chars
        it = self._text(line[: int(max_w) + 2], x_head, 18, DIM, size=11)
        if it.boundingRect().width() > max_w or len(line) > max_w + 2:
            it.setText(QFontMetricsF(it.font()).elidedText(line[: int(max_w) + 2], Qt.TextElideMode.ElideRight, max_w))
        self._text("logical KV blocks", x_log + LABEL_W, y0 - 18, INK, bold=True)
        x = x_tab
        for name, w in table_cols():
            self._text(name, x, y0 - 18, INK, bold=True, align="centre", width=w)
            x += w
        cell = {"logical": [], "table": [], "pending": None}
        self._cells["requests"][r.request_id] = cell
        self._table_y[r.request_id] = {}
        pend = self._pending(r)
        if pend is not None:
            cell["pending"] = (pend[0], pend[1], self.decoder.label(pend[2]))
        if not r.block_ids:
            why = {
                "WAITING": "waiting: no blocks yet (it is admitted when the scheduler has room)",
                "SWAPPED": f"swapped out: its KV sits in CPU blocks {list(r.cpu_block_ids)}",
                "PREEMPTED": "preempted: its blocks were freed; it will be prefilled again",
            }.get(r.status, "finished: its blocks went back to the pool (cached ones stay reusable)")
            self._text(why, x_log, y0 + 4, DIM)
            return
        y = y0
        light = _qc(palette.text_on((0, 0, 0)))
        for i in self._shown_logical(r):
            if i is None:
                self._text("⋮", x_log + LABEL_W + 10, y, DIM, size=14)
                y += SLOT_H * 0.8
                continue
            self._text(f"block {i}", x_log, y + 5, DIM)
            toks = request_block_tokens(r, i, bs)
            labels = [self.decoder.label(t) for t in toks]
            for j in range(bs):
                dx, dy = slot_offset(j, self.per_line)
                xs, ys = x_log + LABEL_W + dx, y + dy
                if j < len(labels):
                    self._slot(xs, ys, labels[j], _soft(colour.getRgb()[:3], 0.45), border=colour.darker(130))
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
            cols = table_cols()
            ref_fill = _qc(self._state(b).colour)  # the block's state colour, as in the grid (shared: orange)
            for (_, w), (v, fill) in zip(
                cols, ((str(i), EMPTY), (str(b), EMPTY), (str(filled), EMPTY), (str(ref), ref_fill))
            ):
                self.scene.addRect(QRectF(x, y, w, SLOT_H), QPen(QColor(90, 96, 110)), QBrush(fill))
                ink = QColor(*palette.text_on(fill.getRgb()[:3])) if fill is not EMPTY else light
                self._text(v, x, y + 5, ink, align="centre", width=w, bold=(w == cols[1][1]))
                x += w
            y += block_size_px(bs, self.per_line)[1] + ROW_GAP
        if pend is not None and pend[0] >= len(r.block_ids):
            # The last block is full: the next token needs a new physical block (allocated next step).
            self._text(f"block {pend[0]}", x_log, y + 5, DIM, italic=True)
            self._slot(x_log + LABEL_W, y, self.decoder.label(pend[2]), EMPTY, pending=True)
            self._text("new block at the next step", x_tab, y + 5, DIM, italic=True, size=11)
            notes.append(
                f"request {r.request_id}'s last block is full: its next token "
                f"{self.decoder.label(pend[2])!r} needs a new physical block"
            )

    def _physical(self, x0: float, y0: float, mapped: set[int], tokens: BlockTokens, reqs: list[RequestInfo]) -> None:
        s, bs = self.snapshot, self.snapshot.block_size
        self._phys_y: dict[int, float] = {}
        self._text("physical KV blocks (the pool)", x0 + phys_label_w(), y0 - 18, INK, bold=True)
        y = y0
        for b in self._shown_physical(mapped):
            if b is None:
                self._text("⋮", x0 + phys_label_w() + 10, y, DIM, size=14)
                y += SLOT_H * 0.8
                continue
            state = self._state(b)
            holders = [k for k, r in enumerate(reqs) if b in r.block_ids]
            ref = int(s.ref_cnt[b])
            self._text(f"block {b}", x0, y + 5, INK if holders else DIM, bold=bool(holders))
            self._text(
                f"ref {ref}" if ref else "null" if b in s.reserved else state.name,  # vLLM's null block: "null"
                x0,
                y + 6,
                _qc(state.line_colour) if ref else DIM,
                size=11,
                align="right",
                width=phys_label_w() - 8,
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
            for j in range(bs):
                dx, dy = slot_offset(j, self.per_line)
                xs, ys = x0 + phys_label_w() + dx, y + dy
                if j < len(labels):
                    self._slot(xs, ys, labels[j], fill, ink=QColor(0, 0, 0) if holders else INK, border=border)
                else:
                    self._slot(xs, ys, None, EMPTY, border=border.darker(140))
            # who maps it: a bar in the request's colour, on the side its arrows come from
            for k in holders:
                bx = x0 - 8 if k == 0 else x0 + phys_label_w() + block_size_px(bs, self.per_line)[0] + 3
                self.scene.addRect(
                    QRectF(bx, y, 5, block_size_px(bs, self.per_line)[1]),
                    QPen(Qt.PenStyle.NoPen),
                    QBrush(_qc(palette.owner_colour(reqs[k].index))),
                )
            self._phys_y[b] = y
            y += block_size_px(bs, self.per_line)[1] + ROW_GAP
        if not mapped:
            self._text("(no blocks mapped)", x0 + phys_label_w(), y0 + 4, DIM)

    def _layout(self, block_size: int, two: bool) -> int:
        """Slots a line: the one whose figure, fitted to the panel's width, draws the largest text."""
        vw = max(1, self.view.viewport().width())
        return max((8, 4), key=lambda n: (min(1.3 * text_scale(), vw / figure_width(block_size, two, n)), n))

    def scale(self) -> float:
        """The figure's zoom: it fills the panel's width (up to 1.3x the presentation scale), the height scrolls
        where it must, and its smallest text (11 px in the scene) never shows below ``MIN_TEXT_PX`` times the
        presentation scale: then the figure scrolls sideways too."""
        rect = self.scene.sceneRect()
        vw, vh = max(1, self.view.viewport().width()), max(1, self.view.viewport().height())
        top = 1.3 * text_scale()
        fit = min(vw / max(rect.width(), 1), top)
        if rect.height() * fit <= vh or min_text_px() is not None:  # it all fits (presenting: it must)
            fit = min(top, vw / max(rect.width(), 1), vh / max(rect.height(), 1))
        floor = min_text_px()
        if floor is not None:  # presenting: as large as fits, never below the floor (the scene's least text is 13)
            return max(fit, floor / PRESENT_SCENE_TEXT)
        return max(fit, MIN_TEXT_PX * text_scale() / 11)

    def lesson_in_view(self) -> bool:
        """Whether the lesson (every request's head, logical blocks and table rows, and the physical blocks) is
        inside the panel's viewport as it is scrolled now: seen whole, without scrolling."""
        lesson = getattr(self, "_lesson", None)
        if lesson is None or not self.request_ids:
            return False
        shown = self.view.mapFromScene(lesson).boundingRect()
        self.last_lesson = (shown, self.view.viewport().rect())  # what was compared (a failing test says it)
        return self.view.viewport().rect().adjusted(-1, -1, 1, 1).contains(shown)

    def min_text_px(self) -> float:
        """The smallest text drawn, in screen pixels (a test keeps it readable at 1280x720)."""
        sizes = [it.font().pixelSize() for it in self.scene.items() if isinstance(it, QGraphicsSimpleTextItem)]
        return min(sizes, default=0) * self.view.transform().m11()

    def _fit(self) -> None:
        if self.snapshot is not None and self.request_ids:
            want = self._layout(self.snapshot.block_size, len(self.request_ids) == 2)
            if want != self.per_line:  # the panel's width changed enough to draw the blocks another way
                self._redraw()
                return
        s = self.scale()
        self.view.resetTransform()
        self.view.scale(s, s)
