"""Commands that write and outline builds: `build`, `regen` and `inspect`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from mkgen.cli.checks import compile_and_print, verify_and_print
from mkgen.cli.options import (
    draft_option,
    drafting_spec,
    force_option,
    kernel_options,
    output_option,
    plan_inputs,
    prepare_jax,
    shown,
    spec_argument,
)


@click.command("build", short_help="Generate the megakernel build of a spec.")
@spec_argument()
@kernel_options
@draft_option
@output_option("Build directory (default: generated/<spec>-<shape>/ in the checkout).")
@force_option(
    "Overwrite a build mkgen wrote whose files were edited or deleted (never a "
    "directory or file mkgen did not write)."
)
def build_command(
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
    output: Path | None,
    force: bool,
) -> None:
    """Generate the megakernel build of SPEC: megakernel.py, runner.py, plan.json,
    REPORT.md and mini/ (the mini twin's build), written atomically. Same inputs give
    identical bytes; compile and verify results are added by `mkgen compile/verify
    --update-report`. With --draft the build carries the drafter: its plan prices verify +
    draft and its runner drafts with it (docs/drafting.md)."""
    import time

    from mkgen.codegen.naming import CommandLine, build_commands, default_build_dir
    from mkgen.codegen.package import make_build

    prepare_jax()
    spec, topo, options = plan_inputs(
        spec_ref, topology, batch=batch, rows=rows, context=context, acceptance=acceptance,
        quant=quant, ring_depth=ring_depth, expert_slots=expert_slots, held_refills=held_refills,
        kv_tile=kv_tile, collectives=collectives, expert_sharing=expert_sharing,
        residual_snapshots=residual_snapshots, recurrent_states=recurrent_states,
        fuse_draft=fuse_draft,
    )  # fmt: skip
    spec = drafting_spec(spec, draft, rows)
    # The printed commands name the build as the user did, so they run as printed.
    default_dir = output is None or output.resolve() == default_build_dir(spec.name, topo).resolve()
    line = CommandLine(
        spec=None if spec_ref == spec.name else spec_ref,
        output=None if default_dir else str(output),
        draft=draft,
    )
    start = time.perf_counter()
    result = make_build(spec, topo, options, output=output, force=force, line=line)
    seconds = time.perf_counter() - start
    r, where = result.rendered, shown(result.directory)
    if not result.written:
        click.echo(f"{where}/ is up to date (same inputs, identical files); nothing written")
        return
    click.echo(
        f"wrote {where}/ in {seconds:.1f} s: {spec.name} on {topo.name} ({topo.num_devices} "
        f"cores), batch {options.batch} x rows {options.rows}, context {options.context}"
    )
    _print_files(r, where)
    commands = build_commands(spec.name, topo, options, line)
    if result.dropped:
        click.echo(f"  {_dropped(result.dropped)}")
    click.echo(f"next: {commands['verify']}; {commands['compile']}; {commands['inspect']}")


def _print_files(r: Any, where: str) -> None:
    """One line per file of the rendered build `r` written to `where`."""
    L, est = r.layout, r.plan.estimate
    kernel_lines = r.files["megakernel.py"].count("\n")
    click.echo(
        f"  megakernel.py  {kernel_lines:>5} lines  one pallas_call per step, "
        f"{len(L.attention_table)} layers in a runtime loop, {L.stream.total_banks} banks of "
        f"{L.stream.bank_bytes / 2**20:.2f} MiB per core, ring depth {L.stream.ring_depth}"
    )
    click.echo(
        f"  runner.py      {r.files['runner.py'].count(chr(10)):>5} lines  "
        f"python {where}/runner.py --help"
    )
    click.echo(f"  plan.json      {r.files['plan.json'].count(chr(10)):>5} lines")
    click.echo(
        f"  REPORT.md      {r.files['REPORT.md'].count(chr(10)):>5} lines  {est.headline} "
        f"({r.plan.confidence.beside_step()}; "
        f"{r.plan.ideal_floor.times(est.step_ms)}), {est.tokens_per_s_per_user:.1f} tokens/s "
        "per user" + (f" at acceptance {est.acceptance:g} (--acceptance)" if est.rows > 1 else "")
    )
    mini = json.loads(r.files["mini/plan.json"])["kernel"]
    click.echo(
        f"  mini/          {mini['model']}: {len(mini['attention_table'])} layers, hidden "
        f"{mini['hidden']}, banks of {mini['stream']['bank_rows']} rows, ring depth "
        f"{mini['stream']['ring_depth']}"
    )
    click.echo(f"  inputs sha256 {r.inputs_sha256}")


def _dropped(measurements: tuple[str, ...]) -> str:
    """What a rebuild says of the measurements it did not keep."""
    return (
        f"dropped the recorded {', '.join(measurements)} results: the kernel code changed "
        "or the build was edited (record them again)"
    )


@click.command("inspect", short_help="Outline a generated kernel's phases, DMAs and VMEM.")
@click.argument("build", metavar="BUILD")
@click.option("--layer", type=int, help="Show one layer's schedule next to its code.")
def inspect_command(build: str, layer: int | None) -> None:
    """Outline a generated kernel (BUILD: a build directory or a name in generated/):
    each phase of each layer kind with its lines in megakernel.py, the DMAs in flight
    and the VMEM map."""
    from mkgen.verify.inspect import layer_view, outline

    prepare_jax()
    click.echo(outline(build) if layer is None else layer_view(build, layer))


@click.command("regen", short_help="Rebuild every checked-in build in generated/BUILDS.")
@click.option(
    "--measure",
    is_flag=True,
    help="Also compile and verify each build (at the seed of its recorded verify, else 0) and "
    "record the results in its REPORT.md.",
)
def regen_command(measure: bool) -> None:
    """Rebuild every checked-in build listed in generated/BUILDS (with --force)."""
    from mkgen.codegen.build_list import BUILD_LIST, entry_inputs, read_build_list
    from mkgen.codegen.measurements import read_measurements
    from mkgen.codegen.naming import CommandLine, default_build_dir
    from mkgen.codegen.package import make_build

    prepare_jax()
    for entry in read_build_list(BUILD_LIST):
        spec, topo, options = entry_inputs(entry)
        directory = default_build_dir(spec.name, topo)
        # Read before the rebuild, which drops a record of another kernel text.
        seed = ((read_measurements(directory) or {}).get("verify") or {}).get("seed", 0)
        line = CommandLine(draft=entry.draft)
        result = make_build(spec, topo, options, output=directory, force=True, line=line)
        state = "rewritten" if result.written else "unchanged"
        dropped = f"; {_dropped(result.dropped)}" if result.dropped else ""
        click.echo(f"{shown(directory)}: {state} (mkgen build {entry.line}){dropped}")
        if measure:
            _measure(entry, spec, topo, options, directory, seed)


def _measure(entry: Any, spec: Any, topo: Any, options: Any, directory: Path, seed: int) -> None:
    """`regen --measure` of one build: its full-size compile and its mini twin's verify in
    both DMA modes at random weights `seed` (its last recorded verify's, else 0: a seed at
    which the reference drafter's first draft is a near tie compares no draft, and Kimi K3's
    twin verifies at 10, docs/drafting.md), recorded in its REPORT.md. The twin takes the
    full-size kernel's modes, as `mkgen verify` gives them. A kernel that drafts verifies
    one step: its passes make a step of Kimi K3's 32-device twin take about 40 minutes. A
    hang stops by itself (stalled), so the timeout only bounds a slow twin."""
    from mkgen.codegen.package import MINI_CONTEXT
    from mkgen.kinds import default_registry
    from mkgen.plan import full_size_kernel_modes
    from mkgen.verify import checks

    compile_and_print(spec, topo, options, directory)
    applied = options.apply(spec)
    knobs = {"fuse_draft": True} if options.fuse_draft else {}
    knobs |= full_size_kernel_modes(applied, topo, options, kinds=default_registry())
    verify_and_print(
        entry.spec, applied, topo, checks.modes_of("both"), directory,
        steps=1 if options.fuse_draft else 2, batch=options.batch, rows=options.rows,
        context=MINI_CONTEXT, seed=seed, timeout=3600.0,
        quant=tuple(f"{f}={v}" for f, v in options.quant), draft=entry.draft, knobs=knobs,
    )  # fmt: skip
