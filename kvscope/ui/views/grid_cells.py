"""The block grid's arithmetic, with no Qt: a state array into colour codes and a 2-D grid, the level of detail
for a zoom, downsampling for the overview (``block_grid`` draws what this computes; tests check it alone)."""

from __future__ import annotations

import enum
import math

import numpy as np

from engine.inspect.snapshot import BlockState, KVSnapshot
from kvscope.ui.palette import (
    AGE_COLOURS,
    BACKGROUND,
    OWNER_PALETTE,
    REF_COLOURS,
    STATE_COLOURS,
    age_codes,
    group_codes,
    group_lut_colours,
    state_codes,
)


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


def slot_layout(block_size: int) -> tuple[int, int]:
    """(rows, cols) of a block's slots drawn inside its cell (plus one header row above them)."""
    cols = 1 if block_size <= 8 else 2 if block_size <= 32 else 4
    return math.ceil(block_size / cols), cols


def slots_px(block_size: int) -> float:
    """Pixels per cell from which each block is drawn as its slots with their tokens."""
    rows, cols = slot_layout(block_size)
    return max(LABEL_PX * 1.5, SLOT_ROW_PX * (rows + 1), SLOT_MIN_WIDTH_PX * cols)


def level_for(px_per_cell: float, block_size: int) -> DetailLevel:
    # a zoom to a threshold comes back through the view's transform as 39.99999999999998 for 40: round first
    px_per_cell = round(px_per_cell, 6)
    if px_per_cell >= slots_px(block_size):
        return DetailLevel.SLOTS
    if px_per_cell >= LABEL_PX:
        return DetailLevel.LABELS
    if px_per_cell >= BORDER_PX:
        return DetailLevel.BORDERS
    return DetailLevel.CELLS


def grid_shape(n: int, cols: int | None = None) -> tuple[int, int]:
    """(rows, cols) of a grid holding n cells: ``cols`` columns, else near-square and wider than tall."""
    cols = max(1, cols if cols else math.ceil(math.sqrt(n)))
    return max(1, math.ceil(n / cols)), cols


def columns_to_fill(n: int, width: float, height: float) -> int:
    """The number of columns whose grid of ``n`` square cells has the largest cells inside width x height (a
    compact grid that shows the whole pool at once)."""
    if n <= 0 or width <= 0 or height <= 0:
        return max(1, math.ceil(math.sqrt(max(n, 1))))
    return max(range(1, n + 1), key=lambda c: (min(width / c, height / math.ceil(n / c)), -c))


def _lut(colours: list[tuple[int, int, int]]) -> np.ndarray:
    return np.array(colours + [BACKGROUND], dtype=np.uint8)


def state_lut() -> np.ndarray:
    """The state mode's lookup table: a ``BlockState`` code to its colour (code K: the padding)."""
    return _lut([STATE_COLOURS[s] for s in BlockState])


def codes_lut(states: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes, lut) of bare block states (a pool with no snapshot: the fleet window's)."""
    return states, state_lut()


def codes_for(snap: KVSnapshot, mode: str, leaked: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(codes uint8 [num_blocks], lut [K+1, 3]); code K is the padding colour."""
    if mode == "state":
        return state_codes(snap, leaked), state_lut()
    if mode == "owner":
        k = len(OWNER_PALETTE)
        codes = np.where(snap.owner < 0, 0, 1 + snap.owner % k).astype(np.uint8)
        return codes, _lut([STATE_COLOURS[BlockState.FREE]] + OWNER_PALETTE)
    if mode == "ref count":
        return np.minimum(snap.ref_cnt, len(REF_COLOURS) - 1).astype(np.uint8), _lut(REF_COLOURS)
    if mode == "age":
        return age_codes(snap.step - snap.last_access), _lut(AGE_COLOURS)
    if mode == "KV group":
        return group_codes(snap), _lut(group_lut_colours(snap.num_groups))
    raise ValueError(f"unknown colour mode {mode!r}")


def cpu_codes_for(snap: KVSnapshot, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """The CPU swap pool: free or swapped (coloured by owner in owner mode)."""
    if mode == "owner":
        k = len(OWNER_PALETTE)
        codes = np.where(snap.cpu_owner < 0, 0, 1 + snap.cpu_owner % k).astype(np.uint8)
        return codes, _lut([STATE_COLOURS[BlockState.FREE]] + OWNER_PALETTE)
    return snap.cpu_state.copy(), state_lut()


def to_grid(codes: np.ndarray, pad_code: int, cols: int | None = None) -> np.ndarray:
    rows, cols = grid_shape(len(codes), cols)
    grid = np.full(rows * cols, pad_code, dtype=np.uint8)
    grid[: len(codes)] = codes
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
