"""``EngineWorker``: owns the session (engine or trace replay) on its own thread.

The GUI talks to it only by queued signals and gets copies (snapshots) back.
"""
from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from PySide6.QtCore import QObject, QTimer, Signal, Slot

from engine import SamplingParams

from .session import ReplaySession, Session, StepRecord
from .sysinfo import MemoryProbe, MemoryReading

SessionFactory = Callable[[str | None], "Session | ReplaySession"]  # scenario name (or None) -> session


@dataclass(frozen=True, slots=True)
class InjectSpec:
    prompt: object  # text, token ids or chat messages
    params: SamplingParams
    request_id: str | None = None


@dataclass(frozen=True, slots=True)
class StepResult:
    """What the GUI gets after each step or command: copies only, never live engine objects."""
    record: StepRecord
    memory: MemoryReading

    @property
    def step(self) -> int:
        return self.record.step

    @property
    def snapshot(self):
        return self.record.snapshot

    @property
    def events(self):
        return self.record.events

    @property
    def audit(self):
        return self.record.audit

    @property
    def step_seconds(self) -> float:
        return self.record.seconds


@dataclass(frozen=True, slots=True)
class EngineInfo:
    model_name: str
    device: str
    dtype: str
    num_blocks: int
    block_size: int
    block_bytes: int
    max_model_len: int
    load_seconds: float
    num_cpu_blocks: int = 0
    decode: Callable[[list[int]], str] | None = None  # the tokenizer's (immutable, thread-safe) decode
    scenario: str | None = None
    read_only: bool = False
    extra: dict = field(default_factory=dict)
    kv_cache_dtype: str = "auto"


class EngineWorker(QObject):
    loaded = Signal(object)  # EngineInfo
    load_failed = Signal(str)
    progress = Signal(str)
    stepped = Signal(object)  # StepResult
    error = Signal(str)
    running_changed = Signal(bool)
    injected = Signal(str)  # request id
    wake_requested = Signal()  # emitted from any thread (the HTTP server's): there is work to step

    def __init__(self, factory: SessionFactory, bridge=None) -> None:
        super().__init__()
        self._factory = factory
        self.session: Session | ReplaySession | None = None
        self._timer: QTimer | None = None
        self._running = False  # the user's Run; while serving, the timer stops when idle and wakes on work
        self.bridge = bridge  # a kvscope.serve RequestBridge, or None
        if bridge is not None:
            self.wake_requested.connect(self._on_wake)  # queued: runs on the worker's thread
            bridge.wake = self.wake_requested.emit
        self._interval_ms = 0
        self._probe: MemoryProbe | None = None
        self.audit_enabled = False

    @property
    def engine(self):
        return getattr(self.session, "engine", None)

    # -- lifecycle -------------------------------------------------------------------
    @Slot()
    def load(self) -> None:
        self.load_scenario("")

    @Slot(str)
    def load_scenario(self, name: str) -> None:
        self.pause()
        self.progress.emit(f"loading {'scenario ' + name if name else 'the model'}…")
        if self.session is not None:
            if self.bridge is not None:
                self.bridge.detach("the engine is being reloaded")
            self.session.close()
            self.session = None
        try:
            session = self._factory(name or None)
        except Exception as e:  # noqa: BLE001 - the window shows it and stays usable
            if self.bridge is not None:
                self.bridge.detach(f"the model failed to load: {_one_line(e)}")
            self.load_failed.emit(_one_line(e))
            return
        self.session = session
        if isinstance(session, Session):
            session.audit_enabled = session.audit_enabled or self.audit_enabled
        d = session.describe()
        dev = d["device"]
        self._probe = MemoryProbe(int(dev.split(":")[1]) if dev.startswith("cuda:") else
                                  (0 if dev == "cuda" else None))
        self.loaded.emit(EngineInfo(d["model_name"], dev, d["dtype"], d["num_blocks"], d["block_size"],
                                    d["block_bytes"], d["max_model_len"], d["load_seconds"], d["num_cpu_blocks"],
                                    d["decode"], d["scenario"], session.read_only,
                                    kv_cache_dtype=d.get("kv_cache_dtype", "auto")))
        if not session.read_only:
            self._send(session.current())
        if self.bridge is not None:
            if isinstance(session, Session):
                self.bridge.attach(session.engine)
                self.run()  # serving: requests are stepped as they come
            else:
                self.bridge.detach("a trace replay cannot serve requests")

    @Slot()
    def shutdown(self) -> None:
        """Runs on the worker's thread (blocking call), so its timer dies on the thread it lives on."""
        self.pause()
        self._timer = None
        if self.bridge is not None:
            self.bridge.detach("the server is shutting down")
            self.bridge.wake = None  # this worker is going away: late requests must not emit into it
        if self.session is not None:
            self.session.close()
        self.session = None

    # -- commands ------------------------------------------------------------------
    @Slot(int)
    def step(self, n: int = 1) -> None:
        for _ in range(max(1, n)):
            if not self._step_once():
                break

    @Slot(int)
    def set_interval(self, ms: int) -> None:
        self._interval_ms = max(0, ms)
        if self._timer is not None:
            self._timer.setInterval(self._interval_ms)

    @Slot()
    def run(self) -> None:
        if self.session is None:
            return
        if self._timer is None:
            self._timer = QTimer()  # created here, so it lives on the worker's thread
            self._timer.timeout.connect(self._tick)
        self._timer.setInterval(self._interval_ms)
        self._timer.start()
        self._running = True
        self.running_changed.emit(True)

    @Slot()
    def pause(self) -> None:
        if self._running or (self._timer is not None and self._timer.isActive()):
            self._timer.stop()
            self._running = False
            self.running_changed.emit(False)

    @Slot()
    def _tick(self) -> None:
        if self.session is not None and self.session.has_work():
            if not self._step_once():
                self.pause()
        elif self.bridge is not None and isinstance(self.session, Session):
            self._timer.stop()  # idle, still in Run: the server's wake starts the timer again
        else:
            self.pause()

    @Slot()
    def _on_wake(self) -> None:
        if self._running and self._timer is not None and not self._timer.isActive():
            self._timer.start()

    def _command(self, what: str, fn, *args):
        if self.session is None:
            self.error.emit("no model is loaded")
            return None
        try:
            result = fn(*args)
        except Exception as e:  # noqa: BLE001 - a refused command is a message, not a crash
            self.error.emit(f"{what}: {_one_line(e)}")
            return None
        self._send(self.session.current())
        if self.bridge is not None and isinstance(self.session, Session):
            self.bridge.settle(self.session.engine)  # an HTTP request aborted here gets its answer now
            self._on_wake()  # in Run but idle: step the new work
        return result

    @Slot(object)
    def inject(self, spec: InjectSpec) -> None:
        rid = self._command("request refused", lambda: self.session.inject(spec.prompt, spec.params,
                                                                           spec.request_id))
        if rid is not None:
            self.injected.emit(rid)

    @Slot(str)
    def abort(self, request_id: str) -> None:
        if self._command("abort", self.session.abort if self.session else None, request_id) is False:
            self.error.emit(f"request {request_id} is not running or waiting")

    @Slot(str)
    def fork(self, request_id: str) -> None:
        rid = self._command("fork", self.session.fork if self.session else None, request_id)
        if rid is not None:
            self.injected.emit(rid)

    @Slot()
    def reset_prefix_cache(self) -> None:
        self._command("reset prefix cache", self.session.reset_prefix_cache if self.session else None)

    @Slot(bool)
    def set_audit(self, on: bool) -> None:
        self.audit_enabled = on
        if isinstance(self.session, Session):
            self.session.audit_enabled = on or bool(self.session.engine.config.fault)
            self._send(self.session.current())

    # -- internals -----------------------------------------------------------------
    def _step_once(self) -> bool:
        if self.session is None:
            return False
        if self.session.read_only and not self.session.has_work():
            return False
        try:
            rec = self.session.step()
        except Exception as e:  # noqa: BLE001 - report, keep the thread alive
            traceback.print_exc()
            self.error.emit(f"step failed: {_one_line(e)}")
            return False
        self._send(rec)
        out = rec.step_output
        if out is not None and out.error:
            self.error.emit(f"step {out.step} failed: {out.error} (its requests were finished with an error)")
        return True

    def _send(self, rec: StepRecord) -> None:
        mem = self._probe.read() if self._probe else MemoryReading()
        self.stepped.emit(StepResult(rec, mem))


def _one_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]
