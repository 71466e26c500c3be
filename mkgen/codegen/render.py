"""Rendering templates: Jinja2 with strict undefined names, then ruff format.

Templates only place values the plan decided; rendering is deterministic (same
inputs, identical bytes).
"""

from __future__ import annotations

import subprocess
import sys
from importlib import resources
from typing import Any

import jinja2

from mkgen.errors import MkgenError

# Package data, so an installed wheel renders exactly what a checkout does.
TEMPLATES = resources.files("mkgen") / "templates"


def environment() -> jinja2.Environment:
    """The Jinja2 settings every template renders with."""
    return jinja2.Environment(
        loader=jinja2.PackageLoader("mkgen", "templates"),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def format_python(source: str) -> str:
    """ruff format, so generated code reads like the rest of the project."""
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--line-length", "100", "-"],
        input=source,
        capture_output=True,
        text=True,
    )
    if result.returncode:
        raise MkgenError(f"generated code does not parse: {result.stderr.strip().splitlines()[-1]}")
    return result.stdout


def render(template: str, **context: Any) -> str:
    """Render templates/<template> and format the Python it produces."""
    text = environment().get_template(template).render(**context)
    return format_python(text)
