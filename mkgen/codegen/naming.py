"""A build's name, its default directory, and the commands its files print.

The commands name the build as the user typed it (`CommandLine`) so that they run as
printed; the build's own files take only the SPEC argument, so a build copied or written
elsewhere keeps its bytes.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from mkgen.hardware import DEFAULT_CHIP
from mkgen.plan.options import BuildOptions
from mkgen.spec.topology import Topology

REPO = Path(__file__).resolve().parents[2]
# A checkout builds into its generated/ (the checked-in builds); an installed package
# (site-packages has no pyproject.toml) into generated/ in the working directory.
GENERATED = REPO / "generated" if (REPO / "pyproject.toml").is_file() else Path("generated")


def build_name(spec_name: str, topology: Topology) -> str:
    """`qwen3-32b-2x2x1` (TPU7x, the default chip) or `qwen3-32b-v6e-2x2` (other chips)."""
    if topology.chip == DEFAULT_CHIP:
        return f"{spec_name}-{topology.shape_name}"
    return f"{spec_name}-{topology.chip}-{topology.shape_name}"


def default_build_dir(spec_name: str, topology: Topology) -> Path:
    return GENERATED / build_name(spec_name, topology)


def cli_flags(topology: Topology, options: BuildOptions) -> list[str]:
    """The `mkgen build` flags that reproduce `topology` and `options` (defaults left out)."""
    topo = topology.shape_name if topology.chip == DEFAULT_CHIP else topology.name
    flags = ["--topology", topo]
    default = BuildOptions()
    for name in ("batch", "rows", "context", "ring_depth", "expert_slots", "kv_tile"):
        if getattr(options, name) != getattr(default, name):
            flags += [f"--{name.replace('_', '-')}", str(getattr(options, name))]
    if options.expert_sharing != default.expert_sharing:
        flags += ["--expert-sharing", options.expert_sharing]
    if options.acceptance != default.acceptance:
        flags += ["--acceptance", f"{options.acceptance:g}"]
    for family, fmt in options.quant:
        flags += ["--quant", f"{family}={fmt}"]
    return flags + (["--fuse-draft"] if options.fuse_draft else [])


def _verify_flags(topology: Topology, options: BuildOptions) -> list[str]:
    """`mkgen verify` flags of a build: its flags without context and acceptance."""
    flags, out = cli_flags(topology, options.model_copy(update={"fuse_draft": False})), []
    for name, value in zip(flags[::2], flags[1::2], strict=True):
        if name not in ("--context", "--acceptance"):
            out += [name, value]
    return out + (["--fuse-draft"] if options.fuse_draft else [])


@dataclass(frozen=True)
class CommandLine:
    """How the commands a build prints name it: the SPEC argument and the -o directory as
    the user typed them, so that they run as printed. The defaults (the spec's name, the
    build in generated/<build>/) are what `mkgen regen` and library callers get.

    The build's files take only the SPEC argument (`for_files`): a build names no output
    directory, so one copied or written elsewhere keeps its bytes and its measurements."""

    spec: str | None = None  # None: the spec's name (a name in model_specs/)
    output: str | None = None  # None: generated/<build>/, no -o needed
    draft: str | None = None  # the --draft the build's drafter came from; None: no drafter

    def spec_arg(self, spec_name: str) -> str:
        return self.spec or spec_name

    def draft_flags(self) -> list[str]:
        return [] if self.draft is None else ["--draft", self.draft]

    def output_flags(self) -> list[str]:
        return [] if self.output is None else ["-o", self.output]

    def build_ref(self, name: str) -> str:
        """What `mkgen inspect` takes for the build: its directory, or its name in generated/."""
        return self.output or name

    def for_files(self) -> CommandLine:
        return CommandLine(spec=self.spec, draft=self.draft)


# The defaults: the spec's name, the build in generated/<build>/ (`mkgen regen`, libraries).
DEFAULT_LINE = CommandLine()


def rebuild_command(
    spec_name: str, topology: Topology, options: BuildOptions, line: CommandLine = CommandLine()
) -> str:
    return shlex.join(
        ["mkgen", "build", line.spec_arg(spec_name), *cli_flags(topology, options),
         *line.draft_flags(), *line.output_flags(), "--force"]
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
            ["mkgen", "compile", spec_arg, *cli_flags(topology, options), *line.draft_flags(),
             *output, "--update-report"]
        ),
        "verify": shlex.join(
            ["mkgen", "verify", spec_arg, *_verify_flags(topology, options),
             *line.draft_flags(), *output, "--update-report"]
        ),
        "inspect": shlex.join(["mkgen", "inspect", line.build_ref(build_name(spec_name, topology))]),
    }  # fmt: skip
