"""generated/BUILDS: the checked-in builds, one `mkgen build` line each."""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mkgen.codegen.naming import GENERATED
from mkgen.errors import MkgenError
from mkgen.plan.options import BuildOptions
from mkgen.spec.schema import ModelSpec
from mkgen.spec.topology import Topology, parse_topology

BUILD_LIST = GENERATED / "BUILDS"  # the checked-in builds, one `mkgen build` line each


@dataclass(frozen=True)
class BuildEntry:
    """One line of generated/BUILDS: the arguments of `mkgen build`."""

    line: str
    spec: str
    topology: str
    options: dict[str, Any]
    draft: str | None = None  # --draft: the build's drafter (mkgen.spec.draft_import)


def _entry_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="generated/BUILDS", add_help=False, exit_on_error=False)
    parser.add_argument("spec")
    parser.add_argument("--topology", required=True)
    for flag in ("--batch", "--rows", "--context", "--ring-depth", "--expert-slots"):
        parser.add_argument(flag, type=int)
    parser.add_argument("--acceptance", type=float)
    parser.add_argument("--quant", action="append")
    parser.add_argument("--draft")
    parser.add_argument("--fuse-draft", action="store_true", default=None)
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
        options = {k: v for k, v in vars(args).items() if k not in ("spec", "topology", "draft")}
        entries.append(
            BuildEntry(
                line=line,
                spec=args.spec,
                topology=args.topology,
                options={k: v for k, v in options.items() if v is not None},
                draft=args.draft,
            )
        )
    return entries


def entry_inputs(entry: BuildEntry) -> tuple[ModelSpec, Topology, BuildOptions]:
    """The spec (with the drafter its --draft names), topology and options of a line."""
    from mkgen.spec.draft_import import load_drafter
    from mkgen.spec.loader import load_spec

    spec = load_spec(entry.spec)
    return (
        load_drafter(entry.draft, spec) if entry.draft else spec.model_copy(update={"draft": None}),
        parse_topology(entry.topology),
        BuildOptions.create(**entry.options),
    )
