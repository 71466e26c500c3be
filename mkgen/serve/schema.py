"""The request bodies `mkgen serve` takes, parsed and type-checked strictly by pydantic's
own JSON parser (pydantic-core): "5" is not an integer, "yes" not a boolean, true not a
token id; invalid UTF-8, a lone surrogate escape ("\\ud800") and nesting deeper than the
parser's limit are invalid JSON. Every refusal is an OpenAIError (400) naming the field.
Fields OpenAI has and mkgen does not use are ignored, as OpenAI's own server ignores the
fields it does not know."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from mkgen.serve.errors import OpenAIError

STRICT = ConfigDict(extra="ignore", strict=True)

# What the fields that take several shapes take, for their one-line refusal.
SHAPES = {
    "prompt": "text, a list of token ids, or a list of one of those",
    "stop": "a string or a list of strings and token ids",
}


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


class SamplingFields(BaseModel):
    """The fields both endpoints take."""

    model_config = STRICT

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
    logprobs: bool | int | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]


class ChatRequest(SamplingFields):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None


def parsed[T: BaseModel](raw: bytes, schema: type[T]) -> T:
    """`raw` as a `schema`; an OpenAIError naming the first field that is wrong."""
    try:
        return schema.model_validate_json(raw)
    except ValidationError as error:
        first = error.errors(include_url=False, include_input=False)[0]
    loc = [str(part) for part in first["loc"]]
    if first["type"] == "json_invalid":
        hint = ""
        if "escape" in first["msg"] or "code point" in first["msg"]:
            hint = "; a \\ud800-\\udfff escape must be half of a surrogate pair"
        raise OpenAIError(f"the body is not valid JSON ({first['msg']}{hint})") from None
    if not loc:
        raise OpenAIError("the body must be a JSON object") from None
    if loc[0] in SHAPES and first["type"] != "missing":
        raise OpenAIError(f"{loc[0]}: must be {SHAPES[loc[0]]}", loc[0]) from None
    param = ".".join(loc)
    raise OpenAIError(f"{param}: {first['msg']}", param) from None
