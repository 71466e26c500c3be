"""One plan, one program: the kernel is rendered from the plan the checks prove, consumes
every kind's stream segments in the program's order, and a program that would hang at any
ring depth is refused at plan time."""

from __future__ import annotations

import difflib
import json
import re
from types import SimpleNamespace

import pytest
from cli_run import assert_user_error, mkgen_here

from mkgen.codegen.build import render_kernel
from mkgen.codegen.build_list import entry_inputs, read_build_list
from mkgen.codegen.conformance import check_program_order, consumed_segments
from mkgen.codegen.package import mini_kernel_args, render_build
from mkgen.kinds import default_registry, moe
from mkgen.plan import BuildOptions, plan_build
from mkgen.plan.graph import ScheduleCheckError
from mkgen.plan.kind import KindRegistry
from mkgen.plan.sharding import full_size_splits
from mkgen.spec.loader import load_spec
from mkgen.spec.mini import mini_twin
from mkgen.spec.topology import parse_topology
from mkgen.verify.numerics import verify_numerics


def _plan(model: str, topology: str, **options):
    return plan_build(
        load_spec(model),
        parse_topology(topology),
        BuildOptions.create(**options),
        kinds=default_registry(),
    )


@pytest.mark.parametrize("entry", read_build_list(), ids=lambda e: e.line)
def test_every_checked_in_kernel_consumes_its_segments_in_program_order(entry) -> None:
    plan = plan_build(*entry_inputs(entry), kinds=default_registry())
    consumed = consumed_segments(render_kernel(plan.kernel, ""), plan.kernel)
    program = plan.schedule.segment_order
    assert consumed == {kind: program[kind] for kind in consumed}
    # Outside the layer kinds: the LM head, and a fused drafter's eh_proj (one segment each,
    # so no order to hold).
    outside = {"lm_head"} | ({"eh_proj"} if plan.kernel.draft_passes else set())
    assert set(program) == set(consumed) | outside


def test_kimi_k3s_moe_streams_shared_down_before_latent_out_as_its_kernel_does() -> None:
    plan = _plan("kimi-k3", "2x2x4", rows=8)
    moe = next(f for f in plan.kernel.ffn if f.name == "moe")
    offsets = {s.name: s.offset for s in moe.segments}
    assert offsets["in"] < offsets["shared_down"] < offsets["latent_out"]
    assert plan.schedule.segment_order["moe"] == ["in", "shared_down", "latent_out"]


def test_a_kernel_out_of_program_order_is_refused_naming_both_segments() -> None:
    plan = _plan("kimi-k3", "2x2x4", rows=8)
    source = render_kernel(plan.kernel, "")
    swapped = dict(plan.schedule.segment_order, moe=["in", "latent_out", "shared_down"])
    with pytest.raises(ScheduleCheckError) as info:
        check_program_order(source, plan.kernel, swapped)
    message = str(info.value)
    assert "moe consumes shared_down where the plan's program consumes latent_out" in message
    assert "\n" not in message


def test_a_stream_laid_out_against_the_programs_order_is_refused_at_plan_time() -> None:
    """The old layout (latent_out's rows before shared_down's, consumed the other way
    round) has shared_down (run in the expert reduce-scatter's flight: Kimi K3 at batch 4,
    whose latent MoE reduce-scatters) read the bank it shares with latent_out before
    anything waited for it and, at a shallow ring, wait for a bank the ring has not
    started: refused, naming op and bank."""
    old = _moe_segments_in(["in", "latent_out", "shared_down"])
    options = BuildOptions.create(rows=8, batch=4)
    with pytest.raises(ScheduleCheckError) as info:
        plan_build(load_spec("kimi-k3"), parse_topology("2x2x4"), options, kinds=old)
    message = str(info.value)
    assert message.startswith("schedule check reads_after_writes failed:")
    assert re.search(
        r"'L\d+ moe\.shared_down bank (\d+)' reads ring\[\d+\] before node \1 ", message
    )
    assert "has landed there (not waited)" in message
    spec, topo = load_spec("kimi-k3"), parse_topology("2x2x4")
    plan = plan_build(spec, topo, options, enforce=False, kinds=old)
    assert plan.sharding.ffn["moe"].latent_design == "rs_ar"
    hang = plan.graph.failures["deadlock_free"]
    assert re.match(r"at ring depth 2, 'L\d+ moe\.shared_down bank", hang), hang
    assert "the kernel would hang" in hang


def test_every_ring_depth_the_planner_may_pick_is_deadlock_free() -> None:
    for depth in (2, 3, 16):
        plan = _plan("kimi-k3", "2x2x4", rows=8, ring_depth=depth)
        assert plan.vmem.ring_depth == plan.kernel.stream.ring_depth == depth
        assert plan.graph.checks["deadlock_free"]


def test_the_build_renders_the_plan_it_reports(tmp_path) -> None:
    """One plan per build: the kernel's ring and expert slots are the VMEM plan's, in the
    full build and in its mini twin (whose banks are small)."""
    spec, topo = load_spec("qwen3-30b-a3b"), parse_topology("2x2x1")
    rendered = render_build(spec, topo, BuildOptions.create(expert_slots=3))
    for path in ("plan.json", "mini/plan.json"):
        data = json.loads(rendered.files[path])
        kernel, vmem = data["kernel"], data["plan"]["vmem"]
        assert kernel["stream"]["ring_depth"] == vmem["ring_depth"]
        assert kernel["stream"]["bank_rows"] * 256 * 2 == vmem["bank_bytes"]
        assert [f["expert_slots"] for f in kernel["ffn"]] == [vmem["expert_slots"]] == [3]
        assert set(data["plan"]["program"]) >= {"prologue", "gqa/moe", "epilogue"}


def test_the_knobs_are_cli_flags_recorded_in_the_build(tmp_path) -> None:
    out = tmp_path / "build"
    result = mkgen_here(
        "build", "qwen3-30b-a3b", "--topology", "2x2x1", "--ring-depth", "4",
        "--expert-slots", "2", "-o", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    header = (out / "megakernel.py").read_text()
    assert "ring depth 4, expert slots 2" in header
    assert "--ring-depth 4 --expert-slots 2" in header
    plan = json.loads((out / "plan.json").read_text())
    assert plan["kernel"]["stream"]["ring_depth"] == 4


@pytest.mark.parametrize(
    ("flags", "fragments"),
    [
        (["--ring-depth", "1"], ["--ring-depth 1", "2 to 16"]),
        (["--ring-depth", "17"], ["--ring-depth 17", "2 to 16"]),
        (["--expert-slots", "0"], ["--expert-slots 0"]),
        (
            ["--ring-depth", "16", "--vmem-budget", "20MiB"],
            ["--ring-depth 16", "lower --ring-depth"],
        ),
    ],
)
def test_knobs_outside_what_fits_are_one_line_errors(flags, fragments) -> None:
    assert_user_error(
        mkgen_here("plan", "kimi-k3", "--topology", "2x2x4", "--rows", "8", *flags), *fragments
    )


def test_plan_json_carries_the_program_and_the_deadlock_check() -> None:
    result = mkgen_here("plan", "kimi-k3", "--topology", "2x2x4", "--rows", "8", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["graph"]["checks"]["deadlock_free"] is True
    ops = data["program"]["kda/moe"]
    names = [op["op"] for op in ops if op["event"] == "run" and op["category"] == "matmul"]
    firsts = [n.split(" bank ")[0] for n in names]
    assert list(dict.fromkeys(firsts)) == ["kda.in", "kda.f_b", "kda.o", "moe.in",
                                           "moe.shared_down", "moe.latent_out"]  # fmt: skip
    assert any(op["category"] == "expert" and "semaphores" in op for op in ops)


RUN_TIMEOUT = 600  # an outer bound: verify's child exits by itself once it stalls


def test_a_build_forced_past_the_check_hangs_in_interpret_mode() -> None:
    """The MoE stream laid out as (latent_out, shared_down, in) while the kernel consumes
    in, shared_down, latent_out: at ring depth 2 the plan refuses it; the same kernel,
    forced past the check (its Segment constants put into Kimi K3's mini twin), waits on
    a bank the ring never started and verify reports the hang as soon as the child stalls
    (long before its timeout), where the checked kernel at the same depth verifies."""
    topology = parse_topology("1x1x1")
    spec = mini_twin(load_spec("kimi-k3"), topology.num_devices)
    options = BuildOptions.create(ring_depth=2, context=128)
    # The twin takes the full-size build's split choices, as verify's twin does.
    splits = full_size_splits(load_spec("kimi-k3"), topology, options, kinds=default_registry())
    options = options.model_copy(update={"splits": splits})

    def kernel(enforce: bool = True, kinds: KindRegistry | None = None) -> str:
        plan = plan_build(spec, topology, options, **mini_kernel_args(), trace_residuals=True,
                          enforce=enforce, kinds=kinds or default_registry())  # fmt: skip
        assert plan.graph.checks["deadlock_free"] is enforce
        if not enforce:  # among the failures (the first one named is a cycle it makes)
            assert "'L1 moe.in bank" in plan.graph.failures["deadlock_free"]
        return render_kernel(plan.kernel, "verify")

    checked = kernel()
    swapped = _moe_segments_in(["latent_out", "shared_down", "in"])
    with pytest.raises(ScheduleCheckError, match="deadlock_free|acyclic"):
        kernel(kinds=swapped)
    forced = kernel(enforce=False, kinds=swapped)

    old, new = checked.splitlines(keepends=True), forced.splitlines(keepends=True)
    edits = difflib.SequenceMatcher(None, old, new).get_opcodes()
    mutations = [
        ("".join(old[a:b]), "".join(new[c:d])) for tag, a, b, c, d in edits if tag != "equal"
    ]
    # Only the MoE's Segment constants move (their offsets; ruff may wrap one over lines).
    assert mutations and all("offset=" in o and "offset=" in n for o, n in mutations), mutations
    assert "MOE_" in "".join(o for o, _ in mutations)
    run = dict(mode="on_wait", steps=1, knobs={"ring_depth": 2})
    control = verify_numerics("kimi-k3", "1x1x1", **run, timeout=RUN_TIMEOUT)
    assert control.passed, control.failure()
    report = verify_numerics("kimi-k3", "1x1x1", **run, timeout=RUN_TIMEOUT, mutations=mutations)
    assert not report.passed
    # "stalled", not "timed out": the child found its own hang.
    assert "stalled" in (report.error or "") and "deadlock" in report.error, report.failure()


def _moe_segments_in(order: list[str]) -> KindRegistry:
    """The default kinds with MoE's fused stream segments laid out in `order`: a registry
    is a value, so a test swaps one kind's rule without touching the others'."""
    fused = dict(moe.SEGMENTS)
    rules = SimpleNamespace(**{k: getattr(moe, k) for k in dir(moe) if not k.startswith("__")})
    rules.SEGMENTS = [(name, fused[name]) for name in order]
    return KindRegistry({**default_registry().kinds, "moe": rules})
