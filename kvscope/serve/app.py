"""The FastAPI app: routes, the API key, and OpenAI-style errors for everything that can go wrong."""

from __future__ import annotations

import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from kvscope.serve import protocol as P
from kvscope.serve.handlers import ApiError, ServeContext, complete

logger = logging.getLogger("kvscope.serve")


def create_app(ctx: ServeContext) -> FastAPI:
    app = FastAPI(
        title="kvscope", summary="OpenAI-compatible endpoints over kvscope's engine", docs_url=None, redoc_url=None
    )
    app.state.ctx = ctx
    if ctx.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=ctx.api_key)

    @app.post("/v1/completions")
    async def completions(body: P.CompletionRequest, request: Request) -> Response:
        try:
            prompt = body.single_prompt()
            params = body.sampling_params(body.max_tokens)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        return await complete(ctx, request, body, prompt, params, body.max_tokens is None, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: P.ChatCompletionRequest, request: Request) -> Response:
        try:
            params = body.sampling_params(body.max_new_tokens)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        return await complete(ctx, request, body, body.chat_messages(), params, body.max_new_tokens is None, chat=True)

    @app.get("/v1/models")
    async def models() -> dict:
        m = ctx.model(None)
        return P.ModelList(
            data=[P.ModelCard(id=m.name, created=m.created, root=m.name, max_model_len=m.max_model_len)]
        ).model_dump()

    @app.get("/health")
    async def health() -> Response:
        ctx.model(None)  # 503 while there is no engine to serve
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.bridge.metrics.render(), media_type=ctx.bridge.metrics.content_type)

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(ApiError(400, _describe(e)).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            ApiError(e.status_code, str(e.detail)).body(),
            status_code=e.status_code,
            headers=getattr(e, "headers", None),
        )

    @app.exception_handler(Exception)
    async def crashed(_request: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error in a request")
        return JSONResponse(ApiError(500, f"internal error: {type(e).__name__}: {e}").body(), status_code=500)

    return app


class ApiKeyMiddleware:
    """``/v1`` needs ``Authorization: Bearer KEY``; checked before anything else (the body included).

    A plain ASGI middleware: Starlette's ``BaseHTTPMiddleware`` would wrap ``receive`` and hide
    client disconnects from the handlers.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):  # constant time: no guessing the key by timing
                err = ApiError(401, "a valid API key is required: send 'Authorization: Bearer <key>'")
                await JSONResponse(err.body(), 401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _describe(e: RequestValidationError) -> str:
    """One line for the first problem: bad JSON, or which field is wrong and why."""
    errors = e.errors()
    if not errors:
        return "invalid request"
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"invalid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
    loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
    if not loc and first.get("type") in ("model_attributes_type", "dict_type"):
        return "the request body must be a JSON object (Content-Type: application/json)"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{loc or 'body'}: {first.get('msg')}{more}"
