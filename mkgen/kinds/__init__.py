"""The layer kinds: one folder each, holding everything mkgen knows of the kind beyond its
spec schema and its reference math.

A kind's folder (one per type of registry.py: `gqa/`, `moe/`, ...) holds its
rules in its `__init__.py` (the plan's `LayerKind` protocol, mkgen/plan/kind.py: sharding
rule, fused stream segments, layout builder, VMEM buffers, op program) and its template
macros in `macros.py.j2`, which templates import as ``kinds/<folder>.py.j2``. The shared
mechanisms are folders of the same shape: `cache_attention/` (GQA's and MLA's KV cache
and tiled attention), `recurrent/` (Gated DeltaNet's and KDA's delta rule) and `common/`
(the protocol's defaults for kinds without rotary positions, state or KV cache, and the
macros every kind's tables are printed with).

`default_registry()` (registry.py) maps each kind's type to its folder's module; callers
pass that registry into the plan (`plan_build(..., kinds=...)`). The kinds build on the
plan's records; the plan imports none of them.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from importlib.resources.abc import Traversable

from mkgen.kinds.registry import default_registry

MACROS = "macros.py.j2"  # a kind folder's template macros


def macro_name(kind_type: str) -> str:
    """The name templates import the macros of the kind (or shared folder) `kind_type` by."""
    return f"kinds/{kind_type}.py.j2"


@cache
def macro_files() -> dict[str, Traversable]:
    """Every kind folder's macros by the name templates import them under
    (``kinds/<folder>.py.j2``), sorted by name. Read as package data, so an installed
    wheel renders what a checkout does."""
    root = resources.files(__name__)
    folders = sorted((d for d in root.iterdir() if d.is_dir()), key=lambda d: d.name)
    return {macro_name(d.name): d / MACROS for d in folders if (d / MACROS).is_file()}


__all__ = ["MACROS", "default_registry", "macro_files", "macro_name"]
