"""A build's recorded measurements (measurements.json), kept apart from what it renders.

Compile seconds and interpret-mode results vary run to run, so ``mkgen build`` never
measures. ``mkgen compile --update-report`` and ``mkgen verify --update-report`` store
their results keyed by the sha256 of the kernels' code (full and mini, headers left out)
and re-render REPORT.md with them (mkgen.codegen.package.record_measurement); a rebuild
keeps them while that code is unchanged and drops them (stale) otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mkgen.codegen.writer import local_edits

MEASUREMENTS = "measurements.json"
# Measurements are keyed by what compile and verify measure: the kernels' code (full and
# mini, without their headers), so a change to the runner, the report or another kind's
# kernel code leaves them valid.
MEASURED_KEY = "kernel_sha256"


def read_measurements(directory: Path) -> dict[str, Any] | None:
    """measurements.json of an unedited build (None if absent or edited)."""
    path = directory / MEASUREMENTS
    if not path.exists() or local_edits(directory) is not None:
        return None
    return json.loads(path.read_text())


def recorded_measurements(directory: Path) -> tuple[str, ...]:
    """The measurements (compile, profile, verify) a build directory records, edited or not."""
    try:
        data = json.loads((directory / MEASUREMENTS).read_text())
    except (OSError, ValueError):
        return ()
    return tuple(sorted(k for k in data if k != MEASURED_KEY)) if isinstance(data, dict) else ()


def measurements_of(measurements: Mapping[str, Any] | None, kernel_digest: str) -> dict[str, Any]:
    """The recorded measurements still valid for kernels of `kernel_digest` (without the key)."""
    if measurements and measurements.get(MEASURED_KEY) == kernel_digest:
        return {k: v for k, v in measurements.items() if k != MEASURED_KEY}
    return {}
