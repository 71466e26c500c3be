"""verify's child process: a hang becomes a timeout, not a stalled parent, and each step
the child finishes reaches the parent as it happens."""

from __future__ import annotations

import os
import sys
import time

from mkgen.verify.numerics import STEP_DONE, _run_streaming


def _child(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_child_that_never_ends_is_a_timeout() -> None:
    start = time.monotonic()
    status, stdout, stderr = _run_streaming(
        _child("import time; time.sleep(60)"), dict(os.environ), 1.0, None
    )
    assert status is None and time.monotonic() - start < 30


def test_step_lines_reach_the_callback_and_the_rest_is_kept() -> None:
    seen: list[int] = []
    code = (
        "import sys\n"
        f"for i in range(3): print('{STEP_DONE}', i, file=sys.stderr, flush=True)\n"
        "print('warning: something', file=sys.stderr)\n"
        "sys.stderr.write('x' * 200_000)\n"  # more than a pipe holds: both are drained
        "print('{\"steps\": []}')\n"
    )
    status, stdout, stderr = _run_streaming(
        _child(code), dict(os.environ), 60.0, lambda: seen.append(len(seen))
    )
    assert status == 0 and seen == [0, 1, 2]
    assert stdout.strip() == '{"steps": []}'
    assert stderr.startswith("warning: something") and STEP_DONE not in stderr
