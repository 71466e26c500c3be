"""The package's shape: data flows spec -> plan -> codegen -> verify (and the runtime after
codegen), with no import cycle, counting imports inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mkgen"
# What each stage may import from the other stages (and always itself, mkgen.errors,
# mkgen.hardware, mkgen.output, mkgen's __init__).
# mkgen/kinds is part of the plan stage, split by layer kind: each kind's module builds on
# the plan's generic pieces (stream, layout records), and the plan's generic machinery
# (kernel layout, VMEM plan, schedule) dispatches to it through mkgen.kinds.registry; the
# module-level cycle test below keeps the two sides from importing each other back.
ALLOWED = {
    "spec": set(),
    "reference": {"spec"},
    "plan": {"spec", "kinds"},
    "kinds": {"spec", "plan"},
    # How weights are stored (formats, per-core packing, conversion): read from the plan's
    # layout, used by the code that runs or checks a build.
    "weights": {"spec", "plan", "kinds", "reference"},
    "codegen": {"spec", "plan", "kinds", "reference", "weights"},
    "verify": {"spec", "plan", "kinds", "reference", "weights", "codegen"},
    "runtime": {"spec", "plan", "kinds", "reference", "weights", "codegen", "verify"},
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts).removesuffix(".__init__")


def _imports() -> nx.DiGraph:
    """mkgen module -> every mkgen module it imports, at the top or inside functions."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                while target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                # A module's own package is imported with it; only other modules count.
                if target in modules and target != name and not name.startswith(target + "."):
                    graph.add_edge(name, target)
    return graph


def test_no_module_imports_itself_back() -> None:
    cycles = sorted(nx.simple_cycles(_imports()), key=len)
    assert cycles == [], " ; ".join(" -> ".join(c + c[:1]) for c in cycles[:5])


@pytest.mark.parametrize("stage", sorted(ALLOWED))
def test_a_stage_imports_only_the_stages_before_it(stage: str) -> None:
    graph = _imports()
    stages = set(ALLOWED)
    back = [
        f"{source} -> {target}"
        for source, target in graph.edges
        if source.startswith(f"mkgen.{stage}")
        and (other := target.split(".")[1] if target.count(".") else "") in stages
        and other != stage
        and other not in ALLOWED[stage]
    ]
    assert back == []
