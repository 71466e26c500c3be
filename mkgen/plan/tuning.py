"""Rewriting the planner's tables of tuned choices: holds.json (the refills held for
collectives, mkgen/plan/holds.py) and kvtiles.json (the KV tiles, mkgen/plan/kvtiles.py).

Only scripts/tune_holds.py runs it: it plans builds, so the planner never imports it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mkgen.plan import holds, kvtiles
from mkgen.plan.kind import KindRegistry
from mkgen.plan.options import BuildOptions
from mkgen.plan.program import score_held_refills, tile_digest
from mkgen.spec.draft_import import load_drafter
from mkgen.spec.loader import load_spec
from mkgen.spec.schema import ModelSpec
from mkgen.spec.topology import parse_topology


def build_spec(spec_name: str, draft: str | None) -> ModelSpec:
    """The spec a build plans: drafting with `draft` (as `mkgen build --draft`) if named."""
    spec = load_spec(spec_name)
    return spec if draft is None else load_drafter(draft, spec)


def entry(
    spec_name: str,
    topology: str,
    fields: dict[str, Any],
    kinds: KindRegistry,
    draft: str | None = None,
) -> dict[str, Any]:
    """The table entry of a build: its inputs, digest and the scorer's choice (scored
    now, whatever the table says; its layer kinds sharded by the rules in `kinds`)."""
    digest, choice, _ = score_held_refills(
        build_spec(spec_name, draft), parse_topology(topology), BuildOptions.create(**fields), kinds
    )
    return {
        "spec": spec_name,
        **({"draft": draft} if draft else {}),
        "topology": topology,
        "options": fields,
        "digest": digest,
        "held_refills": choice.held,
        "refills_per_round": choice.per_round,
    }


def write_table(table: Path, what: str, entries: list[dict[str, Any]]) -> None:
    """`table` (holds.json or kvtiles.json) holding `entries`, the tuned `what` choices."""
    data = {
        "about": f"Tuned {what} choices (mkgen/plan/{table.stem}.py): what the planner's "
        "scorer chose for each build, keyed by the digest of its inputs and the cost model's "
        "constants. Rewrite with `python scripts/tune_holds.py`.",
        "entries": entries,
    }
    staged = table.with_suffix(".json.tmp")  # never a half-written table
    staged.write_text(json.dumps(data, indent=1) + "\n")
    staged.replace(table)


_BOOLEANS = {"true": True, "false": False}


def _parse_fields(items: list[str]) -> dict[str, Any]:
    """`rows=8 quant=experts=int4:128 fuse_draft=true` -> BuildOptions fields (ints and
    booleans where they are), and `draft=DRAFT` (main takes it out: a drafter, not a build
    option)."""
    fields: dict[str, Any] = {}
    for item in items:
        key, _, value = item.partition("=")
        if key == "quant":
            fields.setdefault("quant", []).append(value)
        else:
            fields[key] = int(value) if value.isdigit() else _BOOLEANS.get(value, value)
    return fields


def main(argv: list[str], kinds: KindRegistry) -> None:
    """Score every entry of the table again (and a new one, if given) and rewrite it, and
    the KV tile table (mkgen/plan/kvtiles.py) with the tiles each entry's build chose."""
    current = json.loads(holds.TABLE.read_text())["entries"]
    wanted = [(e["spec"], e["topology"], e["options"], e.get("draft")) for e in current]
    if argv:
        fields = _parse_fields(argv[2:])
        wanted.append((argv[0], argv[1], fields, fields.pop("draft", None)))
    entries, tiles = [], []
    for spec_name, topology, fields, draft in wanted:
        with kvtiles.rescoring():
            made = entry(spec_name, topology, fields, kinds, draft)
        digest = tile_digest(
            build_spec(spec_name, draft), parse_topology(topology), BuildOptions.create(**fields),
            kinds,
        )  # fmt: skip
        choice = kvtiles.scored_choice(digest)
        if choice is not None and all(t["digest"] != digest for t in tiles):
            inputs = {
                k: v for k, v in made.items() if k in ("spec", "draft", "topology", "options")
            }
            tiles.append({**inputs, "digest": digest, "choice": choice.model_dump(mode="json")})
        if all(made["digest"] != e["digest"] for e in entries):
            entries.append(made)
            drafted = f" --draft {draft}" if draft else ""
            print(f"{spec_name}{drafted} {topology} {fields}: {made['held_refills']} held, "
                  f"{made['refills_per_round']} a round")  # fmt: skip
    write_table(holds.TABLE, "held-refill", entries)
    write_table(kvtiles.TABLE, "KV tile", tiles)
