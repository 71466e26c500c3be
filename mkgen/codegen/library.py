"""The kernel's runtime library in the templates: `{{ library("module", "Member") }}`
directives replaced by the member's source text (mkgen/kernellib/, whose package
docstring gives the rules).

The directives are expanded when a template is loaded, before Jinja parses it: Jinja
renders a member's lines like any other, and the inputs hash takes the expanded
template (`expanded_template`), so it covers the library code a build includes. This
module only extracts text; which members a kernel holds is the template's choice.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Callable
from importlib import resources
from importlib.resources.abc import Traversable

import jinja2

from mkgen.errors import MkgenError

# Package data like the templates, so an installed wheel includes what a checkout does.
LIBRARY: Traversable = resources.files("mkgen") / "kernellib"
# A directive stands on a line of its own, indented like the member it includes.
DIRECTIVE = re.compile(
    r'^(?P<indent> *)\{\{ library\("(?P<module>\w+)", "(?P<member>\w+(?:\.\w+)?)"\) \}\}$',
    re.MULTILINE,
)
JINJA_SYNTAX = ("{{", "{%", "{#")


def _member_node(tree: ast.Module, module: str, member: str) -> ast.stmt:
    """The statement that defines `member` (`Class.method` inside a top-level class)."""
    body: list[ast.stmt] = tree.body
    *owners, name = member.split(".")
    for owner in owners:
        found = next((n for n in body if isinstance(n, ast.ClassDef) and n.name == owner), None)
        if found is None:
            raise MkgenError(f"mkgen/kernellib/{module}.py has no class {owner} ({member})")
        body = found.body
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name == name:
            return node
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return node
    raise MkgenError(f"mkgen/kernellib/{module}.py has no member {member}")


@functools.lru_cache(maxsize=64)
def _parsed(source: str) -> ast.Module:
    """A library module's syntax tree (read only), parsed once per text: a kernel
    template includes dozens of members of each module."""
    return ast.parse(source)


def member_source(source: str, module: str, member: str) -> str:
    """`member`'s text in a library module's `source`: its lines from the comment lines
    directly above it (and its decorators) to its last line, without a final newline."""
    node = _member_node(_parsed(source), module, member)
    lines = source.splitlines()
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1
    while first > 0 and lines[first - 1].lstrip().startswith("#"):
        first -= 1
    assert node.end_lineno is not None  # set by ast.parse
    text = "\n".join(lines[first : node.end_lineno])
    if any(syntax in text for syntax in JINJA_SYNTAX):
        raise MkgenError(
            f"mkgen/kernellib/{module}.py: {member} holds Jinja syntax ({', '.join(JINJA_SYNTAX)}), "
            "which the template would interpret: write it otherwise"
        )
    return text


def library_source(module: str) -> str:
    """The text of mkgen/kernellib/<module>.py."""
    path = LIBRARY / f"{module}.py"
    if not path.is_file():
        raise MkgenError(f"the kernel library has no module {module} (mkgen/kernellib/{module}.py)")
    return path.read_bytes().decode()


def expand(template: str, name: str) -> str:
    """`template` (called `name` in messages) with every directive replaced by its member."""
    for number, line in enumerate(template.splitlines(), 1):
        if "{{ library(" in line and not DIRECTIVE.match(line):
            raise MkgenError(
                f'{name}, line {number}: write a library directive as {{{{ library("module", '
                '"Member") }} alone on its line'
            )
    sources: dict[str, str] = {}

    def include(match: re.Match[str]) -> str:
        module, member, indent = match["module"], match["member"], match["indent"]
        if module not in sources:
            sources[module] = library_source(module)
        text = member_source(sources[module], module, member)
        member_indent = len(text) - len(text.lstrip(" "))
        if member_indent != len(indent):
            raise MkgenError(
                f"{name}: indent the directive for {module}.{member} by {member_indent} "
                "spaces, as the member is"
            )
        return text

    return DIRECTIVE.sub(include, template)


def expanded_template(raw: bytes, name: str) -> str:
    """A template file's bytes as Jinja reads them: directives expanded."""
    return expand(raw.decode(), name)


class LibraryLoader(jinja2.PackageLoader):
    """The package's templates with their library directives expanded."""

    def get_source(
        self, environment: jinja2.Environment, template: str
    ) -> tuple[str, str, Callable[[], bool] | None]:
        source, filename, uptodate = super().get_source(environment, template)
        return expand(source, template), filename, uptodate
