"""The target's hidden states a drafter reads, written by the kernel (docs/drafting.md).

The plan names them (mkgen.plan.layout.draft_hidden_states: an mtp drafter's final-normed
last layer, a block drafter's feature layers) only for a spec with a draft section at
rows > 1; the kernel writes them as one more output, priced and counted in VMEM; verify
holds them against the reference's (mkgen.reference.draft.target_hidden), and a kernel
writing the wrong layer fails; the runner hands them to decode beside tokens and logits.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from mkgen.kinds import default_registry
from mkgen.plan import plan_build
from mkgen.plan.layout import DraftHidden
from mkgen.plan.options import BuildOptions
from mkgen.runtime.build import kernel_outputs
from mkgen.spec.loader import load_spec
from mkgen.spec.mini import mini_twin
from mkgen.spec.schema import ModelDraft
from mkgen.spec.topology import parse_topology
from mkgen.verify.numerics import verify_numerics

SPECS = Path(__file__).parent / "specs"
MTP, BLOCK = str(SPECS / "draft-mtp.yaml"), str(SPECS / "draft-block.yaml")
TIMEOUT = 600


def _plan(spec, rows: int):
    options = BuildOptions.create(rows=rows)
    return plan_build(spec, parse_topology("1x1x1"), options, kinds=default_registry())


def test_the_plan_names_the_states_the_drafter_reads() -> None:
    mtp, block = load_spec(MTP), load_spec(BLOCK)
    model = mtp.model_copy(
        update={"draft": ModelDraft(kind="model", model=mtp.model_copy(update={"draft": None}))}
    )
    assert _plan(mtp, 3).kernel.draft_hidden == [DraftHidden(layer=1, normed=True)]
    wanted = [DraftHidden(layer=0, normed=False), DraftHidden(layer=1, normed=True)]
    planned = _plan(block, 3)
    assert planned.kernel.draft_hidden == wanted
    assert _plan(model, 3).kernel.draft_hidden == []  # a small model reads tokens only
    plain = _plan(block, 1)  # rows 1 verifies no draft: nothing to write
    assert plain.kernel.draft_hidden == [] and "draft_hidden" not in plain.kernel.model_dump()
    # Counted in VMEM and priced as the HBM write it is (2 states x 8 rows x 1024 f32).
    buffer = next(b for b in planned.vmem.buffers if b.name == "draft_hidden_vmem")
    assert (buffer.role, buffer.shape) == ("output", (2, 8, 1024))
    write = [e for e in planned.program["epilogue"] if e["op"] == "draft hidden states -> HBM"]
    assert [e["bytes"] for e in write if e["event"] == "start"] == [2 * 8 * 1024 * 4]
    assert planned.estimate.step_ms > plain.estimate.step_ms
    # The twin verify runs keeps the drafter, its feature layers in its own layer count.
    assert mini_twin(block).draft.feature_layers == [0, 1]


@pytest.mark.parametrize(
    ("spec", "topology", "mode", "steps"),
    [(MTP, "1x1x1", "on_wait", 2), (BLOCK, "2x2x1", "eager", 1)],
    ids=["mtp-on_wait", "block-eager"],
)
def test_verify_holds_the_states_to_the_reference(
    spec: str, topology: str, mode: str, steps: int
) -> None:
    report = verify_numerics(spec, topology, mode=mode, steps=steps, rows=3, timeout=TIMEOUT)
    assert report.passed, report.failure()
    assert all(s.max_draft_hidden_diff > 0 for s in report.steps)


def test_a_kernel_writing_the_wrong_layer_fails() -> None:
    # The block drafter's layer-0 state written after layer 1 instead.
    written = "DRAFT_HIDDEN = (\n    ({}, False),"
    report = verify_numerics(
        BLOCK, "1x1x1", mode="on_wait", steps=1, rows=3, timeout=TIMEOUT,
        mutations=[(written.format(0), written.format(1))],
    )  # fmt: skip
    assert not report.passed
    assert "the drafter's hidden state 0 (the stream after layer 0) differs" in report.failure()


def test_the_runner_hands_decode_the_states() -> None:
    drafting = SimpleNamespace(draft_hidden=[DraftHidden(layer=1, normed=True)], draft_passes=None)
    plain = SimpleNamespace(draft_hidden=[], draft_passes=None)
    # A kernel that drafts writes its accepted rows and drafts where the states would be.
    fused = SimpleNamespace(draft_hidden=[], draft_passes="passes")
    assert kernel_outputs(drafting, ("t", "l", "h", "c0", "c1")) == ("t", "l", "h", ["c0", "c1"])
    assert kernel_outputs(plain, ("t", "l", "c0")) == ("t", "l", None, ["c0"])
    assert kernel_outputs(fused, ("t", "l", "d", "c0")) == ("t", "l", "d", ["c0"])
