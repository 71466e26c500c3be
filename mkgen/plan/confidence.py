"""How far to trust a predicted step: the calibrated regime it is shown beside, the parts
of it no measurement covers, and the step at both ends of each unmeasured input.

mkgen's only speed evidence is its cost model (docs/cost-model.md), calibrated on twelve
published rows of one hand-written kernel (mkgen/plan/calibration.py). What those rows
cover (`calibration_coverage`): one TPU7x host of 8 cores (in-host collectives only), no
ring refill held for collectives, experts in int4:128 or nvfp4, the dense stream and the
lm_head in bf16 or int8, GQA attention, one row per sequence at 1 to 8 token rows a step,
context 4096. For every predicted step (`mkgen plan`, plan.json, REPORT.md):

- `calibrated_step_ms`: the same build with no refill held and no expert sharing. Holding
  refills and sharing experts around the ring of groups are the mechanisms outside the
  rows that a build can switch off (the rows run one expert group, so no ring); the rest is
  part of the build;
- the uncalibrated parts: what each mechanism outside the rows contributes to the step.
  Held refills: the step minus the step with no refill held. Expert sharing: that step
  minus the calibrated step (a gain: negative). Cross-host rounds: the core's waits on
  their flights that no DMA covers. A format, attention type, row count or context no row
  runs: the share of the step the walk credits to the phase it prices (the breakdown's
  experts, weights, kv_state), or the core's runs for more token rows than measured. These
  shares are attributions, not savings, and may overlap;
- the sensitivity: the build's program walked again with one unmeasured input at the low
  and at the high end of its range (the catalog's disagreeing sources, or a stated range):
  the cross-host round latency and link bandwidth (slices of several hosts), the core
  clock (chips with issue rates) and the DMA issue cost. The kernel is fixed (its held
  refills stay as rendered).
"""

from __future__ import annotations

from functools import cache

from pydantic import BaseModel, ConfigDict

from mkgen.plan.cost import CostConstants, Estimate
from mkgen.plan.holds import HoldChoice
from mkgen.plan.options import BuildOptions
from mkgen.plan.timeline import (
    PricedProgram,
    ProgramPlan,
    estimate,
    price_program,
    walk_inputs,
)
from mkgen.spec.topology import Topology

# The per-DMA issue cost is derived, not measured (CostConstants.from_chip): its range is
# stated, half to twice the derived figure.
DMA_ISSUE_RANGE = (0.5, 2.0)
DMA_ISSUE_SOURCE = (
    "derived from the measured streaming range (2 MiB x (1/3.0 - 1/3.2 TB/s)); no "
    "per-descriptor measurement: half to twice the derived figure (a stated range)"
)
# Families whose weights are not a ring stream segment.
_NOT_STREAMED = {"experts", "embedding", "vectors"}


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Coverage(_Frozen):
    """The settings the calibration rows run at (mkgen/plan/calibration.py)."""

    chip: str
    hosts: int
    held_refills: int
    expert_sharing: str
    expert_formats: tuple[str, ...]
    stream_formats: tuple[str, ...]
    attention_types: tuple[str, ...]
    rows: int  # rows per sequence
    token_rows: int  # the most batch x rows a row measured
    context: int

    def describe(self) -> str:
        return (
            f"{self.chip}, {self.hosts} host (in-host collectives only), {self.held_refills} "
            f"refills held, expert sharing {self.expert_sharing}, experts {' or '.join(self.expert_formats)}, dense stream and "
            f"lm_head {' or '.join(self.stream_formats)}, {'/'.join(self.attention_types)} "
            f"attention, {self.rows} row per sequence at 1 to {self.token_rows} token rows, "
            f"context {self.context}"
        )


@cache
def calibration_coverage() -> Coverage:
    """What the twelve calibration rows cover, read from calibration.py's inputs."""
    from mkgen.plan import calibration as cal
    from mkgen.spec.loader import load_spec
    from mkgen.spec.topology import parse_topology

    spec, topo = load_spec(cal.MODEL), parse_topology(cal.TOPOLOGY)
    options = {(config, batch): cal.options_for(config, batch) for config, batch in cal.MEASURED_MS}
    quants = [dict(o.apply(spec).quantization) for o in options.values()]
    return Coverage(
        chip=topo.chip_info.name,
        hosts=topo.num_hosts,
        held_refills=cal.MEASURED_HELD_REFILLS,
        expert_sharing="none",  # one expert group (Muse Spark on 2x2x1): nothing pairs
        expert_formats=tuple(sorted({q["experts"] for q in quants})),
        stream_formats=tuple(
            sorted({f for q in quants for fam, f in q.items() if fam not in _NOT_STREAMED})
        ),
        attention_types=tuple(sorted({k.type for k in spec.attention_kinds.values()})),
        rows=max(o.rows for o in options.values()),
        token_rows=max(o.batch * o.rows for o in options.values()),
        context=cal.CONTEXT,
    )


class UncalibratedPart(_Frozen):
    """What one mechanism outside the calibration rows contributes to a step."""

    what: str
    ms: float
    how: str


class SensitivityRow(_Frozen):
    """The step at the low and at the high end of one unmeasured input."""

    input: str  # its name and unit, e.g. "core clock (GHz)"
    low: float
    high: float
    step_ms_low: float
    step_ms_high: float
    source: str  # where the two ends come from

    def record(self) -> dict[str, float | str]:
        """plan.json's entry: the input, its two ends and the step at each."""
        return self.model_dump(exclude={"source"})


class Confidence(_Frozen):
    """A predicted step beside its calibrated regime, its uncalibrated parts and its
    sensitivity to the unmeasured inputs."""

    step_ms: float  # the verify step
    calibrated_step_ms: float  # the verify step in the calibrated regime
    draft_ms: float | None  # the drafter's passes, priced beside the verify step (--draft)
    point: str  # "batch 1 x rows 8"
    coverage: Coverage
    calibration: str  # the calibration's bias and worst row (calibration.RECORDED)
    uncalibrated: tuple[UncalibratedPart, ...]
    sensitivity: tuple[SensitivityRow, ...]

    @property
    def stated_calibrated_ms(self) -> float:
        """The calibrated step as the build states its step: verify + draft with a drafter
        priced beside the verify step (the same draft added: no measurement covers one)."""
        return self.calibrated_step_ms + (self.draft_ms or 0.0)

    def stated_sensitivity(self) -> tuple[SensitivityRow, ...]:
        """The sensitivity table with its steps as the build states its step (the draft
        added to each, as to the calibrated step)."""
        draft = self.draft_ms or 0.0
        return tuple(
            r.model_copy(
                update={
                    "step_ms_low": r.step_ms_low + draft,
                    "step_ms_high": r.step_ms_high + draft,
                }
            )
            for r in self.sensitivity
        )

    def record(self) -> dict[str, object]:
        """plan.json's keys under "estimate" (beside the full step): the calibrated step and
        the sensitivity table's steps as "step_ms" is (stated_calibrated_ms,
        stated_sensitivity)."""
        return {
            "calibrated_step_ms": self.stated_calibrated_ms,
            "calibrated_verify_ms": self.calibrated_step_ms,
            "calibrated_regime": self.coverage.describe(),
            "calibration": self.calibration,
            "uncalibrated": [p.model_dump() for p in self.uncalibrated],
            "sensitivity": [r.record() for r in self.stated_sensitivity()],
            "sensitivity_sources": {r.input: r.source for r in self.sensitivity},
        }

    def sensitivity_of(self) -> str:
        """What the sensitivity table's steps are of, where that is not the step itself."""
        return "; the verify step alone" if self.draft_ms is not None else ""

    def beside_step(self) -> str:
        """What every output states beside a build's step: its calibrated regime and the
        range of the sensitivity table, e.g. "7.142 ms in the calibrated regime; 5.224 to
        8.128 ms with one unmeasured input at either end of its range"; both as the step is
        (verify + draft with a drafter priced beside the verify step)."""
        said = f"{self.stated_calibrated_ms:.3f} ms in the calibrated regime"
        rows = self.stated_sensitivity()
        if not rows:
            return said
        steps = [s for r in rows for s in (r.step_ms_low, r.step_ms_high)]
        return (
            f"{said}; {min(steps):.3f} to {max(steps):.3f} ms with one unmeasured input at "
            "either end of its range"
        )

    def lines(self) -> list[str]:
        """Human text (`mkgen plan`); REPORT.md shows the same as tables."""
        out = [
            f"Calibrated regime: predicted {self.calibrated_step_ms:.3f} ms/step at "
            f"{self.point} with no refill held and no expert sharing, beside the full {self.step_ms:.3f} ms. The "
            f"calibration rows run {self.coverage.describe()}; {self.calibration}. "
            + ("Outside them:" if self.uncalibrated else "The build runs inside them.")
        ]
        out += [f"  {p.what}: {p.ms:+.3f} ms ({p.how})" for p in self.uncalibrated]
        if self.sensitivity:
            out.append(
                "Sensitivity (the same kernel walked at each end of an unmeasured input"
                f"{self.sensitivity_of()}):"
            )
            out += [
                f"  {r.input}: {r.low:.3g} -> {r.step_ms_low:.3f} ms, {r.high:.3g} -> "
                f"{r.step_ms_high:.3f} ms ({r.source})"
                for r in self.sensitivity
            ]
        return out


def _unheld(
    topo: Topology, options: BuildOptions, program: ProgramPlan, est: Estimate,
    priced: PricedProgram | None = None,
) -> tuple[ProgramPlan, Estimate]:  # fmt: skip
    """`program` with no refill held and its walk (`est` itself when none is). Holding
    refills moves only when ring banks start, not what a node is (with_held_refills), so
    the unheld program walks with `program`'s pricing, `priced`, when given."""
    from mkgen.plan.program import with_held_refills

    if not program.stream.held_refills:
        return program, est
    unheld = program.unheld or with_held_refills(
        program, options, HoldChoice(0, program.stream.refills_per_round)
    )
    return unheld, estimate(topo, options, unheld, priced=priced)


def _unshared(
    topo: Topology, options: BuildOptions, program: ProgramPlan, est: Estimate
) -> Estimate:
    """The walk of `program` (walked as `est`) with no expert sharing: its schedule built
    again from the sharding without it (the experts each core reads per layer)."""
    from mkgen.plan.schedule import build_schedule

    sharding = program.sharding.without_expert_sharing()
    if sharding is program.sharding:
        return est
    schedule = build_schedule(
        program.spec, sharding, program.stream, program.vmem, options, kinds=program.kinds
    )
    return estimate(topo, options, program._replace(sharding=sharding, schedule=schedule))


def calibrated_estimate(
    topo: Topology, options: BuildOptions, program: ProgramPlan, est: Estimate
) -> Estimate:
    """`est` (the walk of `program`) in the calibrated regime: the same build with no
    refill held and no expert sharing (`est` itself when it has neither)."""
    unheld, walked = _unheld(topo, options, program, est)
    return _unshared(topo, options, unheld, walked)


def assess(
    topo: Topology, options: BuildOptions, program: ProgramPlan, est: Estimate,
    priced: PricedProgram | None = None,
) -> Confidence:  # fmt: skip
    """The confidence of `est`, the walk of `program` (module docstring; `priced`:
    `price_program(program)` when already done)."""
    from mkgen.plan.calibration import RECORDED

    priced = priced or price_program(program)
    unheld, unheld_est = _unheld(topo, options, program, est, priced)
    calibrated = _unshared(topo, options, unheld, unheld_est)
    point = est.point
    if est.draft_ms is not None:
        point += f", the verify step alone (the draft adds {est.draft_ms:.3f} ms)"
    return Confidence(
        step_ms=est.step_ms,
        calibrated_step_ms=calibrated.step_ms,
        draft_ms=est.draft_ms,
        point=point,
        coverage=calibration_coverage(),
        calibration=RECORDED.describe(),
        uncalibrated=tuple(
            uncalibrated_parts(topo, options, program, est, (unheld_est, calibrated))
        ),
        sensitivity=tuple(sensitivity(topo, options, program, est, priced)),
    )


def uncalibrated_parts(
    topo: Topology,
    options: BuildOptions,
    program: ProgramPlan,
    est: Estimate,
    regimes: tuple[Estimate, Estimate],
) -> list[UncalibratedPart]:
    """What each mechanism no calibration row runs contributes to `est` (module docstring);
    `regimes`: its walk with no refill held, and that with no expert sharing either."""
    cov = calibration_coverage()
    unheld, calibrated = regimes
    step, parts = est.step_ms, []
    if topo.chip_info.name != cov.chip:
        return [UncalibratedPart(what=f"chip {topo.chip_info.name}", ms=step,
                                 how="no calibration row runs on it: the whole step")]  # fmt: skip
    held = program.stream.held_refills
    if held:
        parts.append(UncalibratedPart(
            what=f"{held} refills held for collectives", ms=step - unheld.step_ms,
            how="the step minus the one with no refill held: that the DMA engine takes a round's "
            "copies before the refills started after them is assumed, not measured",
        ))  # fmt: skip
    for name, split in program.sharding.expert_sharing.items():
        parts.append(UncalibratedPart(
            what=f"expert sharing {split.sharing} ({name}: {split.partner_experts} of each "
            f"group's {split.experts_per_rank} experts held by the group before it in the "
            "ring too)",
            ms=unheld.step_ms - calibrated.step_ms,
            how="the step with no refill held minus the calibrated one: that the ring's "
            "worst-loaded core reads the slices the kernel's split gives it, averaged over "
            "uniformly random routings, is the cost model's expectation, not measured",
        ))  # fmt: skip
    if topo.num_hosts > cov.hosts:
        parts.append(UncalibratedPart(
            what=f"cross-host rounds ({topo.num_hosts} hosts)", ms=est.cross_host_wait_ms,
            how="the core's waits on their flights that no DMA covers, at the catalog's "
            "unmeasured cross-host latency and links",
        ))  # fmt: skip
    breakdown = est.breakdown_ms
    quant, families = program.spec.quantization, program.memory.weights_by_family
    expert = quant.experts if families.get("experts") else None
    if expert is not None and expert not in cov.expert_formats:
        parts.append(UncalibratedPart(
            what=f"experts in {expert}", ms=breakdown["experts"],
            how="the breakdown's experts: no calibration row runs the format",
        ))  # fmt: skip
    stream = sorted({getattr(quant, f) for f in families if f not in _NOT_STREAMED})
    unmeasured = [f for f in stream if f not in cov.stream_formats]
    if unmeasured:
        parts.append(UncalibratedPart(
            what=f"dense stream in {', '.join(unmeasured)}",
            ms=breakdown["weights"] + breakdown["lm_head"],
            how="the breakdown's weights and lm_head, which stream them: no calibration row "
            "runs the format",
        ))  # fmt: skip
    parts += _attention_part(program, options, est, cov)
    tokens = est.batch * est.rows
    if tokens > cov.token_rows:
        parts.append(UncalibratedPart(
            what=f"{tokens} token rows a step", ms=est.compute_timeline_ms or 0.0,
            how=f"the core's runs (compute timeline), which grow with rows: the calibration "
            f"measured up to {cov.token_rows}",
        ))  # fmt: skip
    return parts


def _attention_part(
    program: ProgramPlan, options: BuildOptions, est: Estimate, cov: Coverage
) -> list[UncalibratedPart]:
    """The kv_state share when the attention types, rows per sequence or context are
    outside the calibration rows'."""
    types = sorted({k.type for k in program.spec.attention_kinds.values()})
    outside = [t for t in types if t not in cov.attention_types]
    context = options.context
    why = []
    if outside:
        why.append(f"{'/'.join(outside)} attention")
    if est.rows > cov.rows:
        why.append(f"{est.rows} rows per sequence")
    if context != cov.context:
        why.append(f"context {context}")
    if not why:
        return []
    return [UncalibratedPart(
        what=", ".join(why), ms=est.breakdown_ms["kv_state"],
        how=f"the breakdown's kv_state (attention, caches, recurrent state): the calibration "
        f"rows run {'/'.join(cov.attention_types)} at {cov.rows} row per sequence, context "
        f"{cov.context}",
    )]  # fmt: skip


def sensitivity(
    topo: Topology, options: BuildOptions, program: ProgramPlan, est: Estimate,
    priced: PricedProgram,
) -> list[SensitivityRow]:  # fmt: skip
    """The program (priced as `priced`; every row walks it) walked at both ends of each
    unmeasured input (module docstring). An input the build does not use is left out: the
    cross-host figures on one host, the clock where the catalog has no issue rates."""
    chip, c = topo.chip_info, est.constants
    catalog = walk_inputs(topo, c, program.schedule, priced)

    def walked(constants: CostConstants) -> float:
        """The step at `constants`: `est`'s own where the walk reads the same of them as of
        the build's (an input's end is often the catalog's figure, or moves nothing the
        walk reads), else the program walked again."""
        if constants == c or walk_inputs(topo, constants, program.schedule, priced) == catalog:
            return est.step_ms
        return estimate(topo, options, program, constants=constants, priced=priced).step_ms

    def row(name: str, field: str, ends: tuple[float, float], unit: float,
            source: str) -> SensitivityRow:  # fmt: skip
        low, high = (walked(c.with_inputs(**{field: end})) for end in ends)
        return SensitivityRow(input=name, low=ends[0] / unit, high=ends[1] / unit,
                              step_ms_low=low, step_ms_high=high, source=source)  # fmt: skip

    rows = []
    if topo.num_hosts > 1:
        across = chip.cross_host_phase_latency
        rows.append(row("cross-host round latency (us)", "cross_host_phase_s",
                        (across.low, across.high), 1e-6, across.source))  # fmt: skip
        host = chip.ici_level("host")
        if host.bandwidth_range is not None:
            rows.append(row("cross-host link bandwidth (GB/s per core)", "host_bandwidth",
                            host.bandwidth_range, 1e9, host.source))  # fmt: skip
    if c.issue_rates is not None:
        rates = c.issue_rates
        rows.append(row("core clock (GHz)", "clock_hz", rates.clock_range_hz, 1e9,
                        rates.clock_source))  # fmt: skip
        if any(f.experts is not None for f in program.sharding.ffn.values()):  # routed experts
            rows.append(row("scalar ops a cycle (the expert listing)", "scalar_ops_per_cycle",
                            rates.scalar_range, 1, rates.scalar_source))  # fmt: skip
    low, high = DMA_ISSUE_RANGE
    rows.append(row("DMA issue cost (ns per DMA)", "dma_overhead_s",
                    (c.dma_overhead_s * low, c.dma_overhead_s * high), 1e-9, DMA_ISSUE_SOURCE))  # fmt: skip
    return rows
