"""The mkgen command line: thin click commands over spec -> plan -> codegen -> verify, one
module per command group (specs, planning, build, checks, weights, serve), their shared
options declared once in options.py.

Every user error is an MkgenError: printed as one line on stderr, exit status 2,
no traceback. Commands that do not need JAX never import it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from mkgen import __version__
from mkgen.cli.build import build_command, inspect_command, regen_command
from mkgen.cli.checks import compile_command, verify_command
from mkgen.cli.options import fail
from mkgen.cli.planning import estimate_command, plan_command
from mkgen.cli.serve import serve_command
from mkgen.cli.specs import import_hf_command, list_command, show_command
from mkgen.cli.weights import bench_command, convert_command, run_command
from mkgen.errors import MkgenError

# Every command. `mkgen --help` lists them by name, each with its short_help: one whole
# line per command (click would cut the docstrings' first sentences, which say more,
# mid-sentence); tests/test_cli.py holds every command to one.
COMMANDS = (
    list_command, show_command, import_hf_command,
    plan_command, estimate_command,
    build_command, regen_command, inspect_command,
    verify_command, compile_command,
    convert_command, run_command, bench_command,
    serve_command,
)  # fmt: skip


@click.group(
    context_settings={"help_option_names": ["-h", "--help"]},
    commands=COMMANDS,
)
@click.version_option(__version__, prog_name="mkgen")
def cli() -> None:
    """mkgen: a model spec and a TPU topology in, a Pallas decode megakernel out."""


def main(argv: list[str] | None = None) -> None:
    """Console entry point: user errors become one line and exit status 2."""
    run: Callable[..., Any] = cli.main
    try:
        run(args=argv, prog_name="mkgen", standalone_mode=False)
    except click.exceptions.Abort:
        fail("aborted")
    except click.ClickException as error:
        fail(error.format_message())
    except MkgenError as error:
        fail(str(error))
