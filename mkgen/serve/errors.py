"""The OpenAI error object every refusal of `mkgen serve` is: {"error": {"message", "type",
"param", "code"}}, for a bad request (400), an unknown model or path (404), a wrong method
(405), a body over the cap (413), a full queue (429), an unexpected fault (500) or a
server warming up or stopping (503)."""

from __future__ import annotations

from starlette.responses import JSONResponse

from mkgen.errors import first_line


class OpenAIError(Exception):
    """A request refused with an OpenAI-style error object."""

    def __init__(
        self, message: str, param: str | None = None, *, status: int = 400,
        kind: str = "invalid_request_error", code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.message, self.param, self.status = message, param, status
        self.kind, self.code, self.headers = kind, code, headers

    def response(self) -> JSONResponse:
        error = {"message": self.message, "type": self.kind, "param": self.param}
        return JSONResponse(
            {"error": {**error, "code": self.code}}, status_code=self.status, headers=self.headers
        )


def shown(value: str, limit: int = 64) -> str:
    """`value` quoted for an error message, cut to `limit` characters (a client's string
    is echoed, never all of it)."""
    return repr(value if len(value) <= limit else value[:limit] + "...")


def one_line(error: BaseException) -> str:
    """An exception as one short log line: its type and its message's first line."""
    return f"{type(error).__name__}: {first_line(error)[:200]}"
