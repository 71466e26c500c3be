"""The OpenAI-compatible HTTP layer (FastAPI): requests checked and turned into engine
Requests, the engine's token updates turned into completions, chat completions or their
server-sent events.

    POST /v1/completions       prompt as text or token ids
    POST /v1/chat/completions  messages through the checkpoint's chat template
    GET  /v1/models, /health, /metrics

A bad request is HTTP 400 with an OpenAI error object ({"error": {"message", "type",
"param", "code"}}); a full queue 429 and a stopping server 503, both with Retry-After.
Each choice also carries `token_ids`, the generated ids (a field OpenAI does not have).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from mkgen.serve.chat import ChatTemplate, ChatTemplateError
from mkgen.serve.engine import (
    RETRY_AFTER_S,
    Engine,
    EngineStopped,
    GenerationParams,
    QueueFull,
    Update,
)
from mkgen.serve.engine import Request as EngineRequest

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
SEED_LIMIT = 2**32
DISCONNECT_POLL_S = 0.5  # how often a waiting request checks that its client is there


@dataclass(frozen=True)
class ServedModel:
    """What the HTTP layer knows of the model: its name (the `model` clients give), the
    context and vocabulary of the build, the tokenizer (tokenizers.Tokenizer, or None:
    token ids only), the chat template (or None) and the eos ids that end a sequence."""

    name: str
    context: int
    vocab_used: int
    tokenizer: Any
    chat: ChatTemplate | None
    eos_ids: frozenset[int]


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


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """The fields both endpoints take (others are ignored, as OpenAI's own server does
    for fields it does not know)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # not OpenAI's: the openai client sends it through extra_body
    seed: int | None = None
    stop: str | list[str | int] | None = None  # strings, and token ids as integers
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    logprobs: Any = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]


class ChatRequest(_SamplingFields):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None


def _parsed[T: BaseModel](raw: bytes, schema: type[T]) -> T:
    try:
        data = json.loads(raw)
    except ValueError as error:
        raise OpenAIError(f"the body is not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise OpenAIError("the body must be a JSON object")
    try:
        return schema.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        raise OpenAIError(f"{param}: {first['msg']}", param) from None


def _check_ids(ids: list[int], param: str, vocab_used: int) -> list[int]:
    outside = [t for t in ids if not 0 <= t < vocab_used]
    if outside:
        raise OpenAIError(
            f"{param}: token id {outside[0]} is outside the vocabulary [0, {vocab_used})", param
        )
    return ids


class TextAssembler:
    """The text of a request's generated ids as it can be released: a character still
    being decoded and the start of a possible stop string are held back; the first stop
    string found ends the text (it is not included)."""

    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.released = ""
        self.stopped = False

    def add(self, ids: list[int], final: bool = False) -> str:
        """Take the new `ids`; the text released by them (all of it when `final`)."""
        self.ids += ids
        if self.tokenizer is None or self.stopped:
            return ""
        text = self.tokenizer.decode(self.ids)
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            text, self.stopped = text[: min(hits)], True
        elif not final:
            text = text.rstrip("\ufffd")  # a multi-byte character not finished yet
            held = max((n for s in self.stops for n in range(1, len(s)) if text.endswith(s[:n])),
                       default=0)  # fmt: skip
            text = text[: len(text) - held]
        if not text.startswith(self.released):
            return ""  # decoding more ids changed earlier text: wait for it to settle
        delta, self.released = text[len(self.released) :], text
        return delta


def _usage(prompt: list[int], request: EngineRequest) -> dict[str, int]:
    return {
        "prompt_tokens": len(prompt),
        "completion_tokens": request.generated,
        "total_tokens": len(prompt) + request.generated,
    }


def create_app(engine: Engine, served: ServedModel) -> FastAPI:
    """The FastAPI application serving `served` through `engine`; the engine is started
    with the application and stopped (what is still running is cancelled) when uvicorn
    shuts down, after its graceful shutdown has let in-flight requests finish."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await asyncio.to_thread(engine.stop)

    app = FastAPI(title="mkgen serve", lifespan=lifespan)

    @app.exception_handler(OpenAIError)
    async def openai_error(_request: Request, error: OpenAIError) -> JSONResponse:
        return error.response()

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = engine.running
        return JSONResponse({"status": "ok" if ok else "stopping"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(engine.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        entry = {"id": served.name, "object": "model", "created": 0, "owned_by": "mkgen"}
        return {"object": "list", "data": [{**entry, "max_model_len": served.context}]}

    def check_common(body: _SamplingFields) -> None:
        if body.model != served.name:
            raise OpenAIError(
                f"model: this server serves {served.name!r}, not {body.model!r}", "model",
                code="model_not_found",
            )  # fmt: skip
        if body.n != 1:
            raise OpenAIError(f"n: only 1 choice per request, got {body.n}", "n")
        if body.logprobs not in (None, False):
            raise OpenAIError("logprobs: not supported", "logprobs")

    def generation(body: _SamplingFields, prompt: list[int], max_tokens: int | None,
                   default: int) -> GenerationParams:  # fmt: skip
        """The decoding parameters of `body` for `prompt`, every one checked."""
        room = served.context - len(prompt)
        if room < 1:
            raise OpenAIError(
                f"prompt: {len(prompt)} tokens leave no room in the context of "
                f"{served.context} tokens: shorten it", "prompt", code="context_length_exceeded",
            )  # fmt: skip
        if max_tokens is not None and max_tokens <= 0:
            raise OpenAIError(f"max_tokens: must be at least 1, got {max_tokens}", "max_tokens")
        if max_tokens is not None and max_tokens > room:
            raise OpenAIError(
                f"max_tokens: prompt ({len(prompt)}) + max_tokens ({max_tokens}) exceed the "
                f"context of {served.context} tokens: ask for at most {room}", "max_tokens",
                code="context_length_exceeded",
            )  # fmt: skip
        t = body.temperature
        if not math.isfinite(t) or t < 0:
            raise OpenAIError(f"temperature: must be a finite number >= 0, got {t}", "temperature")
        if not 0 < body.top_p <= 1:  # NaN fails too
            raise OpenAIError(f"top_p: must be in (0, 1], got {body.top_p}", "top_p")
        if body.top_k < -1:
            raise OpenAIError(f"top_k: must be >= 0 (0 or -1: all), got {body.top_k}", "top_k")
        if body.seed is not None and not 0 <= body.seed < SEED_LIMIT:
            raise OpenAIError(f"seed: must be in [0, 2^32), got {body.seed}", "seed")
        stop = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
        stop_ids = [s for s in stop if isinstance(s, int)] + (body.stop_token_ids or [])
        stop_ids = _check_ids(stop_ids, "stop", served.vocab_used)
        return GenerationParams(
            max_tokens=min(room, default) if max_tokens is None else max_tokens,
            temperature=t, top_k=max(body.top_k, 0), top_p=body.top_p,
            seed=secrets.randbits(32) if body.seed is None else body.seed,
            stop_ids=frozenset(stop_ids) | (frozenset() if body.ignore_eos else served.eos_ids),
        )  # fmt: skip

    def encode(text: str, param: str, special: bool) -> list[int]:
        if served.tokenizer is None:
            raise OpenAIError(
                f"{param}: this server has no tokenizer.json (convert the checkpoint with "
                "one): send token ids", param,
            )  # fmt: skip
        return _check_ids(
            served.tokenizer.encode(text, add_special_tokens=special).ids, param,
            served.vocab_used,
        )  # fmt: skip

    def completion_prompt(body: CompletionRequest) -> list[int]:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise OpenAIError(f"prompt: one prompt per request, got {len(prompt)}", "prompt")
            prompt = prompt[0]
        ids = encode(prompt, "prompt", True) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise OpenAIError("prompt: empty", "prompt")
        return _check_ids(ids, "prompt", served.vocab_used)

    def chat_prompt(body: ChatRequest) -> list[int]:
        if served.chat is None:
            raise OpenAIError(
                "messages: this model has no chat template (tokenizer_config.json's "
                "chat_template); use /v1/completions", "messages",
            )  # fmt: skip
        messages = []
        for i, message in enumerate(body.messages):
            content = message.get("content")
            if isinstance(content, list):  # content parts: their text, in order
                texts = [p.get("text") for p in content if isinstance(p, dict)]
                if not all(isinstance(t, str) for t in texts) or len(texts) != len(content):
                    raise OpenAIError(f"messages.{i}.content: only text parts", "messages")
                content = "".join(texts)
            if not isinstance(message.get("role"), str) or not isinstance(content, str):
                raise OpenAIError(f"messages.{i}: needs a string role and text content", "messages")
            messages.append({**message, "content": content})
        try:
            text = served.chat.render(messages)
        except ChatTemplateError as error:
            message = f"messages: the chat template refused them: {error}"
            raise OpenAIError(message, "messages") from None
        ids = encode(text, "messages", False)
        if not ids:
            raise OpenAIError("messages: the chat template gave an empty prompt", "messages")
        return ids

    def submit(prompt: list[int], params: GenerationParams) -> tuple[EngineRequest, asyncio.Queue]:
        loop, updates = asyncio.get_running_loop(), asyncio.Queue()

        def deliver(update: Update) -> None:  # on the engine thread
            with contextlib.suppress(RuntimeError):  # the client's loop is gone
                loop.call_soon_threadsafe(updates.put_nowait, update)

        request = EngineRequest(prompt, params, deliver)
        retry = {"Retry-After": str(RETRY_AFTER_S)}
        try:
            engine.submit(request)
        except QueueFull:
            raise OpenAIError(
                "the server is busy (every slot taken and the queue full): retry later",
                status=429, kind="rate_limit_error", headers=retry,
            ) from None  # fmt: skip
        except EngineStopped:
            raise OpenAIError(
                "the server is shutting down", status=503, kind="server_error", headers=retry
            ) from None
        return request, updates

    async def respond(http: Request, body: _SamplingFields, prompt: list[int],
                      params: GenerationParams, chat: bool) -> Response:  # fmt: skip
        stops = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
        assembler = TextAssembler(served.tokenizer, [s for s in stops if isinstance(s, str)])
        request, updates = submit(prompt, params)
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        head = {"id": ident, "created": created, "model": served.name}

        def choice(text: str, ids: list[int], finish: str | None, first: bool = False) -> dict:
            if not chat:
                return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                        "token_ids": ids}  # fmt: skip
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            return {"index": 0, "delta": delta if text or first else {}, "logprobs": None,
                    "finish_reason": finish, "token_ids": ids}  # fmt: skip

        async def next_update() -> tuple[str, list[int], str | None] | None:
            """The next update's text, ids and finish reason; None once the client left
            (polled: with ASGI 2.4 nothing else notices it before a write fails)."""
            while True:
                try:
                    update = await asyncio.wait_for(updates.get(), DISCONNECT_POLL_S)
                    break
                except TimeoutError:
                    if await http.is_disconnected():
                        return None
            text = assembler.add(update.tokens, final=update.finish_reason is not None)
            if assembler.stopped:
                engine.cancel(request)
                return text, update.tokens, "stop"
            return text, update.tokens, update.finish_reason

        if body.stream:
            kind = "chat.completion.chunk" if chat else "text_completion"

            def event(data: dict[str, Any]) -> str:
                return f"data: {json.dumps({**head, 'object': kind, **data})}\n\n"

            async def events() -> AsyncIterator[str]:
                try:
                    if chat:
                        yield event({"choices": [choice("", [], None, first=True)]})
                    finish = None
                    while finish is None:
                        update = await next_update()
                        if update is None:
                            return
                        text, ids, finish = update
                        if text or ids:
                            yield event({"choices": [choice(text, ids, None)]})
                    yield event({"choices": [choice("", [], finish)]})
                    if body.stream_options is not None and body.stream_options.include_usage:
                        yield event({"choices": [], "usage": _usage(prompt, request)})
                    yield "data: [DONE]\n\n"
                finally:  # finished, or the client left: its slot is freed
                    engine.cancel(request)

            return StreamingResponse(events(), media_type="text/event-stream")

        ids: list[int] = []
        text, finish = "", None
        try:
            while finish is None:
                update = await next_update()
                if update is None:
                    return Response(status_code=499)  # nobody reads it: nginx's "client closed"
                delta, new, finish = update
                text, ids = text + delta, ids + new
        finally:
            engine.cancel(request)
        if finish in ("abort", "error"):
            raise OpenAIError(
                "the server stopped before the request finished" if finish == "abort"
                else "the device call failed", status=503 if finish == "abort" else 500,
                kind="server_error",
            )  # fmt: skip
        if chat:
            result = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": finish, "token_ids": ids}  # fmt: skip
        else:
            result = choice(text, ids, finish)
        kind = "chat.completion" if chat else "text_completion"
        return JSONResponse(
            {**head, "object": kind, "choices": [result], "usage": _usage(prompt, request)}
        )

    @app.post("/v1/completions")
    async def completions(http: Request) -> Response:
        body = _parsed(await http.body(), CompletionRequest)
        check_common(body)
        prompt = completion_prompt(body)
        params = generation(body, prompt, body.max_tokens, DEFAULT_COMPLETION_TOKENS)
        return await respond(http, body, prompt, params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request) -> Response:
        body = _parsed(await http.body(), ChatRequest)
        check_common(body)
        prompt = chat_prompt(body)
        given = body.max_completion_tokens, body.max_tokens
        limit = next((n for n in given if n is not None), None)
        params = generation(body, prompt, limit, served.context)
        return await respond(http, body, prompt, params, chat=True)

    return app
