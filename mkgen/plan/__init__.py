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
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, PrivateAttr

from mkgen.plan.cost import CostConstants, Estimate, TraceEvent, to_chrome_trace
from mkgen.plan.draft import DraftPrice, price_draft
from mkgen.plan.floor import IdealFloor, ideal_floor
from mkgen.plan.fused import planned_model
from mkgen.plan.graph import GraphSummary, ScheduleCheckError, analyse
from mkgen.plan.kernel import build_layout
from mkgen.plan.kind import KindRegistry
from mkgen.plan.kvtiles import KvTileChoice
from mkgen.plan.layout import FULL_BANK_ROWS, MAX_PIECE_CHUNKS, KernelLayout
from mkgen.plan.memory import MemoryPlan, check_fit, plan_memory
from mkgen.plan.options import BuildOptions
from mkgen.plan.program import (
    build_digest,
    full_size_kernel_modes,
    plan_program,
    score_held_refills,
    tile_digest,
    with_held_refills,
)
from mkgen.plan.published import HandWritten, hand_written_for
from mkgen.plan.schedule import ScheduleSummary
from mkgen.plan.sharding import ShardingPlan, TensorShard, plan_sharding
from mkgen.plan.store import entry_key, stored
from mkgen.plan.stream import StreamPlan
from mkgen.plan.timeline import PricedProgram, ProgramPlan, estimate, price_program
from mkgen.plan.vmem import VmemPlan
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
    _priced: Any = PrivateAttr(default=None)  # its PricedProgram
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
            from mkgen.plan.confidence import Confidence, assess

            def walked() -> Confidence:
                return assess(
                    self._topology, self.options, self._program, self.estimate, self._priced
                )

            # A registry with kinds from outside mkgen (their code is not in the store's
            # key) walks every time.
            if all(k.__name__.startswith("mkgen.") for k in self.kinds.kinds.values()):
                inputs = (self.model_dump_json(), self._program.spec.model_dump_json(),
                          self._topology.model_dump_json())  # fmt: skip
                self._confidence = stored(entry_key("confidence", inputs), Confidence, walked)
            else:
                self._confidence = walked()
        return self._confidence

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data (``mkgen plan --json``)."""
        from mkgen.plan.report import plan_dict

        return plan_dict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)


def _priced(
    topo: Topology, options: BuildOptions, program: ProgramPlan, priced: PricedProgram | None,
    trace: bool, drafting: ModelSpec | None,
) -> tuple[Estimate | None, DraftPrice | None]:  # fmt: skip
    """The program's estimate (`priced`: its nodes' op counts) and, for a `drafting` spec,
    its drafter's price (the estimate then of verify + draft). A program that fails a check
    may wait for ever: only a checked one is priced (`priced` None: not checked)."""
    if priced is None:
        return None, None
    walked = estimate(topo, options, program, trace=trace, priced=priced)
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
    the verify step. The verify program keeps the draft section for the hidden states the
    drafter reads, which the kernel writes (layout.draft_hidden_states); the drafter's own
    passes are priced, not generated. With `options.fuse_draft` the spec's mtp drafter
    runs inside the kernel instead (mkgen/plan/fused.py): its passes are layers of the
    program, generated, checked and priced with the verify rows."""

    drafting = spec if price_drafter and not options.fuse_draft else None
    base = spec.model_copy(update={"draft": None})  # the published kernels draft apart
    spec, passes = planned_model(spec, options.fuse_draft, options.rows)
    shape = {"kinds": kinds, "bank_rows": bank_rows, "ring_depth": ring_depth,
             "max_piece_chunks": max_piece_chunks, "held_refills": held_refills,
             "refills_per_round": refills_per_round}  # fmt: skip
    program = plan_program(spec, topo, options, **shape, passes=passes)
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
    priced = price_program(program) if step.ok else None  # a failed check is not priced
    walked, drafter = _priced(topo, options, program, priced, trace, drafting)
    if walked is not None and passes is not None:  # what the draft adds: the verify-only step
        unfused = options.model_copy(update={"fuse_draft": False})
        alone = estimate(topo, unfused, plan_program(base, topo, unfused, **shape))
        walked = walked.model_copy(update={"fused_verify_ms": alone.step_ms})
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
    plan._step, plan._program, plan._priced, plan._topology = step, program, priced, topo
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
    "full_size_kernel_modes",
    "plan_build",
    "plan_memory",
    "plan_program",
    "plan_sharding",
    "score_held_refills",
    "tile_digest",
    "to_chrome_trace",
    "with_held_refills",
]
