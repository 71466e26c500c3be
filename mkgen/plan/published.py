"""The hand-written TPU7x megakernels' published step times: the bar a generated kernel is
held against in REPORT.md and `make bench`.

Sources (public Inferact tpu-megakernels repository, README.md and musespark/README.md):
Muse Spark's 12 rows (three weight configurations, batch 1 to 8) are the rows the cost
model is calibrated against (mkgen/plan/calibration.py), and its batch-1 rows are the
bar of the builds doing the same work. Kimi K3 and Qwen3.8-27B are the seeds' serving
points, given as accepted tokens/s per user at acceptance length 6 with 8 rows per step
(1 anchor + 7 drafts), so a step is 6 / (tokens/s) seconds, drafting included."""

from __future__ import annotations

from dataclasses import dataclass

from mkgen.plan.floor import IdealFloor
from mkgen.plan.options import BuildOptions
from mkgen.spec.loader import load_spec
from mkgen.spec.schema import ModelSpec
from mkgen.spec.topology import Topology, parse_topology

SEEDS_SOURCE = "Inferact tpu-megakernels README.md"
MUSE_SOURCE = "Inferact tpu-megakernels musespark/README.md, batch 1"
SEED_ACCEPTANCE = 6.0
SEED_ROWS = 8

# Weight configurations of measurements.md, as --quant overrides of the spec.
CONFIGS: dict[str, tuple[str, ...]] = {
    "int4 experts, bf16 dense": ("experts=int4:128",),
    "nvfp4 experts, bf16 dense": ("experts=nvfp4",),
    # The measured int8 configuration also stores the lm_head in int8 (musespark/REPORT.md:
    # "int8 dense projections + lm_head", lm_head 400 -> 200 MiB).
    "nvfp4 experts, int8 dense": ("experts=nvfp4", "dense=int8", "lm_head=int8"),
}

# ms per decode step, (configuration, batch) -> measured.
MEASURED_MS: dict[tuple[str, int], float] = {
    ("int4 experts, bf16 dense", 1): 3.59,
    ("int4 experts, bf16 dense", 2): 3.71,
    ("int4 experts, bf16 dense", 4): 3.91,
    ("int4 experts, bf16 dense", 8): 4.29,
    ("nvfp4 experts, bf16 dense", 1): 3.57,
    ("nvfp4 experts, bf16 dense", 2): 4.07,
    ("nvfp4 experts, bf16 dense", 4): 4.63,
    ("nvfp4 experts, bf16 dense", 8): 4.86,
    ("nvfp4 experts, int8 dense", 1): 3.26,
    ("nvfp4 experts, int8 dense", 2): 3.66,
    ("nvfp4 experts, int8 dense", 4): 4.25,
    ("nvfp4 experts, int8 dense", 8): 4.46,
}


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
    # The published step drafts its next rows too (a draft model fused in the kernel), and
    # a mkgen kernel drafts nothing yet: the two are not like for like.
    drafting: bool = False


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
        drafting=True,
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
    base: ModelSpec, built: ModelSpec, topo: Topology, options: BuildOptions
) -> HandWritten | None:
    """The published kernel this build does the same work as: the shipped spec it names
    (`base`, the spec before --quant; a user's edited copy does not match), the same
    TPU7x slice, batch and rows, and the same weight formats (`built`, with --quant)."""
    for hand in HAND_WRITTEN:
        shape = (hand.model, parse_topology(hand.topology), hand.batch, hand.rows)
        if shape != (base.name, topo, options.batch, options.rows):
            continue
        if load_spec(hand.model) != base:
            continue
        formats = BuildOptions.create(quant=list(hand.quant))
        if formats.apply(base).quantization == built.quantization:
            return hand
    return None


def bar_text(step_ms: float, floor: IdealFloor, hand: HandWritten | None) -> str:
    """The predicted step against the ideal floor and, where one is published, the
    hand-written kernel (a measurement on TPU7x, where the step is a prediction)."""
    lines = [
        f"ideal floor {floor.ms:.3f} ms ({floor.bytes_per_core / 1e9:.3f} GB per core per step "
        f"at {floor.stream_rate / 1e12:.1f} TB/s, no replication, even experts, no padding): "
        f"the predicted step is {floor.times(step_ms)} (floor / step {floor.ratio(step_ms):.2f})"
    ]
    if hand is not None:
        faster = 1 - step_ms / hand.step_ms
        verdict = f"{faster:.0%} faster" if faster >= 0 else f"{step_ms / hand.step_ms:.2f}x it"
        unlike = (
            ", but not like for like: the published step includes drafting the next rows "
            "with a draft model fused in the kernel, and this kernel drafts nothing"
            if hand.drafting
            else ""
        )
        lines.append(
            f"hand-written kernel {hand.step_ms:.2f} ms measured on TPU7x ({hand.what}; "
            f"{hand.source}): the predicted step is {verdict}{unlike}"
        )
    return "; ".join(lines)
