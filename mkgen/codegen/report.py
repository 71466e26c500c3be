"""REPORT.md's data: everything REPORT.md.j2 places, already formatted (the template
decides nothing). Performance figures are the cost model's predictions."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mkgen import __version__
from mkgen.codegen.naming import CommandLine, build_commands
from mkgen.plan.layout import KernelLayout
from mkgen.plan.options import BuildOptions
from mkgen.plan.published import bar_text
from mkgen.plan.report import collective_latency_note
from mkgen.spec.figures import params_active, params_total
from mkgen.spec.schema import ModelSpec
from mkgen.spec.topology import Topology


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def _gb(n: float) -> str:
    return f"{n / 1e9:,.3f} GB"


def _ranges(values: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out: list[str] = []
    for v in values:
        if out and out[-1].split("-")[-1] == str(v - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{v}"
        else:
            out.append(str(v))
    return ", ".join(out)


def report_context(
    *,
    spec: ModelSpec,
    topology: Topology,
    options: BuildOptions,
    layout: KernelLayout,
    plan: Any,
    acceptance: list[Any],
    header: str,
    name: str,
    digest: str,
    measurements: Mapping[str, Any],
    mini_name: str | None,
    is_mini: bool,
    rebuild: str,
    line: CommandLine,
) -> dict[str, Any]:
    """Everything REPORT.md.j2 places, already formatted. `mini_name` names the build's
    mini twin (None: it has none)."""
    est, mem, stream = plan.estimate, plan.memory, layout.stream
    quant = plan.sharding.quantization
    verify_runs = _verify_rows(measurements.get("verify"))
    return {
        "header_lines": header.splitlines(),
        "name": name,
        "is_mini": is_mini,
        "spec": spec,
        "description": spec.description,
        "topology": topology,
        "topology_text": topology.describe().splitlines()[0],
        "options": options.describe(),
        "rebuild": rebuild,
        # A mini twin's REPORT prints only its inspect command (it is no spec of its own).
        "commands": build_commands(spec.name, topology, options, line),
        "digest": digest,
        "version": __version__,
        "params_total": f"{params_total(spec) / 1e9:,.2f} B",
        "params_active": f"{params_active(spec) / 1e9:,.2f} B",
        "quant": sorted((f, q) for f, q in quant.items() if mem.weights_by_family.get(f)),
        "kinds": _kind_rows(layout),
        "tensors": _tensor_rows(plan.sharding),
        "split_choices": _split_choices(plan.sharding),
        "collectives": _collective_rows(plan.sharding),
        "collective_rounds": plan.vmem.dims.collectives.describe(),
        "hbm": _hbm_rows(mem),
        "hbm_total": _gb(mem.total_bytes),
        "hbm_usable": _gb(mem.usable_bytes),
        "hbm_headroom": _gb(mem.usable_bytes - mem.total_bytes),
        "vmem_plan": _vmem_plan(plan),
        "ring_bytes": _mib(stream.ring_depth * stream.bank_bytes),
        "stream": stream,
        "bank_bytes": _mib(stream.bank_bytes),
        "stream_bytes": _mib(stream.bytes_per_step),
        "stream_padding": _mib(stream.padding_bytes),
        "stream_rows": _stream_rows(layout),
        "estimate": est,
        "confidence": _confidence(plan.confidence),
        "profile_bound": _profile_bound(measurements.get("profile"), est),
        "bar": bar_text(
            est.step_ms,
            plan.ideal_floor,
            plan.hand_written,
            est.draft_ms,
            plan.draft.drafter if plan.draft else "",
            fused=est.fused_verify_ms is not None,
        ),  # fmt: skip
        "collective_latency": collective_latency_note(topology.chip_info),
        **_estimate_rows(est, acceptance),
        "kv_tiles": _kv_tile_rows(plan.kv_tiles, options.context),
        "measured_compile": measurements.get("compile"),
        "measured_profile": measurements.get("profile"),
        "measured_verify": measurements.get("verify"),
        "verify_runs": verify_runs,
        "verify_drafts": any(run["drafts"] for run in verify_runs),
        "mini": mini_name is not None,
        "mini_name": mini_name,
        "devices": topology.num_devices,
    }


def _kind_rows(layout: KernelLayout) -> list[dict[str, Any]]:
    """Each layer kind and the layers it serves."""
    return [
        {
            "what": f"attention {a.name} ({a.type if hasattr(a, 'type') else 'gqa'})",
            "layers": _ranges(a.layers),
            "count": len(a.layers),
        }
        for a in layout.attention
    ] + [
        {"what": f"ffn {f.name} ({f.type})", "layers": _ranges(f.layers), "count": len(f.layers)}
        for f in layout.ffn
    ]


def _tensor_rows(sharding: Any) -> list[dict[str, Any]]:
    """Every tensor's global shape, split and per-rank piece."""
    tensor_rows = []
    for title, tensors in [("global", sharding.globals), ("every layer", sharding.layer_vectors)]:
        tensor_rows += [(title, t) for t in tensors]
    for kind, s in sharding.attention.items():
        tensor_rows += [(f"attention {kind} ({s.type})", t) for t in s.tensors]
    for kind, s in sharding.ffn.items():
        tensor_rows += [(f"ffn {kind} ({s.type})", t) for t in s.tensors]
    return [
        {
            "group": group,
            "name": t.name,
            "format": t.format,
            "global": "x".join(map(str, t.global_shape)),
            "split": "replicated"
            if t.split_axis is None or t.parts == 1
            else f"axis {t.split_axis} / {t.parts}",
            "rank": "x".join(map(str, t.rank_shape)),
            "bytes": _mib(t.rank_bytes),
        }
        for group, t in tensor_rows
    ]


def _collective_rows(sharding: Any) -> list[dict[str, Any]]:
    """Every collective of a layer kind and of the step, with its rounds and predicted time."""
    collectives = []
    for where, items in (
        *((f"attention {k}", s.collectives) for k, s in sharding.attention.items()),
        *((f"ffn {k}", s.collectives) for k, s in sharding.ffn.items()),
        ("step", sharding.step_collectives),
    ):
        for c in items:
            collectives.append(
                {
                    "where": where,
                    "name": c.name,
                    "op": c.op,
                    "payload": f"{c.payload_bytes:,} B",
                    "rounds": "; ".join(r.describe() for r in c.rounds) or "none",
                    "error": f"{c.error_bound:.1e}",
                    "us": f"{c.time_s * 1e6:.2f}",
                }
            )
    return collectives


def _split_choices(sharding: Any) -> list[dict[str, Any]]:
    """Split or replicated, as the planner scored it: low-rank A-projections, routers and
    the routed experts' split (with its sharing around the ring of groups)."""
    return [
        {"where": f"attention {k}", "what": "low-rank A-projections", "choice": a.latent,
         "why": a.why}
        for k, a in sharding.attention.items()
        if a.latent != "none"
    ] + [
        {"where": f"ffn {k}", "what": "router", "choice": f.router,
         "why": next(t.why for t in f.tensors if t.name == "ffn.router")}
        for k, f in sharding.ffn.items()
        if f.router != "none"
    ] + [
        {"where": f"ffn {k}", "what": "routed experts", "choice": _expert_split(f.experts),
         "why": f.experts.why}
        for k, f in sharding.ffn.items()
        if f.experts is not None
    ]  # fmt: skip


def _expert_split(x: Any) -> str:
    """The expert split the planner chose: groups x width parts, and the sharing."""
    split = f"{x.groups} groups x {x.width_parts} width parts"
    if not x.partner_experts:
        return split
    return (
        f"{split}, expert sharing {x.sharing} (each core holds {x.held_per_rank}: its "
        f"group's {x.experts_per_rank}, then {x.partner_experts} of the next group's)"
    )


def _hbm_rows(mem: Any) -> list[dict[str, str]]:
    """HBM per use, largest first."""
    hbm = []
    for title, table in (
        ("weights", mem.weights_by_family),
        ("caches", mem.cache_by_kind),
        ("workspace", mem.workspace_by_use),
    ):
        for key, value in sorted(table.items(), key=lambda kv: (-kv[1], kv[0])):
            if value:
                hbm.append({"use": f"{title}: {key}", "bytes": _gb(value)})
    return hbm


def _segment_row(where: str, seg: Any) -> dict[str, Any]:
    return {
        "where": where,
        "segment": seg.name,
        "shape": f"{seg.fan_in} x {seg.fan_out}",
        "rows": seg.rows,
        "bytes": _mib(seg.bytes),
    }


def _stream_rows(layout: KernelLayout) -> list[dict[str, Any]]:
    """The weight stream's segments per layer kind, then the lm_head's."""
    stream = layout.stream
    rows = []
    for section, kinds, members in (
        ("attention", stream.attention, layout.attention),
        ("ffn", stream.ffn, layout.ffn),
    ):
        for k in members:
            where = f"{section} {k.name} (x{len(k.layers)} layers)"
            rows += [_segment_row(where, seg) for seg in kinds[k.name].segments]
    return rows + [_segment_row("lm_head (once)", seg) for seg in stream.tail]


def _estimate_rows(est: Any, acceptance: list[Any]) -> dict[str, list[dict[str, Any]]]:
    """The predicted step's breakdown, per layer kind and per acceptance length."""
    return {
        "breakdown": [
            {"what": k, "ms": f"{v:.3f}", "share": f"{100 * v / est.step_ms:.1f} %"}
            for k, v in est.breakdown_ms.items()
        ],
        "by_kind": [
            {
                "kind": k,
                "layers": v.layers,
                "us": f"{v.per_layer_us:.1f}",
                "ms": f"{v.total_ms:.3f}",
            }
            for k, v in est.by_layer_kind.items()
        ],
        "by_acceptance": [
            {
                "acceptance": f"{e.acceptance:g}",
                "step_ms": f"{e.step_ms:.3f}",
                "per_user": f"{e.tokens_per_s_per_user:,.1f}",
                "aggregate": f"{e.tokens_per_s:,.1f}",
            }
            for e in acceptance
        ],
    }


def _kv_tile_rows(choice: Any, context: int) -> dict[str, Any] | None:
    """Each cache attention kind's KV tile and the predicted step at every candidate
    (mkgen/plan/kvtiles.py); None when the planner had no choice to make."""
    if choice is None:
        return None
    from mkgen.plan.options import kv_tile_candidates

    tiles = kv_tile_candidates(context)

    def cell(kind: str, tile: int) -> str:
        if tile in choice.refused[kind]:
            return "refused (VMEM)"
        return f"{choice.scores[kind][tile]:.3f}"

    return {
        "candidates": tiles,
        "rows": [
            {"kind": kind, "tile": tile, "cells": [cell(kind, t) for t in tiles]}
            for kind, tile in choice.tiles.items()
        ],
    }


def _confidence(confidence: Any) -> dict[str, Any] | None:
    """The calibrated regime, the uncalibrated parts and the sensitivity table, formatted
    (mkgen/plan/confidence.py)."""
    if confidence is None:
        return None
    return {
        "step_ms": f"{confidence.step_ms:.3f}",
        "beside_step": confidence.beside_step(),
        "sensitivity_of": confidence.sensitivity_of(),
        "calibrated_step_ms": f"{confidence.calibrated_step_ms:.3f}",
        "point": confidence.point,
        "coverage": confidence.coverage.describe(),
        "calibration": confidence.calibration,
        "uncalibrated": [
            {"what": p.what, "ms": f"{p.ms:+.3f}", "how": p.how} for p in confidence.uncalibrated
        ],
        "sensitivity": [
            {"input": r.input, "low": f"{r.low:.3g}", "high": f"{r.high:.3g}",
             "step_ms_low": f"{r.step_ms_low:.3f}", "step_ms_high": f"{r.step_ms_high:.3f}",
             "source": r.source}
            for r in confidence.sensitivity
        ],
    }  # fmt: skip


def _profile_bound(profile: Mapping[str, Any] | None, est: Any) -> dict[str, str] | None:
    """A recorded static profile's compute timeline against the plan's DMA timeline and
    step (predictions, recomputed with every build)."""
    if profile is None:
        return None
    compute_us, dma_us = profile["compute_us"], est.dma_timeline_ms * 1e3
    return {
        "compute_us": f"{compute_us:.1f}",
        "dma_us": f"{dma_us:.1f}",
        "step_us": f"{est.step_ms * 1e3:.1f}",
        "verdict": "**compute-bound**" if compute_us > dma_us else "DMA-bound",
    }


def _worst(steps: list[dict[str, Any]], value: str, tolerance: str) -> str:
    if not steps:
        return "-"
    worst = max(steps, key=lambda s: s[value] / max(s[tolerance], 1e-30))
    return f"{worst[value]:.4g} / {worst[tolerance]:.4g}"


def _verify_rows(verify: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """One row per DMA mode of a recorded `mkgen verify` (worst step of each check)."""
    rows = []
    for run in (verify or {}).get("runs", []):
        steps = run["steps"]
        agree = sum(s["tokens_equal"] + s["tokens_near_tie"] for s in steps)
        rows.append(
            {
                "mode": run["mode"],
                "passed": run["passed"],
                "failure": run.get("failure") or "",
                "steps": len(steps),
                "logit": _worst(steps, "max_logit_diff", "logit_tolerance"),
                "greedy": f"{agree}/{sum(s['tokens_total'] for s in steps)}",
                "cache": _worst(steps, "max_cache_diff", "cache_tolerance"),
                "residual": _worst(steps, "max_residual_diff", "residual_tolerance")
                if steps and "max_residual_diff" in steps[0]
                else "-",
                # Near ties the reference followed (verify's tie rule); older records lack them.
                "route_ties": sum(len(s.get("route_ties", ())) for s in steps),
                "drafts": _drafts_equal(steps),
                "seconds": f"{sum(s['seconds'] for s in steps):.1f}",
            }
        )
    return rows


def _drafts_equal(steps: list[Mapping[str, Any]]) -> str | None:
    """A kernel that drafts: its drafts equal to the reference drafter's / all it drafted
    over the steps (and how many were not compared, after a near tie of the reference
    drafter's); None without drafts."""
    total = sum(s.get("drafts_total", 0) for s in steps)
    if not total:
        return None
    equal = sum(s["drafts_equal"] for s in steps)
    after_ties = sum(s["drafts_near_tie"] for s in steps)
    return f"{equal}/{total}" + (f" ({after_ties} after a near tie)" if after_ties else "")


def _vmem_plan(plan: Any) -> dict[str, Any]:
    """The plan's VMEM plan (mkgen/plan/vmem.py), formatted: what the kernel allocates
    (tests/test_plan_graph.py holds the kernel's `_scratch_shapes()` to it)."""
    vm = plan.vmem
    return {
        "buffers": [
            {
                "name": b.name,
                "category": b.category,
                "role": b.role,
                "shape": "x".join(map(str, b.shape)),
                "dtype": b.dtype,
                "bytes": _mib(b.bytes),
                "why": b.why,
            }
            for b in sorted(vm.buffers, key=lambda b: (-b.bytes, b.name))
        ],
        "explicit": _mib(vm.explicit_bytes),
        "internal": _mib(vm.internal_bytes),
        "total": _mib(vm.total_bytes),
        "total_bytes": vm.total_bytes,
        "budget": _mib(vm.budget_bytes),
        "limit": _mib(vm.limit_bytes),
        "ring_depth": vm.ring_depth,
        "expert_slots": vm.expert_slots,
        "why": vm.why,
        "smem": [f"`{s.name}`[{'x'.join(map(str, s.shape))}]" for s in vm.smem],
        "semaphores": [f"`{s.name}`[{'x'.join(map(str, s.shape))}]" for s in vm.semaphores],
    }
