"""HTTP front (FastAPI): SGLang's native endpoints and the OpenAI-compatible /v1 endpoints over one Backend.
The routes live in ``serve/routes/`` (admin, native, openai; their shared helpers in routes/common.py); this module
assembles the app and holds the connection-level pieces (API key and internal error middlewares, header
deadline).

Request bodies are parsed here (not by FastAPI) so that malformed JSON, invalid UTF-8, wrong field types and
out-of-range values all come back as a 400 with OpenAI's ``{"error": {message, type, param, code}}`` body, and a
``curl -d`` body (form content type) still works. Streaming is server-sent events: ``data: {json}\\n\\n`` ...
``data: [DONE]\\n\\n``. A client that goes away aborts its requests, which frees their slots and KV pages.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .launch import version
from .request import RequestError
from .routes import admin, native, openai
from .routes.common import APIError, error_response, validation_message

log = logging.getLogger("specjax.serve")


class APIKeyMiddleware:
    """``Authorization: Bearer KEY`` on every path but /health. A plain ASGI middleware (not BaseHTTPMiddleware,
    which hides the client's disconnect from the handlers)."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            got = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                resp = error_response(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                      code="invalid_api_key")
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


class InternalErrorMiddleware:
    """An unexpected exception in a handler: logged (one line and its traceback) and answered with a 500 error body.
    It is caught here, inside Starlette's ServerErrorMiddleware, which would re-raise it after replying: uvicorn then
    logs it again and closes the connection, and the client's next request on that keep-alive connection fails. A
    response already under way (a stream) cannot become a 500: its exception goes on and the connection closes."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_)
        except Exception as e:  # noqa: BLE001 - every unexpected error is answered, not raised
            if started:
                raise
            log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            text = f"{e}".encode("utf-8", "backslashreplace").decode("utf-8")
            resp = error_response(500, f"internal error: {type(e).__name__}: {text}", type_="internal_server_error")
            await resp(scope, receive, send)


def http_protocol(header_timeout: float):
    """uvicorn's h11 protocol, plus a deadline for each request's line and headers: a connection that has not
    completed them ``header_timeout`` s after it opened (or after its previous response) is closed, so clients
    that trickle headers (slowloris) cannot hold connections forever. uvicorn's own keep-alive timer restarts on
    every byte received, so it cannot do this."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadlineProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_deadline()

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

        def _arm_header_deadline(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(header_timeout, self._header_deadline)

        def _header_deadline(self) -> None:
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                log.info("closing a connection that sent no complete request headers in %gs", header_timeout)
                self.transport.close()

    return HeaderDeadlineProtocol


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to every address ``host`` resolves to (as uvicorn would bind them), before the model loads: a
    port in use or a host that is not this machine's fails at once, not after minutes of loading and warm-up. They
    listen only when uvicorn starts serving on them, so until then a client is refused, not left waiting. Raises
    OSError naming the address."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OSError(f"cannot resolve --host {host!r}: {e.strerror}") from None
    socks: list[socket.socket] = []
    try:
        for family, type_, proto, address in dict.fromkeys((f, t, p, a) for f, t, p, _, a in infos):
            sock = socket.socket(family, type_, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # one socket per family, as asyncio binds them
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as e:
                shown = f"[{address[0]}]" if family == socket.AF_INET6 else address[0]
                raise OSError(f"cannot listen on {shown}:{port} (--host {host}, --port {port}): {e.strerror}") from None
    except OSError:
        for sock in socks:
            sock.close()
        raise
    return socks


def create_app(backend) -> FastAPI:
    """The app: OpenAI-shaped error bodies for every failure (a 500 body for unexpected ones, which keeps the
    connection open), the API key check when one is set, then the admin, native and OpenAI routers over ``backend``
    (kept on ``app.state.backend``)."""
    app = FastAPI(title="specjax server", version=version())
    app.state.backend = backend
    add_error_handlers(app)
    if backend.args.api_key:
        app.add_middleware(APIKeyMiddleware, key=backend.args.api_key)
    app.add_middleware(InternalErrorMiddleware)  # added last: the outermost of ours
    for r in (admin.router, native.router, openai.router):
        app.include_router(r)
    return app


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return error_response(e.status, e.message, type_=e.type_, param=e.param, code=e.code)

    @app.exception_handler(RequestError)
    async def _req_error(_, e: RequestError):
        return error_response(400, str(e), param=e.param, code=e.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_, e: RequestValidationError):
        msg, param = validation_message(e)
        return error_response(400, msg, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(e.status_code, str(e.detail), type_=kind)
