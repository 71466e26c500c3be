"""The package's shape: data flows spec -> plan -> codegen -> verify (and the runtime after
codegen), with no import cycle, counting imports inside functions (not those under
`if TYPE_CHECKING:`, which never run)."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mkgen"
# What each stage may import from the other stages (and always itself, mkgen.errors,
# mkgen.hardware, mkgen.output, mkgen's __init__).
# mkgen/kinds sits after the plan: each kind's module builds on the plan's records and
# satisfies its LayerKind protocol (mkgen/plan/kind.py); the plan dispatches through the
# KindRegistry its caller passes in, and imports no kind.
ALLOWED = {
    "spec": set(),
    "reference": {"spec"},
    "plan": {"spec"},
    "kinds": {"spec", "plan"},
    "codegen": {"spec", "plan", "kinds", "reference"},
    "verify": {"spec", "plan", "kinds", "reference", "codegen"},
    "runtime": {"spec", "plan", "kinds", "reference", "codegen", "verify"},
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
        for node in _run_time_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                while target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                # Importing a module runs its packages' __init__ first: they count too. A
                # module's own package is imported with it; only other modules count.
                for package in _with_packages(target):
                    if (
                        package in modules
                        and package != name
                        and not name.startswith(package + ".")
                    ):
                        graph.add_edge(name, package)
    return graph


def _with_packages(module: str) -> list[str]:
    """`module` and the packages it sits in, below mkgen's own: mkgen.plan.stream ->
    [mkgen.plan.stream, mkgen.plan]."""
    parts = module.split(".")
    return [".".join(parts[:n]) for n in range(len(parts), 1, -1)]


def _run_time_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of `tree` but those under `if TYPE_CHECKING:` (annotations only)."""
    found, todo = [], [tree]
    while todo:
        node = todo.pop()
        found.append(node)
        if isinstance(node, ast.If) and ast.unparse(node.test) in (
            "TYPE_CHECKING",
            "typing.TYPE_CHECKING",
        ):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return found


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
