"""The main window: only wiring. Views live in ``views/``, the engine on the worker thread."""
from __future__ import annotations

import time

import numpy as np
from PySide6.QtCore import QSettings, Qt, QTimer, Slot
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDockWidget,
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QProgressBar,
    QPushButton,
    QSlider,
    QSpinBox,
    QToolBar,
    QVBoxLayout,
    QWidget,
)

from .history import RunHistory
from .scenario import available, load_scenario
from .sources import protocol as cmd
from .sources.base import InjectSpec, SourceInfo
from .state import ViewState
from .views.block_grid import BlockGridView
from .views.event_log import EventLogView
from .views.inject_dialog import InjectDialog
from .views.plots import PlotsPanel
from .views.request_panel import RequestPanel
from .worker import EngineBackend, StepResult, ThreadBackend

SPEEDS = {"max": 0, "30 steps/s": 33, "10 steps/s": 100, "2 steps/s": 500, "1 step/s": 1000}


class MainWindow(QMainWindow):
    def __init__(self, backend, settings: QSettings | None = None, bridge=None) -> None:
        """``backend``: an ``EngineBackend``, or a factory of sources (scenario -> source) run on a thread
        (with ``bridge``, an HTTP server's, beside it)."""
        super().__init__()
        self.setWindowTitle("kvscope")
        self.settings = settings or QSettings("kvscope", "kvscope")
        self.history = RunHistory()
        self.info: SourceInfo | None = None
        self.latest: StepResult | None = None
        self.errors: list[str] = []
        self.running = False
        self._dirty = False
        self.state = ViewState()

        self._build_views()
        self._build_toolbar()
        self._build_status()
        self._build_menu()
        self._start_backend(backend if isinstance(backend, EngineBackend) else ThreadBackend(backend, bridge))
        self._redraw_timer = QTimer(self)
        self._redraw_timer.setInterval(self.state.pacer.interval_ms)
        self._redraw_timer.timeout.connect(self.flush)
        self._redraw_timer.start()
        self._restore_settings()

    def start(self) -> None:
        """Start the engine and load the model (connect to the backend's signals before calling this)."""
        self.worker.start()

    # -- construction ------------------------------------------------------------------
    def _build_views(self) -> None:
        self.grid = BlockGridView("GPU block pool")
        self.cpu_grid = BlockGridView("CPU swap pool", cpu=True)
        self.cpu_grid.setMaximumHeight(220)
        self.cpu_grid.hide()
        self.grid.mode_box.currentTextChanged.connect(self.cpu_grid.set_mode)
        self.requests = RequestPanel()
        self.plots = PlotsPanel()
        self.events = EventLogView()
        self.banner = QLabel()
        self.banner.setWordWrap(True)
        self.banner.setStyleSheet("background:#b71c1c;color:white;padding:4px;font-weight:bold")
        self.banner.hide()
        self.timeline = QSlider(Qt.Orientation.Horizontal)
        self.timeline.setRange(0, 0)
        self.timeline.valueChanged.connect(self._on_timeline)
        self.timeline_label = QLabel("live")
        self.live_button = QPushButton("Live")
        self.live_button.clicked.connect(self.follow_live)
        tl = QHBoxLayout()
        tl.addWidget(QLabel("timeline"))
        tl.addWidget(self.timeline, 1)
        tl.addWidget(self.timeline_label)
        tl.addWidget(self.live_button)
        centre = QWidget()
        cl = QVBoxLayout(centre)
        cl.setContentsMargins(4, 4, 4, 4)
        cl.addWidget(self.banner)
        cl.addWidget(self.grid, 1)
        cl.addWidget(self.cpu_grid)
        cl.addLayout(tl)
        self.setCentralWidget(centre)
        for title, widget, area, name in (
                ("Requests", self.requests, Qt.DockWidgetArea.RightDockWidgetArea, "requests"),
                ("Plots", self.plots, Qt.DockWidgetArea.RightDockWidgetArea, "plots"),
                ("Events", self.events, Qt.DockWidgetArea.BottomDockWidgetArea, "events")):
            dock = QDockWidget(title, self)
            dock.setObjectName(name)
            dock.setWidget(widget)
            self.addDockWidget(area, dock)
        # The right-hand docks span the full height; the event log sits under the grid.
        self.setCorner(Qt.Corner.BottomRightCorner, Qt.DockWidgetArea.RightDockWidgetArea)
        self.grid.block_clicked.connect(self.on_block_clicked)
        self.requests.request_selected.connect(self.on_request_selected)
        self.events.event_activated.connect(self.on_event_activated)
        self.resize(1500, 950)

    def _action(self, bar: QToolBar, text: str, slot, shortcut: str | None = None) -> QAction:
        act = QAction(text, self)
        if shortcut:
            act.setShortcut(QKeySequence(shortcut))
            act.setToolTip(f"{text} ({shortcut})")
        act.triggered.connect(slot)
        bar.addAction(act)
        return act

    def _build_toolbar(self) -> None:
        bar = QToolBar("controls")
        bar.setObjectName("controls")
        self.addToolBar(bar)
        self.act_step = self._action(bar, "Step", self.step, "F10")
        self.step_n = QSpinBox()
        self.step_n.setRange(1, 100_000)
        self.step_n.setValue(10)
        self.act_step_n = self._action(bar, "Step N", lambda: self.step(self.step_n.value()))
        bar.addWidget(self.step_n)
        self.act_run = self._action(bar, "Run", self.toggle_run, "F5")
        self.speed = QComboBox()
        self.speed.addItems(list(SPEEDS))
        self.speed.currentTextChanged.connect(lambda t: self.worker.send(cmd.SetInterval(SPEEDS[t])))
        bar.addWidget(self.speed)
        bar.addSeparator()
        self.act_inject = self._action(bar, "Inject…", self.open_inject, "Ctrl+I")
        self.act_abort = self._action(bar, "Abort selected", self.abort_selected, "Del")
        self.act_fork = self._action(bar, "Fork", self.fork_selected, "Ctrl+F")
        self.act_reset = self._action(bar, "Reset prefix cache", lambda: self.worker.send(cmd.ResetPrefixCache()))
        bar.addSeparator()
        self.audit_box = QCheckBox("Audit every step")
        self.audit_box.toggled.connect(lambda on: self.worker.send(cmd.SetAudit(on)))
        bar.addWidget(self.audit_box)
        self.controls = [self.act_step, self.act_step_n, self.act_run, self.act_inject, self.act_abort,
                         self.act_fork, self.act_reset]
        self.write_controls = [self.act_inject, self.act_abort, self.act_fork, self.act_reset]

    def _build_menu(self) -> None:
        menu = self.menuBar().addMenu("&Scenario")
        self.scenario_actions: dict[str, QAction] = {}
        for name in available():
            try:
                title = load_scenario(name).title
            except ValueError:
                continue
            act = QAction(f"{title} ({name})", self)
            act.triggered.connect(lambda _checked=False, n=name: self.load_scenario(n))
            menu.addAction(act)
            self.scenario_actions[name] = act
        menu.addSeparator()
        act = QAction("Plain model (no scenario)", self)
        act.triggered.connect(lambda _checked=False: self.load_scenario(""))
        menu.addAction(act)
        engine_menu = self.menuBar().addMenu("&Engine")
        self.act_restart = QAction("Restart the engine process", self)
        self.act_restart.setEnabled(False)
        self.act_restart.triggered.connect(self.restart_engine)
        engine_menu.addAction(self.act_restart)
        for a in self.controls:
            a.setEnabled(False)

    def _build_status(self) -> None:
        sb = self.statusBar()
        self.status_label = QLabel("starting…")
        self.busy = QProgressBar()
        self.busy.setRange(0, 0)  # indeterminate while the model loads
        self.busy.setMaximumWidth(160)
        sb.addWidget(self.status_label, 1)
        sb.addPermanentWidget(self.busy)

    def _start_backend(self, backend: EngineBackend) -> None:
        self.worker = backend
        self.thread_ = getattr(backend, "thread_", None)
        # Bound methods of this (GUI-thread) object: these run on the GUI thread.
        backend.loaded.connect(self.on_loaded)
        backend.load_failed.connect(self.on_load_failed)
        backend.progress.connect(self.on_progress)
        backend.stepped.connect(self.on_stepped)
        backend.error.connect(self.on_error)
        backend.running_changed.connect(self.on_running_changed)
        backend.died.connect(self.on_engine_died)

    # -- commands -------------------------------------------------------------------
    def step(self, n: int = 1) -> None:
        self.worker.send(cmd.Step(int(n)))

    def toggle_run(self) -> None:
        self.worker.send(cmd.Pause() if self.running else cmd.Run())

    def inject(self, specs: list[InjectSpec]) -> None:
        for s in specs:
            self.worker.send(cmd.Inject(s))

    def open_inject(self) -> None:
        dlg = InjectDialog(self, self.settings)
        if dlg.exec():
            try:
                self.inject(dlg.specs())
            except ValueError as e:
                self.on_error(str(e))

    def load_scenario(self, name: str) -> None:
        """Rebuild the engine with the scenario's settings (on the worker) and start over."""
        self.info = None
        self.busy.show()
        for a in self.controls:
            a.setEnabled(False)
        self.worker.send(cmd.Load(name))

    def fork_selected(self) -> None:
        if self.requests.selected_id:
            self.worker.send(cmd.Fork(self.requests.selected_id))
        else:
            self.on_error("select a running request to fork")

    def abort_selected(self) -> None:
        rows = self.requests.table.selectionModel().selectedRows()
        for idx in rows:
            self.worker.send(cmd.Abort(self.requests.model.rows[idx.row()].request_id))

    # -- worker signals -----------------------------------------------------------------
    @Slot(object)
    def on_loaded(self, info: SourceInfo) -> None:
        self.info = info
        self.grid.token_text = self.worker.decode if self.worker.vocab else None
        self.busy.hide()
        self.history = RunHistory(decode=self.grid.token_text)
        self.latest = None
        self.events.model.clear()
        self.state.reset()
        self.banner.hide()
        for a in self.controls:
            a.setEnabled(not (info.read_only and a in self.write_controls))
        self.cpu_grid.setVisible(info.num_cpu_blocks > 0)
        self.cpu_grid.title.setText(f"CPU swap pool · {info.num_cpu_blocks} blocks")
        title = f"kvscope · {info.model_name}" + (f" · {info.scenario}" if info.scenario else "")
        self.setWindowTitle(title)
        self.grid.title.setText(f"{info.model_name} · {info.num_blocks} blocks × {info.block_size} tokens "
                                f"· {info.block_bytes / 1024:.1f} KiB/block · {info.device} {info.dtype}"
                                + ("" if info.kv_cache_dtype == "auto" else f" · KV cache {info.kv_cache_dtype}"))

    @Slot(str)
    def on_load_failed(self, message: str) -> None:
        self.busy.hide()
        self.on_error(f"could not load the model: {message}")
        self.status_label.setText("no model loaded")

    @Slot(str)
    def on_progress(self, text: str) -> None:
        self.status_label.setText(text)

    @Slot(object)
    def on_stepped(self, result: StepResult) -> None:
        self.latest = result
        self.history.record(result.snapshot, result.step_seconds, result.memory, result.events)
        self.events.append(result.step, result.events)
        self._dirty = True

    @Slot(str)
    def on_error(self, message: str) -> None:
        self.errors.append(message)
        self.banner.setText(f"⚠ {message}")
        self.banner.show()
        self.statusBar().showMessage(message, 10_000)

    @Slot(str)
    def on_engine_died(self, message: str) -> None:
        """The engine process is gone (or hung): keep the last state on screen and offer a restart."""
        self.running = False
        self.act_run.setText("Run")
        for a in self.controls:
            a.setEnabled(False)
        self.act_restart.setEnabled(True)
        self.on_error(f"{message}. The last state and the trace so far are kept; "
                      "Engine ▸ Restart starts a new engine process.")

    def restart_engine(self) -> None:
        try:
            self.worker.restart()
        except ValueError as e:
            self.on_error(str(e))
            return
        self.busy.show()
        self.act_restart.setEnabled(False)

    @Slot(bool)
    def on_running_changed(self, running: bool) -> None:
        self.running = running
        self.act_run.setText("Pause" if running else "Run")

    # -- drawing --------------------------------------------------------------------
    @Slot()
    def flush(self) -> None:
        """Apply the newest snapshot to every view (called at ~30 Hz, and by tests)."""
        if not self._dirty or self.latest is None:
            return
        self._dirty = False
        self._pace_redraws()
        steps = self.history.steps
        self.timeline.blockSignals(True)
        self.timeline.setRange(0, max(len(steps) - 1, 0))
        self.timeline.setValue(self.state.timeline_position(steps))  # old steps may have left the budget
        self.timeline.blockSignals(False)
        h = self.history
        if h.reach:
            self.timeline.setToolTip(
                f"the timeline reaches back to step {h.reach[0]}"
                + (f" ({h.dropped_steps} older steps dropped)" if h.dropped_steps else "")
                + f"; history {h.nbytes / 2**20:.0f} of {h.budget_bytes / 2**20:.0f} MiB")
        if self.state.live:
            self._show(self.latest.snapshot, self.latest.audit)
        self.plots.update_from(self.history, self.latest.memory)
        self._update_status()

    def _pace_redraws(self) -> None:
        interval = self.state.pacer.after_redraw(time.perf_counter(), time.thread_time())
        if interval != self._redraw_timer.interval():
            self._redraw_timer.setInterval(interval)

    def _show(self, snap, audit=None) -> None:
        leaked = np.array(audit.bad_blocks, np.int64) if audit is not None and not audit.ok else None
        self.grid.set_snapshot(snap, leaked)
        if self.cpu_grid.isVisible():
            self.cpu_grid.set_snapshot(snap)
        if leaked is not None:
            worst = "; ".join(str(p) for p in audit.problems[:3])
            self.banner.setText(f"⚠ audit: {len(leaked)} block(s) with wrong ref counts (red in the grid). {worst}")
            self.banner.show()
        self.requests.set_snapshot(snap)
        if self.requests.selected_id:
            self.grid.set_highlight(list(self.requests.selected_block_ids()))

    def _update_status(self) -> None:
        r = self.latest
        if r is None:
            return
        c = r.snapshot.counters
        q = c["prefix_cache_queries"]
        hit = f"{100 * c['prefix_cache_hits'] / q:.0f}%" if q else "–"
        cap = ""
        if self.info:
            i = self.info
            kv = "" if i.kv_cache_dtype == "auto" else f" {i.kv_cache_dtype}"
            cap = (f" · KV{kv} {i.block_bytes / 1024:.1f} KiB/block, capacity {i.num_blocks * i.block_size:,} tokens")
        self.status_label.setText(
            f"step {r.step} · free {c['num_free_blocks']}/{c['num_blocks']} blocks · usage "
            f"{100 * c['kv_cache_usage_perc']:.1f}% · cached {c['num_cached_blocks']} · hit rate {hit} · "
            f"running {c['num_requests_running']} waiting {c['num_requests_waiting']} · "
            f"preemptions {c['num_preemptions']}{cap}")

    def _on_timeline(self, pos: int) -> None:
        steps = self.history.steps
        if not steps:
            return
        live = self.state.timeline_moved(steps, pos) is None
        snap = self.history.latest if live else self.history.at(steps[pos])
        self.timeline_label.setText("live" if live else f"step {steps[pos]}")
        if snap is not None:
            self._show(snap, self.latest.audit if live and self.latest else None)

    def follow_live(self) -> None:
        self.state.follow_live()
        self._dirty = True
        self.flush()

    # -- selection -----------------------------------------------------------------------
    def on_block_clicked(self, block_id: int) -> None:
        snap = self.grid.snapshot
        owners = snap.owners_of(block_id) if snap else []
        self.requests.select(owners)
        self.grid.set_highlight([block_id])

    def on_request_selected(self, request_id: str) -> None:
        self.grid.set_highlight(list(self.requests.selected_block_ids()) if request_id else [])

    def on_event_activated(self, ev) -> None:
        bid = getattr(ev, "block_id", None)
        rid = getattr(ev, "request_id", None)
        if bid is not None and bid >= 0:
            self.on_block_clicked(bid)
        elif rid is not None:
            self.requests.select([rid])

    # -- persistence and shutdown -------------------------------------------------------------
    def _restore_settings(self) -> None:
        s = self.settings
        if s.value("geometry") is not None:
            self.restoreGeometry(s.value("geometry"))
        if s.value("state") is not None:
            self.restoreState(s.value("state"))
        for key, box in (("colour_mode", self.grid.mode_box), ("speed", self.speed)):
            v = s.value(key)
            if v is not None and box.findText(str(v)) >= 0:
                box.setCurrentText(str(v))
        if s.value("step_n") is not None:
            self.step_n.setValue(int(s.value("step_n")))
        self.worker.send(cmd.SetInterval(SPEEDS[self.speed.currentText()]))

    def save_settings(self) -> None:
        s = self.settings
        s.setValue("geometry", self.saveGeometry())
        s.setValue("state", self.saveState())
        s.setValue("colour_mode", self.grid.mode)
        s.setValue("speed", self.speed.currentText())
        s.setValue("step_n", self.step_n.value())
        s.sync()

    def shutdown(self) -> None:
        """Stop the engine (its thread or its process) and wait for it."""
        self._redraw_timer.stop()
        self.worker.shutdown()

    def closeEvent(self, event) -> None:  # noqa: N802 - Qt's name
        self.save_settings()
        self.shutdown()
        super().closeEvent(event)
