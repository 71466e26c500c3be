"""The dense kind's record of the kernel layout (mkgen.kinds.dense builds it, its macros
print it)."""

from __future__ import annotations

from typing import ClassVar, Literal

from mkgen.kinds.common import split_as_mlp
from mkgen.plan.layout import FFNRecord, VectorRow
from mkgen.plan.stream import Segment


class DenseLayout(FFNRecord):
    type: Literal["dense"] = "dense"
    # A fact of the kind (FFNRecord): no routed-expert arrays to pack.
    routed_experts: ClassVar[bool] = False
    name: str
    index: int
    layers: list[int]
    width: int  # per core
    gated: bool
    activation: str
    activation_params: dict[str, float]
    bias: bool
    segments: list[Segment]  # gate_up (gate | up), down
    ops: list[str]  # the layer's ops in program order (mkgen.kinds.dense.OPS): the kernel's order
    vectors: list[VectorRow]

    def columns_split(self) -> bool:
        """W_gate and W_up by columns, W_down by rows, each core its own piece, no biases."""
        if self.vectors:
            return False
        parts = self.stream_parts()
        inputs = [n for n in ("ffn.w_gate", "ffn.w_up") if n in parts]
        return len(parts) == len(inputs) + 1 and split_as_mlp(parts, inputs, "ffn.w_down")
