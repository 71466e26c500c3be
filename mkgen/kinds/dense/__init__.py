"""A dense gated MLP, width split over cores (macros.py.j2 beside it)."""

from __future__ import annotations

from typing import Any

from mkgen.kinds.common import (
    no_buffers,
    no_cache_geometry,
    no_rotary_dim,
    no_state_dims,
    no_views,
)
from mkgen.kinds.dense.record import DenseLayout
from mkgen.plan.kind import LayoutInputs, Step
from mkgen.plan.layout import activation_params, check_stream_formats, unsupported
from mkgen.plan.sharding import FFNSharding, KindShards
from mkgen.plan.stream import part_of
from mkgen.spec.weights import ffn_weights

TEMPLATE = "kinds/dense.py.j2"
RECORD = DenseLayout
# Its weight-stream segments, in the order its ops consume them: tensors fused into one
# segment read the same input.
SEGMENTS = [("gate_up", ["ffn.w_gate", "ffn.w_up"]), ("down", ["ffn.w_down"])]
SLAB_VECTORS = None
rotary_dim = no_rotary_dim  # LayerKind: none
state_dims = no_state_dims  # LayerKind: none
views = no_views  # LayerKind: none
cache_geometry = no_cache_geometry  # LayerKind: none
buffers = no_buffers  # LayerKind: none
# The layer's ops in the order its kernel function runs them: `program` emits them in this
# order and the template prints them in it (DenseLayout.ops).
OPS = ["gate_up", "activation", "down", "combine"]


def shard(ctx: Any, kind_name: str, f: Any) -> FFNSharding:
    """How the kind's tensors split over the cores (mkgen.plan.sharding's context `ctx`):
    the width split over the cores; the down projection's partial sums all-reduced."""
    h, d = ctx.h, ctx.d
    s = KindShards(ctx, "ffn.", f"ffn_kinds.{kind_name}: ")
    weights = ffn_weights(f, h)
    for w in weights:
        if w.name in ("w_gate", "w_up"):
            s.add(w.name, w.shape, w.family, split_axis=1, parts=d, why="width")
        elif w.name == "w_down":
            s.add(w.name, w.shape, w.family, split_axis=0, parts=d, why="input rows by width")
        elif w.name in ("b_gate", "b_up"):
            s.add(w.name, w.shape, w.family, split_axis=0, parts=d, why="width")
        else:  # b_down: added once after the all-reduce
            s.add(w.name, w.shape, w.family, why="replicated (added after the all-reduce)")
    s.collectives.append(ctx.collective("ffn_out", "all_reduce", "ffn.w_down", h))
    return FFNSharding(
        kind=kind_name, type=f.type, tensors=tuple(s.tensors), collectives=tuple(s.collectives),
        experts=None, latent_design="none", why=f"width {f.width} split {d} ways",
    )  # fmt: skip


def layout(i: LayoutInputs) -> DenseLayout:
    check_stream_formats(f"ffn_kinds.{i.name}", i.segments, fused=False)
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


def program(b: Any, s: Step) -> int:
    """The layer's ops (OPS): gate|up, the activation, down, all-reduce."""
    return stream_mlp_program(b, s, OPS, "gate_up")


def stream_mlp_program(b: Any, s: Step, ops: list[str], activation_input: str) -> int:
    """An MLP's ops in `ops` order: stream matmuls, the activation over the output of
    segment `activation_input`, and the all-reduce of the down projection ("combine")."""
    layer, name, segs, first = s.layer, s.name, s.segments, s.stream_row
    y = s.x
    for op in ops:
        if op == "activation":
            y = b.vec(layer, f"{name}: activation", y, 8 * b.t * segs[activation_input].fan_out)
        elif op == "combine":
            y = b.collective(layer, s.collectives.get("ffn_out"), y)
        else:  # stream matmuls
            y = b.segment(layer, name, segs[op], first, y)
    return y
