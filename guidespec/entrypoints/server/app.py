"""The FastAPI app (``create_app``) and ``guidespec serve``'s uvicorn server around it
(``run_server``): the routes, the error handlers that answer every failure in OpenAI's shape,
and the middleware in front of the ``/v1`` routes (the API key, the body size limit, draining).

The routes themselves are in ``routes``; what each error looks like is ``errors``'.
"""

from __future__ import annotations

import hmac
import logging
import signal
import time
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from guidespec.entrypoints.server.errors import APIError, error_response
from guidespec.entrypoints.server.metrics import ServerMetrics
from guidespec.entrypoints.server.routes import ServerContext, router
from guidespec.llm import EngineClient

logger = logging.getLogger("guidespec.server")
MAX_BODY_BYTES = 16 << 20  # a request body past this is refused with 413 before it is read whole


def create_app(llm: EngineClient, model_name: str, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving ``llm`` under the name ``model_name``."""
    app = FastAPI(title="guidespec", docs_url=None, redoc_url=None)
    metrics = ServerMetrics(llm)
    app.state.context = ServerContext(
        llm, model_name, metrics, api_key, max_model_len=llm.config.max_model_len, created=int(time.time())
    )
    app.add_exception_handler(APIError, _api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _bug)
    # (added first, so it runs inside _admit: a body is read only once its request is admitted)
    app.add_middleware(
        _BodyLimit, max_bytes=MAX_BODY_BYTES, on_refused=lambda: metrics.failed.labels(status="413").inc()
    )
    app.middleware("http")(_admit)
    app.state.draining = False
    app.include_router(router)
    return app


def run_server(
    llm: EngineClient,
    model_name: str,
    host: str,
    port: int,
    api_key: str | None,
    log_level: str = "warning",
    shutdown_timeout_s: float = 30.0,
) -> int:
    """Serve until SIGTERM / Ctrl-C (0) or until the engine gives up after a crash loop (1)."""
    import uvicorn

    app = create_app(llm, model_name, api_key)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            app.state.draining = True  # new requests: 503; those in flight finish
            super().handle_exit(sig, frame)
            # uvicorn raises a caught signal again once it has drained: SIGTERM's default action
            # would end this process before the engine is stopped and its shared memory removed
            self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]

    server = _Server(
        uvicorn.Config(
            app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=max(1, round(shutdown_timeout_s))
        )
    )

    def give_up(reason: str) -> None:
        logger.error("the engine died in a crash loop (%s); the server exits", reason)
        app.state.draining = True
        server.should_exit = True

    llm.on_gave_up = give_up
    server.run()
    return 1 if llm.gave_up else 0


def _metrics(request: Request) -> ServerMetrics:
    context: ServerContext = request.app.state.context
    return context.metrics


async def _api_error(request: Request, e: APIError) -> JSONResponse:
    _metrics(request).failed.labels(status=str(e.status)).inc()
    return error_response(e.status, e.message, e.param, e.code)


async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
    _metrics(request).failed.labels(status="422").inc()
    first = e.errors()[0] if e.errors() else {}
    where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
    return error_response(422, f"{where or 'body'}: {first.get('msg', 'invalid request body')}", where or None)


async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    return error_response(e.status_code, str(e.detail))


async def _bug(request: Request, e: Exception) -> JSONResponse:
    logger.error("%s %s failed", request.method, request.url.path, exc_info=e)
    _metrics(request).failed.labels(status="500").inc()
    return error_response(500, f"internal server error ({type(e).__name__}); the details are in the server's log")


async def _admit(request: Request, call_next: Any) -> Any:
    """Authentication (the ``/v1`` routes), a ``Content-Length`` over the body size limit, and
    503 while the server drains for shutdown."""
    if request.url.path.startswith("/v1"):
        context: ServerContext = request.app.state.context
        failed = context.metrics.failed
        if context.api_key and not _authorized(request.headers.get("authorization", ""), context.api_key):
            failed.labels(status="401").inc()
            return error_response(401, "invalid or missing API key (send Authorization: Bearer <key>)")
        if request.app.state.draining:
            failed.labels(status="503").inc()
            return error_response(503, "the server is shutting down")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > MAX_BODY_BYTES:
            failed.labels(status="413").inc()
            return error_response(413, f"the request body has {length} bytes; the limit is {MAX_BODY_BYTES}")
    return await call_next(request)


def _authorized(header: str, api_key: str) -> bool:
    """``Authorization: Bearer <key>`` as vLLM checks it: the scheme in any case (RFC 9110 11.1),
    the key compared in constant time."""
    scheme, _, key = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(key.encode(), api_key.encode())


class _BodyLimit:
    """ASGI middleware: reads each request's body as it arrives, counting its bytes, and answers
    413 as soon as they pass ``max_bytes`` (a chunked upload has no ``Content-Length`` to check
    up front); the rest is not read. A body within the limit reaches the app as one message."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_refused: Callable[[], None]) -> None:
        self.app, self.max_bytes, self.on_refused = app, max_bytes, on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before its body was whole: nobody to answer
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                self.on_refused()
                refusal = error_response(413, f"the request body passed {self.max_bytes} bytes (the limit)")
                await refusal(scope, receive, send)
                return
            more = message.get("more_body", False)
        pending: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay() -> Message:  # the body, then the connection's own messages (a disconnect)
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)
