"""The hand-written TPU7x megakernels' published step times: the bar a generated kernel is
held against in REPORT.md and `make bench`.

Sources (public Inferact tpu-megakernels repository, README.md and musespark/README.md):
Muse Spark's batch-1 rows are the calibration rows of mkgen/plan/calibration.py; Kimi K3
and Qwen3.8-27B are the seeds' serving points, given as accepted tokens/s per user at
acceptance length 6 with 8 rows per step (1 anchor + 7 drafts), so a step is
6 / (tokens/s) seconds, drafting included."""

from __future__ import annotations

from dataclasses import dataclass

from mkgen.plan.calibration import CONFIGS, MEASURED_MS
from mkgen.plan.options import BuildOptions
from mkgen.spec.schema import ModelSpec
from mkgen.spec.topology import Topology, parse_topology

SEEDS_SOURCE = "Inferact tpu-megakernels README.md: accepted tokens/s per user at acceptance 6"
MUSE_SOURCE = "Inferact tpu-megakernels musespark/README.md: ms per step, batch 1"
SEED_ACCEPTANCE = 6.0
SEED_ROWS = 8


@dataclass(frozen=True)
class HandWritten:
    """One published measurement of a hand-written kernel on real TPU7x hardware."""

    model: str
    topology: str
    batch: int
    rows: int
    quant: tuple[str, ...]  # --quant FAMILY=FORMAT overrides of the shipped spec
    step_ms: float
    what: str
    source: str


def _seed(model: str, topology: str, tokens_per_s_per_user: float) -> HandWritten:
    return HandWritten(
        model=model,
        topology=topology,
        batch=1,
        rows=SEED_ROWS,
        quant=(),
        step_ms=SEED_ACCEPTANCE / tokens_per_s_per_user * 1e3,
        what=f"{tokens_per_s_per_user:g} accepted tokens/s per user at acceptance "
        f"{SEED_ACCEPTANCE:g}, {SEED_ROWS} rows per step",
        source=SEEDS_SOURCE,
    )


HAND_WRITTEN: tuple[HandWritten, ...] = (
    _seed("kimi-k3", "2x2x4", 709),
    _seed("qwen3.8-27b", "2x2x1", 1515),
    *(
        HandWritten(
            model="muse-spark-1.2",
            topology="2x2x1",
            batch=1,
            rows=1,
            quant=CONFIGS[config],
            step_ms=MEASURED_MS[(config, 1)],
            what=config,
            source=MUSE_SOURCE,
        )
        for config in CONFIGS
    ),
)


def hand_written_for(
    model: str, base: ModelSpec, built: ModelSpec, topo: Topology, options: BuildOptions
) -> HandWritten | None:
    """The published kernel this build does the same work as: same model (by spec name),
    TPU7x slice, batch, rows and weight formats (`base` is the spec as shipped, `built`
    the build's, with its --quant applied)."""
    for hand in HAND_WRITTEN:
        shape = (hand.model, parse_topology(hand.topology), hand.batch, hand.rows)
        if shape != (model, topo, options.batch, options.rows):
            continue
        formats = BuildOptions.create(quant=list(hand.quant))
        if formats.apply(base).quantization == built.quantization:
            return hand
    return None
