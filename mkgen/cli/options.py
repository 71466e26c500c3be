"""The option declarations several commands share, written once (click decorators), and
the helpers that turn their values into a spec, a topology and BuildOptions.

Each factory takes only what differs between the commands that use it (a help text, an
example topology), so every command's `--help` reads as it always has."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from mkgen.errors import MkgenError
from mkgen.output import progress_bar

Command = TypeVar("Command", bound=Callable[..., Any])
Decorator = Callable[[Command], Command]

# Random weights come from jax.random.key(seed), which takes 32-bit seeds.
SEED = click.IntRange(0, 2**32 - 1)


def compose(*decorators: Callable[[Any], Any]) -> Callable[[Command], Command]:
    """One decorator applying `decorators` as if stacked in this order (top first), so the
    options appear in `--help` in this order."""

    def apply(command: Command) -> Command:
        for decorator in reversed(decorators):
            command = decorator(command)
        return command

    return apply


def spec_argument(*, required: bool = True) -> Callable[[Command], Command]:
    """SPEC: a name in model_specs/, a YAML file or a config.json (`[SPEC]` when optional)."""
    return click.argument("spec_ref", metavar="SPEC" if required else "[SPEC]", required=required)


def topology_option(
    example: str = "2x2x4", *, required: bool = True, note: str = ""
) -> Callable[[Command], Command]:
    return click.option(
        "--topology", required=required, help=f"CHIP:SHAPE or SHAPE, e.g. {example}{note}."
    )


def batch_option(help: str) -> Callable[[Command], Command]:
    return click.option("--batch", type=int, default=1, show_default=True, help=help)


rows_option = click.option(
    "--rows", type=int, default=1, show_default=True, help="Rows per sequence."
)
context_option = click.option(
    "--context", type=int, default=None, help="Cache tokens per sequence [4096]."
)
draft_option = click.option(
    "--draft", metavar="DRAFT", default=None,
    help="A drafter (rows > 1), priced beside the verify step; a build carries it and its "
    "runner drafts with it: mtp (the spec's own MTP layers), a drafter spec in "
    "model_specs/drafters/ or a .yaml, or a drafter's config.json.",
)  # fmt: skip
acceptance_option = click.option(
    "--acceptance", type=float, default=None, help="Mean accepted tokens per step."
)


def quant_option(help: str = "Weight format override.") -> Callable[[Command], Command]:
    return click.option("--quant", multiple=True, metavar="FAMILY=FORMAT", help=help)


def json_option(help: str) -> Callable[[Command], Command]:
    return click.option("--json", "as_json", is_flag=True, help=help)


def force_option(help: str) -> Callable[[Command], Command]:
    return click.option("--force", is_flag=True, help=help)


def output_option(help: str, *, required: bool = False) -> Callable[[Command], Command]:
    return click.option(
        "-o", "--output", type=click.Path(path_type=Path), required=required, help=help
    )


update_report_options = compose(
    click.option(
        "--update-report", is_flag=True, help="Record the results in the build's REPORT.md."
    ),
    output_option("The build for --update-report."),
)

# The kernel knobs shared by `plan`, `build`, `compile` and `verify` (plan fields).
knob_options = compose(
    click.option("--ring-depth", type=int, default=None, help="Weight banks in flight [planner]."),
    click.option(
        "--expert-slots", type=int, default=None, help="Expert pieces in flight [planner]."
    ),
    click.option(
        "--held-refills",
        type=int,
        default=None,
        help="Ring refills held for the collectives' rounds [planner].",
    ),
    click.option(
        "--kv-tile",
        type=int,
        default=None,
        help="Cache tokens per KV tile of every cache attention kind [planner].",
    ),
    click.option(
        "--collectives",
        default=None,
        metavar="auto|staged|flat|scatter",
        help="Rounds of the collectives: a round in each host then one across hosts, one "
        "round of every core, all-reduces scattered over the host (reduce-scatter, "
        "all-reduce across hosts, all-gather), or per collective whichever the cost model "
        "prices lowest [auto].",
    ),
    click.option(
        "--expert-sharing",
        default=None,
        metavar="auto|none|quarter|half|full",
        help="Of each expert group's experts, the share the group before it in a ring also "
        "holds (the ring splits their active ones): the planner's choice, or forced [auto].",
    ),
    click.option(
        "--residual-snapshots",
        type=click.Choice(["vmem", "hbm"]),
        default=None,
        help="Where the attention-residual snapshots live [planner: VMEM if it holds them].",
    ),
    click.option(
        "--recurrent-states",
        type=click.Choice(["vmem", "stream"]),
        default=None,
        help="Recurrent states all in VMEM, or streamed a sequence at a time [planner].",
    ),
    click.option(
        "--fuse-draft",
        is_flag=True,
        default=None,
        help="Run the --draft mtp drafter inside the kernel, its passes layers of the step "
        "(docs/drafting.md) [between kernel calls].",
    ),
)

# --topology and the build options shared by `build` and `compile`.
kernel_options = compose(
    knob_options,
    topology_option("2x2x1"),
    batch_option("Sequences."),
    rows_option,
    context_option,
    acceptance_option,
    quant_option(),
)


def fail(message: str) -> None:
    click.echo(f"mkgen: error: {message}", err=True)
    sys.exit(2)


def shown(path: Path) -> str:
    """`path` relative to the working directory when it is below it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def progress(items: Any, desc: str, unit: str) -> Any:
    """A bar over `items` on a terminal's stderr (mkgen.output.progress_bar)."""
    return progress_bar(items, desc=desc, unit=unit)


def positive_list(flag: str, text: str) -> tuple[int, ...]:
    """`1,2,4` -> (1, 2, 4); an error naming `flag` otherwise."""
    try:
        sizes = tuple(int(b) for b in text.split(","))
    except ValueError:
        raise MkgenError(f"{flag} {text!r}: write sizes like 1,2,4,8") from None
    if not sizes or min(sizes) < 1:
        raise MkgenError(f"{flag} {text!r}: sizes must be positive integers")
    return sizes


def drafting_spec(spec: Any, draft: str | None, rows: int) -> Any:
    """`spec` with the drafter `--draft` names attached (mkgen.spec.draft_import), or
    without a drafter when none is named (a spec's own MTP section drafts only with --draft
    mtp); refused in one line on a rows-1 plan, which verifies no draft."""
    if draft is None:
        return spec.model_copy(update={"draft": None})
    if rows < 2:
        raise MkgenError(
            f"--draft {draft}: --rows {rows} verifies no drafts, so there is no draft to price; "
            "pass --rows 2 or more (e.g. --rows 8)"
        )
    from mkgen.spec.draft_import import load_drafter

    return load_drafter(draft, spec)


def plan_inputs(spec_ref: str, topology: str, **fields: Any) -> tuple[Any, Any, Any]:
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


def prepare_jax() -> None:
    """JAX on the CPU unless told otherwise (libtpu only serves compile-only devices here);
    libtpu's start-up noise on stderr is swallowed."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from mkgen.verify.tpu_compile import quiet_stderr

    with quiet_stderr():
        import jax  # noqa: F401
