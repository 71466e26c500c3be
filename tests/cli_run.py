"""Running the CLI as a user does (a fresh process) and checking its one-line errors;
shared by the CLI test files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def mkgen(*args: str, cwd: Path = REPO, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """The CLI in a fresh process, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "mkgen.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONDONTWRITEBYTECODE": "1"},
        timeout=timeout,
    )


def assert_user_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    """Exit status 2, no traceback, one line on stderr naming every fragment."""
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
