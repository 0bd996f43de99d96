"""``RequestBridge``: where HTTP handlers (the server's asyncio loop) meet the engine (its own thread).

Handlers never touch the engine. They call two thread-safe methods, ``submit`` (a prompt and its
``SamplingParams``, giving back a ``RequestStream``) and ``abort``. Whoever owns the ``LiveSource``
steps it, with the bridge among its hooks: ``before_step`` moves the submissions into
``engine.add_request`` (a refusal resolves the stream with the reason) and the aborts into
``engine.abort``, so a disconnected client's blocks are back before the next step runs;
``after_step`` routes each output of the step to its stream (``call_soon_threadsafe``) and updates
the metrics. ``wake`` (any thread) tells the owner that there is work, so it can start stepping.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine import LLMEngine, SamplingParams
from engine.inputs import PromptType, to_token_ids
from engine.messages import one_line
from engine.outputs import CompletionOutput, RequestOutput, StepOutput
from kvscope.serve.metrics import ServeMetrics

logger = logging.getLogger("kvscope.serve")


class RequestRefused(Exception):
    """The engine would not take the request (HTTP ``status``: 400 bad input, 503 no engine, 500 other)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.status = message, status


class RequestFailed(RequestRefused):
    """A request that was running ended without a result (the engine went away)."""


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    max_model_len: int
    created: int


@dataclass(frozen=True, slots=True)
class AbortRecord:
    """One abort the bridge carried out: asked for after step ``requested_after``, done before step
    ``done_after + 1`` ran (``done_after - requested_after`` is at most the one step in flight)."""

    request_id: str
    reason: str
    requested_after: int
    done_after: int
    admitted: bool  # False: it never reached the engine


class RequestStream:
    """One request's outputs, read on the server's loop; written from the engine's thread."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.submitted_at = time.monotonic()
        self._queue: asyncio.Queue[tuple[str, object]] = asyncio.Queue()
        # Engine-thread state:
        self.first_token_at: float | None = None
        self.prompt_token_ids: list[int] = []
        self.n = 1
        self.last: RequestOutput | None = None

    def push(self, kind: str, payload: object = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self._queue.put_nowait, (kind, payload))
        except RuntimeError:  # the server's loop has closed: nobody is listening any more
            pass

    async def accepted(self) -> None:
        """Returns once the engine has queued the request; raises ``RequestRefused`` if it would not."""
        kind, payload = await self._queue.get()
        if kind != "accepted":
            raise payload  # type: ignore[misc]

    async def next_output(self) -> RequestOutput:
        """The request's next (cumulative) output; the last has ``finished``. Raises ``RequestFailed``."""
        kind, payload = await self._queue.get()
        if kind != "output":
            raise payload  # type: ignore[misc]
        return payload  # type: ignore[return-value]


@dataclass(slots=True)
class _Submission:
    stream: RequestStream
    prompt: PromptType
    params: SamplingParams
    client: str
    fill_max_tokens: bool


class RequestBridge:
    def __init__(self, metrics: ServeMetrics | None = None, wake: Callable[[], None] | None = None) -> None:
        self.metrics = metrics or ServeMetrics()
        self.wake = wake
        self.model: ModelInfo | None = None  # None: no engine to serve (loading, or a trace replay)
        self.unavailable = "the model is loading"
        self.steps_seen = 0  # the engine's step count after the last step (read from any thread)
        self.abort_log: deque[AbortRecord] = deque(maxlen=100_000)
        self._lock = threading.Lock()
        self._submissions: list[_Submission] = []
        self._aborts: dict[str, tuple[str, int]] = {}  # request id -> (reason, steps_seen when asked)
        self._streams: dict[str, RequestStream] = {}  # admitted, unfinished (engine thread only)
        self._ids = itertools.count()

    # -- any thread (the handlers') ------------------------------------------------------
    def submit(
        self,
        prompt: PromptType,
        params: SamplingParams,
        client: str = "",
        kind: str = "cmpl",
        fill_max_tokens: bool = False,
    ) -> RequestStream:
        """Queue a request for the next step; call it on the loop that will read the stream.

        ``fill_max_tokens``: generate up to the end of the context (or of the pool, if smaller).
        """
        stream = RequestStream(f"{kind}-{next(self._ids)}", asyncio.get_running_loop())
        with self._lock:
            self._submissions.append(_Submission(stream, prompt, params, client, fill_max_tokens))
        self._wake()
        return stream

    def abort(self, request_id: str, reason: str) -> None:
        with self._lock:
            self._aborts.setdefault(request_id, (reason, self.steps_seen))
        self._wake()

    def pending(self) -> tuple[int, int]:
        """(submissions, aborts) waiting for the next step."""
        with self._lock:
            return len(self._submissions), len(self._aborts)

    def _wake(self) -> None:
        if self.wake is not None:
            self.wake()

    # -- the engine's thread: its owner ----------------------------------------------------
    def attach(self, engine: LLMEngine) -> None:
        """Serve this engine (call it on the engine's thread once it is loaded)."""
        self.steps_seen = engine.step_count
        self.metrics.attach(engine.model_name, engine.metrics())
        self.model = ModelInfo(engine.model_name, engine.max_model_len, int(time.time()))

    def detach(self, reason: str) -> None:
        """Stop serving (the engine is being replaced or closed): every open request ends with 503."""
        self.model = None
        self.unavailable = reason
        with self._lock:
            subs, self._submissions = self._submissions, []
            self._aborts.clear()
        for sub in subs:
            sub.stream.push("refused", RequestRefused(reason, 503))
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.push("failed", RequestFailed(reason, 503))

    # -- the engine's thread: StepHook -----------------------------------------------------
    def before_step(self, engine: LLMEngine) -> None:
        with self._lock:
            subs, self._submissions = self._submissions, []
            aborts, self._aborts = self._aborts, {}
        done_after = engine.step_count
        for sub in subs:
            rid = sub.stream.request_id
            if rid in aborts:  # gone before it reached the engine
                reason, asked = aborts.pop(rid)
                self.abort_log.append(AbortRecord(rid, reason, asked, done_after, admitted=False))
                sub.stream.push("refused", RequestRefused(f"aborted: {reason}", 499))
                continue
            self._admit(engine, sub)
        for rid, (reason, asked) in aborts.items():
            stream = self._streams.pop(rid, None)
            if stream is None:  # it finished in the meantime: nothing to give back
                continue
            engine.abort(rid)
            self.abort_log.append(AbortRecord(rid, reason, asked, done_after, admitted=True))
            self.metrics.observe_finished(time.monotonic() - stream.submitted_at, "abort")
            stream.push("failed", RequestFailed(f"aborted: {reason}", 499))

    def _admit(self, engine: LLMEngine, sub: _Submission) -> None:
        stream = sub.stream
        params = sub.params
        try:
            if sub.fill_max_tokens:
                ids, _ = to_token_ids(sub.prompt, engine.tokenizer, engine.vocab_size)
                room = min(engine.max_model_len, engine.pool.num_blocks * engine.config.block_size) - len(ids)
                params = dataclasses.replace(params, max_tokens=max(room, 1))
            engine.add_request(sub.prompt, params, request_id=stream.request_id, client=sub.client)
        except Exception as e:  # noqa: BLE001 - a refusal is the client's answer, not a crash
            bad_input = isinstance(e, (ValueError, TypeError, LookupError)) or "Template" in type(e).__name__
            if not bad_input:
                logger.exception("request %s refused", stream.request_id)
            stream.push("refused", RequestRefused(one_line(e), 400 if bad_input else 500))
            return
        stream.prompt_token_ids = engine.requests[stream.request_id].prompt_token_ids
        stream.n = params.n
        self._streams[stream.request_id] = stream
        stream.push("accepted")

    def after_step(self, engine: LLMEngine, out: StepOutput) -> None:
        self.steps_seen = engine.step_count
        now = time.monotonic()
        for o in out.outputs:
            stream = self._streams.get(o.request_id)
            if stream is None:  # not ours: the window's, a scenario's
                continue
            if stream.first_token_at is None and any(c.token_ids for c in o.outputs):
                stream.first_token_at = now
                self.metrics.observe_first_token(now - stream.submitted_at)
            stream.last = o
            if o.finished:
                del self._streams[o.request_id]
                reason = "error" if o.error else next((c.finish_reason for c in o.outputs if c.finish_reason), "stop")
                self.metrics.observe_finished(now - stream.submitted_at, reason)
            stream.push("output", o)
        self.settle(engine)

    def settle(self, engine: LLMEngine) -> None:
        """Answer the requests that ended without an output (the window's Abort button), and refresh the gauges.

        Runs after every step; the owner may also call it after a command between steps, so a paused
        engine still answers the client of a request it aborted.
        """
        now = time.monotonic()
        for rid in self._vanished(engine):
            stream = self._streams.pop(rid)
            self.metrics.observe_finished(now - stream.submitted_at, "abort")
            stream.push("output", _aborted_output(stream))
        self.metrics.update(engine.metrics())

    def has_work(self, engine: LLMEngine) -> bool:
        return bool(self._submissions or self._aborts) or bool(self._vanished(engine))

    def _vanished(self, engine: LLMEngine) -> list[str]:
        if not self._streams:
            return []
        live = {r.group_id for r in engine.requests.values()}
        return [rid for rid in self._streams if rid not in live]


def _aborted_output(stream: RequestStream) -> RequestOutput:
    last = stream.last
    comps = last.outputs if last is not None else [CompletionOutput(i, "", []) for i in range(stream.n)]
    comps = [CompletionOutput(c.index, c.text, list(c.token_ids), c.finish_reason or "abort") for c in comps]
    return RequestOutput(
        stream.request_id,
        last.prompt if last else None,
        stream.prompt_token_ids,
        comps,
        True,
        last.num_cached_tokens if last else 0,
    )
