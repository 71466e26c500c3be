"""No function or method over MAX_LINES lines in mkgen/ and scripts/ (the developers' guide).

A function's length runs from its `def` line to its last line: decorators are not
counted, its docstring, comments, blank lines and nested functions are (a nested
function is also held to the limit on its own). Generated code and tests are not walked.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 80
WALKED = ("mkgen", "scripts")


def long_functions(source: str, where: str) -> list[str]:
    """`where:line name (n lines)` of every function or method in `source` over MAX_LINES."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_LINES:
                found.append(f"{where}:{node.lineno} {node.name} ({lines} lines)")
    return found


def _lines(count: int, indent: int) -> str:
    return "".join(" " * indent + f"x{i} = {i}\n" for i in range(count))


def test_the_length_runs_from_def_to_last_line_without_decorators() -> None:
    at_limit = '@decorator\ndef at_limit():\n    """doc"""\n' + _lines(MAX_LINES - 2, 4)
    assert long_functions(at_limit, "m.py") == []
    over = "def over():\n" + _lines(MAX_LINES, 4)
    assert long_functions(over, "m.py") == [f"m.py:1 over ({MAX_LINES + 1} lines)"]


def test_a_nested_function_counts_within_its_parent_and_on_its_own() -> None:
    short_inside = "def outer():\n    def inner():\n        pass\n" + _lines(MAX_LINES - 2, 4)
    assert long_functions(short_inside, "m.py") == [f"m.py:1 outer ({MAX_LINES + 1} lines)"]
    long_inside = "class C:\n    def method(self):\n        def helper():\n"
    assert long_functions(long_inside + _lines(MAX_LINES, 12), "m.py") == [
        f"m.py:2 method ({MAX_LINES + 2} lines)",
        f"m.py:3 helper ({MAX_LINES + 1} lines)",
    ]


def test_no_function_in_mkgen_or_scripts_is_over_80_lines() -> None:
    found = [
        hit
        for folder in WALKED
        for path in sorted((ROOT / folder).rglob("*.py"))
        for hit in long_functions(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert not found, f"functions over {MAX_LINES} lines (split them into their steps): " + (
        "; ".join(found)
    )
