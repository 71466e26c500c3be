"""KDA (Kimi Delta Attention): as many key as value heads, a per-key-dim decay from a
low-rank projection, an output gated by a sigmoid gate (templates/kinds/kda.py.j2)."""

from __future__ import annotations

from typing import Any

from mkgen.kinds import recurrent
from mkgen.kinds.common import BufferInputs, LayoutInputs, Step
from mkgen.plan.layout import RecurrentLayout

TEMPLATE = "kinds/kda.py.j2"
SLAB_VECTORS = recurrent.SLAB_VECTORS
rotary_dim = recurrent.rotary_dim


def state_dims(kind: Any, shard: Any) -> tuple[int, int, int, int]:
    """(state heads, key dim, value dim, conv channels) per core."""
    h = shard.heads_per_rank
    return h, kind.head_dim, kind.head_dim, 3 * h * kind.head_dim


def ops(kind: Any) -> list[str]:
    """The decay's low-rank second half, the output gate's when it is low rank, the gates."""
    return recurrent.ops(["f_b", *(["g_b"] if kind.output_gate_rank else []), "gates"])


def layout(i: LayoutInputs) -> RecurrentLayout:
    heads, d = i.shard.heads_per_rank, i.kind.head_dim
    dims = dict(key_heads=heads, value_heads=heads, group=1, key_dim=d, value_dim=d)
    extra = dict(
        gate_lower_bound=i.kind.gate_lower_bound,
        output_gate_rank=i.kind.output_gate_rank,
        ops=ops(i.kind),
    )
    return recurrent.layout(i, dims, extra)


def buffers(out: Any, i: BufferInputs) -> None:
    recurrent.buffers(out, i, state_dims(i.kind, i.shard))


def program(b: Any, s: Step) -> int:
    return recurrent.program(b, s, state_dims(s.kind, s.shard), ops(s.kind))
