"""The mkgen command line: thin click commands over spec -> plan -> codegen -> verify.

Every user error is an MkgenError: printed as one line on stderr, exit status 2,
no traceback. Commands that do not need JAX never import it.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from argparse import Namespace
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from mkgen import __version__
from mkgen.errors import MkgenError
from mkgen.output import progress_bar, write_atomic
from mkgen.runtime.devices import INTERPRET_ACROSS_PROCESSES, check_multi_host_flags
from mkgen.serve import DRAIN_S, HOST_CACHE_MIB, MAX_BODY_MIB

# Random weights come from jax.random.key(seed), which takes 32-bit seeds.
SEED = click.IntRange(0, 2**32 - 1)


def _fail(message: str) -> None:
    click.echo(f"mkgen: error: {message}", err=True)
    sys.exit(2)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mkgen")
def cli() -> None:
    """mkgen: a model spec and a TPU topology in, a Pallas decode megakernel out."""


@cli.command("list", short_help="List the model specs, chips and slices.")
def list_command() -> None:
    """List the model specs in model_specs/ and the known chips and topologies."""
    from mkgen.hardware import CATALOG
    from mkgen.spec.figures import params_active, params_total
    from mkgen.spec.loader import list_spec_names, load_spec

    click.echo("Model specs (model_specs/):")
    for name in list_spec_names():
        spec = load_spec(name)
        click.echo(
            f"  {name:<18} {spec.layers.count:>3} layers  "
            f"{params_total(spec) / 1e9:>8.1f}B total  {params_active(spec) / 1e9:>6.1f}B active"
        )
    click.echo("Chips and slices (TOPOLOGY is CHIP:SHAPE, or SHAPE for TPU7x):")
    for chip in CATALOG.values():
        slices = ", ".join("x".join(map(str, s)) for s in chip.slice_shapes)
        click.echo(f"  {chip.name:<6} {chip.cores_per_chip} core(s)/chip  slices: {slices}")


def _layer_runs(table: list[tuple[str, str]]) -> list[tuple[int, int, str, str]]:
    """Consecutive layers with the same (attention, FFN) kinds: (first, last, attn, ffn)."""
    runs: list[tuple[int, int, str, str]] = []
    for i, (attn, ffn) in enumerate(table):
        if runs and runs[-1][2:] == (attn, ffn) and runs[-1][1] == i - 1:
            runs[-1] = (runs[-1][0], i, attn, ffn)
        else:
            runs.append((i, i, attn, ffn))
    return runs


def describe_assignment(assignment: Any) -> str:
    """The layer rules in words, e.g. 'kda by default; mla every 4 from 3; mla last 1'."""
    if assignment.pattern:
        parts = [f"pattern {'/'.join(assignment.pattern)}"]
    else:
        parts = [f"{assignment.default} by default"] if assignment.default else []
    for rule in assignment.rules:
        if rule.every is not None:
            parts.append(f"{rule.kind} every {rule.every} from {rule.offset}")
        elif rule.indices is not None:
            parts.append(f"{rule.kind} at {rule.indices}")
        else:
            which = "first" if rule.first is not None else "last"
            parts.append(f"{rule.kind} {which} {rule.first or rule.last}")
    return "; ".join(parts)


def show_data(spec: Any) -> dict[str, Any]:
    """The machine-readable summary `mkgen show --json` prints."""
    from mkgen.spec.figures import (
        bytes_by_family,
        cache_bytes_per_token,
        params_active,
        params_total,
        state_bytes_per_sequence,
    )

    attention, ffn = spec.attention_table(), spec.ffn_table()
    return {
        "name": spec.name,
        "description": spec.description,
        "dims": spec.dims.model_dump(mode="json"),
        "params_total": params_total(spec),
        "params_active": params_active(spec),
        "bytes_by_family": bytes_by_family(spec),
        "quantization": spec.quantization.model_dump(mode="json"),
        "cache_bytes_per_token": cache_bytes_per_token(spec)["total"],
        "cache_bytes_per_token_by_kind": cache_bytes_per_token(spec),
        "state_bytes_per_sequence": state_bytes_per_sequence(spec),
        "layers": [
            {
                "index": i,
                "attention": a,
                "attention_type": spec.attention_kinds[a].type,
                "ffn": f,
                "ffn_type": spec.ffn_kinds[f].type,
            }
            for i, (a, f) in enumerate(zip(attention, ffn, strict=True))
        ],
    }


def _human(n: float, unit: str = "") -> str:
    """1234567 -> '1.23 M' (decimal prefixes, as parameter counts and HBM sizes are quoted)."""
    for scale, prefix in ((1e12, "T"), (1e9, "G" if unit else "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {prefix}{unit}".rstrip()
    return f"{n:,.0f} {unit}".rstrip()


@cli.command("show", short_help="Summarise a model spec: dims, kinds, parameters, bytes.")
@click.argument("spec_ref", metavar="SPEC")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--mini", is_flag=True, help="Show the spec's mini twin instead.")
@click.option("--layers", is_flag=True, help="Also print the per-layer table.")
def show_command(spec_ref: str, as_json: bool, mini: bool, layers: bool) -> None:
    """Summarise SPEC (a name in model_specs/, a YAML file or a config.json)."""
    from mkgen.spec.loader import load_spec
    from mkgen.spec.mini import mini_twin

    spec = load_spec(spec_ref)
    if mini:
        spec = mini_twin(spec)
    data = show_data(spec)
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    d = spec.dims
    click.echo(f"{spec.name}: {spec.description}")
    click.echo(
        f"  hidden {d.hidden}, vocab {d.vocab}"
        + (f" ({d.vocab_used} used)" if d.vocab_used else "")
        + f", {spec.layers.count} layers, norm {d.norm_style} eps {d.norm_eps:g}"
        + (", tied embeddings" if d.tie_embeddings else "")
        + (
            f", logit soft-cap {d.logit_softcap:g} x{d.logit_multiplier:g}"
            if d.logit_softcap
            else ""
        )
    )
    click.echo(
        f"  parameters: {_human(data['params_total'])} total, "
        f"{_human(data['params_active'])} active per token"
    )
    for section, kinds, table in (
        ("attention", spec.attention_kinds, spec.attention_table()),
        ("ffn", spec.ffn_kinds, spec.ffn_table()),
    ):
        counts = ", ".join(
            f"{name} ({kinds[name].type}) x{table.count(name)}" for name in kinds if name in table
        )
        rules = describe_assignment(getattr(spec.layers, section))
        click.echo(f"  {section}: {counts}; {rules}")
    if not layers:
        click.echo("  (--layers prints the per-layer table)")
    for first, last, attn, ffn in _layer_runs(spec.layer_table()) if layers else []:
        span = f"{first}" if first == last else f"{first}-{last}"
        click.echo(
            f"    {span:>7}  {attn} ({spec.attention_kinds[attn].type}) + "
            f"{ffn} ({spec.ffn_kinds[ffn].type})"
        )
    click.echo("  weight bytes by family (format):")
    quant = data["quantization"]
    for family, nbytes in sorted(data["bytes_by_family"].items(), key=lambda kv: -kv[1]):
        click.echo(f"    {family:<15} {_human(nbytes, 'B'):>12}  {quant.get(family, 'bf16')}")
    click.echo(f"    {'total':<15} {_human(sum(data['bytes_by_family'].values()), 'B'):>12}")
    cache = data["cache_bytes_per_token_by_kind"]
    click.echo(
        f"  cache per token: {cache['total']:,} B (KV {cache['kv']:,}, MLA latent "
        f"{cache['mla_latent']:,}); recurrent state per sequence: "
        f"{data['state_bytes_per_sequence']:,} B"
    )


@cli.command("import-hf", short_help="Map a Hugging Face config.json to a model spec.")
@click.argument("config", type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), help="Write the spec here.")
@click.option("--name", help="Spec name (default: the directory's or file's name).")
@click.option("--force", is_flag=True, help="Overwrite an existing output file.")
def import_hf_command(config: Path, output: Path | None, name: str | None, force: bool) -> None:
    """Map a Hugging Face config.json, or a checkpoint directory's, to a model spec (YAML
    on stdout or -o FILE)."""
    from mkgen.spec.hf_import import render_spec_yaml

    text = render_spec_yaml(config, name)
    if output is None:
        click.echo(text, nl=False)
        return
    write_atomic(
        output, text, may_replace=lambda _: force, refusal="exists; pass --force to overwrite it"
    )
    click.echo(f"wrote {output}")


def _knob_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The kernel knobs shared by `plan`, `build`, `compile` and `verify` (plan fields)."""
    for decorator in reversed(
        [
            click.option(
                "--ring-depth", type=int, default=None, help="Weight banks in flight [planner]."
            ),
            click.option(
                "--expert-slots", type=int, default=None, help="Expert pieces in flight [planner]."
            ),
            click.option(
                "--held-refills",
                type=int,
                default=None,
                help="Ring refills held for the collectives' rounds [planner].",
            ),
        ]
    ):
        command = decorator(command)
    return command


@cli.command("plan", short_help="Plan a spec on a topology, with its predicted step time.")
@click.argument("spec_ref", metavar="SPEC")
@click.option("--topology", required=True, help="CHIP:SHAPE or SHAPE, e.g. 2x2x4.")
@click.option("--batch", type=int, default=1, show_default=True, help="Sequences per step.")
@click.option("--rows", type=int, default=1, show_default=True, help="Rows per sequence.")
@click.option("--acceptance", type=float, default=None, help="Mean accepted tokens per step.")
@click.option("--context", type=int, default=None, help="Cache tokens per sequence [4096].")
@click.option("--quant", multiple=True, metavar="FAMILY=FORMAT", help="Weight format override.")
@click.option("--vmem-budget", "vmem_budget", metavar="SIZE", help="Explicit VMEM, e.g. 48MiB.")
@click.option("--price", type=float, default=None, help="USD per chip-hour.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--trace", type=click.Path(path_type=Path), help="Write a Perfetto trace here.")
@click.option("--force", is_flag=True, help="Overwrite a --trace file mkgen did not write.")
@_knob_options
def plan_command(spec_ref: str, topology: str, as_json: bool, trace: Path | None, force: bool,
                 **fields: Any) -> None:  # fmt: skip
    """Plan SPEC on a topology: sharding, HBM and VMEM, schedule checks, predicted step."""
    from mkgen.kinds import default_registry
    from mkgen.plan import plan_build, to_chrome_trace
    from mkgen.plan.report import plan_text

    spec, topo, options = _plan_inputs(spec_ref, topology, **fields)
    plan = plan_build(spec, topo, options, trace=trace is not None, kinds=default_registry())
    if trace is not None:
        write_atomic(
            trace, json.dumps(to_chrome_trace(plan.estimate.events)),
            may_replace=lambda old: force or _is_trace(old, to_chrome_trace(())),
            refusal="exists and is not a trace mkgen wrote; pass --force to overwrite it",
        )  # fmt: skip
    if as_json:
        click.echo(plan.to_json())
        return
    click.echo(plan_text(plan))
    if trace is not None:
        click.echo(f"\nwrote {trace} (open it in ui.perfetto.dev)")


def _is_trace(text: str, empty: dict[str, list[Any]]) -> bool:
    """Whether `text` is a trace mkgen wrote: its events open with the track records
    of `empty` (the trace of no events)."""
    try:
        events = json.loads(text)["traceEvents"]
    except (ValueError, TypeError, KeyError):
        return False
    header = empty["traceEvents"]
    return isinstance(events, list) and events[: len(header)] == header


@cli.command("estimate", short_help="Predict tokens per dollar against tokens/s per user.")
@click.argument("spec_ref", metavar="SPEC")
@click.option("--topology", required=True, help="CHIP:SHAPE or SHAPE, e.g. 2x2x4.")
@click.option(
    "-o", "--output", type=click.Path(path_type=Path),
    help="Directory for the CSV, SVG and PNG (default: the current directory).",
)  # fmt: skip
@click.option("--batches", default="1,2,4,8,16,32,64", show_default=True, help="Batch sizes.")
@click.option(
    "--rows", "rows_list", default="1", show_default=True,
    help="Rows per sequence, e.g. 1,4,8 (rows > 1 need --acceptance).",
)  # fmt: skip
@click.option(
    "--acceptance", type=float, default=None,
    help="Mean tokens accepted per step when rows > 1 (capped at each row count).",
)  # fmt: skip
@click.option(
    "--scenario", default="agentic", show_default=True, metavar="NAME",
    help="Request shape the total tokens per $ price: agentic, chat or decode.",
)  # fmt: skip
@click.option("--context", type=int, default=None, help="Cache tokens per sequence [4096].")
@click.option("--quant", multiple=True, metavar="FAMILY=FORMAT", help="Weight format override.")
@click.option("--price", type=float, default=None, help="USD per chip-hour [catalog estimate].")
@click.option(
    "--reference-price", "reference_prices", multiple=True, metavar="CHIP=USD",
    help="Chip-hour price of a published reference (e.g. GB300=2.31).",
)  # fmt: skip
def estimate_command(spec_ref: str, topology: str, output: Path | None, batches: str,
                     rows_list: str, scenario: str, reference_prices: tuple[str, ...],
                     **fields: Any) -> None:  # fmt: skip
    """Predict total tokens per dollar against tokens/s per user over batch x rows: the
    table, SPEC-SHAPE-estimate.csv, and the chart as .svg and .png, with the published
    reference points (mkgen/plan/tco.py)."""
    from mkgen.kinds import default_registry
    from mkgen.plan import tco
    from mkgen.plan.options import MAX_TOKEN_ROWS
    from mkgen.plan.report import estimate_chart_text, sweep, sweep_csv, sweep_table, tco_chart

    sizes = _positive_list("--batches", batches)
    row_counts = _positive_list("--rows", rows_list)
    most_rows = max(row_counts)
    if most_rows * max(sizes) > MAX_TOKEN_ROWS:
        raise MkgenError(
            f"--batches {batches} x --rows {rows_list}: {max(sizes)} x {most_rows} token rows "
            f"per step, over the {MAX_TOKEN_ROWS} a step holds; lower the largest batch or rows"
        )
    if max(row_counts) > 1 and fields["acceptance"] is None:
        raise MkgenError(
            f"--rows {rows_list}: rows > 1 need --acceptance A (mean tokens accepted per step, "
            "e.g. 3), or sweep --rows 1"
        )
    request = tco.scenario(scenario)
    prices = tco.parse_prices(reference_prices)
    spec, topo, options = _plan_inputs(spec_ref, topology, rows=max(row_counts), **fields)
    # As mkgen run and serve count: a request's prompt (at least one token: a step feeds
    # one) and its output tokens.
    needed = max(request.input_tokens, 1) + request.output_tokens
    if needed > options.context:
        raise MkgenError(
            f"--context {options.context}: --scenario {request.describe()} needs a context of "
            f"{needed} (its prompt, at least one token, and its output); pass --context to "
            "raise it"
        )
    price = options.price_per_chip_hour_usd or topo.chip_info.price_per_chip_hour_usd
    if price is None:
        raise MkgenError(f"{topo.chip} has no chip-hour price in the catalog; pass --price USD")
    rows = sweep(
        spec, topo, options, request, batches=sizes, rows=row_counts, kinds=default_registry()
    )
    click.echo(
        f"{spec.name} on {topo.name}, context {options.context}, {request.describe()}; each row "
        f"is the build `mkgen plan {spec.name} --topology {topology} --batch B --rows R` "
        "plans (step ms: its predicted step; calib ms: the same build with no refill held, "
        "the calibrated regime; floor ms: the ideal floor). Predictions of the cost model."
    )
    click.echo(sweep_table(rows))
    title, notes = estimate_chart_text(spec.name, topo, price, request, prices)
    references = tuple(tco.priced(curve, prices) for curve in tco.REFERENCES)
    name = f"{spec.name}-{topo.shape_name}-estimate"
    directory = output or Path(".")
    files = [(".csv", sweep_csv(rows).encode())] + [
        (f".{fmt}", tco_chart(rows, title=title, notes=notes, references=references, fmt=fmt))
        for fmt in ("svg", "png")
    ]
    click.echo(f"wrote to {_shown(directory)}/ (-o DIR chooses the directory):")
    header = sweep_csv([])  # an earlier estimate is recognised by its CSV header or title
    for suffix, data in files:
        path = directory / f"{name}{suffix}"
        earlier = header if suffix == ".csv" else title
        write_atomic(
            path, data, may_replace=lambda old, mark=earlier: mark in old,
            refusal="exists and is not an estimate mkgen wrote; move it or choose another -o",
        )  # fmt: skip
        click.echo(f"  {path}")


def _progress(items: Any, desc: str, unit: str) -> Any:
    """A bar over `items` on a terminal's stderr (mkgen.output.progress_bar)."""
    return progress_bar(items, desc=desc, unit=unit)


def _positive_list(flag: str, text: str) -> tuple[int, ...]:
    """`1,2,4` -> (1, 2, 4); an error naming `flag` otherwise."""
    try:
        sizes = tuple(int(b) for b in text.split(","))
    except ValueError:
        raise MkgenError(f"{flag} {text!r}: write sizes like 1,2,4,8") from None
    if not sizes or min(sizes) < 1:
        raise MkgenError(f"{flag} {text!r}: sizes must be positive integers")
    return sizes


def _plan_inputs(spec_ref: str, topology: str, **fields: Any) -> tuple[Any, Any, Any]:
    """Spec, topology and BuildOptions from CLI values (errors name the flag)."""
    from mkgen.plan.options import BuildOptions, refuse_repeated_families
    from mkgen.spec.loader import load_spec
    from mkgen.spec.topology import parse_topology

    refuse_repeated_families(fields.get("quant") or ())
    fields["quant"] = list(fields.get("quant") or ()) or None
    if "vmem_budget" in fields:
        fields["vmem_budget_bytes"] = fields.pop("vmem_budget")
    if "price" in fields:
        fields["price_per_chip_hour_usd"] = fields.pop("price")
    options = BuildOptions.create(**fields)
    return load_spec(spec_ref), parse_topology(topology), options


def _prepare_jax() -> None:
    """JAX on the CPU unless told otherwise (libtpu only serves compile-only devices here);
    libtpu's start-up noise on stderr is swallowed."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from mkgen.verify.tpu_compile import quiet_stderr

    with quiet_stderr():
        import jax  # noqa: F401


def _kernel_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """--topology and the build options shared by `build` and `compile`."""
    for decorator in reversed(
        [
            _knob_options,
            click.option("--topology", required=True, help="CHIP:SHAPE or SHAPE, e.g. 2x2x1."),
            click.option("--batch", type=int, default=1, show_default=True, help="Sequences."),
            click.option(
                "--rows", type=int, default=1, show_default=True, help="Rows per sequence."
            ),
            click.option(
                "--context", type=int, default=None, help="Cache tokens per sequence [4096]."
            ),
            click.option(
                "--acceptance", type=float, default=None, help="Mean accepted tokens per step."
            ),
            click.option(
                "--quant", multiple=True, metavar="FAMILY=FORMAT", help="Weight format override."
            ),
        ]
    ):
        command = decorator(command)
    return command


def _shown(path: Path) -> str:
    """`path` relative to the working directory when it is below it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _build_dir_for(spec: Any, topo: Any, options: Any, output: Path | None) -> Path:
    """The build directory a --update-report writes to; it must hold this very build."""
    from mkgen.codegen.package import default_build_dir, load_build_inputs

    directory = output or default_build_dir(spec.name, topo)
    built_spec, built_topo, built_options, data = load_build_inputs(directory)
    if (
        built_spec.model_dump(mode="json") != options.apply(spec).model_dump(mode="json")
        or built_topo.name != topo.name
        or built_options != options
    ):
        raise MkgenError(
            f"{_shown(directory)} was built from other inputs ({data['build']['rebuild']}); "
            "pass the same options or rebuild it"
        )
    return directory


@cli.command("build", short_help="Generate the megakernel build of a spec.")
@click.argument("spec_ref", metavar="SPEC")
@_kernel_options
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path),
    help="Build directory (default: generated/<spec>-<shape>/ in the checkout).",
)
@click.option(
    "--force",
    is_flag=True,
    help="Overwrite a build mkgen wrote whose files were edited or deleted (never a "
    "directory or file mkgen did not write).",
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
    output: Path | None,
    force: bool,
) -> None:
    """Generate the megakernel build of SPEC: megakernel.py, runner.py, plan.json,
    REPORT.md and mini/ (the mini twin's build), written atomically. Same inputs give
    identical bytes; compile and verify results are added by `mkgen compile/verify
    --update-report`."""
    import time

    from mkgen.codegen.package import CommandLine, build_commands, default_build_dir, make_build

    _prepare_jax()
    spec, topo, options = _plan_inputs(
        spec_ref, topology, batch=batch, rows=rows, context=context, acceptance=acceptance,
        quant=quant, ring_depth=ring_depth, expert_slots=expert_slots, held_refills=held_refills,
    )  # fmt: skip
    # The printed commands name the build as the user did, so they run as printed.
    default_dir = output is None or output.resolve() == default_build_dir(spec.name, topo).resolve()
    line = CommandLine(
        spec=None if spec_ref == spec.name else spec_ref,
        output=None if default_dir else str(output),
    )
    start = time.perf_counter()
    result = make_build(spec, topo, options, output=output, force=force, line=line)
    seconds = time.perf_counter() - start
    r, where = result.rendered, _shown(result.directory)
    L, est = r.layout, r.plan.estimate
    if not result.written:
        click.echo(f"{where}/ is up to date (same inputs, identical files); nothing written")
        return
    click.echo(
        f"wrote {where}/ in {seconds:.1f} s: {spec.name} on {topo.name} ({topo.num_devices} "
        f"cores), batch {options.batch} x rows {options.rows}, context {options.context}"
    )
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
        f"({r.plan.confidence.calibrated_step_ms:.3f} with no refill held; "
        f"{r.plan.ideal_floor.times(est.step_ms)}), {est.tokens_per_s_per_user:.1f} tokens/s "
        "per user"
    )
    mini = json.loads(r.files["mini/plan.json"])["kernel"]
    click.echo(
        f"  mini/          {mini['model']}: {len(mini['attention_table'])} layers, hidden "
        f"{mini['hidden']}, banks of {mini['stream']['bank_rows']} rows, ring depth "
        f"{mini['stream']['ring_depth']}"
    )
    click.echo(f"  inputs sha256 {r.inputs_sha256}")
    commands = build_commands(spec.name, topo, options, line)
    if result.dropped:
        click.echo(f"  {_dropped(result.dropped)}")
    click.echo(f"next: {commands['verify']}; {commands['compile']}; {commands['inspect']}")


def _dropped(measurements: tuple[str, ...]) -> str:
    """What a rebuild says of the measurements it did not keep."""
    return (
        f"dropped the recorded {', '.join(measurements)} results: the kernel code changed "
        "or the build was edited (record them again)"
    )


@cli.command("verify", short_help="Check a spec's mini twin against the reference model.")
@click.argument("spec_ref", metavar="SPEC")
@click.option("--topology", required=True, help="CHIP:SHAPE or SHAPE, e.g. 2x2x1.")
@click.option("--steps", type=int, default=2, show_default=True, help="Decode steps per mode.")
@click.option("--batch", type=int, default=1, show_default=True, help="Sequences per step.")
@click.option("--rows", type=int, default=1, show_default=True, help="Rows per sequence.")
@click.option("--context", type=int, default=128, show_default=True, help="Mini cache tokens.")
@click.option(
    "--seed", type=SEED, default=0, show_default=True, help="Seed of the random weights and tokens."
)
@click.option(
    "--quant",
    multiple=True,
    metavar="FAMILY=FORMAT",
    help="The build's weight format overrides (the twin keeps its own block sizes).",
)
@click.option(
    "--mode",
    type=click.Choice(["on_wait", "eager", "both"]),
    default="both",
    show_default=True,
    help="DMA execution mode of TPU interpret mode.",
)
@click.option(
    "--timeout", type=float, default=900.0, show_default=True, help="Seconds per mode (deadlock)."
)
@click.option("--update-report", is_flag=True, help="Record the results in the build's REPORT.md.")
@click.option(
    "-o", "--output", type=click.Path(path_type=Path), help="The build for --update-report."
)
@_knob_options
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
) -> None:
    """Run SPEC's mini twin on TOPOLOGY's mesh in TPU interpret mode (virtual CPU devices,
    race detection, uninitialised memory as NaN) against the reference model, in each DMA
    execution mode. Exit 0 if every check passes, 1 naming the first failure."""
    from mkgen.codegen.package import mini_kernel_args
    from mkgen.kinds import default_registry
    from mkgen.plan import plan_build
    from mkgen.plan.options import BuildOptions
    from mkgen.plan.sharding import full_size_splits
    from mkgen.spec.mini import mini_twin
    from mkgen.verify import checks

    knobs = {
        k: v
        for k, v in (
            ("ring_depth", ring_depth),
            ("expert_slots", expert_slots),
            ("held_refills", held_refills),
        )
        if v is not None
    }
    spec, topo, built = _plan_inputs(spec_ref, topology, quant=quant, **knobs)
    options = BuildOptions.create(batch=batch, rows=rows, context=context, **knobs)
    if not 1 <= steps * rows <= context:
        raise MkgenError(
            f"--steps {steps}: each step writes --rows {rows} token(s) into the mini caches of "
            f"--context {context} tokens; give 1 to {context // rows} steps"
        )
    if not 0 < timeout < math.inf:
        raise MkgenError(f"--timeout {timeout:g}: give a finite number of seconds above 0")
    # Unsupported kinds or formats, or a plan that would hang: exit 2 here, not later.
    plan_build(spec, topo, built, kinds=default_registry())
    spec = built.apply(spec)
    mini = mini_twin(spec, topo.num_devices)
    splits = full_size_splits(spec, topo, options, kinds=default_registry())
    plan_build(
        mini,
        topo,
        options.model_copy(update={"splits": splits}),
        **mini_kernel_args(),
        kinds=default_registry(),
    )
    directory = None
    if update_report:
        from mkgen.codegen.package import default_build_dir, load_build_inputs

        directory = output or default_build_dir(spec.name, topo)
        built = load_build_inputs(directory)[2]
        if (built.batch, built.rows) != (batch, rows):
            raise MkgenError(
                f"{_shown(directory)} is built for batch {built.batch} x rows {built.rows}; "
                f"verify with --batch {built.batch} --rows {built.rows}"
            )
    _verify_and_print(
        spec_ref, spec, topo, checks.modes_of(mode), directory, steps=steps, batch=batch,
        rows=rows, context=context, seed=seed, timeout=timeout, quant=quant, knobs=knobs,
    )  # fmt: skip


def _verify_and_print(
    spec_ref: str,
    spec: Any,
    topo: Any,
    modes: tuple[str, ...],
    directory: Path | None,
    **run: Any,
) -> None:
    """Run verify mode by mode, print a table each, record, exit 1 on a failure."""
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
    with _progress(None, "verify", "step") as bar:
        bar.reset(total=len(modes) * run["steps"])
        for mode in modes:
            bar.set_postfix_str(f"DMA mode {mode}")
            reports += checks.run_verify(
                spec_ref, topo.name, modes=(mode,), on_step=bar.update, **run
            )
            for line in checks.verify_lines(reports[-1]):
                bar.write(line, file=sys.stdout)
    if directory is not None:
        from mkgen.codegen.package import record_measurement

        record = checks.verify_record(reports, **{k: v for k, v in run.items() if k != "timeout"})
        record_measurement(directory, "verify", record)
        click.echo(f"recorded in {_shown(directory)}/REPORT.md")
    failure = checks.first_failure(reports)
    if failure:
        click.echo(f"verify: FAILED: {failure}")
        sys.exit(1)
    click.echo(f"verify: passed ({len(modes)} mode(s) x {run['steps']} step(s))")


@cli.command("compile", short_help="Compile a spec's full-size kernel for TPU7x.")
@click.argument("spec_ref", metavar="SPEC")
@_kernel_options
@click.option("--update-report", is_flag=True, help="Record the results in the build's REPORT.md.")
@click.option(
    "-o", "--output", type=click.Path(path_type=Path), help="The build for --update-report."
)
@click.option(
    "--profile",
    is_flag=True,
    help="Count the compiled kernel's ops per phase (Mosaic's LLO) beside the model's.",
)
@click.option("--json", "as_json", is_flag=True, help="With --profile: the profile as JSON.")
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
    _prepare_jax()
    spec, topo, options = _plan_inputs(
        spec_ref, topology, batch=batch, rows=rows, context=context, acceptance=acceptance,
        quant=quant, ring_depth=ring_depth, expert_slots=expert_slots, held_refills=held_refills,
    )  # fmt: skip
    directory = _build_dir_for(spec, topo, options, output) if update_report else None
    if profile:
        _profile_and_print(spec, topo, options, as_json, directory)
        return
    _compile_and_print(spec, topo, options, directory)


def _profile_and_print(
    spec: Any, topo: Any, options: Any, as_json: bool, directory: Path | None
) -> None:
    """Compile with Mosaic's LLO dump on (a child process), print the profile table and
    record it (and the compile) in the build at `directory`."""
    from mkgen.codegen.package import build_name
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
        click.echo(f"  recorded in {_shown(directory)}/REPORT.md")


def _compile_and_print(spec: Any, topo: Any, options: Any, directory: Path | None) -> None:
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
        click.echo(f"  recorded in {_shown(directory)}/REPORT.md")
    if outcome.plan_below_mosaic:
        sys.exit(1)


@cli.command("convert", short_help="Pack a checkpoint into a build's per-core weights.")
@click.argument("spec_ref", metavar="[SPEC]", required=False)
@click.option(
    "--checkpoint",
    type=click.Path(path_type=Path),
    help="Hugging Face checkpoint directory (config.json, safetensors shards and index).",
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
@click.option("--topology", help="CHIP:SHAPE or SHAPE, e.g. 2x2x4 (without --build).")
@click.option("--batch", type=int, default=1, show_default=True, help="Sequences.")
@click.option("--rows", type=int, default=1, show_default=True, help="Rows per sequence.")
@click.option("--context", type=int, default=None, help="Cache tokens per sequence [4096].")
@click.option("--quant", multiple=True, metavar="FAMILY=FORMAT", help="Weight format override.")
@click.option(
    "-o", "--output", type=click.Path(path_type=Path), required=True, help="Weights directory."
)
@click.option("--force", is_flag=True, help="Replace a conversion made from other inputs.")
def convert_command(
    spec_ref: str | None,
    checkpoint: Path | None,
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
    bar on stderr when it is a terminal."""
    from mkgen.codegen import convert
    from mkgen.plan.layout import KernelLayout
    from mkgen.spec.hf_import import import_hf_config

    if (checkpoint is None) == (random_weights is None):
        raise MkgenError("give one of --checkpoint DIR and --random-weights SEED")
    convert.check_output(output)  # before the plan and the checkpoint's headers are read
    if build_dir is not None:
        from mkgen.codegen.package import load_build_inputs

        if spec_ref or topology or quant:
            raise MkgenError("--build takes spec, topology and formats from the build")
        spec, topo, options, data = load_build_inputs(build_dir)
        layout = KernelLayout.model_validate(data["kernel"])
        kernel_args = data["kernel_args"]
    else:
        if not topology:
            raise MkgenError("give --topology (or --build BUILD)")
        if spec_ref is None and checkpoint is None:
            raise MkgenError("give SPEC (or --checkpoint DIR, whose config.json is the spec)")
        from mkgen.plan.options import BuildOptions, refuse_repeated_families
        from mkgen.spec.loader import load_spec
        from mkgen.spec.topology import parse_topology

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
        from mkgen.codegen.package import resolved_kernel_args
        from mkgen.kinds import default_registry
        from mkgen.plan import plan_build

        plan = plan_build(spec, topo, options, kinds=default_registry())
        layout, kernel_args = plan.kernel, resolved_kernel_args(plan)
    identity = convert.build_identity(spec, topo.name, options.model_dump(mode="json"), kernel_args)
    if checkpoint is not None:
        source, fingerprint = convert.checkpoint_source(spec, Path(checkpoint))
        identity["checkpoint"] = fingerprint
    else:
        from mkgen.codegen.quantize import stored_random_weights

        _prepare_jax()
        source = convert.InventorySource(stored_random_weights(spec, random_weights))
        identity["random_weights"] = random_weights
    tokenizer_files = [
        Path(checkpoint) / name for name in convert.TOKENIZER_FILES if checkpoint is not None
    ]
    result = convert.convert(
        spec, layout, source, output, identity=identity, force=force, progress=True,
        tokenizer_files=[path for path in tokenizer_files if path.is_file()],
    )  # fmt: skip
    if result.skipped == ["all"]:
        changes = [f"copied {name} from the checkpoint" for name in result.tokenizers_copied]
        changes += [f"removed {name} (not in the checkpoint)" for name in result.tokenizers_removed]
        kept = f"{_shown(output)}/ is up to date ({result.files} files verified)"
        click.echo("; ".join([kept, *changes]))
        return
    resumed = (
        f"; resumed: {len(result.skipped)} unit(s) verified and kept" if result.skipped else ""
    )
    click.echo(
        f"wrote {_shown(output)}/ in {result.seconds:.1f} s: {spec.name} for {topo.name} "
        f"({layout.devices} cores), {result.files} files, {result.bytes / 2**20:,.1f} MiB{resumed}"
    )


@cli.command(
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

    run(_runner_build(build), list(runner_args), prog="mkgen run", usage=f"mkgen run {build}")


def _runner_build(build: str) -> Any:
    """The runtime Build of BUILD: a build directory, or a build's name in generated/."""
    from mkgen.codegen.package import GENERATED
    from mkgen.runtime.build import RUNNER_FILE, runner_build

    directory = Path(build)
    if not (directory / RUNNER_FILE).exists() and not directory.is_absolute():
        directory = GENERATED / build
    if not (directory / RUNNER_FILE).exists():
        elsewhere = "" if Path(build).is_absolute() else f" nor in generated/{build}"
        raise MkgenError(f"{build}: no {RUNNER_FILE} there{elsewhere}")
    return runner_build(directory)


@cli.command("serve", short_help="Serve a build behind an OpenAI-compatible API.")
@click.argument("build", metavar="BUILD")
@click.option(
    "--weights", type=click.Path(path_type=Path), help="Converted weights (mkgen convert)."
)
@click.option(
    "--random-weights", type=SEED, default=None, metavar="SEED",
    help="The reference's random weights instead of --weights (the mini/ build on CPU).",
)  # fmt: skip
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
    help="Port to listen on (0: a free one, printed).",
)  # fmt: skip
@click.option("--interpret", is_flag=True, help="TPU interpret mode on virtual CPU devices.")
@click.option(
    "--steps-per-call", type=click.IntRange(min=1), default=8, show_default=True,
    help="Kernel steps per device call.",
)  # fmt: skip
@click.option(
    "--queue-limit", type=click.IntRange(min=0), default=64, show_default=True,
    help="Requests waiting for a slot before new ones get 429.",
)  # fmt: skip
@click.option("--trust-weights", is_flag=True, help="Skip the sha256 check of the weights.")
@click.option(
    "--disaggregate", is_flag=True,
    help="Prefill on a second set of the build's device count, decode on the first.",
)  # fmt: skip
@click.option(
    "--host-cache-mib", type=click.IntRange(min=0), default=HOST_CACHE_MIB, show_default=True,
    help="Host memory for finished sequences' caches, reused by prompts that start with "
    "them (0: off).",
)  # fmt: skip
@click.option(
    "--multi-host", is_flag=True,
    help="One process of a multi-host job (jax.distributed, one per host): process 0 serves "
    "HTTP, the others follow its engine.",
)  # fmt: skip
@click.option("--coordinator", metavar="HOST:PORT", help="Process 0's address (--multi-host).")
@click.option(
    "--num-processes", type=click.IntRange(min=1), help="Processes in the job (--multi-host)."
)
@click.option(
    "--process-id", type=click.IntRange(min=0), help="This process's index (--multi-host)."
)
@click.option(
    "--served-model-name", metavar="NAME",
    help="The model name clients give (default: the build's spec name, e.g. qwen3-30b-a3b).",
)  # fmt: skip
@click.option(
    "--max-body-mib", type=click.IntRange(min=1), default=MAX_BODY_MIB, show_default=True,
    help="A request body over this many MiB is refused (413) before it is read whole.",
)  # fmt: skip
@click.option(
    "--drain-seconds", type=click.FloatRange(min=0), default=DRAIN_S, show_default=True,
    help="On SIGTERM or Ctrl-C, how long queued and running requests may go on (new ones "
    "get 503); those still running then end with finish_reason abort.",
)  # fmt: skip
def serve_command(
    build: str, weights: Path | None, random_weights: int | None, host: str, port: int,
    interpret: bool, steps_per_call: int, queue_limit: int, trust_weights: bool,
    disaggregate: bool, host_cache_mib: int, multi_host: bool, coordinator: str | None,
    num_processes: int | None, process_id: int | None, served_model_name: str | None,
    max_body_mib: int, drain_seconds: float,
) -> None:  # fmt: skip
    """Serve a build behind an OpenAI-compatible API (docs/serving.md#serve): BUILD is a
    build directory or a build's name in generated/ (with --rows R > 1, R - 1 drafts
    per step are verified); the `openai` client talks to http://HOST:PORT/v1 with any api
    key. The server compiles first (/health: 503 "warming up", then 200). SIGTERM or
    Ctrl-C drains: new requests get 503 while queued and running ones go on for up to
    --drain-seconds; those still running then end with finish_reason "abort" (a stream
    still gets its last event and [DONE]), and the server exits; a second signal skips
    the rest of the drain."""
    if (weights is None) == (random_weights is None):
        raise MkgenError("give --weights WEIGHTS (mkgen convert) or --random-weights SEED")
    if trust_weights and weights is None:
        raise MkgenError("--trust-weights: only with --weights (converted weights)")
    if served_model_name is not None and not served_model_name.strip():
        raise MkgenError("--served-model-name: give a name (or leave it out: the spec's name)")
    check_multi_host_flags(multi_host, disaggregate, coordinator, num_processes, process_id)
    if multi_host and interpret:
        raise MkgenError(INTERPRET_ACROSS_PROCESSES)
    distributed = {"coordinator": coordinator, "num_processes": num_processes}
    distributed["process_id"] = process_id
    from mkgen.serve.server import serve

    serve(
        _runner_build(build), weights=weights, random_weights=random_weights, host=host,
        port=port, interpret=interpret, steps_per_call=steps_per_call,
        queue_limit=queue_limit, trust_weights=trust_weights, disaggregate=disaggregate,
        host_cache_mib=host_cache_mib,
        multi_host=Namespace(**distributed) if multi_host else None,
        served_model_name=served_model_name, max_body_mib=max_body_mib,
        drain_seconds=drain_seconds,
    )  # fmt: skip


@cli.command(
    "bench",
    short_help="Benchmark the runner at several batch sizes.",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
)
@click.argument("spec_ref", metavar="SPEC")
@click.option("--topology", required=True, help="CHIP:SHAPE or SHAPE, e.g. 2x2x4.")
@click.option("--batches", default="1,2,4,8", show_default=True, help="Batch sizes to build.")
@click.option("--rows", type=int, default=1, show_default=True, help="Rows per sequence.")
@click.option("--context", type=int, default=None, help="Cache tokens per sequence [4096].")
@click.option("--quant", multiple=True, metavar="FAMILY=FORMAT", help="Weight format override.")
@click.option("--mini", is_flag=True, help="Run each build's mini twin (CPU: with --interpret).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON list, a row per batch.")
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

    sizes = _positive_list("--batches", batches)
    rows_out = []
    with (
        tempfile.TemporaryDirectory(prefix="mkgen-bench-") as tmp,
        _progress(sizes, "bench", "batch") as bar,
    ):
        for batch in bar:
            bar.set_postfix_str(f"batch {batch}: build, then run the runner")
            spec, topo, options = _plan_inputs(
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


@cli.command("inspect", short_help="Outline a generated kernel's phases, DMAs and VMEM.")
@click.argument("build", metavar="BUILD")
@click.option("--layer", type=int, help="Show one layer's schedule next to its code.")
def inspect_command(build: str, layer: int | None) -> None:
    """Outline a generated kernel (BUILD: a build directory or a name in generated/):
    each phase of each layer kind with its lines in megakernel.py, the DMAs in flight
    and the VMEM map."""
    from mkgen.verify.inspect import layer_view, outline

    _prepare_jax()
    click.echo(outline(build) if layer is None else layer_view(build, layer))


@cli.command("regen", short_help="Rebuild every checked-in build in generated/BUILDS.")
@click.option(
    "--measure",
    is_flag=True,
    help="Also compile and verify each build and record the results in its REPORT.md.",
)
def regen_command(measure: bool) -> None:
    """Rebuild every checked-in build listed in generated/BUILDS (with --force)."""
    from mkgen.codegen.package import (
        BUILD_LIST,
        MINI_CONTEXT,
        default_build_dir,
        entry_inputs,
        make_build,
        read_build_list,
    )

    _prepare_jax()
    for entry in read_build_list(BUILD_LIST):
        spec, topo, options = entry_inputs(entry)
        directory = default_build_dir(spec.name, topo)
        result = make_build(spec, topo, options, output=directory, force=True)
        state = "rewritten" if result.written else "unchanged"
        dropped = f"; {_dropped(result.dropped)}" if result.dropped else ""
        click.echo(f"{_shown(directory)}: {state} (mkgen build {entry.line}){dropped}")
        if measure:
            from mkgen.verify import checks

            _compile_and_print(spec, topo, options, directory)
            _verify_and_print(
                entry.spec, options.apply(spec), topo, checks.modes_of("both"), directory,
                steps=2, batch=options.batch, rows=options.rows, context=MINI_CONTEXT, seed=0,
                timeout=900.0, quant=tuple(f"{f}={v}" for f, v in options.quant),
            )  # fmt: skip


# What `mkgen --help` lists: one whole line per command (click would cut the docstrings'
# first sentences, which say more, mid-sentence); tests/test_cli.py holds every command
# to one.


def main(argv: list[str] | None = None) -> None:
    """Console entry point: user errors become one line and exit status 2."""
    run: Callable[..., Any] = cli.main
    try:
        run(args=argv, prog_name="mkgen", standalone_mode=False)
    except click.exceptions.Abort:
        _fail("aborted")
    except click.ClickException as error:
        _fail(error.format_message())
    except MkgenError as error:
        _fail(str(error))


if __name__ == "__main__":
    main()
