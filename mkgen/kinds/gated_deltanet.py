"""Gated DeltaNet: value heads split over cores, each core with the key heads they read;
one scalar decay per head; the output gated by silu(z) (templates/kinds/gated_deltanet.py.j2)."""

from __future__ import annotations

from typing import Any

from mkgen.kinds import recurrent
from mkgen.kinds.common import BufferInputs, LayoutInputs, Step
from mkgen.plan.layout import RecurrentLayout

TEMPLATE = "kinds/gated_deltanet.py.j2"
OPS = recurrent.ops(["gates"])  # its decay and gates from the input projection alone
SLAB_VECTORS = recurrent.SLAB_VECTORS
rotary_dim = recurrent.rotary_dim


def state_dims(kind: Any, shard: Any) -> tuple[int, int, int, int]:
    """(state heads, key dim, value dim, conv channels) per core."""
    v, k = shard.heads_per_rank, shard.kv_heads_per_rank
    conv = 2 * k * kind.key_head_dim + v * kind.value_head_dim
    return v, kind.key_head_dim, kind.value_head_dim, conv


def layout(i: LayoutInputs) -> RecurrentLayout:
    key_heads, value_heads = i.shard.kv_heads_per_rank, i.shard.heads_per_rank
    dims = dict(
        key_heads=key_heads, value_heads=value_heads, group=value_heads // key_heads,
        key_dim=i.kind.key_head_dim, value_dim=i.kind.value_head_dim,
    )  # fmt: skip
    return recurrent.layout(i, dims, {"ops": OPS})


def buffers(out: Any, i: BufferInputs) -> None:
    recurrent.buffers(out, i, state_dims(i.kind, i.shard))


def program(b: Any, s: Step) -> int:
    return recurrent.program(b, s, state_dims(s.kind, s.shard), OPS)
