"""Commands about model specs: `list`, `show` and `import-hf`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from mkgen.cli.options import force_option, json_option, output_option, spec_argument
from mkgen.output import write_atomic


@click.command("list", short_help="List the model specs, chips and slices.")
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


@click.command("show", short_help="Summarise a model spec: dims, kinds, parameters, bytes.")
@spec_argument()
@json_option("Print one JSON object.")
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


@click.command("import-hf", short_help="Map a Hugging Face config.json to a model spec.")
@click.argument("config", type=click.Path(path_type=Path))
@output_option("Write the spec here.")
@click.option("--name", help="Spec name (default: the directory's or file's name).")
@click.option(
    "--keep-mtp",
    is_flag=True,
    help="Keep the checkpoint's multi-token-prediction layers as the spec's `mtp` draft "
    "section (no kernel drafts with it yet: docs/drafting.md).",
)
@force_option("Overwrite an existing output file.")
def import_hf_command(
    config: Path, output: Path | None, name: str | None, keep_mtp: bool, force: bool
) -> None:
    """Map a Hugging Face config.json, or a checkpoint directory's, to a model spec (YAML
    on stdout or -o FILE)."""
    from mkgen.spec.hf_import import render_spec_yaml

    text = render_spec_yaml(config, name, keep_mtp)
    if output is None:
        click.echo(text, nl=False)
        return
    write_atomic(
        output, text, may_replace=lambda _: force, refusal="exists; pass --force to overwrite it"
    )
    click.echo(f"wrote {output}")
