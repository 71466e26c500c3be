"""Spec and config files: reading YAML and JSON, validating a spec, writing a spec's YAML.

Both readers refuse, in one line naming the place, what a parser would otherwise
accept silently or crash on: duplicate keys (the last would win), nesting deeper than
any spec or config needs (the parsers recurse), integer literals too long for any
bound (Python refuses to parse more than 4300 digits), text that is not UTF-8 and file
names that are not one printable line (they end up in messages and generated headers).
YAML is read with the YAML 1.2 core schema's plain scalars: `yes`, `on`, `010`, `0x10`,
`1_000` or `34:08`, which YAML 1.1 reads as booleans or numbers, are refused rather than
guessed (docs/spec-reference.md#numbers-and-yaml).
"""

from __future__ import annotations

import json
import re
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from mkgen.errors import SpecError
from mkgen.spec.schema import ModelSpec

# A spec nests 6 levels (attention_kinds.NAME.rope.scaling.factor), a Hugging Face
# config about as many; the parsers recurse per level and crash near 1000.
MAX_NESTING = 32
# 2^64 has 20 digits and every integer bound of a spec or option is below 2^31; longer
# literals are refused before Python parses them (it stops at 4300 digits).
MAX_INTEGER_DIGITS = 20


@dataclass(frozen=True)
class _Refused:
    """A value a reader refuses, left in place so that the error names its path."""

    why: str


def _mapping(pairs: list[tuple[Any, Any]]) -> dict[Any, Any] | _Refused:
    """A mapping from its key/value pairs, refused when a key repeats (the last would win)."""
    data: dict[Any, Any] = {}
    for key, value in pairs:
        if not isinstance(key, Hashable):
            return _Refused("a list or mapping used as a key")
        if key in data:
            return _Refused(f"duplicate key {key!r}; keep one")
        data[key] = value
    return data


def _integer(text: str) -> int | _Refused:
    digits = len(text.lstrip("+-"))
    if digits > MAX_INTEGER_DIGITS:
        return _Refused(
            f"an integer of {digits} digits, beyond every bound (docs/spec-reference.md#bounds)"
        )
    return int(text)


def _field_text(key: Any) -> str:
    """A key as it appears in an error: plain when printable, quoted otherwise (one line)."""
    text = str(key)
    return text if text.isprintable() else repr(text)


def _check_tree(data: Any, source: str) -> Any:
    """``data`` unless it holds a refused value or nests too deeply: then a SpecError
    naming the dotted path. Shared containers (YAML aliases) are visited once."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    seen: set[int] = set()
    while stack:
        node, path, depth = stack.pop()
        where = f"{source}: {path}" if path else source
        if isinstance(node, _Refused):
            raise SpecError(f"{where}: {node.why}")
        if not isinstance(node, dict | list) or id(node) in seen:
            continue
        if depth == MAX_NESTING:
            raise SpecError(f"{where}: nested more than {MAX_NESTING} levels deep")
        seen.add(id(node))
        items = node.items() if isinstance(node, dict) else enumerate(node)
        children = [(v, f"{path}.{_field_text(k)}" if path else _field_text(k)) for k, v in items]
        stack.extend((v, p, depth + 1) for v, p in reversed(children))
    return data


class _SpecYamlError(yaml.MarkedYAMLError):
    """Well-formed YAML that no spec needs (nesting deeper than MAX_NESTING)."""


# YAML 1.1 (PyYAML's default) reads these plain scalars as booleans or numbers; YAML
# 1.2 and most other tools read them differently. A spec never needs them unquoted.
_AMBIGUOUS = {
    "a boolean": r"yes|Yes|YES|no|No|NO|on|On|ON|off|Off|OFF",
    "a base-60 number": r"[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?",
    "an octal, hexadecimal or binary number": r"[-+]?0[0-9_]+|[-+]?0[xob][0-9a-fA-F_]+",
    "a number with underscores": r"(?=[^_]*_)[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)?",
}
_AMBIGUOUS_TAG = "tag:mkgen,2026:ambiguous"


class _SpecYamlLoader(yaml.SafeLoader):
    """SafeLoader with the YAML 1.2 core schema's plain scalars (so 1e-5 is a float and
    `yes` is refused, not true), no duplicate keys, no merge keys, bounded nesting."""

    yaml_implicit_resolvers: dict[Any, Any] = {}  # noqa: RUF012 - PyYAML's class table
    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_NESTING:
                mark = self.peek_event().start_mark
                raise _SpecYamlError(
                    None, None, f"nested more than {MAX_NESTING} levels deep", mark
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _add_resolver(tag: str, pattern: str, first: list[str]) -> None:
    """Resolve plain scalars starting with one of ``first`` and matching ``pattern``;
    resolvers added earlier win, so the ambiguous forms come first."""
    _SpecYamlLoader.add_implicit_resolver(tag, re.compile(f"^(?:{pattern})$"), first)


_DIGITS = list("-+0123456789")
for _pattern in _AMBIGUOUS.values():
    _add_resolver(_AMBIGUOUS_TAG, _pattern, [*_DIGITS, *"yYnNoO"])
_add_resolver("tag:yaml.org,2002:null", r"~|null|Null|NULL|", ["~", "n", "N", ""])
_add_resolver("tag:yaml.org,2002:bool", r"true|True|TRUE|false|False|FALSE", list("tTfF"))
_add_resolver("tag:yaml.org,2002:int", r"[-+]?(?:0|[1-9][0-9]*)", _DIGITS)
_add_resolver(
    "tag:yaml.org,2002:float",
    r"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)",
    [*_DIGITS, "."],
)


def _refuse_ambiguous(loader: _SpecYamlLoader, node: yaml.ScalarNode) -> _Refused:
    why = next(w for w, p in _AMBIGUOUS.items() if re.fullmatch(p, node.value))
    return _Refused(
        f"{node.value!r} is {why} in YAML 1.1 and reads differently elsewhere; quote it for "
        "a string, or write a decimal number or true/false"
    )


def _construct_int(loader: _SpecYamlLoader, node: yaml.ScalarNode) -> int | _Refused:
    text = loader.construct_scalar(node)
    if not re.fullmatch(r"[-+]?[0-9]+", text):
        return _Refused(f"{text!r}: write integers in decimal")
    return _integer(text)


def _construct_mapping(loader: _SpecYamlLoader, node: yaml.MappingNode) -> Any:
    return _mapping(loader.construct_pairs(node, deep=True))


_SpecYamlLoader.add_constructor(_AMBIGUOUS_TAG, _refuse_ambiguous)
_SpecYamlLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_SpecYamlLoader.add_constructor("tag:yaml.org,2002:map", _construct_mapping)


def describe_validation_error(error: ValidationError, source: str) -> str:
    """One line naming the first invalid field by its path and what is wrong."""
    errors = error.errors()
    # A misspelt key also makes the right key "missing": name the misspelling first.
    first = min(errors, key=lambda e: e["type"] != "extra_forbidden")
    loc = [_field_text(p) for p in first["loc"] if not str(p).startswith("function-")]
    # Discriminated unions put the type tag after the kind's name; it does not help a reader.
    if len(loc) > 2 and loc[0] in ("attention_kinds", "ffn_kinds"):
        del loc[2]
    elif len(loc) > 1 and loc[0] == "draft":
        del loc[1]
    path = ".".join(loc)
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        message = "unknown key (check the spelling; see docs/spec-reference.md)"
    elif first["type"] == "union_tag_invalid":
        message = message.replace("Input tag", "type")
    elif first["type"] in ("less_than", "less_than_equal", "string_too_long"):
        message += " (the bounds and where they come from: docs/spec-reference.md#bounds)"
    where = f"{source}: {path}" if path else source
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return f"{where}: {message}{more}"


def spec_from_dict(data: Any, source: str = "spec") -> ModelSpec:
    """Validate a plain mapping as a ModelSpec; errors are one-line SpecErrors."""
    if not isinstance(data, dict):
        raise SpecError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return ModelSpec.model_validate(data)
    except ValidationError as error:
        raise SpecError(describe_validation_error(error, source)) from None


def checked_path(ref: str | Path) -> Path:
    """``ref`` as a Path, refused unless its name is one printable line: paths end up in
    one-line errors and in the header comment of an imported spec."""
    if not str(ref).isprintable():
        raise SpecError(f"{str(ref)!r}: the path is not one printable line; rename the file")
    return Path(ref)


# A spec or config.json is a few KB (the largest Hugging Face configs tens of KB): a bigger
# file is refused before it is parsed, which for a 50 MB file took about 20 s.
MAX_SPEC_FILE_BYTES = 1 << 20


def _read_text(path: Path) -> str:
    try:
        with checked_path(path).open("rb") as handle:
            data = handle.read(MAX_SPEC_FILE_BYTES + 1)
    except OSError as error:
        raise SpecError(f"{path}: cannot read ({error.strerror})") from None
    if len(data) > MAX_SPEC_FILE_BYTES:
        raise SpecError(
            f"{path}: over {MAX_SPEC_FILE_BYTES >> 20} MiB, far more than any spec or "
            "config.json; give the spec file itself"
        )
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise SpecError(
            f"{path}: not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start}); "
            "save it as UTF-8"
        ) from None


def read_yaml(path: Path) -> Any:
    text = _read_text(path)
    try:
        data = yaml.load(text, Loader=_SpecYamlLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.reader.ReaderError as error:  # e.g. a NUL byte: no YAML file may hold it
        raise SpecError(
            f"{path}: character U+{error.character:04X} at offset {error.position} is not "
            "allowed in YAML; remove it"
        ) from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None)
        if isinstance(error, _SpecYamlError):  # well-formed, but nothing a spec needs
            raise SpecError(f"{path}: {where}: {problem}") from None
        where = f" at {where}" if where else ""
        raise SpecError(
            f"{path}: malformed YAML{where}{f': {problem}' if problem else ''}"
        ) from None
    return _check_tree(data, path.name)


def read_json(path: Path) -> Any:
    text = _read_text(path)
    try:
        data = json.loads(text, object_pairs_hook=_mapping, parse_int=_integer)
    except json.JSONDecodeError as error:
        raise SpecError(f"{path}: not valid JSON (line {error.lineno}: {error.msg})") from None
    except RecursionError:
        raise SpecError(f"{path}: nested more than {MAX_NESTING} levels deep") from None
    return _check_tree(data, str(path))


def spec_to_dict(spec: ModelSpec) -> dict[str, Any]:
    """Plain data of a spec with defaults left out (what a YAML file would say)."""
    return spec.model_dump(mode="json", exclude_defaults=True)


def dump_spec_yaml(spec: ModelSpec, header: str = "") -> str:
    body = yaml.safe_dump(spec_to_dict(spec), sort_keys=False, default_flow_style=None, width=100)
    return header + body
