"""The package's shape: data flows spec -> plan -> codegen -> verify (and the runtime after
codegen), with no import cycle, counting imports inside functions (not those under
`if TYPE_CHECKING:`, which never run)."""

from __future__ import annotations

import ast
import typing
from pathlib import Path

import networkx as nx
import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mkgen"
# What each stage may import from the other stages (and always itself, mkgen.errors,
# mkgen.hardware, mkgen.host_devices, mkgen.output, mkgen's __init__).
# mkgen/kinds sits after the plan: each kind's module builds on the plan's records and
# satisfies its LayerKind protocol (mkgen/plan/kind.py); the plan dispatches through the
# KindRegistry its caller passes in, and imports no kind.
ALLOWED = {
    "spec": set(),
    "reference": {"spec"},
    "plan": {"spec"},
    "kinds": {"spec", "plan"},
    # How weights are stored (formats, per-core packing, conversion): read from the plan's
    # layout, used by the code that runs or checks a build.
    "weights": {"spec", "plan", "kinds", "reference"},
    "codegen": {"spec", "plan", "kinds", "weights"},
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
        for node in _run_time_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                # `from P import m` imports the module P.m where there is one, else a name
                # of P itself.
                targets = [
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                    else node.module
                    for a in node.names
                ]  # fmt: skip
            else:
                continue
            for target in targets:
                while target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                # Importing a module runs its packages' __init__ first: they count too. A
                # module's own package is imported with it, so only a name taken from it
                # (`from mkgen.plan import plan_build` inside mkgen.plan.x) counts.
                for package in _with_packages(target):
                    if (
                        package in modules
                        and package != name
                        and (package == target or not name.startswith(package + "."))
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


# Every stage after the spec and the reference that is not the kinds themselves: it
# dispatches through the KindRegistry, or reads a fact of a kind's layout record or calls
# its hooks, instead of testing a kind's name or its schema or record class. Exempt, on purpose: mkgen/spec (the schema and the Hugging
# Face importer are where the user's input names a kind, and the spec's figures and mini
# twin are per-kind rules of the schema), mkgen/reference (each kind's math, defined once
# and dispatched by type) and mkgen/kinds (a kind's own folder names itself).
DISPATCHING = ("plan", "codegen", "weights", "verify", "runtime", "serve", "cli")
EXEMPT = {"spec", "reference", "kinds"}


def _schema_kinds() -> tuple[set[str], set[str]]:
    """(every kind's type, the class names of every kind's schema and layout record), from
    the spec's unions and the default registry."""
    from mkgen.kinds import default_registry
    from mkgen.spec.schema import AttentionKind, FFNKind

    members = [m for u in (AttentionKind, FFNKind) for m in typing.get_args(typing.get_args(u)[0])]
    types = {typing.get_args(m.model_fields["type"].annotation)[0] for m in members}
    kinds = default_registry()
    records = {kinds.record(t).__name__ for t in kinds.types()}
    return types, {m.__name__ for m in members} | records


def _kind_branches(tree: ast.AST, types: set[str], classes: set[str]) -> list[int]:
    """Lines of `tree` that test a kind's name: a `.type` compared with a kind's type (or
    a tuple of them), or isinstance on a kind's schema or layout record class."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            named = {c.value for o in operands for c in ast.walk(o) if isinstance(c, ast.Constant)}
            if any(isinstance(o, ast.Attribute) and o.attr == "type" for o in operands) and (
                named & types
            ):
                lines.append(node.lineno)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
            names = {getattr(n, "id", getattr(n, "attr", None)) for n in ast.walk(node.args[1])}
            if names & classes:
                lines.append(node.lineno)
    return lines


def test_the_plan_imports_no_kind() -> None:
    """The plan reads kinds through the KindRegistry its caller passes in (LayerKind,
    mkgen/plan/kind.py), never through an import of mkgen.kinds."""
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
        for path in sorted((PACKAGE / "plan").rglob("*.py"))
        for node in _run_time_nodes(ast.parse(path.read_text()))
        if any(name == "mkgen.kinds" or name.startswith("mkgen.kinds.") for name in _imported(node))
    ]
    assert found == [], "pass a KindRegistry instead of importing a kind: " + ", ".join(found)


def _imported(node: ast.AST) -> list[str]:
    """The modules an import statement names (none for other nodes)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
        return [node.module]
    return []


@pytest.mark.parametrize("stage", DISPATCHING)
def test_a_stage_after_the_spec_never_tests_a_kinds_name(stage: str) -> None:
    types, classes = _schema_kinds()
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path in sorted((PACKAGE / stage).rglob("*.py"))
        for line in _kind_branches(ast.parse(path.read_text()), types, classes)
    ]
    assert found == [], "dispatch through the KindRegistry or the record's hooks: " + ", ".join(
        found
    )


def test_every_stage_is_dispatching_or_exempt_by_name() -> None:
    """A new stage (a folder of mkgen/) must be put in DISPATCHING or EXEMPT on purpose."""
    stages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    stages -= {"kernellib", "templates", "model_specs"}  # kernel text and data: no dispatch
    assert stages == set(DISPATCHING) | EXEMPT


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ('if kind.type == "moe": pass', True),
        ('x = a if spec_kind.type in ("gqa", "mla") else b', True),
        ("ok = isinstance(f, MoEFFN)", True),
        ("ok = isinstance(f, layout.MoELayout)", True),  # a kind's layout record
        ("ok = isinstance(a, GQALayout | MLALayout)", True),
        ("ok = isinstance(f, FFNRecord)", False),  # the plan's base of every record
        ('if family == "dense": pass', False),  # a weight family, not a kind's type
        ('TABLE = {"kda": 1}[kind.type]', False),  # data keyed by a kind: no branch
    ],
)
def test_the_kind_branch_rule_finds_what_it_names(source: str, found: bool) -> None:
    types, classes = _schema_kinds()
    assert bool(_kind_branches(ast.parse(source), types, classes)) is found
