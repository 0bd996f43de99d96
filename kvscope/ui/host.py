"""The one way every kvscope window opens: the main window (kvscope's engine, a replay, a probed vLLM, a workload),
the attach window, the fleet window and the simulated fleet's.

``host_window`` starts the application once in kvscope's style, builds the window, gives it ``--window-size``,
``--font-scale`` and presentation (where the window has lessons), starts the window's driver (what steps its
source), runs the event loop, and ends it the same way for every kind: Ctrl+C (SIGINT) or SIGTERM closes the
window the normal way (its engine process, sockets and shared memory released by its own close), the window is
deleted at a moment of our choosing (``lifetime.dispose``), and the exit code says what happened: the driver's
(a screenshot that failed, bad input), 130 after SIGINT, 143 after SIGTERM, with one line on stderr.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication, QMainWindow

from kvscope.ui.lifetime import dispose
from kvscope.ui.style import apply_style, set_text_scale

SIGNAL_POLL_MS = 200  # Python runs a signal handler only between bytecodes: a timer lets it in
SCREENSHOT_SIZE = (1600, 1000)  # a screenshot's window without --window-size
# what each signal that stops a window exits with (the shell's 128 + the signal), and the line it says
STOPPED_BY = {signal.SIGINT: (130, "interrupted"), signal.SIGTERM: (143, "terminated")}


@dataclass(frozen=True, slots=True)
class HostOptions:
    """What every window kind takes from the command line."""

    screenshot: str | None = None  # save this PNG once the driver has run its steps, then exit
    window_size: tuple[int, int] | None = None
    font_scale: float | None = None  # every view's text (None: the window's own, or its saved, size)
    present: bool = False  # presentation (only a window with lessons: the command line refuses it elsewhere)


class Driver(Protocol):
    """What steps a window's source; ``exit_code`` is the run's verdict (0 unless something failed)."""

    exit_code: int

    def start(self) -> None: ...


class HostedWindow(QMainWindow):
    """A window ``host_window`` can show. Its text scale is the application's font; a window that draws text of
    its own (the main window's grid and figure) overrides ``set_text_scale``, and only a window with lessons
    has ``set_presentation``."""

    def set_text_scale(self, scale: float) -> None:
        set_text_scale(QApplication.instance(), scale)

    def prepare_screenshot(self) -> None:
        """What a screenshot should show that a person would see by hovering or waiting (default: nothing)."""


W = TypeVar("W", bound=QMainWindow)


def styled_app() -> QApplication:
    """The application (made once, before any window), in kvscope's style."""
    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("kvscope")
    app.setOrganizationName("kvscope")
    apply_style(app)
    return app


def host_window(
    build: Callable[[], W],
    drive: Callable[[W], Driver],
    opts: HostOptions,
    teardown: Callable[[W], None] | None = None,
) -> int:
    """Build the window (``build``), start its driver (``drive``), run until it closes; ``teardown`` runs after
    the event loop and before the window is deleted (the main window detaches its server there)."""
    app = styled_app()
    stopped: list[int] = []
    shown: list[QMainWindow] = []

    def on_signal(signum, _frame) -> None:
        stopped.append(signum)
        for w in shown:
            QTimer.singleShot(0, w.close)  # runs once the event loop does, even if it has not started yet

    # In before the window is built: a signal while it is being built closes it as soon as it exists.
    previous = {s: signal.signal(s, on_signal) for s in STOPPED_BY}
    try:
        win = build()
        shown.append(win)
        if stopped:
            QTimer.singleShot(0, win.close)
        if opts.window_size or opts.screenshot:
            win.resize(*(opts.window_size or SCREENSHOT_SIZE))
        if opts.font_scale is not None:
            win.set_text_scale(opts.font_scale)
        if opts.present:
            win.set_presentation(True)
        driver = drive(win)
        poll = QTimer()
        poll.timeout.connect(lambda: None)
        poll.start(SIGNAL_POLL_MS)
        try:
            win.show()
            driver.start()
            code = app.exec()
        finally:
            poll.stop()
        if teardown is not None:
            teardown(win)
        dispose(win)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if stopped:
        exit_code, word = STOPPED_BY[signal.Signals(stopped[0])]
        print(f"kvscope: {word}", file=sys.stderr)
        return exit_code
    return driver.exit_code or code
