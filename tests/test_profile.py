"""`mkgen compile --profile`: Mosaic's LLO counted per phase and held against the model."""

from __future__ import annotations

import json
import re

import pytest

from mkgen.kinds import default_registry
from mkgen.plan import BuildOptions, plan_build
from mkgen.plan.opcount import NORM_OPS, node_op_counts
from mkgen.spec.loader import load_spec
from mkgen.spec.topology import parse_topology
from mkgen.verify.llo import StepCounter, op_group, parse_llo
from mkgen.verify.profile import kind_of, phase_of
from tests.cli_run import (
    REPORTED,
    assert_user_error,
    compiled_profile,
    mkgen,
    reported_profile,
)

# A kernel as Mosaic prints it after finalize: a constant loop of 3 whose guard lets 2 of
# its 4 chunk blocks run (c = 2 * i + j < 5), a sibling region reusing the first loop's
# SSA names with another bound, a while loop of scalar work (kept out), and a loop bounded
# by another loop's second result (%r#1: runtime).
LLO = """\
module @k {
  func.func @k(%arg0: i32) {
    %c0 = llo.constant {value = 0 : i32} : i32 loc(#loc)
    %c1 = llo.constant {value = 1 : i32} : i32 loc(#loc)
    %c2 = llo.constant {value = 2 : i32} : i32 loc(#loc)
    %c3 = llo.constant {value = 3 : i32} : i32 loc(#loc)
    %c5 = llo.constant {value = 5 : i32} : i32 loc(#loc)
    %n = llo.sld %arg0 : i32 loc(#loc)
    scf.for %i = %c0 to %c3 step %c1  : i32 {
      %m = llo.smul.u32 %i, %c2 loc(#loc)
      %lt = llo.slt.s32 %m, %c5 loc(#loc)
      scf.if %lt {
        "llo.vmatmul.mubr"(%arg0) : (i32) -> () loc(#loc4)
        %a = llo.vadd.f32 %arg0, %arg0 : f32 loc(#loc4)
      } {in_layout = []} loc(#loc5)
      %m1 = llo.sadd.s32 %m, %c1 loc(#loc)
      %lt1 = llo.slt.s32 %m1, %c5 loc(#loc)
      scf.if %lt1 {
        %b = llo.vadd.f32 %arg0, %arg0 : f32 loc(#loc4)
      } {in_layout = []} loc(#loc5)
    } {in_layout = []} loc(#loc6)
    scf.for %i = %c0 to %c2 step %c1  : i32 {
      %m = llo.smul.u32 %i, %c2 loc(#loc)
      %lt = llo.slt.s32 %m, %c1 loc(#loc)
      scf.if %lt {
        %v = llo.vector_load %arg0 : i32 loc(#loc4)
      } {in_layout = []} loc(#loc5)
    } {in_layout = []} loc(#loc6)
    %w = scf.while (%x = %c0) : (i32) -> i32 {
      %more = llo.slt.s32 %x, %n loc(#loc)
      scf.condition(%more) %x : i32 loc(#loc)
    } do {
    ^bb0(%x: i32 loc(#loc)):
      %x1 = llo.sadd.s32 %x, %c1 loc(#loc)
      scf.yield %x1 : i32 loc(#loc)
    } attributes {in_layout = []} loc(#loc)
    %r:2 = scf.for %u = %c0 to %c2 step %c1 iter_args(%p = %n, %q = %n) -> (i32, i32)  : i32 {
      scf.yield %p, %q : i32, i32 loc(#loc)
    } {in_layout = []} loc(#loc)
    scf.for %t = %c0 to %r#1 step %c1  : i32 {
      llo.vector_store %arg0 into %arg0 : i32 into i32 loc(#loc7)
      "llo.enqueue_dma"(%arg0) : (i32) -> () loc(#loc7)
      %s = llo.sadd.s32 %t, %c1 loc(#loc)
    } {in_layout = []} loc(#loc8)
    return loc(#loc)
  }
}
#loc = loc(unknown)
#loc1 = loc("rendered:k.py":10:4)
#loc2 = loc("rendered:k.py":20:8)
#loc3 = loc("rendered:k.py":30:2)
#loc4 = loc(callsite(#loc9 at #loc10))
#loc5 = loc("Ring.matmul.<locals>.unit_step"(#loc2))
#loc6 = loc("_experts_moe.<locals>.run"(#loc1))
#loc7 = loc("_attend_gqa.<locals>.pair.<locals>.step"(#loc3))
#loc8 = loc("_attend_gqa.<locals>.pair"(#loc3))
#loc9 = loc("_bf16_product.<locals>.product"(#loc2))
#loc10 = loc("Ring.matmul.<locals>.unit_step.<locals>._"(#loc1))
"""


def _counts(trips: float | None = 4) -> dict[tuple[str, str], float]:
    counter = StepCounter(parse_llo(LLO), lambda frames: trips)
    out: dict[tuple[str, str], float] = {}
    for (frames, group), n in counter.count().items():
        key = (phase_of(frames), group)
        out[key] = out.get(key, 0) + n
    return out


def test_guarded_blocks_run_as_often_as_their_guard_holds() -> None:
    counts = _counts()
    # c = 2i + j < 5 over i in 0..2: j = 0 holds for i = 0, 1, 2 and j = 1 for i = 0, 1.
    assert counts[("experts", "mxu")] == 3
    assert counts[("experts", "vpu")] == 3 + 2
    # The sibling loop reuses %m and %lt with bound 1: only i = 0.
    assert counts[("experts", "loads")] == 1


def test_runtime_bounded_loops_run_the_trips_the_caller_gives() -> None:
    counts = _counts(trips=4)
    assert counts[("attention", "stores")] == 4
    assert counts[("attention", "dmas")] == 4


def test_an_unknown_runtime_loop_is_listed_not_guessed() -> None:
    counter = StepCounter(parse_llo(LLO), lambda frames: None)
    counter.count()
    assert counter.unresolved and "_attend_gqa.<locals>.pair" in counter.unresolved[0]


def test_ops_inherit_the_call_stack_of_their_loop() -> None:
    counter = StepCounter(parse_llo(LLO), lambda frames: 1)
    frames = {f for (f, group) in counter.count() if group == "mxu"}
    (stack,) = frames
    assert stack[0] == "_bf16_product.<locals>.product"
    assert "_experts_moe.<locals>.run" in stack  # from the loop around the guarded block


def test_op_groups() -> None:
    assert op_group("vmatprep.subr") == "mxu"
    assert op_group("vlatchi") == "mxu"
    assert op_group("vadd.f32") == "vpu"
    assert op_group("vector_store_masked") == "stores"
    assert op_group("enqueue_dma") == "dmas"
    assert op_group("sadd.s32") is None
    assert op_group("vsync.add") is None


def test_the_outermost_phase_and_kind_decide() -> None:
    ring = ("Ring.matmul.<locals>.unit_step", "Ring.matmul")
    assert phase_of(ring + ("_attention_gqa", "_kernel")) == "stream matmul"
    assert phase_of(ring + ("_experts_moe.<locals>.run", "_experts_moe", "_ffn_moe")) == "experts"
    # A cached lowering keeps its first caller's frames inside the routing's.
    stale = ("_attend_gqa.<locals>.pair.<locals>.step", "_top_k", "_route_moe", "_ffn_moe")
    assert phase_of(stale) == "routing"
    assert phase_of(("_rms_norm", "_kernel")) == "vector"
    # Work run inside a collective while its copies travel is the phase of what it runs.
    flight = ("_in_flight", "_reduce_scatter_in_flight.<locals>.on_sent", "_round_exchange",
              "Collectives._round", "Collectives.reduce_scatter", "_reduce_scatter_in_flight",
              "_ffn_moe", "_kernel")  # fmt: skip
    assert phase_of(ring + ("_ffn_moe.<locals>.shared_experts", *flight)) == "stream matmul"
    assert phase_of(("_activation", "_ffn_moe.<locals>.shared_experts", *flight)) == "vector"
    assert phase_of(("_to_wire", "Collectives.reduce_scatter", "_ffn_moe")) == "collectives"
    frames = ("_write_cache_local", "_attention_local", "_write_cache_global", "_attention_global")
    assert kind_of(frames, {"local", "global"}) == "global"
    assert kind_of(("_rms_norm", "_kernel"), {"gqa"}) is None


def test_json_needs_profile() -> None:
    assert_user_error(
        mkgen("compile", "qwen3-30b-a3b", "--topology", "2x2x1", "--json"), "--json", "--profile"
    )


def test_the_profiles_predicted_step_is_the_plans_step_and_its_dma_timeline_says_so() -> None:
    """`compile --profile --json`'s predicted_step_us is the plan's step (the walk's end); the
    DMA engine's busy time, which it compares the compute timeline with, is dma_timeline_us."""
    from mkgen.verify.profile import profile_build

    spec = load_spec("qwen3-30b-a3b")
    plan = plan_build(
        spec, parse_topology("2x2x1"), BuildOptions.create(), kinds=default_registry()
    )
    record = profile_build("", plan, spec, "qwen3-30b-a3b-2x2x1").record()
    assert record["predicted_step_us"] == round(plan.estimate.step_ms * 1e3, 3)
    assert record["dma_timeline_us"] == round(plan.estimate.dma_timeline_ms * 1e3, 3)
    assert record["dma_timeline_us"] < record["predicted_step_us"]
    assert record["point"] == "batch 1 x rows 1"


def _vector_node_ops(spec_name: str, topology: str) -> dict[str, float]:
    """Vector ALU ops the model gives each vector-phase node of layer 0 (by the node's
    name after its layer) in one step's plan."""
    options = BuildOptions.create()
    spec = options.apply(load_spec(spec_name))
    plan = plan_build(spec, parse_topology(topology), options, kinds=default_registry())
    schedule = plan.step_graph.schedule
    per_node, _ = node_op_counts(
        schedule, plan.stream, plan.vmem, plan.sharding, spec, default_registry()
    )
    return {
        node.name.removeprefix("L0 "): ops.vpu
        for node, (phase, ops) in zip(schedule.nodes, per_node, strict=True)
        if phase == "vector" and node.name.startswith("L0 ")
    }


def test_norms_and_heads_op_are_priced_by_the_measured_template_code() -> None:
    ops = _vector_node_ops("qwen3-30b-a3b", "2x2x1")
    per_lanes, once = NORM_OPS[8]
    # hidden 2048 at 1 row (8 padded): 16 lanes-blocks of the measured norm
    assert ops["gqa: attn_norm"] == ops["moe: ffn_norm"] == 16 * per_lanes + once
    # 4 q heads and 1 kv head per core, 128 wide with RoPE on all of it: 5 x 21 + 10
    assert ops["gqa: q/k norm, rope, new rows"] == 115


def test_a_latent_the_template_does_not_norm_costs_no_vector_ops() -> None:
    # Muse Spark's latent MoE has no latent norm weight: the template emits no norm.
    assert _vector_node_ops("muse-spark-1.2", "2x2x1")["moe: latent norm"] == 0


# Every phase with more than this share of the step's vector ALU ops is held to the model.
SIGNIFICANT = 0.01
TOLERANCE = 0.25
BUILDS = [
    ("qwen3-30b-a3b", "2x2x1", "1"),
    ("muse-spark-1.2", "2x2x1", "1"),
    ("kimi-k3", "2x2x4", "8"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("spec", "topology", "rows"), BUILDS, ids=[b[0] for b in BUILDS])
def test_model_is_within_a_quarter_of_the_compiled_kernel(
    run_once, run_once_dir, spec: str, topology: str, rows: str
) -> None:
    if (spec, topology, rows) == (*REPORTED, "1"):
        # The profile test_update_report_records_the_profile_table's compile records: the
        # same compile, its record as --json prints it ({"compile": ..., **profile}).
        from mkgen.codegen.measurements import read_measurements

        build, result = reported_profile(run_once, run_once_dir)
        assert result["returncode"] == 0, result["stderr"]
        measured = read_measurements(build) or {}
        profile = {"compile": measured["compile"], **measured["profile"]}
    else:
        # Muse Spark's and Kimi K3's compiles are also tests/test_codegen.py's (their VMEM
        # against the plan's).
        result = compiled_profile(run_once, spec, topology, rows)
        assert result["returncode"] == 0, result["stderr"]
        profile = json.loads(result["stdout"])
    assert profile["unpriced_formats"] == []
    phases = profile["phases"]
    total = sum(p["compiled_vpu_ops"] for p in phases)
    held = [p for p in phases if p["compiled_vpu_ops"] > SIGNIFICANT * total]
    assert held
    misses = [
        f"{p['name']} {what}: compiled {p[f'compiled_{what}']:,}, model {p[f'model_{what}']:,}"
        for p in held
        for what in ("vpu_ops", "mxu_pushes", "dmas")
        if abs(p[f"model_{what}"] - p[f"compiled_{what}"]) > TOLERANCE * p[f"compiled_{what}"]
    ]
    assert not misses, misses


@pytest.mark.slow
def test_update_report_records_the_profile_table(run_once, run_once_dir) -> None:
    build, result = reported_profile(run_once, run_once_dir)
    assert result["returncode"] == 0, result["stderr"]
    assert "recorded in" in result["stdout"]
    report = (build / "REPORT.md").read_text()
    assert "Static profile per step and core" in report
    # 3 expert slices a layer (half of each group's experts shared with its pair; 4 without).
    assert re.search(r"^\| experts \| [\d,]+ \| [\d,]+ \| 224,640 \| 224,640 \|", report, re.M)
    assert "DMA-bound" in report
    assert "VMEM Mosaic uses" in report  # the compile is recorded with it
