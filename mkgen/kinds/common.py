"""What every kind's module receives from the generic machinery."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mkgen.plan.options import BuildOptions
from mkgen.plan.stream import Segment, StreamPlan
from mkgen.spec.schema import Dims


@dataclass(frozen=True)
class LayoutInputs:
    """What a kind's layout builder reads: the kind as the spec and the plan have it."""

    name: str
    index: int  # position among the model's attention (or FFN) kinds: the layer table's code
    layers: list[int]  # model layers of this kind, in order
    kind: Any  # the spec's kind (GQAAttention, MoEFFN, ...)
    shard: Any  # its AttentionSharding or FFNSharding
    segments: list[Segment]  # its weight-stream segments
    devices: int
    options: BuildOptions
    dims: Dims
    first_row: int  # first row of the layer's vector slab the kind may use
    expert_format: str
    max_piece_chunks: int
    expert_slots: int


@dataclass(frozen=True)
class BufferInputs:
    """What a kind's VMEM buffers depend on (mkgen.plan.vmem)."""

    name: str
    kind: Any  # the spec's kind
    shard: Any  # its AttentionSharding or FFNSharding
    dims: Any  # mkgen.plan.vmem.KernelDims
    stream: StreamPlan
    expert_slots: int
    expert_format: str


@dataclass(frozen=True)
class Step:
    """One layer of a kind in the program (mkgen.plan.schedule): what its ops read."""

    layer: int
    name: str
    kind: Any  # the spec's kind
    shard: Any  # its AttentionSharding or FFNSharding
    segments: dict[str, Segment]  # its stream segments by name, in stream order
    stream_row: int  # the layer's first stream row of this kind
    collectives: dict[str, Any]  # its collectives by name (mkgen.plan.sharding.Collective)
    vectors: int  # the op that loaded the layer's vector slab
    x: int  # the op that produced its normed input
