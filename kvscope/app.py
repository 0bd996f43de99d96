"""Start the Qt application around ``MainWindow`` (and the ``--screenshot`` mode)."""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from PySide6.QtCore import QObject, QTimer, Slot
from PySide6.QtWidgets import QApplication

from engine import EngineConfig, SamplingParams

from .main_window import MainWindow
from .sources.base import InjectSpec
from .sources.build import SourceSpec
from .style import apply_style
from .worker import ProcessBackend, ThreadBackend


class StartupDriver(QObject):
    """Once the model is loaded: inject the requests; with a path, run N steps, save a PNG, quit."""

    def __init__(self, win: MainWindow, path: str | None, steps: int, prompts: list, max_tokens: int) -> None:
        super().__init__(win)
        self.win, self.path, self.steps = win, path, steps
        self.prompts, self.max_tokens = prompts, max_tokens
        self.exit_code = 0
        win.worker.loaded.connect(self.on_loaded)
        win.worker.load_failed.connect(self.on_failed)
        win.worker.stepped.connect(self.on_stepped)

    @Slot(object)
    def on_loaded(self, _info) -> None:
        params = SamplingParams(max_tokens=self.max_tokens, temperature=0.0)
        if self.prompts:
            self.win.inject([InjectSpec(p, params) for p in self.prompts])
        if self.path:
            self.win.step(self.steps)

    @Slot(str)
    def on_failed(self, msg: str) -> None:
        print(f"kvscope: {msg}", file=sys.stderr)
        self.exit_code = 1
        QTimer.singleShot(0, self.save)

    @Slot(object)
    def on_stepped(self, result) -> None:
        if self.path and result.step >= self.steps:
            QTimer.singleShot(100, self.save)

    def save(self) -> None:
        self.win.flush()
        # Select the request with the most blocks, so the block table and path show up.
        model = self.win.requests.model
        if model.rows and not self.win.requests.selected_id:
            best = max(model.rows, key=lambda r: len(r.block_ids))
            self.win.requests.select([best.request_id])
        QApplication.processEvents()
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        ok = self.win.grab().save(self.path)
        print(f"kvscope: saved {self.path}" if ok else f"kvscope: could not save {self.path}")
        self.exit_code = self.exit_code or (0 if ok else 1)
        self.win.close()


def run_app(config: EngineConfig, args: argparse.Namespace) -> int:
    server = serve = None
    if getattr(args, "serve", False):
        from .serve import OpenAIServer, ServeOptions
        from .serve.server import check_port
        if args.replay or args.screenshot:
            print("kvscope: --serve needs a live engine in a window: not with --replay or --screenshot",
                  file=sys.stderr)
            return 2
        serve = ServeOptions.from_args(args)
        try:
            if args.engine_thread:  # the server beside the engine: in this process
                server = OpenAIServer(serve)
                server.start()
                print(f"kvscope: serving at {server.url}/v1 (metrics at {server.url}/metrics)", file=sys.stderr)
            else:  # the engine process starts it; a port in use is told here, before the window opens
                check_port(serve.host, serve.port)
        except OSError as e:
            print(f"kvscope: {e}", file=sys.stderr)
            return 2
    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("kvscope")
    app.setOrganizationName("kvscope")
    apply_style(app)
    spec = SourceSpec.from_args(config, args)
    if args.engine_thread:
        backend = ThreadBackend(spec.factory, server.bridge if server else None)
    else:
        backend = ProcessBackend(dataclasses.replace(spec, serve=serve))
    win = MainWindow(backend)
    if args.screenshot:
        win.resize(1600, 1000)
    prompts = args.inject or (_demo_prompts() if args.screenshot and not (args.scenario or args.replay) else [])
    driver = StartupDriver(win, args.screenshot, args.steps or 8, prompts, args.max_tokens)
    win.show()
    win.start()
    code = app.exec()
    win.shutdown()  # detaches the bridge: open responses end before the server stops
    if server is not None:
        server.stop()
    return driver.exit_code or code


def _demo_prompts() -> list:
    from .presets import shared_system_prompt
    return [shared_system_prompt(i) for i in range(4)]
