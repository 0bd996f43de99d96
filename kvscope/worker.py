"""``EngineWorker``: owns the engine on its own thread; the GUI talks to it by queued signals."""
from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from PySide6.QtCore import QObject, QTimer, Signal, Slot

from engine import LLMEngine, SamplingParams
from engine.audit import AuditReport
from engine.events import Event
from engine.outputs import StepOutput
from engine.snapshot import KVSnapshot

from .sysinfo import MemoryProbe, MemoryReading


@dataclass(frozen=True, slots=True)
class InjectSpec:
    prompt: object  # text, token ids or chat messages
    params: SamplingParams
    request_id: str | None = None


@dataclass(frozen=True, slots=True)
class StepResult:
    """What the GUI gets after each step: copies only, never live engine objects."""
    step: int
    snapshot: KVSnapshot
    events: list[Event]
    step_output: StepOutput | None
    memory: MemoryReading
    step_seconds: float
    audit: AuditReport | None = None


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
    config: dict = field(default_factory=dict)
    decode: Callable[[list[int]], str] | None = None  # the tokenizer's (immutable, thread-safe) decode


class EngineWorker(QObject):
    loaded = Signal(object)  # EngineInfo
    load_failed = Signal(str)
    progress = Signal(str)
    stepped = Signal(object)  # StepResult
    error = Signal(str)
    running_changed = Signal(bool)
    injected = Signal(str)  # request id

    def __init__(self, engine_factory: Callable[[], LLMEngine]) -> None:
        super().__init__()
        self._factory = engine_factory
        self.engine: LLMEngine | None = None
        self._timer: QTimer | None = None
        self._interval_ms = 0
        self._probe: MemoryProbe | None = None
        self.audit_enabled = False

    # -- lifecycle -------------------------------------------------------------------
    @Slot()
    def load(self) -> None:
        self.progress.emit("loading model…")
        try:
            engine = self._factory()
        except Exception as e:  # noqa: BLE001 - the window shows it and stays usable
            self.load_failed.emit(_one_line(e))
            return
        self.engine = engine
        dev = engine.device
        self._probe = MemoryProbe((dev.index or 0) if dev.type == "cuda" else None)
        c = engine.config
        self.loaded.emit(EngineInfo(engine.model_name, str(dev), str(engine.runner.dtype).replace("torch.", ""),
                                    engine.pool.num_blocks, c.block_size, engine.runner.block_bytes,
                                    engine.max_model_len, engine.load_seconds,
                                    {k: getattr(c, k) for k in c.__slots__},
                                    engine.tokenizer.decode if engine.tokenizer is not None else None))
        self._emit(None, [], 0.0)

    @Slot()
    def shutdown(self) -> None:
        """Runs on the worker's thread (blocking call), so its timer dies on the thread it lives on."""
        self.pause()
        self._timer = None
        self.engine = None

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
        if self.engine is None:
            return
        if self._timer is None:
            self._timer = QTimer()  # created here, so it lives on the worker's thread
            self._timer.timeout.connect(self._tick)
        self._timer.setInterval(self._interval_ms)
        self._timer.start()
        self.running_changed.emit(True)

    @Slot()
    def pause(self) -> None:
        if self._timer is not None and self._timer.isActive():
            self._timer.stop()
            self.running_changed.emit(False)

    @Slot()
    def _tick(self) -> None:
        if self.engine is None or not self.engine.has_unfinished():
            self.pause()
            return
        if not self._step_once():
            self.pause()

    @Slot(object)
    def inject(self, spec: InjectSpec) -> None:
        if self.engine is None:
            self.error.emit("no model is loaded")
            return
        try:
            rid = self.engine.add_request(spec.prompt, spec.params, request_id=spec.request_id)
        except Exception as e:  # noqa: BLE001
            self.error.emit(f"request refused: {_one_line(e)}")
            return
        self.injected.emit(rid)
        self._emit(None, self.engine.pool.drain_events(), 0.0)

    @Slot(str)
    def abort(self, request_id: str) -> None:
        if self.engine is None:
            return
        if not self.engine.abort(request_id):
            self.error.emit(f"request {request_id} is not running or waiting")
        self._emit(None, self.engine.pool.drain_events(), 0.0)

    @Slot()
    def reset_prefix_cache(self) -> None:
        if self.engine is None:
            return
        try:
            self.engine.reset_prefix_cache()
        except Exception as e:  # noqa: BLE001
            self.error.emit(_one_line(e))
            return
        self._emit(None, self.engine.pool.drain_events(), 0.0)

    @Slot(bool)
    def set_audit(self, on: bool) -> None:
        self.audit_enabled = on

    # -- internals -----------------------------------------------------------------
    def _step_once(self) -> bool:
        if self.engine is None:
            return False
        t0 = time.perf_counter()
        try:
            out = self.engine.step()
        except Exception as e:  # noqa: BLE001 - report, keep the thread alive
            traceback.print_exc()
            self.error.emit(f"step failed: {_one_line(e)}")
            return False
        self._emit(out, out.events, time.perf_counter() - t0)
        if out.error:
            self.error.emit(f"step {out.step} failed: {out.error} (its requests were finished with an error)")
        return True

    def _emit(self, out: StepOutput | None, events: list[Event], seconds: float) -> None:
        e = self.engine
        audit = e.audit() if self.audit_enabled else None
        mem = self._probe.read() if self._probe else MemoryReading()
        self.stepped.emit(StepResult(e.step_count, e.snapshot(), events, out, mem, seconds, audit))


def _one_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]
