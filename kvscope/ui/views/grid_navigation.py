"""The grid's navigation: zoom, pan, fit, keys, and which detail the zoom shows. A mixin of ``BlockGridView``
(it reads the view's plot, image size and block size), kept apart from what the view draws."""

from __future__ import annotations

import math

import numpy as np
from PySide6.QtCore import QPointF, QRectF, Qt, QTimer

from engine.inspect.snapshot import BlockState
from kvscope.ui.views.grid_cells import (
    BORDER_PX,
    LABEL_PX,
    MAX_TEXT_CELLS,
    MIN_FIT_CELLS,
    DetailLevel,
    level_for,
    slots_px,
)


class GridNavigation:
    def _frame_view(self) -> None:
        shape = self.grid.shape
        vb = self.plot.getViewBox()
        rows, cols = shape
        span = max(rows, cols)
        vb.setLimits(
            minXRange=1.0,
            minYRange=1.0,
            maxXRange=4 * span + 4,
            maxYRange=4 * span + 4,
            xMin=-span - 1,
            xMax=cols + span + 1,
            yMin=-span - 1,
            yMax=rows + span + 1,
        )
        if self.compact:  # presentation: the whole pool, always
            self._shape = shape
            self.fit_all()
        elif shape != self._shape:  # a new pool: open framed on the blocks in use
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
        vb = self.plot.getViewBox()
        if vb.width() > 0 and min(vb.width() / cols, vb.height() / rows) >= LABEL_PX:
            return QRectF(0, 0, cols, rows)  # the whole pool is readable at once: frame it all (nothing cut off)
        state = s.cpu_state if self.cpu else s.state
        mask = np.zeros(rows * cols, bool)
        mask[: len(state)] = state != BlockState.FREE
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
        return {
            DetailLevel.CELLS: 0.0,
            DetailLevel.BORDERS: BORDER_PX,
            DetailLevel.LABELS: LABEL_PX,
            DetailLevel.SLOTS: slots_px(bs),
        }

    def zoom_to(self, px_per_cell: float, centre: QPointF | None = None) -> None:
        """Set the zoom so that one cell is ``px_per_cell`` pixels wide (centred on ``centre``, grid units)."""
        vb = self.plot.getViewBox()
        if centre is None:
            centre = vb.viewRect().center()
        w, h = vb.width() / px_per_cell, vb.height() / px_per_cell
        vb.setRange(
            xRange=(centre.x() - w / 2, centre.x() + w / 2), yRange=(centre.y() - h / 2, centre.y() + h / 2), padding=0
        )

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
        return (
            max(0, math.floor(r.top())),
            min(rows, math.ceil(r.bottom())),
            max(0, math.floor(r.left())),
            min(cols, math.ceil(r.right())),
        )

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
        names = {
            DetailLevel.CELLS: "cells",
            DetailLevel.BORDERS: "borders",
            DetailLevel.LABELS: "ids, ref, fill",
            DetailLevel.SLOTS: "slots + tokens",
        }
        # the zoom in a few characters (a fixed width: it changes as the view zooms), what it shows in its tooltip
        self.zoom_label.setText(f"{px:.0f} px/block" if px >= 1 else f"{1 / px:.1f} blocks/px" if px > 0 else "")
        self.zoom_label.setToolTip(f"at this zoom the grid shows {names[level]}")
        self.overview.set_frame(self.plot.getViewBox().viewRect())
        self._highlight_style()
        self.layer.update()

    def _on_resized(self, *_) -> None:
        if self.compact:
            self.fit_compact()
        elif self.grid is not None and self.auto_fit:
            self.fit_used()
        self._on_range()
