"""The OpenAI-compatible HTTP layer (FastAPI): requests checked and turned into engine
Requests, the engine's token updates turned into completions, chat completions or their
server-sent events.

    POST /v1/completions       prompt as text or token ids
    POST /v1/chat/completions  messages through the checkpoint's chat template
    GET  /v1/models, /health, /metrics

Every refusal is an OpenAI error object ({"error": {"message", "type", "param", "code"}}):
a bad request 400, an unknown model or path 404, a wrong method 405, a body over the cap
413 (guard.py), a full queue 429, an unexpected fault 500, a server warming up, draining
or stopping 503 (429 and 503 with Retry-After). A request's body is parsed, checked and
tokenized on a worker thread (at most PREPARE_THREADS at once), so the event loop, and
/health with it, keeps answering whatever the requests hold.
Each choice also carries `token_ids`, the generated ids (a field OpenAI does not have).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from mkgen.serve import MAX_BODY_MIB
from mkgen.serve.chat import ChatTemplate, ChatTemplateError
from mkgen.serve.engine import (
    RETRY_AFTER_S,
    Engine,
    EngineStopped,
    GenerationParams,
    QueueFull,
    Update,
    params_problem,
)
from mkgen.serve.engine import Request as EngineRequest
from mkgen.serve.errors import OpenAIError, shown
from mkgen.serve.guard import Guard
from mkgen.serve.schema import ChatRequest, CompletionRequest, SamplingFields, parsed
from mkgen.serve.tokens import encode_within

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
DISCONNECT_POLL_S = 0.5  # how often a waiting request checks that its client is there
# Requests parsed and tokenized at once: pydantic's parse holds the GIL (about 50 ms per
# MiB of a list of small ids), so a few at a time keep the event loop answering.
PREPARE_THREADS = 2
STOP_LIMIT = 16  # stop strings and ids per request (`stop`; OpenAI takes 4)
STOP_CHARS = 256  # characters per stop string: the held-back text is checked per update
STOP_IDS_LIMIT = 256  # stop_token_ids per request
ENDPOINTS = "POST /v1/completions, POST /v1/chat/completions, GET /v1/models, /health, /metrics"


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


def _check_ids(ids: list[int], param: str, vocab_used: int) -> list[int]:
    outside = [t for t in ids if not 0 <= t < vocab_used]
    if outside:
        raise OpenAIError(
            f"{param}: token id {outside[0]} is outside the vocabulary [0, {vocab_used})", param
        )
    return ids


def _check_common(served: ServedModel, body: SamplingFields) -> None:
    if body.model != served.name:
        raise OpenAIError(
            f"model: this server serves {served.name!r}, not {shown(body.model)}", "model",
            status=404, code="model_not_found",
        )  # fmt: skip
    if body.n != 1:
        raise OpenAIError(f"n: only 1 choice per request, got {body.n}", "n")
    if body.logprobs not in (None, False):
        raise OpenAIError("logprobs: not supported", "logprobs")


def _stop_list(body: SamplingFields) -> list[str | int]:
    """`stop` as a list (a string is one stop)."""
    return [body.stop] if isinstance(body.stop, str) else (body.stop or [])


def _stops(body: SamplingFields) -> list[str | int]:
    """`stop` as a list, its count and strings' lengths checked."""
    stop = _stop_list(body)
    if len(stop) > STOP_LIMIT:
        raise OpenAIError(f"stop: at most {STOP_LIMIT} strings and ids, got {len(stop)}", "stop")
    lengths = [len(s) for s in stop if isinstance(s, str)]
    if lengths and not 1 <= min(lengths) <= max(lengths) <= STOP_CHARS:
        raise OpenAIError(
            f"stop: each string must have 1 to {STOP_CHARS} characters, got "
            f"{max(lengths) if max(lengths) > STOP_CHARS else 0}", "stop",
        )  # fmt: skip
    if len(body.stop_token_ids or []) > STOP_IDS_LIMIT:
        raise OpenAIError(
            f"stop_token_ids: at most {STOP_IDS_LIMIT}, got {len(body.stop_token_ids or [])}",
            "stop_token_ids",
        )  # fmt: skip
    return stop


def _generation(served: ServedModel, body: SamplingFields, prompt: list[int],
                max_tokens: int | None, default: int) -> GenerationParams:  # fmt: skip
    """The decoding parameters of `body` for `prompt`, every one checked."""
    room = served.context - len(prompt)
    if room < 1:
        raise OpenAIError(
            f"prompt: {len(prompt)} tokens leave no room in the context of "
            f"{served.context} tokens: shorten it", "prompt", code="context_length_exceeded",
        )  # fmt: skip
    if max_tokens is not None and max_tokens > room:
        raise OpenAIError(
            f"max_tokens: prompt ({len(prompt)}) + max_tokens ({max_tokens}) exceed the "
            f"context of {served.context} tokens: ask for at most {room}", "max_tokens",
            code="context_length_exceeded",
        )  # fmt: skip
    stop = _stops(body)
    stop_ids = [s for s in stop if isinstance(s, int)] + (body.stop_token_ids or [])
    stop_ids = _check_ids(stop_ids, "stop", served.vocab_used)
    params = GenerationParams(
        max_tokens=min(room, default) if max_tokens is None else max_tokens,
        temperature=body.temperature, top_k=0 if body.top_k == -1 else body.top_k,
        top_p=body.top_p, seed=secrets.randbits(32) if body.seed is None else body.seed,
        stop_ids=frozenset(stop_ids) | (frozenset() if body.ignore_eos else served.eos_ids),
    )  # fmt: skip
    problem = params_problem(params, served.vocab_used)
    if problem is not None:
        raise OpenAIError(f"{problem[0]}: {problem[1]}", problem[0])
    return params


def _encode(served: ServedModel, text: str, param: str, special: bool) -> list[int]:
    """`text`'s ids; refused when they cannot fit the context (tokens.encode_within)."""
    if served.tokenizer is None:
        raise OpenAIError(
            f"{param}: this server has no tokenizer.json (convert the checkpoint with "
            "one): send token ids", param,
        )  # fmt: skip
    ids = encode_within(served.tokenizer, text, special, served.context - 1)
    if ids is None:
        raise OpenAIError(
            f"{param}: the text has more tokens than the context of {served.context} "
            f"tokens leaves room for (at most {served.context - 1}): shorten it", param,
            code="context_length_exceeded",
        )  # fmt: skip
    return _check_ids(ids, param, served.vocab_used)


def _completion_prompt(served: ServedModel, body: CompletionRequest) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise OpenAIError(f"prompt: one prompt per request, got {len(prompt)}", "prompt")
        prompt = prompt[0]
    ids = _encode(served, prompt, "prompt", True) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise OpenAIError("prompt: empty", "prompt")
    return _check_ids(ids, "prompt", served.vocab_used)


def _chat_prompt(served: ServedModel, body: ChatRequest) -> list[int]:
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
        raise OpenAIError(
            f"messages: the chat template refused them: {error}", "messages"
        ) from None
    ids = _encode(served, text, "messages", False)
    if not ids:
        raise OpenAIError("messages: the chat template gave an empty prompt", "messages")
    return ids


type Prepared = tuple[SamplingFields, list[int], GenerationParams]


def prepare_completion(served: ServedModel, raw: bytes) -> Prepared:
    """A /v1/completions body's fields, prompt ids and decoding parameters, all checked
    (OpenAIError otherwise): the work done off the event loop."""
    body = parsed(raw, CompletionRequest)
    _check_common(served, body)
    prompt = _completion_prompt(served, body)
    return (
        body,
        prompt,
        _generation(served, body, prompt, body.max_tokens, DEFAULT_COMPLETION_TOKENS),
    )


def prepare_chat(served: ServedModel, raw: bytes) -> Prepared:
    """prepare_completion for /v1/chat/completions (its default max_tokens: the context
    left)."""
    body = parsed(raw, ChatRequest)
    _check_common(served, body)
    prompt = _chat_prompt(served, body)
    given = body.max_completion_tokens, body.max_tokens
    limit = next((n for n in given if n is not None), None)
    return body, prompt, _generation(served, body, prompt, limit, served.context)


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


def _unavailable(state: str) -> OpenAIError:
    """The 503 of a server that takes no request now (`state`: Engine.state)."""
    why = {"draining": "is shutting down (draining)", "stopping": "is shutting down"}
    return OpenAIError(
        f"the server {why.get(state, state)}: retry later, or on another replica",
        status=503, kind="server_error", headers={"Retry-After": str(RETRY_AFTER_S)},
    )  # fmt: skip


class _Completion:
    """One request through the engine, its updates turned into a completion or chat
    completion, whole or streamed."""

    def __init__(self, engine: Engine, served: ServedModel, http: Request, prepared: Prepared,
                 chat: bool) -> None:  # fmt: skip
        self.engine, self.served, self.http, self.chat = engine, served, http, chat
        self.body, self.prompt, params = prepared
        texts = [s for s in _stop_list(self.body) if isinstance(s, str)]
        self.assembler = TextAssembler(served.tokenizer, texts)
        loop, self.updates = asyncio.get_running_loop(), asyncio.Queue[Update]()

        def deliver(update: Update) -> None:  # on the engine thread
            with contextlib.suppress(RuntimeError):  # the client's loop is gone
                loop.call_soon_threadsafe(self.updates.put_nowait, update)

        self.request = EngineRequest(self.prompt, params, deliver)
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.head = {"id": ident, "created": int(time.time()), "model": served.name}

    async def response(self) -> Response:
        """Submit the request (429: the queue is full; 503: the server stops) and answer."""
        try:
            self.engine.submit(self.request)
        except QueueFull:
            raise OpenAIError(
                "the server is busy (every slot taken and the queue full): retry later",
                status=429, kind="rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from None  # fmt: skip
        except EngineStopped:
            raise _unavailable(self.engine.state) from None
        if self.body.stream:
            return StreamingResponse(self.events(), media_type="text/event-stream")
        return await self.whole()

    def choice(self, text: str, ids: list[int], finish: str | None, first: bool = False) -> dict:
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                    "token_ids": ids}  # fmt: skip
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": 0, "delta": delta if text or first else {}, "logprobs": None,
                "finish_reason": finish, "token_ids": ids}  # fmt: skip

    async def next_update(self) -> tuple[str, list[int], str | None] | None:
        """The next update's text, ids and finish reason; None once the client left
        (polled: with ASGI 2.4 nothing else notices it before a write fails)."""
        while True:
            try:
                update = await asyncio.wait_for(self.updates.get(), DISCONNECT_POLL_S)
                break
            except TimeoutError:
                if await self.http.is_disconnected():
                    return None
        text = self.assembler.add(update.tokens, final=update.finish_reason is not None)
        if self.assembler.stopped:
            self.engine.cancel(self.request)
            return text, update.tokens, "stop"
        return text, update.tokens, update.finish_reason

    def event(self, data: dict[str, Any]) -> str:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return f"data: {json.dumps({**self.head, 'object': kind, **data})}\n\n"

    async def events(self) -> AsyncIterator[str]:
        """The server-sent events: one per update with text or ids, then the finish
        reason (also "abort" when the server stopped first, "error" when the request's
        device work failed), the usage when asked for, and [DONE]."""
        try:
            if self.chat:
                yield self.event({"choices": [self.choice("", [], None, first=True)]})
            finish = None
            while finish is None:
                update = await self.next_update()
                if update is None:
                    return
                text, ids, finish = update
                if text or ids:
                    yield self.event({"choices": [self.choice(text, ids, None)]})
            yield self.event({"choices": [self.choice("", [], finish)]})
            options = self.body.stream_options
            if options is not None and options.include_usage:
                yield self.event({"choices": [], "usage": _usage(self.prompt, self.request)})
            yield "data: [DONE]\n\n"
        finally:  # finished, or the client left: its slot is freed
            self.engine.cancel(self.request)

    async def whole(self) -> Response:
        """The whole completion once it finished (503 when the server stopped first, 500
        when its device work failed)."""
        ids: list[int] = []
        text, finish = "", None
        try:
            while finish is None:
                update = await self.next_update()
                if update is None:
                    return Response(status_code=499)  # nobody reads it: nginx's "client closed"
                delta, new, finish = update
                text, ids = text + delta, ids + new
        finally:
            self.engine.cancel(self.request)
        if finish == "abort":
            raise _unavailable("stopping")
        if finish == "error":
            raise OpenAIError(
                "the device work of this request failed (the server's log says why)",
                status=500, kind="server_error",
            )  # fmt: skip
        if self.chat:
            result = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": finish, "token_ids": ids}  # fmt: skip
        else:
            result = self.choice(text, ids, finish)
        kind = "chat.completion" if self.chat else "text_completion"
        usage = _usage(self.prompt, self.request)
        return JSONResponse({**self.head, "object": kind, "choices": [result], "usage": usage})


def _http_error(request: Request, error: HTTPException) -> OpenAIError:
    """Starlette's own refusals (an unknown path, a wrong method) as OpenAI errors."""
    where = f"{request.method} {request.url.path}"
    if error.status_code == 404:
        message = f"no such endpoint: {where} (this server has {ENDPOINTS})"
    elif error.status_code == 405:
        allowed = (error.headers or {}).get("Allow", "")
        message = f"method not allowed: {where} (allowed: {allowed})"
    else:
        message = f"{where}: {error.detail}"
    return OpenAIError(message, status=error.status_code, headers=error.headers)


def create_app(engine: Engine, served: ServedModel, max_body: int = MAX_BODY_MIB << 20) -> FastAPI:
    """The FastAPI application serving `served` through `engine`, request bodies capped
    at `max_body` bytes; the engine is started (it warms up) with the application and
    stopped (what is still running ends with "abort") when uvicorn shuts down."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await asyncio.to_thread(engine.stop)

    app = FastAPI(title="mkgen serve", lifespan=lifespan)
    app.add_middleware(Guard, max_body=max_body)
    limiter = anyio.CapacityLimiter(PREPARE_THREADS)

    @app.exception_handler(OpenAIError)
    async def openai_error(_request: Request, error: OpenAIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        return _http_error(request, error).response()

    @app.get("/health")
    async def health() -> JSONResponse:
        state = engine.state
        return JSONResponse({"status": state}, status_code=200 if state == "ok" else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(engine.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        entry = {"id": served.name, "object": "model", "created": 0, "owned_by": "mkgen"}
        return {"object": "list", "data": [{**entry, "max_model_len": served.context}]}

    async def prepared(
        http: Request, prepare: Callable[[ServedModel, bytes], Prepared]
    ) -> Prepared:
        """The request's body read (capped by the Guard), then parsed, checked and
        tokenized on a worker thread; a server that takes no request refuses it first."""
        if engine.state not in ("ok", "warming up"):
            raise _unavailable(engine.state)
        raw = await http.body()
        return await anyio.to_thread.run_sync(prepare, served, raw, limiter=limiter)

    @app.post("/v1/completions")
    async def completions(http: Request) -> Response:
        request = await prepared(http, prepare_completion)
        return await _Completion(engine, served, http, request, chat=False).response()

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request) -> Response:
        request = await prepared(http, prepare_chat)
        return await _Completion(engine, served, http, request, chat=True).response()

    return app
