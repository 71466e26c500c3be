"""The mtp drafter fused into the kernel (mkgen/plan/fused.py, docs/drafting.md).

The plan lays the passes out as layers after the target's (one cache slot for the MTP
module, its eh_proj and the LM head again around each pass in the stream, the program
walking them), the kernel drafts inside the step, verify holds its drafts and accepted
rows against the reference drafter and the accept rule in both DMA modes, a wrong accept
rule or a wrong roll-back fails, and the full-size kernel compiles for TPU7x.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from mkgen.errors import SpecError
from mkgen.kinds import default_registry
from mkgen.plan import plan_build
from mkgen.plan.options import BuildOptions
from mkgen.spec.loader import load_spec
from mkgen.spec.schema import MtpDraft
from mkgen.spec.topology import parse_topology
from mkgen.verify.numerics import verify_numerics

SPECS = Path(__file__).parent / "specs"
MTP, BLOCK = str(SPECS / "draft-mtp.yaml"), str(SPECS / "draft-block.yaml")
TIMEOUT = 600
FUSED = {"fuse_draft": True}


def _plan(spec_ref: str, rows: int = 3, **fields):
    options = BuildOptions.create(rows=rows, **fields)
    return plan_build(load_spec(spec_ref), parse_topology("1x1x1"), options,
                      kinds=default_registry())  # fmt: skip


def test_the_plan_lays_the_passes_out_as_layers() -> None:
    plan = _plan(MTP, fuse_draft=True)
    k, s = plan.kernel, plan.kernel.stream
    assert (k.draft_passes.first_layer, k.draft_passes.passes) == (2, 2)
    assert k.num_layers == 4 and k.draft_hidden == []  # the kernel reads its own states
    # One cache slot for the MTP module: the second pass writes the first's.
    assert k.attention_slot == [0, 1, 2, 2] and k.attention[0].layers == [0, 1, 2]
    # Stream order: the target's layers, its LM head, then each pass's eh_proj, layer and head.
    order = [s.lm_head_row, s.draft.eh_proj_rows[0], s.attention_rows[2], s.ffn_rows[2],
             s.draft.head_rows[0], s.draft.eh_proj_rows[1], s.attention_rows[3], s.ffn_rows[3],
             s.draft.head_rows[1]]  # fmt: skip
    assert s.ffn_rows[1] < order[0] and order == sorted(order)
    # eh_proj's output columns split over the chip's 2 cores.
    assert (s.draft.eh_proj.fan_in, s.draft.eh_proj.fan_out) == (2048, 512)
    ops = {op["op"] for ops in plan.program.values() for op in ops}
    assert {"greedy tokens -> SMEM", "token embeddings -> VMEM"} <= ops
    buffers = {b.name: b.shape for b in plan.vmem.buffers}
    assert buffers["drafts_vmem"] == (8, 128) and buffers["embed_vmem"] == (8, 1, 1024)
    assert {a.name: a.shape for a in plan.vmem.smem}["draft_smem"] == (3, 1)
    # The step is verify and draft; the verify-only kernel's step is walked beside it.
    plain = _plan(MTP)
    est = plan.estimate
    assert est.fused_verify_ms == pytest.approx(plain.estimate.step_ms, rel=0.02)
    assert est.step_ms > est.fused_verify_ms
    data = json.loads(plan.to_json())["estimate"]
    assert data["verify_ms"] + data["draft_ms"] == pytest.approx(data["step_ms"])
    assert "verify and draft in one kernel" in est.headline
    # A build that fuses nothing dumps as before.
    dumped = json.dumps(plain.kernel.model_dump()) + json.dumps(plain.options.model_dump())
    assert "draft_passes" not in dumped and "fuse_draft" not in dumped
    assert '"draft"' not in json.dumps(plain.kernel.stream.model_dump())


def test_a_chained_pass_is_priced_at_the_experts_its_rows_choose() -> None:
    """A chained pass's rows repeat one entry a sequence, so they choose one token's
    experts: the program fetches the worst core's expected slices at batch tokens there,
    at batch x rows tokens in the first pass (whose rows are distinct)."""
    target = load_spec("qwen3-30b-a3b")
    spec = target.model_copy(
        update={"draft": MtpDraft(kind="mtp", layers=1, attention="gqa", ffn="moe")}
    )
    options = BuildOptions.create(rows=4, fuse_draft=True)
    plan = plan_build(spec, parse_topology("2x2x1"), options, kinds=default_registry())
    passes = plan.kernel.draft_passes
    split = next(f.experts for f in plan.sharding.ffn.values() if f.experts is not None)
    fetched = plan.step_graph.schedule.experts_per_layer
    first, *chained = passes.layers
    assert fetched[first][0] == math.ceil(split.expected_max_experts_per_rank)
    one_token = split.chained_expected_max_experts_per_rank
    assert one_token < split.expected_max_experts_per_rank
    assert all(fetched[layer][0] == math.ceil(one_token) < fetched[first][0] for layer in chained)
    # The calibrated regime (no expert sharing) takes the unshared candidate's figure.
    none = next(c for c in split.sharing_candidates if not c.partner_experts)
    assert (
        split.unshared().chained_expected_max_experts_per_rank == none.chained_expected_max_experts
    )


@pytest.mark.parametrize(
    ("spec", "fields", "says"),
    [
        (BLOCK, {}, "the kernel fuses an mtp drafter only (this build's drafter: block)"),
        (MTP, {"rows": 1}, "rows 1 verifies no draft"),
    ],
    ids=["block-drafter", "rows-1"],
)
def test_what_cannot_fuse_is_refused_in_one_line(spec: str, fields: dict, says: str) -> None:
    with pytest.raises(SpecError, match="--fuse-draft") as error:
        _plan(spec, **{"rows": 3, **fields}, fuse_draft=True)
    assert says in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("topology", "mode", "batch", "rows"), [("1x1x1", "on_wait", 2, 4), ("2x2x1", "eager", 1, 3)]
)
def test_verify_holds_the_drafts_and_accepted_rows_to_the_reference(
    topology: str, mode: str, batch: int, rows: int
) -> None:
    """Sequence b starts at position b and is fed, from step b on every other step, rows the
    target accepts but the last: at batch 2 the sequences' positions and accepted rows
    differ, so each one's passes run at its own positions."""
    report = verify_numerics(
        MTP, topology, mode=mode, steps=2, batch=batch, rows=rows, timeout=TIMEOUT, knobs=FUSED
    )
    assert report.passed, report.failure()
    first, second = report.steps
    assert (first.accepted, second.accepted) == ([1] * batch, [rows - 1, 1][:batch])
    assert all(s.drafts_total == batch * (rows - 1) for s in report.steps)
    assert first.drafts_equal == first.drafts_total  # no near tie on these seeds' first steps
    assert all(s.max_draft_cache_diff > 0 for s in report.steps)  # compared, bf16-rounded


@pytest.mark.parametrize(
    ("mutation", "steps", "says"),
    [
        (
            ("(jnp.int32(1), jnp.int32(1))", "(jnp.int32(2), jnp.int32(1))"),
            1,
            "step 0: the kernel accepted 2 row(s) where the accept rule on its own greedy "
            "tokens accepts 1",
        ),
        (
            (
                "entry = lambda b: jnp.where(p == 0, draft_smem[0, b] - 1, 0)",
                "entry = lambda b: jnp.where(p == 0, 0, 0)",
            ),
            2,  # step 1 accepts 3 rows: its draft comes from the third
            "step 1: the fused drafter's drafts differ from the reference drafter's from draft 1",
        ),
        (
            (
                "pass_positions_smem[b] = positions_smem[b] + draft_smem[0, b] + p - 1",
                "pass_positions_smem[b] = positions_smem[0] + draft_smem[0, 0] + p - 1",
            ),
            1,  # at batch 2: sequence 1 starts at position 1, its passes at sequence 0's
            "step 0: sequence 1: the fused drafter's cache entries at positions 1 to 3 differ",
        ),
    ],
    ids=["accept-rule-one-too-many", "draft-from-the-first-row", "passes-at-sequence-0s-positions"],
)
def test_a_wrong_accept_rule_or_roll_back_fails(
    mutation: tuple[str, str], steps: int, says: str
) -> None:
    batch = 2 if "sequence 1" in says else 1
    report = verify_numerics(
        MTP, "1x1x1", mode="on_wait", steps=steps, batch=batch, rows=4, timeout=TIMEOUT,
        knobs=FUSED, mutations=[mutation],
    )  # fmt: skip
    assert not report.passed and says in report.failure()


def test_the_fused_kernel_compiles_for_tpu7x() -> None:
    from mkgen.verify.checks import compile_full_size

    options = BuildOptions.create(rows=3, fuse_draft=True)
    outcome = compile_full_size(load_spec(MTP), parse_topology("1x1x1"), options, "test")
    assert 0 < outcome.vmem_bytes <= outcome.plan_vmem_bytes
