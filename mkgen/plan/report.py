"""Plans for people and for programs: human text, JSON, the estimate sweep as CSV and chart.

Only formatting lives here (and the sweep that feeds the TCO table); every number comes
from mkgen.plan. Output is deterministic: the same plan gives the same bytes.
"""

from __future__ import annotations

import csv
import io
import math
import textwrap
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from mkgen.errors import MkgenError
from mkgen.hardware import Chip, MeasuredRange, MiB
from mkgen.plan.published import bar_text

if TYPE_CHECKING:
    from mkgen.plan import BuildPlan
    from mkgen.plan.kind import KindRegistry
    from mkgen.plan.options import BuildOptions
    from mkgen.plan.tco import ReferenceCurve, Scenario
    from mkgen.spec.schema import ModelSpec
    from mkgen.spec.topology import Topology

GB = 1e9


# =========================================================================== JSON


def plan_dict(plan: BuildPlan) -> dict[str, Any]:
    """The plan as JSON-ready data: the keys of issue 3's ``--json`` block and more."""
    o, sh, mem, vm = plan.options, plan.sharding, plan.memory, plan.vmem
    return {
        "model": sh.model,
        "topology": sh.topology,
        "devices": sh.devices,
        "chips": plan.chips,
        "batch": o.batch,
        "rows": o.rows,
        "acceptance": o.acceptance,
        "context": o.context,
        "quantization": dict(sh.quantization),
        "fits": mem.fits and vm.within_budget,
        "memory": _memory_dict(plan),
        "vmem": _vmem_dict(plan),
        "sharding": _sharding_dict(plan),
        "collectives": plan.vmem.dims.collectives.model_dump(),
        "stream": {
            "bank_rows": plan.stream.bank_rows,
            "bank_bytes": plan.stream.bank_bytes,
            "banks": plan.stream.total_banks,
            "bytes_per_step": plan.stream.bytes_per_step,
            "weight_bytes": plan.stream.weight_bytes,
            "padding_bytes": plan.stream.padding_bytes,
            "padding_percent": round(plan.stream.padding_percent, 3),
        },
        "schedule": plan.schedule.model_dump(),
        "program": plan.program,
        "graph": {
            "nodes": plan.graph.nodes,
            "edges": plan.graph.edges,
            "data_edges": plan.graph.data_edges,
            "reuse_edges": plan.graph.reuse_edges,
            "checks": dict(plan.graph.checks),
            "failures": dict(plan.graph.failures),
        },
        "estimate": _estimate_dict(plan),
        "kv_tiles": _kv_tiles_dict(plan),
    }


def _kv_tiles_dict(plan: BuildPlan) -> dict[str, Any]:
    """Each cache attention kind's KV tile and, where the planner chose it, the predicted
    step (ms, no refill held) at each candidate and the candidates it refused
    (mkgen/plan/kvtiles.py)."""
    choice = plan.kv_tiles
    return {
        "tiles": dict(plan.vmem.dims.kv_tiles),
        "chosen_by": "cost model" if choice else "context rule or --kv-tile",
        "step_ms_by_tile": {k: {str(t): ms for t, ms in s.items()} for k, s in choice.scores.items()}
        if choice else {},
        "refused": {k: {str(t): why for t, why in r.items()} for k, r in choice.refused.items()}
        if choice else {},
    }  # fmt: skip


def _memory_dict(plan: BuildPlan) -> dict[str, Any]:
    """HBM per device and VMEM per core, in bytes."""
    mem, vm = plan.memory, plan.vmem
    return {
        "hbm_bytes_per_device": mem.total_bytes,
        "hbm_usable_bytes_per_device": mem.usable_bytes,
        "hbm_weights_bytes": mem.weights_bytes,
        "hbm_cache_bytes": mem.cache_bytes,
        "hbm_workspace_bytes": mem.workspace_bytes,
        "hbm_weights_by_family": dict(mem.weights_by_family),
        "vmem_bytes": vm.explicit_bytes,
        "vmem_total_bytes": vm.total_bytes,
        "vmem_mosaic_scratch_bytes": vm.internal_bytes,
        "vmem_budget_bytes": vm.budget_bytes,
        "vmem_limit_bytes": vm.limit_bytes,
        "vmem_by_category": vm.by_category,
    }


def _vmem_dict(plan: BuildPlan) -> dict[str, Any]:
    """The VMEM plan: ring, expert slots, every buffer, semaphore and SMEM array."""
    vm = plan.vmem
    return {
        "ring_depth": vm.ring_depth,
        "bank_bytes": vm.dims.bank_bytes,
        "expert_slots": vm.expert_slots,
        "expert_slot_bytes": vm.expert_slot_bytes,
        "buffers": [
            {
                "name": b.name,
                "category": b.category,
                "role": b.role,
                "shape": list(b.shape),
                "dtype": b.dtype,
                "bytes": b.bytes,
            }
            for b in vm.buffers
        ],
        "semaphores": {s.name: list(s.shape) for s in vm.semaphores},
        "smem": {s.name: list(s.shape) for s in vm.smem},
    }


def _estimate_dict(plan: BuildPlan) -> dict[str, Any]:
    """The cost model's predicted step, its confidence, floors and breakdowns."""
    est, confidence = plan.estimate, plan.confidence
    return {
        "point": est.point,
        # The step: verify + draft with a drafter priced (mkgen/plan/draft.py) or fused
        # into the kernel (mkgen/plan/fused.py: its draft is what it adds to the verify-only
        # kernel), else the verify step; draft_ms and draft are null without one.
        "step_ms": est.drafted_step_ms,
        "verify_ms": est.verify_ms,
        "draft_ms": est.step_draft_ms,
        "draft": plan.draft.record() if plan.draft else None,
        **(confidence.record() if confidence else {}),
        "dma_timeline_ms": est.dma_timeline_ms,
        "compute_timeline_ms": est.compute_timeline_ms,
        "compute_bound": est.compute_bound,
        "hbm_floor_ms": est.hbm_floor_ms,
        "ideal_floor_ms": plan.ideal_floor.ms,
        "ideal_floor_ratio": plan.ideal_floor.ratio(est.step_ms),
        "ideal_floor_bytes_per_core": plan.ideal_floor.bytes_per_core,
        "hand_written": None
        if plan.hand_written is None
        else {
            "step_ms": plan.hand_written.step_ms,
            "what": plan.hand_written.what,
            "source": plan.hand_written.source,
            "drafter": plan.hand_written.drafter or None,
        },
        "hbm_bytes_per_device_per_step": est.hbm_bytes_per_device_per_step,
        "tokens_per_s_per_user": est.tokens_per_s_per_user,
        "tokens_per_s": est.tokens_per_s,
        "tokens_per_dollar": est.tokens_per_dollar,
        "price_per_chip_hour_usd": est.price_per_chip_hour_usd,
        "breakdown_ms": dict(est.breakdown_ms),
        "cross_host_wait_ms": est.cross_host_wait_ms,
        "by_layer_kind": {
            k: {"layers": v.layers, "per_layer_us": v.per_layer_us, "total_ms": v.total_ms}
            for k, v in est.by_layer_kind.items()
        },
    }


def _sharding_dict(plan: BuildPlan) -> dict[str, Any]:
    sh = plan.sharding

    def tensors(ts) -> list[dict[str, Any]]:
        return [
            {
                "name": t.name,
                "format": t.format,
                "global_shape": list(t.global_shape),
                "split_axis": t.split_axis,
                "parts": t.parts,
                "expert_groups": t.expert_groups,
                "rank_shape": list(t.rank_shape),
                "rank_bytes": t.rank_bytes,
            }
            for t in ts
        ]

    def collectives(cs) -> list[dict[str, Any]]:
        return [
            {"name": c.name, "op": c.op, "bytes": c.payload_bytes, "level": c.level,
             "rounds": [r.model_dump() for r in c.rounds], "error_bound": c.error_bound,
             "us": c.time_s * 1e6}
            for c in cs
        ]  # fmt: skip

    out: dict[str, Any] = {"attention": {}, "ffn": {}, "globals": tensors(sh.globals)}
    for name, a in sh.attention.items():
        out["attention"][name] = {
            "type": a.type,
            "heads_per_rank": a.heads_per_rank,
            "kv_heads_per_rank": a.kv_heads_per_rank,
            "latent": a.latent,
            "why": a.why,
            "tensors": tensors(a.tensors),
            "collectives": collectives(a.collectives),
        }
    for name, f in sh.ffn.items():
        entry: dict[str, Any] = {
            "type": f.type,
            "why": f.why,
            "tensors": tensors(f.tensors),
            "collectives": collectives(f.collectives),
        }
        if f.experts is not None:
            x = f.experts
            entry["experts"] = {
                "groups": x.groups,
                "width_parts": x.width_parts,
                "experts_per_rank": x.experts_per_rank,
                "width_per_rank": x.width_per_rank,
                "slice_bytes": x.slice_bytes,
                "expected_max_experts_per_rank": x.expected_max_experts_per_rank,
                "sharing": x.sharing,
                "partner_experts": x.partner_experts,
                "held_per_rank": x.held_per_rank,
                "sharing_candidates": [
                    c.model_dump(exclude_none=True) for c in x.sharing_candidates
                ],
            }
            if x.chained_expected_max_experts_per_rank is not None:  # a fused chained pass's
                entry["experts"]["chained_expected_max_experts_per_rank"] = (
                    x.chained_expected_max_experts_per_rank
                )
        out["ffn"][name] = entry
    return out


# =========================================================================== human text


def _mib(n: float) -> str:
    return f"{n / MiB:.2f} MiB"


def _split(t) -> str:
    if t.replicated:
        return "replicated"
    out = f"axis {t.split_axis}/{t.parts}" if t.parts > 1 else ""
    if t.expert_groups > 1:
        out += (", " if out else "") + f"experts/{t.expert_groups}"
    return out


def sharding_table(plan: BuildPlan) -> str:
    """One row per tensor of each kind: format, global shape, split, per-rank shape, MiB."""
    sh = plan.sharding
    head = (
        f"  {'tensor':<26} {'format':<9} {'global shape':<20} {'split':<20} "
        f"{'per-rank shape':<20} {'MiB/rank':>9}"
    )
    lines = [f"Sharding over {sh.devices} devices", head]

    def rows(ts) -> None:
        for t in ts:
            lines.append(
                f"  {t.name:<26} {t.format:<9} {str(list(t.global_shape)):<20} "
                f"{_split(t):<20} {str(list(t.rank_shape)):<20} {t.rank_bytes / MiB:9.2f}"
            )

    lines.append(" globals")
    rows(sh.globals)
    for name, a in sh.attention.items():
        lines.append(f" attention {name} ({a.type}): {a.why}")
        rows(a.tensors)
        for c in a.collectives:
            lines.append(f"  collective {c.describe()}")
    for name, f in sh.ffn.items():
        lines.append(f" ffn {name} ({f.type}): {f.why}")
        rows(f.tensors)
        for c in f.collectives:
            lines.append(f"  collective {c.describe()}")
    return "\n".join(lines)


def vmem_table(plan: BuildPlan) -> str:
    vm = plan.vmem
    lines = [
        f"VMEM per core: {_mib(vm.explicit_bytes)} explicit of the {_mib(vm.budget_bytes)} "
        f"budget (+ {_mib(vm.internal_bytes)} Mosaic scratch, estimate: {_mib(vm.total_bytes)} "
        f"of the {_mib(vm.limit_bytes)} limit); {vm.why}",
        "  by category: "
        + ", ".join(f"{k} {v / MiB:.2f}" for k, v in vm.by_category.items() if v)
        + " MiB",
        f"  {'buffer':<30} {'category':<12} {'shape':<26} {'dtype':<6} {'MiB':>8}",
    ]
    for b in vm.buffers:
        lines.append(
            f"  {b.name:<30} {b.category:<12} {str(list(b.shape)):<26} {b.dtype:<6} "
            f"{b.bytes / MiB:8.3f}"
        )
    return "\n".join(lines)


def schedule_text(plan: BuildPlan) -> str:
    g = plan.graph
    checks = ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in g.checks.items())
    return "\n".join(
        [
            plan.schedule.describe(),
            f"graph: {g.nodes} nodes, {g.edges} edges ({g.data_edges} data, {g.reuse_edges} "
            f"buffer reuse); checks: {checks}",
        ]
        + [f"  {k}: {v}" for k, v in g.failures.items()]
    )


def _chip(plan: BuildPlan) -> Chip:
    from mkgen.spec.topology import parse_topology

    return parse_topology(plan.sharding.topology).chip_info


def kv_tiles_text(plan: BuildPlan) -> str:
    """One line: each cache attention kind's KV tile and how it was chosen."""
    tiles = plan.vmem.dims.kv_tiles
    if not tiles:
        return "KV tiles: none (no cache attention kind)"
    choice = plan.kv_tiles
    parts = []
    for kind, tile in tiles.items():
        scores = choice.scores[kind] if choice else {}
        scored = ", ".join(f"{t}: {ms:.3f}" for t, ms in scores.items())
        parts.append(f"{kind} {tile} tokens" + (f" (predicted ms/step, no refill held: {scored})"
                                                 if scored else ""))  # fmt: skip
    how = "chosen by the cost model" if choice else "the context rule's or --kv-tile's"
    return f"KV tiles, {how}: " + "; ".join(parts)


def plan_text(plan: BuildPlan) -> str:
    """The human output of ``mkgen plan``."""
    o, sh = plan.options, plan.sharding
    quant = ", ".join(f"{k}={v}" for k, v in sh.quantization.items())
    head = (
        f"{sh.model} on {sh.topology}: {sh.devices} devices ({plan.chips} chips); "
        f"batch {o.batch} x rows {o.rows} (acceptance {o.acceptance:g}), context {o.context}\n"
        f"quantization: {quant}"
    )
    return "\n\n".join(
        [
            head,
            sharding_table(plan),
            plan.vmem.dims.collectives.describe(),
            plan.memory.describe(),
            vmem_table(plan),
            plan.stream.describe(),
            schedule_text(plan),
            kv_tiles_text(plan),
            "Estimate: " + plan.estimate.describe(),
            *([plan.draft.describe()] if plan.draft else []),
            "\n".join(plan.confidence.lines()),
            "Against the bar: "
            + bar_text(
                plan.estimate.step_ms,
                plan.ideal_floor,
                plan.hand_written,
                plan.estimate.draft_ms,
                plan.draft.drafter if plan.draft else "",
                fused=plan.estimate.fused_verify_ms is not None,
            ),  # fmt: skip
        ]
        + ([collective_latency_note(_chip(plan))] if plan.sharding.devices > 1 else [])
    )


# =========================================================================== the sweep


@dataclass(frozen=True)
class SweepRow:
    batch: int
    rows: int
    acceptance: float
    fits_hbm: bool
    fits_vmem: bool
    hbm_gb_per_device: float
    vmem_mib: float
    step_ms: float  # the build `mkgen plan` plans at this point (its held refills)
    calibrated_step_ms: float  # the same build in the calibrated regime: no refill held, no expert sharing (mkgen/plan/confidence.py)
    ideal_floor_ms: float
    ideal_floor_ratio: float  # ideal floor / step
    tokens_per_s_per_user: float
    tokens_per_s: float
    tokens_per_dollar: float  # decoded tokens only
    total_tokens_per_dollar: float  # input plus output tokens of the sweep's scenario
    scenario: str  # its name (mkgen/plan/tco.py)
    note: str

    @property
    def fits(self) -> bool:
        return self.fits_hbm and self.fits_vmem


def collective_latency_note(chip: Chip) -> str:
    """The catalog's latency of one collective round within a host and of one across hosts,
    with where each comes from (REPORT.md and `mkgen plan`)."""
    inside, across = chip.collective_phase_latency, chip.cross_host_phase_latency

    def state(r: MeasuredRange) -> str:
        return "measured" if r.measured else "assumed"

    return (
        f"Collective latency: {inside.cost_model * 1e6:.1f} us per round within a host "
        f"({state(inside)}: {inside.source}); {across.cost_model * 1e6:.1f} us per round "
        f"across hosts, and per flat round of every core ({state(across)}: {across.why})"
    )


DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_ROWS = (1,)


def sweep(
    spec: ModelSpec,
    topo: Topology,
    base: BuildOptions,
    scenario: Scenario,
    batches: tuple[int, ...] = DEFAULT_BATCHES,
    rows: tuple[int, ...] = DEFAULT_ROWS,
    *,
    kinds: KindRegistry,
    price_drafter: bool = False,
) -> list[SweepRow]:
    """The cost model over batch x rows; points that do not fit are kept and marked.

    Each point's step is the build `mkgen plan` plans there (the same held refills), beside
    its calibrated step (none held). ``base.acceptance`` is capped at each row count (a step
    accepts at most its rows). Total tokens per dollar price `scenario`'s requests
    (mkgen/plan/tco.py). With `price_drafter` each point's step is verify + draft, the
    spec's drafter priced at its batch x rows (mkgen/plan/draft.py).
    """
    return [
        _sweep_point(
            spec, topo, scenario, kinds,
            base.model_copy(
                update={"batch": b, "rows": r, "acceptance": min(base.acceptance, float(r))}
            ),
            price_drafter,
        )
        for r in rows
        for b in batches
    ]  # fmt: skip


def _sweep_point(
    spec: ModelSpec, topo: Topology, scenario: Scenario, kinds: KindRegistry, opts: BuildOptions,
    price_drafter: bool,
) -> SweepRow:  # fmt: skip
    """One point of the sweep (a build that does not fit HBM is priced all the same; one
    whose buffers do not fit VMEM has no program to price)."""
    from mkgen.plan.confidence import calibrated_estimate
    from mkgen.plan.draft import price_draft
    from mkgen.plan.floor import ideal_floor
    from mkgen.plan.memory import plan_fitted
    from mkgen.plan.program import plan_program
    from mkgen.plan.tco import total_tokens_per_dollar
    from mkgen.plan.timeline import estimate
    from mkgen.spec.figures import params_active

    # The verify program keeps the draft section: the kernel writes the hidden states the
    # drafter reads (mkgen.plan.layout.draft_hidden_states); its passes are priced apart.
    drafting = spec
    applied = opts.apply(spec)
    try:
        program = plan_program(spec, topo, opts, kinds=kinds, require_fit=False)
    except MkgenError:
        program = None
    mem = program.memory if program else plan_fitted(applied, topo, opts, kinds=kinds)[1]
    notes = [] if mem.fits else [f"HBM {mem.total_bytes / GB:.1f} > {mem.usable_bytes / GB:.1f} GB"]
    if program is None:
        notes.append("VMEM over budget: not priced")
    floor = ideal_floor(applied, topo, opts)
    nan = math.nan
    est = estimate(topo, opts, program) if program else None
    calibrated = calibrated_estimate(topo, opts, program, est) if program and est else None
    if est and calibrated and price_drafter:
        draft_ms = price_draft(drafting, topo, opts, kinds=kinds).ms
        est, calibrated = est.with_draft(draft_ms), calibrated.with_draft(draft_ms)
    price = est.price_per_chip_hour_usd if est else None
    total = 0.0
    if est and price:
        total = total_tokens_per_dollar(
            scenario,
            decode_tokens_per_s=est.tokens_per_s,
            active_params=params_active(applied),
            chips=topo.num_chips,
            peak_bf16_flops_per_chip=topo.chip_info.peak_bf16_flops_per_chip,
            price_per_chip_hour_usd=price,
        )
    return SweepRow(
        batch=opts.batch,
        rows=opts.rows,
        acceptance=opts.acceptance,
        fits_hbm=mem.fits,
        fits_vmem=program is not None,
        hbm_gb_per_device=mem.total_bytes / GB,
        vmem_mib=program.vmem.explicit_bytes / MiB if program else nan,
        step_ms=est.drafted_step_ms if est else nan,
        calibrated_step_ms=calibrated.drafted_step_ms if calibrated else nan,
        ideal_floor_ms=floor.ms,
        ideal_floor_ratio=floor.ratio(est.step_ms) if est else nan,
        tokens_per_s_per_user=est.tokens_per_s_per_user if est else nan,
        tokens_per_s=est.tokens_per_s if est else nan,
        tokens_per_dollar=(est.tokens_per_dollar if est else None) or 0.0,
        total_tokens_per_dollar=total,
        scenario=scenario.name,
        note="; ".join(notes),
    )


def sweep_table(rows: list[SweepRow]) -> str:
    """The sweep for people: each row one build (batch x rows), its predicted step beside
    its calibrated step (no refill held) and the ideal floor."""
    lines = [
        f"{'batch':>5} {'rows':>4} {'accept':>6} {'step ms':>8} {'calib ms':>8} "
        f"{'floor ms':>8} {'tok/s/user':>10} {'tok/s':>9} {'total tok/$':>12} {'HBM GB':>7} "
        f"{'VMEM MiB':>8}  fits"
    ]
    for r in rows:
        fits = "yes" if r.fits else "no: " + r.note
        vmem = "-" if math.isnan(r.vmem_mib) else f"{r.vmem_mib:.1f}"
        lines.append(
            f"{r.batch:>5} {r.rows:>4} {r.acceptance:>6g} {r.step_ms:>8.3f} "
            f"{r.calibrated_step_ms:>8.3f} {r.ideal_floor_ms:>8.3f} "
            f"{r.tokens_per_s_per_user:>10.1f} {r.tokens_per_s:>9.1f} "
            f"{r.total_tokens_per_dollar:>12,.0f} {r.hbm_gb_per_device:>7.1f} {vmem:>8}  {fits}"
        )
    return "\n".join(lines)


def sweep_csv(rows: list[SweepRow]) -> str:
    buf = io.StringIO()
    fields = list(SweepRow.__dataclass_fields__)
    writer = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    for r in rows:
        data = asdict(r)
        for k, v in data.items():
            if isinstance(v, float):
                data[k] = "" if math.isnan(v) else f"{v:.6g}"
        writer.writerow(data)
    return buf.getvalue()


# --------------------------------------------------------------------------- the chart


def pareto_frontier(rows: list[SweepRow]) -> list[SweepRow]:
    """The points that fit and that no other fitting point beats on both tokens/s per user
    and total tokens per dollar, by rising tokens/s per user."""
    frontier: list[SweepRow] = []
    best = 0.0
    ordered = sorted(
        (r for r in rows if r.fits and r.total_tokens_per_dollar > 0),
        key=lambda r: (-r.tokens_per_s_per_user, -r.total_tokens_per_dollar),
    )
    for r in ordered:
        if r.total_tokens_per_dollar > best:
            frontier.append(r)
            best = r.total_tokens_per_dollar
    return frontier[::-1]


_MARKERS = ("o", "s", "^", "D", "v", "P")
_REFERENCE_STYLES = ("#444444", "#b8860b", "#8b0000", "#2e8b57", "#6a5acd")


def tco_chart(
    rows: list[SweepRow],
    *,
    title: str,
    notes: list[str],
    references: tuple[ReferenceCurve, ...],
    fmt: str,
) -> bytes:
    """Total tokens per dollar (log) against tokens/s per user, as SVG or PNG bytes.

    One marker per row count (hollow: does not fit HBM or VMEM), mkgen's Pareto frontier,
    the published reference points and where the curves of others end. Batch labels sit
    on the frontier only and are dropped where they would overprint another. Deterministic
    to the byte: fixed SVG hash salt, no dates or software names in the metadata.
    """
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    pts = [r for r in rows if r.total_tokens_per_dollar > 0 and r.tokens_per_s_per_user > 0]
    if not pts:
        raise MkgenError("estimate: no point has a price; pass --price USD")
    # Dollar signs are text, not mathtext delimiters; SVG text stays text (searchable).
    style = {
        "svg.hashsalt": "mkgen", "svg.fonttype": "none", "font.size": 9, "text.parse_math": False,
    }  # fmt: skip
    with matplotlib.rc_context(style):
        fig = Figure(figsize=(12.5, 7), dpi=100)
        FigureCanvasAgg(fig)  # text extents for the label placement
        # Room for the legend on the right and the notes below, each wrapped to the width.
        lines = [line for note in notes for line in textwrap.wrap(note, 190)]
        fig.subplots_adjust(left=0.07, right=0.62, top=0.9, bottom=0.1 + 0.025 * len(lines))
        ax = fig.add_subplot()
        ax.set_yscale("log")
        _plot_row_counts(ax, pts)
        frontier = pareto_frontier(pts)
        if frontier:
            ax.plot(
                [r.tokens_per_s_per_user for r in frontier],
                [r.total_tokens_per_dollar for r in frontier],
                color="black", linewidth=2.2, zorder=2, label="mkgen Pareto frontier (predicted)",
            )  # fmt: skip
        _plot_references(ax, references)
        _finish_axes(fig, ax, title)
        fig.text(0.01, 0.01, "\n".join(lines), fontsize=7.5, va="bottom", ha="left")
        _label_frontier(fig, ax, frontier)
        buffer = io.BytesIO()
        # The PNG keeps its title as text: `estimate` recognises its own earlier chart by it.
        metadata = {"Date": None} if fmt == "svg" else {"Software": None, "Title": title}
        fig.savefig(buffer, format=fmt, metadata=metadata)
    return buffer.getvalue()


def _plot_row_counts(ax: Any, pts: list[SweepRow]) -> None:
    """A line and a marker style per row count, hollow markers where a point does not fit."""
    for i, count in enumerate(sorted({r.rows for r in pts})):
        line = sorted((r for r in pts if r.rows == count), key=lambda r: r.batch)
        color = f"C{i}"
        accepted = f", acceptance {line[0].acceptance:g}" if count > 1 else ""
        ax.plot(
            [r.tokens_per_s_per_user for r in line],
            [r.total_tokens_per_dollar for r in line],
            color=color, linewidth=1, alpha=0.6,
            label=f"mkgen, rows {count}{accepted} (batch {line[0].batch}-{line[-1].batch})",
        )  # fmt: skip
        for fits in (True, False):
            group = [r for r in line if r.fits == fits]
            ax.scatter(
                [r.tokens_per_s_per_user for r in group],
                [r.total_tokens_per_dollar for r in group],
                marker=_MARKERS[i % len(_MARKERS)], s=28, zorder=3, edgecolors=color,
                facecolors=color if fits else "white",
            )  # fmt: skip


def _plot_references(ax: Any, references: tuple[ReferenceCurve, ...]) -> None:
    """The published reference points, and a vertical line where each curve ends."""
    for j, ref in enumerate(references):
        color = _REFERENCE_STYLES[j % len(_REFERENCE_STYLES)]
        note = f"; {ref.note}" if ref.note else ""
        if ref.points:
            ax.plot(
                [x for x, _ in ref.points], [y for _, y in ref.points],
                color=color, linestyle="--", marker="*", markersize=11, zorder=4,
                label=_wrap(f"{ref.describe()}: published{note}"),
            )  # fmt: skip
        for k, (x, what) in enumerate(ref.ends_at):
            ax.axvline(
                x, color=color, linestyle=(0, (2 + 2 * k, 2)), linewidth=1.2,
                label=_wrap(f"{ref.describe()}: {what} at {x:g} tokens/s per user (published)"),
            )  # fmt: skip


def _finish_axes(fig: Any, ax: Any, title: str) -> None:
    """Tick labels, axis labels, title, grid and legend."""
    from matplotlib.ticker import FuncFormatter

    # Plain tick labels ("2M", "10M"): with mathtext off, the log axis' own are raw TeX.
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _count(v)))
    ax.yaxis.set_minor_formatter(
        FuncFormatter(lambda v, _: _count(v) if round(v / 10 ** math.floor(math.log10(v)))
                      in (2, 5) else "")
    )  # fmt: skip
    ax.set_xlabel("tokens/s per user (decode)")
    ax.set_ylabel("total tokens (input + output) per dollar")
    fig.suptitle(title, fontsize=11, x=0.01, ha="left")
    ax.grid(True, which="major", color="#cccccc", linewidth=0.6)
    ax.grid(True, which="minor", color="#eeeeee", linewidth=0.4)
    ax.set_xlim(left=0)
    ax.scatter([], [], marker="o", facecolors="white", edgecolors="#333333",
               label="hollow: does not fit HBM or VMEM")  # fmt: skip
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)


def _count(v: float) -> str:
    """2500000 -> '2.5M', 100000 -> '100k' (tick labels)."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if v >= scale:
            return f"{v / scale:g}{suffix}"
    return f"{v:g}"


def _wrap(label: str) -> str:
    return textwrap.fill(label, 52, subsequent_indent="  ")


def _label_frontier(fig: Any, ax: Any, frontier: list[SweepRow]) -> None:
    """`B<batch> r<rows>` beside each frontier point, at the first of a few offsets where
    it overlaps no label placed before; left out where every offset would overprint."""
    fig.draw_without_rendering()  # axis limits and transforms as they will be drawn
    renderer = fig.canvas.get_renderer()
    placed: list[Any] = []
    for r in frontier:
        for dx, dy in ((6, 6), (6, -12), (-30, 8), (-30, -14)):
            text = ax.annotate(
                f"B{r.batch} r{r.rows}", (r.tokens_per_s_per_user, r.total_tokens_per_dollar),
                xytext=(dx, dy), textcoords="offset points", fontsize=7,
            )  # fmt: skip
            box = text.get_window_extent(renderer)
            if not any(box.overlaps(other) for other in placed):
                placed.append(box)
                break
            text.remove()


def estimate_chart_text(
    spec_name: str,
    topo: Topology,
    price: float,
    scenario: Scenario,
    reference_prices: dict[str, float],
    draft: str | None = None,
) -> tuple[str, list[str]]:
    """The chart's title and its notes: what is predicted, at which price, for which
    requests, under which assumption, and where the reference points come from (and,
    with `draft`, that each step is verify + that drafter's priced passes)."""
    from mkgen.plan.tco import PREFILL_MFU, REFERENCE_SOURCE

    title = (
        f"{spec_name} on {topo.name} ({topo.num_chips} chips at ${price:.2f} per chip-hour): "
        "predicted total tokens per $ vs tokens/s per user"
    )
    prefill = (
        f"prefill priced at {100 * PREFILL_MFU:.0f} % of the slice's peak bf16 FLOP/s "
        "(an assumption: mkgen has no prefill estimate yet)"
        if scenario.input_tokens
        else "prefill not counted"
    )
    from mkgen.plan.calibration import RECORDED

    prices = ", ".join(f"{chip} ${usd:.2f}" for chip, usd in reference_prices.items())
    other = "" if spec_name == "kimi-k3" else f", not {spec_name}"
    notes = [
        "mkgen points are predictions of its cost model, not measurements: each is the build "
        "`mkgen plan` plans at its batch x rows"
        + (
            f", its step verify + draft with --draft {draft} (the draft priced, no kernel runs "
            "it yet)."
            if draft
            else "."
        ),
        "The model is calibrated on the hand-written Muse Spark kernel's published TPU7x "
        f"measurements ({RECORDED.describe()}).",
        f"Requests: {scenario.describe()} ({scenario.why}); {prefill}.",
        f"References: {REFERENCE_SOURCE}, as published{other}; chip-hour prices (analyst "
        f"estimates): {prices}.",
    ]
    return title, notes
