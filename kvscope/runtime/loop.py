"""``SessionLoop``: step a session while it has work, else sleep until woken.

``kvscope --headless --serve`` runs it on the main thread; tests and ``bench/serve_load.py`` run it
on a thread of their own. ``call`` runs a function on the loop's thread between two steps (a safe
look at the engine from another thread).
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from kvscope.sources.base import StepRecord
from kvscope.sources.live import LiveSource

T = TypeVar("T")


class SessionLoop:
    def __init__(self, session: LiveSource, on_step: Callable[[StepRecord], None] | None = None) -> None:
        self.session = session
        self.on_step = on_step
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._calls: deque[tuple[Callable[[], object], Future]] = deque()
        self._thread: threading.Thread | None = None

    def wake(self) -> None:
        """From any thread: there is work (the bridge calls it on every submit and abort)."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def call(self, fn: Callable[[], T], timeout: float | None = 30.0) -> T:
        """Run ``fn`` on the loop's thread between steps and return its result."""
        fut: Future = Future()
        self._calls.append((fn, fut))
        self._wake.set()
        return fut.result(timeout)

    def run(self) -> None:
        while not self._stop.is_set():
            while self._calls:
                fn, fut = self._calls.popleft()
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)
            if self.session.has_work():
                rec = self.session.step()
                if self.on_step is not None:
                    self.on_step(rec)
            else:
                # Cleared before has_work() is asked again, so a wake landing in between is not lost.
                self._wake.wait(1.0)
                self._wake.clear()

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="kvscope-engine", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = 10.0) -> None:
        self.stop()
        if self._thread is not None:
            self._thread.join(timeout)
