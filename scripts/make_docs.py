"""Regenerate README.md's example blocks from the commands they show (`make docs`).

An example block is a command between markers; everything between them is rewritten
with what the command prints today::

    <!-- mkgen-example: mkgen list -->
    ```
    $ mkgen list
    ...its output...
    ```
    <!-- /mkgen-example -->

Each command runs as a user runs it (a fresh `python -m mkgen.cli` process) in an empty
temporary directory, so an example that writes files (`mkgen build ... -o DIR`) leaves
nothing behind and finds nothing there before it. The output is the command's stdout,
with one change: a build's wall-clock time ("wrote DIR/ in 1.3 s:") is shown as
"in ... s", because it differs from run to run and the README must be reproducible.

`python scripts/make_docs.py` rewrites README.md; `--check` only says whether it is
current (exit 1 if not). tests/test_docs.py holds the README to the code the same way.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
BLOCK = re.compile(
    r"(?P<open><!-- mkgen-example: (?P<command>[^>]+?) -->\n)(?P<body>.*?)(?P<close><!-- /mkgen-example -->)",
    re.DOTALL,
)
# The one run-dependent figure in the examples: how long a build took.
SECONDS = re.compile(r"\bin \d+(\.\d+)? s:")


def run_example(command: str) -> str:
    """`command` (starting with `mkgen`) run with this checkout's mkgen in an empty
    temporary directory: its stdout, build time masked. A failing command is an error:
    the README must show working ones."""
    words = shlex.split(command)
    if words[0] != "mkgen":
        raise ValueError(f"example {command!r}: must start with 'mkgen'")
    with tempfile.TemporaryDirectory(prefix="mkgen-docs-") as cwd:
        result = subprocess.run(
            [sys.executable, "-m", "mkgen.cli", *words[1:]],
            capture_output=True,
            text=True,
            cwd=cwd,
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join(
                    filter(None, (str(REPO), os.environ.get("PYTHONPATH")))
                ),
                "JAX_PLATFORMS": "cpu",
                "PYTHONDONTWRITEBYTECODE": "1",
            },
            timeout=600,
        )
    if result.returncode != 0:
        raise RuntimeError(f"example {command!r} failed: {result.stderr.strip()[-2000:]}")
    return SECONDS.sub("in ... s:", result.stdout)


def render(readme: str) -> str:
    """`readme` with every example block holding its command's current output."""

    def block(match: re.Match[str]) -> str:
        command = match["command"].strip()
        output = run_example(command).rstrip("\n")
        return f"{match['open']}```\n$ {command}\n{output}\n```\n{match['close']}"

    return BLOCK.sub(block, readme)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="Exit 1 if README.md is stale.")
    args = parser.parse_args()
    current = README.read_text()
    fresh = render(current)
    if args.check:
        sys.exit(0 if fresh == current else 1)
    if fresh != current:
        README.write_text(fresh)
        print(f"rewrote {README.relative_to(REPO)}")
    else:
        print(f"{README.relative_to(REPO)} is up to date")


if __name__ == "__main__":
    main()
