"""Commands that check a build: `verify` (the mini twin against the reference, in TPU
interpret mode) and `compile` (the full-size kernel for TPU7x)."""

from __future__ import annotations

import json
import math
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import click

from mkgen.cli.options import (
    SEED,
    batch_option,
    draft_option,
    drafting_spec,
    json_option,
    kernel_options,
    knob_options,
    plan_inputs,
    prepare_jax,
    progress,
    quant_option,
    rows_option,
    shown,
    spec_argument,
    topology_option,
    update_report_options,
)
from mkgen.errors import MkgenError


def _build_dir_for(spec: Any, topo: Any, options: Any, output: Path | None) -> Path:
    """The build directory a --update-report writes to; it must hold this very build."""
    from mkgen.codegen.naming import default_build_dir
    from mkgen.codegen.package import load_build_inputs

    directory = output or default_build_dir(spec.name, topo)
    built_spec, built_topo, built_options, data = load_build_inputs(directory)
    if (
        built_spec.model_dump(mode="json") != options.apply(spec).model_dump(mode="json")
        or built_topo.name != topo.name
        or built_options != options
    ):
        raise MkgenError(
            f"{shown(directory)} was built from other inputs ({data['build']['rebuild']}); "
            "pass the same options or rebuild it"
        )
    return directory


@click.command("verify", short_help="Check a spec's mini twin against the reference model.")
@spec_argument()
@topology_option("2x2x1")
@click.option("--steps", type=int, default=2, show_default=True, help="Decode steps per mode.")
@batch_option("Sequences per step.")
@rows_option
@click.option("--context", type=int, default=128, show_default=True, help="Mini cache tokens.")
@click.option(
    "--seed", type=SEED, default=0, show_default=True, help="Seed of the random weights and tokens."
)
@quant_option("The build's weight format overrides (the twin keeps its own block sizes).")
@click.option(
    "--mode",
    type=click.Choice(["on_wait", "eager", "both"]),
    default="both",
    show_default=True,
    help="DMA execution mode of TPU interpret mode.",
)
@click.option(
    "--timeout",
    type=float,
    default=900.0,
    show_default=True,
    help="Seconds per mode (a slow twin's limit; a hang stops by itself as stalled).",
)
@draft_option
@update_report_options
@knob_options
def verify_command(
    spec_ref: str,
    topology: str,
    steps: int,
    batch: int,
    rows: int,
    context: int,
    seed: int,
    quant: tuple[str, ...],
    mode: str,
    timeout: float,
    update_report: bool,
    output: Path | None,
    ring_depth: int | None,
    expert_slots: int | None,
    held_refills: int | None,
    kv_tile: int | None,
    collectives: str | None,
    expert_sharing: str | None,
    residual_snapshots: str | None,
    recurrent_states: str | None,
    fuse_draft: bool | None,
    draft: str | None,
) -> None:
    """Run SPEC's mini twin on TOPOLOGY's mesh in TPU interpret mode (virtual CPU devices,
    race detection, uninitialised memory as NaN) against the reference model, in each DMA
    execution mode. Exit 0 if every check passes, 1 naming the first failure."""
    from mkgen.codegen.package import mini_kernel_args
    from mkgen.kinds import default_registry
    from mkgen.plan import full_size_kernel_modes, plan_build
    from mkgen.plan.options import BuildOptions
    from mkgen.plan.sharding import full_size_splits
    from mkgen.spec.mini import mini_twin
    from mkgen.verify import checks

    given = {"ring_depth": ring_depth, "expert_slots": expert_slots, "held_refills": held_refills,
             "kv_tile": kv_tile, "collectives": collectives, "expert_sharing": expert_sharing,
             "residual_snapshots": residual_snapshots, "recurrent_states": recurrent_states,
             "fuse_draft": fuse_draft}  # fmt: skip
    knobs = {k: v for k, v in given.items() if v is not None}
    # The full-size build as built (rows 1 unless it fuses a drafter, which drafts R - 1).
    rows_built = {"rows": rows} if fuse_draft else {}
    spec, topo, built = plan_inputs(spec_ref, topology, quant=quant, **rows_built, **knobs)
    # The twin drafts nothing (mkgen.spec.mini): the drafter is checked against the spec.
    spec = drafting_spec(spec, draft, rows)
    options = BuildOptions.create(batch=batch, rows=rows, context=context, **knobs)
    _check_steps_fit(steps, batch, rows, context)
    if not 0 < timeout < math.inf:
        raise MkgenError(f"--timeout {timeout:g}: give a finite number of seconds above 0")
    # Unsupported kinds or formats, or a plan that would hang: exit 2 here, not later.
    plan_build(spec, topo, built, kinds=default_registry())
    spec = built.apply(spec)
    full_size = built.model_copy(update={"batch": batch, "rows": rows})
    modes = full_size_kernel_modes(spec, topo, full_size, kinds=default_registry())
    knobs |= modes  # the twin takes the full-size build's kernel modes, to prove that kernel
    options = options.model_copy(update=modes)
    mini = mini_twin(spec, topo.num_devices)
    splits = full_size_splits(spec, topo, options, kinds=default_registry())
    plan_build(
        mini,
        topo,
        options.model_copy(update={"splits": splits}),
        **mini_kernel_args(),
        kinds=default_registry(),
    )
    directory = _verified_build(output, spec, topo, options) if update_report else None
    verify_and_print(
        spec_ref, spec, topo, checks.modes_of(mode), directory, steps=steps, batch=batch,
        rows=rows, context=context, seed=seed, timeout=timeout, quant=quant, knobs=knobs,
        draft=draft,
    )  # fmt: skip


def _check_steps_fit(steps: int, batch: int, rows: int, context: int) -> None:
    """Refuse, in one line, steps whose rows would not fit in the twin's caches: sequence b
    starts at position b (mkgen.verify.numerics.start_positions) and each step writes
    `rows` token(s)."""
    from mkgen.verify.numerics import start_positions

    most_steps = (context - start_positions(batch)[-1]) // rows
    if most_steps < 1:
        raise MkgenError(
            f"--batch {batch} --rows {rows}: sequence b starts at position b, so the last one's "
            f"first step ends past --context {context}; give a --context of at least "
            f"{batch - 1 + rows}"
        )
    if not 1 <= steps <= most_steps:
        raise MkgenError(
            f"--steps {steps}: each step writes --rows {rows} token(s) into the mini caches of "
            f"--context {context} tokens (sequence b from position b); give 1 to {most_steps} "
            "steps"
        )


def _verified_build(output: Path | None, spec: Any, topo: Any, verified: Any) -> Path:
    """The build whose REPORT.md `verify --update-report` records into: `output` or the
    default, refused unless it is built for the verified batch and rows, and fuses its
    drafter exactly when the verified kernel does (`verified`: the verify's options)."""
    from mkgen.codegen.naming import default_build_dir
    from mkgen.codegen.package import load_build_inputs

    directory = output or default_build_dir(spec.name, topo)
    built = load_build_inputs(directory)[2]
    if (built.batch, built.rows) != (verified.batch, verified.rows):
        raise MkgenError(
            f"{shown(directory)} is built for batch {built.batch} x rows {built.rows}; "
            f"verify with --batch {built.batch} --rows {built.rows}"
        )
    if built.fuse_draft != verified.fuse_draft:
        flag = "with" if built.fuse_draft else "without"
        raise MkgenError(
            f"{shown(directory)} is built {flag} --fuse-draft; verify {flag} --fuse-draft"
        )
    return directory


def verify_and_print(
    spec_ref: str,
    spec: Any,
    topo: Any,
    modes: tuple[str, ...],
    directory: Path | None,
    **run: Any,
) -> None:
    """Run verify in each DMA mode (side by side where there are cores), print a table
    each, record, exit 1 on a failure."""
    from mkgen.spec.mini import mini_twin
    from mkgen.verify import checks

    click.echo(
        f"verify {mini_twin(spec, topo.num_devices).name} (mini twin of {spec.name}) on "
        f"{topo.name}: {topo.num_devices} virtual CPU devices, batch {run['batch']} x rows "
        f"{run['rows']}, context {run['context']}, {run['steps']} step(s), seed {run['seed']}"
    )
    click.echo(
        f"TPU interpret mode: detect_races, vector_clock_size {max(4 * topo.num_devices, 8)}, "
        f"uninitialised memory NaN; timeout {run['timeout']:g} s per mode"
    )
    click.echo(f"tolerances: {checks.TOLERANCES}")
    click.echo(f"({checks.NOT_YET})")
    reports = []
    lock = threading.Lock()
    with progress(None, "verify", "step") as bar:
        bar.reset(total=len(modes) * run["steps"])
        bar.set_postfix_str(f"DMA mode {', '.join(modes)}")

        def stepped() -> None:
            with lock:
                bar.update()

        def one(mode: str) -> list[Any]:
            return checks.run_verify(spec_ref, topo.name, modes=(mode,), on_step=stepped, **run)

        # Each mode is a child process of its own: side by side where there are cores for them
        # (a 32-device twin's step takes minutes), printed in mode order.
        with ThreadPoolExecutor(max_workers=min(len(modes), os.cpu_count() or 1)) as pool:
            for done in [pool.submit(one, mode) for mode in modes]:
                reports += done.result()
                for line in checks.verify_lines(reports[-1]):
                    bar.write(line, file=sys.stdout)
    if directory is not None:
        from mkgen.codegen.package import record_measurement

        record = checks.verify_record(reports, **{k: v for k, v in run.items() if k != "timeout"})
        record_measurement(directory, "verify", record)
        click.echo(f"recorded in {shown(directory)}/REPORT.md")
    failure = checks.first_failure(reports)
    if failure:
        click.echo(f"verify: FAILED: {failure}")
        sys.exit(1)
    click.echo(f"verify: passed ({len(modes)} mode(s) x {run['steps']} step(s))")


@click.command("compile", short_help="Compile a spec's full-size kernel for TPU7x.")
@spec_argument()
@kernel_options
@draft_option
@update_report_options
@click.option(
    "--profile",
    is_flag=True,
    help="Count the compiled kernel's ops per phase (Mosaic's LLO) beside the model's.",
)
@json_option("With --profile: the profile as JSON.")
def compile_command(
    spec_ref: str,
    topology: str,
    batch: int,
    rows: int,
    context: int | None,
    acceptance: float | None,
    quant: tuple[str, ...],
    ring_depth: int | None,
    expert_slots: int | None,
    held_refills: int | None,
    kv_tile: int | None,
    collectives: str | None,
    expert_sharing: str | None,
    residual_snapshots: str | None,
    recurrent_states: str | None,
    fuse_draft: bool | None,
    draft: str | None,
    update_report: bool,
    output: Path | None,
    profile: bool,
    as_json: bool,
) -> None:
    """Compile SPEC's full-size kernel for TOPOLOGY's compile-only TPU7x devices
    (libtpu, shape-only arguments): compile seconds and the VMEM Mosaic uses beside the
    plan's figure. Exit 1 with Mosaic's message when it does not compile."""
    if as_json and not profile:
        raise MkgenError("--json prints the profile: add --profile")
    prepare_jax()
    spec, topo, options = plan_inputs(
        spec_ref, topology, batch=batch, rows=rows, context=context, acceptance=acceptance,
        quant=quant, ring_depth=ring_depth, expert_slots=expert_slots, held_refills=held_refills,
        kv_tile=kv_tile, collectives=collectives, expert_sharing=expert_sharing,
        residual_snapshots=residual_snapshots, recurrent_states=recurrent_states,
        fuse_draft=fuse_draft,
    )  # fmt: skip
    # The kernel verifies; the drafter is in it only with --fuse-draft.
    spec = drafting_spec(spec, draft, rows)
    directory = _build_dir_for(spec, topo, options, output) if update_report else None
    if profile:
        _profile_and_print(spec, topo, options, as_json, directory)
        return
    compile_and_print(spec, topo, options, directory)


def _profile_and_print(
    spec: Any, topo: Any, options: Any, as_json: bool, directory: Path | None
) -> None:
    """Compile with Mosaic's LLO dump on (a child process), print the profile table and
    record it (and the compile) in the build at `directory`."""
    from mkgen.codegen.naming import build_name
    from mkgen.kinds import default_registry
    from mkgen.plan import plan_build
    from mkgen.verify.profile import compile_with_dump, profile_build
    from mkgen.verify.tpu_compile import CompileError

    try:
        record, llo = compile_with_dump(spec, topo, options, "mkgen compile", timeout=1800)
    except CompileError as error:
        click.echo(f"mkgen: compile failed: {error}", err=True)
        sys.exit(1)
    applied = options.apply(spec)
    result = profile_build(
        llo,
        plan_build(applied, topo, options, kinds=default_registry()),
        applied,
        build_name(spec.name, topo),
    )
    if directory is not None:
        from mkgen.codegen.package import record_measurement

        record_measurement(directory, "compile", record)
        record_measurement(directory, "profile", result.record())
    if as_json:
        click.echo(json.dumps({"compile": record, **result.record()}, indent=2))
        return
    click.echo(
        f"compile {spec.name} on {topo.name}: batch {options.batch} x rows {options.rows}, "
        f"context {options.context}, compiled in {record['seconds']:.1f} s"
    )
    for line in result.lines():
        click.echo(line)
    if directory is not None:
        click.echo(f"  recorded in {shown(directory)}/REPORT.md")


def compile_and_print(spec: Any, topo: Any, options: Any, directory: Path | None) -> None:
    """Compile, print, record; exit 1 when Mosaic refuses or the plan's VMEM is too low."""
    from mkgen.verify import checks
    from mkgen.verify.tpu_compile import CompileError

    click.echo(
        f"compile {spec.name} on {topo.name} (compile-only {topo.compile_only_name}, "
        f"libtpu {checks._version('libtpu')}): batch {options.batch} x rows {options.rows}, "
        f"context {options.context}"
    )
    try:
        outcome = checks.compile_full_size(spec, topo, options, "mkgen compile")
    except CompileError as error:
        click.echo(f"mkgen: compile failed: {error}", err=True)
        sys.exit(1)
    for line in outcome.lines():
        click.echo(line)
    if directory is not None:
        from mkgen.codegen.package import record_measurement

        record_measurement(directory, "compile", outcome.record())
        click.echo(f"  recorded in {shown(directory)}/REPORT.md")
    if outcome.plan_below_mosaic:
        sys.exit(1)
