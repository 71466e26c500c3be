"""Stages 1 to 5 and the schedule of a build: the program the cost model prices.

``plan_program`` plans a build's sharding, memory fit, weight stream, VMEM and schedule
with the KV tiles the cost model chooses (mkgen/plan/kvtiles.py) and the refills held
for collectives from the tuned table or scored (mkgen/plan/holds.py). ``plan_build``
(mkgen/plan/__init__.py) adds the kernel layout, the checks and the estimate; the
drafter's price (mkgen/plan/draft.py) and the calibration plan their programs here too,
so this module imports neither.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mkgen.errors import SpecError
from mkgen.plan.cost import CostConstants
from mkgen.plan.fused import DraftPasses, planned_model
from mkgen.plan.holds import HoldChoice, hold_digest, known_choice, remember, score_holds
from mkgen.plan.kind import KindRegistry
from mkgen.plan.kvtiles import choose_program
from mkgen.plan.layout import FULL_BANK_ROWS, MAX_PIECE_CHUNKS
from mkgen.plan.memory import MemoryPlan, check_fit, plan_fitted
from mkgen.plan.options import BuildOptions
from mkgen.plan.schedule import build_schedule
from mkgen.plan.sharding import ShardingPlan
from mkgen.plan.stream import StreamPlan, plan_stream
from mkgen.plan.timeline import ProgramPlan, estimate, price_program
from mkgen.plan.vmem import MAX_EXPERT_SLOTS, cache_kinds, comfort_depth, plan_vmem
from mkgen.spec.schema import ModelSpec
from mkgen.spec.topology import Topology

# plan_program's arguments that size the program, at plan_build's defaults.
DEFAULT_SHAPE: dict[str, Any] = {"bank_rows": FULL_BANK_ROWS, "ring_depth": None,
    "max_piece_chunks": MAX_PIECE_CHUNKS, "kv_tile_tokens": None, "inline_scales": True}  # fmt: skip


def plan_program(
    spec: ModelSpec,
    topo: Topology,
    options: BuildOptions,
    *,
    kinds: KindRegistry,
    bank_rows: int = FULL_BANK_ROWS,
    ring_depth: int | None = None,
    max_piece_chunks: int = MAX_PIECE_CHUNKS,
    held_refills: int | None = None,
    refills_per_round: int | None = None,
    kv_tile_tokens: int | None = None,
    inline_scales: bool = True,
    require_fit: bool = True,
    passes: DraftPasses | None = None,
) -> ProgramPlan:
    """Stages 1 to 5 and the schedule (stage 7) of `plan_build`, without the kernel layout:
    the program the cost model prices. Arguments as `plan_build`'s (`kinds`: the layer
    kinds' rules, mkgen.kinds.default_registry()); every cache kind's KV tile is
    `kv_tile_tokens` (or --kv-tile) when given, else the cost model's choice
    (mkgen.plan.kvtiles), and mxfp4 / nvfp4 expert scales are
    inline after their codes unless `inline_scales` is False (the calibration prices the
    measured kernel's 256-token tiles and its codes and scales in separate DMAs, which the
    template does not render). `require_fit` False prices a build that does not fit HBM
    (`mkgen estimate`'s hollow points). `passes`: a fused drafter's (``spec`` is then
    mkgen.plan.fused.fused_model's).

    The refills held for the collectives are forced (`--held-refills`, `held_refills`) or
    chosen: from the tuned table (mkgen/plan/holds.py) when it knows the build, else by
    scoring (`score_held_refills`), once per build in a process."""
    shape = {"bank_rows": bank_rows, "ring_depth": ring_depth, "max_piece_chunks": max_piece_chunks,
             "kv_tile_tokens": kv_tile_tokens, "inline_scales": inline_scales}  # fmt: skip
    base = _unheld_program(spec, topo, options, kinds, shape, require_fit, passes)
    if base.sharding.devices == 1:
        return base
    forced = options.held_refills
    if forced is not None or held_refills is not None:
        most = max(0, base.vmem.ring_depth - 2)
        held = forced if forced is not None else min(held_refills or 0, most)
        per_round = refills_per_round or base.stream.refills_per_round
        return with_held_refills(base, options, HoldChoice(held, per_round))
    digest = _digest(spec, topo, options, shape, base)
    choice = known_choice(digest)
    if choice is not None:
        return with_held_refills(base, options, choice)
    built: dict[HoldChoice, ProgramPlan] = {}
    choice, _ = _score(base, topo, options, built)
    remember(digest, choice)
    return built.get(choice) or with_held_refills(base, options, choice)


def score_held_refills(
    spec: ModelSpec, topo: Topology, options: BuildOptions, kinds: KindRegistry
) -> tuple[str, HoldChoice, dict[int, dict[int, float]]]:
    """What the scorer chooses for a build planned with plan_build's defaults, whatever the
    tuned table says: (the build's digest, the choice, {refills a round: {held: predicted
    step ms}}). The tuned table's entries are this function's answers (tests/test_holds.py)."""
    spec, passes = planned_model(spec, options.fuse_draft, options.rows)
    base = _unheld_program(spec, topo, options, kinds, DEFAULT_SHAPE, True, passes)
    choice, scores = _score(base, topo, options, {})
    return _digest(spec, topo, options, DEFAULT_SHAPE, base), choice, scores


def build_digest(
    spec: ModelSpec, topo: Topology, options: BuildOptions, kinds: KindRegistry
) -> str:
    """The tuned table's key of a build planned with plan_build's defaults (holds.py)."""
    spec, passes = planned_model(spec, options.fuse_draft, options.rows)
    base = _unheld_program(spec, topo, options, kinds, DEFAULT_SHAPE, True, passes)
    return _digest(spec, topo, options, DEFAULT_SHAPE, base)


def tile_digest(spec: ModelSpec, topo: Topology, options: BuildOptions, kinds: KindRegistry) -> str:
    """The KV tile table's key of a build planned with plan_build's defaults (kvtiles.py)."""
    spec, passes = planned_model(spec, options.fuse_draft, options.rows)
    spec = options.apply(spec)
    sharding, _ = plan_fitted(spec, topo, options, kinds=kinds, passes=passes)
    return hold_digest(spec, topo, options, _with_sharing(DEFAULT_SHAPE, sharding))


def _with_sharing(shape: dict[str, Any], sharding: ShardingPlan) -> dict[str, Any]:
    """`shape` with the expert sharing the planner chose where a kind shares (the walk reads
    it; the options' digest leaves "auto" out, holds.py), else `shape` itself."""
    chosen = {name: split.sharing for name, split in sharding.expert_sharing.items()}
    return {**shape, "expert_sharing": chosen} if chosen else shape


def _digest(
    spec: ModelSpec, topo: Topology, options: BuildOptions, shape: dict[str, Any], base: ProgramPlan
) -> str:
    chosen = {"ring_depth": base.vmem.ring_depth, "kv_tiles": base.vmem.dims.kv_tiles}
    return hold_digest(spec, topo, options, {**_with_sharing(shape, base.sharding), **chosen})


def _score(
    base: ProgramPlan, topo: Topology, options: BuildOptions, built: dict[HoldChoice, ProgramPlan]
) -> tuple[HoldChoice, dict[int, dict[int, float]]]:
    """Holding refills for the collectives moves ring traffic under their flights, but
    shortens the ring ahead of the core; a round starting only the banks its flight covers
    keeps the next round's copies from queueing behind them, but leaves the rest held for
    longer. The cost model walks a few holds for each (holds.score_holds); the programs it
    builds are kept in `built`. Holding refills moves only when ring banks start, not what
    a node is (with_held_refills), so every variant is walked with the base's pricing."""
    priced = price_program(base)

    def step_ms(choice: HoldChoice) -> float:
        built[choice] = with_held_refills(base, options, choice)
        return estimate(topo, options, built[choice], priced=priced).step_ms

    most = max(0, base.vmem.ring_depth - 2)
    return score_holds(step_ms, base.stream.refills_per_round, most)


def full_size_kernel_modes(
    spec: ModelSpec, topo: Topology, options: BuildOptions, *, kinds: KindRegistry
) -> dict[str, Any]:
    """The kernel modes the full-size build of `spec` at `options` chose that its mini
    twin, whose small buffers would choose otherwise, takes to prove that kernel (as
    BuildOptions fields): the attention-residual snapshots in HBM, the recurrent states
    streamed, the expert sharing (where the full size chose it). Nothing when the full size does not plan (the twin keeps its own choice)."""
    try:
        program = _unheld_program(spec, topo, options, kinds, DEFAULT_SHAPE, require_fit=False)
    except SpecError:
        return {}
    vmem = program.vmem
    modes = {"residual_snapshots": "hbm" if vmem.snapshots_in_hbm else None,
             "recurrent_states": "stream" if vmem.state_slots else None}  # fmt: skip
    chosen = {k: v for k, v in modes.items() if v is not None and getattr(options, k) is None}
    if options.expert_sharing == "auto":  # the twin's own choice could differ either way
        shared = [s.sharing for s in program.sharding.expert_sharing.values()]
        chosen["expert_sharing"] = shared[0] if shared else "none"
    return chosen


def _unheld_program(
    spec: ModelSpec, topo: Topology, options: BuildOptions, kinds: KindRegistry,
    shape: dict[str, Any], require_fit: bool, passes: DraftPasses | None = None,
) -> ProgramPlan:  # fmt: skip
    """Stages 1 to 5 and the schedule with no refill held (rounds would start the banks
    their flight covers), at the KV tiles `shape` forces or the cost model chooses
    (mkgen.plan.kvtiles); refuses a forced hold the ring cannot take."""
    spec = options.apply(spec)
    sharding, memory = plan_fitted(spec, topo, options, kinds=kinds, passes=passes)
    if require_fit:
        check_fit(spec, topo, options, memory, kinds=kinds)
    # The ring depth does not change the stream's layout: plan it, then size the ring.
    stream = plan_stream(spec, sharding, bank_rows=shape["bank_rows"], ring_depth=2, kinds=kinds)

    def program_at(kv_tiles: dict[str, int]) -> ProgramPlan:
        def planned(opts: BuildOptions) -> ProgramPlan:
            return _tiled_program(
                spec, topo, opts, kinds, shape, (sharding, memory, stream), kv_tiles
            )

        return _with_scored_slots(planned, options, shape, topo)

    names = cache_kinds(spec, sharding, kinds, options.rows)
    forced = shape["kv_tile_tokens"] or options.kv_tile
    if forced is not None:
        return program_at(dict.fromkeys(names, forced))
    return choose_program(
        program_at, names, options.context, lambda p: estimate(topo, options, p).step_ms,
        hold_digest(spec, topo, options, _with_sharing(shape, sharding)),
    )  # fmt: skip


def _with_scored_slots(
    planned: Callable[[BuildOptions], ProgramPlan], options: BuildOptions,
    shape: dict[str, Any], topo: Topology,
) -> ProgramPlan:  # fmt: skip
    """The program `planned(options)`, or, where VMEM leaves the ring under its comfort
    depth (mkgen.plan.vmem: the plan's rule gives the ring every byte up to it before a
    second expert slot), the program with more expert slots and the ring what is left, when
    the cost model predicts it faster: Kimi K3 at batch 8 x rows 8 takes 4 slots and a ring
    of 3 (before its all-reduces ran scattered, 1 slot predicted 42.786 ms a step, 2 and
    smaller KV tiles 33.250)."""
    program = planned(options)
    vmem = program.vmem
    forced = options.expert_slots or options.ring_depth or shape["ring_depth"]
    if forced or not vmem.expert_slots or vmem.ring_depth >= comfort_depth(vmem.dims.bank_bytes):
        return program
    best, best_ms = program, estimate(topo, options, program).step_ms
    for slots in range(vmem.expert_slots + 1, MAX_EXPERT_SLOTS + 1):
        try:
            trial = planned(options.model_copy(update={"expert_slots": slots}))
        except SpecError:  # no room left for the ring's two banks
            break
        ms = estimate(topo, options, trial).step_ms
        if ms < best_ms:
            best, best_ms = trial, ms
    return best


def _tiled_program(
    spec: ModelSpec, topo: Topology, options: BuildOptions, kinds: KindRegistry,
    shape: dict[str, Any], planned: tuple[ShardingPlan, MemoryPlan, StreamPlan],
    kv_tiles: dict[str, int],
) -> ProgramPlan:  # fmt: skip
    """_unheld_program's VMEM plan and schedule at the cache kinds' `kv_tiles`."""
    sharding, memory, stream = planned
    vmem = plan_vmem(
        spec,
        topo,
        options,
        sharding,
        stream,
        kinds=kinds,
        max_piece_chunks=shape["max_piece_chunks"],
        ring_depth=shape["ring_depth"],
        kv_tiles=kv_tiles,
        inline_scales=shape["inline_scales"],
    )
    if sharding.devices == 1 and options.held_refills:
        raise SpecError(
            f"--held-refills {options.held_refills}: one core has no collectives to hold ring "
            "refills for; leave it out"
        )
    most = max(0, vmem.ring_depth - 2)
    forced = options.held_refills
    if forced is not None and forced > most:
        raise SpecError(
            f"--held-refills {forced}: a ring of {vmem.ring_depth} banks holds at most {most} "
            "(a bank waited before its held refill starts would hang); lower it or raise "
            "--ring-depth"
        )
    flight = _round_refills(topo, options, stream.bank_bytes)
    stream = stream.model_copy(
        update={"ring_depth": vmem.ring_depth, "held_refills": 0, "refills_per_round": flight}
    )
    schedule = build_schedule(spec, sharding, stream, vmem, options, kinds=kinds)
    return ProgramPlan(spec, sharding, memory, stream, vmem, schedule, kinds)


def with_held_refills(
    program: ProgramPlan, options: BuildOptions, choice: HoldChoice
) -> ProgramPlan:
    """`program` with `choice.held` refills held for the collectives, `choice.per_round`
    started a round (its schedule built again; `program` itself when nothing changes). The
    schedule's nodes are the same (tests/test_holds.py): only the events that start ring
    banks move."""
    stream = program.stream
    if (stream.held_refills, stream.refills_per_round) == choice:
        return program
    held_stream = stream.model_copy(
        update={"held_refills": choice.held, "refills_per_round": choice.per_round}
    )
    schedule = build_schedule(
        program.spec, program.sharding, held_stream, program.vmem, options, kinds=program.kinds
    )
    unheld = program.unheld if stream.held_refills else program
    if choice.held == 0:
        unheld = None
    return program._replace(stream=held_stream, schedule=schedule, unheld=unheld)


def _round_refills(topo: Topology, options: BuildOptions, bank_bytes: int) -> int:
    """Held refills a collective round starts: the banks the DMA engine streams during the
    shortest round's flight (the catalog's phase latencies), at least one. More would
    still be streaming when the next round's copies queue behind them."""
    c = CostConstants.from_chip(topo.chip_info, options)
    return max(1, int(min(c.collective_phase_s, c.cross_host_phase_s) / c.dma_s(bank_bytes)))
