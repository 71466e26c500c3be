"""A dense gated MLP, width split over cores (templates/kinds/dense.py.j2)."""

from __future__ import annotations

from typing import Any

from mkgen.kinds.common import BufferInputs, LayoutInputs, Step
from mkgen.plan.layout import DenseLayout, activation_params, unsupported
from mkgen.plan.stream import part_of

TEMPLATE = "kinds/dense.py.j2"
SLAB_VECTORS = None
# The layer's ops in the order its kernel function runs them: `program` emits them in this
# order and the template prints them in it (DenseLayout.ops).
OPS = ["gate_up", "activation", "down", "combine"]


def layout(i: LayoutInputs) -> DenseLayout:
    kind = i.kind
    if kind.bias or not kind.gated:
        unsupported(f"ffn_kinds.{i.name}: a dense MLP with bias or without a gate")
    parts = {t.name: part_of(t, i.devices) for t in i.shard.tensors}
    width = parts["ffn.w_gate"].size
    return DenseLayout(
        name=i.name,
        index=i.index,
        layers=i.layers,
        width=width,
        gated=kind.gated,
        activation=kind.activation.kind,
        activation_params=activation_params(kind.activation),
        bias=kind.bias,
        segments=i.segments,
        ops=OPS,
        vectors=[],
    )


def buffers(out: Any, i: BufferInputs) -> None:
    """Nothing beyond the stream's: its matmuls use the ring's staging buffers."""


def program(b: Any, s: Step) -> int:
    """The layer's ops (OPS): gate|up, the activation, down, all-reduce."""
    layer, name, segs, first = s.layer, s.name, s.segments, s.first_bank
    y = s.x
    for op in OPS:
        if op == "activation":
            y = b.vec(layer, f"{name}: activation", y, 8 * b.t * segs["gate_up"].fan_out)
        elif op == "combine":
            y = b.collective(layer, s.collectives.get("ffn_out"), y)
        else:  # gate_up, down: stream matmuls
            y = b.segment(layer, name, segs[op], first, y)
    return y
