"""The inspector through its real widgets and signals, offscreen, on the tiny random model."""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest
from PySide6.QtCore import QSettings, QTimer

from engine import LLMEngine, SamplingParams
from kvscope.sources.live import LiveSource
from kvscope.ui.app import StartupDriver
from kvscope.ui.main_window import MainWindow
from kvscope.ui.views.grid_cells import codes_for
from kvscope.ui.worker import InjectSpec

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
SHARED = list(range(10, 30))  # 20 tokens = 5 full blocks of 4


@pytest.fixture
def settings(tmp_path):
    return QSettings(str(tmp_path / "kvscope.ini"), QSettings.Format.IniFormat)


@pytest.fixture
def make_window(open_window, tiny_hf, settings):
    """Windows on the tiny Llama (or on ``factory``'s engine), on a thread."""

    def make(factory=None, start: bool = True, **engine_kw) -> MainWindow:
        engine_kw.setdefault("num_gpu_blocks", 48)
        engine_kw.setdefault("block_size", 4)
        factory = factory or (lambda: LLMEngine.from_hf_model(tiny_hf, None, name="tiny-llama", **engine_kw))
        return open_window(lambda _scenario: LiveSource(factory()), start=start, loaded=None, settings=settings)

    return make


def loaded(qtbot, win: MainWindow) -> MainWindow:
    qtbot.waitUntil(lambda: win.info is not None and win.latest is not None, timeout=20_000)
    return win


def step_and_wait(qtbot, win: MainWindow, n: int = 1) -> None:
    target = win.latest.step + n
    win.act_step.trigger() if n == 1 else win.step(n)
    qtbot.waitUntil(lambda: win.latest.step >= target, timeout=20_000)
    win.flush()


def inject_and_wait(qtbot, win: MainWindow, prompts: list[list[int]]) -> None:
    # Wait on GUI-side state: a cross-thread waitSignal would run its callback on the worker's thread.
    before = len(win.latest.snapshot.requests)
    win.inject([InjectSpec(p, GREEDY) for p in prompts])
    qtbot.waitUntil(lambda: len(win.latest.snapshot.requests) == before + len(prompts), timeout=10_000)


def test_window_opens_and_grid_matches_engine_after_each_step(qtbot, make_window):
    win = loaded(qtbot, make_window())
    assert "tiny-llama" in win.grid.title.text() and "48 blocks" in win.grid.title.text()
    inject_and_wait(qtbot, win, [SHARED + [1, 2], SHARED + [3]])
    for _ in range(4):
        step_and_wait(qtbot, win)
        live = win.worker.engine.snapshot()  # the worker is idle between steps
        shown = win.grid.grid.ravel()[: live.num_blocks]
        assert np.array_equal(shown, codes_for(live, "state")[0])
        assert np.array_equal(win.latest.snapshot.ref_cnt, live.ref_cnt)
    # The two requests share their 5 full prompt blocks.
    snap = win.latest.snapshot
    assert (snap.ref_cnt == 2).sum() == 5
    assert f"step {snap.step}" in win.status_label.text() and "free" in win.status_label.text()


def test_requests_table_and_block_table_show_the_mapping(qtbot, make_window):
    win = loaded(qtbot, make_window())
    inject_and_wait(qtbot, win, [SHARED + [1, 2], SHARED + [3]])
    step_and_wait(qtbot, win, 2)
    model = win.requests.model
    assert [r.request_id for r in model.rows] == ["0", "1"]
    prompt = model.HEADERS.index("prompt")
    assert model.index(0, prompt).data() == 22 and model.index(1, prompt).data() == 21
    win.requests.select(["1"])
    snap = win.latest.snapshot
    ids = snap.block_tables["1"]
    assert win.requests.block_table.cell_text() == [(b, int(snap.ref_cnt[b])) for b in ids]
    assert win.grid.highlight == list(ids)  # logical order
    # Clicking a shared block selects both requests that map it.
    win.on_block_clicked(ids[0])
    selected = {model.rows[i.row()].request_id for i in win.requests.table.selectionModel().selectedRows()}
    assert selected == {"0", "1"}


def test_run_pause_and_abort(qtbot, make_window):
    win = loaded(qtbot, make_window())
    inject_and_wait(qtbot, win, [[5, 6, 7], [8, 9, 10, 11, 12]])
    win.speed.setCurrentText("30 steps/s")
    win.act_run.trigger()
    qtbot.waitUntil(lambda: win.running, timeout=5000)
    start = win.latest.step
    qtbot.waitUntil(lambda: win.latest.step >= start + 3, timeout=10_000)
    win.act_run.trigger()
    qtbot.waitUntil(lambda: not win.running, timeout=5000)
    assert win.act_run.text() == "Run"
    paused_at = win.latest.step
    qtbot.wait(200)
    assert win.latest.step == paused_at
    win.flush()
    win.requests.select(["1"])
    win.act_abort.trigger()
    qtbot.waitUntil(lambda: win.latest.snapshot.request("1").status == "FINISHED_ABORTED", timeout=5000)
    win.flush()
    assert win.latest.snapshot.request("1").block_ids == ()
    assert win.events.model.rows[-1][1].kind == "aborted"
    model = win.requests.model
    assert model.index(model.row_of("1"), model.HEADERS.index("state")).data() == "finished: aborted"


def test_event_log_filters_and_selects(qtbot, make_window):
    win = loaded(qtbot, make_window())
    inject_and_wait(qtbot, win, [SHARED + [1], SHARED + [2]])
    step_and_wait(qtbot, win, 3)
    all_kinds = {e.kind for e in win.events.visible_events()}
    assert {"allocated", "hit", "stored", "admitted"} <= all_kinds
    win.events.kind_boxes["hit"].setChecked(True)
    shown = win.events.visible_events()
    assert shown and all(e.kind == "hit" for e in shown)
    win.events.activate_row(0)
    assert win.grid.highlight == [shown[0].block_id]
    win.events.kind_boxes["hit"].setChecked(False)
    win.events.search.setText("request_id=1")
    assert all(
        "request_id=1" in f"{e.to_dict()}".replace("'request_id': '1'", "request_id=1")
        for e in win.events.visible_events()
    )
    assert 0 < win.events.proxy.rowCount() < win.events.model.rowCount()


def test_failing_step_shows_error_and_window_stays_alive(qtbot, make_window):
    win = loaded(qtbot, make_window())
    inject_and_wait(qtbot, win, [[1, 2, 3]])
    engine = win.worker.engine
    real = engine.runner.execute
    engine.runner.execute = lambda sched: (_ for _ in ()).throw(RuntimeError("injected failure"))
    win.step()
    qtbot.waitUntil(lambda: win.banner.isVisible(), timeout=5000)
    assert "injected failure" in win.banner.text()
    engine.runner.execute = real
    inject_and_wait(qtbot, win, [[4, 5, 6]])
    step_and_wait(qtbot, win, 3)
    assert win.latest.snapshot.request("1").num_output_tokens == 3


def test_load_failure_is_a_message_not_a_crash(qtbot, make_window):
    def broken():
        raise ValueError("cannot find model 'nope'; tried: local path")

    win = make_window(broken)
    qtbot.waitUntil(lambda: win.banner.isVisible(), timeout=5000)
    assert "cannot find model 'nope'" in win.banner.text()
    assert not win.act_step.isEnabled()
    assert win.isVisible()


def slow_engine(tiny_hf, seconds: float):
    """A factory of engines whose every step first sleeps ``seconds``."""

    def factory():
        eng = LLMEngine.from_hf_model(tiny_hf, None, name="slow", num_gpu_blocks=16, block_size=4)
        real = eng.step
        eng.step = lambda: (time.sleep(seconds), real())[1]
        return eng

    return factory


def test_a_slow_step_does_not_block_the_event_loop(qtbot, make_window, tiny_hf):
    win = loaded(qtbot, make_window(slow_engine(tiny_hf, 1.0)))
    ticks = []
    timer = QTimer()
    timer.timeout.connect(lambda: ticks.append(time.perf_counter()))
    timer.start(20)
    t0 = time.perf_counter()
    win.step()
    qtbot.waitUntil(lambda: len(ticks) >= 10, timeout=900)  # well before the 1 s step ends
    assert ticks[9] - t0 < 0.9
    qtbot.waitUntil(lambda: win.latest.step == 1, timeout=5000)
    timer.stop()


def test_colour_modes_and_settings_persist(qtbot, make_window, settings):
    win = loaded(qtbot, make_window())
    inject_and_wait(qtbot, win, [SHARED])
    step_and_wait(qtbot, win)
    for mode in ("owner", "ref count", "age", "state"):
        win.grid.set_mode(mode)
        assert win.grid.grid is not None
    win.grid.set_mode("ref count")
    win.speed.setCurrentText("2 steps/s")
    win.save_settings()
    win2 = loaded(qtbot, make_window())
    assert win2.grid.mode == "ref count" and win2.speed.currentText() == "2 steps/s"


def test_grid_redraws_only_when_the_snapshot_changes(qtbot, make_window):
    win = loaded(qtbot, make_window())
    inject_and_wait(qtbot, win, [[1, 2, 3]])
    win.flush()
    n = win.grid.num_redraws
    win.grid.redraw()
    win.flush()
    assert win.grid.num_redraws == n
    step_and_wait(qtbot, win)
    assert win.grid.num_redraws == n + 1


def test_shared_prefix_screenshot_is_not_blank(qtbot, make_window, tmp_path):
    win = make_window(start=False)
    win.resize(1400, 900)
    path = tmp_path / "shot.png"
    prompts = [SHARED + [i, i + 1] for i in range(4)]
    driver = StartupDriver(win, str(path), 6, prompts, 24)
    win.start()
    qtbot.waitUntil(lambda: path.exists(), timeout=30_000)
    assert driver.exit_code == 0
    from PySide6.QtGui import QImage

    img = QImage(str(path))
    assert img.width() >= 1000 and img.height() >= 600
    colours = {img.pixel(x, y) for x in range(0, img.width(), 7) for y in range(0, img.height(), 7)}
    assert len(colours) > 20
    snap = win.latest.snapshot
    assert (snap.ref_cnt == 4).sum() == 5  # the shared prefix, visible as shared blocks


def test_many_redraws_keep_none_refcount(qtbot, make_window):
    """PySide6 6.12.0 on CPython 3.11 leaks None's refcount per void Qt call (pyproject.toml pins <6.12)."""
    win = loaded(qtbot, make_window())
    inject_and_wait(qtbot, win, [SHARED])
    step_and_wait(qtbot, win)
    snap = win.latest.snapshot
    before = sys.getrefcount(None)
    for i in range(3000):
        win.grid._key = None
        win.grid.set_snapshot(snap)
        win.grid.set_mode(("state", "owner")[i % 2])
    after = sys.getrefcount(None)
    assert after >= before - 100, (before, after)


def test_fork_button_cpu_grid_and_leak_banner(qtbot, make_window, tiny_hf):
    win = loaded(qtbot, make_window(num_gpu_blocks=16, preemption_mode="swap", num_cpu_blocks=8, fault="abort-leak"))
    assert win.cpu_grid.isVisible() and "8 blocks" in win.cpu_grid.title.text()
    inject_and_wait(qtbot, win, [[1, 2, 3, 4, 5, 6]])
    step_and_wait(qtbot, win, 2)
    win.requests.select(["0"])
    win.act_fork.trigger()
    qtbot.waitUntil(lambda: win.latest.snapshot.request("0+1") is not None, timeout=5000)
    win.flush()
    snap = win.latest.snapshot
    assert snap.block_tables["0+1"] == snap.block_tables["0"]
    assert all(snap.ref_cnt[b] == 2 for b in snap.block_tables["0"])
    # Pressure: swaps show up in the CPU grid.
    inject_and_wait(qtbot, win, [list(range(10, 30)), list(range(40, 60))])
    seen_swapped = False
    for _ in range(12):
        step_and_wait(qtbot, win)
        if (win.latest.snapshot.cpu_state == 4).any():
            seen_swapped = True
            assert (win.cpu_grid.grid.ravel()[:8] == win.latest.snapshot.cpu_state).all()
            break
    assert seen_swapped
    # The fault leaks an aborted request's blocks: the audit marks them and the banner says so.
    win.audit_box.setChecked(True)
    victim = next(r for r in win.latest.snapshot.requests if r.block_ids and r.status == "RUNNING")
    win.requests.select([victim.request_id])
    win.act_abort.trigger()
    qtbot.waitUntil(lambda: win.latest.audit is not None and not win.latest.audit.ok, timeout=5000)
    win.flush()
    assert win.banner.isVisible() and "audit" in win.banner.text()
    leaked = win.latest.audit.bad_blocks
    assert (win.grid.grid.ravel()[leaked] == 5).all()  # BlockState.LEAKED
    assert any(e.kind == "leak" for _, e in win.events.model.rows)
    kinds = win.latest.audit.block_kinds()
    assert kinds and all(f"audit: {kinds[b]}" in win.grid.describe(b) for b in leaked)  # its own kind, in words
    assert "leaked" in win.grid.legend.counts() or any("leaked" in name for name in win.grid.legend.counts())


def test_replay_in_the_window(qtbot, tiny_hf, settings, tmp_path):
    from kvscope.sources.replay import ReplaySource

    engine = LLMEngine.from_hf_model(tiny_hf, None, name="tiny", block_size=4, num_gpu_blocks=16)
    rec = LiveSource(engine, trace_path=str(tmp_path / "t.trace"))
    rec.inject(SHARED, GREEDY)
    live = [rec.step().snapshot for _ in range(5)]
    rec.close()
    win = MainWindow(lambda _s: ReplaySource(str(tmp_path / "t.trace")), settings)
    qtbot.addWidget(win)
    win.show()
    win.start()
    qtbot.waitUntil(lambda: win.info is not None, timeout=5000)
    assert not win.act_inject.isEnabled() and win.act_step.isEnabled()
    for i, snap in enumerate(live):
        if i:  # the first recorded step shows as the replay loads (as a live engine shows its step 0); F10 the next
            win.step()
        qtbot.waitUntil(lambda s=snap: win.latest is not None and win.latest.step == s.step, timeout=5000)
        win.flush()
        assert np.array_equal(win.grid.grid.ravel()[:16], snap.state)
    # The timeline looks back at an earlier step.
    win.timeline.setValue(1)
    assert win.timeline_label.text() == f"step {win.history.steps[1]}"
    assert np.array_equal(win.grid.snapshot.state, win.history.at(win.history.steps[1]).state)
    win.follow_live()
    win.shutdown()


def test_scenario_menu_lists_the_scenarios(qtbot, make_window):
    win = loaded(qtbot, make_window())
    assert {"four-score", "leak-hunt", "parallel-sampling"} <= set(win.scenario_actions)


def test_inject_dialog_beam_search_shows_the_beams(qtbot, make_window, settings):
    from kvscope.ui.views.inject_dialog import InjectDialog

    win = loaded(qtbot, make_window(num_gpu_blocks=64))
    dlg = InjectDialog(win, settings)
    qtbot.addWidget(dlg)
    dlg.beam_width.setValue(3)
    dlg.n.setValue(2)
    dlg.max_tokens.setValue(6)
    params = dlg.params()
    assert params.use_beam_search and params.beam_width == 3 and params.n == 2
    win.inject([InjectSpec([5, 9, 17, 33, 2], params)])
    qtbot.waitUntil(lambda: len(win.latest.snapshot.requests) == 1, timeout=10_000)
    step_and_wait(qtbot, win, 2)
    # Three live beams, forked from the first, on the grid and in the table.
    live = [r for r in win.latest.snapshot.requests if r.status == "RUNNING"]
    assert len(live) == 3 and {r.group_id for r in live} == {live[0].group_id}
    step_and_wait(qtbot, win, 10)
    assert win.latest.snapshot.counters["num_free_blocks"] == 64


def test_closing_the_window_mid_step_shuts_down_cleanly(qtbot, make_window, tiny_hf, capfd):
    """A Step(5) under way is cut at the next step boundary by the window's close, not run to its end."""
    started = threading.Event()
    engines = []

    def factory():
        eng = slow_engine(tiny_hf, 0.3)()
        real = eng.step
        eng.step = lambda: (started.set(), real())[1]
        engines.append(eng)
        return eng

    win = loaded(qtbot, make_window(factory))
    inject_and_wait(qtbot, win, [[1, 2, 3]])
    started.clear()
    win.step(5)
    assert started.wait(10)  # the first of the five steps is running now
    win.close()  # closeEvent: the loop finishes its step, sees the shutdown, and the thread ends
    assert not win.worker.is_running
    assert engines[0].step_count < 5  # the rest of the Step(5) was not run
    assert "Traceback" not in capfd.readouterr().err


def test_a_long_prefill_shows_its_progress_in_the_status_bar(qtbot, make_window):
    """A prompt over the step's token budget is prefilled in chunks; the status bar says how far."""
    win = loaded(qtbot, make_window(max_num_batched_tokens=8))
    inject_and_wait(qtbot, win, [list(range(10, 30))])  # 20 tokens: chunks of 8, 8, 4
    step_and_wait(qtbot, win)
    assert win.status_label.text().startswith("prefilling request 0: 8 of 20 prompt tokens (40%) · step")
    step_and_wait(qtbot, win)
    assert "16 of 20 prompt tokens (80%)" in win.status_label.text()
    step_and_wait(qtbot, win)
    assert "prefilling" not in win.status_label.text()  # the prompt is in: decoding now
