"""How long mkgen takes, measured as a user runs it (`make bench`).

Each benchmark is a function returning ``Row``s; ``BENCHMARKS`` lists them in the order
the table prints. Every command runs in a fresh subprocess (imports included, as a user
pays them), several times; the table shows the median and the spread.

To add a benchmark (build, compile, verify, ...): write a function like
``plan_benchmarks`` that calls ``time_command`` for each case, and append it to
``BENCHMARKS``.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNS = 5


@dataclass(frozen=True)
class Row:
    name: str  # what was timed, e.g. the command line
    median_s: float
    min_s: float
    max_s: float
    runs: int
    target_s: float | None = None  # the target, when it sets one

    @property
    def verdict(self) -> str:
        if self.target_s is None:
            return ""
        return "ok" if self.median_s <= self.target_s else "OVER TARGET"


def time_command(
    args: Sequence[str],
    runs: int = RUNS,
    target_s: float | None = None,
    name: str = "",
    store: str = "",
) -> Row:
    """Run ``mkgen ARGS`` ``runs`` times in fresh processes; fails loudly if it fails.
    `store` is the planner's store the runs use (MKGEN_CACHE_DIR, mkgen/plan/store.py): off
    unless given, so each run walks what a first plan of the build walks."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "MKGEN_CACHE_DIR": store}
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        result = subprocess.run(
            [sys.executable, "-m", "mkgen.cli", *args],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=env,
            check=False,
        )
        times.append(time.perf_counter() - start)
        if result.returncode != 0:
            raise SystemExit(f"bench: mkgen {' '.join(args)} failed:\n{result.stderr}")
    return Row(
        name=name or "mkgen " + " ".join(args),
        median_s=statistics.median(times),
        min_s=min(times),
        max_s=max(times),
        runs=runs,
        target_s=target_s,
    )


# --------------------------------------------------------------------------- benchmarks


def plan_benchmarks() -> list[Row]:
    """Issues 3 and 24: `mkgen plan kimi-k3 --topology 2x2x4` and the checked-in build's
    plan (rows 8) under 3 s, their held refills and KV tiles read from the tuned tables
    (mkgen/plan/holds.py, kvtiles.py); each timed with the planner's store off (a first
    plan: every walk of the calibrated regime and the sensitivity table) and holding those
    walks from an earlier run (the same plan again)."""
    import tempfile

    kimi = ["plan", "kimi-k3", "--topology", "2x2x4"]
    rows8 = [*kimi, "--rows", "8"]
    # make build's build, which drafts in its kernel, plans two programs (with and without
    # the drafter's passes): no target.
    fused = [*rows8, "--draft", "kimi-k3-mtp", "--fuse-draft"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="mkgen-bench-store-") as store:
        for args, target in ((kimi, 3.0), (rows8, 3.0), (fused, None)):
            line = "mkgen " + " ".join(args)
            rows.append(time_command(args, target_s=target, name=f"{line} (first plan)"))
            time_command(args, runs=1, store=store)  # walks once, into the store
            rows.append(time_command(args, target_s=target, name=f"{line} (again)", store=store))
        rows.append(time_command([*rows8, "--json"], store=store))
    return rows


def _checked_in_builds() -> list[list[str]]:
    """`SPEC --topology T [options]` of every checked-in build (generated/BUILDS)."""
    import shlex

    from mkgen.codegen.build_list import read_build_list

    return [shlex.split(entry.line) for entry in read_build_list()]


def build_benchmarks() -> list[Row]:
    """Issue 4: `mkgen build` of every checked-in build (rendered into a temp directory)."""
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory(prefix="mkgen-bench-") as tmp:
        for args in _checked_in_builds():
            out = str(Path(tmp) / args[0])
            rows.append(
                time_command(
                    ["build", *args, "-o", out, "--force"],
                    runs=3,
                    name=f"mkgen build {' '.join(args)}",
                )
            )
    return rows


def compile_benchmarks() -> list[Row]:
    """Issue 4: full-size TPU7x compile of every checked-in build, under 30 s each (the
    command's wall time: imports, rendering and libtpu start-up included)."""
    return [
        time_command(["compile", *args], runs=3, target_s=30.0) for args in _checked_in_builds()
    ]


def verify_benchmarks() -> list[Row]:
    """Issue 4: interpret-mode verify of every checked-in build's mini twin (one step, both
    DMA modes; one run each, they are slow)."""
    return [
        time_command(["verify", *args, "--steps", "1"], runs=1) for args in _checked_in_builds()
    ]


# Build, compile and verify timings go here (one function each), in pipeline order.
BENCHMARKS: list[Callable[[], list[Row]]] = [
    plan_benchmarks,
    build_benchmarks,
    compile_benchmarks,
    verify_benchmarks,
]


def format_table(rows: list[Row]) -> str:
    width = max(len(r.name) for r in rows)
    lines = [f"{'command':<{width}}  {'median s':>8}  {'min s':>6}  {'max s':>6}  runs  target"]
    for r in rows:
        target = f"{r.target_s:g} s {r.verdict}" if r.target_s is not None else ""
        lines.append(
            f"{r.name:<{width}}  {r.median_s:>8.2f}  {r.min_s:>6.2f}  {r.max_s:>6.2f}  "
            f"{r.runs:>4}  {target}"
        )
    return "\n".join(lines)


def _range(est: dict) -> str:
    """The lowest and highest step of a plan's sensitivity table ("" without one)."""
    steps = [s for r in est["sensitivity"] for s in (r["step_ms_low"], r["step_ms_high"])]
    return f"{min(steps):.2f}-{max(steps):.2f}" if steps else ""


def against_the_bar() -> str:
    """Each build a hand-written kernel was published for: the cost model's predicted step
    beside the published (measured) one and the ideal floor."""
    import json

    from mkgen.plan.published import HAND_WRITTEN

    builds = []
    for hand in HAND_WRITTEN:
        quant = [flag for q in hand.quant for flag in ("--quant", q)]
        builds.append((hand, [hand.model, "--topology", hand.topology, "--batch", str(hand.batch),
                              "--rows", str(hand.rows), *quant]))  # fmt: skip
    width = max(len(" ".join(args)) for _, args in builds)
    lines = [
        "Predicted step (cost model, not measured; calib: the same build with no refill held "
        "and no expert sharing, the calibrated regime; range: the lowest and highest step with "
        "one unmeasured input at either end of its range) against the hand-written kernels "
        "(measured on TPU7x) and the ideal floor:",
        f"{'build':<{width}} {'step ms':>8} {'calib ms':>8} {'range ms':>11} {'hand ms':>8} "
        f"{'floor ms':>8} {'floor/step':>10}",
    ]
    for hand, args in builds:
        result = subprocess.run(
            [sys.executable, "-m", "mkgen.cli", "plan", *args, "--json"],
            capture_output=True, text=True, cwd=REPO, check=False,
        )  # fmt: skip
        if result.returncode:  # a configuration mkgen cannot build yet: say why
            lines.append(f"{' '.join(args):<{width}} {result.stderr.strip().splitlines()[-1]}")
            continue
        est = json.loads(result.stdout)["estimate"]
        lines.append(
            f"{' '.join(args):<{width}} {est['step_ms']:>8.3f} {est['calibrated_step_ms']:>8.3f} "
            f"{_range(est):>11} {hand.step_ms:>8.2f} {est['ideal_floor_ms']:>8.3f} "
            f"{est['ideal_floor_ratio']:>10.3f}"
        )
    return "\n".join(lines)


# Issue 21's targets for verify + draft at rows 8 with each seed's shipped drafter (ms).
DRAFTED_TARGET_MS = {"qwen3.8-27b": 3.24, "kimi-k3": 7.5}


def drafted_against_the_bar() -> str:
    """Each published step that drafts, against the build's verify step plus the drafter
    mkgen ships for the model, priced by the cost model: the draft priced as fused beside a
    verify-only kernel, then the kernel that drafts (--fuse-draft, walked whole; refused in
    one line for a drafter the kernel cannot run yet)."""
    import json

    from mkgen.plan.published import HAND_WRITTEN

    seeds = [hand for hand in HAND_WRITTEN if hand.shipped_drafter]
    builds = [(hand, [hand.model, "--topology", hand.topology, "--batch", str(hand.batch),
                      "--rows", str(hand.rows), "--draft", hand.shipped_drafter, *fused])
              for hand in seeds for fused in ([], ["--fuse-draft"])]  # fmt: skip
    width = max(len(" ".join(args)) for _, args in builds)
    lines = [
        "Verify + draft (predicted by the cost model, not measured: without --fuse-draft the "
        "draft is priced beside a verify-only kernel; with it, the kernel drafts inside the "
        "step) against the hand-written kernels' published steps, which draft with their own "
        "drafters (measured on TPU7x), and issue 21's targets; calib and range of the step as "
        "above:",
        f"{'build':<{width}} {'verify ms':>9} {'draft ms':>8} {'step ms':>8} {'calib ms':>8} "
        f"{'range ms':>11} {'hand ms':>8} {'target ms':>9}  published drafter",
    ]
    for hand, args in builds:
        result = subprocess.run(
            [sys.executable, "-m", "mkgen.cli", "plan", *args, "--json"],
            capture_output=True, text=True, cwd=REPO, check=False,
        )  # fmt: skip
        if result.returncode:
            lines.append(f"{' '.join(args):<{width}} {result.stderr.strip().splitlines()[-1]}")
            continue
        est = json.loads(result.stdout)["estimate"]
        target = DRAFTED_TARGET_MS[hand.model]
        verdict = "ok" if est["step_ms"] <= target else "OVER TARGET"
        lines.append(
            f"{' '.join(args):<{width}} {est['verify_ms']:>9.3f} {est['draft_ms']:>8.3f} "
            f"{est['step_ms']:>8.3f} {est['calibrated_step_ms']:>8.3f} {_range(est):>11} "
            f"{hand.step_ms:>8.2f} {target:>6.2f} {verdict:<11} {hand.drafter}"
        )
    return "\n".join(lines)


def main() -> None:
    rows = [row for bench in BENCHMARKS for row in bench()]
    print(format_table(rows))
    print()
    print(against_the_bar())
    print()
    print(drafted_against_the_bar())


if __name__ == "__main__":
    main()
