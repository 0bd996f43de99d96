"""The main window: only wiring. Views live in ``views/``, the engine behind a backend (its own
process, or a thread), the view state (selection, timeline position, redraw pacing) in ``state``.
"""

from __future__ import annotations

import bisect
import time

import numpy as np
from PySide6.QtCore import QSettings, Qt, QTimer, Slot
from PySide6.QtGui import QAction, QActionGroup, QKeySequence
from PySide6.QtWidgets import (
    QApplication,
    QCheckBox,
    QComboBox,
    QDockWidget,
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QProgressBar,
    QPushButton,
    QScrollArea,
    QSlider,
    QSpinBox,
    QSplitter,
    QStackedLayout,
    QStackedWidget,
    QToolBar,
    QVBoxLayout,
    QWidget,
)

from kvscope.diagnosis import Diagnosis, comparison_prompts
from kvscope.history import RunHistory
from kvscope.limits import LIMITS, WindowLimits
from kvscope.prefill_progress import prefill_progress
from kvscope.run_audit import RunAudit
from kvscope.runtime import protocol as cmd
from kvscope.scenario import Subject, available, load_scenario, subject_at
from kvscope.sources.base import REMOTE_STEPPING, InjectSpec, SourceInfo
from kvscope.state import ViewState, short_status, status_text
from kvscope.ui import focus as focus_rule
from kvscope.ui.style import TEXT_SCALES, set_min_text_px, set_text_scale, text_scale
from kvscope.ui.views.banner import Banner, audit_banner
from kvscope.ui.views.block_grid import BlockGridView
from kvscope.ui.views.diagnosis_panel import DiagnosisPanel
from kvscope.ui.views.event_log import EventLogView
from kvscope.ui.views.figure_view import FigureView
from kvscope.ui.views.fragmentation import FragmentationView
from kvscope.ui.views.inject_dialog import InjectDialog
from kvscope.ui.views.miss_panel import MissPanel
from kvscope.ui.views.plots import PlotsPanel
from kvscope.ui.views.presentation import PresentationPage
from kvscope.ui.views.rank_picker import RankPicker
from kvscope.ui.views.request_panel import RequestPanel
from kvscope.ui.views.scenario_notes import ScenarioNotesPanel
from kvscope.ui.views.welcome import WelcomeView, lesson_order
from kvscope.ui.worker import EngineBackend, StepResult, ThreadBackend

SPEEDS = {"max": 0, "30 steps/s": 33, "10 steps/s": 100, "2 steps/s": 500, "1 step/s": 1000}
MIN_SIZE = (1024, 600)  # every panel stays reachable on a 1280x720 screen
LAYOUT_VERSION = 3  # a saved dock layout of another version (other docks) is not restored
PRESENT_MIN_SCALE = 1.5  # the text size a back row reads on a 1280x720 projector
REQUEST_ROWS = 4  # the requests' table's rows on screen in the default layout, at any text size
PRESENT_MIN_TEXT_PX = 14.0  # nothing smaller is drawn in presentation (a label that would be is left out)
PRESENT_SHORTCUT = "F11"
LESSON_VIEWS = ("figure", "events", "diagnosis", "fragmentation", "plots", "miss")  # what a lesson's panel can be


class MainWindow(QMainWindow):
    def __init__(self, backend, settings: QSettings | None = None, bridge=None, limits: WindowLimits = LIMITS) -> None:
        """``backend``: an ``EngineBackend``, or a factory of sources (scenario -> source) run on a thread
        (with ``bridge``, an HTTP server's, beside it); ``limits``: how much of a long run each store keeps."""
        super().__init__()
        self.setWindowTitle("kvscope")
        self.settings = settings or QSettings("kvscope", "kvscope")
        self.limits = limits
        self.history = RunHistory(limits.timeline_bytes, max_requests=limits.timeline_requests)
        self.diagnosis = Diagnosis(limits=limits)
        self.run_audit = RunAudit()  # every step's audit: a run's problems outlive a pool that healed
        self.info: SourceInfo | None = None
        self._latest: StepResult | None = None  # the newest record with whole arrays (see ``latest``)
        self.errors: list[str] = []
        self.running = False
        self._dirty = False
        self.state = ViewState()
        self._presenting: tuple | None = None  # (the layout and text scale to go back to) while presenting
        self._present_view: str | None = None  # the panel asked for (--view, show_view) over the lesson's own
        self.subjects: list[Subject] = []  # what the loaded scenario's notes point at (kvscope.scenario)
        self.focus = focus_rule.Focus()  # what the window points at now, and the rule that chose it
        self._pinned: tuple[str, ...] = ()  # requests the user chose (a row, a block, --select)
        self._pinned_blocks: tuple[int, ...] = ()  # a block the user clicked that no request holds
        self._applying_focus = False  # selecting the focus's requests: not the user's choice
        self.first_step_sent = False  # a replay's step 0 asked for on load (``on_loaded``)

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
        self.cpu_grid.hide()
        self.grid.mode_box.currentTextChanged.connect(self.cpu_grid.set_mode)
        self.requests = RequestPanel()
        self.plots = PlotsPanel()
        self.events = EventLogView(max_rows=self.limits.event_log_rows)
        self.figure = FigureView()
        self.diagnosis_panel = DiagnosisPanel()
        self.miss_panel = MissPanel()  # "why did it miss?": the Miss tab, and a lab's lesson panel in presentation
        self.fragmentation = FragmentationView()
        self.diagnosis_panel.step_activated.connect(self.show_step)
        self.diagnosis_panel.compare_requested.connect(self.compare_caching)
        self.notes = ScenarioNotesPanel()
        self.welcome = WelcomeView()
        self.welcome.scenario_chosen.connect(self.load_scenario)
        self.welcome.inject_requested.connect(self.open_inject)
        self.banner = Banner()
        self.timeline = QSlider(Qt.Orientation.Horizontal)
        self.timeline.setRange(0, 0)
        self.timeline.valueChanged.connect(self._on_timeline)
        self.timeline_label = QLabel("live")
        self.timeline_label.setMinimumWidth(70)
        self.live_button = QPushButton("Live")
        self.live_button.setToolTip("follow the run again")
        self.live_button.clicked.connect(self.follow_live)
        tl = QHBoxLayout()
        tl.addWidget(QLabel("timeline"))
        tl.addWidget(self.timeline, 1)
        tl.addWidget(self.timeline_label)
        tl.addWidget(self.live_button)
        # The CPU swap pool beside the GPU pool, not under it: the grid area is wide and short, and stacked the
        # two grids each got a strip too thin to read (issue 25's pool-exhaustion at 1280x720).
        self.pool = pool = QSplitter(Qt.Orientation.Horizontal)
        pool.setChildrenCollapsible(False)
        pool.addWidget(self.grid)
        pool.addWidget(self.cpu_grid)
        pool.setStretchFactor(0, 3)
        pool.setStretchFactor(1, 2)
        # The first screen lies over the (empty) pool until the first request, step or lesson; the panels step aside
        # while it shows (they hold nothing yet), so that every lesson's button is on screen at 1280x720, 1.5x text.
        area = QWidget()
        self.pages = QStackedLayout(area)
        self.pages.setStackingMode(QStackedLayout.StackingMode.StackAll)
        self.pages.addWidget(pool)  # presentation borrows the pool, then puts it back
        self.pages.addWidget(self.welcome)
        centre = QWidget()
        cl = QVBoxLayout(centre)
        cl.setContentsMargins(4, 4, 4, 4)
        cl.addWidget(self.banner)
        cl.addWidget(area, 1)
        cl.addLayout(tl)
        # presentation's own page (``views.presentation``): the lesson panel and the pool move there while it lasts
        self.present_page = PresentationPage()
        self.central = QStackedWidget()
        self.central.addWidget(centre)
        self.central.addWidget(self.present_page)
        self._welcome_state = None  # the panels' layout to go back to when the first screen goes
        self.setCentralWidget(self.central)
        self.docks: dict[str, QDockWidget] = {}
        # Short titles: they are the tabs below the grid, which must read whole at 1280x720 with 1.5x text (long
        # ones were cut to "E…" and "P…"); what each panel is, is its tooltip.
        right, bottom = Qt.DockWidgetArea.RightDockWidgetArea, Qt.DockWidgetArea.BottomDockWidgetArea
        for title, tip, widget, area, name in (
            ("Scenario", "the scenario's note for this step", self.notes, right, "scenario"),
            (
                "Requests",
                "every request: its prompt, cached tokens, blocks and state",
                self.requests,
                right,
                "requests",
            ),
            (
                "Figure",
                "the paper's figure, live: the selected requests' logical blocks, block table and the physical blocks",
                self.figure,
                bottom,
                "figure",
            ),
            ("Events", "every event of every step", self.events, bottom, "events"),
            ("Why?", "a block's story; caching on vs off", self.diagnosis_panel, bottom, "diagnosis"),
            ("Miss", "why the request in focus missed the prefix cache", self.miss_panel, bottom, "miss"),
            ("Fragmentation", "contiguous reservation vs paged blocks", self.fragmentation, bottom, "fragmentation"),
            ("Plots", "the run's series against the step", self.plots, bottom, "plots"),
        ):
            dock = QDockWidget(title, self)
            dock.setObjectName(name)
            # these scroll where the panel is smaller than they need (the Miss tab's reason and detail and the Why?
            # tab's caching verdict, wrapped at 1.5x text in a 250 px band, were cut mid-line); presentation gives
            # them the room they need
            if widget in (self.fragmentation, self.miss_panel, self.diagnosis_panel):
                scroll = QScrollArea()
                scroll.setWidgetResizable(True)
                scroll.setFrameShape(QScrollArea.Shape.NoFrame)
                scroll.setWidget(widget)
                widget = scroll
            dock.setWidget(widget)
            dock.setToolTip(tip)
            self.addDockWidget(area, dock)
            self.docks[name] = dock
        # Below the grid, one tab at a time: the paper's figure, the event log, the plots.
        self.tabifyDockWidget(self.docks["figure"], self.docks["events"])
        self.tabifyDockWidget(self.docks["events"], self.docks["diagnosis"])
        self.tabifyDockWidget(self.docks["diagnosis"], self.docks["miss"])
        self.tabifyDockWidget(self.docks["miss"], self.docks["fragmentation"])
        self.tabifyDockWidget(self.docks["fragmentation"], self.docks["plots"])
        self.docks["figure"].raise_()
        self.setCorner(Qt.Corner.BottomRightCorner, Qt.DockWidgetArea.RightDockWidgetArea)
        self.grid.block_clicked.connect(self.on_block_clicked)
        self.requests.request_selected.connect(self.on_request_selected)
        self.events.event_activated.connect(self.on_event_activated)
        self.setMinimumSize(*MIN_SIZE)
        self.resize(1500, 950)
        self.show_welcome(True)

    def _action(self, bar: QToolBar, text: str, slot, shortcut: str | None = None, tip: str = "") -> QAction:
        act = QAction(text, self)
        if shortcut:
            act.setShortcut(QKeySequence(shortcut))
        act.setToolTip(f"{tip or text}" + (f" ({shortcut})" if shortcut else ""))
        act.triggered.connect(slot)
        bar.addAction(act)
        if shortcut:  # the window's too: the keys work while the toolbar steps aside (presentation)
            self.addAction(act)
        return act

    def _build_toolbar(self) -> None:
        bar = QToolBar("controls")
        bar.setObjectName("controls")
        self.addToolBar(bar)
        self.act_step = self._action(bar, "Step", self.step, "F10", "run the scheduler one step")
        self.step_n = QSpinBox()
        self.step_n.setRange(1, 100_000)
        self.step_n.setValue(10)
        self.act_step_n = self._action(
            bar, "Step N", lambda: self.step(self.step_n.value()), tip="run the scheduler N steps"
        )
        bar.addWidget(self.step_n)
        self.act_run = self._action(bar, "Run", self.toggle_run, "F5", "step continuously / pause")
        self.speed = QComboBox()
        self.speed.addItems(list(SPEEDS))
        self.speed.setToolTip("how fast Run steps")
        self.speed.currentTextChanged.connect(lambda t: self.worker.send(cmd.SetInterval(SPEEDS[t])))
        bar.addWidget(self.speed)
        bar.addSeparator()
        self.act_inject = self._action(bar, "Inject…", self.open_inject, "Ctrl+I", "add a request")
        self.act_abort = self._action(bar, "Abort", self.abort_selected, "Del", "abort the selected requests")
        self.act_fork = self._action(
            bar,
            "Fork",
            self.fork_selected,
            "Ctrl+F",
            "fork the selected running request: the copy shares its blocks (CoW)",
        )
        self.act_reset = self._action(
            bar,
            "Reset cache",
            lambda: self.worker.send(cmd.ResetPrefixCache()),
            tip="drop every cached hash (refused while blocks are in use)",
        )
        bar.addSeparator()
        self.audit_box = QCheckBox("Audit")
        self.audit_box.setToolTip(
            "after every step, recompute every ref count from the block tables: "
            "wrong ones turn red and a banner names them"
        )
        self.audit_chosen = False  # the user's choice (a probed vLLM's box shows its own audit, always on)
        self.audit_box.toggled.connect(self._audit_toggled)
        bar.addWidget(self.audit_box)
        self.rank_picker = RankPicker()  # a probed vLLM with data-parallel ranks: which one is shown
        self.rank_picker.rank_chosen.connect(lambda r: self.worker.send(cmd.SelectRank(r)))
        self.act_rank = bar.addWidget(self.rank_picker)
        self.act_rank.setVisible(False)
        self.controls = [
            self.act_step,
            self.act_step_n,
            self.act_run,
            self.act_inject,
            self.act_abort,
            self.act_fork,
            self.act_reset,
        ]
        self.write_controls = [self.act_inject, self.act_abort, self.act_fork, self.act_reset]

    def _audit_toggled(self, on: bool) -> None:
        self.audit_chosen = on
        self.worker.send(cmd.SetAudit(on))

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
        view = self.menuBar().addMenu("&View")
        act = QAction("Welcome: what to do first", self)
        act.triggered.connect(lambda: self.show_welcome(True))
        view.addAction(act)
        size_menu = view.addMenu("Text size (for a projector)")
        self.text_size_actions: dict[float, QAction] = {}
        group = QActionGroup(self)
        for scale in TEXT_SCALES:
            act = QAction(f"{scale:.0%}", self, checkable=True)
            act.setActionGroup(group)
            act.triggered.connect(lambda _checked=False, s=scale: self.set_text_scale(s))
            size_menu.addAction(act)
            self.text_size_actions[scale] = act
        self.act_present = QAction("Presentation (the lesson fills the screen)", self, checkable=True)
        self.act_present.setShortcut(QKeySequence(PRESENT_SHORTCUT))
        self.act_present.toggled.connect(self.set_presentation)
        view.addAction(self.act_present)
        self.addAction(self.act_present)
        for text, key, slot in (
            ("Next lesson", "PgDown", lambda: self.next_lesson(1)),
            ("Previous lesson", "PgUp", lambda: self.next_lesson(-1)),
            ("Follow the lesson (forget the request I chose)", "Esc", self.unpin),
        ):
            act = QAction(text, self)
            act.setShortcut(QKeySequence(key))
            act.triggered.connect(slot)
            view.addAction(act)
            self.addAction(act)
        view.addSeparator()
        for dock in self.docks.values():
            view.addAction(dock.toggleViewAction())
        diagnose = self.menuBar().addMenu("&Diagnose")
        self.act_compare = QAction("Compare caching on / off (this run's prompts)", self)
        self.act_compare.triggered.connect(self.compare_caching)
        diagnose.addAction(self.act_compare)
        act = QAction("Block story of the selected block", self)
        act.triggered.connect(lambda: self.docks["diagnosis"].raise_())
        diagnose.addAction(act)
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
        self.status_label.setMinimumWidth(100)
        self.busy = QProgressBar()
        self.busy.setRange(0, 0)  # indeterminate while the model loads
        self.busy.setMaximumWidth(160)
        sb.addWidget(self.status_label, 1)
        sb.addPermanentWidget(self.busy)

    def _start_backend(self, backend: EngineBackend) -> None:
        self.worker = backend
        # Bound methods of this (GUI-thread) object: these run on the GUI thread.
        backend.loaded.connect(self.on_loaded)
        backend.load_failed.connect(self.on_load_failed)
        backend.progress.connect(self.on_progress)
        backend.progress_fraction.connect(self.on_progress_fraction)
        backend.stepped.connect(self.on_stepped)
        backend.error.connect(self.on_error)
        backend.running_changed.connect(self.on_running_changed)
        backend.died.connect(self.on_engine_died)
        backend.compared.connect(self.on_compared)

    # -- commands -------------------------------------------------------------------
    def step(self, n: int = 1) -> None:
        self.show_welcome(False)
        self.worker.send(cmd.Step(int(n)))

    def toggle_run(self) -> None:
        self.show_welcome(False)
        self.worker.send(cmd.Pause() if self.running else cmd.Run())

    def run_at_max(self) -> None:
        """Run, as fast as the engine steps (a workload's trace plays this way)."""
        self.speed.setCurrentText("max")
        if not self.running:
            self.toggle_run()

    def inject(self, specs: list[InjectSpec]) -> None:
        self.show_welcome(False)
        for s in specs:
            self.worker.send(cmd.Inject(s))

    def open_inject(self) -> None:
        info = self.info
        dlg = InjectDialog(self, self.settings, has_tokenizer=bool(info and info.has_tokenizer))
        if dlg.exec():
            try:
                self.inject(dlg.specs())
            except ValueError as e:
                self.on_error(str(e))

    def load_scenario(self, name: str) -> None:
        """Rebuild the engine with the scenario's settings (in the engine's process) and start over."""
        self.info = None
        self.busy.show()
        for a in self.controls:
            a.setEnabled(False)
        self.show_welcome(not name)
        self.worker.send(cmd.Load(name))

    def preview_scenario(self, name: str) -> None:
        """While the engine loads (a model takes seconds), the lesson already reads: its title, its first note and
        what its notes point at; and Step is taken at once (the engine runs it when it has loaded), so that a
        class starts the lesson without waiting for the weights."""
        try:
            sc = load_scenario(name)
        except ValueError:
            return  # the engine says why, in one line
        self.show_welcome(False)
        self.notes.set_scenario(sc.watch, list(sc.notes), sc.title)
        self.notes.set_step(0)
        self.subjects = list(sc.subjects)
        self._preview_title = sc.title
        self.act_step.setEnabled(True)
        self.act_step_n.setEnabled(True)
        if self.presenting:
            self._show_page()

    def fork_selected(self) -> None:
        if self.requests.selected_id:
            self.worker.send(cmd.Fork(self.requests.selected_id))
        else:
            self.on_error("select a running request to fork")

    def abort_selected(self) -> None:
        for rid in self.requests.selected_ids():
            self.worker.send(cmd.Abort(rid))

    def set_text_scale(self, scale: float, keep: bool = True) -> None:
        """Every view's text at ``scale`` (the View menu's Text size, ``--font-scale``); kept in the settings unless
        ``keep`` is false (presentation's own scale is not the user's)."""
        set_text_scale(QApplication.instance(), scale)
        for s, act in self.text_size_actions.items():
            act.setChecked(abs(s - scale) < 1e-6)
        if keep:
            self.settings.setValue("text_scale", scale)
        self.grid.redraw(force=True)
        self.cpu_grid.redraw(force=True)
        self.figure.set_snapshot(self.figure.snapshot, self.figure.flagged, self.figure.flag_kinds)  # laid out again
        self.plots.set_text_scale(scale)
        self.miss_panel.apply_sizes()
        self.present_page.apply_sizes()
        self.welcome.fit()  # its lessons in one column or two at the new size

    @property
    def presenting(self) -> bool:
        return self._presenting is not None

    def set_presentation(self, on: bool) -> None:
        """Presentation (View > Presentation, F11, ``--present``): for a projector. The lesson fills the window on a
        page of its own (``views.presentation``): its panel, the step's note, a compact grid of the whole pool, the
        legend of the states present and a one-line status; menus, toolbar and other panels step aside and the keys
        drive. The text is at least ``PRESENT_MIN_SCALE`` and nothing is drawn under ``PRESENT_MIN_TEXT_PX``.
        Leaving it restores the panels, bars and text size as they were."""
        if on == self.presenting:
            return
        if on:
            bars = (self.menuBar().isVisible(), self.statusBar().isVisible())
            state, self._welcome_state = (self._welcome_state or self.saveState()), None
            self._presenting = (state, text_scale(), bars)
            set_min_text_px(PRESENT_MIN_TEXT_PX)
            self.set_text_scale(max(text_scale(), PRESENT_MIN_SCALE), keep=False)
            for dock in self.docks.values():
                dock.hide()
            for bar in self.findChildren(QToolBar):
                bar.hide()
            self.menuBar().hide()
            self.statusBar().hide()
            self.grid.set_compact(True)
            self.cpu_grid.set_compact(True)
            self._place_lesson()
            if not self.welcoming:  # the first screen stays, its text at presentation's size, until a lesson
                self.central.setCurrentWidget(self.present_page)
            self._show_page()
        else:
            state, scale, (menu, status) = self._presenting
            self._presenting = None
            self._return_lesson()
            self.present_page.take_pool()
            self.pages.insertWidget(0, self.pool)
            self.pool.show()
            self.grid.set_compact(False)
            self.cpu_grid.set_compact(False)
            welcoming = self.welcoming
            self.central.setCurrentIndex(0)
            self.menuBar().setVisible(menu)
            self.statusBar().setVisible(status)
            set_min_text_px(None)
            self.restoreState(state)  # the docks and the toolbar as they were
            self.set_text_scale(scale, keep=False)
            if welcoming:  # the first screen again, the panels aside
                self._welcome_state = self.saveState()
                for dock in self.docks.values():
                    dock.hide()
        self.act_present.blockSignals(True)
        self.act_present.setChecked(on)
        self.act_present.blockSignals(False)
        self.grid.redraw(force=True)
        self._dirty = True
        self.flush()

    def lesson_view(self) -> str:
        """The panel the lesson reads: the one asked for (``--view``, ``show_view`` while presenting), else the
        loaded scenario's (its ``view``), else the paper's figure."""
        view = self._present_view or (self.info.view if self.info is not None else None)
        return view if view in LESSON_VIEWS else "figure"

    def _lesson_widget(self, name: str) -> QWidget:
        return self.docks[name].widget()

    def _place_lesson(self) -> None:
        """Presenting: the lesson's panel and the pool on the presentation page."""
        name = self.lesson_view()
        if self.present_page.lesson is not None and self.present_page.lesson is not self._lesson_widget(name):
            self._return_lesson()
        widget = self._lesson_widget(name)
        self._presented = name
        self.present_page.place(widget, self.pool)

    def _return_lesson(self) -> None:
        """The presented lesson panel back in its dock."""
        widget = self.present_page.take_lesson()
        name = getattr(self, "_presented", None)
        if widget is None or name is None:
            return
        self.docks[name].setWidget(widget)
        widget.show()
        self.miss_panel.apply_sizes()

    def present_layout(self) -> None:
        """Presentation lays itself out (its page); kept for callers of the docks' layout."""
        if self.presenting:
            self._place_lesson()

    def show_view(self, name: str) -> None:
        """Bring one of the panels below the grid to the front (``cli.VIEWS`` names them; ``welcome`` is the
        first screen, shown until the first request).
        While presenting (or before, with ``--present``) the panel becomes the lesson's."""
        if name == "welcome":
            self.show_welcome(True)
            return
        self._present_view = name
        if self.presenting:
            self._place_lesson()
            return
        self.docks[name].raise_()

    def next_lesson(self, delta: int) -> None:
        """The next (or previous) lesson in a classroom's order (PgDn, PgUp): a teacher's tour from the keyboard."""
        names = lesson_order(available())
        here = self.info.scenario_name if self.info is not None else None
        i = names.index(here) + delta if here in names else 0 if delta > 0 else len(names) - 1
        if 0 <= i < len(names):
            self.load_scenario(names[i])

    def unpin(self) -> None:
        """Esc: forget the user's choice; the figure follows the lesson (or the newest running request) again."""
        self._pinned, self._pinned_blocks = (), ()
        self._dirty = True
        self.flush()

    @property
    def welcoming(self) -> bool:
        return getattr(self, "_welcoming", False)

    def show_welcome(self, on: bool) -> None:
        """The first screen, over the pool; the panels step aside while it shows and come back as they were
        (presenting: it takes the page's place until a lesson starts)."""
        self.welcome.setVisible(on)
        if on:
            self.pages.setCurrentWidget(self.welcome)
        if on == self.welcoming:
            return
        self._welcoming = on
        if self.presenting:
            self.central.setCurrentIndex(0 if on else 1)
        if on:
            if not self.presenting:
                self._welcome_state = self.saveState()
                for dock in self.docks.values():
                    dock.hide()
            self.welcome.fit()
            return
        state, self._welcome_state = self._welcome_state, None
        if state is not None and not self.presenting:
            self.restoreState(state)
            if getattr(self, "_layout_pending", False):  # the first show came while the first screen was up
                self._layout_pending = False
                QTimer.singleShot(0, self.default_layout)

    # -- engine signals -----------------------------------------------------------------
    @Slot(object)
    def on_loaded(self, info: SourceInfo) -> None:
        self.info = info
        decode = self.worker.decode if self.worker.vocab else None
        # Nothing of the previous session may show: not its blocks, hover text or figure.
        self.grid.clear()
        self.cpu_grid.clear()
        self.figure.set_requests([])
        self.figure.set_snapshot(None)
        for view in (self.grid, self.cpu_grid, self.figure):
            view.set_decode(decode)
        self.events.set_decode(decode)
        self.busy.hide()
        # a pool kvscope's rules do not rebuild from events (a probed vLLM's): a keyframe every step
        self.history = RunHistory(
            self.limits.timeline_bytes,
            keyframe_every=None if info.events_rebuild_pool else 1,
            decode=decode,
            max_requests=self.limits.timeline_requests,
        )
        self.diagnosis = Diagnosis(decode, info.prefix_caching, self.limits, tuple(info.extra.get("kv_groups", ())))
        self.run_audit = RunAudit()
        self.diagnosis_panel.clear_story()
        self.diagnosis_panel.reset_compare(not info.read_only)
        self.act_compare.setEnabled(not info.read_only)
        self.latest = None
        self.events.clear()
        self.events.set_max_step(None)
        self.plots.set_cursor(None)
        self.plots.set_pool(info.block_bytes)
        self.fragmentation.set_info(info.max_model_len, info.kv_layout)
        self.fragmentation.set_snapshot(None)
        # the lesson's subjects (what its notes point at), and nothing the user chose in the last one
        if info.scenario or info.watch or info.notes or info.read_only:  # a lesson or a replay: the panels back first
            self.show_welcome(False)
        self.subjects = self._subjects_of(info)
        self._pinned, self._pinned_blocks, self.focus = (), (), focus_rule.Focus()
        self._present_view = None
        if self.presenting:  # a scenario whose lesson is another panel: that panel on the page
            self._place_lesson()
        elif info.view in LESSON_VIEWS:
            self.docks[info.view].raise_()
        if info.view == "plots" and info.plot:  # at 1280x720 one row of plots shows: the lesson's one
            QTimer.singleShot(0, lambda name=info.plot: self.plots.show_series(name))
        self.state.reset()
        self.banner.clear()
        self._applying_focus = True  # not the user's choice: nothing of the last session is followed
        try:
            self.requests.select([])
        finally:
            self._applying_focus = False
        for a in self.controls:
            a.setEnabled(not (info.read_only and a in self.write_controls))
        # a probed vLLM is audited after every step on its own: the box says so (and is not the user's to change);
        # any other source shows the user's own choice (which the host keeps across loads)
        always = bool(info.extra.get("always_audited"))
        self.audit_box.blockSignals(True)
        self.audit_box.setChecked(always or self.audit_chosen)
        self.audit_box.blockSignals(False)
        self.audit_box.setEnabled(not info.read_only and not always)
        ranks = list(info.extra.get("dp_ranks", ()))
        self.rank_picker.set_ranks(ranks, info.extra.get("dp_rank", 0))
        self.act_rank.setVisible(len(ranks) > 1)
        # A replay's first record is its step 0: shown at once, as a live engine shows its step 0 when it loads (so
        # that F10 means the next step for every source; a live vLLM is not stepped uninvited).
        self.first_step_sent = (
            info.read_only and REMOTE_STEPPING not in info.capabilities and not info.extra.get("workload")
        )
        if self.first_step_sent:
            self.worker.send(cmd.Step(1))
        self.cpu_grid.setVisible(info.num_cpu_blocks > 0)
        self.cpu_grid.set_title(f"CPU swap pool · {info.num_cpu_blocks} blocks")
        title = f"kvscope · {info.model_name}" + (f" · {info.scenario}" if info.scenario else "")
        self.setWindowTitle(title)
        kv = "" if info.kv_cache_dtype == "auto" else f" · KV cache {info.kv_cache_dtype}"
        tok = "" if info.has_tokenizer or info.read_only else " · no tokenizer: prompts are token ids"
        self.grid.set_title(
            f"{info.model_name} · {info.num_blocks:,} blocks × {info.block_size} tokens "
            f"· {info.block_bytes / 1024:.1f} KiB/block · {info.device} {info.dtype}{kv}{tok}"
        )
        if info.scenario or info.watch or info.notes:
            self.notes.set_scenario(info.watch, list(info.notes), info.scenario or "")
            self.show_welcome(False)
        else:
            self.notes.clear()
        if info.read_only:
            self.show_welcome(False)

    @staticmethod
    def _subjects_of(info: SourceInfo) -> list[Subject]:
        """The loaded scenario's subjects, read from its file (a run without a scenario has none)."""
        if not info.scenario_name:
            return []
        try:
            return list(load_scenario(info.scenario_name).subjects)
        except ValueError:  # a replay of a scenario since renamed: no subjects, the window follows the run
            return []

    @Slot(str)
    def on_load_failed(self, message: str) -> None:
        self.busy.hide()
        self.on_error(f"could not load the model: {message}")
        self.status_label.setText("no model loaded")

    @Slot(str)
    def on_progress(self, text: str) -> None:
        self.status_label.setText(text)
        if self.presenting:
            self.present_page.set_status(text)

    @Slot(object)
    def on_progress_fraction(self, fraction) -> None:
        if fraction is None:
            self.busy.setRange(0, 0)  # indeterminate
        else:
            self.busy.setRange(0, 100)
            self.busy.setValue(int(100 * fraction))
        self.busy.show()

    @property
    def latest(self) -> StepResult | None:
        """The newest record with a whole snapshot. An engine process's comes raw; it is assembled the first
        time it is asked for (when it is drawn: at most once a frame, however fast the steps come)."""
        res = self._latest
        if res is not None:
            res = self._latest = res.assembled()
        return res

    @latest.setter
    def latest(self, result: StepResult | None) -> None:
        self._latest = result

    @Slot(object)
    def on_stepped(self, result: StepResult) -> None:
        if result.snapshot.has_arrays:  # else a digest: a newer record came with it
            self.latest = result
        self.history.record(result.snapshot, result.step_seconds, result.memory, result.events)
        self.run_audit.add(result.step, result.record.audit)
        self.diagnosis.feed(result.step, result.events, result.snapshot)
        self.events.append(result.step, result.events)
        if result.snapshot.requests and self.welcoming:
            self.show_welcome(False)
        if result.record.error is None and self.banner.isVisible() and self.banner.kind == "error":
            self.banner.clear()  # the next action succeeded: the old error no longer applies
        self._dirty = True

    @Slot(str)
    def on_error(self, message: str) -> None:
        self.show_welcome(False)  # the banner says what went wrong: the panels come back to show it
        self.errors.append(message)
        if self.info is not None and not self.info.read_only:
            self.diagnosis_panel.compare_failed(message)
        self.banner.show_message(message, "error")
        self.statusBar().showMessage(message, 10_000)

    @Slot(str)
    def on_engine_died(self, message: str) -> None:
        """The engine process is gone (or hung): keep the last state on screen and offer a restart."""
        self.running = False
        self.act_run.setText("Run")
        for a in self.controls:
            a.setEnabled(False)
        self.act_restart.setEnabled(True)
        self.banner.show_message(
            f"{message}. The last state and the trace so far are kept; Engine ▸ Restart starts a new engine process.",
            "engine",  # a record the dying engine sent before it stopped must not clear this (on_stepped would)
        )
        self.errors.append(message)

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
        """Apply the newest record to every view (called at ~30 Hz, and by tests)."""
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
                + f"; history {h.nbytes / 2**20:.0f} of {h.budget_bytes / 2**20:.0f} MiB"
            )
        if self.state.live:
            self._show(self.latest.snapshot, self.latest.audit, self.latest.events)
        self.plots.update_from(self.history, self.latest.memory)
        self.events.flush()

    def _pace_redraws(self) -> None:
        interval = self.state.pacer.after_redraw(time.perf_counter(), time.thread_time())
        if interval != self._redraw_timer.interval():
            self._redraw_timer.setInterval(interval)

    def _show(self, snap, audit=None, events=()) -> None:
        """Every view at one step: the live one, or the timeline's."""
        leaked = np.array(audit.bad_blocks, np.int64) if audit is not None and not audit.ok else None
        kinds = audit.block_kinds() if leaked is not None else None
        subject = subject_at(self.subjects, snap.step)
        if leaked is not None:
            first = subject.blocks if subject is not None else ()
            self.banner.show_message(audit_banner(audit, first), "audit")
        elif not self.run_audit.clean and (self.banner.kind in ("audit", "warning") or not self.banner.isVisible()):
            steps = self.run_audit.problem_steps()
            self.banner.show_message(  # the pool healed, the run's record did not: say where to look
                f"audit: clean at step {snap.step}, but {self.run_audit.text()}. The timeline shows them"
                + (f" (steps {', '.join(map(str, steps[:8]))}{'…' if len(steps) > 8 else ''})" if steps else ""),
                "warning",
            )
        elif self.banner.kind == "audit":
            self.banner.clear()
        self.requests.set_snapshot(snap, leaked if leaked is not None else ())
        with self.figure.held():  # the figure drawn once, with its snapshot, events and focus
            self.figure.set_snapshot(snap, leaked, kinds)
            self.figure.set_events(list(events))
            self._apply_focus(snap, audit, subject, redraw=False)  # the grids draw it with their snapshot: once
        self.grid.set_snapshot(snap, leaked, *((audit.kinds_names(), kinds) if leaked is not None else (None, None)))
        if self.cpu_grid.isVisible():
            self.cpu_grid.set_snapshot(snap)
        self.fragmentation.set_snapshot(snap)
        self.notes.set_step(snap.step)
        progress = prefill_progress(snap)  # a long prompt's chunks: the one thing moving for a minute
        status = status_text(snap, self.info, self.state.live)
        # the whole line where it fits, else its short form (the whole line is the tooltip): never cut mid-line
        full = f"{progress} · {status}" if progress else status
        short = short_status(snap, self.info, self.state.live)
        short = f"{progress} · {short}" if progress else short
        fits = self.status_label.fontMetrics().horizontalAdvance(full) <= self.status_label.width() - 4
        self.status_label.setText(full if fits or not self.status_label.width() else short)
        self.status_label.setToolTip(full)
        if self.presenting:
            self._show_page(snap)

    def _apply_focus(self, snap, audit, subject: Subject | None, redraw: bool = True) -> None:
        """Point at what the focus rule chooses (``kvscope.ui.focus``): select its requests (not as the user's
        choice), draw them in the figure with the rule's words, outline their blocks in the grid."""
        f = focus_rule.choose(snap, audit, subject, self._pinned, self._pinned_blocks, self.focus)
        self.focus = f
        if f.rule != focus_rule.PINNED and self.requests.selected_ids() != [
            r for r in (row.request_id for row in self.requests.model.rows) if r in f.requests
        ]:
            self._applying_focus = True
            try:
                self.requests.select(list(f.requests))
            finally:
                self._applying_focus = False
        self.figure.set_focus(list(f.requests), f.blocks, f.why)
        tables = [snap.request(r) for r in f.requests]
        tables = [r.block_ids for r in tables if r is not None and r.block_ids]
        if len(tables) == 1 and not f.blocks:
            self.grid.set_highlight(list(tables[0]), redraw=redraw)  # one table: its path, in logical order
        else:
            blocks = sorted({b for t in tables for b in t} | set(f.blocks))
            self.grid.set_highlight(blocks, logical=False, redraw=redraw)
        if self.cpu_grid.isVisible():  # a swapped-out request's KV: in the CPU pool
            swapped = [q.cpu_block_ids for q in (snap.request(r) for r in f.requests) if q is not None]
            self.cpu_grid.set_highlight(sorted({c for ids in swapped for c in ids}), logical=False, redraw=redraw)
        rid = f.requests[0] if f.requests else self.requests.selected_id
        text = self.diagnosis.miss_text(snap, rid)
        explained = self.diagnosis.explained(snap, rid)
        if explained is not None:
            miss, hit = explained
            self.miss_panel.show_miss(rid, miss, hit)
            # under the block table, one line; the whole answer is its tooltip and the Miss tab's
            short = f"{hit}" + (
                f"; first miss: block {miss.block_index} at token {miss.token_position}, {miss.reason} (Miss tab)"
                if miss
                else ""
            )
            self.requests.set_miss_text(short, text)
        else:
            self.miss_panel.show_text(text)
            self.requests.set_miss_text(text)

    def _show_page(self, snap=None) -> None:
        """Presentation's page at this step: the lesson's title and note, the legend of what is present, a status
        (before the first step: the lesson's title and first note, while the engine loads)."""
        note = self.notes.current_note()
        title = (self.info.scenario if self.info is not None else None) or getattr(self, "_preview_title", "kvscope")
        watch = self.notes.watch if note is None else note[1]
        self.present_page.set_note(title, snap.step if snap is not None else self.notes.step, watch)
        if snap is None:
            return
        entries = list(self.grid.legend.entries)
        if self.cpu_grid.isVisible():
            entries += [e for e in self.cpu_grid.legend.entries if e.name != "free"]
        self.present_page.set_legend(entries)
        self.present_page.set_status(short_status(snap, self.info))
        self.present_page.set_banner(self.banner.text() if self.banner.isVisibleTo(self.banner.parentWidget()) else "")

    def _on_timeline(self, pos: int) -> None:
        steps = self.history.steps
        if not steps:
            return
        live = self.state.timeline_moved(steps, pos) is None
        step = steps[min(pos, len(steps) - 1)]
        snap = self.history.latest if live else self.history.at(step)
        self.timeline_label.setText("live" if live else f"step {step}")
        self.events.set_max_step(None if live else step)
        self.plots.set_cursor(None if live else step)
        if snap is not None:
            latest = self.latest
            self._show(
                snap,
                latest.audit if live and latest else self.run_audit.at(step),
                latest.events if live and latest else self.history.events_at(step),
            )

    def show_step(self, step: int) -> None:
        """Move the timeline to ``step`` (a story row clicked)."""
        i = bisect.bisect_left(self.history.steps, step)
        if i < len(self.history.steps):
            self.timeline.setValue(i)

    def compare_caching(self) -> None:
        prompts, max_tokens = comparison_prompts(self.history)
        if not prompts:
            self.on_error("nothing to compare: inject a request or load a scenario first")
            return
        self.diagnosis_panel.comparison_running(len(prompts))
        self.docks["diagnosis"].raise_()
        self.worker.send(cmd.CompareCaching(prompts, max_tokens))

    @Slot(str, object)
    def on_compared(self, text: str, divergence) -> None:
        self.diagnosis_panel.show_comparison(text, divergence)
        self.status_label.setText(text)

    def follow_live(self) -> None:
        self.state.follow_live()
        self.timeline_label.setText("live")
        self.events.set_max_step(None)
        self.plots.set_cursor(None)
        self._dirty = True
        self.flush()

    # -- selection -----------------------------------------------------------------------
    def on_block_clicked(self, block_id: int) -> None:
        snap = self.grid.snapshot
        owners = snap.owners_of(block_id) if snap else []
        self.requests.select(owners)  # the user's choice: pinned (on_request_selected)
        self._pinned_blocks = () if owners else (block_id,)
        self.grid.set_highlight([block_id], logical=False)
        up_to = None if self.state.live or snap is None else snap.step
        self.diagnosis_panel.show_story(
            block_id, self.diagnosis.story(block_id, self.history, up_to), self.history.reach
        )
        if not owners:
            self._pinned = ()
            self._refocus()

    def on_request_selected(self, request_id: str) -> None:
        if self._applying_focus:
            return
        self._pinned = tuple(self.requests.selected_ids())  # the user's choice: the figure keeps it (Esc: unpin)
        self._pinned_blocks = ()
        self._refocus()

    def _refocus(self) -> None:
        """Point again at what the rule chooses now (the user changed the choice), at the step on screen."""
        snap = self.requests.snapshot
        if snap is None:
            return
        latest = self.latest if self.state.live else None
        self._apply_focus(snap, latest.audit if latest is not None else None, subject_at(self.subjects, snap.step))

    def on_event_activated(self, ev) -> None:
        bid = getattr(ev, "block_id", None)
        rid = getattr(ev, "request_id", None)
        if bid is not None and bid >= 0:
            self.on_block_clicked(bid)
        elif rid is not None:
            self.requests.select([rid])

    # -- persistence and shutdown -------------------------------------------------------------
    def showEvent(self, event) -> None:  # noqa: N802 - Qt's name
        super().showEvent(event)
        if not self._layout_restored:
            self._layout_restored = True
            QTimer.singleShot(0, self.default_layout)

    def default_layout(self) -> None:
        """The grid gets most of the window; the figure, event log and plots share a band below it."""
        if self.presenting:
            self.present_layout()
            return
        if self.welcoming:  # the panels are aside: laid out when they come back
            self._layout_pending = True
            return
        w, h = self.width(), self.height()
        self.resizeDocks([self.docks["figure"]], [int(h * 0.36)], Qt.Orientation.Vertical)
        self.resizeDocks([self.docks["scenario"]], [max(300, int(w * 0.26))], Qt.Orientation.Horizontal)
        self.resizeDocks(
            [self.docks["scenario"], self.docks["requests"]], [int(h * 0.46), int(h * 0.54)], Qt.Orientation.Vertical
        )
        QTimer.singleShot(0, self._show_request_rows)  # once Qt has laid the docks out at those sizes

    def _show_request_rows(self) -> None:
        """The requests' table shows ``REQUEST_ROWS`` rows under its header whatever the text size (at 1.5x it
        showed one or two): its dock grows by what they lack, the scenario's note (which scrolls) gives it up, down
        to a third of the column."""
        table, line = self.requests.table, self.requests.miss_label.fontMetrics().lineSpacing()
        short = REQUEST_ROWS * table.verticalHeader().defaultSectionSize() - table.viewport().height()
        # laid out before its first request: its columns' scroll bar and the miss line's wrapped lines (three at
        # 1.5x) are still to come, and take their height from the table
        short += 0 if table.horizontalScrollBar().isVisible() else table.horizontalScrollBar().sizeHint().height()
        short += max(0, 3 * line - self.requests.miss_label.height())
        right = [self.docks["scenario"], self.docks["requests"]]
        column = sum(d.height() for d in right)
        if short <= 0 or not all(d.isVisible() for d in right):
            return
        requests = min(right[1].height() + short, column * 2 // 3)
        self.resizeDocks(right, [column - requests, requests], Qt.Orientation.Vertical)

    def _restore_settings(self) -> None:
        s = self.settings
        self._layout_restored = False  # until a saved layout is restored, showEvent lays the docks out
        if s.value("geometry") is not None:
            self.restoreGeometry(s.value("geometry"))
        if s.value("state") is not None and str(s.value("layout_version")) == str(LAYOUT_VERSION):
            self._layout_restored = self.restoreState(s.value("state"))
            if self._layout_restored and self.welcoming:  # the user's panels, kept aside until the first screen goes
                self._welcome_state = self.saveState()
                for dock in self.docks.values():
                    dock.hide()
        for key, box in (("colour_mode", self.grid.mode_box), ("speed", self.speed)):
            v = s.value(key)
            if v is not None and box.findText(str(v)) >= 0:
                box.setCurrentText(str(v))
        if s.value("step_n") is not None:
            self.step_n.setValue(int(s.value("step_n")))
        try:
            self.set_text_scale(float(s.value("text_scale", 1.0)))
        except (TypeError, ValueError):  # a settings file written by hand
            self.set_text_scale(1.0)
        self.worker.send(cmd.SetInterval(SPEEDS[self.speed.currentText()]))

    def save_settings(self) -> None:
        s = self.settings
        s.setValue("geometry", self.saveGeometry())
        # the user's panels: not presentation's, nor the first screen's (which puts them aside)
        s.setValue("state", self._presenting[0] if self._presenting else self._welcome_state or self.saveState())
        s.setValue("layout_version", LAYOUT_VERSION)
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
