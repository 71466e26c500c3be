"""The planner (pure Python, no JAX): everything about a build decided before any code.

``plan_build`` runs the stages in order (docs/planner.md):

1. options: the quantization overrides applied to the spec;
2. sharding: per-rank shapes of every tensor and cache, collectives per layer kind;
3. memory: HBM per device against the usable HBM (SpecError if it does not fit);
4. stream: the per-core weight stream of uniform banks;
5. VMEM: every buffer, padded as Mosaic pads it; ring depth and expert slots chosen
   under the budget (SpecError if it does not fit);
6. kernel layout: what the template prints (segments, tables, expert pieces), from the
   same sharding, stream and VMEM choices;
7. schedule and graph: the step's program with every DMA's issue point, slot,
   semaphore and wait point, its dataflow graph and the checks (a failed check raises
   before anything is generated);
8. estimate: the cost model walks the schedule's events on one core (mkgen/plan/cost.py):
   every DMA through prioritised queues, every op at its op counts (mkgen/plan/opcount.py)
   at the chip's issue rates, where the catalog states them; the step and its breakdown,
   held against the ideal floor (mkgen/plan/floor.py) and the published hand-written
   kernel (mkgen/plan/published.py), and shown beside its calibrated regime, its
   uncalibrated parts and its sensitivity (mkgen/plan/confidence.py, on first use);
   with `price_drafter`, the spec's drafter priced by the same model (mkgen/plan/draft.py).

The refills held for collectives (stage 7) are read from the tuned table
(mkgen/plan/holds.py) or scored by the cost model.

It is the one place a build is planned: code generation, verify, compile, convert, the
report and the checks all read the BuildPlan it returns.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, PrivateAttr

from mkgen.errors import SpecError
from mkgen.plan.cost import CostConstants, Estimate, TraceEvent, to_chrome_trace
from mkgen.plan.draft import DraftPrice, price_draft
from mkgen.plan.floor import IdealFloor, ideal_floor
from mkgen.plan.graph import GraphSummary, ScheduleCheckError, analyse
from mkgen.plan.holds import HoldChoice, hold_digest, known_choice, remember, score_holds
from mkgen.plan.kernel import build_layout
from mkgen.plan.kind import KindRegistry
from mkgen.plan.kvtiles import KvTileChoice, choose_program
from mkgen.plan.layout import FULL_BANK_ROWS, MAX_PIECE_CHUNKS, KernelLayout
from mkgen.plan.memory import MemoryPlan, check_fit, plan_memory
from mkgen.plan.options import BuildOptions
from mkgen.plan.published import HandWritten, hand_written_for
from mkgen.plan.schedule import ScheduleSummary, build_schedule
from mkgen.plan.sharding import ShardingPlan, TensorShard, plan_sharding
from mkgen.plan.stream import StreamPlan, plan_stream
from mkgen.plan.timeline import ProgramPlan, estimate, price_program
from mkgen.plan.vmem import MAX_EXPERT_SLOTS, VmemPlan, cache_kinds, comfort_depth, plan_vmem
from mkgen.spec.schema import ModelSpec
from mkgen.spec.topology import Topology

if TYPE_CHECKING:
    from mkgen.plan.confidence import Confidence
    from mkgen.plan.graph import StepGraph


class BuildPlan(BaseModel):
    """What the planner knows about one build: plain data that code generation reads."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    options: BuildOptions
    chips: int
    sharding: ShardingPlan
    memory: MemoryPlan
    stream: StreamPlan
    vmem: VmemPlan
    kernel: KernelLayout  # what the generated kernel is rendered from
    schedule: ScheduleSummary
    # The op list of every layer kind, the prologue and the epilogue (Schedule.program).
    program: dict[str, list[dict[str, Any]]]
    graph: GraphSummary
    estimate: Estimate | None  # None: a plan forced past failed checks (enforce=False)
    # The bar the estimate is held against: what any kernel must read, and the published
    # hand-written kernel doing the same work (None where none is published).
    ideal_floor: IdealFloor
    hand_written: HandWritten | None
    # The drafter's passes, when the plan prices one (plan_build's price_drafter); the
    # estimate's step is then verify + draft (Estimate.drafted_step_ms).
    draft: DraftPrice | None = None
    # How the planner chose the KV tiles (mkgen.plan.kvtiles; None: one candidate or forced).
    kv_tiles: KvTileChoice | None = None
    _step: Any = PrivateAttr(default=None)
    _program: Any = PrivateAttr(default=None)  # the ProgramPlan the estimate walked
    _topology: Any = PrivateAttr(default=None)
    _confidence: Any = PrivateAttr(default=None)

    @property
    def kinds(self) -> KindRegistry:
        """The layer kinds' rules the build was planned with."""
        return self._program.kinds

    @property
    def step_graph(self) -> StepGraph:
        """The full dataflow graph and schedule of the step (not saved with the plan)."""
        return self._step

    @property
    def confidence(self) -> Confidence | None:
        """The estimate beside its calibrated regime, its uncalibrated parts and its
        sensitivity (mkgen/plan/confidence.py: several walks, made on first use)."""
        if self.estimate is None:
            return None
        if self._confidence is None:
            from mkgen.plan.confidence import assess

            self._confidence = assess(self._topology, self.options, self._program, self.estimate)
        return self._confidence

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data (``mkgen plan --json``)."""
        from mkgen.plan.report import plan_dict

        return plan_dict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)


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
) -> ProgramPlan:
    """Stages 1 to 5 and the schedule (stage 7) of `plan_build`, without the kernel layout:
    the program the cost model prices. Arguments as `plan_build`'s (`kinds`: the layer
    kinds' rules, mkgen.kinds.default_registry()); every cache kind's KV tile is
    `kv_tile_tokens` (or --kv-tile) when given, else the cost model's choice
    (mkgen.plan.kvtiles), and mxfp4 / nvfp4 expert scales are
    inline after their codes unless `inline_scales` is False (the calibration prices the
    measured kernel's 256-token tiles and its codes and scales in separate DMAs, which the
    template does not render). `require_fit` False prices a build that does not fit HBM
    (`mkgen estimate`'s hollow points).

    The refills held for the collectives are forced (`--held-refills`, `held_refills`) or
    chosen: from the tuned table (mkgen/plan/holds.py) when it knows the build, else by
    scoring (`score_held_refills`), once per build in a process."""
    shape = {"bank_rows": bank_rows, "ring_depth": ring_depth, "max_piece_chunks": max_piece_chunks,
             "kv_tile_tokens": kv_tile_tokens, "inline_scales": inline_scales}  # fmt: skip
    base = _unheld_program(spec, topo, options, kinds, shape, require_fit)
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
    base = _unheld_program(spec, topo, options, kinds, DEFAULT_SHAPE, require_fit=True)
    choice, scores = _score(base, topo, options, {})
    return _digest(spec, topo, options, DEFAULT_SHAPE, base), choice, scores


def build_digest(
    spec: ModelSpec, topo: Topology, options: BuildOptions, kinds: KindRegistry
) -> str:
    """The tuned table's key of a build planned with plan_build's defaults (holds.py)."""
    base = _unheld_program(spec, topo, options, kinds, DEFAULT_SHAPE, require_fit=True)
    return _digest(spec, topo, options, DEFAULT_SHAPE, base)


def tile_digest(spec: ModelSpec, topo: Topology, options: BuildOptions) -> str:
    """The KV tile table's key of a build planned with plan_build's defaults (kvtiles.py)."""
    return hold_digest(options.apply(spec), topo, options, DEFAULT_SHAPE)


def _digest(
    spec: ModelSpec, topo: Topology, options: BuildOptions, shape: dict[str, Any], base: ProgramPlan
) -> str:
    chosen = {"ring_depth": base.vmem.ring_depth, "kv_tiles": base.vmem.dims.kv_tiles}
    return hold_digest(spec, topo, options, {**shape, **chosen})


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
    streamed. Nothing when the full size does not plan (the twin keeps its own choice)."""
    shape = {"bank_rows": FULL_BANK_ROWS, "ring_depth": None, "max_piece_chunks": MAX_PIECE_CHUNKS,
             "kv_tile_tokens": None, "inline_scales": True}  # fmt: skip
    try:
        vmem = _unheld_program(spec, topo, options, kinds, shape, require_fit=False).vmem
    except SpecError:
        return {}
    modes = {"residual_snapshots": "hbm" if vmem.snapshots_in_hbm else None,
             "recurrent_states": "stream" if vmem.state_slots else None}  # fmt: skip
    return {k: v for k, v in modes.items() if v is not None and getattr(options, k) is None}


def _unheld_program(
    spec: ModelSpec, topo: Topology, options: BuildOptions, kinds: KindRegistry,
    shape: dict[str, Any], require_fit: bool,
) -> ProgramPlan:  # fmt: skip
    """Stages 1 to 5 and the schedule with no refill held (rounds would start the banks
    their flight covers), at the KV tiles `shape` forces or the cost model chooses
    (mkgen.plan.kvtiles); refuses a forced hold the ring cannot take."""
    spec = options.apply(spec)
    sharding = plan_sharding(spec, topo, options, kinds=kinds)
    memory = plan_memory(spec, topo, options, sharding)
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
        hold_digest(spec, topo, options, shape),
    )  # fmt: skip


def _with_scored_slots(
    planned: Callable[[BuildOptions], ProgramPlan], options: BuildOptions,
    shape: dict[str, Any], topo: Topology,
) -> ProgramPlan:  # fmt: skip
    """The program `planned(options)`, or, where VMEM leaves the ring under its comfort
    depth (mkgen.plan.vmem: the plan's rule gives the ring every byte up to it before a
    second expert slot), the program with more expert slots and the ring what is left, when
    the cost model predicts it faster: at batch 8 x rows 8 Kimi K3's experts wait on one
    slot (predicted 42.786 ms a step with 1 slot, 33.250 with 2 and smaller KV tiles)."""
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


def _priced(
    topo: Topology, options: BuildOptions, program: ProgramPlan, checked: bool, trace: bool,
    drafting: ModelSpec | None,
) -> tuple[Estimate | None, DraftPrice | None]:  # fmt: skip
    """The program's estimate and, for a `drafting` spec, its drafter's price (the estimate
    then of verify + draft). A program that fails a check may wait for ever: only a checked
    one is priced."""
    if not checked:
        return None, None
    walked = estimate(topo, options, program, trace=trace)
    if drafting is None:
        return walked, None
    drafter = price_draft(drafting, topo, options, kinds=program.kinds)
    return walked.with_draft(drafter.ms), drafter


def plan_build(
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
    trace_residuals: bool = False,
    trace: bool = False,
    enforce: bool = True,
    price_drafter: bool = False,
) -> BuildPlan:
    """Plan one build. Raises a one-line SpecError when it does not fit in HBM or VMEM,
    and (``enforce``) a ScheduleCheckError when a schedule check fails; forced past a
    failed check (tests), the plan has no estimate. `kinds` holds the layer kinds' rules
    (mkgen.kinds.default_registry(): the plan imports no kind itself).

    `bank_rows` and `max_piece_chunks` size the weight banks and expert pieces (the mini
    twin's are small); `ring_depth` forces the ring's depth unless --ring-depth does (a
    saved build records the depth it was rendered with), `held_refills` the refills held
    for collectives unless --held-refills does, `refills_per_round` how many of them a
    collective round starts (by default the banks its flight covers); `trace_residuals` makes the
    kernel also return the residual stream after every layer (verify's per-layer check);
    `price_drafter` prices the spec's drafter (its draft section, mkgen/plan/draft.py) beside
    the verify step. No kernel reads a drafter, so the program is planned without it."""

    drafting = spec if price_drafter else None
    spec = spec.model_copy(update={"draft": None})
    base = spec
    program = plan_program(
        spec,
        topo,
        options,
        kinds=kinds,
        bank_rows=bank_rows,
        ring_depth=ring_depth,
        max_piece_chunks=max_piece_chunks,
        held_refills=held_refills,
        refills_per_round=refills_per_round,
    )
    spec, sharding, stream = program.spec, program.sharding, program.stream
    vmem, schedule = program.vmem, program.schedule
    kernel = build_layout(spec, topo, sharding, stream, options, kinds=kinds,
                          max_piece_chunks=max_piece_chunks, expert_slots=vmem.expert_slots,
                          kv_tiles=vmem.dims.kv_tiles, trace_residuals=trace_residuals,
                          snapshots_in_hbm=vmem.snapshots_in_hbm,
                          state_slots=vmem.state_slots)  # fmt: skip
    step = analyse(schedule, vmem)
    if enforce:
        step.enforce()
    walked, drafter = _priced(topo, options, program, step.ok, trace, drafting)
    plan = BuildPlan(
        options=options,
        chips=topo.num_chips,
        sharding=sharding,
        memory=program.memory,
        stream=stream,
        vmem=vmem,
        kernel=kernel,
        schedule=schedule.summary(),
        program=schedule.program(),
        graph=step.summary(),
        estimate=walked,
        ideal_floor=ideal_floor(spec, topo, options),
        hand_written=hand_written_for(base, spec, topo, options),
        draft=drafter,
        kv_tiles=program.kv_tiles,
    )
    plan._step, plan._program, plan._topology = step, program, topo
    return plan


__all__ = [
    "BuildOptions",
    "BuildPlan",
    "CostConstants",
    "DraftPrice",
    "Estimate",
    "GraphSummary",
    "KernelLayout",
    "KindRegistry",
    "MemoryPlan",
    "ProgramPlan",
    "ScheduleCheckError",
    "ScheduleSummary",
    "ShardingPlan",
    "StreamPlan",
    "TensorShard",
    "TraceEvent",
    "VmemPlan",
    "build_digest",
    "check_fit",
    "estimate",
    "plan_build",
    "plan_memory",
    "plan_program",
    "plan_sharding",
    "score_held_refills",
    "tile_digest",
    "to_chrome_trace",
    "with_held_refills",
]
