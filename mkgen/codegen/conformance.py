"""The rendered kernel held to the plan's program.

The schedule the checks prove (mkgen/plan/schedule.py) and the template that renders the
kernel must consume every layer kind's stream segments in the same order: the ring starts
bank g + depth only after bank g is used, so a kernel that waits for its banks out of the
program's order hangs at a shallow enough depth while every check of the program passes.
The rendered source is read back here (its `matmul` calls on `first_bank + offset`, in
source order) and compared with the program before a build is written.
"""

from __future__ import annotations

import ast

from mkgen.plan.graph import ScheduleCheckError
from mkgen.plan.layout import KernelLayout

STREAM_FIRST_BANK = "first_bank"  # the kernel's name for a layer kind's first bank


def consumed_segments(source: str, layout: KernelLayout) -> dict[str, list[str]]:
    """Layer kind -> the stream segments its kernel function consumes, in source order."""
    module = ast.parse(source)
    constants = {
        target.id: node.value.value
        for node in module.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        for target in node.targets
        if isinstance(target, ast.Name) and isinstance(node.value.value, int)
    }
    functions = {f.name: f for f in module.body if isinstance(f, ast.FunctionDef)}
    kinds = [("_attention_", k) for k in layout.attention] + [("_ffn_", k) for k in layout.ffn]
    out: dict[str, list[str]] = {}
    for prefix, kind in kinds:
        by_offset = {s.bank_offset: s.name for s in kind.segments}
        function = functions.get(prefix + kind.name)
        if function is None:
            raise ScheduleCheckError(f"the rendered kernel has no {prefix}{kind.name} function")
        offsets = [_bank_offset(call, constants) for call in _matmuls(function)]
        out[kind.name] = [by_offset.get(o, f"bank +{o}") for o in offsets if o is not None]
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


def _matmuls(function: ast.FunctionDef) -> list[ast.Call]:
    calls = [
        node
        for node in ast.walk(function)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "matmul"
        and len(node.args) >= 2
    ]
    return sorted(calls, key=lambda c: (c.lineno, c.col_offset))


def _bank_offset(call: ast.Call, constants: dict[str, int]) -> int | None:
    """`first_bank + K` (K a literal or a module constant) -> K; None for other banks."""
    bank = call.args[1]
    if not (
        isinstance(bank, ast.BinOp)
        and isinstance(bank.op, ast.Add)
        and isinstance(bank.left, ast.Name)
        and bank.left.id == STREAM_FIRST_BANK
    ):
        return None
    offset = bank.right
    if isinstance(offset, ast.Constant) and isinstance(offset.value, int):
        return offset.value
    if isinstance(offset, ast.Name) and offset.id in constants:
        return constants[offset.id]
    raise ScheduleCheckError(
        f"the rendered kernel reads bank first_bank + {ast.unparse(offset)}, not a constant"
    )
