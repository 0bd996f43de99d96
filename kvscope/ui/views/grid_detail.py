"""What the grid's detail view paints over its image for the visible cells: borders, labels, slots as text."""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import QColor, QFont, QFontMetrics, QPen

from engine.inspect.snapshot import BlockState
from kvscope.ui import palette
from kvscope.ui.palette import BACKGROUND, text_on
from kvscope.ui.style import min_text_px, text_scale
from kvscope.ui.views.grid_cells import DetailLevel, slot_layout

_ELIDE = Qt.TextElideMode.ElideRight  # enum lookups are slow in PySide: look them up once


def _mix(c: tuple[int, int, int], other: tuple[int, int, int], t: float) -> QColor:
    return QColor(*(int(a + (b - a) * t) for a, b in zip(c, other)))


class _DetailLayer(pg.GraphicsObject):
    """Borders, labels and slots of the visible cells, painted in device pixels in one item."""

    def __init__(self, view) -> None:  # the BlockGridView it paints for (not imported: it imports this)
        super().__init__()
        self.view = view
        self.painted_cells = 0  # cells that got text in the last paint (tests and the benchmark)
        self.texts: dict[int, list[str]] = {}  # block -> the text painted in it, last paint (bounded)
        self.bars: dict[int, int] = {}  # block -> filled slots drawn as its fill bar, last paint
        self.min_px = 0  # the smallest text painted, in pixels, last paint (0: none; a test reads it)

    def boundingRect(self) -> QRectF:  # noqa: N802 - Qt's name
        g = self.view.grid
        return QRectF(0, 0, 1, 1) if g is None else QRectF(0, 0, g.shape[1], g.shape[0])

    def paint(self, p, *args) -> None:
        v = self.view
        level = v.detail_level
        self.painted_cells = 0
        self.texts, self.bars = {}, {}
        self.min_px = 0
        self._style = None
        if v.grid is None or v.snapshot is None or level == DetailLevel.CELLS:
            return
        r0, r1, c0, c1 = v.visible_cells()
        if r1 <= r0 or c1 <= c0:
            return
        tr = p.transform()
        p.save()
        p.resetTransform()
        p.setRenderHint(p.RenderHint.Antialiasing, False)
        o = tr.map(QPointF(c0, r0))
        e = tr.map(QPointF(c0 + 1, r0 + 1))
        dx, dy = e.x() - o.x(), e.y() - o.y()  # one cell in device pixels (dy < 0 if y is up)
        px = abs(dx)
        border = QColor(*BACKGROUND)
        pen = QPen(border)
        pen.setWidthF(max(1.0, min(4.0, px * 0.06)))
        p.setPen(pen)
        for c in range(c0, c1 + 1):
            x = o.x() + (c - c0) * dx
            p.drawLine(QPointF(x, o.y()), QPointF(x, o.y() + (r1 - r0) * dy))
        for r in range(r0, r1 + 1):
            y = o.y() + (r - r0) * dy
            p.drawLine(QPointF(o.x(), y), QPointF(o.x() + (c1 - c0) * dx, y))
        if level >= DetailLevel.LABELS:  # _on_range keeps the visible cells under MAX_TEXT_CELLS here
            cols = v.grid.shape[1]
            n = v.num_cells()
            for r in range(r0, r1):
                for c in range(c0, c1):
                    b = r * cols + c
                    if b >= n:
                        break
                    x, y = o.x() + (c - c0) * dx, o.y() + (r - r0) * dy
                    rect = QRectF(QPointF(x, y), QPointF(x + dx, y + dy)).normalized()
                    inset = pen.widthF()
                    rect = rect.adjusted(inset, inset, -inset / 2, -inset / 2)
                    if level == DetailLevel.SLOTS and not v.cpu:
                        self._paint_slots(p, rect, b)
                    else:
                        if self._style is None:
                            self._label_style(p, rect)
                        self._paint_label(p, rect, b)
                    if b in v.logical_index:
                        self._paint_selected(p, rect, b)
                    self.painted_cells += 1
        p.restore()

    def _cell_colour(self, b: int) -> tuple[int, int, int]:
        v = self.view
        return tuple(int(x) for x in v.lut[int(v.codes[b])])

    def _paint_selected(self, p, rect: QRectF, b: int) -> None:
        """The selected request's block: a white outline and its logical index as a badge."""
        pen = QPen(QColor(255, 255, 255))
        pen.setWidthF(max(2.0, rect.width() * 0.04))
        p.save()
        p.setPen(pen)
        p.setBrush(Qt.BrushStyle.NoBrush)
        p.drawRect(rect)
        badge = f"L{self.view.logical_index[b]}"
        font = QFont()
        font.setPixelSize(int(max(8, min(12 * text_scale(), rect.height() * 0.15))))
        font.setBold(True)
        if not self._readable(font.pixelSize()):  # presenting, and too small to read: the outline says it
            p.restore()
            return
        p.setFont(font)
        fm = QFontMetrics(font)
        w, h = fm.horizontalAdvance(badge) + 6, fm.height()
        # top right: the block's id is top left, and the notes name blocks by their ids
        box = QRectF(rect.right() - w - 1, rect.top() + 1, w, h)
        p.fillRect(box, QColor(255, 255, 255))
        p.setPen(QColor(0, 0, 0))
        p.drawText(box, Qt.AlignmentFlag.AlignCenter, badge)
        p.restore()
        self.texts.setdefault(b, []).append(badge)

    def _readable(self, px: int) -> bool:
        """Whether text of ``px`` pixels is drawn: not below presentation's floor (a back row cannot read it; the
        cell's colour still says its state), nor below 8 px times the text scale (the user asked for larger text:
        a label that cannot grow with it waits for the next zoom)."""
        floor = max(min_text_px() or 0.0, 8 * text_scale() if text_scale() > 1 else 0.0)
        if px < floor:
            return False
        self.min_px = min(self.min_px, px) if self.min_px else px
        return True

    def _label_style(self, p, rect: QRectF) -> None:
        """Font, metrics and per-colour pens for this paint (every cell has the same size): made once."""
        font = QFont()
        font.setPixelSize(int(max(8, min(14 * text_scale(), rect.height() * 0.22))))  # the cell's room
        p.setFont(font)
        fm = QFontMetrics(font)
        pad = max(2.0, rect.width() * 0.06)
        v = self.view
        cpu_owner = {c: r.request_id for r in v.snapshot.requests for c in r.cpu_block_ids} if v.cpu else {}
        colours = {}
        for code, c in enumerate(v.lut):
            c = tuple(int(x) for x in c)
            colours[code] = (
                QColor(*c),
                QColor(*text_on(c)),
                _mix(c, (255, 255, 255), 0.35),
                _mix(c, (0, 0, 0), 0.55),
                _mix(c, (255, 255, 255), 0.6),
            )
        width = rect.width() - 2 * pad
        readable = self._readable(font.pixelSize())
        self._style = {
            "fm": fm,
            "pad": pad,
            "text": readable,
            "long_ref": width > fm.horizontalAdvance("ref 00"),
            "fill_text": width > fm.horizontalAdvance("00/00") * 1.6,
            "cpu_owner": cpu_owner,
            "colours": colours,
            "ids_fit": fm.horizontalAdvance(f"#{max(v.num_cells() - 1, 0)}") <= width,
            "ascent": fm.ascent(),
            "line": fm.height(),
            "descent": fm.descent(),
        }

    def _paint_label(self, p, rect: QRectF, b: int) -> None:
        v, s, st = self.view, self.view.snapshot, self._style
        fm, pad = st["fm"], st["pad"]
        fill, ink, dim, bar_bg, bar_fg = st["colours"][int(v.codes[b])]
        p.fillRect(rect, fill)
        text_rect = rect.adjusted(pad, pad, -pad, -pad)
        width = int(text_rect.width())
        x, y = text_rect.left(), text_rect.top() + st["ascent"]

        def line(i: int, t: str) -> None:
            if not st["text"]:
                return
            if (i and (len(t) > 6 or not st["long_ref"])) or (not i and not st["ids_fit"]):
                t = fm.elidedText(t, _ELIDE, width)
            p.drawText(QPointF(x, y + i * st["line"]), t)

        if v.cpu:
            owner = st["cpu_owner"].get(b)
            lines = [f"#{b}", f"req {owner}" if owner is not None else "free"]
        elif s.state[b] == BlockState.FREE and b not in v.leaked_set:  # empty: just its id, quietly
            p.setPen(dim)
            line(0, f"#{b}")
            if st["text"]:
                self.texts[b] = [f"#{b}"]
            return
        else:
            ref = int(s.ref_cnt[b])
            lines = [f"#{b}", f"ref {ref}" if st["long_ref"] else str(ref)]
            if b in v.leaked_set:
                lines[1] += " !"
        p.setPen(ink)
        for i, t in enumerate(lines):
            line(i, t)
        if st["text"]:
            self.texts[b] = lines
        if not v.cpu:  # the fill bar: filled slots / block size
            filled = int(s.filled[b])
            self.bars[b] = filled
            h = max(3.0, rect.height() * 0.12)
            bar = QRectF(text_rect.left(), text_rect.bottom() - h, text_rect.width(), h)
            p.fillRect(bar, bar_bg)
            if filled:
                p.fillRect(QRectF(bar.left(), bar.top(), bar.width() * filled / s.block_size, bar.height()), bar_fg)
            if st["fill_text"] and st["text"]:
                t = f"{filled}/{s.block_size}"
                p.drawText(QPointF(text_rect.right() - fm.horizontalAdvance(t), bar.top() - st["descent"] - 1), t)

    def _paint_slots(self, p, rect: QRectF, b: int) -> None:
        v, s = self.view, self.view.snapshot
        colour = self._cell_colour(b)
        p.fillRect(rect, QColor(*colour))
        rows, cols = slot_layout(s.block_size)
        row_h = rect.height() / (rows + 1)
        if self._style is None:  # once per paint: every cell has this size
            font = QFont()
            font.setPixelSize(int(max(8, min(15 * text_scale(), row_h * 0.62))))
            p.setFont(font)
            self._style = QFontMetrics(font) if self._readable(font.pixelSize()) else False
        fm = self._style
        if fm is False:  # presenting, and too small to read: the colours alone
            return
        p.setPen(QColor(*text_on(colour)))
        ref = int(s.ref_cnt[b])
        if v.leaked_set and b in v.leaked_set:
            right = v.flagged_as(b)  # the audit's word for it: a shared write is not a leak
        else:
            right = f"ref {ref}" if ref else palette.STATES[BlockState(int(s.state[b]))].name
        header = QRectF(rect.left() + 3, rect.top(), rect.width() - 6, row_h)
        p.drawText(header, Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter, right)
        p.drawText(
            header.adjusted(0, 0, -fm.horizontalAdvance(right) - 4, 0),
            Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter,
            fm.elidedText(f"#{b}", Qt.TextElideMode.ElideRight, int(header.width() - fm.horizontalAdvance(right) - 4)),
        )
        toks = v.block_tokens().of(b)
        labels = [v.decoder.label(t) for t in toks]
        self.texts[b] = [f"#{b}", right] + labels
        slot_w = (rect.width() - 4) / cols
        empty, full = _mix(colour, (0, 0, 0), 0.55), _mix(colour, (255, 255, 255), 0.72)
        for i in range(s.block_size):
            rr, cc = i % rows, i // rows
            sr = QRectF(rect.left() + 2 + cc * slot_w, rect.top() + row_h * (rr + 1), slot_w, row_h).adjusted(
                1, 1, -1, -1
            )
            p.fillRect(sr, full if i < len(toks) else empty)
            if i < len(toks):
                p.setPen(QColor(0, 0, 0))
                p.drawText(
                    sr.adjusted(3, 0, -2, 0),
                    Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter,
                    fm.elidedText(labels[i], Qt.TextElideMode.ElideRight, int(sr.width() - 5)),
                )
