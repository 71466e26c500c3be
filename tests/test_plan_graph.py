"""The step graph, its schedule and the VMEM plan: every check holds on every shipped spec,
each check fails on a schedule broken on purpose, and the VMEM plan is not below Mosaic's."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from mkgen.errors import MkgenError, SpecError
from mkgen.hardware import MiB
from mkgen.kinds import default_registry
from mkgen.kinds.moe import expert_iterations
from mkgen.plan import BuildOptions, BuildPlan, plan_build
from mkgen.plan.graph import CHECKS, analyse
from mkgen.plan.schedule import RUN, START, WAIT, Node, Schedule, build_schedule
from mkgen.spec.loader import list_spec_names, load_spec
from mkgen.spec.topology import parse_topology

# Every spec in model_specs/ on a topology where it fits (kimi-k2's fp8:128 dense formats
# cannot split 32 ways: its attention / dense MLP run bf16 here, see the report).
SPECS = [
    ("kimi-k3", "2x2x4", {"rows": 8}),
    ("kimi-k3", "2x2x4", {}),
    ("qwen3.8-27b", "2x2x1", {}),
    ("qwen3.8-27b", "2x2x1", {"batch": 8, "rows": 4}),
    ("muse-spark-1.2", "2x2x1", {}),
    ("muse-spark-1.2", "2x2x1", {"batch": 8}),
    (
        "kimi-k2",
        "2x2x4",
        {"quant": ["attention=bf16", "mlp=bf16", "shared_experts=bf16"]},
    ),
    ("qwen3-30b-a3b", "2x2x1", {}),
    ("qwen3-32b", "2x2x1", {}),
    ("qwen3-32b", "2x2x1", {"batch": 16, "context": 32768}),
    ("mixtral-8x7b", "2x2x1", {}),
    ("qwen3-235b-a22b", "2x2x2", {}),
    ("qwen3-235b-a22b", "2x2x4", {"rows": 4}),
]


def _plan(model: str, topology: str, **options) -> BuildPlan:
    return plan_build(
        load_spec(model),
        parse_topology(topology),
        BuildOptions.create(**options),
        kinds=default_registry(),
    )


@pytest.fixture(scope="module")
def small() -> BuildPlan:
    """A MoE + GQA plan small enough to break in many ways (ring 16, 4 expert slots, more
    experts per layer than slots)."""
    return _plan("qwen3-30b-a3b", "2x2x1", batch=4)


def _checks(schedule: Schedule, plan: BuildPlan) -> dict[str, bool]:
    return analyse(schedule, plan.vmem).checks


def _failed(schedule: Schedule, plan: BuildPlan) -> set[str]:
    return {k for k, v in _checks(schedule, plan).items() if not v}


def _event(schedule: Schedule, op: int, node: int) -> int:
    return schedule.events.index((op, node))


# --------------------------------------------------------------------------- every spec


def test_every_shipped_spec_is_covered() -> None:
    assert {m for m, _, _ in SPECS} == set(list_spec_names())


@pytest.mark.parametrize(("model", "topology", "options"), SPECS)
def test_every_check_holds_on_a_topology_that_fits(model, topology, options) -> None:
    plan = _plan(model, topology, **options)
    assert plan.memory.fits
    assert plan.vmem.within_budget
    assert plan.vmem.explicit_bytes <= plan.vmem.budget_bytes
    assert set(plan.graph.checks) == set(CHECKS)
    assert all(plan.graph.checks.values()), plan.graph.failures
    assert plan.graph.nodes > plan.stream.total_banks  # every bank is a node, and more
    assert plan.graph.edges > plan.graph.nodes
    assert plan.schedule.banks == plan.stream.total_banks
    assert plan.schedule.bytes_by_category["bank"] == plan.stream.bytes_per_step
    assert plan.estimate.step_ms > 0


def test_kimi_k3_plan_has_ring_slots_tiles_and_states() -> None:
    plan = _plan("kimi-k3", "2x2x4", rows=8)
    s = plan.schedule
    assert plan.vmem.expert_slots == 4  # measurements.md: 4 was best
    # Four collectives a layer (attention out; latent MoE gather, reduce-scatter,
    # all-reduce), each with its own buffer of 32-bit words holding bf16 pairs or f32: the
    # all-reduces' 8 + 4 round slots, 32 where a flat gather or scatter lands (the gathers'
    # buffer, shared with the dense layer's all-reduce, is 32 x 3584 words): under 7 MiB,
    # where a flat f32 exchange of every collective needed 28 MiB.
    assert plan.vmem.dims.collective_buffers == 4
    assert [b.slots for b in plan.vmem.dims.collectives.buffers] == [12, 32, 32, 12]
    assert plan.vmem.by_category["collectives"] < 7 * MiB
    assert plan.vmem.ring_depth == 16  # RING_VMEM_BYTES: 16 x 2 MiB, within the budget
    assert {
        "bank",
        "vector",
        "expert",
        "collective",
        "kv_tile",
        "state_read",
        "state_write",
    } <= set(s.dmas_by_category)
    # Every layer's vector slab once, and the input rows into the stream; 24 MLA layers
    # write their latent block.
    assert s.dmas_by_category["vector"] == 93 + 1
    assert s.dmas_by_category["cache_write"] == 24
    # KDA: 69 layers read and write the conv tail and state of the one sequence.
    assert s.dmas_by_category["state_read"] == s.dmas_by_category["state_write"] == 69 * 2
    # The expected worst-loaded rank's experts, every piece once (folded loops included).
    split = plan.sharding.ffn["moe"].experts
    pieces = plan.vmem.experts["moe"].pieces
    slices = math.ceil(split.expected_max_experts_per_rank)
    # One DMA a piece: mxfp4's E8M0 scale bytes follow its code bytes in one int8 array.
    assert plan.vmem.experts["moe"].array_shapes == [
        (5376 + 352, "int8")
    ]  # 336 scale rows, whole tiles
    assert s.dmas_by_category["expert"] == 92 * slices * pieces
    by_category = plan.vmem.by_category
    assert by_category["ring"] == plan.vmem.ring_depth * 2 * MiB + 128 * 1024  # + the wrap
    assert by_category["expert_slots"] == 4 * plan.vmem.expert_slot_bytes


def test_gated_deltanet_reads_and_writes_every_sequence_state() -> None:
    plan = _plan("qwen3.8-27b", "2x2x1", batch=4)
    layers = sum(1 for a, _ in plan.sharding.layer_table if a == "linear")
    s = plan.schedule
    assert s.dmas_by_category["state_read"] == s.dmas_by_category["state_write"] == layers * 2 * 4


@pytest.mark.parametrize("n", [1, 2, 5, 9, 13, 21, 40, 112])
@pytest.mark.parametrize(("pieces", "slots"), [(1, 4), (5, 4), (9, 4), (6, 4), (3, 2), (2, 1)])
def test_expert_loop_folding_keeps_every_slice_and_the_slot_phase(n, pieces, slots) -> None:
    kept = expert_iterations(n, pieces, slots)
    assert sum(rep for _, rep in kept) == n
    indices = [i for i, _ in kept]
    assert indices == sorted(set(indices)) and indices[0] == 0 and indices[-1] == n - 1
    period = slots // math.gcd(pieces, slots)
    # Kept iteration k meets the slots as the real iteration it names does.
    assert all((k - i) % period == 0 for k, (i, _) in enumerate(kept))
    assert len(kept) <= max(n, 0) and (n < 16 or len(kept) < n)


def test_the_ring_policy_is_the_kernels() -> None:
    plan = _plan("qwen3-32b", "2x2x1", held_refills=0)
    schedule = plan.step_graph.schedule
    depth = plan.vmem.ring_depth
    first, wait = schedule.positions()
    banks = [n for n in schedule.nodes if n.cat == "bank"]
    first_use: dict[int, int] = {}  # bank -> position of its first reader
    last_use: dict[int, int] = {}  # bank -> position of its last reader
    for node in schedule.nodes:
        for read, _, _ in node.reads:
            first_use[read] = min(first_use.get(read, first[node.id]), first[node.id])
            last_use[read] = max(last_use.get(read, -1), first[node.id])
    # Priming: banks 0..depth-1 start before any layer work, right after the input rows'
    # copy (before the entry barrier: copies into the core's own VMEM).
    assert [schedule.events[i + 1] for i in range(depth)] == [(START, b.id) for b in banks[:depth]]
    for g, bank in enumerate(banks):
        wrap = (f"ring_sems[{depth}]",) if g % depth == 0 else ()
        assert bank.slot == g % depth and bank.sems == (f"ring_sems[{g % depth}]", *wrap)
        if g >= depth:
            # Bank g starts right after the first use of bank g - depth + 1 (reaching it
            # means bank g - depth is used up), into the slot bank g - depth has left.
            assert first[bank.id] == first_use[banks[g - depth + 1].id] + 1
            assert last_use[banks[g - depth].id] < first[bank.id]
        assert wait[bank.id] > first[bank.id]


@pytest.mark.parametrize("held", [1, 6, 9])
def test_held_refills_start_once_a_collective_rounds_copies_are_under_way(held) -> None:
    """With refills held, a bank starts where the ring reaches it unless it is among the
    last `held` refills, which wait for a collective round: right after its copies and
    before it is waited, the round starts the oldest `refills_per_round` of them. Every
    bank still starts before its wait."""
    plan = _plan("qwen3-32b", "2x2x1", held_refills=held)
    schedule = plan.step_graph.schedule
    depth, nodes = plan.vmem.ring_depth, schedule.nodes
    per_round = plan.stream.refills_per_round
    assert schedule.held_refills == plan.stream.held_refills == held
    assert schedule.refills_per_round == per_round < 9
    first, wait = schedule.positions()
    bank_of = {n.id: n.key[1] for n in nodes if n.cat == "bank"}
    expected: list[int] = []  # banks in the order the kernel's rule starts them
    pending: list[int] = []
    reached: set[int] = set()
    for op, i in schedule.events:
        node = nodes[i]
        if op == START and node.cat == "collective":
            expected += pending[:per_round]
            pending = pending[per_round:]
        if op != RUN:
            continue
        for read, res, _ in node.reads:
            bank = bank_of.get(read)
            if res == "ring" and bank not in reached:
                reached.add(bank)
                if bank > 0:
                    pending.append(bank - 1 + depth)
                    if len(pending) > held:
                        expected.append(pending.pop(0))
    expected = [g for g in expected if g < schedule.total_banks]
    started = [bank_of[i] for op, i in schedule.events if op == START and i in bank_of]
    assert started[depth:] == expected
    after_collective = sum(
        1
        for k, (op, i) in enumerate(schedule.events)
        if op == START and i in bank_of and nodes[schedule.events[k - 1][1]].cat == "collective"
    )
    assert after_collective > 0
    assert all(wait[b] > first[b] for b in bank_of)


def test_too_many_held_refills_for_the_ring_is_refused() -> None:
    with pytest.raises(SpecError, match=r"--held-refills 11: a ring of 12 banks holds at most 10"):
        _plan("qwen3-30b-a3b", "2x2x1", ring_depth=12, held_refills=11)
    with pytest.raises(SpecError, match=r"--held-refills 2: one core has no collectives"):
        _plan("qwen3-30b-a3b", "v6e:1x1", quant=["experts=mxfp4"], held_refills=2)


def test_a_program_holding_more_refills_than_its_ring_allows_would_hang() -> None:
    """Held past depth - 2, a refill is still held when the core waits for its bank (the
    next collective's copies start only after that wait): deadlock_free says so."""
    plan = _plan("qwen3-30b-a3b", "2x2x1", ring_depth=6)
    spec = plan.options.apply(load_spec("qwen3-30b-a3b"))
    for held, hangs in ((4, False), (5, True)):
        stream = plan.stream.model_copy(update={"held_refills": held})
        schedule = build_schedule(
            spec, plan.sharding, stream, plan.vmem, plan.options, kinds=default_registry()
        )
        failures = analyse(schedule, plan.vmem).failures
        assert ("deadlock_free" in failures) is hangs, failures
    assert failures["deadlock_free"].startswith("at ring depth 6, ")
    assert "the kernel would hang" in failures["deadlock_free"]


def test_folded_loops_keep_the_bytes_of_every_iteration() -> None:
    plan = _plan("qwen3-32b", "2x2x1", batch=4, context=8192)
    tiles = plan.schedule.dmas_by_category["kv_tile"]
    # 64 layers x 4 sequences x 1 kv head x the context's tiles x (k, v)
    assert tiles == 64 * 4 * 1 * (8192 // plan.vmem.dims.kv_tiles["gqa"]) * 2
    # ...with a node count that does not grow with batch or context
    small = _plan("qwen3-32b", "2x2x1")
    assert plan.graph.nodes == small.graph.nodes


def test_describe_prints_one_line_per_node(small) -> None:
    step = small.step_graph
    lines = step.describe().splitlines()
    assert len(lines) == 1 + len(step.schedule.nodes)
    assert "bank 0" in lines[1]
    events = step.schedule.describe(limit=50).splitlines()
    # The input rows' copy, the ring's first banks and layer 0's vectors start before the
    # entry barrier (copies into the core's own VMEM).
    depth = small.vmem.ring_depth
    assert len(events) == 51
    kinds = [e.split()[1] for e in events[: depth + 3]]
    assert kinds == ["start"] * (depth + 2) + ["run"]
    assert (
        "x rows" in events[0]
        and "bank 0" in events[1]
        and "vectors of layer 0" in events[depth + 1]
    )
    assert "barrier" in events[depth + 2]


def test_the_json_has_the_issue_keys() -> None:
    data = _plan("qwen3.8-27b", "2x2x1").to_dict()
    for key in ("model", "topology", "devices", "batch", "rows", "context"):
        assert key in data
    assert set(data["memory"]) >= {
        "hbm_bytes_per_device", "hbm_usable_bytes_per_device", "vmem_bytes",
        "vmem_budget_bytes", "vmem_limit_bytes", "vmem_by_category",
    }  # fmt: skip
    assert set(data["graph"]) >= {"nodes", "edges", "checks"}
    assert set(data["estimate"]) >= {
        "step_ms", "hbm_floor_ms", "hbm_bytes_per_device_per_step", "tokens_per_s_per_user",
        "tokens_per_s", "tokens_per_dollar", "breakdown_ms",
    }  # fmt: skip


# --------------------------------------------------------------------------- broken on purpose


def test_an_intact_copy_passes(small) -> None:
    assert not _failed(small.step_graph.schedule.copy(), small)


def test_a_bank_in_the_wrong_slot_fails(small) -> None:
    broken = small.step_graph.schedule.copy()
    bank = broken.nodes[20]
    assert bank.key == ("bank", 20)
    bank.slot = (bank.slot + 1) % broken.ring_depth  # lands in its neighbour's slot
    failed = _failed(broken, small)
    assert "reads_after_writes" in failed  # its reader finds another bank there
    assert "no_slot_overwrite" in failed  # and it lands on a bank still in use


def test_a_slot_the_plan_does_not_allocate_fails(small) -> None:
    broken = small.step_graph.schedule.copy()
    broken.nodes[20].slot = broken.ring_depth
    assert "vmem_within_budget" in _failed(broken, small)


def test_a_missing_wait_fails(small) -> None:
    broken = small.step_graph.schedule.copy()
    tile = next(n for n in broken.nodes if n.cat == "kv_tile")
    broken.events.remove((WAIT, tile.id))
    failed = _failed(broken, small)
    assert "dma_waited_once" in failed
    assert "reads_after_writes" in failed  # the tile is read before it has landed


def test_a_bank_fetched_twice_fails(small) -> None:
    broken = small.step_graph.schedule.copy()
    again = broken.nodes[5].copy()
    again.id = len(broken.nodes)
    broken.nodes.append(again)
    # Fetched again after the step's last event, into a slot nobody reads any more.
    broken.events += [(START, again.id), (WAIT, again.id)]
    failed = _failed(broken, small)
    assert "weights_fetched_once" in failed


def test_an_expert_fetched_twice_or_never_fails(small) -> None:
    broken = small.step_graph.schedule.copy()
    expert = next(n for n in broken.nodes if n.cat == "expert" and n.key[2] == 0)
    _, layer, _, piece = expert.key
    expert.key = ("expert", layer, 1, piece)  # slice 1's piece twice, slice 0's never
    assert "weights_fetched_once" in _failed(broken, small)


def test_a_dma_into_a_slot_still_being_read_fails(small) -> None:
    broken = small.step_graph.schedule.copy()
    depth = broken.ring_depth
    g = 3
    nxt = broken.nodes[g + depth]
    reader = next(
        n for n in broken.nodes if n.op == "compute" and any(p == g for p, _, _ in n.reads)
    )
    # Start bank g + depth before bank g's matmul has read it.
    broken.events.remove((START, nxt.id))
    broken.events.insert(_event(broken, RUN, reader.id), (START, nxt.id))
    failed = _failed(broken, small)
    assert "no_slot_overwrite" in failed


def test_an_expert_slot_reused_too_early_fails(small) -> None:
    broken = small.step_graph.schedule.copy()
    slots = broken.expert_slots
    experts = [n for n in broken.nodes if n.cat == "expert" and n.layer == 0]
    assert len(experts) > slots
    late = experts[slots]  # reuses slot 0 after expert 0's matmuls
    broken.events.remove((START, late.id))
    broken.events.insert(_event(broken, START, experts[0].id) + 1, (START, late.id))
    failed = _failed(broken, small)
    assert "no_slot_overwrite" in failed


def test_a_cycle_fails(small) -> None:
    broken = small.step_graph.schedule.copy()
    depth = broken.ring_depth
    g = 2
    reader = next(
        n for n in broken.nodes if n.op == "compute" and any(p == g for p, _, _ in n.reads)
    )
    # A matmul that needs bank g and bank g + depth at once: they share one ring slot, so
    # bank g + depth can only land after the matmul has read bank g - which needs it.
    reader.reads = (*reader.reads, (g + depth, "ring", g % depth))
    checks = _checks(broken, small)
    assert not checks["acyclic"]


def test_a_shared_semaphore_fails(small) -> None:
    broken = small.step_graph.schedule.copy()
    # Banks 0 and 1 are in flight together from the start: one semaphore would be a race.
    broken.nodes[1].sems = broken.nodes[0].sems
    assert "semaphores_unshared" in _failed(broken, small)


def test_a_semaphore_the_plan_lacks_fails(small) -> None:
    broken = small.step_graph.schedule.copy()
    broken.nodes[1].sems = (f"ring_sems[{broken.ring_depth}]",)
    assert "semaphores_unshared" in _failed(broken, small)


def test_an_op_that_never_runs_fails(small) -> None:
    broken = small.step_graph.schedule.copy()
    op = next(n for n in broken.nodes if n.cat == "routing")
    broken.events.remove((RUN, op.id))
    failed = _failed(broken, small)
    assert "ops_run_once" in failed
    assert "reads_after_writes" in failed  # the expert DMAs need the routing


def test_vmem_over_budget_fails(small) -> None:
    tight = small.vmem.model_copy(update={"budget_bytes": small.vmem.explicit_bytes - 1})
    checks = analyse(small.step_graph.schedule, tight).checks
    assert not checks["vmem_within_budget"]


def test_collective_rounds_that_miss_a_core_fail(small) -> None:
    rounds = small.vmem.dims.collectives
    host = rounds.rounds[0]
    # Groups of 4 where the 8 cores of the host need one group of 8: half the partials
    # never reach a core.
    half = rounds.model_copy(update={"rounds": [host.model_copy(update={"size": 4})]})
    broken = small.vmem.model_copy(
        update={"dims": small.vmem.dims.model_copy(update={"collectives": half})}
    )
    graph = analyse(small.step_graph.schedule, broken)
    assert not graph.checks["collectives_balanced"]
    assert graph.failures["collectives_balanced"] == "rounds of [4] members do not cover 8 cores"


def test_every_check_can_fail() -> None:
    """The negative tests above (and tests/test_program.py for deadlock_free) cover every
    named check."""
    covered = {
        "acyclic", "reads_after_writes", "dma_waited_once", "no_slot_overwrite",
        "weights_fetched_once", "vmem_within_budget", "semaphores_unshared", "ops_run_once",
        "deadlock_free", "collectives_balanced",
    }  # fmt: skip
    assert covered == set(CHECKS)


def test_a_failed_check_is_one_line_naming_the_check_and_node(small) -> None:
    broken = small.step_graph.schedule.copy()
    broken.nodes[20].slot = (broken.nodes[20].slot + 1) % broken.ring_depth
    step = analyse(broken, small.vmem)
    with pytest.raises(MkgenError) as info:
        step.enforce()
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("schedule check reads_after_writes failed: node ")
    assert "'" in message  # the node's name


def test_node_copy_is_deep_enough(small) -> None:
    schedule = small.step_graph.schedule
    twin = schedule.copy()
    twin.nodes[0].slot = 99
    assert schedule.nodes[0].slot == 0
    assert isinstance(twin.nodes[0], Node)


# --------------------------------------------------------------------------- VMEM


def test_vmem_over_budget_is_a_one_line_error_with_numbers() -> None:
    with pytest.raises(SpecError) as info:
        # batch 8 fits, batch 16 is short of room for the ring: tests/test_kernel_modes.py
        _plan("kimi-k3", "2x2x4", rows=8, batch=24)
    message = str(info.value)
    assert "\n" not in message
    assert "MiB" in message and "collective0_vmem" in message and "--batch" in message


def test_a_budget_too_small_for_one_bank_is_its_own_error() -> None:
    with pytest.raises(SpecError, match=r"too small for one 2\.0 MiB weight bank"):
        _plan("qwen3-32b", "2x2x1", vmem_budget_bytes="5MiB")


def test_a_budget_above_the_limit_is_an_error() -> None:
    with pytest.raises(SpecError, match="exceeds the 63.9 MiB of VMEM a tpu7x kernel may use"):
        _plan("qwen3-32b", "2x2x1", vmem_budget_bytes="80MiB")


def test_a_tighter_budget_gives_a_shallower_ring_and_fewer_slots() -> None:
    wide = _plan("mixtral-8x7b", "2x2x1")
    tight = _plan("mixtral-8x7b", "2x2x1", vmem_budget_bytes="16MiB")
    assert (wide.vmem.ring_depth, wide.vmem.expert_slots) == (16, 4)
    assert tight.vmem.explicit_bytes <= 16 * MiB
    assert tight.vmem.ring_depth < wide.vmem.ring_depth
    assert tight.vmem.expert_slots < wide.vmem.expert_slots
    assert all(tight.graph.checks.values())


def test_expert_slots_hold_pieces_of_the_packed_slice() -> None:
    plan = _plan("muse-spark-1.2", "2x2x1")
    split = plan.sharding.ffn["moe"].experts
    e = plan.vmem.experts["moe"]
    # int4 codes two to a byte plus bf16 scales (two arrays, two DMAs a piece): the pieces
    # cover the HBM slice.
    assert e.code_dtype == "int8" and e.scale_dtype == "bf16" and e.arrays == 2
    assert split.slice_bytes <= e.pieces * e.piece_bytes < 1.1 * split.slice_bytes
    assert plan.vmem.expert_slot_bytes == e.piece_bytes  # no tile padding on [*, 256] pieces


# --------------------------------------------------------------------------- against Mosaic

# Every spec the code generator renders today, at the size it ships, and the test specs.
# (Mosaic's real VMEM use is held against the plan where each compiles: tests/test_codegen.py.)
RENDERED = [
    ("qwen3-32b", "2x2x1", {}),
    ("qwen3.8-27b", "2x2x1", {}),
    ("qwen3-30b-a3b", "2x2x1", {}),
    ("muse-spark-1.2", "2x2x1", {}),
    ("mixtral-8x7b", "2x2x1", {}),
    ("kimi-k3", "2x2x4", {"rows": 8}),
    # The compact modes: residual snapshots in HBM and states streamed, chosen at batch 8.
    ("kimi-k3", "2x2x4", {"rows": 8, "batch": 8}),
    ("qwen3.8-27b", "2x2x1", {"batch": 3, "rows": 2, "recurrent_states": "stream"}),
    ("kimi-k2", "2x2x4", {}),
    ("tests/specs/kda-hybrid.yaml", "2x2x1", {}),
    ("tests/specs/mla-hybrid.yaml", "1x1x1", {"batch": 2, "rows": 3}),
    ("tests/specs/latent-moe-shared.yaml", "2x2x2", {}),
    ("tests/specs/formats-mxfp4.yaml", "2x2x1", {}),
    ("tests/specs/formats-fp8.yaml", "2x2x1", {}),
    ("tests/specs/formats-int8.yaml", "2x2x1", {}),
    ("tests/specs/formats-nvfp4.yaml", "2x2x1", {}),
    ("tests/specs/formats-int8-experts.yaml", "2x2x1", {}),
]
_DTYPES = {
    "bfloat16": "bf16",
    "float32": "f32",
    "int32": "int32",
    "uint32": "uint32",
    "int8": "int8",
    "float8_e4m3fn": "fp8",
}
REPO = Path(__file__).resolve().parents[1]


def _kernel(model: str, topology: str, options: dict):
    from mkgen.codegen.build import load_module, render_kernel

    ref = str(REPO / model) if model.endswith(".yaml") else model
    spec, topo = load_spec(ref), parse_topology(topology)
    plan = plan_build(spec, topo, BuildOptions.create(**options), kinds=default_registry())
    name = "plan_graph_" + spec.name.replace("-", "_").replace(".", "_")
    return plan, plan.kernel, load_module(render_kernel(plan.kernel, "t"), name)


@pytest.mark.parametrize(("model", "topology", "options"), RENDERED)
def test_vmem_plan_lists_exactly_the_kernels_scratch(model, topology, options) -> None:
    plan, layout, kernel = _kernel(model, topology, options)
    assert plan.vmem.ring_depth == layout.stream.ring_depth
    kernel_list = []
    for s in kernel._scratch_shapes():
        dtype = "dma_sem" if str(s.dtype) == "dma_sem" else _DTYPES[str(s.dtype)]
        if str(s.memory_space) == "smem":
            dtype = f"smem:{dtype}"
        kernel_list.append((tuple(s.shape), dtype))
    plan_list = [(shape, dtype) for _, shape, dtype in plan.vmem.scratch_shapes()]
    assert plan_list == kernel_list
