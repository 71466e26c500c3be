"""A generated build: every file rendered in memory from one plan, then written.

``mkgen build SPEC --topology T`` writes ``generated/<spec>-<shape>/``::

    megakernel.py         the decode megakernel (templates/megakernel.py.j2)
    runner.py             the build's constants, calling mkgen.runtime (runner.py.j2)
    plan.json             spec, options, kernel layout, sharding, HBM fit, cost estimate
    REPORT.md             the same for people (REPORT.md.j2, mkgen/codegen/report.py)
    mini/                 the same four files for the spec's mini twin on the same mesh
    measurements.json     only after `mkgen compile/verify --update-report`
    .mkgen-manifest.json  sha256 of every file above

Deterministic: every file is a pure function of the inputs, hashed into
``inputs_sha256`` in every header (mkgen/codegen/digest.py); JSON is written with sorted
keys; nothing records a time or a path. The names and printed commands are in
naming.py, the atomic writer and its manifest in writer.py, the recorded measurements in
measurements.py and the checked-in builds' list in build_list.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mkgen import __version__
from mkgen.codegen.build import (
    identifier,
    render_header,
    render_kernel,
    render_text,
    safe_text,
)
from mkgen.codegen.conformance import check_program_order
from mkgen.codegen.digest import dump_json, inputs_digest, sha256_bytes, sorted_keys
from mkgen.codegen.measurements import (
    MEASURED_KEY,
    MEASUREMENTS,
    measurements_of,
    read_measurements,
    recorded_measurements,
)
from mkgen.codegen.naming import (
    DEFAULT_LINE,
    CommandLine,
    build_name,
    default_build_dir,
    rebuild_command,
)
from mkgen.codegen.render import render
from mkgen.codegen.report import report_context
from mkgen.codegen.writer import check_target, refuse, write_build
from mkgen.errors import MkgenError, SpecError
from mkgen.plan.layout import KernelLayout
from mkgen.plan.options import BuildOptions
from mkgen.spec.schema import ModelSpec
from mkgen.spec.topology import Topology, parse_topology

MINI_DIR = "mini"
PLAN_FORMAT = 1
# The mini twin's cache length: verify_numerics' default, one 128-token KV tile, and room
# for a short prompt plus a few decode steps in the mini runner.
MINI_CONTEXT = 128
_MODEL_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")


# Mini twins use small banks (CHUNK rows: a chunk spans at most two) and a shallow ring so
# that a few layers already wrap the ring several times and chunks straddle banks.
MINI_BANK_ROWS = 256
MINI_RING_DEPTH = 4
MINI_PIECE_CHUNKS = 1  # expert slices in several pieces, the slots wrapping within a layer


def mini_kernel_args() -> dict[str, int]:
    """plan_build's kernel arguments for a mini twin: the small banks, shallow ring and small
    expert pieces `mkgen verify` renders with too (mkgen/verify/numerics.py), so that
    mini/megakernel.py is the kernel verify proves (verify's copy may also return the
    residual stream after every layer, for its per-layer check). --ring-depth and
    --held-refills, when given, win over the shallow ring and its hold."""
    return {
        "bank_rows": MINI_BANK_ROWS,
        "ring_depth": MINI_RING_DEPTH,
        "max_piece_chunks": MINI_PIECE_CHUNKS,
        # As many held refills as the shallow ring allows, fewer started per collective
        # round than held, so the twin proves the hold and its partial releases.
        "held_refills": MINI_RING_DEPTH - 2,
        "refills_per_round": 1,
    }


def resolved_kernel_args(plan: Any, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`given` kernel arguments with the bank size and ring depth the plan resolved: recorded
    so that a saved build re-renders identically (and converted weights bind to them)."""
    stream = plan.kernel.stream
    return {**(given or {}), "bank_rows": stream.bank_rows, "ring_depth": stream.ring_depth}


# ---------------------------------------------------------------- checks before rendering


def check_renderable(spec: ModelSpec) -> None:
    """Spec strings that become code are plain names (the schema checks them too)."""
    if not _MODEL_NAME.fullmatch(spec.name):
        raise SpecError(f"name {spec.name!r}: must match {_MODEL_NAME.pattern}")
    for section in (spec.attention_kinds, spec.ffn_kinds):
        for name in section:
            try:
                identifier(name)
            except MkgenError as error:
                raise SpecError(f"kind name {name!r}: {error}") from None


# ---------------------------------------------------------------- rendering


@dataclass(frozen=True)
class RenderedBuild:
    """The files of one build, by path relative to the build directory."""

    name: str
    inputs_sha256: str
    kernel_sha256: str  # the code measurements are of (MEASURED_KEY)
    files: dict[str, str]
    layout: KernelLayout
    plan: Any  # mkgen.plan.BuildPlan

    def step_ms(self) -> float:
        return float(self.plan.estimate.step_ms)


def plan_json(plan: Any) -> Any:
    """The BuildPlan as JSON data (its own to_dict when it has one)."""
    to_dict = getattr(plan, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    return plan.model_dump(mode="json")


def render_build(
    spec: ModelSpec,
    topology: Topology,
    options: BuildOptions,
    *,
    kernel_args: Mapping[str, Any] | None = None,
    measurements: Mapping[str, Any] | None = None,
    with_mini: bool = True,
    is_mini: bool = False,
    parent: str | None = None,
    line: CommandLine = DEFAULT_LINE,
) -> RenderedBuild:
    """Every file of a build, in memory. Raises SpecError before anything is rendered
    when the spec or one of its kinds is not supported by the code generator.

    `kernel_args` go to plan_build (bank_rows, ring_depth, ...); the mini twin uses
    mini_kernel_args(). The kernel, the checks, the report and plan.json all come from
    that one plan. `line` is how the printed commands name the build (make_build passes
    CommandLine.for_files: a build's files never name its directory)."""
    from mkgen.kinds import default_registry
    from mkgen.plan import plan_build

    check_renderable(spec)
    spec = options.apply(spec)
    plan = plan_build(
        spec, topology, options, **(kernel_args or {}), kinds=default_registry(),
        price_drafter=spec.draft is not None,
    )  # fmt: skip
    layout = plan.kernel
    kernel_args = resolved_kernel_args(plan, kernel_args)
    digest = inputs_digest(spec, topology, options, kernel_args)
    name = build_name(spec.name, topology)
    rebuild = parent or rebuild_command(spec.name, topology, options, line)
    header = _header(spec, topology, options, plan, digest, rebuild)
    acceptance = _estimates_by_acceptance(plan, options)
    kernel_source = render_kernel(layout, header)
    check_program_order(kernel_source, layout, plan.schedule.segment_order)
    identity = {"name": name, "digest": digest, "rebuild": rebuild, "is_mini": is_mini}
    mini = (
        _render_mini(spec, topology, options, rebuild, line.build_ref(name)) if with_mini else None
    )
    kernels = render_kernel(layout, "") + (render_kernel(mini.layout, "") if mini else "")
    kernel_digest = sha256_bytes(kernels.encode())
    valid = measurements_of(measurements, kernel_digest)
    files = {
        "megakernel.py": kernel_source,
        "runner.py": _render_runner(spec, topology, options, layout, header, name),
        # Not key-sorted: "spec" and "kernel" keep their order (kind order numbers the kinds
        # in the kernel, and a saved build must re-render identically); the planner's data
        # is key-sorted in _plan_data.
        "plan.json": dump_json(
            _plan_data(spec, topology, options, plan, kernel_args, acceptance, line, **identity),
            sort=False,
        ),
    }
    if mini:
        files.update({f"{MINI_DIR}/{path}": text for path, text in mini.files.items()})
    files["REPORT.md"] = render_text(
        "REPORT.md.j2",
        **report_context(
            spec=spec, topology=topology, options=options, layout=layout, plan=plan,
            acceptance=acceptance, header=header, measurements=valid,
            mini_name=mini.layout.model if mini else None, line=line, **identity,
        ),
    )  # fmt: skip
    if valid:
        files[MEASUREMENTS] = dump_json({MEASURED_KEY: kernel_digest, **valid})
    return RenderedBuild(
        name=name,
        inputs_sha256=digest,
        kernel_sha256=kernel_digest,
        files=files,
        layout=layout,
        plan=plan,
    )


def _header(
    spec: ModelSpec, topology: Topology, options: BuildOptions, plan: Any, digest: str, rebuild: str
) -> str:
    """The lines every file of the build starts with: what made it and how to make it again."""
    stream = plan.kernel.stream
    held, per_round = stream.held_refills, stream.refills_per_round
    return render_header(
        spec_name=spec.name,
        topology=topology.name,
        version=__version__,
        inputs_sha256=digest,
        description=spec.description,
        options=f"{options.describe()}; weight banks of {stream.bank_rows} rows, ring depth "
        f"{stream.ring_depth}"
        + (f", {held} refills held for collectives, {per_round} a round" if held else "")
        + (f"; drafter {plan.draft.drafter}" if plan.draft else ""),
        rebuild=rebuild,
    )


def _estimates_by_acceptance(plan: Any, options: BuildOptions) -> list[Any]:
    """The cost model at every whole acceptance length 1..rows: the step does not depend on
    the acceptance (every row is verified), so one walk serves them all."""
    return [
        plan.estimate.at_acceptance(float(accepted))
        for accepted in (range(1, options.rows + 1) if options.rows > 1 else ())
    ]


def _render_mini(
    spec: ModelSpec, topology: Topology, options: BuildOptions, rebuild: str, build_ref: str
) -> RenderedBuild:
    """The build's mini twin: the twin of the spec as built (overrides applied), with the
    twin's own formats, on the same mesh and with the full size's expert splits."""
    from mkgen.kinds import default_registry
    from mkgen.plan import full_size_kernel_modes
    from mkgen.plan.sharding import full_size_splits
    from mkgen.spec.mini import mini_twin

    built = options.apply(spec)
    modes = {
        k: getattr(options, k) for k in ("residual_snapshots", "recurrent_states", "expert_sharing")
    }
    modes |= full_size_kernel_modes(built, topology, options, kinds=default_registry())
    mini_options = BuildOptions.create(
        batch=options.batch,
        rows=options.rows,
        context=MINI_CONTEXT,
        ring_depth=options.ring_depth,
        expert_slots=options.expert_slots,
        splits=full_size_splits(built, topology, options, kinds=default_registry()),
        fuse_draft=options.fuse_draft,
        **modes,
    )
    return render_build(
        mini_twin(options.apply(spec), topology.num_devices),
        topology,
        mini_options,
        kernel_args=mini_kernel_args(),
        with_mini=False,
        is_mini=True,
        parent=f"part of `{rebuild}`",
        line=CommandLine(output=f"{build_ref}/{MINI_DIR}"),
    )


def _render_runner(
    spec: ModelSpec,
    topology: Topology,
    options: BuildOptions,
    layout: KernelLayout,
    header: str,
    name: str,
) -> str:
    """runner.py: the build's constants, calling mkgen.runtime."""
    return render(
        "runner.py.j2",
        header=header,
        build_name=safe_text(name),
        spec_name=safe_text(spec.name),
        topology=safe_text(topology.name),
        devices=topology.num_devices,
        batch=options.batch,
        rows=options.rows,
        context=options.context,
        vocab_used=layout.vocab_used,
        default_steps=min(8, options.context // 4),
        # Kinds whose cache is a recurrent state: the runner keeps the snapshot after each
        # sequence's last accepted row (RecurrentLayout.recurrent).
        recurrent_kinds=repr(tuple(a.name for a in layout.attention if a.recurrent)),
        drafter=safe_text(spec.draft.kind) if spec.draft else None,
        fused_draft=options.fuse_draft,
    )


def _plan_data(
    spec: ModelSpec,
    topology: Topology,
    options: BuildOptions,
    plan: Any,
    kernel_args: dict[str, Any],
    acceptance: list[Any],
    line: CommandLine,
    *,
    name: str,
    digest: str,
    rebuild: str,
    is_mini: bool,
) -> dict[str, Any]:
    """plan.json's data (the planner's own data key-sorted, the spec and kernel in order)."""
    return {
        "build": {
            "format": PLAN_FORMAT,
            "name": name,
            "mini": is_mini,
            "mkgen_version": __version__,
            "inputs_sha256": digest,
            "rebuild": rebuild,
            # The --draft is kept only where there is one: a build without a drafter
            # keeps its bytes.
            "command_line": {"spec": line.spec, **({"draft": line.draft} if line.draft else {})},
        },
        "spec": spec.model_dump(mode="json"),
        "topology": topology.name,
        "options": options.model_dump(mode="json"),
        "kernel_args": kernel_args,
        "kernel": plan.kernel.model_dump(mode="json"),
        "plan": sorted_keys(plan_json(plan)),
        "estimates_by_acceptance": sorted_keys([e.model_dump(mode="json") for e in acceptance]),
    }


# ---------------------------------------------------------------- one build, end to end


@dataclass(frozen=True)
class BuildResult:
    directory: Path
    rendered: RenderedBuild
    written: bool  # False: the directory already held exactly these files
    # Measurements the directory recorded that the new build does not keep (its kernel
    # code changed, or the build was edited): `mkgen build` and `mkgen regen` say so.
    dropped: tuple[str, ...] = ()


def make_build(
    spec: ModelSpec,
    topology: Topology,
    options: BuildOptions,
    *,
    output: Path | None = None,
    force: bool = False,
    measurements: Mapping[str, Any] | None = None,
    line: CommandLine = DEFAULT_LINE,
) -> BuildResult:
    """Render and write one build (default directory: generated/<spec>-<shape>/).

    Measurements already in an unedited target directory are kept while its inputs
    are unchanged."""
    target = output or default_build_dir(spec.name, topology)
    check_target(target, force)  # fail before any rendering work
    if measurements is None:
        measurements = read_measurements(target)
    recorded = recorded_measurements(target)
    rendered = render_build(
        spec, topology, options, measurements=measurements, line=line.for_files()
    )
    written = write_build(rendered.files, target, force=force)
    dropped = () if MEASUREMENTS in rendered.files else recorded
    return BuildResult(directory=target, rendered=rendered, written=written, dropped=dropped)


def load_build_inputs(directory: Path) -> tuple[ModelSpec, Topology, BuildOptions, dict]:
    """The spec, topology and options a build was made from (from its plan.json)."""
    path = directory / "plan.json"
    if not path.exists():
        raise MkgenError(f"{directory} is not a mkgen build (no plan.json)")
    try:
        data = json.loads(path.read_text())
    except ValueError as error:
        raise MkgenError(f"{path}: damaged ({error}); build again") from None
    if not isinstance(data, dict) or not isinstance(data.get("build"), dict):
        raise MkgenError(f"{path}: not a mkgen plan.json (no build object); build again")
    if data.get("build", {}).get("format") != PLAN_FORMAT:
        raise MkgenError(f"{path}: plan format {data.get('build', {}).get('format')!r} unknown")
    spec = ModelSpec.model_validate(data["spec"])
    options = BuildOptions.create(**data["options"])
    return spec, parse_topology(data["topology"]), options, data


def record_measurement(directory: Path, key: str, result: Mapping[str, Any]) -> Path:
    """Store one measurement (`compile`, `profile` or `verify`) in a build and re-render
    its REPORT.md.

    The build must be unedited and current (its inputs hash equal to what mkgen renders
    from the same inputs today)."""
    directory = Path(directory)
    refuse(directory, False, "rebuild with --force first")
    spec, topology, options, data = load_build_inputs(directory)
    digest = inputs_digest(spec, topology, options, data["kernel_args"])
    if digest != data["build"]["inputs_sha256"]:
        raise MkgenError(
            f"{directory} was built from other templates or another mkgen; "
            f"run `{data['build']['rebuild']}` first"
        )
    line = CommandLine(**data["build"].get("command_line", {})).for_files()
    kernel_digest = render_build(
        spec, topology, options, kernel_args=data["kernel_args"], line=line
    ).kernel_sha256
    measurements = {
        **measurements_of(read_measurements(directory), kernel_digest),
        MEASURED_KEY: kernel_digest,
        key: dict(result),
    }
    rendered = render_build(
        spec, topology, options, kernel_args=data["kernel_args"], measurements=measurements,
        line=line,
    )  # fmt: skip
    write_build(rendered.files, directory, force=True)
    return directory
