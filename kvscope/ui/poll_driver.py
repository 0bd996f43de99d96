"""``PollDriver``: steps a ``Source`` on a timer on the GUI thread and shows each record in its window.

For the sources whose windows draw what they read from the source between steps: an attached engine's forest,
a fleet, a simulated fleet. (The main window's sources run in an engine process or thread and reach it as
records over the wire: ``ui.worker``.) Each tick is one ``source.step()``, shown with ``win.on_step(rec, last)``;
``before_step`` runs first (a demo steps its engines there). With a screenshot, after ``steps`` steps (or at the
source's end) the window prepares what a person would see by hovering (``prepare_screenshot``) and is saved and
closed.
"""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import QObject, QTimer
from PySide6.QtWidgets import QApplication

from kvscope.ui.screenshot import save_window


class PollDriver(QObject):
    def __init__(
        self,
        win,
        source,
        interval: float,
        steps: int | None = None,
        screenshot: str | None = None,
        before_step: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(win)
        self.win, self.source, self.steps, self.screenshot = win, source, steps, screenshot
        self.before_step = before_step
        self.taken = 0
        self.exit_code = 0
        self.running = False
        self.timer = QTimer(self)
        self.timer.setInterval(max(1, int(interval * 1000)))
        self.timer.timeout.connect(self.tick)

    def start(self) -> None:
        self.running = True
        self.timer.start()

    def toggle(self) -> None:
        """Pause or run on (a window's Run/Pause button)."""
        if self.running:
            self.running = False
            self.timer.stop()
        elif self.source.has_work():
            self.start()

    def tick(self) -> None:
        src = self.source
        if not src.has_work():
            self.running = False
            self.timer.stop()
            self.win.on_step(None, bool(self.screenshot))  # the end: nothing more will come
            if self.screenshot:
                self.save()
            return
        if self.before_step is not None:
            self.before_step()
        rec = src.step()
        self.taken += 1
        last = bool(self.screenshot and self.steps is not None and self.taken >= self.steps)
        self.win.on_step(rec, last)
        if last:
            self.running = False
            self.timer.stop()
            self.save()

    def save(self) -> None:
        QApplication.processEvents()  # laid out at its size first
        self.win.prepare_screenshot()
        self.exit_code = 0 if save_window(self.win, self.screenshot) else 1
        self.win.close()
