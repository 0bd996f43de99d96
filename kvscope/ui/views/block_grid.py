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

import math

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QEvent, QObject, QPointF, Qt, Signal
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QLabel,
    QScrollArea,
    QSizePolicy,
    QToolButton,
    QToolTip,
    QVBoxLayout,
    QWidget,
)

from engine.inspect.kv_groups import name_of
from engine.inspect.snapshot import BlockState, KVSnapshot
from kvscope.ui import palette
from kvscope.ui.palette import MODES
from kvscope.ui.style import text_scale
from kvscope.ui.views.grid_cells import (
    DetailLevel,
    codes_for,
    columns_to_fill,
    cpu_codes_for,
    to_grid,
)
from kvscope.ui.views.grid_detail import _DetailLayer
from kvscope.ui.views.grid_navigation import GridNavigation
from kvscope.ui.views.grid_overview import OverviewView
from kvscope.ui.views.legend import LegendView
from kvscope.ui.views.token_text import BlockTokens, TokenDecoder

SIDE_PX = 190  # the legend and overview's column at 1x text


class _KeyForwarder(QObject):
    def __init__(self, view: BlockGridView) -> None:
        super().__init__(view)
        self.view = view

    def eventFilter(self, obj, ev) -> bool:  # noqa: N802 - Qt's name
        if ev.type() == QEvent.Type.KeyPress and self.view.handle_key(ev.key(), ev.text()):
            return True
        return False


class _LegendScroll(QScrollArea):
    """The legend's scroll area: as the side panel's height changes, the overview gives up height first (down to
    a small map) and then the legend drops the grey line under each state (kept as the row's tooltip), so that
    every row shows without scrolling where it can."""

    def __init__(self, legend: LegendView, overview: OverviewView) -> None:
        super().__init__()
        self.legend, self.overview = legend, overview

    def resizeEvent(self, ev) -> None:  # noqa: N802 - Qt's name
        super().resizeEvent(ev)
        self.fit()

    def fit(self) -> None:
        side = self.parentWidget()
        if side is None:
            return
        total = side.height()
        mapped = self.overview.isVisible()
        full = self.legend.height_needed(meanings=True)
        meanings = full <= total - (70 if mapped else 0)  # the map keeps at least 70 px
        self.legend.set_meanings_shown(meanings)
        if mapped:  # at most 150 px, and whatever the legend leaves
            need = full if meanings else self.legend.height_needed(meanings=False)
            self.overview.setMaximumHeight(max(70, min(150, total - need)))


class BlockGridView(GridNavigation, QWidget):
    """The block grid. API: ``set_snapshot(snap, leaked)``, ``set_mode(mode)``, ``set_highlight(ids)``,
    ``fit_used()``, ``fit_all()``, ``zoom_by(f)``, ``zoom_to(px_per_cell, centre)``, ``pan_by(dx, dy)``,
    ``detail_level``, ``pixels_per_cell()``; signals ``block_clicked(int)``, ``block_hovered(int)``;
    ``token_text`` (callable ids -> str, or ``set_decode``); ``legend`` and ``overview`` are its children.
    """

    block_clicked = Signal(int)
    block_hovered = Signal(int)
    level_changed = Signal(int)  # DetailLevel

    def __init__(
        self,
        title: str = "GPU blocks",
        parent: QWidget | None = None,
        cpu: bool = False,
        overview: bool | None = None,
        legend: bool = True,
    ) -> None:
        super().__init__(parent)
        self.cpu = cpu  # draw the CPU swap pool of the snapshot instead of the device pool
        self.snapshot: KVSnapshot | None = None
        self.leaked: np.ndarray | None = None
        self.flag_name: str | None = None  # what the audit found wrong with the red blocks (the legend says it)
        self.flag_kinds: dict[int, str] = {}  # each red block's own problem
        self.leaked_set: set[int] = set()
        self.mode = "state"
        self.highlight: list[int] = []
        self.logical_index: dict[int, int] = {}  # highlighted block -> its index in the highlight (logical block)
        self.grid: np.ndarray | None = None
        self.codes: np.ndarray | None = None
        self.lut: np.ndarray | None = None
        self.num_redraws = 0
        self.auto_fit = True  # follow the blocks in use until the user zooms or pans
        self.compact = False  # presentation: the whole pool, its columns fitted to the view, nothing around it
        self.columns: int | None = None  # compact: the grid's columns (None: near-square)
        self._key = None
        self._shape: tuple[int, int] | None = None
        self._level = DetailLevel.CELLS
        self._ui_pending = False
        self._block_tokens: BlockTokens | None = None
        self.decoder = TokenDecoder()

        self.title = QLabel(title)
        self.title.setMinimumWidth(40)
        self.title.setWordWrap(True)  # a long title wraps: it never runs under the zoom label beside it
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
        self._fit_zoom_label()  # its text changes as the view zooms: a fixed width, never a relayout for it
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
        self.path = pg.PlotDataItem(
            pen=pg.mkPen((255, 255, 255, 200), width=2), symbol="o", symbolSize=5, symbolBrush=(255, 255, 255)
        )
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
        self.top_widgets = [self.title, self.zoom_label, self.fit_button]
        if not cpu:  # the CPU pool follows the GPU grid's colour mode: its own box only took its title's room
            colour_by = QLabel("colour by")
            top.addWidget(colour_by)
            top.addWidget(self.mode_box)
            self.top_widgets += [colour_by, self.mode_box]
        side = QWidget()
        side_lay = QVBoxLayout(side)
        side_lay.setContentsMargins(0, 0, 0, 0)
        side_lay.addWidget(self.overview, 0)
        legend_scroll = _LegendScroll(self.legend, self.overview)
        legend_scroll.setWidget(self.legend)
        legend_scroll.setWidgetResizable(True)
        legend_scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        legend_scroll.setFrameShape(QScrollArea.Shape.NoFrame)
        legend_scroll.setMinimumHeight(60)
        side_lay.addWidget(legend_scroll, 1)
        self.side = side
        self._fit_side()
        side.setVisible(legend or show_overview)
        self.legend_shown = legend
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

    def _fit_zoom_label(self) -> None:
        """The zoom label as wide as its widest text at the current text size."""
        fm = self.zoom_label.fontMetrics()
        self.zoom_label.setFixedWidth(max(fm.horizontalAdvance(t) for t in ("000 px/block", "00.0 blocks/px")) + 8)

    def changeEvent(self, ev) -> None:  # noqa: N802 - Qt's name
        super().changeEvent(ev)
        if ev.type() in (QEvent.Type.FontChange, QEvent.Type.StyleChange):  # a new text size
            self._fit_zoom_label()
            self._fit_side()

    def _fit_side(self) -> None:
        """The legend's column: 190 px at 1x text, wider with the text (at 1.5x its names were cut at the side)."""
        self.side.setFixedWidth(round(SIDE_PX * max(1.0, text_scale())))

    def set_compact(self, on: bool) -> None:
        """Presentation's grid: the whole pool in as many columns as make its cells largest in the view, with no
        title row, side panel or hover line (the page around it has its own legend and status)."""
        if on == self.compact:
            return
        self.compact = on
        for w in self.top_widgets:
            w.setVisible(not on)
        self.side.setVisible(not on and (self.legend_shown or self.show_overview))
        self.hover_label.setVisible(not on)
        self.columns = None
        self._key = None
        self.auto_fit = True
        self.fit_compact() if on else self.redraw(force=True)

    def _compact_columns(self) -> int:
        vb = self.plot.getViewBox()
        return columns_to_fill(self.num_cells(), vb.width(), vb.height())

    def fit_compact(self) -> None:
        """Compact: the columns for the view's size now, and the whole pool in view."""
        if not self.compact or self.snapshot is None:
            return
        if self._compact_columns() != self.columns:
            self.redraw(force=True)
        if self.grid is not None:
            self.fit_all()

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
    def set_title(self, text: str) -> None:
        """The line above the grid (the model, the pool's size, the block's bytes)."""
        self.title.setText(text)

    def flagged_as(self, b: int) -> str:
        """What the audit found wrong with block ``b`` (its own kind, else the legend's name for the red class)."""
        return self.flag_kinds.get(b) or self.flag_name or palette.STATES[BlockState.LEAKED].name

    def set_snapshot(
        self,
        snap: KVSnapshot,
        leaked: np.ndarray | None = None,
        flag_name: str | None = None,
        flag_kinds: dict[int, str] | None = None,
    ) -> None:
        """``leaked``: the blocks the audit flagged (red); ``flag_name``: what is wrong with them, for the legend;
        ``flag_kinds``: each flagged block's own problem (``AuditReport.block_kinds``), written on it."""
        self.snapshot, self.leaked, self.flag_name = snap, leaked, flag_name
        self.flag_kinds = flag_kinds or {}
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
        if self.compact:
            self.columns = self._compact_columns()
        grid = to_grid(codes, k, self.columns if self.compact else None)
        if self.grid is None or grid.shape != self.grid.shape:
            self.layer.prepareGeometryChange()  # before the layer's bounding rect changes (the scene's index)
        self.grid = grid
        self.image.setImage(self.grid, lut=lut, levels=(0, k + 1), autoLevels=False, autoDownsample=False)
        if self.show_overview:
            ov = self.grid
            if self.mode == "state" and not self.cpu and snap.reserved:  # the overview keeps the highest code of a
                ov = np.where(ov == BlockState.RESERVED, BlockState.FREE, ov)  # texel: a reserved block hides none
            self.overview.set_grid(ov, lut, "min" if self.mode == "age" else "max")
        self.legend.set_snapshot(snap, self.leaked, self.flag_name)
        self._draw_highlight()
        self._frame_view()
        self.layer.update()
        self.num_redraws += 1

    def set_highlight(self, block_ids: list[int], logical: bool = True, redraw: bool = True) -> None:
        """Outline these blocks; with ``logical`` they are a block table in its order: drawn as a path, each with
        its logical index as a badge (a block clicked on its own is no table's: it wears no "L0")."""
        block_ids = [int(b) for b in block_ids]
        index: dict[int, int] = {}
        for i, b in enumerate(block_ids if logical else ()):
            index.setdefault(b, i)
        if block_ids == self.highlight and index == self.logical_index:
            return  # the same outline: no redraw (the window sets it every step)
        self.highlight, self.logical_index = block_ids, index
        self._key = None
        if redraw:  # else the caller's next set_snapshot draws it (one redraw a step)
            self.redraw()

    def _highlight_style(self) -> None:
        """Small cells: a spotlight (the rest dimmed) and a path in logical order. Big cells (text): an outline and an
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
        # A spotlight: every other block dimmed, the selected ones in their own colours. (A white wash over them
        # made a used block pale green, which the fragmentation figure uses for "reserved, empty".)
        mask = np.zeros((rows * cols, 4), np.uint8)
        mask[:] = (0, 0, 0, 120)
        ids = np.array(self.highlight)
        ids = ids[(ids >= 0) & (ids < rows * cols)]
        mask[ids] = 0
        self.overlay.setImage(mask.reshape(rows, cols, 4), levels=(0, 255), autoLevels=False)
        if self.logical_index:  # a block table: its path in logical order
            self.path.setData(ids % cols + 0.5, ids // cols + 0.5)
        else:
            self.path.setData([], [])

    # -- view range and level of detail ------------------------------------------------------
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
        parts = [
            f"block {b}",
            palette.STATES[state].name,
            f"ref {int(s.ref_cnt[b])}",
            f"filled {int(s.filled[b])}/{s.block_size}",
        ]
        if b in self.leaked_set:
            parts.append(f"audit: {self.flagged_as(b)}")
        if s.num_groups > 1 and state is not BlockState.RESERVED:  # a hybrid model: which group holds it
            g = s.group_of(b)
            if g >= 0:
                parts.append(name_of(s.kv_groups, g))
        if s.pinned.get(b):
            parts.append(f"held by the KV connector ({s.pinned[b]} ref, no table: a pin for a transfer)")
        if owners:
            parts.append("owners " + ",".join(owners))
        if b in s.block_hashes:
            parts.append("hash " + s.block_hashes[b][:12])
        toks = self.block_tokens().of(b)
        if toks:
            text = self.decoder.join(toks)
            parts.append(repr(text)[:80])
        return " · ".join(parts)

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
