"""The engine process: an ``EngineHost`` fed by a pipe (no Qt in this process).

Besides the window's commands the pipe carries three housekeeping messages: the window
attaches the shared-memory slots, releases a slot once it has copied it, and the engine
process sends a heartbeat, so that a hung engine is told from a busy one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.connection import wait as mp_wait

from engine.gc_policy import tune_gc
from engine.messages import log_to_terminal
from kvscope.runtime import protocol as p
from kvscope.runtime.build import SourceSpec
from kvscope.runtime.host import EngineHost
from kvscope.runtime.loop import HostLoop
from kvscope.runtime.shm import ShmSlots, SlotSpec
from kvscope.runtime.wire import RecordEncoder
from kvscope.stopping import signals_held

HEARTBEAT_S = 0.5


@dataclass(frozen=True, slots=True)
class AttachSlots:
    spec: SlotSpec


@dataclass(frozen=True, slots=True)
class ReleaseSlot:
    slot: int


@dataclass(frozen=True, slots=True)
class Heartbeat:
    pass


@dataclass(slots=True)
class SpawnedEngine:
    """An engine process started (and told to load) before the window exists: its start-up (torch,
    the weights) runs while this process imports Qt and builds the window. The backend adopts it."""

    spec: SourceSpec
    proc: object  # multiprocessing.Process
    conn: object  # our end of the pipe


@contextlib.contextmanager
def _start_unbroken() -> Iterator[None]:
    """A Ctrl+C or SIGTERM cannot break the engine process's start, in either process.

    In this one a signal that stopped the run inside ``Process.start`` left the child reading its pickled
    start-up data from a pipe closed half-written: it printed an EOFError traceback under the run's one line
    (seen in CI). Here the signal waits for the start (``signals_held``, main thread only: Python sets handlers
    nowhere else). In the child, SIGINT stays blocked from birth (the signal mask goes through fork and exec)
    until ``engine_process_main`` ignores it: Ctrl+C at a terminal reaches the whole process group, and the
    child, still importing, raised KeyboardInterrupt with a traceback."""
    main = threading.current_thread() is threading.main_thread()
    with signals_held() if main else contextlib.nullcontext():
        # Started first: starting it inside ``Process.start`` unblocks SIGINT (its own guard ends in SIG_UNBLOCK).
        resource_tracker.ensure_running()
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


def spawn_engine(spec: SourceSpec, log_level: int, load=None) -> SpawnedEngine:
    """Start the engine process; ``load``, if given, is sent at once (a ``protocol.Load``)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=True)
    proc = ctx.Process(
        target=engine_process_main,
        args=(child, spec),
        kwargs={"log_level": log_level},
        name="kvscope-engine",
        daemon=True,
    )
    with _start_unbroken():
        proc.start()
    child.close()
    if load is not None:
        parent.send(load)
    return SpawnedEngine(spec, proc, parent)


def leave_a_core_to_the_window() -> int:
    """Give the engine's CPU threads (torch's intra-op pool) one core fewer than this process may use, unless
    ``OMP_NUM_THREADS`` says how many; returns the number. The window's process works beside the engine's:
    on a 2-core machine two spinning OpenMP threads took the window's core, and the tiny model ran at 0.37x
    its bare rate with the window attached (0.69x with one thread), while a model that small gains nothing
    from a second thread. On a GPU the CPU threads hardly work at all."""
    if "OMP_NUM_THREADS" in os.environ:
        try:
            return max(1, int(os.environ["OMP_NUM_THREADS"].split(",")[0]))
        except ValueError:  # OpenMP's own problem to report
            return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    n = max(1, cores - 1)
    os.environ["OMP_NUM_THREADS"] = str(n)  # read when torch is first imported (by the model's load)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(n)
    return n


def engine_process_main(
    conn, spec: SourceSpec, heartbeat_s: float = HEARTBEAT_S, log_level: int = logging.INFO
) -> None:
    leave_a_core_to_the_window()
    # Ctrl+C in the terminal is the window's to handle: it shuts this process down in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked from birth (_start_unbroken)
    # The engine's log (the pool's size, the weights, warnings) goes to the terminal as it would
    # with the engine in the window's process.
    log_to_terminal(log_level)
    lock = threading.Lock()
    alive = threading.Event()
    alive.set()

    def send(obj) -> None:
        # Plain pickle, read by the window's ``conn.recv()`` as it is: Connection.send would build a
        # ForkingPickler (and copy its reducer table) for every record; nothing sent here needs one.
        data = pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
        with lock:
            conn.send_bytes(data)

    encoder = RecordEncoder()

    def flush() -> None:
        batch = encoder.flush()
        if batch is not None:
            send(batch)

    # An HTTP server beside the engine lives in this process too (its handlers wake the loop through a self-pipe
    # that the loop's wait watches with the window's pipe); a port it cannot take is the load's failure.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    server = None
    if spec.serve is not None:
        from kvscope.serve.server import start_server  # FastAPI and uvicorn: only where a server runs

        try:
            server = start_server(spec.serve)
        except OSError as e:
            send(p.LoadFailed(f"cannot serve: {e}"))

    def wait(timeout: float | None) -> bool:
        """The loop's wait: the window's pipe (read into the loop's queue) and the server's wake-ups."""
        woke = False
        ready = mp_wait([conn, wake_r], timeout)
        if wake_r in ready:
            os.read(wake_r, 4096)
            woke = True
        if conn in ready:
            pump()
        return woke

    def pump() -> None:
        while conn.poll(0):
            msg = conn.recv()
            if isinstance(msg, ReleaseSlot):
                encoder.release(msg.slot)
            elif isinstance(msg, AttachSlots):
                encoder.attach(ShmSlots.attach(msg.spec))
            else:
                loop.queue.append(msg)

    def emit(res: p.Result) -> None:
        if isinstance(res, p.Stepped):
            encoder.add(res)  # read now: a live record is valid only until the engine goes on
            if encoder.due:
                flush()
                # At full speed the next tick is due at once, so the pipe is read here, a batch at a time: a
                # Pause, and the window's slot releases (without them every batch after the third would carry
                # its arrays pickled instead of through shared memory).
                pump()
            return
        flush()  # the steps before it go first
        if isinstance(res, p.Loaded):
            encoder.detach()  # the window sizes new slots for this source's pool
            encoder.loaded()
        send(res)

    # the collector tuned for the loaded heap after each load (engine.gc_policy)
    host = EngineHost(spec.factory, emit, server.bridge if server else None, raw_snapshots=True, on_load=tune_gc)
    loop = HostLoop(host, wait)
    loop.on_idle = flush  # nothing is sent while waiting: what is pending goes now

    def wake_pipe() -> None:
        try:
            os.write(wake_w, b"w")
        except BlockingIOError:  # a wake-up is already pending
            pass

    loop.on_wake = wake_pipe
    if server is not None:
        server.bridge.wake = loop.wake

    def beat() -> None:
        while alive.is_set():
            try:
                send(Heartbeat())
            except OSError:
                return
            time.sleep(heartbeat_s)

    threading.Thread(target=beat, name="heartbeat", daemon=True).start()
    try:
        loop.run()
    except (EOFError, OSError):
        pass  # the window went away: nothing to report to
    finally:
        alive.clear()
        host.shutdown()
        encoder.detach()
        if server is not None:
            server.stop()
