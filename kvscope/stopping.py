"""How a run stops on a signal, said once for every mode (the window's host, ``--headless``, ``--serve``).

Ctrl+C (SIGINT) and SIGTERM end a run the same way: what it holds is released by its own code (the engine
process, sockets, shared memory), one line on stderr says which signal it was, and the exit code is the shell's
128 + the signal (130, 143). A run that only ends when it is stopped (``--headless --serve``, a headless
``--probe``, ``--attach`` or fleet without ``--duration``) takes either signal as its normal end: it prints its
summary and exits 0.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

STOPPED_BY = {signal.SIGINT: (130, "interrupted"), signal.SIGTERM: (143, "terminated")}


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Python raises KeyboardInterrupt for SIGINT, so that every path that ends a run on
    Ctrl+C ends it the same way on SIGTERM."""


def code_and_line(e: KeyboardInterrupt) -> tuple[int, str]:
    """The exit code and the one line of a run stopped by ``e``."""
    code, word = STOPPED_BY[signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT]
    return code, f"kvscope: {word}"


def _raise_terminated(_signum, _frame) -> None:
    raise Terminated


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises ``Terminated`` in the main thread while this runs (Python's default would kill the process
    with nothing released and nothing said)."""
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM held back while this runs (importing Qt: a KeyboardInterrupt raised inside PySide6's
    import machinery aborts the process), then delivered as soon as it ends, where they stop the run cleanly.

    Held by Python's own handlers, which only note the signal: a mask (``pthread_sigmask``) holds it back from the
    main thread alone, and a signal that another thread took (ZeroMQ's, a reader's) still ran the raising handler
    in the main thread, inside the import (a fatal "libshiboken/signature" error, exit -6, under load)."""
    got: list[int] = []

    def note(signum, _frame) -> None:
        got.append(signum)

    previous = {s: signal.signal(s, note) for s in STOPPED_BY}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if got:  # delivered now, to the handlers the run had (KeyboardInterrupt, Terminated)
            signal.raise_signal(got[0])
