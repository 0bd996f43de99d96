"""The physical block grid, with level of detail: an overview of the whole pool and a zoomable detail view.

Both views draw an ``ImageItem`` over a uint8 code array and a LUT (a million blocks redraw in
milliseconds; 100 k QGraphicsRectItems take over 100 ms). On top of the detail image one item
paints, for the visible cells only, more as blocks grow on screen (pixels per cell, measured from
the view's range):

- ``DetailLevel.CELLS``   below ``BORDER_PX``: one colour per block;
- ``DetailLevel.BORDERS`` from ``BORDER_PX``: cell borders, so neighbouring blocks of one state stay apart;
- ``DetailLevel.LABELS``  from ``LABEL_PX``: each block's id, ref count and a fill bar (filled / block size);
- ``DetailLevel.SLOTS``   from ``slots_px(block_size)``: each block as its slots with their tokens as text.

Zoom and pan: mouse wheel, drag, ``+``/``-``, arrow keys; ``F`` or ``Home`` fits the blocks in use,
``A`` shows the whole pool. The detail view opens framed on the blocks in use and follows them
until the user zooms or pans. Colour modes: state, owning request, ref count, age (``kvscope.ui.palette``).
"""
from __future__ import annotations

import enum
import math

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QEvent, QObject, QPointF, QRectF, QSize, Qt, QTimer, Signal
from PySide6.QtGui import QBrush, QColor, QFont, QFontMetrics, QPen
from PySide6.QtWidgets import (
    QApplication,
    QComboBox,
    QGraphicsRectItem,
    QHBoxLayout,
    QLabel,
    QScrollArea,
    QSizePolicy,
    QToolButton,
    QToolTip,
    QVBoxLayout,
    QWidget,
)

from engine.inspect.snapshot import BlockState, KVSnapshot
from kvscope.ui import palette
from kvscope.ui.palette import (
    AGE_COLOURS,
    BACKGROUND,
    MODES,
    OWNER_PALETTE,
    REF_COLOURS,
    STATE_COLOURS,
    age_codes,
    state_codes,
    text_on,
)
from kvscope.ui.views.legend import LegendView
from kvscope.ui.views.token_text import BlockTokens, TokenDecoder

__all__ = ["BlockGridView", "DetailLevel", "BORDER_PX", "LABEL_PX", "slots_px", "grid_shape", "codes_for",
           "cpu_codes_for", "to_grid", "downsample", "STATE_COLOURS", "MODES"]


class DetailLevel(enum.IntEnum):
    CELLS = 0
    BORDERS = 1
    LABELS = 2
    SLOTS = 3


BORDER_PX = 6.0  # cell borders from this many pixels per cell
LABEL_PX = 40.0  # block id, ref count and fill bar
SLOT_ROW_PX = 15.0  # one slot row (a token of text) needs this height ...
SLOT_MIN_WIDTH_PX = 60.0  # ... and this width
MAX_TEXT_CELLS = 2500  # never paint text for more cells than this, however the view is sized
OVERVIEW_TEXELS = 256  # the overview image is at most this many texels a side (downsampled by priority)
MIN_FIT_CELLS = 4  # "fit used blocks" frames at least this many cells a side


_ELIDE = Qt.TextElideMode.ElideRight  # enum lookups are slow in PySide: look them up once


def slot_layout(block_size: int) -> tuple[int, int]:
    """(rows, cols) of a block's slots drawn inside its cell (plus one header row above them)."""
    cols = 1 if block_size <= 8 else 2 if block_size <= 32 else 4
    return math.ceil(block_size / cols), cols


def slots_px(block_size: int) -> float:
    """Pixels per cell from which each block is drawn as its slots with their tokens."""
    rows, cols = slot_layout(block_size)
    return max(LABEL_PX * 1.5, SLOT_ROW_PX * (rows + 1), SLOT_MIN_WIDTH_PX * cols)


def level_for(px_per_cell: float, block_size: int) -> DetailLevel:
    if px_per_cell >= slots_px(block_size):
        return DetailLevel.SLOTS
    if px_per_cell >= LABEL_PX:
        return DetailLevel.LABELS
    if px_per_cell >= BORDER_PX:
        return DetailLevel.BORDERS
    return DetailLevel.CELLS


def grid_shape(n: int) -> tuple[int, int]:
    """(rows, cols) of a near-square grid holding n cells, wider than tall."""
    cols = max(1, math.ceil(math.sqrt(n)))
    return math.ceil(n / cols), cols


def _lut(colours: list[tuple[int, int, int]]) -> np.ndarray:
    return np.array(colours + [BACKGROUND], dtype=np.uint8)


def codes_for(snap: KVSnapshot, mode: str, leaked: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(codes uint8 [num_blocks], lut [K+1, 3]); code K is the padding colour."""
    if mode == "state":
        return state_codes(snap, leaked), _lut([STATE_COLOURS[s] for s in BlockState])
    if mode == "owner":
        k = len(OWNER_PALETTE)
        codes = np.where(snap.owner < 0, 0, 1 + snap.owner % k).astype(np.uint8)
        return codes, _lut([STATE_COLOURS[BlockState.FREE]] + OWNER_PALETTE)
    if mode == "ref count":
        return np.minimum(snap.ref_cnt, len(REF_COLOURS) - 1).astype(np.uint8), _lut(REF_COLOURS)
    if mode == "age":
        return age_codes(snap.step - snap.last_access), _lut(AGE_COLOURS)
    raise ValueError(f"unknown colour mode {mode!r}")


def cpu_codes_for(snap: KVSnapshot, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """The CPU swap pool: free or swapped (coloured by owner in owner mode)."""
    if mode == "owner":
        k = len(OWNER_PALETTE)
        codes = np.where(snap.cpu_owner < 0, 0, 1 + snap.cpu_owner % k).astype(np.uint8)
        return codes, _lut([STATE_COLOURS[BlockState.FREE]] + OWNER_PALETTE)
    return snap.cpu_state.copy(), _lut([STATE_COLOURS[s] for s in BlockState])


def to_grid(codes: np.ndarray, pad_code: int) -> np.ndarray:
    rows, cols = grid_shape(len(codes))
    grid = np.full(rows * cols, pad_code, dtype=np.uint8)
    grid[:len(codes)] = codes
    grid = grid.reshape(rows, cols)
    grid.flags.writeable = False  # ImageItem reads lazily at paint time: never mutate a shown array
    return grid


def downsample(grid: np.ndarray, factor: int, pad_code: int, reduce: str = "max") -> np.ndarray:
    """Shrink ``grid`` by ``factor`` a side, each texel the max (or min) code of its blocks.

    Codes are ordered by importance (a leaked block outranks a free one), so a single leaked
    or used block is never hidden in the overview. Padding ranks below every real code.
    """
    if factor <= 1:
        return grid
    rows, cols = grid.shape
    r2, c2 = math.ceil(rows / factor), math.ceil(cols / factor)
    if reduce == "max":  # shift so that the padding code is the smallest
        work = np.zeros((r2 * factor, c2 * factor), np.uint8)
        np.add(grid, 1, out=work[:rows, :cols])
        work[:rows, :cols][grid == pad_code] = 0
        op = np.maximum
    else:
        work = np.full((r2 * factor, c2 * factor), pad_code, np.uint8)
        work[:rows, :cols] = grid
        op = np.minimum
    # Strided element-wise max/min: ~10x faster than a reshape(...).max(axis=(1, 3)) over small axes.
    out = work[0::factor].copy()
    for k in range(1, factor):
        op(out, work[k::factor], out=out)
    cols_out = out[:, 0::factor].copy()
    for k in range(1, factor):
        op(cols_out, out[:, k::factor], out=cols_out)
    if reduce == "max":
        return np.where(cols_out == 0, pad_code, cols_out - 1).astype(np.uint8)
    return cols_out


def _mix(c: tuple[int, int, int], other: tuple[int, int, int], t: float) -> QColor:
    return QColor(*(int(a + (b - a) * t) for a, b in zip(c, other)))


class _DetailLayer(pg.GraphicsObject):
    """Borders, labels and slots of the visible cells, painted in device pixels in one item."""

    def __init__(self, view: BlockGridView) -> None:
        super().__init__()
        self.view = view
        self.painted_cells = 0  # cells that got text in the last paint (tests and the benchmark)
        self.texts: dict[int, list[str]] = {}  # block -> the text painted in it, last paint (bounded)
        self.bars: dict[int, int] = {}  # block -> filled slots drawn as its fill bar, last paint

    def boundingRect(self) -> QRectF:  # noqa: N802 - Qt's name
        g = self.view.grid
        return QRectF(0, 0, 1, 1) if g is None else QRectF(0, 0, g.shape[1], g.shape[0])

    def paint(self, p, *args) -> None:
        v = self.view
        level = v.detail_level
        self.painted_cells = 0
        self.texts, self.bars = {}, {}
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
        font.setPixelSize(int(max(8, min(12, rect.height() * 0.15))))
        font.setBold(True)
        p.setFont(font)
        fm = QFontMetrics(font)
        w, h = fm.horizontalAdvance(badge) + 6, fm.height()
        box = QRectF(rect.center().x() - w / 2, rect.top() + 1, w, h)
        p.fillRect(box, QColor(255, 255, 255))
        p.setPen(QColor(0, 0, 0))
        p.drawText(box, Qt.AlignmentFlag.AlignCenter, badge)
        p.restore()
        self.texts.setdefault(b, []).append(badge)

    def _label_style(self, p, rect: QRectF) -> None:
        """Font, metrics and per-colour pens for this paint (every cell has the same size): made once."""
        font = QFont()
        font.setPixelSize(int(max(8, min(14, rect.height() * 0.22))))
        p.setFont(font)
        fm = QFontMetrics(font)
        pad = max(2.0, rect.width() * 0.06)
        v = self.view
        cpu_owner = {c: r.request_id for r in v.snapshot.requests for c in r.cpu_block_ids} if v.cpu else {}
        colours = {}
        for code, c in enumerate(v.lut):
            c = tuple(int(x) for x in c)
            colours[code] = (QColor(*c), QColor(*text_on(c)), _mix(c, (255, 255, 255), 0.35),
                             _mix(c, (0, 0, 0), 0.55), _mix(c, (255, 255, 255), 0.6))
        width = rect.width() - 2 * pad
        self._style = {"fm": fm, "pad": pad, "long_ref": width > fm.horizontalAdvance("ref 00"),
                       "fill_text": width > fm.horizontalAdvance("00/00") * 1.6, "cpu_owner": cpu_owner,
                       "colours": colours, "ids_fit": fm.horizontalAdvance(f"#{max(v.num_cells() - 1, 0)}") <= width,
                       "ascent": fm.ascent(), "line": fm.height(), "descent": fm.descent()}

    def _paint_label(self, p, rect: QRectF, b: int) -> None:
        v, s, st = self.view, self.view.snapshot, self._style
        fm, pad = st["fm"], st["pad"]
        fill, ink, dim, bar_bg, bar_fg = st["colours"][int(v.codes[b])]
        p.fillRect(rect, fill)
        text_rect = rect.adjusted(pad, pad, -pad, -pad)
        width = int(text_rect.width())
        x, y = text_rect.left(), text_rect.top() + st["ascent"]

        def line(i: int, t: str) -> None:
            if (i and (len(t) > 6 or not st["long_ref"])) or (not i and not st["ids_fit"]):
                t = fm.elidedText(t, _ELIDE, width)
            p.drawText(QPointF(x, y + i * st["line"]), t)

        if v.cpu:
            owner = st["cpu_owner"].get(b)
            lines = [f"#{b}", f"req {owner}" if owner is not None else "free"]
        elif s.state[b] == BlockState.FREE and b not in v.leaked_set:  # empty: just its id, quietly
            p.setPen(dim)
            line(0, f"#{b}")
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
        self.texts[b] = lines
        if not v.cpu:  # the fill bar: filled slots / block size
            filled = int(s.filled[b])
            self.bars[b] = filled
            h = max(3.0, rect.height() * 0.12)
            bar = QRectF(text_rect.left(), text_rect.bottom() - h, text_rect.width(), h)
            p.fillRect(bar, bar_bg)
            if filled:
                p.fillRect(QRectF(bar.left(), bar.top(), bar.width() * filled / s.block_size, bar.height()), bar_fg)
            if st["fill_text"]:
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
            font.setPixelSize(int(max(8, min(15, row_h * 0.62))))
            p.setFont(font)
            self._style = QFontMetrics(font)
        fm = self._style
        p.setPen(QColor(*text_on(colour)))
        ref = int(s.ref_cnt[b])
        if v.leaked_set and b in v.leaked_set:
            right = "LEAKED"
        else:
            right = f"ref {ref}" if ref else palette.STATES[BlockState(int(s.state[b]))].name
        header = QRectF(rect.left() + 3, rect.top(), rect.width() - 6, row_h)
        p.drawText(header, Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter, right)
        p.drawText(header.adjusted(0, 0, -fm.horizontalAdvance(right) - 4, 0),
                   Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter,
                   fm.elidedText(f"#{b}", Qt.TextElideMode.ElideRight,
                                 int(header.width() - fm.horizontalAdvance(right) - 4)))
        toks = v.block_tokens().of(b)
        labels = [v.decoder.label(t) for t in toks]
        self.texts[b] = [f"#{b}", right] + labels
        slot_w = (rect.width() - 4) / cols
        empty, full = _mix(colour, (0, 0, 0), 0.55), _mix(colour, (255, 255, 255), 0.72)
        for i in range(s.block_size):
            rr, cc = i % rows, i // rows
            sr = QRectF(rect.left() + 2 + cc * slot_w, rect.top() + row_h * (rr + 1), slot_w, row_h).adjusted(
                1, 1, -1, -1)
            p.fillRect(sr, full if i < len(toks) else empty)
            if i < len(toks):
                p.setPen(QColor(0, 0, 0))
                p.drawText(sr.adjusted(3, 0, -2, 0), Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter,
                           fm.elidedText(labels[i], Qt.TextElideMode.ElideRight,
                                         int(sr.width() - 5)))


class OverviewView(pg.PlotWidget):
    """The whole pool, small: one downsampled ImageItem and a rectangle for the detail view's range."""

    jump_to = Signal(float, float)  # grid coordinates (x = column, y = row) to centre the detail view on

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setAspectLocked(True)
        self.invertY(True)
        self.hideAxis("left")
        self.hideAxis("bottom")
        self.setMenuEnabled(False)
        self.setMouseEnabled(False, False)
        self.hideButtons()
        self.image = pg.ImageItem(axisOrder="row-major")
        self.addItem(self.image)
        self.frame = QGraphicsRectItem()
        pen = QPen(QColor(255, 255, 255))
        pen.setCosmetic(True)
        pen.setWidth(2)
        self.frame.setPen(pen)
        self.frame.setBrush(QBrush(QColor(255, 255, 255, 40)))
        self.frame.setZValue(10)
        self.addItem(self.frame)
        self.factor = 1
        self.shape = (0, 0)
        self.scene().sigMouseClicked.connect(self._on_click)
        self.scene().sigMouseMoved.connect(self._on_move)
        self.setToolTip("the whole pool: click or drag to move the detail view")
        self.setMinimumSize(60, 60)

    def sizeHint(self) -> QSize:  # noqa: N802 - Qt's name
        return QSize(170, 150)

    def set_grid(self, grid: np.ndarray, lut: np.ndarray, reduce: str = "max") -> None:
        self._last = (grid, lut, reduce)
        rows, cols = grid.shape
        k = len(lut) - 1
        # No more texels than the widget has pixels: Qt's scaling would drop rows (and a leaked block).
        target = max(16, min(OVERVIEW_TEXELS, self.width() - 4, self.height() - 4))
        self.factor = max(1, math.ceil(max(rows, cols) / target))
        small = downsample(grid, self.factor, k, reduce)
        self.image.setImage(small, lut=lut, levels=(0, k + 1), autoLevels=False, autoDownsample=False)
        self.image.setRect(QRectF(0, 0, small.shape[1] * self.factor, small.shape[0] * self.factor))
        if self.shape != (rows, cols):
            self.shape = (rows, cols)
            self.setRange(xRange=(0, cols), yRange=(0, rows), padding=0.02)

    def resizeEvent(self, ev) -> None:  # noqa: N802 - Qt's name
        super().resizeEvent(ev)
        if getattr(self, "_last", None) is not None:
            self.set_grid(*self._last)

    def set_frame(self, rect: QRectF) -> None:
        self.frame.setRect(rect)

    def _grid_pos(self, scene_pos) -> QPointF:
        return self.getViewBox().mapSceneToView(scene_pos)

    def _on_click(self, ev) -> None:
        p = self._grid_pos(ev.scenePos())
        self.jump_to.emit(p.x(), p.y())

    def _on_move(self, pos) -> None:
        if QApplication.mouseButtons() & Qt.MouseButton.LeftButton:
            p = self._grid_pos(pos)
            self.jump_to.emit(p.x(), p.y())


class _KeyForwarder(QObject):
    def __init__(self, view: BlockGridView) -> None:
        super().__init__(view)
        self.view = view

    def eventFilter(self, obj, ev) -> bool:  # noqa: N802 - Qt's name
        if ev.type() == QEvent.Type.KeyPress and self.view.handle_key(ev.key(), ev.text()):
            return True
        return False


class BlockGridView(QWidget):
    """The block grid. API: ``set_snapshot(snap, leaked)``, ``set_mode(mode)``, ``set_highlight(ids)``,
    ``fit_used()``, ``fit_all()``, ``zoom_by(f)``, ``zoom_to(px_per_cell, centre)``, ``pan_by(dx, dy)``,
    ``detail_level``, ``pixels_per_cell()``; signals ``block_clicked(int)``, ``block_hovered(int)``;
    ``token_text`` (callable ids -> str, or ``set_decode``); ``legend`` and ``overview`` are its children.
    """

    block_clicked = Signal(int)
    block_hovered = Signal(int)
    level_changed = Signal(int)  # DetailLevel

    def __init__(self, title: str = "GPU blocks", parent: QWidget | None = None, cpu: bool = False,
                 overview: bool | None = None, legend: bool = True) -> None:
        super().__init__(parent)
        self.cpu = cpu  # draw the CPU swap pool of the snapshot instead of the device pool
        self.snapshot: KVSnapshot | None = None
        self.leaked: np.ndarray | None = None
        self.leaked_set: set[int] = set()
        self.mode = "state"
        self.highlight: list[int] = []
        self.logical_index: dict[int, int] = {}  # highlighted block -> its index in the highlight (logical block)
        self.grid: np.ndarray | None = None
        self.codes: np.ndarray | None = None
        self.lut: np.ndarray | None = None
        self.num_redraws = 0
        self.auto_fit = True  # follow the blocks in use until the user zooms or pans
        self._key = None
        self._shape: tuple[int, int] | None = None
        self._level = DetailLevel.CELLS
        self._ui_pending = False
        self._block_tokens: BlockTokens | None = None
        self.decoder = TokenDecoder()

        self.title = QLabel(title)
        self.title.setMinimumWidth(40)
        self.title.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.mode_box = QComboBox()
        self.mode_box.addItems(MODES)
        self.mode_box.currentTextChanged.connect(self.set_mode)
        self.fit_button = QToolButton()
        self.fit_button.setText("Fit")
        self.fit_button.setToolTip("fit the blocks in use (F or Home); A: the whole pool")
        self.fit_button.clicked.connect(self.fit_used)
        self.zoom_label = QLabel("")
        self.zoom_label.setStyleSheet("color: #8a93a5")
        self.zoom_label.setFixedWidth(150)  # its text changes as the view zooms: never relayout for it
        self.hover_label = QLabel(" ")
        self.hover_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.hover_label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)

        self.plot = pg.PlotWidget()
        self.plot.setAspectLocked(True)
        self.plot.invertY(True)
        self.plot.hideAxis("left")
        self.plot.hideAxis("bottom")
        self.plot.setMenuEnabled(False)
        self.plot.hideButtons()
        self.plot.setMinimumSize(120, 100)
        self.plot.setFocusPolicy(Qt.FocusPolicy.StrongFocus)
        self.image = pg.ImageItem(axisOrder="row-major")
        self.plot.addItem(self.image)
        self.overlay = pg.ImageItem(axisOrder="row-major")
        self.overlay.setZValue(5)
        self.plot.addItem(self.overlay)
        self.layer = _DetailLayer(self)
        self.layer.setZValue(6)
        self.plot.addItem(self.layer)
        self.path = pg.PlotDataItem(pen=pg.mkPen((255, 255, 255, 200), width=2), symbol="o", symbolSize=5,
                                    symbolBrush=(255, 255, 255))
        self.path.setZValue(10)
        self.plot.addItem(self.path)
        vb = self.plot.getViewBox()
        vb.sigRangeChanged.connect(self._on_range)
        vb.sigRangeChangedManually.connect(self._on_manual_range)
        vb.sigResized.connect(self._on_resized)
        self.plot.scene().sigMouseMoved.connect(self._on_move)
        self.plot.scene().sigMouseClicked.connect(self._on_click)
        self._keys = _KeyForwarder(self)
        self.plot.installEventFilter(self._keys)
        self.setFocusPolicy(Qt.FocusPolicy.StrongFocus)

        show_overview = (not cpu) if overview is None else overview
        self.show_overview = show_overview
        self.overview = OverviewView()
        self.overview.jump_to.connect(self.centre_on)
        self.overview.setVisible(show_overview)
        self.legend = LegendView(cpu=cpu)

        top = QHBoxLayout()
        top.setContentsMargins(0, 0, 0, 0)
        top.addWidget(self.title, 1)
        top.addWidget(self.zoom_label)
        top.addWidget(self.fit_button)
        top.addWidget(QLabel("colour by"))
        top.addWidget(self.mode_box)
        side = QWidget()
        side_lay = QVBoxLayout(side)
        side_lay.setContentsMargins(0, 0, 0, 0)
        side_lay.addWidget(self.overview, 0)
        legend_scroll = QScrollArea()
        legend_scroll.setWidget(self.legend)
        legend_scroll.setWidgetResizable(True)
        legend_scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        legend_scroll.setFrameShape(QScrollArea.Shape.NoFrame)
        legend_scroll.setMinimumHeight(60)
        side_lay.addWidget(legend_scroll, 1)
        side.setFixedWidth(190)
        self.side = side
        side.setVisible(legend or show_overview)
        legend_scroll.setVisible(legend)
        body = QHBoxLayout()
        body.setContentsMargins(0, 0, 0, 0)
        body.addWidget(self.plot, 1)
        body.addWidget(side)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(2, 2, 2, 2)
        lay.setSpacing(2)
        lay.addLayout(top)
        lay.addLayout(body, 1)
        lay.addWidget(self.hover_label)


    # -- token text --------------------------------------------------------------------
    @property
    def token_text(self):
        return self.decoder.decode

    @token_text.setter
    def token_text(self, fn) -> None:
        self.set_decode(fn)

    def set_decode(self, fn) -> None:
        """``fn(list[int]) -> str`` (a tokenizer's decode), or None: tokens are shown as ids."""
        self.decoder.set_decode(fn)
        self.layer.update()

    # -- data --------------------------------------------------------------------------
    def set_snapshot(self, snap: KVSnapshot, leaked: np.ndarray | None = None) -> None:
        self.snapshot, self.leaked = snap, leaked
        self.leaked_set = set(np.asarray(leaked).tolist()) if leaked is not None and len(leaked) else set()
        self._block_tokens = None
        self.redraw()

    def set_mode(self, mode: str) -> None:
        self.mode = mode
        if self.mode_box.currentText() != mode:
            self.mode_box.setCurrentText(mode)
        self.legend.set_mode(mode)
        self.redraw()

    def num_cells(self) -> int:
        s = self.snapshot
        if s is None:
            return 0
        return len(s.cpu_state) if self.cpu else s.num_blocks

    def block_tokens(self) -> BlockTokens:
        if self._block_tokens is None or self._block_tokens.snap is not self.snapshot:
            self._block_tokens = BlockTokens(self.snapshot)
        return self._block_tokens

    def redraw(self, force: bool = False) -> None:
        snap = self.snapshot
        if snap is None:
            return
        key = (id(snap), self.mode, None if self.leaked is None else self.leaked.tobytes(), tuple(self.highlight))
        if key == self._key and not force:
            return  # redraw only when something changed
        self._key = key
        codes, lut = cpu_codes_for(snap, self.mode) if self.cpu else codes_for(snap, self.mode, self.leaked)
        k = len(lut) - 1
        self.codes, self.lut = codes, lut
        grid = to_grid(codes, k)
        if self.grid is None or grid.shape != self.grid.shape:
            self.layer.prepareGeometryChange()  # before the layer's bounding rect changes (the scene's index)
        self.grid = grid
        self.image.setImage(self.grid, lut=lut, levels=(0, k + 1), autoLevels=False, autoDownsample=False)
        if self.show_overview:
            self.overview.set_grid(self.grid, lut, "min" if self.mode == "age" else "max")
        self.legend.set_snapshot(snap, self.leaked)
        self._draw_highlight()
        self._frame_view()
        self.layer.update()
        self.num_redraws += 1

    def set_highlight(self, block_ids: list[int]) -> None:
        """Outline these blocks; their order (a block table's logical order) is drawn as a path."""
        self.highlight = list(block_ids)
        self.logical_index = {}
        for i, b in enumerate(self.highlight):
            self.logical_index.setdefault(int(b), i)
        self._key = None
        self.redraw()

    def _highlight_style(self) -> None:
        """Small cells: a light wash and a path in logical order. Big cells (text): an outline and an
        "L<i>" badge (the logical index) instead, so nothing is drawn over the tokens."""
        big = self._level >= DetailLevel.LABELS
        self.overlay.setVisible(not big)
        self.path.setVisible(not big)
        self.image.setVisible(not big)  # the layer fills the few visible cells itself (cheaper than the image)

    def _draw_highlight(self) -> None:
        if self.grid is None:
            return
        rows, cols = self.grid.shape
        if not self.highlight:
            self.overlay.clear()
            self.path.setData([], [])
            return
        mask = np.zeros((rows * cols, 4), np.uint8)
        ids = np.array(self.highlight)
        ids = ids[(ids >= 0) & (ids < rows * cols)]
        mask[ids] = (255, 255, 255, 110)
        self.overlay.setImage(mask.reshape(rows, cols, 4), levels=(0, 255), autoLevels=False)
        self.path.setData(ids % cols + 0.5, ids // cols + 0.5)

    # -- view range and level of detail ------------------------------------------------------
    def _frame_view(self) -> None:
        shape = self.grid.shape
        vb = self.plot.getViewBox()
        rows, cols = shape
        span = max(rows, cols)
        vb.setLimits(minXRange=1.0, minYRange=1.0, maxXRange=4 * span + 4, maxYRange=4 * span + 4,
                     xMin=-span - 1, xMax=cols + span + 1, yMin=-span - 1, yMax=rows + span + 1)
        if shape != self._shape:  # a new pool: open framed on the blocks in use
            self._shape = shape
            self.auto_fit = True
            self.fit_used()
        elif self.auto_fit:
            box = self.used_rect()
            if not vb.viewRect().contains(box):
                self.fit_used()
        self._on_range()

    def used_rect(self) -> QRectF:
        """Grid rectangle around the blocks in use (any state but free), at least MIN_FIT_CELLS a side.

        With none in use: the head of the free queue, where the next allocations land.
        """
        s = self.snapshot
        rows, cols = self.grid.shape
        state = s.cpu_state if self.cpu else s.state
        mask = np.zeros(rows * cols, bool)
        mask[:len(state)] = state != BlockState.FREE
        if not mask.any():
            head = np.asarray(s.free_queue[:16] if not self.cpu else (), np.int64)
            mask[head if len(head) else np.arange(min(16, len(state)))] = True
        if not mask.any():
            mask[0] = True
        m = mask.reshape(rows, cols)
        used_rows, used_cols = np.flatnonzero(m.any(axis=1)), np.flatnonzero(m.any(axis=0))
        r0, r1 = int(used_rows[0]), int(used_rows[-1]) + 1
        c0, c1 = int(used_cols[0]), int(used_cols[-1]) + 1
        w, h = max(c1 - c0, min(MIN_FIT_CELLS, cols)), max(r1 - r0, min(MIN_FIT_CELLS, rows))
        # Grow around the blocks, but stay inside the grid where it is big enough.
        x = min(max(0.0, (c0 + c1 - w) / 2), max(0.0, cols - w))
        y = min(max(0.0, (r0 + r1 - h) / 2), max(0.0, rows - h))
        return QRectF(x, y, w, h)

    def fit_used(self) -> None:
        """Frame the blocks in use ("F" / "Home"), and follow them again as they grow."""
        if self.grid is None:
            return
        self.auto_fit = True
        box = self.used_rect().adjusted(-0.15, -0.15, 0.15, 0.15)
        vb = self.plot.getViewBox()
        rows, cols = self.grid.shape
        aspect = vb.width() / vb.height() if vb.height() > 0 else 1.0
        # The range the aspect lock will show, placed top-left-most inside the grid (no empty margins).
        w, h = max(box.width(), box.height() * aspect), max(box.height(), box.width() / aspect)

        def place(lo: float, size: float, box_size: float, limit: int) -> float:
            if size >= limit + 0.3:
                return (limit - size) / 2
            return min(max(-0.15, lo - (size - box_size) / 2), limit + 0.15 - size)

        x, y = place(box.left(), w, box.width(), cols), place(box.top(), h, box.height(), rows)
        vb.setRange(xRange=(x, x + w), yRange=(y, y + h), padding=0)

    def fit_all(self) -> None:
        """The whole pool ("A")."""
        if self.grid is None:
            return
        self.auto_fit = False
        rows, cols = self.grid.shape
        self.plot.getViewBox().setRange(xRange=(0, cols), yRange=(0, rows), padding=0.01)

    def pixels_per_cell(self) -> float:
        """Screen pixels per cell now (from the view's range and size, not the lazily updated transform)."""
        vb = self.plot.getViewBox()
        w = vb.viewRect().width()
        return vb.width() / w if w > 0 else 0.0

    @property
    def detail_level(self) -> DetailLevel:
        return self._level

    @property
    def thresholds(self) -> dict[DetailLevel, float]:
        """Pixels per cell at which each level starts (the slot level depends on the block size)."""
        bs = self.snapshot.block_size if self.snapshot is not None else 16
        return {DetailLevel.CELLS: 0.0, DetailLevel.BORDERS: BORDER_PX, DetailLevel.LABELS: LABEL_PX,
                DetailLevel.SLOTS: slots_px(bs)}

    def zoom_to(self, px_per_cell: float, centre: QPointF | None = None) -> None:
        """Set the zoom so that one cell is ``px_per_cell`` pixels wide (centred on ``centre``, grid units)."""
        vb = self.plot.getViewBox()
        if centre is None:
            centre = vb.viewRect().center()
        w, h = vb.width() / px_per_cell, vb.height() / px_per_cell
        vb.setRange(xRange=(centre.x() - w / 2, centre.x() + w / 2),
                    yRange=(centre.y() - h / 2, centre.y() + h / 2), padding=0)

    def zoom_by(self, factor: float) -> None:
        """Zoom in (factor > 1) or out around the view's centre."""
        self.auto_fit = False
        vb = self.plot.getViewBox()
        vb.scaleBy((1 / factor, 1 / factor), center=vb.viewRect().center())

    def pan_by(self, fx: float, fy: float) -> None:
        """Move the view by these fractions of its width and height."""
        self.auto_fit = False
        vb = self.plot.getViewBox()
        r = vb.viewRect()
        vb.translateBy(x=fx * r.width(), y=fy * r.height())

    def centre_on(self, x: float, y: float) -> None:
        self.auto_fit = False
        vb = self.plot.getViewBox()
        r = vb.viewRect()
        vb.translateBy(x=x - r.center().x(), y=y - r.center().y())

    def visible_cells(self) -> tuple[int, int, int, int]:
        """(row0, row1, col0, col1), half-open, of the cells in view, clipped to the grid."""
        if self.grid is None:
            return 0, 0, 0, 0
        rows, cols = self.grid.shape
        r = self.plot.getViewBox().viewRect()
        return (max(0, math.floor(r.top())), min(rows, math.ceil(r.bottom())),
                max(0, math.floor(r.left())), min(cols, math.ceil(r.right())))

    def handle_key(self, key: int, text: str = "") -> bool:
        """Keyboard zoom and pan; True when the key was one of ours."""
        k = Qt.Key
        if key in (k.Key_Plus, k.Key_Equal):
            self.zoom_by(1.25)
        elif key in (k.Key_Minus, k.Key_Underscore):
            self.zoom_by(0.8)
        elif key == k.Key_Left:
            self.pan_by(-0.25, 0)
        elif key == k.Key_Right:
            self.pan_by(0.25, 0)
        elif key == k.Key_Up:
            self.pan_by(0, -0.25)
        elif key == k.Key_Down:
            self.pan_by(0, 0.25)
        elif key in (k.Key_Home, k.Key_F):
            self.fit_used()
        elif key == k.Key_A:
            self.fit_all()
        else:
            return False
        return True

    def keyPressEvent(self, ev) -> None:  # noqa: N802 - Qt's name
        if not self.handle_key(ev.key(), ev.text()):
            super().keyPressEvent(ev)

    def _on_manual_range(self, *_) -> None:
        self.auto_fit = False

    def _on_range(self, *_) -> None:
        if self.grid is None:
            return
        px = self.pixels_per_cell()
        bs = self.snapshot.block_size if self.snapshot is not None else 16
        level = level_for(px, bs) if not self.cpu else min(level_for(px, bs), DetailLevel.LABELS)
        r0, r1, c0, c1 = self.visible_cells()
        if level >= DetailLevel.LABELS and (r1 - r0) * (c1 - c0) > MAX_TEXT_CELLS:
            level = DetailLevel.BORDERS  # a huge screen: text would cost too much, the image draws instead
        changed = level != self._level
        self._level = level
        # The view box may settle its range while it paints (aspect lock): changing widgets or items
        # then can free the device being painted, so those updates wait for the paint to end.
        if self.plot.viewport().paintingActive():
            if not self._ui_pending:
                self._ui_pending = True
                QTimer.singleShot(0, self._apply_range_ui)
        else:
            self._apply_range_ui()
        if changed:
            self.level_changed.emit(int(level))

    def _apply_range_ui(self) -> None:
        self._ui_pending = False
        if self.grid is None:
            return
        px, level = self.pixels_per_cell(), self._level
        names = {DetailLevel.CELLS: "cells", DetailLevel.BORDERS: "borders", DetailLevel.LABELS: "ids, ref, fill",
                 DetailLevel.SLOTS: "slots + tokens"}
        self.zoom_label.setText(f"{px:.0f} px/block · {names[level]}" if px >= 1 else
                                f"{1 / px:.1f} blocks/px · {names[level]}" if px > 0 else "")
        self.overview.set_frame(self.plot.getViewBox().viewRect())
        self._highlight_style()
        self.layer.update()

    def _on_resized(self, *_) -> None:
        if self.grid is not None and self.auto_fit:
            self.fit_used()
        self._on_range()

    # -- mouse ------------------------------------------------------------------------
    def block_at(self, scene_pos: QPointF) -> int:
        if self.grid is None or self.snapshot is None:
            return -1
        p = self.plot.getViewBox().mapSceneToView(scene_pos)
        rows, cols = self.grid.shape
        c, r = int(math.floor(p.x())), int(math.floor(p.y()))
        if not (0 <= c < cols and 0 <= r < rows):
            return -1
        b = r * cols + c
        return b if b < self.num_cells() else -1

    def describe(self, b: int) -> str:
        s = self.snapshot
        if s is not None and self.cpu:
            owner = [r.request_id for r in s.requests if b in r.cpu_block_ids]
            return f"CPU block {b} · " + (f"swapped out by request {owner[0]}" if owner else "free")
        if s is None or not 0 <= b < s.num_blocks:
            return ""
        owners = s.owners_of(b)
        state = BlockState(int(s.state[b]))
        parts = [f"block {b}", palette.STATES[state].name, f"ref {int(s.ref_cnt[b])}",
                 f"filled {int(s.filled[b])}/{s.block_size}"]
        if b in self.leaked_set:
            parts.append("LEAKED")
        if owners:
            parts.append("owners " + ",".join(owners))
        if b in s.block_hashes:
            parts.append("hash " + s.block_hashes[b][:12])
        toks = self.block_tokens().of(b)
        if toks:
            text = self.decoder.join(toks)
            parts.append(repr(text)[:80])
        return " · ".join(parts)

    def _tokens_of(self, b: int) -> tuple[int, ...]:
        return self.block_tokens().of(b)

    def _on_move(self, pos) -> None:
        b = self.block_at(pos)
        text = self.describe(b) if b >= 0 else " "
        self.hover_label.setText(text)
        if b >= 0:
            self.plot.setToolTip(text.replace(" · ", "\n"))
            self.block_hovered.emit(b)
        else:
            self.plot.setToolTip("")
            QToolTip.hideText()

    def _on_click(self, ev) -> None:
        b = self.block_at(ev.scenePos())
        if b >= 0:
            self.block_clicked.emit(b)

    def clear(self) -> None:
        """Forget the snapshot (a new session): no stale hover text, captions or highlight."""
        self.snapshot, self.leaked, self.leaked_set = None, None, set()
        self.highlight, self.logical_index = [], {}
        self.layer.prepareGeometryChange()
        self.grid = self.codes = None
        self._key = self._shape = None
        self._block_tokens = None
        self.image.clear()
        self.overlay.clear()
        self.overview.image.clear()
        self.path.setData([], [])
        self.hover_label.setText(" ")
        self.plot.setToolTip("")
        self.legend.set_snapshot(None)
        self.layer.update()

