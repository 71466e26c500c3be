"""Commands that run a build on weights: `convert` (a checkpoint into a build's per-core
weights), `run` (the build's runner) and `bench` (the runner at several batch sizes)."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import click

from mkgen.cli.options import (
    SEED,
    batch_option,
    context_option,
    force_option,
    json_option,
    output_option,
    plan_inputs,
    positive_list,
    prepare_jax,
    progress,
    quant_option,
    rows_option,
    shown,
    spec_argument,
    topology_option,
)
from mkgen.errors import MkgenError


@click.command("convert", short_help="Pack a checkpoint into a build's per-core weights.")
@spec_argument(required=False)
@click.option(
    "--checkpoint",
    type=click.Path(path_type=Path),
    help="Hugging Face checkpoint directory (config.json, safetensors shards and index).",
)
@click.option(
    "--draft-checkpoint",
    type=click.Path(path_type=Path),
    help="The build's drafter's checkpoint (config.json and safetensors, its published "
    "tensor names): mtp the target's own MTP layers (may be --checkpoint itself), block a "
    "DFlash drafter, model a Hugging Face checkpoint; written beside the target's weights.",
)
@click.option(
    "--random-weights", type=SEED, metavar="SEED", help="The reference's random weights instead."
)
@click.option(
    "--build",
    "build_dir",
    type=click.Path(path_type=Path),
    help="Convert for this build directory (its spec, topology, options and banks).",
)
@topology_option(required=False, note=" (without --build)")
@batch_option("Sequences.")
@rows_option
@context_option
@quant_option()
@output_option("Weights directory.", required=True)
@force_option("Replace a conversion made from other inputs.")
def convert_command(
    spec_ref: str | None,
    checkpoint: Path | None,
    draft_checkpoint: Path | None,
    random_weights: int | None,
    build_dir: Path | None,
    topology: str | None,
    batch: int,
    rows: int,
    context: int | None,
    quant: tuple[str, ...],
    output: Path,
    force: bool,
) -> None:
    """Pack a checkpoint into every core's weight arrays for a build: per core its stream
    banks, vector slabs and expert arrays layer by layer, in the build's formats, plus a
    layout.json the runner checks (runner.py --weights OUTPUT). SPEC defaults to the
    checkpoint's config.json, which must agree with the spec; every tensor's name, shape
    and dtype is checked before the first layer is converted. Bounded memory (one layer at
    a time), atomic per file, resumable: run it again after an interruption (or after the
    checkpoint's tokenizer files changed: they are copied, the weights kept). A progress
    bar on stderr when it is a terminal. With --draft-checkpoint, the build's drafter
    (mkgen build --draft) is converted too, checked first like the target."""
    from mkgen.weights import convert
    from mkgen.weights.draft import draft_checkpoint as drafter_source

    if (checkpoint is None) == (random_weights is None):
        raise MkgenError("give one of --checkpoint DIR and --random-weights SEED")
    if draft_checkpoint is not None and checkpoint is None:
        raise MkgenError("--draft-checkpoint: only with --checkpoint (a drafter beside a model)")
    convert.check_output(output)  # before the plan and the checkpoint's headers are read
    spec, topo, options, layout, kernel_args = _conversion_target(
        spec_ref, checkpoint, build_dir, topology, batch=batch, rows=rows, context=context,
        quant=quant,
    )  # fmt: skip
    if options.fuse_draft and draft_checkpoint is None:
        raise MkgenError(
            f"--build {build_dir}: its kernel drafts (mkgen build --fuse-draft) with its MTP "
            "module, whose weights come from --draft-checkpoint (the target's own checkpoint "
            "when it holds its MTP layers); give --checkpoint and --draft-checkpoint"
        )
    identity = convert.build_identity(spec, topo.name, options.model_dump(mode="json"), kernel_args)
    if checkpoint is not None:
        source, fingerprint = convert.checkpoint_source(spec, Path(checkpoint))
        identity["checkpoint"] = fingerprint
        draft = None if draft_checkpoint is None else drafter_source(spec, draft_checkpoint)
        if draft is not None:
            identity["draft_checkpoint"] = draft.fingerprint
    else:
        from mkgen.weights.quantize import stored_random_weights

        prepare_jax()
        source = convert.InventorySource(stored_random_weights(spec, random_weights))
        identity["random_weights"], draft = random_weights, None
    tokenizer_files = [
        Path(checkpoint) / name for name in convert.TOKENIZER_FILES if checkpoint is not None
    ]
    result = convert.convert(
        spec, layout, source, output, identity=identity, force=force, progress=True,
        tokenizer_files=[path for path in tokenizer_files if path.is_file()], draft=draft,
    )  # fmt: skip
    if result.skipped == ["all"]:
        changes = [f"copied {name} from the checkpoint" for name in result.tokenizers_copied]
        changes += [f"removed {name} (not in the checkpoint)" for name in result.tokenizers_removed]
        kept = f"{shown(output)}/ is up to date ({result.files} files verified)"
        click.echo("; ".join([kept, *changes]))
        return
    resumed = (
        f"; resumed: {len(result.skipped)} unit(s) verified and kept" if result.skipped else ""
    )
    drafter = f" with its {spec.draft.kind} drafter" if draft is not None else ""
    click.echo(
        f"wrote {shown(output)}/ in {result.seconds:.1f} s: {spec.name}{drafter} for {topo.name} "
        f"({layout.devices} cores), {result.files} files, {result.bytes / 2**20:,.1f} MiB{resumed}"
    )


def _conversion_target(
    spec_ref: str | None,
    checkpoint: Path | None,
    build_dir: Path | None,
    topology: str | None,
    *,
    batch: int,
    rows: int,
    context: int | None,
    quant: tuple[str, ...],
) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
    """What `convert` packs for: (spec, topology, options, kernel layout, kernel arguments),
    from --build's plan.json or planned from SPEC (or the checkpoint's config.json)."""
    from mkgen.codegen.package import load_build_inputs, resolved_kernel_args
    from mkgen.kinds import default_registry
    from mkgen.plan import plan_build
    from mkgen.plan.layout import KernelLayout
    from mkgen.plan.options import BuildOptions, refuse_repeated_families
    from mkgen.spec.hf_import import import_hf_config
    from mkgen.spec.loader import load_spec
    from mkgen.spec.topology import parse_topology

    if build_dir is not None:
        if spec_ref or topology or quant:
            raise MkgenError("--build takes spec, topology and formats from the build")
        spec, topo, options, data = load_build_inputs(build_dir)
        layout = KernelLayout.read(data["kernel"], default_registry())
        return spec, topo, options, layout, data["kernel_args"]
    if not topology:
        raise MkgenError("give --topology (or --build BUILD)")
    if spec_ref is None and checkpoint is None:
        raise MkgenError("give SPEC (or --checkpoint DIR, whose config.json is the spec)")
    refuse_repeated_families(quant)
    topo = parse_topology(topology)
    options = BuildOptions.create(
        batch=batch, rows=rows, context=context, quant=list(quant) or None
    )
    if spec_ref is None:
        assert checkpoint is not None
        spec = import_hf_config(Path(checkpoint))
    else:
        spec = load_spec(spec_ref)
    spec = options.apply(spec)
    plan = plan_build(spec, topo, options, kinds=default_registry())
    return spec, topo, options, plan.kernel, resolved_kernel_args(plan)


@click.command(
    "run",
    short_help="Generate with a build's runner.",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    add_help_option=False,
)
@click.argument("build", metavar="BUILD")
@click.argument("runner_args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def run_command(ctx: click.Context, build: str, runner_args: tuple[str, ...]) -> None:
    """Run a build's runner: BUILD is a build directory (or a build's name in generated/),
    and the runner's own options follow it, e.g. `mkgen run BUILD --weights W --prompt-ids
    1,2 --json`; `mkgen run BUILD --help` lists them. The same as `python
    BUILD/runner.py ...`, in this process."""
    if build in ("-h", "--help"):
        click.echo(ctx.get_help())
        return
    from mkgen.runtime import run

    run(runner_build(build), list(runner_args), prog="mkgen run", usage=f"mkgen run {build}")


def runner_build(build: str) -> Any:
    """The runtime Build of BUILD: a build directory, or a build's name in generated/."""
    from mkgen.codegen.naming import GENERATED
    from mkgen.runtime.build import RUNNER_FILE, runner_build

    directory = Path(build)
    if not (directory / RUNNER_FILE).exists() and not directory.is_absolute():
        directory = GENERATED / build
    if not (directory / RUNNER_FILE).exists():
        elsewhere = "" if Path(build).is_absolute() else f" nor in generated/{build}"
        raise MkgenError(f"{build}: no {RUNNER_FILE} there{elsewhere}")
    return runner_build(directory)


@click.command(
    "bench",
    short_help="Benchmark the runner at several batch sizes.",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
)
@spec_argument()
@topology_option()
@click.option("--batches", default="1,2,4,8", show_default=True, help="Batch sizes to build.")
@rows_option
@context_option
@quant_option()
@click.option("--mini", is_flag=True, help="Run each build's mini twin (CPU: with --interpret).")
@json_option("Print one JSON list, a row per batch.")
@click.argument("runner_args", nargs=-1, type=click.UNPROCESSED)
def bench_command(
    spec_ref: str, topology: str, batches: str, rows: int, context: int | None,
    quant: tuple[str, ...], mini: bool, as_json: bool, runner_args: tuple[str, ...],
) -> None:  # fmt: skip
    """Benchmark the runner at several batch sizes: build SPEC once per batch (in a
    temporary directory), run each build's runner with --bench --json and the arguments
    that follow (weights, prompt, --steps, --warmup, --interpret, ...), and print ms per
    step (median, p10-p90), tokens/s per user and in all, next to the plan's prediction."""
    import subprocess

    from mkgen.codegen.package import make_build

    sizes = positive_list("--batches", batches)
    rows_out = []
    with (
        tempfile.TemporaryDirectory(prefix="mkgen-bench-") as tmp,
        progress(sizes, "bench", "batch") as bar,
    ):
        for batch in bar:
            bar.set_postfix_str(f"batch {batch}: build, then run the runner")
            spec, topo, options = plan_inputs(
                spec_ref, topology, batch=batch, rows=rows, context=context, quant=quant
            )
            result = make_build(spec, topo, options, output=Path(tmp) / f"batch-{batch}")
            runner = result.directory / ("mini" if mini else "") / "runner.py"
            run = subprocess.run(
                [sys.executable, str(runner), "--bench", "--json", *runner_args],
                capture_output=True, text=True,
            )  # fmt: skip
            if run.returncode != 0:
                last = (run.stderr.strip().splitlines() or ["no output"])[-1]
                raise MkgenError(f"batch {batch}: the runner failed: {last}")
            bench = json.loads(run.stdout.strip().splitlines()[-1])["bench"]
            # The plan's prediction, and the same build with no refill held (its calibrated
            # regime, docs/cost-model.md): both are the cost model's, at this batch x rows.
            rendered = result.rendered
            predicted = None if mini else (
                rendered.step_ms(), rendered.plan.confidence.calibrated_step_ms
            )  # fmt: skip
            rows_out.append((batch, bench, predicted))
    if as_json:
        click.echo(json.dumps([
            {"batch": batch, **bench,
             "predicted_ms_per_step": p[0] if p else None,
             "predicted_calibrated_ms_per_step": p[1] if p else None}
            for batch, bench, p in rows_out
        ]))  # fmt: skip
        return
    # Predicted: the cost model's step of each build (batch x `rows`); calibrated: the same
    # build with no refill held for collectives, the regime its calibration rows ran.
    click.echo(
        "batch  ms/step (p10-p90)       tokens/s/user  tokens/s  predicted ms/step  "
        "calibrated ms/step"
    )
    for batch, bench, p in rows_out:
        spread = f"{bench['ms_p10']:.3f}-{bench['ms_p90']:.3f}"
        shown, calibrated = ("-", "-") if p is None else (f"{p[0]:.3f}", f"{p[1]:.3f}")
        click.echo(
            f"{batch:>5}  {bench['ms_per_step']:>8.3f} ({spread:>15})  "
            f"{bench['tokens_per_s_per_user']:>13.1f}  {bench['tokens_per_s']:>8.1f}  "
            f"{shown:>17}  {calibrated:>18}"
        )
