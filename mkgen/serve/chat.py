"""Chat messages to prompt text with the checkpoint's own chat template, rendered the way
transformers' `apply_chat_template` does: tokenizer_config.json's `chat_template` (a
string, or a list of named templates of which "default" is used) in a sandboxed jinja2
environment with trim_blocks and lstrip_blocks, the loopcontrols extension, the `tojson`
filter and the `raise_exception` and `strftime_now` globals, given `messages`,
`add_generation_prompt` and the special tokens (bos_token, eos_token, ...). The text is
then tokenized without adding special tokens (the template writes them)."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

from mkgen.errors import MkgenError

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplateError(Exception):
    """The template refused the messages (raise_exception) or failed on them."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json gives it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """A checkpoint's chat template and special tokens, compiled once."""

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise_exception
        environment.globals["strftime_now"] = _strftime_now
        self.template = environment.from_string(source)
        self.special_tokens = special_tokens

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text of `messages`; ChatTemplateError when the template refuses them."""
        try:
            return self.template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )  # fmt: skip
        except jinja2.exceptions.TemplateError as error:
            raise ChatTemplateError(str(error)) from None


def load_tokenizer_config(path: Path) -> tuple[ChatTemplate | None, str | None]:
    """tokenizer_config.json's chat template (None without one) and its eos token text
    (None without one); a missing file is (None, None). A broken file or template is a
    one-line MkgenError naming it."""
    if not path.is_file():
        return None, None
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise MkgenError(f"{path}: not a tokenizer_config.json ({error})") from None
    if not isinstance(config, dict):
        raise MkgenError(f"{path}: not a tokenizer_config.json (expected a JSON object)")
    special = {n: t for n in SPECIAL_TOKENS if (t := _token_text(config.get(n))) is not None}
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: transformers uses "default"
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if source is None:
        return None, special.get("eos_token")
    if not isinstance(source, str):
        raise MkgenError(f"{path}: chat_template must be a string or named templates")
    try:
        template = ChatTemplate(source, special)
    except jinja2.exceptions.TemplateSyntaxError as error:
        raise MkgenError(f"{path}: chat_template line {error.lineno}: {error.message}") from None
    return template, special.get("eos_token")
