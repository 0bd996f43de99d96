"""Engine backends: the window's side of the protocol in ``kvscope.runtime.protocol``.

``ThreadBackend`` runs the engine's ``HostLoop`` on a thread of this process (tests pass it
factories that close over models already in memory); ``ProcessBackend`` runs it in a spawned engine
process, so the engine never shares a GIL with the window and a crash of the engine (a
segfault, a CUDA error, the OOM killer) leaves the window alive. Both emit the same signals.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal as _signal
import threading
import time
from collections import deque

from PySide6.QtCore import QObject, Qt, QTimer, Signal, Slot

from kvscope.runtime import protocol as p
from kvscope.runtime.build import SourceSpec
from kvscope.runtime.engine_process import AttachSlots, Heartbeat, ReleaseSlot, SpawnedEngine, spawn_engine
from kvscope.runtime.host import EngineHost, SourceFactory
from kvscope.runtime.loop import HostLoop
from kvscope.runtime.shm import ShmSlots
from kvscope.runtime.wire import RecordDecoder, WireBatch
from kvscope.sources.base import InjectSpec, SourceInfo  # noqa: F401 - InjectSpec is part of this module's API

logger = logging.getLogger("kvscope")
HANG_TIMEOUT_S = 15.0  # no heartbeat for this long: the engine process is hung, not busy
START_TIMEOUT_S = 180.0  # from spawn to the first message (imports torch and transformers)
WHOLE_EVERY = 16  # steps: a batch's last step is decoded whole at least this often (the timeline's keyframes)

StepResult = p.Stepped  # what ``stepped`` carries (a record and the memory reading after it)
EngineInfo = SourceInfo


class EngineBackend(QObject):
    """Signals every backend emits on the GUI thread."""

    loaded = Signal(object)  # SourceInfo
    load_failed = Signal(str)
    progress = Signal(str)
    progress_fraction = Signal(object)  # a float in [0, 1], or None: indeterminate
    stepped = Signal(object)  # protocol.Stepped
    error = Signal(str)
    refused = Signal(str)  # an error that is bad input (also emitted as ``error``): a refused request
    running_changed = Signal(bool)
    injected = Signal(str)  # request id
    died = Signal(str)  # the engine process ended or hung; the window keeps the last state
    compared = Signal(str, object)  # a caching comparison's line and its divergence (dict or None)
    _result = Signal(object)  # from the host's thread (or the reader thread) to the GUI thread

    def __init__(self) -> None:
        super().__init__()
        self.vocab: tuple[str, ...] = ()
        self.load_failed_on_bad_input = False  # the last load failed on bad input, not on a crash
        self._result.connect(self._dispatch, Qt.ConnectionType.QueuedConnection)

    @Slot(object)
    def _dispatch(self, res: p.Result) -> None:
        match res:
            case p.Loaded(info, vocab):
                self.vocab = vocab
                self.loaded.emit(info)
            case p.LoadFailed(message, bad_input):
                self.load_failed_on_bad_input = bad_input
                self.load_failed.emit(message)
            case p.Progress(text, fraction):
                self.progress.emit(text)
                self.progress_fraction.emit(fraction)
            case p.Stepped():
                self.stepped.emit(res)
            case p.Error(message, refused):
                if refused:  # first: a screenshot run ends on it, before ``error`` would save the window
                    self.refused.emit(message)
                self.error.emit(message)
            case p.RunningChanged(running):
                self.running_changed.emit(running)
            case p.Injected(rid):
                self.injected.emit(rid)
            case p.Died(message):
                self.died.emit(message)
            case p.Compared(text, divergence):
                self.compared.emit(text, divergence)

    def decode(self, token_ids) -> str | None:
        """Token ids as text (one token's own text each), or None when the model has no tokenizer."""
        if not self.vocab:
            return None
        v = self.vocab
        return "".join(v[t] if 0 <= t < len(v) else f"<{t}>" for t in token_ids)

    # Implemented by each backend.
    def start(self) -> None:
        raise NotImplementedError

    def send(self, cmd: p.Command) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError

    def restart(self) -> None:
        raise ValueError("this engine cannot be restarted")

    @property
    def is_running(self) -> bool:
        raise NotImplementedError


# -- an engine on a worker thread -----------------------------------------------------------
class ThreadBackend(EngineBackend):
    """The engine's ``HostLoop`` on a thread of this process (the same loop as the engine process's): commands
    are posted to it, its results come back through a queued signal to the GUI thread."""

    def __init__(self, factory: SourceFactory, bridge=None) -> None:
        super().__init__()
        self.host = EngineHost(factory, self._result.emit, bridge)
        self.loop = HostLoop(self.host)
        if bridge is not None:
            bridge.wake = self.loop.wake
        self._thread: threading.Thread | None = None

    @property
    def engine(self):
        return self.host.engine

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self._thread = threading.Thread(target=self.loop.run, name="engine", daemon=True)
        self._thread.start()
        self.send(p.Load(None))

    def send(self, cmd: p.Command) -> None:
        self.loop.post(cmd)

    def shutdown(self) -> None:
        """Stop the host (its source closes, its bridge detaches) and wait for the thread."""
        if not self.is_running:
            return
        self.loop.stop()
        self._thread.join(30.0)


# -- an engine in a child process ---------------------------------------------------------------
def describe_exit(code: int | None) -> str:
    if code is None:
        return "stopped responding"
    if code < 0:
        name = _signal.Signals(-code).name if -code in _signal.Signals._value2member_map_ else f"signal {-code}"
        why = {
            "SIGKILL": " (killed: perhaps by the out-of-memory killer)",
            "SIGSEGV": " (a segmentation fault)",
            "SIGABRT": " (aborted)",
            "SIGBUS": " (a bus error)",
        }.get(name, "")
        return f"was killed by {name}{why}"
    return f"exited with code {code}"


class ProcessBackend(EngineBackend):
    """The engine in a spawned process: commands through a pipe, snapshot arrays through shared memory."""

    def __init__(
        self, spec: SourceSpec, hang_timeout_s: float = HANG_TIMEOUT_S, early: SpawnedEngine | None = None
    ) -> None:
        """``early``: an engine process spawned (and loading) before the window was built."""
        super().__init__()
        self.spec = spec
        self.early = early
        self.hang_timeout_s = hang_timeout_s
        self.proc: mp.process.BaseProcess | None = None
        self.conn = None
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._decoder = RecordDecoder()
        self._whole_step = -WHOLE_EVERY  # the step of the last record decoded whole
        self._slots: ShmSlots | None = None
        self._closing = False
        self._reported = False
        self.last_beat: float | None = None  # None until the engine process has said anything
        self._spawned_at = 0.0
        self.scenario: str | None = None  # the last Load's, for a restart
        self._watchdog = QTimer(self)
        self._watchdog.setInterval(500)
        self._watchdog.timeout.connect(self._check_alive)
        # Results from the reader thread wait here; one queued wake-up drains them all, so a
        # fast engine costs the GUI thread one event per batch, not one per step.
        self._inbox: deque[p.Result] = deque()
        self._wake_pending = False
        self._inbox_lock = threading.Lock()
        self._wake.connect(self._drain, Qt.ConnectionType.QueuedConnection)

    _wake = Signal()

    def _post(self, res: p.Result) -> None:
        self._post_all((res,))

    def _post_all(self, results) -> None:
        with self._inbox_lock:
            self._inbox.extend(results)
            if self._wake_pending:
                return
            self._wake_pending = True
        self._wake.emit()

    @Slot()
    def _drain(self) -> None:
        with self._inbox_lock:
            batch, self._inbox = self._inbox, deque()
            self._wake_pending = False
        for res in batch:
            self._dispatch(res)

    @property
    def is_running(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        early, self.early = self.early, None
        if early is not None and early.spec == self.spec and early.proc.is_alive():
            self._adopt(early.proc, early.conn)  # it was told to load when it was spawned
            return
        if early is not None:  # for another spec, or it died: not this window's engine
            early.proc.terminate()
            early.conn.close()
        self._spawn()
        self.send(p.Load(self.scenario))

    def _spawn(self) -> None:
        spawned = spawn_engine(self.spec, logging.getLogger().getEffectiveLevel())
        self._adopt(spawned.proc, spawned.conn)

    def _adopt(self, proc, parent) -> None:
        self.proc = proc
        self.conn = parent
        self._closing = self._reported = False
        self.last_beat, self._spawned_at = None, time.monotonic()
        self._reader = threading.Thread(target=self._read, args=(parent,), name="engine-reader", daemon=True)
        self._reader.start()
        self._watchdog.start()

    def send(self, cmd) -> None:
        if isinstance(cmd, p.Load):
            self.scenario = cmd.scenario
        conn = self.conn
        if conn is None:
            return
        try:
            with self._lock:
                conn.send(cmd)
        except (OSError, ValueError):
            self._report_death()

    # -- the reader thread: blocks on the pipe, so the GUI thread never does -------------------
    def _read(self, conn) -> None:
        # Only the newest step is drawn: a batch is held until what follows it is known; if another batch
        # follows, every step of it is digested (rows, counters, blocks per state; no arrays copied or
        # assembled), else its last step is kept whole (its arrays copied out, assembled only when drawn).
        # Holding one batch keeps one shared-memory slot, so the engine still has the others to write.
        pending: WireBatch | None = None
        while True:
            try:
                if pending is not None and not conn.poll(0):
                    self._handle_batch(pending, True)  # nothing newer has come
                    pending = None
                    continue
                msg = conn.recv()
            except (EOFError, OSError):
                break
            except Exception as e:  # noqa: BLE001 - a message that cannot be decoded is a dead link
                logger.error("engine process sent something unreadable: %s", e)
                break
            self.last_beat = time.monotonic()
            if isinstance(msg, Heartbeat):
                continue
            if isinstance(msg, WireBatch):
                if pending is not None:
                    self._handle_batch(pending, False)
                pending = msg
                continue
            if pending is not None:
                self._handle_batch(pending, True)
                pending = None
            self._handle_other(msg)
        if pending is not None:  # a dying engine's last steps are still shown
            self._handle_batch(pending, True)
        if not self._closing:
            self._post(p.Died(self._death_message()))
            self._reported = True

    def _handle_other(self, msg: p.Result) -> None:
        if isinstance(msg, p.Loaded):
            self._attach_slots(msg.info)
            self._whole_step = -WHOLE_EVERY
        self._post(msg)

    def _handle_batch(self, batch: WireBatch, newest: bool) -> None:
        if batch.slot is not None and self._slots is None:
            self._decoder.skip(batch)  # slots of a pool already replaced
            return
        # The last step is kept whole also when it is the first after a load (it is sent alone), a
        # command's, or WHOLE_EVERY steps after the last one kept whole, so that the timeline's keyframes
        # stay close.
        last = batch.last
        whole = batch.has_arrays and (
            newest
            or last.cache is not None
            or not last.has_output
            or last.step - self._whole_step >= WHOLE_EVERY
            or last.step < self._whole_step
        )
        results = self._decoder.decode(batch, whole)
        if whole:
            self._whole_step = last.step
        if batch.slot is not None:
            self.send(ReleaseSlot(batch.slot))
        self._post_all(results)

    def _attach_slots(self, info: SourceInfo) -> None:
        old, self._slots = self._slots, None
        self._decoder.slots = None
        if old is not None:
            old.close()
        slots = ShmSlots.create(info.num_blocks)
        self._slots = self._decoder.slots = slots
        self.send(AttachSlots(slots.spec))

    def _death_message(self) -> str:
        proc = self.proc
        if proc is not None:
            proc.join(timeout=2.0)
        code = proc.exitcode if proc is not None else None
        return f"the engine process {describe_exit(code)}"

    @Slot()
    def _check_alive(self) -> None:
        if self._closing or self._reported or self.proc is None:
            return
        if not self.proc.is_alive():
            return  # the reader reports an exit
        now = time.monotonic()
        if self.last_beat is None:
            if now - self._spawned_at > START_TIMEOUT_S:
                self._reported = True
                self.died.emit(f"the engine process did not start within {START_TIMEOUT_S:.0f} s")
        elif now - self.last_beat > self.hang_timeout_s:
            self._reported = True
            self.died.emit(f"the engine process stopped responding ({self.hang_timeout_s:g} s without a heartbeat)")

    def _report_death(self) -> None:
        if not self._reported and not self._closing:
            self._reported = True
            self._post(p.Died(self._death_message()))

    # -- lifecycle -------------------------------------------------------------------------------
    def restart(self) -> None:
        """Kill whatever is left of the engine process and start a fresh one (same spec, same scenario)."""
        self._stop(graceful=False)
        self.start()

    def shutdown(self) -> None:
        self._stop(graceful=True)

    def _stop(self, graceful: bool) -> None:
        self._closing = True
        self._watchdog.stop()
        proc, conn = self.proc, self.conn
        if proc is not None and proc.is_alive() and graceful:
            try:
                with self._lock:
                    conn.send(p.Shutdown())
            except (OSError, ValueError):
                pass
            proc.join(timeout=10.0)
        if proc is not None and proc.is_alive():
            proc.kill()
            proc.join(timeout=5.0)
        if conn is not None:
            conn.close()
        if self._reader is not None:
            self._reader.join(timeout=5.0)
        if self._slots is not None:
            self._slots.close()
        self._slots = self._decoder.slots = None
        self.proc = self.conn = self._reader = None
