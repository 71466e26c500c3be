"""The ASGI middleware that keeps one request from hurting the server: request bodies are
capped while they are read, and an unexpected exception is one log line and a 500 OpenAI
error object, never a traceback.

A body whose Content-Length is over the cap is refused (413) before any of it is read; a
body without one (chunked) is refused as soon as what has arrived passes the cap, so no
more than the cap plus one chunk is ever held. The middleware sits outside FastAPI's
exception handlers and inside Starlette's ServerErrorMiddleware, which would otherwise
print the traceback of any exception that reaches it (uvicorn logs it too)."""

from __future__ import annotations

import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mkgen.serve.errors import OpenAIError, one_line

log = logging.getLogger("mkgen.serve")


def too_large(max_body: int) -> OpenAIError:
    return OpenAIError(
        f"the request body is over this server's limit of {max_body} bytes "
        f"({max_body / (1 << 20):g} MiB): send a shorter prompt", status=413,
        code="request_too_large", headers={"Connection": "close"},  # the rest is unread
    )  # fmt: skip


def _declared_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length" and value.isdigit():
            return int(value)
    return None  # chunked (h11 refuses a malformed Content-Length itself)


class Guard:
    """ASGI middleware: bodies capped at `max_body` bytes, unexpected exceptions turned
    into 500 OpenAI errors."""

    def __init__(self, app: ASGIApp, max_body: int) -> None:
        self.app, self.max_body = app, max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _declared_length(scope)
        if declared is not None and declared > self.max_body:
            await too_large(self.max_body).response()(scope, receive, send)
            return
        received = 0
        started = False

        async def capped() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_body:
                raise too_large(self.max_body)  # the app's handler answers it, or the below
            return message

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, capped, tracked)
        except Exception as error:  # an OpenAIError the app left, or a fault of ours: 500
            if not isinstance(error, OpenAIError):
                log.error("%s %s: unexpected %s", scope["method"], scope["path"], one_line(error))
                error = OpenAIError(
                    "the server failed on this request (its log says why)", status=500,
                    kind="server_error",
                )  # fmt: skip
            if not started:
                await error.response()(scope, receive, send)
