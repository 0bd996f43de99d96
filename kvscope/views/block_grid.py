"""The physical block grid: one pixel-cell per block, an ImageItem over a uint8 code array and a LUT.

A million blocks redraw in milliseconds this way (100 k QGraphicsRectItems take
over 100 ms). Colour modes: state, owning request, ref count, age.
"""
from __future__ import annotations

import math

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPointF, Qt, Signal
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QToolTip, QVBoxLayout, QWidget

from engine.inspect.snapshot import BlockState, KVSnapshot

STATE_COLOURS = {  # BlockState -> RGB
    BlockState.FREE: (48, 52, 60),
    BlockState.CACHED: (66, 133, 244),
    BlockState.USED: (52, 168, 83),
    BlockState.SHARED: (251, 140, 0),
    BlockState.SWAPPED: (156, 39, 176),
    BlockState.LEAKED: (229, 57, 53),
}
BACKGROUND = (20, 22, 26)  # padding cells after the last block
OWNER_PALETTE = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
                 (227, 119, 194), (188, 189, 34), (23, 190, 207), (174, 199, 232), (255, 187, 120), (152, 223, 138)]
REF_COLOURS = [(48, 52, 60), (52, 168, 83), (251, 192, 45), (251, 140, 0), (229, 57, 53)]  # 0,1,2,3,4+
AGE_LEVELS = 16
MODES = ("state", "owner", "ref count", "age")


def grid_shape(n: int) -> tuple[int, int]:
    """(rows, cols) of a near-square grid holding n cells, wider than tall."""
    cols = max(1, math.ceil(math.sqrt(n)))
    return math.ceil(n / cols), cols


def _lut(colours: list[tuple[int, int, int]]) -> np.ndarray:
    return np.array(colours + [BACKGROUND], dtype=np.uint8)


def codes_for(snap: KVSnapshot, mode: str, leaked: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(codes uint8 [num_blocks], lut [K+1, 3]); code K is the padding colour."""
    if mode == "state":
        codes = snap.state.copy()
        if leaked is not None and len(leaked):
            codes[leaked] = BlockState.LEAKED
        return codes, _lut([STATE_COLOURS[s] for s in BlockState])
    if mode == "owner":
        k = len(OWNER_PALETTE)
        codes = np.where(snap.owner < 0, 0, 1 + snap.owner % k).astype(np.uint8)
        return codes, _lut([STATE_COLOURS[BlockState.FREE]] + OWNER_PALETTE)
    if mode == "ref count":
        return np.minimum(snap.ref_cnt, 4).astype(np.uint8), _lut(REF_COLOURS)
    if mode == "age":
        age = np.clip(snap.step - snap.last_access, 0, AGE_LEVELS - 1).astype(np.uint8)
        ramp = [(int(255 - 200 * i / (AGE_LEVELS - 1)), int(220 - 170 * i / (AGE_LEVELS - 1)), 60)
                for i in range(AGE_LEVELS)]
        return age, _lut(ramp)
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


class BlockGridView(QWidget):
    block_clicked = Signal(int)
    block_hovered = Signal(int)

    def __init__(self, title: str = "GPU blocks", parent: QWidget | None = None, cpu: bool = False) -> None:
        super().__init__(parent)
        self.cpu = cpu  # draw the CPU swap pool of the snapshot instead of the device pool
        self.snapshot: KVSnapshot | None = None
        self.leaked: np.ndarray | None = None
        self.mode = "state"
        self.highlight: list[int] = []
        self.grid: np.ndarray | None = None
        self.num_redraws = 0
        self._key = None
        self.token_text = None  # callable(token_ids) -> str, set by the window when a tokenizer exists

        self.title = QLabel(title)
        self.mode_box = QComboBox()
        self.mode_box.addItems(MODES)
        self.mode_box.currentTextChanged.connect(self.set_mode)
        self.hover_label = QLabel(" ")
        self.hover_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.plot = pg.PlotWidget()
        self.plot.setAspectLocked(True)
        self.plot.invertY(True)
        self.plot.hideAxis("left")
        self.plot.hideAxis("bottom")
        self.plot.setMenuEnabled(False)
        self.image = pg.ImageItem(axisOrder="row-major")
        self.plot.addItem(self.image)
        self.overlay = pg.ImageItem(axisOrder="row-major")
        self.overlay.setZValue(5)
        self.plot.addItem(self.overlay)
        self.path = pg.PlotDataItem(pen=pg.mkPen((255, 255, 255, 200), width=2), symbol="o", symbolSize=5,
                                    symbolBrush=(255, 255, 255))
        self.path.setZValue(10)
        self.plot.addItem(self.path)
        self.plot.scene().sigMouseMoved.connect(self._on_move)
        self.plot.scene().sigMouseClicked.connect(self._on_click)

        top = QHBoxLayout()
        top.addWidget(self.title)
        top.addStretch(1)
        top.addWidget(QLabel("colour by"))
        top.addWidget(self.mode_box)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(2, 2, 2, 2)
        lay.addLayout(top)
        lay.addWidget(self.plot, 1)
        lay.addWidget(self.hover_label)

    # -- data --------------------------------------------------------------------------
    def set_snapshot(self, snap: KVSnapshot, leaked: np.ndarray | None = None) -> None:
        self.snapshot, self.leaked = snap, leaked
        self.redraw()

    def set_mode(self, mode: str) -> None:
        self.mode = mode
        if self.mode_box.currentText() != mode:
            self.mode_box.setCurrentText(mode)
        self.redraw()

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
        self.grid = to_grid(codes, k)
        self.image.setImage(self.grid, lut=lut, levels=(0, k + 1), autoLevels=False, autoDownsample=False)
        self._draw_highlight()
        self.num_redraws += 1

    def set_highlight(self, block_ids: list[int]) -> None:
        """Outline these blocks; their order (a block table's logical order) is drawn as a path."""
        self.highlight = list(block_ids)
        self._key = None
        self.redraw()

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
        n = len(self.snapshot.cpu_state) if self.cpu else self.snapshot.num_blocks
        return b if b < n else -1

    def describe(self, b: int) -> str:
        s = self.snapshot
        if s is not None and self.cpu:
            owner = [r.request_id for r in s.requests if b in r.cpu_block_ids]
            return f"CPU block {b} · " + (f"swapped out by request {owner[0]}" if owner else "free")
        if s is None or not 0 <= b < s.num_blocks:
            return ""
        owners = s.owners_of(b)
        parts = [f"block {b}", BlockState(int(s.state[b])).name.lower(), f"ref {int(s.ref_cnt[b])}",
                 f"filled {int(s.filled[b])}/{s.block_size}"]
        if self.leaked is not None and b in set(self.leaked.tolist()):
            parts.append("LEAKED")
        if owners:
            parts.append("owners " + ",".join(owners))
        if b in s.block_hashes:
            parts.append("hash " + s.block_hashes[b][:12])
        toks = self._tokens_of(b)
        if toks:
            text = self.token_text(toks) if self.token_text else " ".join(map(str, toks))
            parts.append(repr(text)[:80])
        return " · ".join(parts)

    def _tokens_of(self, b: int) -> tuple[int, ...]:
        s = self.snapshot
        if b in s.cached_tokens:
            return s.cached_tokens[b]
        for r in s.requests:
            if b in r.block_ids:
                i = r.block_ids.index(b)
                return r.token_ids[i * s.block_size:min((i + 1) * s.block_size, r.num_computed_tokens)]
        return ()

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
