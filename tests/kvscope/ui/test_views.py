"""The views on their own (pytest-qt, offscreen), from real snapshots of the tiny engine."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PySide6.QtCore import QPointF, QSettings, Qt
from PySide6.QtWidgets import QWidget

from engine import LLMEngine, SamplingParams
from engine.inspect.events import BlockStored
from engine.inspect.snapshot import BlockState, assemble_snapshot
from kvscope.scenario import available, load_scenario
from kvscope.ui import palette
from kvscope.ui.qt_models import EventFilterProxy, EventLogModel, describe
from kvscope.ui.views.banner import Banner
from kvscope.ui.views.block_grid import BlockGridView
from kvscope.ui.views.event_log import EventLogView
from kvscope.ui.views.figure_view import FigureView
from kvscope.ui.views.grid_cells import (
    BORDER_PX,
    LABEL_PX,
    OVERVIEW_TEXELS,
    DetailLevel,
    codes_for,
    downsample,
    level_for,
    slots_px,
)
from kvscope.ui.views.inject_dialog import InjectDialog, parse_token_ids
from kvscope.ui.views.legend import LegendView
from kvscope.ui.views.plots import CURVES, PlotsPanel
from kvscope.ui.views.request_panel import BlockTableView, RequestPanel
from kvscope.ui.views.scenario_notes import ScenarioNotesPanel
from kvscope.ui.views.welcome import WelcomeView

WORDS = [
    "Four",
    " score",
    " and",
    " seven",
    " years",
    " ago",
    " our",
    " fathers",
    " brought",
    " forth",
    " on",
    " this",
    " continent",
    " a",
    " new",
    " nation",
]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def decode(ids):
    return "".join(WORDS[i % len(WORDS)] for i in ids)


def label(t: int) -> str:
    return WORDS[t % len(WORDS)].strip()


def engine(tiny_hf, **kw) -> LLMEngine:
    kw.setdefault("num_gpu_blocks", 32)
    kw.setdefault("block_size", 4)
    return LLMEngine.from_hf_model(tiny_hf, None, name="tiny-llama", **kw)


def run(eng: LLMEngine, steps: int):
    for _ in range(steps):
        eng.step()
    return eng.snapshot()


@pytest.fixture
def busy_snapshot(tiny_hf):
    """Shared prefix blocks (ref 4), private tails, and cached free blocks of finished requests."""
    eng = engine(tiny_hf, num_gpu_blocks=64)
    shared = list(range(10, 30))  # 5 full blocks of 4
    for i in range(4):
        eng.add_request(shared + [40 + i, 41 + i], GREEDY)
    eng.add_request([200, 201, 202, 203, 204, 205], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    return run(eng, 4)


_ALIVE: list[QWidget] = []  # strong references until the test's teardown (see ``alive``)


@pytest.fixture(autouse=True)
def alive():
    """pytest-qt holds test widgets weakly and paints them once more after the test: a widget kept only
    by its (pyqtgraph) reference cycles could then be collected by the GC in the middle of its own
    paint. The window owns its views; here this list does, until qtbot has closed them."""
    yield
    _ALIVE.clear()


def show(qtbot, w: QWidget, width: int, height: int) -> QWidget:
    _ALIVE.append(w)
    qtbot.addWidget(w)
    w.resize(width, height)
    w.show()
    qtbot.waitExposed(w)
    return w


# -- palette -----------------------------------------------------------------------------------


def is_red(rgb) -> bool:
    r, g, b = rgb
    return r > 180 and g < 110 and b < 110


def test_one_colour_per_meaning():
    shared = palette.STATE_COLOURS[BlockState.SHARED]
    assert palette.REF_COLOURS[2] == shared  # the grid's ref-count mode starts where state mode says shared
    assert palette.REF_COLOURS[1] == palette.STATE_COLOURS[BlockState.USED]
    assert palette.SERIES_COLOURS["used"] == palette.STATE_COLOURS[BlockState.USED]
    assert palette.SERIES_COLOURS["cached"] == palette.STATE_COLOURS[BlockState.CACHED]
    assert not any(is_red(c) for c in palette.REF_COLOURS)
    assert is_red(palette.STATE_COLOURS[BlockState.LEAKED])
    assert not any(is_red(c) for c in palette.OWNER_PALETTE)
    assert "free but still hashed" in palette.STATES[BlockState.CACHED].meaning


def test_block_table_cells_take_the_grids_state_colours(qtbot, busy_snapshot):
    """Used green, shared orange (any ref count above 1), audit-flagged red: the grid's state mode."""
    table = BlockTableView()
    qtbot.addWidget(table)
    r = next(r for r in busy_snapshot.requests if any(busy_snapshot.ref_cnt[b] > 1 for b in r.block_ids))
    flagged = {r.block_ids[-1]}
    table.show_table(busy_snapshot, r.block_ids, flagged)
    codes, lut = codes_for(busy_snapshot, "state", np.array(sorted(flagged), np.int64))
    for i, b in enumerate(r.block_ids):
        assert table.item(0, i).background().color().getRgb()[:3] == tuple(int(v) for v in lut[codes[b]])
    assert table.item(1, len(r.block_ids) - 1).background().color().getRgb()[:3] == palette.LEAKED
    assert palette.SHARED in table.colours.values()


# -- legend ---------------------------------------------------------------------------------------


def test_legend_classes_and_counts_equal_the_snapshot(qtbot, busy_snapshot):
    s = busy_snapshot
    assert (s.state == BlockState.CACHED).sum() > 0 and (s.state == BlockState.SHARED).sum() > 0
    leaked = np.array([int(np.flatnonzero(s.state == BlockState.USED)[0])])
    leg = show(qtbot, LegendView(), 220, 300)
    leg.set_snapshot(s, leaked)
    codes = codes_for(s, "state", leaked)[0]
    assert leg.counts() == {
        palette.STATES[st].name: int((codes == st).sum())
        for st in (BlockState.FREE, BlockState.CACHED, BlockState.USED, BlockState.SHARED, BlockState.LEAKED)
    }
    assert sum(leg.counts().values()) == s.num_blocks and leg.counts()["audit problem"] == 1
    leg.set_snapshot(s, leaked, "written while shared")  # the audit's kinds name the red class
    assert leg.counts()["written while shared"] == 1 and "audit problem" not in leg.counts()
    leg.set_mode("ref count")
    ref = np.minimum(s.ref_cnt, 4)
    assert list(leg.counts().values()) == [int((ref == k).sum()) for k in range(5)]
    leg.set_mode("owner")
    by_id = {r.request_id: r.index for r in s.requests}
    for name, count in leg.counts().items():
        if name == "no owner":
            assert count == int((s.owner < 0).sum())
        else:
            assert count == int((s.owner == by_id[name.removeprefix("request ")]).sum())
    leg.set_mode("age")
    age = s.step - s.last_access
    for (lo, hi), count in zip(palette.AGE_BINS, leg.counts().values()):
        assert count == int(((age >= lo) & (age <= (hi if hi is not None else 1 << 60))).sum())
    # the swatches are the grid's colours
    grid_lut = codes_for(s, "age")[1]
    assert [e.colours[0] for e in leg.entries] == [tuple(int(x) for x in c) for c in grid_lut[:-1]]


def test_legend_lists_the_biggest_owners_then_others(qtbot, tiny_hf):
    eng = engine(tiny_hf, num_gpu_blocks=128)
    for i in range(11):
        eng.add_request(list(range(1 + i, 2 + i + 4 * (i % 4 + 1))), GREEDY)
    s = run(eng, 1)
    leg = show(qtbot, LegendView(), 220, 400)
    leg.set_snapshot(s)
    leg.set_mode("owner")
    names = [e.name for e in leg.entries]
    assert names[0] == "no owner" and names[-1] == "others (3 requests)"
    counts = [e.count for e in leg.entries[1:-1]]
    assert counts == sorted(counts, reverse=True) and len(counts) == palette.MAX_OWNERS_LISTED
    assert sum(e.count for e in leg.entries) == s.num_blocks


def test_grid_embeds_a_legend_that_follows_the_mode(qtbot, busy_snapshot):
    grid = show(qtbot, BlockGridView("GPU"), 900, 600)
    grid.set_snapshot(busy_snapshot)
    assert grid.legend.isVisible() and grid.legend.mode == "state"
    grid.mode_box.setCurrentText("ref count")
    assert grid.legend.mode == "ref count"
    assert sum(grid.legend.counts().values()) == busy_snapshot.num_blocks


# -- block grid: level of detail --------------------------------------------------------------------


def test_zoom_levels_switch_detail_at_the_thresholds(qtbot, tiny_hf):
    eng = engine(tiny_hf, num_gpu_blocks=4096)
    eng.add_request(list(range(1, 30)), GREEDY)
    snap = run(eng, 2)
    grid = show(qtbot, BlockGridView("GPU"), 900, 620)
    grid.set_decode(decode)
    grid.set_snapshot(snap)
    centre = QPointF(3.5, 0.5)
    levels = [
        (BORDER_PX, DetailLevel.BORDERS),
        (LABEL_PX, DetailLevel.LABELS),
        (slots_px(snap.block_size), DetailLevel.SLOTS),
    ]
    assert grid.thresholds[DetailLevel.SLOTS] == slots_px(4) and BORDER_PX < LABEL_PX < slots_px(4)
    for px, level in levels:
        grid.zoom_to(px * 0.9, centre)
        assert grid.detail_level == level - 1, (px, grid.pixels_per_cell())
        grid.zoom_to(px * 1.1, centre)
        assert grid.detail_level == level, (px, grid.pixels_per_cell())
        grid.grab()  # paint
        r0, r1, c0, c1 = grid.visible_cells()
        visible = (r1 - r0) * (c1 - c0)
        if level >= DetailLevel.LABELS:  # text in every visible cell, and only there
            assert grid.layer.painted_cells == visible
            cols = grid.grid.shape[1]
            assert all(r0 <= b // cols < r1 and c0 <= b % cols < c1 for b in grid.layer.texts)
        else:
            assert grid.layer.painted_cells == 0
    # At the slot level each used block shows its tokens, slot by slot.
    req = snap.requests[0]
    grid.grab()
    b = req.block_ids[1]
    assert grid.layer.texts[b][2:] == [label(t) for t in req.token_ids[4:8]]
    grid.zoom_to(LABEL_PX * 1.2, centre)
    grid.grab()
    assert grid.layer.bars[req.block_ids[0]] == 4 and grid.layer.texts[req.block_ids[0]][:2] == [
        f"#{req.block_ids[0]}",
        "ref 1",
    ]
    grid.zoom_to(2.0)
    grid.grab()
    assert grid.detail_level == DetailLevel.CELLS and grid.layer.painted_cells == 0


def test_selected_blocks_get_their_logical_index_when_big(qtbot, tiny_hf):
    eng = engine(tiny_hf)
    eng.add_request(list(range(7)), GREEDY)
    eng.step()
    eng.add_request(list(range(20, 26)), GREEDY)
    snap = run(eng, 2)
    table = snap.block_tables["0"]
    grid = show(qtbot, BlockGridView("GPU"), 900, 600)
    grid.set_snapshot(snap)
    grid.set_highlight(list(table))
    grid.zoom_to(3.0, QPointF(3, 3))
    assert grid.overlay.isVisible() and grid.path.isVisible()  # small cells: a wash and a path
    grid.fit_used()
    grid.grab()
    assert grid.detail_level >= DetailLevel.LABELS
    assert not grid.overlay.isVisible() and not grid.path.isVisible()  # nothing over the tokens
    for i, b in enumerate(table):
        assert grid.layer.texts[b][-1] == f"L{i}"
    others = set(snap.block_tables["1"])
    assert all(not t[-1].startswith("L") for b, t in grid.layer.texts.items() if b in others)


def test_a_zoom_to_a_threshold_reaches_its_level_through_float_rounding():
    """The view's transform gives 39.99999999999998 back for a zoom to 40 px (under an application style
    sheet, as the window sets for its text size): that is still the labels' level."""
    assert level_for(LABEL_PX * (1 - 1e-15), 16) == DetailLevel.LABELS
    assert level_for(LABEL_PX * 0.99, 16) == DetailLevel.BORDERS


def test_text_is_bounded_however_big_the_pool(qtbot):
    n = 1_048_576
    ref = np.ones(n, np.int32)
    snap = assemble_snapshot(
        3,
        16,
        ref_cnt=ref,
        has_hash=np.zeros(n, bool),
        last_access=np.zeros(n, np.int64),
        free_queue=np.zeros(0, np.int32),
        requests=[],
        cached_tokens={},
        block_hashes={},
        counters={},
        num_cpu_blocks=0,
    )
    grid = show(qtbot, BlockGridView("GPU"), 1200, 800)
    grid.set_snapshot(snap)
    for px in (LABEL_PX, slots_px(16) * 1.05):
        grid.zoom_to(px, QPointF(512, 512))
        grid.grab()
        r0, r1, c0, c1 = grid.visible_cells()
        assert grid.layer.painted_cells == (r1 - r0) * (c1 - c0) < 1000


def test_a_pool_readable_whole_is_framed_whole(qtbot, tiny_hf):
    """24 blocks at labels' size fit a small panel: no row is cut off at the bottom (pool-exhaustion at 720p)."""
    eng = engine(tiny_hf, num_gpu_blocks=24)
    eng.add_request(list(range(1, 10)), GREEDY)
    grid = show(qtbot, BlockGridView("GPU"), 560, 330)
    grid.set_snapshot(run(eng, 1))
    grid.fit_used()
    qtbot.wait(20)
    rows, cols = grid.grid.shape
    assert grid.visible_cells() == (0, rows, 0, cols) and grid.pixels_per_cell() >= LABEL_PX


def test_opens_framed_on_the_blocks_in_use_and_keys_zoom_and_pan(qtbot, tiny_hf):
    eng = engine(tiny_hf, num_gpu_blocks=2912)  # the 2,912-block pool
    eng.add_request(list(range(1, 43)), GREEDY)  # 42 tokens: 11 blocks
    snap = run(eng, 1)
    grid = show(qtbot, BlockGridView("GPU"), 1000, 640)
    grid.set_snapshot(snap)
    used = np.flatnonzero(snap.state != BlockState.FREE)
    cols = grid.grid.shape[1]
    view = grid.plot.getViewBox().viewRect()
    for b in used:
        assert view.contains(QPointF(b % cols + 0.5, b // cols + 0.5))
    assert grid.detail_level >= DetailLevel.LABELS  # no longer a speck
    px = grid.pixels_per_cell()
    qtbot.keyClick(grid.plot, Qt.Key.Key_Minus)
    assert grid.pixels_per_cell() < px and not grid.auto_fit
    qtbot.keyClick(grid.plot, Qt.Key.Key_Plus)
    qtbot.keyClick(grid.plot, Qt.Key.Key_Plus)
    assert grid.pixels_per_cell() > px
    x0 = grid.plot.getViewBox().viewRect().center().x()
    qtbot.keyClick(grid.plot, Qt.Key.Key_Right)
    assert grid.plot.getViewBox().viewRect().center().x() > x0
    qtbot.keyClick(grid.plot, Qt.Key.Key_A)
    assert grid.detail_level <= DetailLevel.BORDERS  # the whole pool
    qtbot.keyClick(grid.plot, Qt.Key.Key_F)
    assert grid.auto_fit and abs(grid.pixels_per_cell() - px) < 0.5
    # While following, new blocks in use stay in view.
    for _ in range(12):
        eng.step()
    snap = eng.snapshot()
    grid.set_snapshot(snap)
    view = grid.plot.getViewBox().viewRect()
    assert all(view.contains(QPointF(b % cols + 0.5, b // cols + 0.5)) for b in snap.requests[0].block_ids)


def test_mouse_wheel_zooms_and_a_click_on_the_overview_jumps(qtbot, tiny_hf):
    from PySide6.QtCore import QPoint
    from PySide6.QtGui import QWheelEvent
    from PySide6.QtWidgets import QApplication

    eng = engine(tiny_hf, num_gpu_blocks=4096)
    eng.add_request(list(range(1, 30)), GREEDY)
    snap = run(eng, 1)
    grid = show(qtbot, BlockGridView("GPU"), 900, 600)
    grid.set_snapshot(snap)
    px = grid.pixels_per_cell()
    vp = grid.plot.viewport()
    centre = QPointF(vp.width() / 2, vp.height() / 2)
    ev = QWheelEvent(
        centre,
        vp.mapToGlobal(centre),
        QPoint(0, 0),
        QPoint(0, -240),
        Qt.MouseButton.NoButton,
        Qt.KeyboardModifier.NoModifier,
        Qt.ScrollPhase.NoScrollPhase,
        False,
    )
    QApplication.sendEvent(vp, ev)
    assert grid.pixels_per_cell() < px and not grid.auto_fit  # the user zoomed: stop following
    ov = grid.overview
    target = ov.getViewBox().mapViewToScene(QPointF(40, 50))
    qtbot.mouseClick(ov.viewport(), Qt.MouseButton.LeftButton, pos=ov.mapFromScene(target))
    c = grid.plot.getViewBox().viewRect().center()
    assert abs(c.x() - 40) < 1.5 and abs(c.y() - 50) < 1.5


def test_overview_keeps_a_single_leaked_block_and_jumps(qtbot):
    grid = np.zeros((1024, 1024), np.uint8)
    grid[777, 333] = BlockState.LEAKED
    grid[-4:, 1000:] = 6  # padding (a whole texel of it)
    grid[-1, 996] = 6  # padding beside a real block: the block wins
    small = downsample(grid, 4, 6)
    assert small.shape == (256, 256) and small[777 // 4, 333 // 4] == BlockState.LEAKED
    assert (small[-1, 250:] == 6).all() and small[-1, 249] == 0 and small[0, 0] == 0
    n = 1_048_576
    ref = np.zeros(n, np.int32)
    snap = assemble_snapshot(
        3,
        16,
        ref_cnt=ref,
        has_hash=np.zeros(n, bool),
        last_access=np.zeros(n, np.int64),
        free_queue=np.arange(n, dtype=np.int32),
        requests=[],
        cached_tokens={},
        block_hashes={},
        counters={},
        num_cpu_blocks=0,
    )
    view = show(qtbot, BlockGridView("GPU"), 1000, 640)
    view.set_snapshot(snap, leaked=np.array([777 * 1024 + 333]))
    img = view.overview.image.image
    assert max(img.shape) <= OVERVIEW_TEXELS and (img == BlockState.LEAKED).sum() == 1
    view.overview.jump_to.emit(600.0, 400.0)
    c = view.plot.getViewBox().viewRect().center()
    assert abs(c.x() - 600) < 1 and abs(c.y() - 400) < 1
    frame = view.overview.frame.rect()
    assert abs(frame.center().x() - 600) < 1


def test_clear_forgets_the_previous_session(qtbot, busy_snapshot):
    grid = show(qtbot, BlockGridView("GPU"), 800, 500)
    grid.set_snapshot(busy_snapshot)
    grid.set_highlight([0, 1])
    grid.hover_label.setText("block 0 · shared")
    grid.clear()
    assert grid.snapshot is None and grid.highlight == [] and grid.hover_label.text().strip() == ""
    assert grid.describe(0) == "" and grid.legend.entries == []


# -- figure view ---------------------------------------------------------------------------------------


def check_figure(fig: FigureView, snap, rids) -> None:
    cells = fig.cells()
    bs = snap.block_size
    assert set(cells["requests"]) == set(rids)
    arrows = []
    for rid in rids:
        r = snap.request(rid)
        got = cells["requests"][rid]
        want_table = [
            (i, b, max(0, min(bs, r.num_computed_tokens - i * bs)), int(snap.ref_cnt[b]))
            for i, b in enumerate(r.block_ids)
        ]
        assert got["table"] == want_table
        assert got["logical"] == [
            (i, [label(t) for t in r.token_ids[i * bs : min((i + 1) * bs, r.num_computed_tokens)]])
            for i in range(len(r.block_ids))
        ]
        if len(r.token_ids) > r.num_computed_tokens:
            i = r.num_computed_tokens
            assert got["pending"] == (i // bs, i % bs, label(r.token_ids[i]))
        arrows += [(rid, i, b) for i, b in enumerate(r.block_ids)]
        for i, b in enumerate(r.block_ids):  # the physical block holds the same tokens
            assert cells["physical"][b][: len(got["logical"][i][1])] == got["logical"][i][1]
    assert cells["arrows"] == arrows
    mapped = {b for rid in rids for b in snap.request(rid).block_ids}
    assert mapped <= set(cells["physical"])


def test_figure_one_request_as_in_figure_4(qtbot, tiny_hf):
    eng = engine(tiny_hf)
    eng.add_request(list(range(7)), GREEDY)  # "Four score and seven years ago our"
    fig = show(qtbot, FigureView(), 900, 420)
    fig.set_decode(decode)
    fig.set_requests(["0"])
    for _ in range(3):
        snap = run(eng, 1)
        fig.set_snapshot(snap)
        check_figure(fig, snap, ["0"])
    cells = fig.cells()["requests"]["0"]
    assert [row[2] for row in cells["table"]] == [4, 4, 1]  # after two decode steps: # filled 4, 4, 1
    assert cells["logical"][0][1] == ["Four", "score", "and", "seven"]
    assert cells["logical"][1][1][:3] == ["years", "ago", "our"]
    # neighbours of the mapped blocks are drawn too
    assert len(fig.cells()["physical"]) >= 8


def test_figure_two_requests_interleave_as_in_figure_5(qtbot, tiny_hf):
    eng = engine(tiny_hf)
    eng.add_request(list(range(7)), GREEDY)
    eng.step()
    eng.add_request([16 + 11, 16 + 12, 16 + 13, 16 + 14, 16 + 15, 16 + 4], GREEDY)
    snap = run(eng, 3)
    a, b = snap.request("0").block_ids, snap.request("1").block_ids
    assert min(b) < max(a)  # interleaved in the pool
    fig = show(qtbot, FigureView(), 1200, 420)
    fig.set_decode(decode)
    fig.set_snapshot(snap)
    fig.set_requests(["0", "1"])
    check_figure(fig, snap, ["0", "1"])
    assert "interleave" in fig.caption.text()


def test_figure_copy_on_write_as_in_figure_6(qtbot, tiny_hf):
    eng = engine(tiny_hf)
    eng.add_request(list(range(7)), SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=3, ignore_eos=True))
    fig = show(qtbot, FigureView(), 1200, 420)
    fig.set_decode(decode)
    eng.step()
    snap = eng.snapshot()
    rids = [r.request_id for r in snap.requests]
    assert len(rids) == 2 and snap.block_tables[rids[0]] == snap.block_tables[rids[1]]
    fig.set_snapshot(snap)
    fig.set_requests(rids)
    check_figure(fig, snap, rids)
    assert [row[3] for row in fig.cells()["requests"][rids[0]]["table"]] == [2, 2]  # shared, ref count 2
    out = eng.step()
    snap = eng.snapshot()
    cow = [e for e in out.events if e.kind == "cow"]
    assert len(cow) == 1
    fig.set_snapshot(snap)
    fig.set_events(out.events)
    check_figure(fig, snap, rids)
    t0, t1 = (fig.cells()["requests"][r]["table"] for r in rids)
    assert t0[0][1] == t1[0][1] and t0[0][3] == 2  # the full block stays shared
    assert t0[1][1] != t1[1][1] and t0[1][3] == t1[1][3] == 1  # the partial one was copied: tables diverge
    assert {t0[1][1], t1[1][1]} == {cow[0].src_block_id, cow[0].dst_block_id}
    assert f"got a copy, block {cow[0].dst_block_id}" in fig.caption.text()


def test_figure_without_a_selection_says_what_to_do(qtbot, busy_snapshot):
    fig = show(qtbot, FigureView(), 600, 300)
    fig.set_snapshot(busy_snapshot)
    fig.set_requests([])
    texts = [it.text() for it in fig.scene.items() if hasattr(it, "text")]
    assert any("Select a request" in t for t in texts)
    fig.set_requests(["4"])  # finished: its blocks went back
    assert fig.cells()["requests"]["4"]["table"] == []


# -- small sizes -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: BlockGridView("GPU"),
        lambda: BlockGridView("CPU", cpu=True),
        LegendView,
        FigureView,
        EventLogView,
        PlotsPanel,
        RequestPanel,
        Banner,
        ScenarioNotesPanel,
        WelcomeView,
    ],
)
def test_each_view_can_be_small(qtbot, make):
    w = make()
    qtbot.addWidget(w)
    hint = w.minimumSizeHint()
    assert hint.width() <= 400 and hint.height() <= 240, (type(w).__name__, hint)


def test_event_log_kind_filter_does_not_widen_the_window(qtbot):
    log = EventLogView()
    qtbot.addWidget(log)
    assert log.minimumSizeHint().width() < 300  # 15 checkboxes in a row needed 1,376 px
    log.kind_boxes["hit"].setChecked(True)
    assert log.proxy.kinds == {"hit"} and "hit" in log.kinds_button.text()


# -- banner ---------------------------------------------------------------------------------------------------


def test_banner_closes_and_clears(qtbot):
    parent = show(qtbot, QWidget(), 600, 100)
    ban = Banner(parent)
    assert not ban.isVisible()
    ban.show_message("could not load the model: nope")
    assert ban.isVisible() and "could not load the model" in ban.text()
    with qtbot.waitSignal(ban.closed):
        qtbot.mouseClick(ban.close_button, Qt.MouseButton.LeftButton)
    assert not ban.isVisible()
    ban.show_message("audit: 2 block(s) with wrong ref counts", "audit")
    ban.clear()
    assert not ban.isVisible() and ban.text() == ""
    ban.setText("⚠ drop-in for the old QLabel")
    ban.show()
    assert ban.isVisible() and ban.text().startswith("⚠")


# -- inject dialog ----------------------------------------------------------------------------------------------


@pytest.fixture
def settings(tmp_path):
    return QSettings(str(tmp_path / "kvscope.ini"), QSettings.Format.IniFormat)


def test_an_edited_preset_is_what_is_injected(qtbot, settings):
    dlg = InjectDialog(None, settings)
    qtbot.addWidget(dlg)
    dlg.preset.setCurrentText("four score (PagedAttention paper)")
    assert [s.prompt for s in dlg.specs()] == ["Four score and seven years ago our"]
    dlg.prompt.setPlainText("Four score and seven years ago our fathers")
    assert [s.prompt for s in dlg.specs()] == ["Four score and seven years ago our fathers"]
    assert dlg.preset.currentText() == "(custom)"
    dlg.preset.setCurrentText("chat: capital of France")
    dlg.prompt.setPlainText("What is the capital of Italy?")
    assert [s.prompt for s in dlg.specs()] == [[{"role": "user", "content": "What is the capital of Italy?"}]]


def test_token_ids_for_a_model_without_a_tokenizer(qtbot, settings):
    dlg = InjectDialog(None, settings, has_tokenizer=False, vocab_size=256)
    qtbot.addWidget(dlg)
    assert dlg.as_ids.isChecked() and not dlg.no_tokenizer.isHidden() and "no tokenizer" in dlg.no_tokenizer.text()
    dlg.prompt.setPlainText("1, 5 9,\n12")
    dlg.copies.setValue(2)
    assert [s.prompt for s in dlg.specs()] == [[1, 5, 9, 12], [1, 5, 9, 12]]
    dlg.prompt.setPlainText("1, x, 3")
    with pytest.raises(ValueError, match="'x' is not a token id"):
        dlg.specs()
    dlg.prompt.setPlainText("1, 300")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        dlg.specs()
    with pytest.raises(ValueError, match="no token ids"):
        parse_token_ids("  ")
    with_tok = InjectDialog(None, settings)
    qtbot.addWidget(with_tok)
    assert not with_tok.as_ids.isChecked() and with_tok.no_tokenizer.isHidden()
    with_tok.as_ids.setChecked(True)
    with_tok.prompt.setPlainText("7 8 9")
    assert with_tok.specs()[0].prompt == [7, 8, 9] and not with_tok.as_chat.isEnabled()


def test_token_ids_from_the_dialog_run_on_the_engine(qtbot, tiny_hf, settings):
    dlg = InjectDialog(None, settings, has_tokenizer=False, vocab_size=256)
    qtbot.addWidget(dlg)
    dlg.prompt.setPlainText("3 1 4 1 5")
    eng = engine(tiny_hf)
    for spec in dlg.specs():
        eng.add_request(spec.prompt, spec.params)
    eng.step()
    assert eng.snapshot().requests[0].token_ids[:5] == (3, 1, 4, 1, 5)


# -- event log, plots ---------------------------------------------------------------------------------------------


def test_event_log_max_step_and_token_text(qtbot):
    log = EventLogView()
    qtbot.addWidget(log)
    model = EventLogModel()
    proxy = EventFilterProxy()
    proxy.setSourceModel(model)
    ev = BlockStored(3, "ab" * 16, "0", (0, 1, 2, 3))
    model.append(1, [ev])
    model.append(2, [ev, ev])
    model.append(5, [ev])
    proxy.set_max_step(2)
    assert proxy.rowCount() == 3
    proxy.set_max_step(None)
    assert proxy.rowCount() == 4
    assert "'Four score and seven'" not in describe(ev)
    assert "token_ids=(0, 1, 2, 3) 'Four score and seven'" in describe(ev, decode)
    model.set_decode(decode)
    assert "'Four score and seven'" in model.index(0, 2).data()
    log.set_decode(decode)
    log.append(1, [ev])
    log.append(3, [ev])
    log.set_max_step(1)
    assert len(log.visible_events()) == 1 and "up to step 1" in log.step_label.text()
    assert "'Four score and seven'" in log.model.index(0, 2).data()


def test_plots_cursor_on_every_plot(qtbot):
    from kvscope.history import RunHistory

    plots = show(qtbot, PlotsPanel(), 700, 500)
    h = RunHistory()
    plots.update_from(h)  # an empty history, and series the history does not record, draw nothing
    plots.set_cursor(3)
    assert len(plots.cursors) == len(plots.plots) == len(CURVES)
    assert all(c.isVisible() and c.value() == 3 for c in plots.cursors)
    plots.set_cursor(None)
    assert not any(c.isVisible() for c in plots.cursors)


# -- scenarios, notes, welcome ----------------------------------------------------------------------------------------


def test_every_scenario_has_what_to_watch_and_step_notes():
    for name in available():
        sc = load_scenario(name)
        assert sc.watch and len(sc.notes) >= 3, name
        steps = [a for a, _ in sc.notes]
        assert steps == sorted(steps) and all(isinstance(t, str) and t for _, t in sc.notes)
    fs = load_scenario("four-score")
    assert fs.config["block_size"] == 4 and fs.requests[0]["prompt"] == "Four score and seven years ago our"
    assert fs.requests[1]["prompt"] == "It was the best of times"


@pytest.mark.parametrize(
    "notes, match",
    [
        ("x", "'notes' must be a list"),
        ([{"at": -1, "text": "t"}], r"notes\[0\]"),
        ([{"at": 1}], r"notes\[0\]"),
        ([{"at": "2", "text": "t"}], r"notes\[0\]"),
        ([{"at": 1, "text": "ok"}, 3], r"notes\[1\]"),
    ],
)
def test_malformed_notes_are_a_clear_error(tmp_path, notes, match):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps({"requests": [], "notes": notes}))
    with pytest.raises(ValueError, match=match):
        load_scenario(str(p))


def test_notes_panel_follows_the_step(qtbot):
    panel = show(qtbot, ScenarioNotesPanel(), 320, 400)
    sc = load_scenario("four-score")
    panel.set_scenario(sc.watch, sc.notes, sc.title)
    assert sc.watch in panel.watch_label.text()
    panel.set_step(0)
    assert panel.current_note() == sc.notes[0]
    for step in range(0, 12):
        panel.set_step(step)
        want = [n for n in sc.notes if n[0] <= step][-1]
        assert panel.current_note() == want and panel.now.text() == want[1]
    panel.set_scenario("", [])
    panel.set_step(3)
    assert panel.current_note() is None and panel.now.isHidden()


def test_a_short_notes_panel_cuts_no_line_and_shows_the_steps_note_first(qtbot):
    """At 1280x720 the panel is ~300 px high: the longest scenario text and note are never cut."""
    panel = show(qtbot, ScenarioNotesPanel(), 330, 300)
    sc = load_scenario("lab-caching-changes-output")
    panel.set_scenario(sc.watch, sc.notes, sc.title)
    for step in (0, sc.notes[-1][0]):
        panel.set_step(step)
        qtbot.wait(20)
        assert panel.clipped() == []
        top = panel.now.mapTo(panel.scroll.widget(), panel.now.rect().topLeft()).y()
        assert top < panel.watch_label.mapTo(panel.scroll.widget(), panel.watch_label.rect().topLeft()).y()
        assert top + panel.now.height() <= panel.scroll.viewport().height()  # the note whole, without scrolling


def test_welcome_lists_the_scenarios_and_emits(qtbot):
    w = show(qtbot, WelcomeView(), 900, 600)
    assert set(w.buttons) == set(available())
    with qtbot.waitSignal(w.scenario_chosen) as sig:
        qtbot.mouseClick(w.buttons["four-score"], Qt.MouseButton.LeftButton)
    assert sig.args == ["four-score"]
    with qtbot.waitSignal(w.inject_requested):
        qtbot.mouseClick(w.inject_button, Qt.MouseButton.LeftButton)
    from kvscope.ui.views.welcome import SHORTCUTS

    keys = " ".join(k for k, _ in SHORTCUTS)
    for key in ("F10", "F5", "Ctrl+I", "Del", "Ctrl+F", "Home"):
        assert key in keys


def test_welcome_gives_each_scenario_a_whole_first_sentence():
    """A lab's line is its question, not the label before it ("Question:" alone, as it was)."""
    from kvscope.ui.views.welcome import first_sentence, scenario_lines

    lines = {name: line for name, _, line in scenario_lines()}
    assert lines["lab-caching-changes-output"].startswith("Question: why does the second chat answer")
    assert lines["lab-caching-changes-output"].endswith("?")
    for name, line in lines.items():
        assert len(line) > 20 and line.rstrip(":") == line, name
    assert first_sentence("A bug is on: aborting forgets to free. More.") == "A bug is on: aborting forgets to free."
    assert first_sentence("Label: " + "x" * 200) == "Label:"


# -- style ----------------------------------------------------------------------------------------------------


def test_disabled_controls_look_disabled(qtbot):
    from PySide6.QtWidgets import QApplication, QToolButton

    from kvscope.ui.style import apply_style

    apply_style(QApplication.instance())
    try:
        buttons = []
        for enabled in (True, False):
            b = QToolButton()
            b.setText("Step")
            b.setEnabled(enabled)
            show(qtbot, b, 80, 28)
            buttons.append(b.grab().toImage())
        brightest = [
            max(QColor_lightness(img.pixel(x, y)) for x in range(img.width()) for y in range(img.height()))
            for img in buttons
        ]
        assert brightest[1] < brightest[0] - 60, brightest
    finally:
        QApplication.instance().setStyleSheet("")


def QColor_lightness(argb: int) -> int:  # noqa: N802
    from PySide6.QtGui import QColor

    return QColor.fromRgb(argb).lightness()


def test_the_plots_panel_scrolls_a_named_plot_into_view(qtbot):
    plots = show(qtbot, PlotsPanel(), 900, 200)  # one row of plots fits: the panel scrolls
    bar = plots.scroll.verticalScrollBar()
    assert bar.maximum() > 0 and bar.value() == 0
    plots.show_series("ttft")  # the second row
    low = bar.value()
    assert low > 0
    plots.show_series("hit_rate")  # back up to the first
    assert bar.value() < low
