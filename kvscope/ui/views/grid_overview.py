"""The grid's overview: the whole pool downsampled into one small image, with the detail view's frame on it."""

from __future__ import annotations

import math

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPointF, QRectF, QSize, Qt, Signal
from PySide6.QtGui import QBrush, QColor, QPen
from PySide6.QtWidgets import QApplication, QGraphicsRectItem, QWidget

from kvscope.ui.views.grid_cells import OVERVIEW_TEXELS, downsample


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
