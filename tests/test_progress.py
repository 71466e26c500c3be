"""Progress bars go to stderr, and only to a terminal: stdout stays the command's output."""

from __future__ import annotations

import fcntl
import json
import os
import re
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
QWEN3 = REPO / "tests" / "fixtures" / "hf" / "qwen3" / "config.json"


def _read_all(fd: int) -> bytes:
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the terminal's other end closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _on_a_terminal(*args: str) -> tuple[subprocess.CompletedProcess[str], str]:
    """`mkgen ARGS` with stdout a pipe and stderr a terminal (a pty, 120 columns): the
    result, and what was drawn on the terminal."""
    terminal, stderr = os.openpty()
    # A new terminal is 0 columns wide; tqdm draws nothing into that.
    fcntl.ioctl(stderr, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    drawn: list[bytes] = []
    # Read while the command runs: a closed terminal's unread output is lost.
    reader = threading.Thread(target=lambda: drawn.append(_read_all(terminal)))
    reader.start()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "mkgen.cli", *args],
            stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=600, cwd=REPO,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
        )  # fmt: skip
    finally:
        os.close(stderr)
        reader.join(timeout=10)
        os.close(terminal)
    return result, b"".join(drawn).decode(errors="replace")


@pytest.mark.slow
def test_bench_json_is_clean_with_progress_on_a_terminal_stderr() -> None:
    """One batch of the qwen3 fixture in interpret mode: stderr is a terminal (a pty), so
    the bar is drawn there, and stdout is one JSON list all the same."""
    result, shown = _on_a_terminal(
        "bench", str(QWEN3), "--topology", "1x1x1", "--batches", "1", "--context", "64",
        "--json", "--interpret", "--random-weights", "0", "--prompt-ids", "1,2,3", "--steps",
        "1", "--warmup", "0",
    )  # fmt: skip
    assert result.returncode == 0, shown[-2000:]
    (row,) = json.loads(result.stdout)
    assert row["batch"] == 1 and row["ms_per_step"] > 0 and row["predicted_ms_per_step"] > 0
    assert row["predicted_calibrated_ms_per_step"] >= row["predicted_ms_per_step"]
    assert "bench" in shown and "batch 1" in shown


def test_convert_draws_its_bar_only_on_a_terminal(tmp_path: Path) -> None:
    """The bar counts bytes, on a terminal (and is gone when done); a pipe gets none
    (tests/test_convert.py), as verify and bench decide (mkgen.output.progress_bar)."""
    args = ["convert", "--checkpoint", str(QWEN3.parent), "--topology", "1x1x1", "-o"]
    result, shown = _on_a_terminal(*args, str(tmp_path / "w"))
    assert result.returncode == 0, shown[-2000:]
    assert result.stdout.startswith("wrote ") and result.stdout.count("\n") == 1
    assert re.search(r"convert: +\d+%\|.*B/s", shown), shown[-2000:]  # then cleared
    piped = subprocess.run(
        [sys.executable, "-m", "mkgen.cli", *args, str(tmp_path / "w2")],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert (piped.returncode, piped.stderr) == (0, "")
