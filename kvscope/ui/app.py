"""The main window through the one host (``ui.host``), and its driver: the requests the command line injects, the
``--screenshot`` mode's steps and save, a failed load's exit code."""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import QObject, QSettings, QTimer, Slot

from engine import SamplingParams
from kvscope.limits import LIMITS, WindowLimits
from kvscope.runtime.build import SourceSpec
from kvscope.runtime.engine_process import SpawnedEngine
from kvscope.serve.options import ServeOptions
from kvscope.sources.base import InjectSpec
from kvscope.ui.host import HostOptions, host_window
from kvscope.ui.main_window import MainWindow
from kvscope.ui.screenshot import save_window
from kvscope.ui.worker import ProcessBackend, ThreadBackend

REPLAY_END_MS = 3000  # a screenshot of a replay that ended before --steps N: saved this long after its last step


@dataclass(frozen=True, slots=True)
class WindowOptions:
    """What the window is started with (``kvscope.cli.window`` reads them from the command line)."""

    spec: SourceSpec
    serve: ServeOptions | None = None  # an HTTP server beside the engine
    engine_thread: bool = False  # the engine on a thread of this process, not in its own
    screenshot: str | None = None  # run ``steps`` steps offscreen, save this PNG, exit
    window_size: tuple[int, int] | None = None
    steps: int = 8
    prompts: tuple = ()  # injected once loaded
    max_tokens: int = 48
    replay_steps: int | None = None  # the steps a replay shows (a screenshot of a replay stops at its end)
    select: tuple[str, ...] = ()
    select_block: int | None = None
    compare: bool = False
    view: str | None = None
    audit: bool = False
    font_scale: float | None = None  # every view's text (None: as kept in the settings)
    limits: WindowLimits = LIMITS  # how much of a long run each store keeps
    present: bool = False  # presentation: the lesson fills the window (View > Presentation)
    steps_given: bool = False  # --steps was given: a window runs to that step too, not only a screenshot


class StartupDriver(QObject):
    """Once the model is loaded: inject the requests; with a path, run N steps, save a PNG, quit.

    It never waits for ever: a replay counts the steps it replays (a trace's steps start at 0)
    and stops at the trace's end; a load failure, a failed step or a refused command saves the
    window as it stands and exits non-zero; a save that fails says so and exits non-zero.
    """

    def __init__(
        self,
        win: MainWindow,
        path: str | None,
        steps: int,
        prompts: list,
        max_tokens: int,
        replay_steps: int | None = None,
        select: list[str] | None = None,
        select_block: int | None = None,
        compare: bool = False,
        view: str | None = None,
        steps_given: bool = False,
    ) -> None:
        super().__init__(win)
        self.steps_given = steps_given
        self.view = view
        self.select = select or []
        self.select_block, self.compare = select_block, compare
        self.win, self.path, self.steps = win, path, steps
        self.prompts, self.max_tokens = prompts, max_tokens
        self.replay_steps = replay_steps
        self.exit_code = 0
        self.bad_input = False  # the first load failed on bad input (the engine host says which)
        self._first_load = True
        self._waiting = False
        self._received = 0
        self._saving = False
        self._refused = False
        self._goal: int | None = None  # a step to run to once the first record shows where the source is
        # a replay sends its records back to back: none for this long after the last means it ended
        self._idle = QTimer(self)
        self._idle.setSingleShot(True)
        self._idle.setInterval(REPLAY_END_MS)
        self._idle.timeout.connect(lambda: self._waiting and self._schedule_save())
        win.worker.loaded.connect(self.on_loaded)
        win.worker.load_failed.connect(self.on_failed)
        win.worker.stepped.connect(self.on_stepped)
        win.worker.error.connect(self.on_error)
        win.worker.refused.connect(self.on_refused)
        win.worker.compared.connect(self.on_compared)

    def start(self) -> None:
        """The window's engine starts (its load's result comes back to ``on_loaded``)."""
        self.win.start()

    @Slot(object)
    def on_loaded(self, info) -> None:
        first, self._first_load = self._first_load, False
        params = SamplingParams(max_tokens=self.max_tokens, temperature=0.0)
        if self.prompts:
            self.win.inject([InjectSpec(p, params) for p in self.prompts])
        if self.view:
            self.win.show_view(self.view)
        if not self.path:
            if first and self.steps_given:  # --steps N: the window shows step N, as a screenshot would
                self.go_to_step()
            elif first and info.extra.get("workload"):  # kvscope --workload: the trace plays at once, at full speed
                self.win.run_at_max()
            return
        self._waiting = True
        if self.steps == 0:  # the first screen (--view welcome): nothing to run
            self._schedule_save()
            return
        if info.read_only:  # a replay stops at its end: the trace's last step, if it comes first
            self._target = min(self.steps, self.replay_steps if self.replay_steps is not None else self.steps)
            if self._target == 0:
                self._schedule_save()
                return
            self._idle.start()  # a replay that ends before step N: saved at its end
        self.go_to_step()

    def go_to_step(self) -> None:
        """Run to step N, by the records' own numbers: a live engine shows its step 0 as it loads, a replay's first
        record (the window asks for it on load) is the trace's first step, whatever its number; so the steps to
        send are known once a record is there."""
        self._goal = self.steps
        if self.win.latest is None and self.win.first_step_sent:
            return  # on the replay's first record (on_stepped)
        now = self.win.latest.step if self.win.latest is not None else 0
        self._goal = None
        if now < self.steps:
            self.win.step(self.steps - now)

    @Slot(str)
    def on_failed(self, msg: str) -> None:
        if not (self._first_load or self.path):
            return  # a scenario picked later from the menu: the window shows why and stays
        self._first_load = False
        print(f"kvscope: {msg}", file=sys.stderr)
        self.exit_code = 2 if self.bad_input or self.win.worker.load_failed_on_bad_input else 1
        if self.path:
            self._schedule_save(0)
        else:
            self.win.close()

    @Slot(object)
    def on_stepped(self, result) -> None:
        if self._goal is not None:  # the replay's first record: now the steps to N are known
            self._goal, now = None, result.step
            if now < self.steps:
                self.win.step(self.steps - now)
        if not (self.path and self._waiting):
            return
        if self.win.info is not None and self.win.info.read_only:
            self._received += 1  # step N, as everywhere; or a replay's end (its steps counted, or none come)
            done = result.step >= self.steps or (self.replay_steps is not None and self._received >= self.replay_steps)
            self._idle.start()
        else:
            done = result.step >= self.steps
        if done:
            self._schedule_save()

    @Slot(str)
    def on_refused(self, msg: str) -> None:
        """A request of the command line refused: bad input, as ``--headless`` says it (one line, exit 2), and no
        picture of a run that did not happen."""
        if not self.path or self._refused:
            return
        self._refused = True
        print(f"kvscope: {msg}", file=sys.stderr)
        self.exit_code = 2
        self._saving = True  # no save after this
        QTimer.singleShot(0, self.win.close)

    @Slot(str)
    def on_error(self, msg: str) -> None:
        if not self.path or self._refused:
            return  # the window shows it in its banner
        print(f"kvscope: {msg}", file=sys.stderr)
        self.exit_code = self.exit_code or 1
        self._schedule_save()

    @Slot(str, object)
    def on_compared(self, _text: str, _divergence) -> None:
        if self.path and self.compare:
            self.compare = False
            self._saving = False
            self._schedule_save()

    def _schedule_save(self, delay_ms: int = 100) -> None:
        if self._saving:
            return
        if self.compare and self.win.info is not None and not self.win.info.read_only and self.exit_code == 0:
            self._saving, self._waiting = True, False
            self.win.flush()
            self.win.compare_caching()  # on_compared saves
            return
        self._saving, self._waiting = True, False
        QTimer.singleShot(delay_ms, self.save)

    def select_for_shot(self) -> list[str]:
        """Select ``--select``'s requests (the user's choice, as a click makes it); without it the window's own
        focus rule chose what the figure shows, as in a window. Returns the selected ids; raises ``ValueError``
        (one line) for a request that is not there."""
        model = self.win.requests.model
        missing = [rid for rid in self.select if model.row_of(rid) < 0]
        if missing:
            there = ", ".join(r.request_id for r in model.rows) or "none"
            raise ValueError(f"--select {','.join(missing)}: no such request at step {self.steps} (requests: {there})")
        n = self.win.info.num_blocks if self.win.info is not None else 0
        if self.select_block is not None and not 0 <= self.select_block < n:
            raise ValueError(f"--select-block {self.select_block}: no such block (the pool has blocks 0-{n - 1})")
        if self.select:
            self.win.requests.select(list(self.select))
        return self.win.requests.selected_ids()

    def save(self) -> None:
        try:
            self.win.flush()
            self.select_for_shot()
        except ValueError as e:  # bad input: no picture of something else
            print(f"kvscope: {e}", file=sys.stderr)
            self.exit_code = 2
            self.win.close()
            return
        if self.select_block is not None:
            self.win.on_block_clicked(self.select_block)
            self.win.show_view("diagnosis")
        ok = save_window(self.win, self.path)
        self.exit_code = self.exit_code or (0 if ok else 1)
        self.win.close()


def run_app(opts: WindowOptions, early: SpawnedEngine | None = None) -> int:
    """The main window through the one host (``ui.host``). ``early``: the engine process started before Qt was
    imported (``kvscope.cli.window.spawn_early``)."""
    server = None
    if opts.serve is not None:
        from kvscope.serve.server import check_port, start_server

        try:
            if opts.engine_thread:  # the server beside the engine: in this process
                server = start_server(opts.serve)
            else:  # the engine process starts it; a port in use is told here, before the window opens
                check_port(opts.serve.host, opts.serve.port)
        except OSError as e:
            print(f"kvscope: {e}", file=sys.stderr)
            return 2

    def build() -> MainWindow:
        from engine.gc_policy import tune_gc

        tune_gc()  # the window's timeline grows by thousands of objects a second: fewer, cheaper collections
        from kvscope.malloc_policy import tune_malloc

        tune_malloc()  # per-frame copies of long series mapped, not left as holes in the heap
        spec = opts.spec
        if opts.engine_thread:
            backend = ThreadBackend(spec.factory, server.bridge if server else None)
        else:
            backend = ProcessBackend(dataclasses.replace(spec, serve=opts.serve), early=early)
        # A screenshot shows the default layout, never the user's saved one (nor does it change it).
        settings = (
            QSettings(str(Path(tempfile.mkdtemp()) / "kvscope.ini"), QSettings.Format.IniFormat)
            if opts.screenshot
            else None
        )
        win = MainWindow(backend, settings, limits=opts.limits)
        if opts.audit:
            win.audit_box.setChecked(True)  # the command line's --audit, shown where the user can undo it
        return win

    def drive(win: MainWindow) -> StartupDriver:
        if opts.spec.scenario and not opts.screenshot:  # the lesson reads while the engine loads
            win.preview_scenario(opts.spec.scenario)
        return StartupDriver(
            win,
            opts.screenshot,
            opts.steps,
            list(opts.prompts),
            opts.max_tokens,
            opts.replay_steps,
            list(opts.select),
            opts.select_block,
            opts.compare,
            opts.view,
            opts.steps_given,
        )

    def teardown(win: MainWindow) -> None:
        win.shutdown()  # detaches the bridge: open responses end before the server stops
        if server is not None:
            server.stop()

    host = HostOptions(opts.screenshot, opts.window_size, opts.font_scale, opts.present)
    return host_window(build, drive, host, teardown)
