"""Plans for people and for programs: human text, JSON, the estimate sweep as CSV and SVG.

Only formatting lives here (and the sweep that feeds the TCO table); every number comes
from mkgen.plan. Output is deterministic: the same plan gives the same bytes.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from mkgen.errors import MkgenError
from mkgen.hardware import MiB

if TYPE_CHECKING:
    from mkgen.plan import BuildPlan
    from mkgen.plan.options import BuildOptions
    from mkgen.spec.schema import ModelSpec
    from mkgen.spec.topology import Topology

GB = 1e9


# =========================================================================== JSON


def plan_dict(plan: BuildPlan) -> dict[str, Any]:
    """The plan as JSON-ready data: the keys of issue 3's ``--json`` block and more."""
    o, sh, mem, vm, est = plan.options, plan.sharding, plan.memory, plan.vmem, plan.estimate
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
        "memory": {
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
        },
        "vmem": {
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
        },
        "sharding": _sharding_dict(plan),
        "collectives": plan.vmem.dims.collectives.model_dump(),
        "stream": {
            "bank_rows": plan.stream.bank_rows,
            "bank_bytes": plan.stream.bank_bytes,
            "banks": plan.stream.total_banks,
            "bytes_per_step": plan.stream.bytes_per_step,
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
        "estimate": {
            "step_ms": est.step_ms,
            "hbm_floor_ms": est.hbm_floor_ms,
            "floor_ratio": est.floor_ratio,
            "hbm_bytes_per_device_per_step": est.hbm_bytes_per_device_per_step,
            "tokens_per_s_per_user": est.tokens_per_s_per_user,
            "tokens_per_s": est.tokens_per_s,
            "tokens_per_dollar": est.tokens_per_dollar,
            "price_per_chip_hour_usd": est.price_per_chip_hour_usd,
            "breakdown_ms": dict(est.breakdown_ms),
            "by_layer_kind": {
                k: {"layers": v.layers, "per_layer_us": v.per_layer_us, "total_ms": v.total_ms}
                for k, v in est.by_layer_kind.items()
            },
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
             "algorithm": c.algorithm, "us": c.time_s * 1e6}
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
            }
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
            schedule_text(plan),
            "Estimate: " + plan.estimate.describe(),
        ]
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
    step_ms: float
    hbm_floor_ms: float
    tokens_per_s_per_user: float
    tokens_per_s: float
    tokens_per_dollar: float
    note: str


DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_ROWS = (1, 4, 8)


def sweep(
    spec: ModelSpec,
    topo: Topology,
    base: BuildOptions,
    batches: tuple[int, ...] = DEFAULT_BATCHES,
    rows: tuple[int, ...] = DEFAULT_ROWS,
) -> list[SweepRow]:
    """The cost model over batch x rows; points that do not fit are kept and marked.

    ``base.acceptance`` is capped at each row count (a step accepts at most its rows).
    """
    from mkgen.plan.cost import estimate
    from mkgen.plan.layout import FULL_BANK_ROWS
    from mkgen.plan.memory import plan_memory
    from mkgen.plan.sharding import plan_sharding
    from mkgen.plan.stream import plan_stream
    from mkgen.plan.vmem import plan_vmem

    spec = base.apply(spec)
    out: list[SweepRow] = []
    for r in rows:
        for b in batches:
            opts = base.model_copy(
                update={"batch": b, "rows": r, "acceptance": min(base.acceptance, float(r))}
            )
            notes: list[str] = []
            sharding = plan_sharding(spec, topo, opts)
            mem = plan_memory(spec, topo, opts, sharding)
            if not mem.fits:
                notes.append(f"HBM {mem.total_bytes / GB:.1f} > {mem.usable_bytes / GB:.1f} GB")
            vmem_mib, fits_vmem = math.nan, False
            try:
                stream = plan_stream(spec, sharding, bank_rows=FULL_BANK_ROWS, ring_depth=2)
                vm = plan_vmem(spec, topo, opts, sharding, stream)
                vmem_mib, fits_vmem = vm.explicit_bytes / MiB, True
            except MkgenError:
                notes.append("VMEM over budget")
            est = estimate(spec, topo, opts, sharding)
            out.append(
                SweepRow(
                    batch=b,
                    rows=r,
                    acceptance=opts.acceptance,
                    fits_hbm=mem.fits,
                    fits_vmem=fits_vmem,
                    hbm_gb_per_device=mem.total_bytes / GB,
                    vmem_mib=vmem_mib,
                    step_ms=est.step_ms,
                    hbm_floor_ms=est.hbm_floor_ms,
                    tokens_per_s_per_user=est.tokens_per_s_per_user,
                    tokens_per_s=est.tokens_per_s,
                    tokens_per_dollar=est.tokens_per_dollar or 0.0,
                    note="; ".join(notes),
                )
            )
    return out


def sweep_table(rows: list[SweepRow]) -> str:
    lines = [
        f"{'batch':>5} {'rows':>4} {'accept':>6} {'step ms':>8} {'floor ms':>8} "
        f"{'tok/s/user':>10} {'tok/s':>9} {'tok/$':>12} {'HBM GB':>7} {'VMEM MiB':>8}  fits"
    ]
    for r in rows:
        fits = "yes" if r.fits_hbm and r.fits_vmem else "no: " + r.note
        vmem = "-" if math.isnan(r.vmem_mib) else f"{r.vmem_mib:.1f}"
        lines.append(
            f"{r.batch:>5} {r.rows:>4} {r.acceptance:>6g} {r.step_ms:>8.3f} "
            f"{r.hbm_floor_ms:>8.3f} {r.tokens_per_s_per_user:>10.1f} {r.tokens_per_s:>9.1f} "
            f"{r.tokens_per_dollar:>12,.0f} {r.hbm_gb_per_device:>7.1f} {vmem:>8}  {fits}"
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


# --------------------------------------------------------------------------- SVG

_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def _nice_step(span: float) -> float:
    raw = span / 6 if span > 0 else 1.0
    power = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if raw <= m * power:
            return m * power
    return 10 * power


def _fmt(v: float) -> str:
    if v >= 1e6:
        return f"{v / 1e6:g}M"
    if v >= 1e3:
        return f"{v / 1e3:g}k"
    return f"{v:g}"


def sweep_svg(rows: list[SweepRow], title: str) -> str:
    """Tokens per dollar (log) against tokens/s per user: one line per row count.

    Hand-written SVG (no plotting dependency), deterministic to the byte. Filled points
    fit in HBM and VMEM, hollow ones do not.
    """
    w, h = 720, 480
    left, right, top, bottom = 80, 160, 50, 60
    pw, ph = w - left - right, h - top - bottom
    pts = [r for r in rows if r.tokens_per_dollar > 0 and r.tokens_per_s_per_user > 0]
    if not pts:
        raise MkgenError("estimate: no point has a price; pass --price USD")
    xmax = max(r.tokens_per_s_per_user for r in pts)
    xstep = _nice_step(xmax)
    xmax = math.ceil(xmax / xstep) * xstep
    lo = math.floor(math.log10(min(r.tokens_per_dollar for r in pts)))
    hi = math.ceil(math.log10(max(r.tokens_per_dollar for r in pts)))
    hi = max(hi, lo + 1)

    def sx(v: float) -> float:
        return left + pw * v / xmax

    def sy(v: float) -> float:
        return top + ph * (1 - (math.log10(v) - lo) / (hi - lo))

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
        f'viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">',
        f'<rect width="{w}" height="{h}" fill="white"/>',
        f'<text x="{left + pw / 2:.1f}" y="24" text-anchor="middle" font-size="15">'
        f"{_esc(title)}</text>",
    ]
    # grid and ticks
    x = 0.0
    while x <= xmax + 1e-9:
        out.append(
            f'<line x1="{sx(x):.1f}" y1="{top}" x2="{sx(x):.1f}" y2="{top + ph}" stroke="#ddd"/>'
        )
        out.append(
            f'<text x="{sx(x):.1f}" y="{top + ph + 18}" text-anchor="middle">{_fmt(x)}</text>'
        )
        x += xstep
    for e in range(lo, hi + 1):
        for m in (1, 2, 5):
            v = m * 10.0**e
            if v > 10.0**hi:
                break
            y = sy(v)
            out.append(
                f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" '
                f'stroke="{"#ccc" if m == 1 else "#eee"}"/>'
            )
            out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{_fmt(v)}</text>')
    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#333"/>')
    out.append(
        f'<text x="{left + pw / 2:.1f}" y="{h - 18}" text-anchor="middle">tokens/s per user</text>'
    )
    out.append(
        f'<text transform="translate(18,{top + ph / 2:.1f}) rotate(-90)" '
        'text-anchor="middle">tokens per dollar</text>'
    )
    # one line per row count
    for i, r_count in enumerate(sorted({r.rows for r in pts})):
        color = _COLORS[i % len(_COLORS)]
        line = sorted((r for r in pts if r.rows == r_count), key=lambda r: r.batch)
        coords = " ".join(f"{sx(r.tokens_per_s_per_user):.1f},{sy(r.tokens_per_dollar):.1f}"
                          for r in line)  # fmt: skip
        out.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="2"/>')
        for r in line:
            fill = color if r.fits_hbm and r.fits_vmem else "white"
            cx, cy = sx(r.tokens_per_s_per_user), sy(r.tokens_per_dollar)
            out.append(
                f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="4" fill="{fill}" stroke="{color}"/>'
            )
            out.append(f'<text x="{cx + 6:.1f}" y="{cy - 6:.1f}" font-size="10">B{r.batch}</text>')
        ly = top + 10 + 20 * i
        out.append(
            f'<line x1="{left + pw + 16}" y1="{ly}" x2="{left + pw + 40}" y2="{ly}" '
            f'stroke="{color}" stroke-width="2"/>'
        )
        acc = line[0].acceptance
        out.append(
            f'<text x="{left + pw + 46}" y="{ly + 4}">rows {r_count}'
            f"{f', accept {acc:g}' if r_count > 1 else ''}</text>"
        )
    ly = top + 10 + 20 * len({r.rows for r in pts}) + 10
    out.append(
        f'<circle cx="{left + pw + 28}" cy="{ly}" r="4" fill="white" stroke="#333"/>'
        f'<text x="{left + pw + 46}" y="{ly + 4}">does not fit</text>'
    )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _esc(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
