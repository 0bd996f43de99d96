"""``HostLoop``: the one loop that drives an engine, wherever it runs.

Between two steps it runs what it was asked (commands for its ``EngineHost``, calls from other threads);
while the host is in Run it steps at the host's pace; otherwise it waits until something arrives. The
engine process runs it on its main thread (commands come through the window's pipe, and the loop's
``wait`` watches the pipe too), the window's ``--engine-thread`` backend on a thread of its own (commands
posted from the GUI thread), ``kvscope --headless --serve`` on the main thread (no commands: the HTTP
server's bridge wakes it). The host owns the source and the server's bridge: the loop only drives it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from kvscope.runtime import protocol as p
from kvscope.runtime.host import EngineHost

T = TypeVar("T")
PAUSING = (p.Pause, p.Shutdown, p.Load)  # commands that end a Step(n) early


class HostLoop:
    def __init__(self, host: EngineHost, wait: Callable[[float | None], bool] | None = None) -> None:
        """``wait(timeout)``: block until woken, input arrives, or ``timeout`` passes (None: no limit); True
        when woken (there may be work to step). By default the loop's own event; the engine process passes one
        that also reads its pipe into ``post``."""
        self.host = host
        self.queue: deque[p.Command] = deque()
        self._calls: deque[tuple[Callable[[], object], Future]] = deque()
        self._event = threading.Event()
        self.wait = wait or self._wait_event
        self.on_idle: Callable[[], None] = lambda: None  # before each wait (the engine process sends a batch)
        self.on_wake: Callable[[], None] = lambda: None  # wake() also calls this (the engine process's self-pipe)
        self._thread: threading.Thread | None = None
        host.interrupted = self.interrupted

    @classmethod
    def over(cls, source, bridge=None, emit=None, load: bool = True) -> HostLoop:
        """A loop over a source already built (headless serving, tests, benchmarks), woken by the bridge (if any).
        With ``load`` it is loaded at once (the bridge attached, serving: in Run); else a ``Load`` does it."""
        host = EngineHost(lambda _scenario, progress=None: source, emit or (lambda _res: None), bridge)
        loop = cls(host)
        if bridge is not None:
            bridge.wake = loop.wake
        if load:
            host.handle(p.Load(None))
        return loop

    # -- from any thread ---------------------------------------------------------------------------
    def post(self, cmd: p.Command) -> None:
        self.queue.append(cmd)
        self.wake()

    def wake(self) -> None:
        """There is work (a command, a call, a request the server's bridge took in)."""
        self._event.set()
        self.on_wake()

    def call(self, fn: Callable[[], T], timeout: float | None = 30.0) -> T:
        """Run ``fn`` on the loop's thread between two steps and return its result (a safe look at the engine)."""
        fut: Future = Future()
        self._calls.append((fn, fut))
        self.wake()
        return fut.result(timeout)

    def stop(self) -> None:
        self.post(p.Shutdown())

    # -- on the loop's thread ------------------------------------------------------------------------
    def interrupted(self) -> bool:
        """Whether a command waiting would end a ``Step(n)`` (the host asks between its steps)."""
        self.wait(0.0)  # the engine process reads its pipe here
        return any(isinstance(c, PAUSING) for c in self.queue)

    def run(self) -> None:
        """Until the host handles a ``Shutdown``."""
        host, queue = self.host, self.queue
        next_tick, idle = 0.0, False
        while True:
            while self._calls:
                fn, fut = self._calls.popleft()
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)
            if queue:
                idle = False
                if not host.handle(queue.popleft()):
                    return
                continue
            now = time.monotonic()
            if host.running and not idle and now >= next_tick:
                next_tick = now + host.interval_ms / 1000
                # Serving with nothing to do: stay in Run, idle, until the bridge wakes the loop.
                idle = not host.tick() and host.running
                continue
            self.on_idle()
            timeout = None if not host.running or idle else max(0.0, next_tick - now)
            if self.wait(timeout):
                idle = False

    def _wait_event(self, timeout: float | None) -> bool:
        if self._calls or self.queue:
            return True
        # At most a second at a time: a signal handler (Ctrl+C in headless serving) runs between two waits.
        woke = self._event.wait(1.0 if timeout is None else timeout)
        self._event.clear()  # cleared before the queue is read again: a wake landing in between is not lost
        return woke

    def start(self, name: str = "kvscope-engine") -> None:
        """Run on a daemon thread of its own."""
        self._thread = threading.Thread(target=self.run, name=name, daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = 10.0) -> None:
        """Stop (the host shuts down: the source closes, the bridge detaches) and wait for the thread."""
        self.stop()
        if self._thread is not None:
            self._thread.join(timeout)
