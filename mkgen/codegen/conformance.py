"""The rendered kernel held to the plan's program.

The schedule the checks prove (mkgen/plan/schedule.py) and the template that renders the
kernel must consume every layer kind's stream segments in the same order: the ring starts
bank g - 1 + depth only once bank g is reached, so a kernel that waits for its banks out of the
program's order hangs at a shallow enough depth while every check of the program passes.
The rendered source is read back here (its `matmul(x, first_row, SEGMENT)` calls, in
source order, each SEGMENT a module-level `Segment(offset=...)`) and compared with the
program before a build is written.
"""

from __future__ import annotations

import ast

from mkgen.plan.graph import ScheduleCheckError
from mkgen.plan.layout import KernelLayout

STREAM_FIRST_ROW = "first_row"  # the kernel's name for a layer kind's first stream row
STREAM_SEGMENT = "Segment"  # the kernel's record of a stream segment (offset, shape, format)


def consumed_segments(source: str, layout: KernelLayout) -> dict[str, list[str]]:
    """Layer kind -> the stream segments its kernel function consumes, in source order."""
    module = ast.parse(source)
    offsets = {  # NAME = Segment(offset=N, ...) at module level -> N
        target.id: keyword.value.value
        for node in module.body
        if isinstance(node, ast.Assign) and _is_segment(node.value)
        for target in node.targets
        if isinstance(target, ast.Name)
        for keyword in node.value.keywords
        if keyword.arg == "offset" and isinstance(keyword.value, ast.Constant)
    }
    functions = {f.name: f for f in module.body if isinstance(f, ast.FunctionDef)}
    kinds = [("_attention_", k) for k in layout.attention] + [("_ffn_", k) for k in layout.ffn]
    out: dict[str, list[str]] = {}
    for prefix, kind in kinds:
        by_offset = {s.offset: s.name for s in kind.segments}
        function = functions.get(prefix + kind.name)
        if function is None:
            raise ScheduleCheckError(f"the rendered kernel has no {prefix}{kind.name} function")
        consumed = [_stream_offset(call, offsets) for call in _matmuls(function)]
        out[kind.name] = [by_offset.get(o, f"row +{o}") for o in consumed if o is not None]
    return out


def check_program_order(source: str, layout: KernelLayout, program: dict[str, list[str]]) -> None:
    """Raise a one-line ScheduleCheckError naming the first segment where the rendered
    kernel and the program disagree."""
    for kind, kernel_order in consumed_segments(source, layout).items():
        planned = program.get(kind, [])
        if kernel_order == planned:
            continue
        at = next(
            (i for i, (a, b) in enumerate(zip(kernel_order, planned, strict=False)) if a != b),
            min(len(kernel_order), len(planned)),
        )
        got = kernel_order[at] if at < len(kernel_order) else "nothing more"
        want = planned[at] if at < len(planned) else "nothing more"
        raise ScheduleCheckError(
            f"program order: the kernel's {kind} consumes {got} where the plan's program "
            f"consumes {want} (kernel {' > '.join(kernel_order)}; program "
            f"{' > '.join(planned)}); the ring would wait for banks out of order"
        )


def _is_segment(value: ast.expr) -> bool:
    return (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Name)
        and value.func.id == STREAM_SEGMENT
    )


def _matmuls(function: ast.FunctionDef) -> list[ast.Call]:
    calls = [
        node
        for node in ast.walk(function)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "matmul"
        and len(node.args) >= 3
    ]
    return sorted(calls, key=lambda c: (c.lineno, c.col_offset))


def _stream_offset(call: ast.Call, offsets: dict[str, int]) -> int | None:
    """`matmul(x, first_row, SEGMENT)` -> SEGMENT's offset; None for other units (expert
    slots)."""
    first, segment = call.args[1], call.args[2]
    if not (isinstance(first, ast.Name) and first.id == STREAM_FIRST_ROW):
        return None
    if isinstance(segment, ast.Name) and segment.id in offsets:
        return offsets[segment.id]
    raise ScheduleCheckError(
        f"the rendered kernel streams {ast.unparse(segment)} from first_row: not a Segment "
        "constant with a literal offset"
    )
