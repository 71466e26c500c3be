"""Running the CLI as a user does (a fresh process), or its entry point in the test's own
process, and checking its one-line errors; shared by the CLI test files."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import traceback
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


def mkgen_here(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """The CLI's entry point (mkgen.cli.main, what the console script calls) in this process,
    with what `mkgen` gives a user: the exit status, stdout and stderr, an uncaught
    exception's traceback on stderr with status 1. For the tests of what a command writes
    or refuses, where a fresh process would only add its imports (about 1 to 2 CPU s a
    call); the tests of tests/test_cli.py and the runs on virtual devices start one."""
    from mkgen.cli import main

    out, err = io.StringIO(), io.StringIO()
    status = 0
    bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # as mkgen() runs it
    try:
        with (
            contextlib.chdir(cwd),
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
        ):
            try:
                main(list(args))
            except SystemExit as exit_:
                if isinstance(exit_.code, int | None):
                    status = exit_.code or 0
                else:  # sys.exit(message): the message on stderr, status 1
                    err.write(f"{exit_.code}\n")
                    status = 1
            except Exception:  # what the interpreter prints for an uncaught one
                err.write(traceback.format_exc())
                status = 1
    finally:
        sys.dont_write_bytecode = bytecode
    return subprocess.CompletedProcess(["mkgen", *args], status, out.getvalue(), err.getvalue())


def assert_user_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    """Exit status 2, no traceback, one line on stderr naming every fragment."""
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def compiled_profile(run_once, spec: str, topology: str, rows: str) -> dict:
    """`mkgen compile SPEC --topology TOPOLOGY --rows ROWS --profile --json` (returncode,
    stdout, stderr), run once for the whole run (conftest's run_once): the full-size
    kernel compiled for TPU7x with Mosaic's LLO dump on. tests/test_profile.py holds its op
    counts to the model, tests/test_codegen.py its VMEM to the plan (the kernel it
    renders itself differs only in its docstring's header)."""

    def compute() -> dict:
        result = mkgen(
            "compile", spec, "--topology", topology, "--rows", rows, "--profile", "--json",
            timeout=900,
        )  # fmt: skip
        return {"returncode": result.returncode, "stdout": result.stdout, "stderr": result.stderr}

    return run_once(f"profile-{Path(spec).name}-{topology}-rows{rows}", compute)


# The build whose profile tests/test_profile.py's update-report test records, its quarter
# test holds to the model, and tests/test_codegen.py holds the VMEM of (one compile).
REPORTED = ("qwen3-30b-a3b", "2x2x1")


def reported_profile(run_once, run_once_dir: Path) -> tuple[Path, dict]:
    """`mkgen build qwen3-30b-a3b --topology 2x2x1` and then `mkgen compile ... --profile
    --update-report` of it, once for the run (conftest's run_once): the build and the
    compile's returncode, stdout and stderr. Its measurements hold the compile's record
    and the profile's, the two parts of what `--json` prints."""
    build = run_once_dir / "qwen-profiled"

    def compute() -> dict:
        built = mkgen_here("build", REPORTED[0], "--topology", REPORTED[1], "-o", str(build))
        assert built.returncode == 0, built.stderr  # in this process: it needs no devices
        result = mkgen(
            "compile", REPORTED[0], "--topology", REPORTED[1], "--profile", "--update-report",
            "-o", str(build), timeout=900,
        )  # fmt: skip
        return {"returncode": result.returncode, "stdout": result.stdout, "stderr": result.stderr}

    return build, run_once(f"profile-{REPORTED[0]}-{REPORTED[1]}-report", compute)
