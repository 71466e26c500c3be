"""A plain MLP, act(x W_up) W_down, width split over cores (macros.py.j2 beside it): the
dense kind's sharding and program without the gate."""

from __future__ import annotations

from typing import Any

from mkgen.kinds.common import (
    no_buffers,
    no_cache_geometry,
    no_rotary_dim,
    no_state_dims,
    no_views,
)
from mkgen.kinds.dense import shard as dense_shard
from mkgen.kinds.dense import stream_mlp_program
from mkgen.kinds.mlp.record import MLPLayout
from mkgen.plan.kind import LayoutInputs, Step
from mkgen.plan.layout import check_stream_formats
from mkgen.plan.stream import part_of

TEMPLATE = "kinds/mlp.py.j2"
RECORD = MLPLayout
# Its weight-stream segments, in the order its ops consume them.
SEGMENTS = [("up", ["ffn.w_up"]), ("down", ["ffn.w_down"])]
SLAB_VECTORS = None
rotary_dim = no_rotary_dim  # LayerKind: none
state_dims = no_state_dims  # LayerKind: none
views = no_views  # LayerKind: none
cache_geometry = no_cache_geometry  # LayerKind: none
buffers = no_buffers  # LayerKind: none
# The layer's ops in the order its kernel function runs them (MLPLayout.ops).
OPS = ["up", "activation", "down", "combine"]
# The dense kind's rule serves unchanged: up split by columns, down by rows, all-reduce.
shard = dense_shard


def layout(i: LayoutInputs) -> MLPLayout:
    check_stream_formats(f"ffn_kinds.{i.name}", i.segments, fused=False)
    parts = {t.name: part_of(t, i.devices) for t in i.shard.tensors}
    return MLPLayout(
        name=i.name,
        index=i.index,
        layers=i.layers,
        width=parts["ffn.w_up"].size,
        activation=i.kind.activation,
        activation_params={},
        segments=i.segments,
        ops=OPS,
        vectors=[],
    )


def program(b: Any, s: Step) -> int:
    """The layer's ops (OPS): up, the activation, down, all-reduce."""
    return stream_mlp_program(b, s, OPS, "up")
