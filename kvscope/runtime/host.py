"""``EngineHost``: owns a source and carries out the window's commands (no Qt).

The same host runs on a worker thread of the window's process (``ThreadBackend``) and in a
child engine process (``ProcessBackend``); each result goes to ``emit``.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import traceback
from collections.abc import Callable

from engine.messages import one_line
from kvscope.runtime import protocol as p
from kvscope.sources.base import REMOTE_STEPPING, Source
from kvscope.sysinfo import MemoryProbe, MemoryReading

MEMORY_READ_EVERY_S = 0.05  # the memory plot's resolution: a reading per step cost ~0.3 ms of a small step

logger = logging.getLogger("kvscope")

# scenario name (None: the command line's, "": none) -> source; a factory with a ``progress`` keyword
# is told where to report (text, fraction) while it loads.
SourceFactory = Callable[..., Source]


def vocab_of(source) -> tuple[str, ...]:
    """Each token id's own text (the window draws one token a slot and decodes nothing itself).

    Decoding 49,152 tokens one by one takes ~0.3 s of every start; for a model whose conversion kvscope
    caches (a GGUF file), the texts are kept beside the converted weights and read back instead.
    """
    own = getattr(source, "vocab", None)
    if own is not None:  # a source without an engine of its own (a probed vLLM) that knows its tokenizer
        return own()
    engine = getattr(source, "engine", None)
    tok = getattr(engine, "tokenizer", None)
    if tok is None:
        return ()
    n = engine.vocab_size
    cache = vocab_cache_file(engine)
    if cache is not None:
        try:
            texts = json.loads(cache.read_text(encoding="utf-8"))
            if isinstance(texts, list) and len(texts) == n and all(isinstance(t, str) for t in texts):
                return tuple(texts)
        except (OSError, ValueError):
            pass  # absent or torn: decode and write it again
    texts = tok.batch_decode([[i] for i in range(n)], skip_special_tokens=False)
    if cache is not None:
        try:
            tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(texts), encoding="utf-8")
            tmp.replace(cache)
        except OSError:
            pass  # a read-only cache: decode again next time
    return tuple(texts)


def vocab_cache_file(engine):
    """Where a GGUF model's token texts are kept (its conversion's cache folder), else None."""
    src = getattr(engine, "source", None)
    if src is None or not src.gguf_file or getattr(engine.config, "tokenizer", None):
        return None
    from engine.runner.models.loader import COMPLETE, gguf_cache_dir

    folder = gguf_cache_dir(src)
    return folder / "kvscope-vocab.json" if (folder / COMPLETE).is_file() else None


class EngineHost:
    """``bridge``: an HTTP server's ``RequestBridge`` (kvscope.serve): with one, a live source starts
    in Run and stays in Run when idle (the driver waits for the bridge's wake-up), and every command
    settles the bridge, so a client whose request was aborted here gets its answer at once.
    ``raw_snapshots`` (an engine process): a live source's records carry the raw ``PoolState``, which
    the wire sends and the window's process assembles."""

    def __init__(
        self,
        factory: SourceFactory,
        emit: Callable[[p.Result], None],
        bridge=None,
        raw_snapshots: bool = False,
        on_load: Callable[[], None] | None = None,
    ) -> None:
        """``on_load``: called after each successful load (the engine process tunes its collector there)."""
        self.factory = factory
        self.on_load = on_load or (lambda: None)
        self.emit = emit
        self.bridge = bridge
        self.raw_snapshots = raw_snapshots
        self.source: Source | None = None
        self.running = False
        self.interval_ms = 0
        self.audit_enabled = False
        self._probe: MemoryProbe | None = None
        self.interrupted: Callable[[], bool] = lambda: False  # checked between the steps of a Step(n)

    @property
    def engine(self):
        return getattr(self.source, "engine", None)

    @property
    def serving(self) -> bool:
        return self.bridge is not None and self.engine is not None

    # -- dispatch ------------------------------------------------------------------------
    def handle(self, cmd: p.Command) -> bool:
        """Carry out one command; False once the host has shut down."""
        match cmd:
            case p.Load(scenario):
                self.load(scenario)
            case p.Step(n):
                for _ in range(max(1, n)):
                    if not self.step_once() or self.interrupted():
                        break
            case p.Run():
                if self.source is not None:
                    self._set_running(True)
            case p.Pause():
                self._set_running(False)
            case p.SetInterval(ms):
                self.interval_ms = max(0, ms)
            case p.Inject(spec):
                rid = self._command(
                    "request refused",
                    self._source().inject if self.source else None,
                    spec.prompt,
                    spec.params,
                    spec.request_id,
                )
                if rid is not None:
                    self.emit(p.Injected(rid))
            case p.Abort(rid):
                if self._command("abort", self.source.abort if self.source else None, rid) is False:
                    self.emit(p.Error(f"request {rid} is not running or waiting"))
            case p.Fork(rid):
                child = self._command("fork", self.source.fork if self.source else None, rid)
                if child is not None:
                    self.emit(p.Injected(child))
            case p.ResetPrefixCache():
                self._command("reset prefix cache", self.source.reset_prefix_cache if self.source else None)
            case p.SetAudit(on):
                self.audit_enabled = on
                if self.source is not None and not self.source.info.read_only:
                    self.source.set_audit(on)
                    self._send(self.source.current())
            case p.CompareCaching(prompts, max_tokens):
                self.compare_caching(prompts, max_tokens)
            case p.Shutdown():
                self.shutdown()
                return False
            case _:
                self.emit(p.Error(f"unknown command {cmd!r}"))
        return True

    def _source(self) -> Source:
        return self.source

    def compare_caching(self, prompts, max_tokens: int) -> None:
        """Two fresh engines on the loaded weights; the loaded one is left as it was."""
        compare = getattr(self.source, "compare_caching", None)
        if compare is None:
            self.emit(p.Error("comparing caching on and off needs a live engine, not a trace replay"))
            return
        if not prompts:
            self.emit(p.Error("nothing to compare: inject a request or load a scenario first"))
            return
        self.emit(p.Progress(f"running {len(prompts)} requests with caching on, then off…", None))
        try:
            c = compare([list(x) for x in prompts], max_tokens)
        except Exception as e:  # noqa: BLE001 - the window shows it and stays usable
            self.emit(p.Error(f"caching comparison failed: {one_line(e)}"))
            return
        self.emit(p.Compared(c.summary(), c.divergence.to_dict() if c.divergence else None))

    # -- lifecycle -------------------------------------------------------------------
    def load(self, scenario: str | None) -> None:
        self._set_running(False)
        self.emit(p.Progress(f"loading {'scenario ' + scenario if scenario else 'the model'}…"))
        if self.source is not None:
            if self.bridge is not None:
                self.bridge.detach("the engine is being reloaded")
            self.source.close()
            self.source = None
        try:
            if "progress" in inspect.signature(self.factory).parameters:
                source = self.factory(
                    scenario, progress=lambda text, fraction=None: self.emit(p.Progress(text, fraction))
                )
            else:
                source = self.factory(scenario)
        except Exception as e:  # noqa: BLE001 - the window shows it and stays usable
            if self.bridge is not None:
                self.bridge.detach(f"the model failed to load: {one_line(e)}")
            self.emit(p.LoadFailed(one_line(e), isinstance(e, (ValueError, OSError))))
            return
        self.source = source
        if self.raw_snapshots and hasattr(source, "raw_snapshots"):
            source.raw_snapshots = True
        info = source.info
        if self.audit_enabled and not info.read_only:
            source.set_audit(True)
        self._probe = MemoryProbe.for_device(info.device, MEMORY_READ_EVERY_S)
        self.on_load()
        self.emit(p.Loaded(info, vocab_of(source)))
        if not info.read_only or REMOTE_STEPPING in info.capabilities:
            self._send(source.current())
        if REMOTE_STEPPING in info.capabilities:
            self._set_running(True)  # a running engine elsewhere: shown as it goes until Pause holds it
        if self.bridge is not None:
            if self.serving:
                if self.bridge not in source.hooks:
                    source.hooks.append(self.bridge)
                self.bridge.attach(self.engine)
                self._set_running(True)  # serving: requests are stepped as they come
            else:
                self.bridge.detach("a trace replay cannot serve requests")

    def shutdown(self) -> None:
        if self.source is not None and REMOTE_STEPPING in self.source.info.capabilities:
            self.source.close()  # before the pause below: a window that goes lets the engine run on
            self.source = None
        self._set_running(False)
        if self.bridge is not None:
            self.bridge.detach("the server is shutting down")
            self.bridge.wake = None  # late requests must not wake a host that is gone
        if self.source is not None:
            self.source.close()
        self.source = None

    # -- running -------------------------------------------------------------------
    def _set_running(self, on: bool) -> None:
        if on != self.running:
            self.running = on
            src = self.source
            self.emit(p.RunningChanged(on))
            if src is not None and REMOTE_STEPPING in src.info.capabilities:
                for rec in src.hold(not on):  # Pause holds the engine itself (and shows where it stopped)
                    self._send(rec)

    def tick(self) -> bool:
        """One step of a run; returns whether a step ran. With nothing left to do it pauses, except
        while serving: then it stays in Run, idle, until the bridge wakes the driver."""
        if not self.running:
            return False
        if self.source is not None and self.source.has_work():
            if self.step_once():
                return True
        elif self.serving:
            return False
        self._set_running(False)
        return False

    def step_once(self) -> bool:
        src = self.source
        if src is None or (src.info.read_only and not src.has_work()):
            return False
        try:
            rec = src.step()
        except Exception as e:  # noqa: BLE001 - report, keep the host alive
            traceback.print_exc()
            self.emit(p.Error(f"step failed: {one_line(e)}"))
            return False
        self._send(rec)
        if rec.error:
            self.emit(p.Error(f"step {rec.step} failed: {rec.error} (its requests were finished with an error)"))
        return True

    def _command(self, what: str, fn, *args):
        if self.source is None or fn is None:
            self.emit(p.Error("no model is loaded"))
            return None
        try:
            result = fn(*args)
        except Exception as e:  # noqa: BLE001 - a refused command is a message, not a crash
            self.emit(p.Error(f"{what}: {one_line(e)}", refused=isinstance(e, ValueError)))
            return None
        self._send(self.source.current())
        if self.serving:
            self.bridge.settle(self.engine)  # an HTTP request aborted here gets its answer now
        return result

    def _send(self, rec) -> None:
        mem = self._probe.read() if self._probe else MemoryReading()
        self.emit(p.Stepped(rec, mem))
        if getattr(rec, "notice", None):
            self.emit(p.Error(rec.notice))
