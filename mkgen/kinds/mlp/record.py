"""The plain MLP's record of the kernel layout (mkgen.kinds.mlp builds it, its macros
print it)."""

from __future__ import annotations

from typing import ClassVar, Literal

from mkgen.plan.layout import FFNRecord, VectorRow
from mkgen.plan.stream import Segment


class MLPLayout(FFNRecord):
    """A plain MLP (mkgen.kinds.mlp): act(x W_up) W_down, width split over cores."""

    type: Literal["mlp"] = "mlp"
    routed_experts: ClassVar[bool] = False  # no routed-expert arrays to pack
    name: str
    index: int
    layers: list[int]
    width: int  # per core
    activation: str  # a single-input activation: _activation's gated form with up = 1
    activation_params: dict[str, float]  # none (common.activation_constants prints them)
    segments: list[Segment]  # up, down
    ops: list[str]  # the layer's ops in program order (mkgen.kinds.mlp.OPS): the kernel's order
    vectors: list[VectorRow]
