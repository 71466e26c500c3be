"""The checks behind `mkgen compile` and `mkgen verify`: run them, print them, record them.

- compile: the full-size kernel lowered and compiled for the compile-only TPU7x
  topology with shape-only arguments (mkgen/verify/tpu_compile.py); its VMEM is held
  against the plan's figure when the plan has one.
- verify: the mini twin in TPU interpret mode against the reference, in each DMA
  execution mode (mkgen/verify/numerics.py, one subprocess per mode).

Each check returns plain data that the CLI prints and that a build's
measurements.json records (mkgen/codegen/package.py record_measurement).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from mkgen.errors import MkgenError
from mkgen.plan.options import BuildOptions
from mkgen.spec.schema import ModelSpec
from mkgen.spec.topology import Topology
from mkgen.verify import numerics
from mkgen.verify.numerics import (
    CACHE_RTOL,
    DRAFT_TIE_FACTOR,
    INTERPRET_MODES,
    LOGIT_ATOL,
    LOGIT_RTOL,
    ROUTE_RTOL,
    NumericsReport,
    StepCheck,
    verify_numerics,
)

MiB = 1024 * 1024


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def plan_vmem_bytes(plan: Any) -> int | None:
    """The plan's VMEM figure in bytes, once the planner has a VMEM plan (else None)."""
    vmem = getattr(plan, "vmem", None)
    if vmem is None:
        return None
    for name in ("total_bytes", "peak_bytes", "bytes", "padded_bytes"):
        value = getattr(vmem, name, None)
        if isinstance(value, int):
            return value
    return None


# ---------------------------------------------------------------- compile


@dataclass(frozen=True)
class CompileOutcome:
    build: str
    topology: str
    seconds: float
    vmem_bytes: int  # what Mosaic's compiled module reports
    plan_vmem_bytes: int | None
    scratch_padded_bytes: int  # the kernel's own allocation, tile-padded
    jax: str
    libtpu: str

    @property
    def plan_below_mosaic(self) -> bool:
        return self.plan_vmem_bytes is not None and self.plan_vmem_bytes < self.vmem_bytes

    def record(self) -> dict[str, Any]:
        return asdict(self)

    def lines(self) -> list[str]:
        plan = (
            f"plan {self.plan_vmem_bytes / MiB:.2f} MiB ({self.plan_vmem_bytes:,} B)"
            if self.plan_vmem_bytes is not None
            else "the plan has no VMEM figure yet"
        )
        out = [
            f"  compiled in {self.seconds:.1f} s",
            f"  VMEM: Mosaic uses {self.vmem_bytes / MiB:.2f} MiB ({self.vmem_bytes:,} B); "
            f"{plan}; kernel scratch {self.scratch_padded_bytes / MiB:.2f} MiB tile-padded",
        ]
        if self.plan_below_mosaic:
            out.append("  the plan's VMEM figure is BELOW what Mosaic uses: the plan is wrong")
        return out


def compile_full_size(
    spec: ModelSpec, topology: Topology, options: BuildOptions, header: str
) -> CompileOutcome:
    """Render, lower and compile the full-size kernel for `topology`'s compile-only TPU
    devices. Raises CompileError (Mosaic's message) when it does not compile."""
    import numpy as np
    from jax.sharding import Mesh

    from mkgen.codegen.build import load_module, render_kernel
    from mkgen.codegen.naming import build_name
    from mkgen.kinds import default_registry
    from mkgen.plan import plan_build
    from mkgen.plan.collectives import arrange_devices
    from mkgen.verify.inspect import vmem_map
    from mkgen.verify.tpu_compile import compile_for_tpu, compile_only_devices

    applied = options.apply(spec)
    plan = plan_build(applied, topology, options, kinds=default_registry())
    layout = plan.kernel
    source = render_kernel(layout, header)
    name = build_name(spec.name, topology)
    kernel = load_module(source, f"mkgen_compile_{name.replace('-', '_').replace('.', '_')}")
    devices = compile_only_devices(topology)
    devices = arrange_devices(devices, topology, layout.collectives.mesh_order)
    mesh = Mesh(np.array(devices), (kernel.AXIS,))
    shapes = (kernel.fused_argument_shapes if layout.draft_passes else kernel.argument_shapes)(mesh)
    report = compile_for_tpu(kernel.make_decode_step(mesh), shapes)
    scratch = vmem_map(source)
    return CompileOutcome(
        build=name,
        topology=topology.name,
        seconds=round(report.seconds, 2),
        vmem_bytes=report.vmem_bytes,
        plan_vmem_bytes=plan_vmem_bytes(plan),
        scratch_padded_bytes=scratch.padded_bytes if scratch else 0,
        jax=_version("jax"),
        libtpu=_version("libtpu"),
    )


# ---------------------------------------------------------------- verify


# The per-layer residual check, when the numerics harness has it (it names the first
# diverging layer); before that a failure names the step and the check only.
RESIDUALS = "first_diverging_layer" in StepCheck.__dataclass_fields__
_RESIDUAL_RTOL = getattr(numerics, "RESIDUAL_RTOL", None)
TOLERANCES = (
    f"logits: max |kernel - reference| <= {LOGIT_ATOL:g} + {LOGIT_RTOL:g} x max |reference|; "
    "greedy tokens equal (a near tie, top two within the logit tolerance, may flip); "
    f"cache rows written this step within {CACHE_RTOL:g} x max(|reference|, 1); "
    "every MoE layer's experts equal, unless the kernel's are a top-k choice once the "
    f"router's choice values move by {ROUTE_RTOL:g} x the token's largest (a near tie: "
    "reported, and the reference takes the kernel's experts); "
    + (
        f"the residual stream after every layer within {_RESIDUAL_RTOL:g} x its largest value; "
        f"the drafter's hidden states (a build with a drafter) within {_RESIDUAL_RTOL:g} x "
        "each one's largest value; "
        if RESIDUALS and _RESIDUAL_RTOL is not None
        else ""
    )
    + "a fused drafter's accepted rows as the accept rule on the kernel's own greedy tokens and "
    "its drafts the reference drafter's (a near tie, top two within "
    f"{DRAFT_TIE_FACTOR:g} x the step's largest logit difference, ends that chain's comparison); "
    "every logit and cache entry finite"
)
NOT_YET = (
    "a failure names the step, the check and the first diverging layer"
    if RESIDUALS
    else "per-layer residual comparison is a later addition: a failure names the step and "
    "the check, not yet the layer and tensor"
)


def modes_of(mode: str) -> tuple[str, ...]:
    if mode == "both":
        return INTERPRET_MODES
    if mode not in INTERPRET_MODES:
        raise MkgenError(f"--mode {mode!r}: use on_wait, eager or both")
    return (mode,)


def run_verify(
    spec_ref: str,
    topology: str,
    *,
    modes: tuple[str, ...],
    steps: int,
    batch: int,
    rows: int,
    context: int,
    seed: int,
    timeout: float,
    quant: tuple[str, ...] = (),
    knobs: dict[str, Any] | None = None,
    on_step: Callable[[], None] | None = None,
    draft: str | None = None,
) -> list[NumericsReport]:
    return [
        verify_numerics(
            spec_ref,
            topology,
            mode=mode,
            steps=steps,
            batch=batch,
            rows=rows,
            context=context,
            seed=seed,
            timeout=timeout,
            quant=quant,
            knobs=knobs,
            on_step=on_step,
            draft=draft,
        )  # fmt: skip
        for mode in modes
    ]


def verify_lines(report: NumericsReport) -> list[str]:
    """One table for one DMA mode: a row per step, a column per check."""
    seconds = sum(s.seconds for s in report.steps)
    out = [f"DMA mode {report.mode} ({seconds:.1f} s in the kernel):"]
    if report.error:
        return out + [f"  error: {report.error}"]
    residual_head = f"  {'residual diff':>13}  {'tolerance':>9}  {'layer':>5}" if RESIDUALS else ""
    out.append(
        f"  {'step':>4}  {'max logit diff':>14}  {'tolerance':>9}  {'greedy':>7}  "
        f"{'cache diff':>10}  {'tolerance':>9}{residual_head}  {'finite':>6}  {'seconds':>7}  "
        "result"
    )
    for s in report.steps:
        greedy = f"{s.tokens_equal + s.tokens_near_tie}/{s.tokens_total}"
        residual = ""
        if RESIDUALS:
            layer = s.first_diverging_layer
            residual = (
                f"  {s.max_residual_diff:>13.5f}  {s.residual_tolerance:>9.5f}  "
                f"{'-' if layer is None else layer:>5}"
            )
        out.append(
            f"  {s.step:>4}  {s.max_logit_diff:>14.6f}  {s.logit_tolerance:>9.5f}  {greedy:>7}  "
            f"{s.max_cache_diff:>10.5f}  {s.cache_tolerance:>9.5f}{residual}  "
            f"{'yes' if s.finite else 'NO':>6}  {s.seconds:>7.1f}  "
            f"{'ok' if s.passed else 'FAIL'}"
            + (f" ({s.tokens_near_tie} near tie)" if s.tokens_near_tie else "")
        )
        out += [f"        routing: {tie}" for tie in s.route_ties]
        if s.draft_hidden_states:
            out.append(
                f"        the drafter's {s.draft_hidden_states} hidden state(s): max diff "
                f"{s.max_draft_hidden_diff:.5f}"
                + (f"; {s.draft_hidden_mismatch}" if s.draft_hidden_mismatch else "")
            )
        if s.drafts_total:
            out.append(
                f"        the fused drafter: accepted {', '.join(map(str, s.accepted))} row(s) "
                f"(a sequence's each); drafts {s.drafts_equal}/{s.drafts_total} equal"
                + (f", {s.drafts_near_tie} after a near tie" if s.drafts_near_tie else "")
                + f"; its cache max diff {s.max_draft_cache_diff:.5f}"
                + "".join(
                    f"; {what}"
                    for what in (s.accepted_mismatch, s.draft_cache_mismatch, s.drafts_mismatch)
                    if what
                )
            )
    return out


def first_failure(reports: list[NumericsReport]) -> str | None:
    for report in reports:
        failure = report.failure()
        if failure:
            return f"{report.mode}: {failure}"
    return None


def verify_record(
    reports: list[NumericsReport],
    *,
    steps: int,
    batch: int,
    rows: int,
    context: int,
    seed: int,
    quant: tuple[str, ...] = (),
    knobs: dict[str, Any] | None = None,
    draft: str | None = None,
) -> dict[str, Any]:
    return {
        **({"knobs": dict(knobs)} if knobs else {}),
        **({"draft": draft} if draft else {}),
        "steps_requested": steps,
        "batch": batch,
        "rows": rows,
        "context": context,
        "seed": seed,
        "quant": list(quant),
        "runs": [
            {
                "mode": r.mode,
                "passed": r.passed,
                "failure": r.failure(),
                "steps": [asdict(s) for s in r.steps],
            }
            for r in reports
        ],
    }
