"""What a runner knows about its build: the constants its runner.py holds, and the plan
and kernel beside it."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from mkgen.codegen.step_call import decode_step_arguments
from mkgen.errors import MkgenError

RUNNER_FILE = "runner.py"


@dataclass(frozen=True, kw_only=True)
class Build:
    """One build's constants, as its runner.py states them (mkgen/templates/runner.py.j2)."""

    directory: Path  # megakernel.py and plan.json
    name: str
    spec: str
    topology: str
    devices: int  # cores the kernel is sharded over
    batch: int  # sequences per kernel call
    rows: int  # rows per sequence per call: the last token plus rows - 1 drafts
    context: int  # cache positions per sequence
    vocab_used: int  # token ids at or above this are padding
    # Attention kinds with recurrent state: the kernel stores it after each row of a call,
    # and the runner keeps the snapshot after each sequence's last valid row.
    recurrent_kinds: tuple[str, ...]
    default_steps: int  # tokens generated per sequence when --steps is not given
    # The kind of the drafter the build carries (mkgen build --draft): model, mtp or block;
    # None without one.
    drafter: str | None = None
    # The kernel drafts with the build's mtp drafter inside the step (mkgen build
    # --fuse-draft): it takes the fed rows' tokens and writes each sequence's drafts.
    fused_draft: bool = False


def _import_file(path: Path, name: str) -> ModuleType:
    """A Python file of the build as a module, without writing bytecode beside it (the
    build directory stays as mkgen wrote it)."""
    sys.dont_write_bytecode = True
    module_spec = importlib.util.spec_from_file_location(name, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def _rebuild_hint(directory: Path) -> str:
    """How to rebuild the build in `directory`: its plan.json's command (a mini twin's says
    which build it is part of), when readable."""
    try:
        command = json.loads((directory / "plan.json").read_text())["build"]["rebuild"]
    except (OSError, ValueError, KeyError, TypeError):
        return "build it again with mkgen build"
    return f"rebuild it ({command})"


def runner_build(directory: Path) -> Build:
    """The Build a build directory's runner.py states (what `mkgen run` runs)."""
    path = Path(directory) / RUNNER_FILE
    build = getattr(_import_file(path, "mkgen_build_runner"), "BUILD", None)
    if not isinstance(build, Build):
        raise MkgenError(
            f"{path} was written by another mkgen (it states no runtime Build); "
            f"{_rebuild_hint(path.parent)}"
        )
    return build


def load_build(build: Build) -> tuple[Any, Any, ModuleType]:
    """The build's spec and kernel layout (plan.json) and its megakernel module."""
    from pydantic import ValidationError

    from mkgen.kinds import default_registry
    from mkgen.plan.layout import KernelLayout
    from mkgen.spec.schema import ModelSpec

    for name in ("plan.json", "megakernel.py"):
        if not (build.directory / name).is_file():
            raise MkgenError(
                f"{build.directory / name}: missing beside {RUNNER_FILE}; "
                f"{_rebuild_hint(build.directory)}"
            )
    plan = json.loads((build.directory / "plan.json").read_text())
    try:
        spec = ModelSpec.model_validate(plan["spec"])
        layout = KernelLayout.read(plan["kernel"], default_registry())
    except ValidationError:
        hint = _rebuild_hint(build.directory)
        raise MkgenError(
            f"the installed mkgen cannot read this build's plan.json; {hint}"
        ) from None
    return spec, layout, _import_file(build.directory / "megakernel.py", "megakernel")


def kernel_arguments(
    kernel: Any,
    placed: Mapping[str, Any],
    tables: Any,
    positions: Any,
    fed: Any,
    x: Any,
    caches: Sequence[Any],
) -> tuple[Any, ...]:
    """A decode step's arguments (the kernel module's make_decode_step) from the placed
    weights (mkgen.runtime.weights.place_weights): the layer tables, positions [BATCH], the
    fed rows' embeddings x [TOKENS_PADDED, HIDDEN], the weights and the caches; a kernel
    that drafts also takes the fed rows' ids (fed [BATCH, ROWS]), its drafter's norms and
    each core's embedding rows (mkgen.codegen.step_call.decode_step_arguments)."""
    drafting = None
    if "draft_norms" in placed:
        drafting = (fed.reshape(-1), placed["draft_norms"], placed["embedding_rows"])
    return decode_step_arguments(
        kernel, tables, positions, x, placed["final_norm"], placed["stream"], placed["vectors"],
        placed["experts"], caches, drafting,
    )  # fmt: skip


def kernel_outputs(layout: Any, outputs: Sequence[Any]) -> tuple[Any, Any, Any, list[Any]]:
    """A decode step's outputs (the kernel's make_decode_step) as (tokens, logits, what the
    build's drafter reads from the step, the caches): the target's hidden states
    [len(layout.draft_hidden), TOKENS, HIDDEN] f32 in the plan's order, or, from a kernel
    that drafts (layout.draft_passes), each sequence's accepted rows and drafts [BATCH,
    ROWS] int32; None for a build with neither."""
    tokens, logits, *rest = outputs
    if layout.draft_hidden or layout.draft_passes is not None:
        return tokens, logits, rest[0], rest[1:]
    return tokens, logits, None, rest
