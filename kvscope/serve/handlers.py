"""One completion from the handler's side: submit, wait (racing disconnect and deadline), answer.

Both endpoints share it; ``Shape`` is what differs (text completion or chat, its JSON). Whatever
way a wait ends early (the client left, the deadline passed, the server is stopping), the request
is aborted at once, so the engine gives its blocks back before its next step.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from engine import SamplingParams
from engine.inputs import PromptType
from engine.outputs import RequestOutput
from kvscope.serve import protocol as P
from kvscope.serve.bridge import ModelInfo, RequestBridge, RequestFailed, RequestRefused, RequestStream
from kvscope.serve.deltas import Delta, DeltaTracker
from kvscope.serve.watch import ClientDisconnected, ClientWatch, RequestTimedOut

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    499: "ClientClosedRequest",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    504: "TimeoutError",
}


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message

    def body(self) -> dict:
        return P.error_body(self.message, self.status, ERROR_TYPES.get(self.status, "Error"))


@dataclass(frozen=True, slots=True)
class ServeContext:
    bridge: RequestBridge
    request_timeout: float | None = None
    api_key: str | None = None

    def model(self, name: str | None) -> ModelInfo:
        model = self.bridge.model
        if model is None:
            raise ApiError(503, self.bridge.unavailable)
        if name and name != model.name:
            raise ApiError(404, f"The model `{name}` does not exist.")
        return model


class Flight:
    """A request in the engine, as its handler sees it: aborted at most once, never after it finished."""

    def __init__(self, bridge: RequestBridge, stream: RequestStream) -> None:
        self.bridge, self.stream = bridge, stream
        self.finished = False
        self.aborted = False

    def abort(self, reason: str) -> None:
        if not (self.finished or self.aborted):
            self.aborted = True
            self.bridge.abort(self.stream.request_id, reason)


@dataclass(slots=True)
class Shape:
    """The JSON of one endpoint's answers."""

    chat: bool
    request_id: str
    model: str
    return_token_ids: bool
    created: int = 0

    def __post_init__(self) -> None:
        self.created = int(time.time())

    def response(self, out: RequestOutput) -> dict:
        ids = self.return_token_ids
        comps = sorted(out.outputs, key=lambda c: c.index)
        if self.chat:
            choices = [
                P.ChatChoice(
                    index=c.index,
                    message=P.ChatResponseMessage(content=c.text),
                    finish_reason=c.finish_reason,
                    token_ids=c.token_ids if ids else None,
                )
                for c in comps
            ]
            r = P.ChatCompletionResponse(
                id=self.request_id,
                created=self.created,
                model=self.model,
                choices=choices,
                usage=usage_of(out),
                prompt_token_ids=out.prompt_token_ids if ids else None,
            )
        else:
            choices = [
                P.CompletionChoice(
                    index=c.index, text=c.text, finish_reason=c.finish_reason, token_ids=c.token_ids if ids else None
                )
                for c in comps
            ]
            r = P.CompletionResponse(
                id=self.request_id,
                created=self.created,
                model=self.model,
                choices=choices,
                usage=usage_of(out),
                prompt_token_ids=out.prompt_token_ids if ids else None,
            )
        return r.model_dump()

    def chunk(self, d: Delta, prompt_token_ids: list[int] | None = None, role: bool = False) -> dict:
        ids = d.token_ids if self.return_token_ids else None
        if self.chat:
            delta = P.DeltaMessage(role="assistant", content="") if role else P.DeltaMessage(content=d.text)
            choice = P.ChatStreamChoice(
                index=d.index, delta=delta, finish_reason=d.finish_reason, token_ids=None if role else ids
            )
            c = P.ChatCompletionChunk(
                id=self.request_id,
                created=self.created,
                model=self.model,
                choices=[choice],
                prompt_token_ids=prompt_token_ids,
            )
        else:
            choice = P.CompletionChoice(index=d.index, text=d.text, finish_reason=d.finish_reason, token_ids=ids)
            c = P.CompletionChunk(
                id=self.request_id,
                created=self.created,
                model=self.model,
                choices=[choice],
                prompt_token_ids=prompt_token_ids,
            )
        return c.model_dump()

    def usage_chunk(self, out: RequestOutput) -> dict:
        cls = P.ChatCompletionChunk if self.chat else P.CompletionChunk
        return cls(
            id=self.request_id, created=self.created, model=self.model, choices=[], usage=usage_of(out)
        ).model_dump()


def usage_of(out: RequestOutput) -> P.UsageInfo:
    return P.usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs), out.num_cached_tokens)


def client_of(request: Request) -> str:
    c = request.client
    return f"{c.host}:{c.port}" if c else ""


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


async def complete(
    ctx: ServeContext,
    request: Request,
    body: P._SamplingRequest,
    prompt: PromptType,
    params: SamplingParams,
    fill_max_tokens: bool,
    chat: bool,
) -> Response:
    model = ctx.model(body.model)
    stream = ctx.bridge.submit(prompt, params, client_of(request), "chatcmpl" if chat else "cmpl", fill_max_tokens)
    flight = Flight(ctx.bridge, stream)
    shape = Shape(chat, stream.request_id, model.name, body.return_token_ids)
    watch = ClientWatch(request, ctx.request_timeout)
    try:
        await watch.wait(stream.accepted())
    except RequestRefused as e:  # never admitted: nothing to abort
        watch.close()
        raise ApiError(e.status, e.message) from None
    except BaseException as e:
        watch.close()
        flight.abort(_reason(e))
        if isinstance(e, RequestTimedOut):
            raise ApiError(504, _timeout_message(ctx)) from None
        if isinstance(e, ClientDisconnected):
            return Response(status_code=499)
        raise
    if body.stream:
        events = _events(ctx, flight, watch, shape, params, body.include_usage)
        return EngineStreamingResponse(events)
    return await _collect(ctx, flight, watch, shape)


async def _collect(ctx: ServeContext, flight: Flight, watch: ClientWatch, shape: Shape) -> Response:
    try:
        while True:
            out = await watch.wait(flight.stream.next_output())
            if out.finished:
                flight.finished = True
                break
    except RequestTimedOut:
        flight.abort("timeout")
        raise ApiError(504, _timeout_message(ctx)) from None
    except ClientDisconnected:
        flight.abort("client disconnected")
        return Response(status_code=499)
    except RequestFailed as e:
        flight.finished = True
        raise ApiError(e.status, e.message) from None
    finally:
        watch.close()
        flight.abort("cancelled")  # the handler itself was cancelled (the server is stopping)
    if out.error:
        raise ApiError(500, f"the model step failed: {out.error}")
    return JSONResponse(shape.response(out))


async def _events(
    ctx: ServeContext, flight: Flight, watch: ClientWatch, shape: Shape, params: SamplingParams, include_usage: bool
) -> AsyncIterator[str]:
    """Server-sent events: one chunk per choice per step with new text, then ``[DONE]``."""
    tracker = DeltaTracker(params.stop, with_tokens=shape.return_token_ids)
    prompt_ids = flight.stream.prompt_token_ids if shape.return_token_ids else None
    try:
        if shape.chat:  # as vLLM: a first chunk per choice with the role
            for i in range(params.n):
                yield sse(shape.chunk(Delta(i, "", [], None), prompt_ids, role=True))
                prompt_ids = None
        while True:
            try:
                out = await watch.wait(flight.stream.next_output())
            except RequestTimedOut:
                flight.abort("timeout")
                yield sse(ApiError(504, _timeout_message(ctx)).body())
                break
            except RequestFailed as e:
                flight.finished = True
                yield sse(ApiError(e.status, e.message).body())
                break
            if out.finished:
                flight.finished = True
            if out.error:
                yield sse(ApiError(500, f"the model step failed: {out.error}").body())
                break
            for d in tracker.update(out):
                yield sse(shape.chunk(d, prompt_ids))
                prompt_ids = None
            if out.finished:
                if include_usage:
                    yield sse(shape.usage_chunk(out))
                break
        yield sse("[DONE]")
    finally:
        watch.close()
        flight.abort("client disconnected")  # a no-op once it finished or was aborted


class EngineStreamingResponse(StreamingResponse):
    """Closes its event generator as soon as the response ends, however it ends.

    A client that disconnects while the generator waits at a ``yield`` would otherwise leave its
    cleanup (the abort) to garbage collection.
    """

    def __init__(self, events: AsyncIterator[str]) -> None:
        super().__init__(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self._events = events

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()


def _reason(e: BaseException) -> str:
    if isinstance(e, RequestTimedOut):
        return "timeout"
    if isinstance(e, ClientDisconnected):
        return "client disconnected"
    return "cancelled"


def _timeout_message(ctx: ServeContext) -> str:
    return f"the request ran past --request-timeout ({ctx.request_timeout:g} s) and was aborted"
