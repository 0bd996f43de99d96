"""Pause, step N and run for vLLM's scheduler: the engine core waits at the start of ``schedule()``.

Waiting there keeps vLLM's front end answering (``/health``, new requests queue in the engine core's input
queue) and leaves the pool between two steps, where every table and ref count agree. A pause belongs to the
peer that asked for it (``holder_id``, its socket identity; ``holder`` is its name, for people): when that peer
says goodbye or goes silent, vLLM runs on.
"""

from __future__ import annotations

import threading


class Gate:
    def __init__(self) -> None:
        self._cv = threading.Condition()
        self.paused = False
        self.credits = 0  # schedules allowed before holding again
        self.holder = ""  # the name of the peer holding the pause
        self.holder_id = b""  # and its socket identity (names are the peers' own words: two may share one)
        self.closed = False

    def wait_turn(self) -> None:
        """Called by the engine core at the start of each ``schedule()``: returns when it may schedule."""
        with self._cv:
            while self.paused and self.credits == 0 and not self.closed:
                self._cv.wait(0.5)
            if self.paused and self.credits:
                self.credits -= 1

    @property
    def holding(self) -> bool:
        """Paused with no step left to run: the next ``schedule()`` will wait."""
        return self.paused and self.credits == 0

    def pause(self, holder: str, holder_id: bytes = b"") -> None:
        with self._cv:
            self.paused, self.credits, self.holder, self.holder_id = True, 0, holder, holder_id
            self._cv.notify_all()

    def step(self, n: int, holder: str, holder_id: bytes = b"") -> None:
        with self._cv:
            self.paused, self.holder, self.holder_id = True, holder, holder_id
            self.credits += max(1, n)
            self._cv.notify_all()

    def run(self) -> None:
        with self._cv:
            self.paused, self.credits, self.holder, self.holder_id = False, 0, "", b""
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self.closed = True
            self._cv.notify_all()
