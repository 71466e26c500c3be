"""Commands that plan without building: `plan` and `estimate` (predictions of the cost
model)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from mkgen.cli.options import (
    acceptance_option,
    batch_option,
    context_option,
    draft_option,
    drafting_spec,
    force_option,
    json_option,
    knob_options,
    output_option,
    plan_inputs,
    positive_list,
    quant_option,
    rows_option,
    shown,
    spec_argument,
    topology_option,
)
from mkgen.errors import MkgenError
from mkgen.output import write_atomic


@click.command("plan", short_help="Plan a spec on a topology, with its predicted step time.")
@spec_argument()
@topology_option()
@batch_option("Sequences per step.")
@rows_option
@acceptance_option
@draft_option
@context_option
@quant_option()
@click.option("--vmem-budget", "vmem_budget", metavar="SIZE", help="Explicit VMEM, e.g. 48MiB.")
@click.option("--price", type=float, default=None, help="USD per chip-hour.")
@json_option("Print one JSON object.")
@click.option("--trace", type=click.Path(path_type=Path), help="Write a Perfetto trace here.")
@force_option("Overwrite a --trace file mkgen did not write.")
@knob_options
def plan_command(spec_ref: str, topology: str, as_json: bool, trace: Path | None, force: bool,
                 draft: str | None, **fields: Any) -> None:  # fmt: skip
    """Plan SPEC on a topology: sharding, HBM and VMEM, schedule checks, predicted step
    (with --draft: verify + draft, the drafter priced by the same cost model)."""
    from mkgen.kinds import default_registry
    from mkgen.plan import plan_build, to_chrome_trace
    from mkgen.plan.report import plan_text

    spec, topo, options = plan_inputs(spec_ref, topology, **fields)
    spec = drafting_spec(spec, draft, options.rows)
    plan = plan_build(spec, topo, options, trace=trace is not None, kinds=default_registry(),
                      price_drafter=draft is not None)  # fmt: skip
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


@click.command("estimate", short_help="Predict tokens per dollar against tokens/s per user.")
@spec_argument()
@topology_option()
@output_option("Directory for the CSV, SVG and PNG (default: the current directory).")
@click.option("--batches", default="1,2,4,8,16,32,64", show_default=True, help="Batch sizes.")
@click.option(
    "--rows", "rows_list", default="1", show_default=True,
    help="Rows per sequence, e.g. 1,4,8 (rows > 1 need --acceptance).",
)  # fmt: skip
@click.option(
    "--acceptance", type=float, default=None,
    help="Mean tokens accepted per step when rows > 1 (capped at each row count).",
)  # fmt: skip
@draft_option
@click.option(
    "--scenario", default="agentic", show_default=True, metavar="NAME",
    help="Request shape the total tokens per $ price: agentic, chat or decode.",
)  # fmt: skip
@context_option
@quant_option()
@click.option("--price", type=float, default=None, help="USD per chip-hour [catalog estimate].")
@click.option(
    "--reference-price", "reference_prices", multiple=True, metavar="CHIP=USD",
    help="Chip-hour price of a published reference (e.g. GB300=2.31).",
)  # fmt: skip
def estimate_command(spec_ref: str, topology: str, output: Path | None, batches: str,
                     rows_list: str, scenario: str, reference_prices: tuple[str, ...],
                     draft: str | None, **fields: Any) -> None:  # fmt: skip
    """Predict total tokens per dollar against tokens/s per user over batch x rows: the
    table, SPEC-SHAPE-estimate.csv, and the chart as .svg and .png, with the published
    reference points (mkgen/plan/tco.py)."""
    from mkgen.kinds import default_registry
    from mkgen.plan import tco
    from mkgen.plan.options import MAX_TOKEN_ROWS
    from mkgen.plan.report import estimate_chart_text, sweep, sweep_csv, sweep_table, tco_chart

    sizes = positive_list("--batches", batches)
    row_counts = positive_list("--rows", rows_list)
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
    spec, topo, options = plan_inputs(spec_ref, topology, rows=max(row_counts), **fields)
    spec = drafting_spec(spec, draft, min(row_counts))
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
    rows = sweep(spec, topo, options, request, batches=sizes, rows=row_counts,
                 kinds=default_registry(), price_drafter=draft is not None)  # fmt: skip
    drafted = f" --draft {draft}" if draft else ""
    step = "verify + draft, the draft priced by the same model" if draft else "its predicted step"
    click.echo(
        f"{spec.name} on {topo.name}, context {options.context}, {request.describe()}; each row "
        f"is the build `mkgen plan {spec.name} --topology {topology} --batch B --rows R"
        f"{drafted}` plans (step ms: {step}; calib ms: the same with no refill held in the "
        "verify, the calibrated regime; floor ms: the ideal floor). Predictions of the cost "
        "model."
    )
    click.echo(sweep_table(rows))
    title, notes = estimate_chart_text(spec.name, topo, price, request, prices, draft)
    references = tuple(tco.priced(curve, prices) for curve in tco.REFERENCES)
    name = f"{spec.name}-{topo.shape_name}-estimate"
    directory = output or Path(".")
    files = [(".csv", sweep_csv(rows).encode())] + [
        (f".{fmt}", tco_chart(rows, title=title, notes=notes, references=references, fmt=fmt))
        for fmt in ("svg", "png")
    ]
    click.echo(f"wrote to {shown(directory)}/ (-o DIR chooses the directory):")
    header = sweep_csv([])  # an earlier estimate is recognised by its CSV header or title
    for suffix, data in files:
        path = directory / f"{name}{suffix}"
        earlier = header if suffix == ".csv" else title
        write_atomic(
            path, data, may_replace=lambda old, mark=earlier: mark in old,
            refusal="exists and is not an estimate mkgen wrote; move it or choose another -o",
        )  # fmt: skip
        click.echo(f"  {path}")
