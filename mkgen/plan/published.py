"""The hand-written TPU7x megakernels' published step times: the bar a generated kernel is
held against in REPORT.md and `make bench`.

Sources (public Inferact tpu-megakernels repository, README.md and musespark/README.md):
Muse Spark's 12 rows (three weight configurations, batch 1 to 8) are the rows the cost
model is calibrated against (mkgen/plan/calibration.py), and its batch-1 rows are the
bar of the builds doing the same work. Kimi K3 and Qwen3.8-27B are the seeds' serving
points, given as accepted tokens/s per user at acceptance length 6 with 8 rows per step
(1 anchor + 7 drafts), so a step is 6 / (tokens/s) seconds, drafting included: Kimi K3's
with a DSpark drafter, Qwen3.8-27B's with DFlash2 (z-lab/Qwen3.8-27B-DFlash2). A seed names
the drafter spec mkgen ships for its model (mkgen/model_specs/drafters/), which `mkgen plan
--draft` prices so that the comparison is like with like."""

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
    drafter: str = ""  # the drafter the published step ran with
    # The drafter spec mkgen ships for this model (mkgen/model_specs/drafters/NAME.yaml),
    # which `mkgen plan --draft NAME` prices beside the verify step.
    shipped_drafter: str = ""


def _seed(
    model: str, topology: str, tokens_per_s_per_user: float, drafter: str, shipped: str
) -> HandWritten:
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
        drafter=drafter,
        shipped_drafter=shipped,
    )


HAND_WRITTEN: tuple[HandWritten, ...] = (
    _seed("kimi-k3", "2x2x4", 709, "a DSpark drafter", "kimi-k3-mtp"),
    _seed(
        "qwen3.8-27b", "2x2x1", 1515, "DFlash2 (z-lab/Qwen3.8-27B-DFlash2)", "qwen3.8-27b-dflash"
    ),  # fmt: skip
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


def bar_text(
    step_ms: float,
    floor: IdealFloor,
    hand: HandWritten | None,
    draft_ms: float | None = None,
    drafter: str = "",
    fused: bool = False,
) -> str:
    """The predicted step `step_ms` against the ideal floor and, where one is published,
    the hand-written kernel (a measurement on TPU7x, where the step is a prediction). With
    a drafter priced (`draft_ms`, `drafter` naming it: mkgen/plan/draft.py) the floor is held
    against the verify step (what the floor reads) and the published step against verify +
    draft: like with like where the published step drafts too. A `fused` step drafts inside
    the kernel (mkgen/plan/fused.py): the floor then reads the passes' weights too."""
    verify = "verify " if draft_ms is not None else ""
    lines = [
        f"ideal floor {floor.ms:.3f} ms ({floor.bytes_per_core / 1e9:.3f} GB per core per step "
        f"at {floor.stream_rate / 1e12:.1f} TB/s, no replication, even experts, no padding): "
        f"the predicted {verify}step is {floor.times(step_ms)} (floor / step "
        f"{floor.ratio(step_ms):.3f})"
    ]
    if hand is not None:
        lines.append(_against_hand_written(step_ms, hand, draft_ms, drafter, fused))
    return "; ".join(lines)


def _against_hand_written(
    step_ms: float, hand: HandWritten, draft_ms: float | None, drafter: str, fused: bool
) -> str:
    ours = step_ms + (draft_ms or 0.0)
    faster = 1 - ours / hand.step_ms
    verdict = f"{faster:.0%} faster" if faster >= 0 else f"{ours / hand.step_ms:.2f}x it"
    subject, unlike = "the predicted step", ""
    if fused:
        subject = "the predicted step (verify and draft in one kernel, the model's MTP layers)"
        if hand.drafting:
            unlike = (
                ", like for like: both kernels draft inside the step, each with its own drafter"
            )
    elif draft_ms is not None:
        subject = (f"verify {step_ms:.3f} + draft {draft_ms:.3f} = {ours:.3f} ms (predicted, "
                   f"drafter {drafter})")  # fmt: skip
        if hand.drafting:
            unlike = (", like for like: both steps include drafting, each with its own drafter "
                      "(this one priced by the cost model as fused into the kernel; --fuse-draft "
                      "plans the kernel that runs it)")  # fmt: skip
    elif hand.drafting:
        command = (f"mkgen plan {hand.model} --topology {hand.topology} --rows {hand.rows} "
                   f"--draft {hand.shipped_drafter}")  # fmt: skip
        priced = (f"; `{command}` prices verify + draft with the drafter spec mkgen ships"
                  if hand.shipped_drafter else "")  # fmt: skip
        unlike = (", but not like for like: the published step includes drafting the next rows "
                  f"with a draft model fused in the kernel, and this kernel drafts nothing{priced}")  # fmt: skip
    with_drafter = f", with {hand.drafter}" if hand.drafter else ""
    return (
        f"hand-written kernel {hand.step_ms:.2f} ms measured on TPU7x ({hand.what}"
        f"{with_drafter}; {hand.source}): {subject} is {verdict}{unlike}"
    )
