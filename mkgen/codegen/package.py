"""A generated build directory: rendered in memory, written atomically, guarded by a manifest.

``mkgen build SPEC --topology T`` writes ``generated/<spec>-<shape>/``::

    megakernel.py         the decode megakernel (templates/megakernel.py.j2)
    runner.py             the build's constants, calling mkgen.runtime (runner.py.j2)
    plan.json             spec, options, kernel layout, sharding, HBM fit, cost estimate
    REPORT.md             the same for people (REPORT.md.j2)
    mini/                 the same four files for the spec's mini twin on the same mesh
    measurements.json     only after `mkgen compile/verify --update-report` (see below)
    .mkgen-manifest.json  sha256 of every file above

Decisions:

- Deterministic: every file is a pure function of the inputs (the spec after quant
  overrides, the topology, the options, the weight-bank plan, the template bytes
  and the mkgen version), hashed into ``inputs_sha256`` in every header. JSON is
  written with sorted keys; nothing records a time or a path.
- Atomic: the files are rendered and checked in a staging directory beside the target
  (``.NAME.XXXXXXXX.tmp``, manifest first), which then replaces the target by rename (the
  old build is moved aside to ``.NAME.<uuid>.old`` first and restored if the rename
  fails); no half-written build is ever left. A build killed midway is recovered by the
  next one: after a kill between the two renames the old build goes back, and leftovers
  holding nothing but what mkgen wrote are removed (builds in one folder take turns
  under an flock of the folder, so none mistakes another's staging for debris).
- Nothing mkgen did not write is ever deleted. A target is replaced only when it is new,
  empty, or a build with a manifest. Edits to the files the manifest lists (changed or
  deleted) are refused without ``force`` and overwritten with it. Anything else (a
  directory without a manifest, files, links or empty folders added to a build) is
  refused even with ``force``, and the message does not suggest it. The one exception is
  Python's bytecode of the build's own modules (``__pycache__/runner.cpython-312.pyc``,
  written when a user runs runner.py): a derivative of mkgen's files, stale once they
  change, it goes with the build it was compiled from.
- Output paths are checked before rendering: the filesystem root, a non-directory, a
  parent that is a file or that root cannot write (probed: /proc, /sys, read-only or
  immutable) give one line. Files and folders get the umask's modes.
- Measurements are separate: compile seconds and interpret-mode results vary run to
  run, so ``mkgen build`` never measures. ``mkgen compile --update-report`` and
  ``mkgen verify --update-report`` store their results in ``measurements.json`` keyed
  by the sha256 of the kernels' code (full and mini, headers left out) and re-render
  REPORT.md with them; a rebuild keeps them while that code is unchanged and drops them
  (stale) otherwise.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import tempfile
import uuid
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
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
from mkgen.codegen.library import expanded_template
from mkgen.codegen.render import formatter_version, render, template_file
from mkgen.errors import MkgenError, SpecError
from mkgen.kinds import macro_files
from mkgen.output import check_parent, resolved_target, umask
from mkgen.plan.layout import KernelLayout
from mkgen.plan.options import BuildOptions
from mkgen.plan.published import bar_text
from mkgen.plan.report import collective_latency_note
from mkgen.spec.schema import ModelSpec
from mkgen.spec.topology import Topology, parse_topology

REPO = Path(__file__).resolve().parents[2]
# A checkout builds into its generated/ (the checked-in builds); an installed package
# (site-packages has no pyproject.toml) into generated/ in the working directory.
GENERATED = REPO / "generated" if (REPO / "pyproject.toml").is_file() else Path("generated")
BUILD_LIST = GENERATED / "BUILDS"  # the checked-in builds, one `mkgen build` line each
MANIFEST = ".mkgen-manifest.json"
MEASUREMENTS = "measurements.json"
MINI_DIR = "mini"
PLAN_FORMAT = 1
# Every template a build renders: the kernel's includes its layer kinds' macros, by the
# names templates import them under (kinds/<kind>.py.j2, mkgen.kinds.macro_files).
TEMPLATE_FILES = ("megakernel.py.j2", "runner.py.j2", "REPORT.md.j2") + tuple(macro_files())
# Measurements are keyed by what compile and verify measure: the kernels' code (full and
# mini, without their headers), so a change to the runner, the report or another kind's
# kernel code leaves them valid.
MEASURED_KEY = "kernel_sha256"
# The mini twin's cache length: verify_numerics' default, one 128-token KV tile, and room
# for a short prompt plus a few decode steps in the mini runner.
MINI_CONTEXT = 128
# Attention types whose cache is a recurrent state (not rows indexed by position): the
# runner keeps the snapshot after each sequence's last accepted row.
RECURRENT = ("gated_deltanet", "kda")
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


# ---------------------------------------------------------------- names and inputs


def build_name(spec_name: str, topology: Topology) -> str:
    """`qwen3-32b-2x2x1` (TPU7x, the default chip) or `qwen3-32b-v6e-2x2` (other chips)."""
    from mkgen.hardware import DEFAULT_CHIP

    if topology.chip == DEFAULT_CHIP:
        return f"{spec_name}-{topology.shape_name}"
    return f"{spec_name}-{topology.chip}-{topology.shape_name}"


def default_build_dir(spec_name: str, topology: Topology) -> Path:
    return GENERATED / build_name(spec_name, topology)


def cli_flags(topology: Topology, options: BuildOptions) -> list[str]:
    """The `mkgen build` flags that reproduce `topology` and `options` (defaults left out)."""
    from mkgen.hardware import DEFAULT_CHIP

    topo = topology.shape_name if topology.chip == DEFAULT_CHIP else topology.name
    flags = ["--topology", topo]
    default = BuildOptions()
    for name in ("batch", "rows", "context", "ring_depth", "expert_slots"):
        if getattr(options, name) != getattr(default, name):
            flags += [f"--{name.replace('_', '-')}", str(getattr(options, name))]
    if options.acceptance != default.acceptance:
        flags += ["--acceptance", f"{options.acceptance:g}"]
    for family, fmt in options.quant:
        flags += ["--quant", f"{family}={fmt}"]
    return flags


def _verify_flags(topology: Topology, options: BuildOptions) -> list[str]:
    """`mkgen verify` flags of a build: its flags without context and acceptance."""
    flags, out = cli_flags(topology, options), []
    for name, value in zip(flags[::2], flags[1::2], strict=True):
        if name not in ("--context", "--acceptance"):
            out += [name, value]
    return out


@dataclass(frozen=True)
class CommandLine:
    """How the commands a build prints name it: the SPEC argument and the -o directory as
    the user typed them, so that they run as printed. The defaults (the spec's name, the
    build in generated/<build>/) are what `mkgen regen` and library callers get.

    The build's files take only the SPEC argument (`for_files`): a build names no output
    directory, so one copied or written elsewhere keeps its bytes and its measurements."""

    spec: str | None = None  # None: the spec's name (a name in model_specs/)
    output: str | None = None  # None: generated/<build>/, no -o needed

    def spec_arg(self, spec_name: str) -> str:
        return self.spec or spec_name

    def output_flags(self) -> list[str]:
        return [] if self.output is None else ["-o", self.output]

    def build_ref(self, name: str) -> str:
        """What `mkgen inspect` takes for the build: its directory, or its name in generated/."""
        return self.output or name

    def for_files(self) -> CommandLine:
        return CommandLine(spec=self.spec)


def rebuild_command(
    spec_name: str, topology: Topology, options: BuildOptions, line: CommandLine = CommandLine()
) -> str:
    return shlex.join(
        ["mkgen", "build", line.spec_arg(spec_name), *cli_flags(topology, options),
         *line.output_flags(), "--force"]
    )  # fmt: skip


def build_commands(
    spec_name: str, topology: Topology, options: BuildOptions, line: CommandLine = CommandLine()
) -> dict[str, str]:
    """The commands that record measurements for a build and outline it, runnable as
    printed: its options included (verify runs the twin, so it takes no context or
    acceptance) and its -o directory when it is not the default one."""
    spec_arg, output = line.spec_arg(spec_name), line.output_flags()
    return {
        "compile": shlex.join(
            ["mkgen", "compile", spec_arg, *cli_flags(topology, options), *output,
             "--update-report"]
        ),
        "verify": shlex.join(
            ["mkgen", "verify", spec_arg, *_verify_flags(topology, options), *output,
             "--update-report"]
        ),
        "inspect": shlex.join(["mkgen", "inspect", line.build_ref(build_name(spec_name, topology))]),
    }  # fmt: skip


def resolved_kernel_args(plan: Any, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`given` kernel arguments with the bank size and ring depth the plan resolved: recorded
    so that a saved build re-renders identically (and converted weights bind to them)."""
    stream = plan.kernel.stream
    return {**(given or {}), "bank_rows": stream.bank_rows, "ring_depth": stream.ring_depth}


def _canonical(data: Any) -> str:
    """Compact JSON that keeps key order: the order of a spec's kinds is meaningful (it
    numbers them in the kernel's layer tables), so it must change the hash."""
    return json.dumps(data, separators=(",", ":"), ensure_ascii=True)


def inputs_digest(
    spec: ModelSpec, topology: Topology, options: BuildOptions, kernel_args: Mapping[str, Any]
) -> str:
    """sha256 of everything a build is rendered from (`spec` with its overrides applied)."""
    # Each template as Jinja reads it: with the kernel library members it includes.
    template_digests = {
        name: hashlib.sha256(
            expanded_template(template_file(name).read_bytes(), name).encode()
        ).hexdigest()
        for name in TEMPLATE_FILES
    }
    data = {
        "mkgen": __version__,
        "spec": spec.model_dump(mode="json"),
        "topology": topology.name,
        "options": options.model_dump(mode="json"),
        "kernel_args": dict(kernel_args),
        "templates": template_digests,
        "ruff": formatter_version(),  # it formats the generated code
    }
    return hashlib.sha256(_canonical(data).encode()).hexdigest()


def sorted_keys(data: Any) -> Any:
    """`data` with every dict's keys sorted (for data whose dict order means nothing)."""
    if isinstance(data, dict):
        return {key: sorted_keys(data[key]) for key in sorted(data)}
    if isinstance(data, list | tuple):
        return [sorted_keys(value) for value in data]
    return data


def dump_json(data: Any, *, sort: bool = True) -> str:
    """Deterministic JSON for files: sorted keys (unless `sort` is off because the caller
    fixed the order), ASCII, one trailing newline."""
    return json.dumps(data, sort_keys=sort, indent=1, ensure_ascii=True) + "\n"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


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
    line: CommandLine = CommandLine(),
) -> RenderedBuild:
    """Every file of a build, in memory. Raises SpecError before anything is rendered
    when the spec or one of its kinds is not supported by the code generator.

    `kernel_args` go to plan_build (bank_rows, ring_depth, ...); the mini twin uses
    mini_kernel_args(). The kernel, the checks, the report and plan.json all come from
    that one plan. `line` is how the printed commands name the build (make_build passes
    CommandLine.for_files: a build's files never name its directory)."""
    from mkgen.kinds import default_registry
    from mkgen.plan import plan_build
    from mkgen.plan.sharding import full_size_splits
    from mkgen.spec.mini import mini_twin

    check_renderable(spec)
    spec = options.apply(spec)
    plan = plan_build(spec, topology, options, **(kernel_args or {}), kinds=default_registry())
    layout = plan.kernel
    kernel_args = resolved_kernel_args(plan, kernel_args)
    bank_rows, depth = kernel_args["bank_rows"], kernel_args["ring_depth"]
    held, per_round = plan.kernel.stream.held_refills, plan.kernel.stream.refills_per_round
    digest = inputs_digest(spec, topology, options, kernel_args)
    name = build_name(spec.name, topology)
    rebuild = parent or rebuild_command(spec.name, topology, options, line)
    header = render_header(
        spec_name=spec.name,
        topology=topology.name,
        version=__version__,
        inputs_sha256=digest,
        description=spec.description,
        options=f"{options.describe()}; weight banks of {bank_rows} rows, ring depth {depth}"
        + (f", {held} refills held for collectives, {per_round} a round" if held else ""),
        rebuild=rebuild,
    )
    # The cost model at every whole acceptance length 1..rows: the step does not depend on
    # the acceptance (every row is verified), so one walk serves them all.
    acceptance = [
        plan.estimate.at_acceptance(float(accepted))
        for accepted in (range(1, options.rows + 1) if options.rows > 1 else ())
    ]
    kernel_source = render_kernel(layout, header)
    check_program_order(kernel_source, layout, plan.schedule.segment_order)
    plan_data = {
        "build": {
            "format": PLAN_FORMAT,
            "name": name,
            "mini": is_mini,
            "mkgen_version": __version__,
            "inputs_sha256": digest,
            "rebuild": rebuild,
            "command_line": {"spec": line.spec},
        },
        "spec": spec.model_dump(mode="json"),
        "topology": topology.name,
        "options": options.model_dump(mode="json"),
        "kernel_args": kernel_args,
        "kernel": layout.model_dump(mode="json"),
        "plan": sorted_keys(plan_json(plan)),
        "estimates_by_acceptance": sorted_keys([e.model_dump(mode="json") for e in acceptance]),
    }
    mini = None
    if with_mini:
        # The twin of the spec as built (overrides applied), with the twin's own formats.
        mini_options = BuildOptions.create(
            batch=options.batch,
            rows=options.rows,
            context=MINI_CONTEXT,
            ring_depth=options.ring_depth,
            expert_slots=options.expert_slots,
            splits=full_size_splits(
                options.apply(spec), topology, options, kinds=default_registry()
            ),
        )
        mini = render_build(
            mini_twin(options.apply(spec), topology.num_devices),
            topology,
            mini_options,
            kernel_args=mini_kernel_args(),
            with_mini=False,
            is_mini=True,
            parent=f"part of `{rebuild}`",
            line=CommandLine(output=f"{line.build_ref(name)}/{MINI_DIR}"),
        )
    kernels = render_kernel(layout, "") + (render_kernel(mini.layout, "") if mini else "")
    kernel_digest = sha256_bytes(kernels.encode())
    valid = {}
    if measurements and measurements.get(MEASURED_KEY) == kernel_digest:
        valid = {k: v for k, v in measurements.items() if k != MEASURED_KEY}
    files = {
        "megakernel.py": kernel_source,
        "runner.py": render(
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
            recurrent_kinds=repr(tuple(a.name for a in layout.attention if a.type in RECURRENT)),
        ),
        # Not key-sorted: "spec" and "kernel" keep their order (kind order numbers the kinds
        # in the kernel, and a saved build must re-render identically); the planner's data
        # is key-sorted above.
        "plan.json": dump_json(plan_data, sort=False),
    }
    if mini:
        files.update({f"{MINI_DIR}/{path}": text for path, text in mini.files.items()})
    files["REPORT.md"] = render_text(
        "REPORT.md.j2",
        **report_context(
            spec=spec,
            topology=topology,
            options=options,
            layout=layout,
            plan=plan,
            acceptance=acceptance,
            header=header,
            name=name,
            digest=digest,
            measurements=valid,
            mini=mini,
            is_mini=is_mini,
            rebuild=rebuild,
            line=line,
        ),
    )
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


# ---------------------------------------------------------------- the report's data


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
    mini: RenderedBuild | None,
    is_mini: bool,
    rebuild: str,
    line: CommandLine,
) -> dict[str, Any]:
    """Everything REPORT.md.j2 places, already formatted (the template decides nothing)."""
    from mkgen.spec.figures import params_active, params_total

    est, mem, sharding = plan.estimate, plan.memory, plan.sharding
    quant = sharding.quantization
    tensor_rows = []
    for title, tensors in [("global", sharding.globals), ("every layer", sharding.layer_vectors)]:
        tensor_rows += [(title, t) for t in tensors]
    for kind, s in sharding.attention.items():
        tensor_rows += [(f"attention {kind} ({s.type})", t) for t in s.tensors]
    for kind, s in sharding.ffn.items():
        tensor_rows += [(f"ffn {kind} ({s.type})", t) for t in s.tensors]
    tensors = [
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
    # Split or replicated, as the planner scored it: low-rank A-projections and routers.
    choices = [
        {"where": f"attention {k}", "what": "low-rank A-projections", "choice": a.latent,
         "why": a.why}
        for k, a in sharding.attention.items()
        if a.latent != "none"
    ] + [
        {"where": f"ffn {k}", "what": "router", "choice": f.router,
         "why": next(t.why for t in f.tensors if t.name == "ffn.router")}
        for k, f in sharding.ffn.items()
        if f.router != "none"
    ]  # fmt: skip
    hbm = []
    for title, table in (
        ("weights", mem.weights_by_family),
        ("caches", mem.cache_by_kind),
        ("workspace", mem.workspace_by_use),
    ):
        for key, value in sorted(table.items(), key=lambda kv: (-kv[1], kv[0])):
            if value:
                hbm.append({"use": f"{title}: {key}", "bytes": _gb(value)})
    stream = layout.stream
    stream_rows = []
    for section, kinds, members in (
        ("attention", stream.attention, layout.attention),
        ("ffn", stream.ffn, layout.ffn),
    ):
        for k in members:
            ks = kinds[k.name]
            for seg in ks.segments:
                stream_rows.append(
                    {
                        "where": f"{section} {k.name} (x{len(k.layers)} layers)",
                        "segment": seg.name,
                        "shape": f"{seg.fan_in} x {seg.fan_out}",
                        "rows": seg.rows,
                        "bytes": _mib(seg.bytes),
                    }
                )
    for seg in stream.tail:
        stream_rows.append(
            {
                "where": "lm_head (once)",
                "segment": seg.name,
                "shape": f"{seg.fan_in} x {seg.fan_out}",
                "rows": seg.rows,
                "bytes": _mib(seg.bytes),
            }
        )
    by_acceptance = [
        {
            "acceptance": f"{e.acceptance:g}",
            "step_ms": f"{e.step_ms:.3f}",
            "per_user": f"{e.tokens_per_s_per_user:,.1f}",
            "aggregate": f"{e.tokens_per_s:,.1f}",
        }
        for e in acceptance
    ]
    kinds = [
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
        "kinds": kinds,
        "tensors": tensors,
        "split_choices": choices,
        "collectives": collectives,
        "collective_rounds": plan.vmem.dims.collectives.describe(),
        "hbm": hbm,
        "hbm_total": _gb(mem.total_bytes),
        "hbm_usable": _gb(mem.usable_bytes),
        "hbm_headroom": _gb(mem.usable_bytes - mem.total_bytes),
        "vmem_plan": _vmem_plan(plan),
        "ring_bytes": _mib(stream.ring_depth * stream.bank_bytes),
        "stream": stream,
        "bank_bytes": _mib(stream.bank_bytes),
        "stream_bytes": _mib(stream.bytes_per_step),
        "stream_padding": _mib(stream.padding_bytes),
        "stream_rows": stream_rows,
        "estimate": est,
        "confidence": _confidence(plan.confidence),
        "profile_bound": _profile_bound(measurements.get("profile"), est),
        "bar": bar_text(est.step_ms, plan.ideal_floor, plan.hand_written),
        "collective_latency": collective_latency_note(topology.chip_info),
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
        "by_acceptance": by_acceptance,
        "measured_compile": measurements.get("compile"),
        "measured_profile": measurements.get("profile"),
        "measured_verify": measurements.get("verify"),
        "verify_runs": _verify_rows(measurements.get("verify")),
        "mini": mini,
        "mini_name": mini.layout.model if mini else None,
        "devices": topology.num_devices,
    }


def _confidence(confidence: Any) -> dict[str, Any] | None:
    """The calibrated regime, the uncalibrated parts and the sensitivity table, formatted
    (mkgen/plan/confidence.py)."""
    if confidence is None:
        return None
    return {
        "step_ms": f"{confidence.step_ms:.3f}",
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
                "seconds": f"{sum(s['seconds'] for s in steps):.1f}",
            }
        )
    return rows


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


# ---------------------------------------------------------------- writing

# What a user whose directory mkgen may not replace can do instead.
_NEW_DIRECTORY = "give -o a new or empty directory, or a build mkgen wrote"
_FORCE = "pass --force to overwrite the build"
# Python's bytecode of a module, e.g. __pycache__/runner.cpython-312.pyc (or .opt-1.pyc).
_BYTECODE = re.compile(r"(?P<module>[^.]+)\.[^/]+\.pyc")


@dataclass(frozen=True)
class _Difference:
    """How a directory differs from the build mkgen wrote there."""

    reason: str
    remedy: str | None  # None: only files mkgen wrote differ, which --force may overwrite


def _read_manifest(directory: Path) -> dict[str, str]:
    """The manifest's {relative path: sha256}; ValueError when it is damaged."""
    try:
        files = json.loads((directory / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"unreadable: {error}") from None
    if not isinstance(files, dict) or not all(
        isinstance(rel, str)
        and isinstance(digest, str)
        and rel == PurePosixPath(rel).as_posix()
        and not PurePosixPath(rel).is_absolute()
        and ".." not in PurePosixPath(rel).parts
        for rel, digest in files.items()
    ):
        raise ValueError("not a map of relative paths to digests")
    return files


def _own_bytecode(cache: Path, folder: str, listed: set[str]) -> bool:
    """Whether the __pycache__ `cache` holds nothing but Python's bytecode of listed modules:
    Python writes it when a user runs runner.py, and it is only a derivative of mkgen's files
    (stale once they change), so it goes with the build it was compiled from."""
    prefix = f"{folder}/" if folder else ""
    with os.scandir(cache) as scan:
        return all(
            entry.is_file(follow_symlinks=False)
            and (match := _BYTECODE.fullmatch(entry.name)) is not None
            and f"{prefix}{match['module']}.py" in listed
            for entry in scan
        )


def _foreign(directory: Path, files: Collection[str]) -> Iterator[Path]:
    """Everything in `directory` mkgen did not write: anything but the listed files, the
    folders holding them, the manifest and the bytecode of listed modules. Links are never
    followed: a link (to a file or a directory) is itself something mkgen did not write."""
    listed = {*files, MANIFEST}
    folders = {parent.as_posix() for rel in files for parent in PurePosixPath(rel).parents}
    pending = [""]
    while pending:
        folder = pending.pop()
        with os.scandir(directory / folder) as scan:
            entries = sorted(scan, key=lambda entry: entry.name)
        for entry in entries:
            rel = f"{folder}/{entry.name}" if folder else entry.name
            if entry.is_dir(follow_symlinks=False) and rel in folders:
                pending.append(rel)
            elif not (
                (entry.is_file(follow_symlinks=False) and rel in listed)
                or (
                    entry.name == "__pycache__"
                    and entry.is_dir(follow_symlinks=False)
                    and _own_bytecode(Path(entry.path), folder, listed)
                )
            ):
                yield directory / rel


def _difference(directory: Path) -> _Difference | None:
    """How `directory` differs from the build mkgen wrote there (None: it is that build, or
    it does not exist or is empty)."""
    if not os.path.lexists(directory):
        return None
    if not directory.is_dir():
        return _Difference(f"{directory} is not a directory", _NEW_DIRECTORY)
    if not (directory / MANIFEST).is_file():
        with os.scandir(directory) as scan:
            if next(scan, None) is None:
                return None
        return _Difference(
            f"{directory} holds files mkgen did not write (no {MANIFEST})", _NEW_DIRECTORY
        )
    try:
        files = _read_manifest(directory)
    except ValueError:
        return _Difference(
            f"{directory / MANIFEST} is damaged, so mkgen cannot tell its files from others",
            _NEW_DIRECTORY,
        )
    for path in _foreign(directory, files):
        return _Difference(
            f"{path} was added since mkgen wrote the build",
            f"mkgen does not delete what it did not write: move it out of {directory}",
        )
    for rel, digest in sorted(files.items()):
        path = directory / rel
        if not path.exists():
            return _Difference(f"{path} was deleted since mkgen wrote it", None)
        if sha256_bytes(path.read_bytes()) != digest:
            return _Difference(f"{path} was edited since mkgen wrote it", None)
    return None


def local_edits(directory: Path) -> str | None:
    """Why `directory` is not exactly the build mkgen wrote there, or None if it is."""
    found = _difference(directory)
    return found.reason if found else None


def read_measurements(directory: Path) -> dict[str, Any] | None:
    """measurements.json of an unedited build (None if absent or edited)."""
    path = directory / MEASUREMENTS
    if not path.exists() or local_edits(directory) is not None:
        return None
    return json.loads(path.read_text())


def _refuse(directory: Path, force: bool, fix_edits: str) -> _Difference | None:
    """MkgenError unless `directory` is new, empty, the build mkgen wrote there, or (with
    `force`) that build with files mkgen wrote edited or deleted, which is returned.
    --force is suggested only for those: it never replaces what mkgen did not write."""
    found = _difference(directory)
    if found is not None and (found.remedy is not None or not force):
        raise MkgenError(f"{found.reason}; {found.remedy or fix_edits}")
    return found


def _check_target(target: Path, force: bool) -> Path:
    """`target` absolute with links resolved, once a build may be written there: checked
    before any rendering, and before any scan (`-o /` would walk the whole filesystem)."""
    resolved = resolved_target(target, _NEW_DIRECTORY)
    try:
        _refuse(resolved, force, _FORCE)
    except OSError as error:
        raise MkgenError(f"cannot read {target}: {error.strerror or error}") from None
    check_parent(resolved)
    return resolved


@contextmanager
def _lock(folder: Path) -> Iterator[None]:
    """Builds beside each other take turns, so that none takes another's staging
    directory for the debris of a killed build. flock on the folder itself: the kernel
    releases it when a build is killed, and it leaves no file behind."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _recover(target: Path) -> None:
    """Clean up after a build of `target` that was killed: staging directories
    (`.NAME.XXXXXXXX.tmp`) and previous builds moved aside for the swap (`.NAME.<uuid>.old`).

    A kill between the swap's two renames leaves no build at `target`: the old one goes
    back (the state before that command; a partly written new one proves nothing). The
    rest is removed when it holds nothing but what mkgen wrote (its manifest, the files
    it lists, whole or partly written); anything else there is left alone."""
    debris_name = re.compile(
        rf"\.{re.escape(target.name)}\.(?:[a-z0-9_]{{8}}\.tmp|[0-9a-f]{{32}}\.old)"
    )
    with os.scandir(target.parent) as scan:
        debris = sorted(
            Path(entry.path)
            for entry in scan
            if debris_name.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)
        )
    moved_aside = [path for path in debris if path.suffix == ".old" and (path / MANIFEST).is_file()]
    if moved_aside and not os.path.lexists(target):
        newest = max(moved_aside, key=lambda path: (path / MANIFEST).stat().st_mtime_ns)
        os.rename(newest, target)
        debris.remove(newest)
    for path in debris:
        try:
            files = _read_manifest(path) if (path / MANIFEST).is_file() else {}
        except ValueError:
            files = {}  # a manifest cut short by the kill: nothing else was written yet
        if next(_foreign(path, files), None) is None:
            _remove_written(path)


def _remove_written(directory: Path) -> None:
    """Remove a directory mkgen wrote, its manifest last, so that a kill midway leaves a
    directory still recognisable as mkgen's (and removed by the next build)."""
    with os.scandir(directory) as scan:
        for entry in scan:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            elif entry.name != MANIFEST:
                os.unlink(entry.path)
    (directory / MANIFEST).unlink(missing_ok=True)
    directory.rmdir()


def _write_tree(root: Path, files: Mapping[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8", newline="\n") as handle:
            handle.write(text)


def _swap_in(target: Path, tree: Mapping[str, str], digests: Mapping[str, str]) -> None:
    """Write `tree` to a staging directory beside `target`, check it, then rename it to
    `target`; an existing `target` is moved aside first and removed last."""
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        os.chmod(staging, 0o777 & ~umask())  # mkdtemp makes it 0700
        _write_tree(staging, tree)
        for rel, digest in digests.items():  # read back before anything is replaced
            if sha256_bytes((staging / rel).read_bytes()) != digest:
                raise MkgenError(f"{rel}: written bytes differ from the rendered text")
            if rel.endswith(".py"):
                compile(tree[rel], rel, "exec")
        if os.path.lexists(target):
            old = target.parent / f".{target.name}.{uuid.uuid4().hex}.old"
            os.rename(target, old)
            try:
                os.rename(staging, target)
            except BaseException:
                os.rename(old, target)
                raise
            with suppress(OSError):  # the new build is in place; the next build retries
                _remove_written(old)
        else:
            os.rename(staging, target)
    except BaseException:
        with suppress(OSError):
            _remove_written(staging)
        raise


def write_build(files: Mapping[str, str], target: Path, *, force: bool) -> bool:
    """Write `files` (relative path -> text) as the build directory `target`, atomically.

    Returns False when the directory already holds exactly these files (nothing is
    written). Raises MkgenError, with nothing changed, when `target` is not a place for
    a build (see _check_target), holds anything mkgen did not write, or has local edits
    to mkgen's files and `force` is not set. Debris of a killed build is cleaned up first."""
    target = _check_target(target, force)
    manifest = {
        "files": {rel: sha256_bytes(text.encode()) for rel, text in sorted(files.items())},
        "generator": f"mkgen {__version__}",
    }
    manifest_text = dump_json(manifest)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with _lock(target.parent):
            _recover(target)
            # Again: a recovered build, or edits made while we rendered.
            edits = _refuse(target, force, _FORCE)
            current = target / MANIFEST
            if edits is None and current.is_file() and current.read_text() == manifest_text:
                return False
            # The manifest first: a staging directory cut short by a kill is recognisable.
            _swap_in(target, {MANIFEST: manifest_text, **files}, manifest["files"])
    except OSError as error:
        raise MkgenError(f"cannot write the build {target}: {error.strerror or error}") from None
    return True


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
    line: CommandLine = CommandLine(),
) -> BuildResult:
    """Render and write one build (default directory: generated/<spec>-<shape>/).

    Measurements already in an unedited target directory are kept while its inputs
    are unchanged."""
    target = output or default_build_dir(spec.name, topology)
    _check_target(target, force)  # fail before any rendering work
    if measurements is None:
        measurements = read_measurements(target)
    recorded = _recorded_measurements(target)
    rendered = render_build(
        spec, topology, options, measurements=measurements, line=line.for_files()
    )
    written = write_build(rendered.files, target, force=force)
    dropped = () if MEASUREMENTS in rendered.files else recorded
    return BuildResult(directory=target, rendered=rendered, written=written, dropped=dropped)


def _recorded_measurements(directory: Path) -> tuple[str, ...]:
    """The measurements (compile, profile, verify) a build directory records, edited or not."""
    try:
        data = json.loads((directory / MEASUREMENTS).read_text())
    except (OSError, ValueError):
        return ()
    return tuple(sorted(k for k in data if k != MEASURED_KEY)) if isinstance(data, dict) else ()


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
    _refuse(directory, False, "rebuild with --force first")
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
    measurements = read_measurements(directory) or {}
    if measurements.get(MEASURED_KEY) != kernel_digest:
        measurements = {}
    measurements = {**measurements, MEASURED_KEY: kernel_digest, key: dict(result)}
    rendered = render_build(
        spec, topology, options, kernel_args=data["kernel_args"], measurements=measurements,
        line=line,
    )  # fmt: skip
    write_build(rendered.files, directory, force=True)
    return directory


# ---------------------------------------------------------------- the checked-in builds


@dataclass(frozen=True)
class BuildEntry:
    """One line of generated/BUILDS: the arguments of `mkgen build`."""

    line: str
    spec: str
    topology: str
    options: dict[str, Any]


def _entry_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="generated/BUILDS", add_help=False, exit_on_error=False)
    parser.add_argument("spec")
    parser.add_argument("--topology", required=True)
    for flag in ("--batch", "--rows", "--context", "--ring-depth", "--expert-slots"):
        parser.add_argument(flag, type=int)
    parser.add_argument("--acceptance", type=float)
    parser.add_argument("--quant", action="append")
    return parser


def read_build_list(path: Path = BUILD_LIST) -> list[BuildEntry]:
    """The checked-in builds: `SPEC --topology T [options]` per line, # comments."""
    entries = []
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            args = _entry_parser().parse_args(shlex.split(line))
        except (argparse.ArgumentError, SystemExit) as error:
            raise MkgenError(f"{path}:{number}: {line!r}: {error}") from None
        options = {k: v for k, v in vars(args).items() if k not in ("spec", "topology")}
        entries.append(
            BuildEntry(
                line=line,
                spec=args.spec,
                topology=args.topology,
                options={k: v for k, v in options.items() if v is not None},
            )
        )
    return entries


def entry_inputs(entry: BuildEntry) -> tuple[ModelSpec, Topology, BuildOptions]:
    from mkgen.spec.loader import load_spec

    return (
        load_spec(entry.spec),
        parse_topology(entry.topology),
        BuildOptions.create(**entry.options),
    )
