"""The window explains what it shows (issue 14): first screen, fit on 1280x720, the timeline moves every view,
banners close and clear, nothing of a previous session shows, a model without a tokenizer takes token ids."""

from __future__ import annotations

import pytest

from engine import LLMEngine, SamplingParams
from kvscope.cli import main
from kvscope.sources.base import InjectSpec
from kvscope.sources.live import LiveSource

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture
def window(open_window, tiny_hf):
    """Windows on the tiny Llama, on a thread."""

    def make(**kw):
        kw.setdefault("num_gpu_blocks", 32)
        kw.setdefault("block_size", 4)
        return open_window(lambda _s: LiveSource(LLMEngine.from_hf_model(tiny_hf, None, name="tiny", **kw)))

    return make


def run(qtbot, win, prompts, steps):
    before = len(win.latest.snapshot.requests)
    win.inject([InjectSpec(p, GREEDY) for p in prompts])
    qtbot.waitUntil(lambda: len(win.latest.snapshot.requests) == before + len(prompts), timeout=10_000)
    target = win.latest.step + steps
    win.step(steps)
    qtbot.waitUntil(lambda: win.latest.step >= target, timeout=20_000)
    win.flush()


def test_the_first_screen_says_what_to_do_and_leaves_with_the_first_request(qtbot, window):
    win = window()
    assert win.welcome.isVisible()
    assert {"four-score", "parallel-sampling", "leak-hunt"} <= set(win.welcome.buttons)
    run(qtbot, win, [[1, 2, 3, 4, 5]], 2)
    assert not win.welcome.isVisible() and win.grid.isVisible()


def test_the_window_fits_a_1280x720_screen_with_every_panel_reachable(qtbot, window):
    win = window()
    hint = win.minimumSizeHint()
    assert hint.width() <= 1280 and hint.height() <= 720, hint
    win.resize(1280, 720)
    qtbot.wait(50)
    assert win.width() <= 1280 and win.height() <= 720
    for name, dock in win.docks.items():
        assert dock.toggleViewAction().isEnabled(), name  # each panel can be shown from the View menu
    visible = [d for d in win.docks.values() if d.isVisible() and not win.tabifiedDockWidgets(d)]
    assert all(d.width() > 100 and d.height() > 80 for d in visible)


def test_the_timeline_moves_every_view(qtbot, window):
    win = window()
    run(qtbot, win, [list(range(10, 30)), list(range(10, 24))], 6)
    steps = win.history.steps
    pos = 2
    win.timeline.setValue(pos)
    step = steps[pos]
    then = win.history.at(step)
    assert win.grid.snapshot.step == step and win.requests.snapshot.step == step
    assert win.figure.snapshot.step == step
    assert f"looking back: step {step}" in win.status_label.text()
    assert all(s <= step for s in (win.events.proxy.index(r, 0).data() for r in range(win.events.proxy.rowCount())))
    assert win.plots.cursor_step == step
    assert [r.request_id for r in win.requests.model.rows] == [r.request_id for r in then.requests]
    win.follow_live()
    assert win.grid.snapshot is win.latest.snapshot and win.plots.cursor_step is None
    assert "looking back" not in win.status_label.text()


def test_an_error_banner_can_be_closed_and_clears_when_the_next_action_succeeds(qtbot, window):
    win = window()
    win.fork_selected()  # nothing selected: refused with a message
    assert win.banner.isVisible() and "fork" in win.banner.text()
    win.banner.close_button.click()
    assert not win.banner.isVisible()
    win.fork_selected()
    assert win.banner.isVisible()
    run(qtbot, win, [[3, 4, 5]], 1)
    assert not win.banner.isVisible()


def test_nothing_of_the_previous_session_shows_after_a_load(qtbot, window):
    win = window()
    run(qtbot, win, [list(range(10, 30))], 2)
    win.requests.select(["0"])
    assert win.grid.highlight and win.figure.request_ids == ["0"]
    win.load_scenario("")
    qtbot.waitUntil(
        lambda: win.info is not None and win.latest is not None and not win.latest.snapshot.requests, timeout=20_000
    )
    win.flush()
    assert not win.grid.highlight and win.figure.request_ids == [] and win.grid.hover_label.text().strip() == ""
    assert win.requests.model.rows == []


def test_a_model_without_a_tokenizer_says_so_and_takes_token_ids(qtbot, window, capsys, tiny_dir):
    win = window()
    assert not win.info.has_tokenizer and "no tokenizer" in win.grid.title.text()
    assert (
        main(
            [
                "--headless",
                "--json",
                "--model",
                tiny_dir,
                "--num-gpu-blocks",
                "16",
                "--block-size",
                "4",
                "--inject-ids",
                "1,5,9",
                "--max-tokens",
                "3",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert '"prompt_tokens": 3' in out and '"output_tokens": 3' in out
    with pytest.raises(SystemExit) as bad:  # argparse refuses it: one line, exit 2
        main(["--headless", "--model", tiny_dir, "--inject-ids", "1,x"])
    assert bad.value.code == 2 and "token ids must be integers" in capsys.readouterr().err


def test_a_screenshot_selects_the_requests_of_select_and_refuses_unknown_ids(qtbot, window):
    from kvscope.ui.app import StartupDriver

    win = window()
    run(qtbot, win, [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17]], 2)
    ids = [r.request_id for r in win.requests.model.rows]
    assert StartupDriver(win, None, 0, [], 8, select=[ids[0], ids[1]]).select_for_shot() == ids[:2]
    with pytest.raises(ValueError, match="--select nope: no such request"):  # a picture of something else: no
        StartupDriver(win, None, 0, [], 8, select=[ids[0], "nope"]).select_for_shot()
    win.unpin()
    # none asked: the screenshot selects nothing of its own; what the window follows shows (the newest running)
    newest = max((r for r in win.requests.model.rows if r.status == "RUNNING"), key=lambda r: r.index).request_id
    assert StartupDriver(win, None, 0, [], 8, select=[]).select_for_shot() == [newest]
    assert win.figure.request_ids == [newest] and "newest running" in win.figure.why


def test_at_1280x720_the_figure_text_the_legend_and_the_cached_column_are_readable(qtbot, window):
    """A projector at 1280x720: the paper figure's smallest text at least 10 px, every legend row inside
    the legend's view without scrolling, and the request table's `cached` column inside its viewport."""
    from PySide6.QtCore import QPoint

    from kvscope.ui.views.figure_view import MIN_TEXT_PX

    win = window()
    win.resize(1280, 720)
    run(qtbot, win, [list(range(1, 30)), list(range(1, 20)) + [99, 98]], 3)
    win.requests.select([win.latest.snapshot.requests[0].request_id])
    win.docks["figure"].raise_()
    qtbot.wait(100)
    win.flush()
    assert win.figure.request_ids, "the figure draws the selected request"
    assert win.figure.min_text_px() >= MIN_TEXT_PX >= 10
    legend = win.grid.legend
    scroll = legend.parentWidget().parentWidget()  # the scroll area's viewport, then the area
    shown = [w for row in legend._widgets for w in row[1:2] if w.isVisible()]
    assert len(shown) == len(legend.entries) == 5  # free, cached, used, shared, audit problem
    view = scroll.viewport().rect()
    for name in shown:
        top_left = name.mapTo(scroll.viewport(), QPoint(0, 0))
        assert view.contains(top_left) and view.contains(top_left + QPoint(0, name.height() - 1)), name.text()
    table = win.requests.table
    col = win.requests.model.HEADERS.index("cached")
    right = table.columnViewportPosition(col) + table.columnWidth(col)
    assert table.columnViewportPosition(col) >= 0 and right <= table.viewport().width()


def test_at_1280x720_and_a_larger_text_size_the_cached_column_still_shows(qtbot, window):
    from PySide6.QtWidgets import QApplication

    from kvscope.ui.style import set_text_scale

    win = window()
    win.resize(1280, 720)
    run(qtbot, win, [list(range(1, 30))], 2)
    try:
        set_text_scale(QApplication.instance(), 1.5)
        qtbot.wait(100)
        table = win.requests.table
        col = win.requests.model.HEADERS.index("cached")
        assert table.columnWidth(col) > table.fontMetrics().horizontalAdvance("cached")
        assert table.columnViewportPosition(col) + table.columnWidth(col) <= table.viewport().width()
    finally:
        set_text_scale(QApplication.instance(), 1.0)


def test_at_1280x720_the_block_table_shows_both_rows(qtbot, window):
    win = window()
    win.resize(1280, 720)
    run(qtbot, win, [list(range(1, 30))], 2)
    win.requests.select(["0"])
    qtbot.wait(50)
    table = win.requests.block_table
    for row in (0, 1):  # physical and ref, inside the table's viewport
        top = table.rowViewportPosition(row)
        assert top >= 0 and top + table.rowHeight(row) <= table.viewport().height()
    assert table.isVisible() and table.visibleRegion().boundingRect().height() == table.height()


def test_at_1280x720_every_plot_keeps_its_least_height_and_the_panel_scrolls(qtbot, window):
    """Plots at 1280x720 were ~30 px high with tick labels overlapping: each keeps MIN_PLOT_H and the panel
    scrolls; a legend is its title's second line, so it never covers a line."""
    from kvscope.ui.views.plots import MIN_PLOT_H

    win = window()
    win.resize(1280, 720)
    run(qtbot, win, [list(range(1, 30)), list(range(1, 20))], 4)
    win.show_view("plots")
    qtbot.wait(100)
    win.flush()
    heights = [p.vb.height() for p in win.plots.plots]  # the plotting area, axes and title apart
    assert min(heights) >= MIN_PLOT_H * 0.5, heights
    assert all(p.geometry().height() >= MIN_PLOT_H for p in win.plots.plots)
    assert win.plots.scroll.verticalScrollBar().maximum() > 0  # below the least height it scrolls
    assert all(p.legend is None for p in win.plots.plots)  # no legend item inside a plot
    assert "free" in win.plots.plots[0].titleLabel.text and "used" in win.plots.plots[0].titleLabel.text
