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
   kernel (mkgen/plan/published.py).

It is the one place a build is planned: code generation, verify, compile, convert, the
report and the checks all read the BuildPlan it returns.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, PrivateAttr

from mkgen.errors import SpecError
from mkgen.plan.cost import CostConstants, Estimate, TraceEvent, to_chrome_trace
from mkgen.plan.floor import IdealFloor, ideal_floor
from mkgen.plan.graph import GraphSummary, ScheduleCheckError, analyse
from mkgen.plan.kernel import build_layout
from mkgen.plan.layout import FULL_BANK_ROWS, MAX_PIECE_CHUNKS, KernelLayout
from mkgen.plan.memory import MemoryPlan, check_fit, plan_memory
from mkgen.plan.options import BuildOptions
from mkgen.plan.published import HandWritten, hand_written_for
from mkgen.plan.schedule import ScheduleSummary, build_schedule
from mkgen.plan.sharding import ShardingPlan, TensorShard, plan_sharding
from mkgen.plan.stream import StreamPlan, plan_stream
from mkgen.plan.timeline import ProgramPlan, estimate
from mkgen.plan.vmem import VmemPlan, plan_vmem
from mkgen.spec.schema import ModelSpec
from mkgen.spec.topology import Topology

if TYPE_CHECKING:
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
    _step: Any = PrivateAttr(default=None)

    @property
    def step_graph(self) -> StepGraph:
        """The full dataflow graph and schedule of the step (not saved with the plan)."""
        return self._step

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data (``mkgen plan --json``)."""
        from mkgen.plan.report import plan_dict

        return plan_dict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)


def plan_program(
    spec: ModelSpec,
    topo: Topology,
    options: BuildOptions,
    *,
    bank_rows: int = FULL_BANK_ROWS,
    ring_depth: int | None = None,
    max_piece_chunks: int = MAX_PIECE_CHUNKS,
    held_refills: int | None = None,
    refills_per_round: int | None = None,
    kv_tile_tokens: int | None = None,
    inline_scales: bool = True,
) -> ProgramPlan:
    """Stages 1 to 5 and the schedule (stage 7) of `plan_build`, without the kernel layout:
    the program the cost model prices. Arguments as `plan_build`'s; the KV tile is the
    template's unless `kv_tile_tokens` says another, and mxfp4 / nvfp4 expert scales are
    inline after their codes unless `inline_scales` is False (the calibration prices the
    measured kernel's 256-token tiles and its codes and scales in separate DMAs, which the
    template does not render)."""
    spec = options.apply(spec)
    sharding = plan_sharding(spec, topo, options)
    memory = plan_memory(spec, topo, options, sharding)
    check_fit(spec, topo, options, memory)
    # The ring depth does not change the stream's layout: plan it, then size the ring.
    stream = plan_stream(spec, sharding, bank_rows=bank_rows, ring_depth=2)
    vmem = plan_vmem(
        spec,
        topo,
        options,
        sharding,
        stream,
        max_piece_chunks=max_piece_chunks,
        ring_depth=ring_depth,
        kv_tile_tokens=kv_tile_tokens,
        inline_scales=inline_scales,
    )
    stream = stream.model_copy(update={"ring_depth": vmem.ring_depth})
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

    def program(held: int, per_round: int) -> ProgramPlan:
        held_stream = stream.model_copy(
            update={"held_refills": held, "refills_per_round": per_round}
        )
        schedule = build_schedule(spec, sharding, held_stream, vmem, options)
        return ProgramPlan(spec, sharding, memory, held_stream, vmem, schedule)

    if sharding.devices == 1:
        return program(0, flight)
    if forced is not None or held_refills is not None:
        held = forced if forced is not None else min(held_refills or 0, most)
        return program(held, refills_per_round or flight)
    # Holding refills for the collectives moves ring traffic under their flights, but
    # shortens the ring ahead of the core; a round starting only the banks its flight
    # covers keeps the next round's copies from queueing behind them, but leaves the rest
    # held for longer. The cost model scores a few holds for each (rounds starting what
    # their flight covers, or every held refill), then walks from the fastest of all to its
    # neighbours while they are faster (once per program in a process: every command and
    # test plans the same builds again).
    key = (spec.model_dump_json(), topo.name, options.model_dump_json(), bank_rows,
           vmem.ring_depth, max_piece_chunks, kv_tile_tokens, inline_scales)  # fmt: skip
    scored: dict[tuple[int, int], ProgramPlan] = {}
    if key not in _HOLD_SCORES:
        found: dict[int, dict[int, float]] = {r: {} for r in sorted({flight, max(most, 1)})}

        def score(held: int, per_round: int) -> float:
            scores = found[per_round]
            if held not in scores:
                scored[held, per_round] = program(held, per_round)
                scores[held] = estimate(topo, options, scored[held, per_round]).step_ms
                if held == 0:  # nothing held: the release rule does not matter
                    for other in found.values():
                        other[0] = scores[0]
            return scores[held]

        for per_round in found:
            for held in (0, most // 2, 3 * most // 4, most):
                score(held, per_round)
        per_round = min(found, key=lambda r: min(found[r].values()))
        for way in (-1, 1):
            held = min(found[per_round], key=found[per_round].__getitem__)
            while 0 <= held + way <= most and score(held + way, per_round) < score(held, per_round):
                held += way
        _HOLD_SCORES[key] = {r: dict(sorted(s.items())) for r, s in found.items()}
    by_round = _HOLD_SCORES[key]
    per_round = min(by_round, key=lambda r: min(by_round[r].values()))
    scores = by_round[per_round]
    fastest = min(scores, key=scores.__getitem__)
    best = scored.get((fastest, per_round)) or program(fastest, per_round)
    best.schedule.held_scores = dict(scores)
    best.schedule.round_scores = {r: min(s.values()) for r, s in by_round.items()}
    return best


def _round_refills(topo: Topology, options: BuildOptions, bank_bytes: int) -> int:
    """Held refills a collective round starts: the banks the DMA engine streams during the
    shortest round's flight (the catalog's phase latencies), at least one. More would
    still be streaming when the next round's copies queue behind them."""
    c = CostConstants.from_chip(topo.chip_info, options)
    return max(1, int(min(c.collective_phase_s, c.cross_host_phase_s) / c.dma_s(bank_bytes)))


# Predicted step (ms) of each held-refill count plan_program scored, per program and
# refills started a round.
_HOLD_SCORES: dict[tuple, dict[int, dict[int, float]]] = {}


def plan_build(
    spec: ModelSpec,
    topo: Topology,
    options: BuildOptions,
    *,
    bank_rows: int = FULL_BANK_ROWS,
    ring_depth: int | None = None,
    max_piece_chunks: int = MAX_PIECE_CHUNKS,
    held_refills: int | None = None,
    refills_per_round: int | None = None,
    trace_residuals: bool = False,
    trace: bool = False,
    enforce: bool = True,
) -> BuildPlan:
    """Plan one build. Raises a one-line SpecError when it does not fit in HBM or VMEM,
    and (``enforce``) a ScheduleCheckError when a schedule check fails; forced past a
    failed check (tests), the plan has no estimate.

    `bank_rows` and `max_piece_chunks` size the weight banks and expert pieces (the mini
    twin's are small); `ring_depth` forces the ring's depth unless --ring-depth does (a
    saved build records the depth it was rendered with), `held_refills` the refills held
    for collectives unless --held-refills does, `refills_per_round` how many of them a
    collective round starts (by default the banks its flight covers); `trace_residuals` makes the
    kernel also return the residual stream after every layer (verify's per-layer check)."""

    base = spec
    program = plan_program(
        spec,
        topo,
        options,
        bank_rows=bank_rows,
        ring_depth=ring_depth,
        max_piece_chunks=max_piece_chunks,
        held_refills=held_refills,
        refills_per_round=refills_per_round,
    )
    spec, sharding, _, stream, vmem, schedule = program
    kernel = build_layout(
        spec,
        topo,
        sharding,
        stream,
        options,
        max_piece_chunks=max_piece_chunks,
        expert_slots=vmem.expert_slots,
        trace_residuals=trace_residuals,
    )
    step = analyse(schedule, vmem)
    if enforce:
        step.enforce()
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
        # A program that fails a check may wait for ever: only a checked one is priced.
        estimate=estimate(topo, options, program, trace=trace) if step.ok else None,
        ideal_floor=ideal_floor(spec, topo, options),
        hand_written=hand_written_for(base, spec, topo, options),
    )
    plan._step = step
    return plan


__all__ = [
    "BuildOptions",
    "BuildPlan",
    "CostConstants",
    "Estimate",
    "GraphSummary",
    "KernelLayout",
    "MemoryPlan",
    "ProgramPlan",
    "ScheduleCheckError",
    "ScheduleSummary",
    "ShardingPlan",
    "StreamPlan",
    "TensorShard",
    "TraceEvent",
    "VmemPlan",
    "check_fit",
    "estimate",
    "plan_build",
    "plan_memory",
    "plan_program",
    "plan_sharding",
    "to_chrome_trace",
]
