"""Loading specs: a name in model_specs/, a YAML path, or a Hugging Face config.json."""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from mkgen.errors import SpecError
from mkgen.spec.schema import ModelSpec

# Package data: the shipped specs travel inside the wheel.
SPECS_DIR = resources.files("mkgen") / "model_specs"


class _SpecYamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads 1e-5 as a float (YAML 1.1 wants 1.0e-5)."""


_SpecYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def describe_validation_error(error: ValidationError, source: str) -> str:
    """One line naming the first invalid field by its path and what is wrong."""
    errors = error.errors()
    # A misspelt key also makes the right key "missing": name the misspelling first.
    first = min(errors, key=lambda e: e["type"] != "extra_forbidden")
    loc = [str(p) for p in first["loc"] if not str(p).startswith("function-")]
    # Discriminated unions put the type tag after the kind's name; it does not help a reader.
    if len(loc) > 2 and loc[0] in ("attention_kinds", "ffn_kinds"):
        del loc[2]
    path = ".".join(loc)
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        message = "unknown key (check the spelling; see docs/spec-reference.md)"
    elif first["type"] == "union_tag_invalid":
        message = message.replace("Input tag", "type")
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


def read_yaml(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as error:
        raise SpecError(f"{path}: cannot read ({error.strerror})") from None
    try:
        return yaml.load(text, Loader=_SpecYamlLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or "malformed YAML"
        raise SpecError(f"{path}: malformed YAML{where}: {problem}") from None


def load_spec(ref: str | Path) -> ModelSpec:
    """Load a spec by name (model_specs/NAME.yaml), YAML path, or config.json path."""
    path = Path(ref)
    if path.suffix == ".json":
        from mkgen.spec.hf_import import import_hf_config

        return import_hf_config(path)
    if path.suffix not in (".yaml", ".yml"):
        candidate = SPECS_DIR / f"{ref}.yaml"
        if not candidate.is_file():
            known = ", ".join(list_spec_names()) or "none"
            raise SpecError(
                f"unknown spec {str(ref)!r}: not a file and not in model_specs/ ({known})"
            )
        with resources.as_file(candidate) as shipped:
            return spec_from_dict(read_yaml(shipped), shipped.name)
    if not path.exists():
        raise SpecError(f"{path}: no such file")
    return spec_from_dict(read_yaml(path), path.name)


def list_spec_names() -> list[str]:
    return sorted(
        p.name.removesuffix(".yaml") for p in SPECS_DIR.iterdir() if p.name.endswith(".yaml")
    )


def spec_to_dict(spec: ModelSpec) -> dict[str, Any]:
    """Plain data of a spec with defaults left out (what a YAML file would say)."""
    return spec.model_dump(mode="json", exclude_defaults=True)


def dump_spec_yaml(spec: ModelSpec, header: str = "") -> str:
    body = yaml.safe_dump(spec_to_dict(spec), sort_keys=False, default_flow_style=None, width=100)
    return header + body


def read_json(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as error:
        raise SpecError(f"{path}: cannot read ({error.strerror})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise SpecError(f"{path}: not valid JSON (line {error.lineno}: {error.msg})") from None
