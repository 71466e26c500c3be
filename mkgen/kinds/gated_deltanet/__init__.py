"""Gated DeltaNet: value heads split over cores, each core with the key heads they read;
one scalar decay per head; the output gated by silu(z) (macros.py.j2 beside it)."""

from __future__ import annotations

from typing import Any

from mkgen.kinds import recurrent
from mkgen.kinds.recurrent.record import RecurrentLayout
from mkgen.plan.kind import BufferInputs, LayoutInputs, StateDims, Step
from mkgen.plan.sharding import AttentionSharding, attention_shards, held_heads, split_heads

TEMPLATE = "kinds/gated_deltanet.py.j2"
RECORD = RecurrentLayout
# Its weight-stream segments, in the order its ops consume them: tensors fused into one
# segment read the same input.
SEGMENTS = [
    ("in", ["attn.wq", "attn.wk", "attn.wv", "attn.wz", "attn.wb", "attn.wa"]),
    ("o", ["attn.wo"]),
]
OPS = recurrent.ops(["gates"])  # its decay and gates from the input projection alone
SLAB_VECTORS = recurrent.SLAB_VECTORS
rotary_dim = recurrent.rotary_dim
cache_geometry = recurrent.cache_geometry
views = recurrent.views


def state_dims(kind: Any, shard: Any) -> StateDims:
    """Value heads hold the state; each reads one of the core's fewer key heads."""
    v, k = shard.heads_per_rank, shard.kv_heads_per_rank
    conv = 2 * k * kind.key_head_dim + v * kind.value_head_dim
    return StateDims(v, kind.key_head_dim, kind.value_head_dim, conv, key_heads=k)


def shard(ctx: Any, kind_name: str, a: Any) -> AttentionSharding:
    """How the kind's tensors split over the cores (mkgen.plan.sharding's context `ctx`):
    value heads (and their state) split over the cores; key heads split, or each core holds the ones its value heads read."""
    d = ctx.d
    s, specs = attention_shards(ctx, kind_name, a)
    vpr = split_heads(ctx, kind_name, "value heads", a.num_value_heads)
    k = held_heads(
        ctx, a.num_value_heads, a.num_key_heads, a.key_head_dim, "key heads split",
        lambda kpr, k_copies: f"{a.num_key_heads} key heads over {d}: each rank holds the "
        f"{kpr} its value heads use (x{k_copies:g} copies)",
    )  # fmt: skip
    for name, shape, family in specs:
        if name in ("wq", "wk", "conv_q", "conv_k"):
            s.add_held(name, shape, family, 1, k, why_split="key heads")
        elif name in ("wv", "wz", "wb", "wa", "conv_v"):
            s.add(name, shape, family, split_axis=1, parts=d, why="value heads")
        elif name in ("A_log", "dt_bias"):
            s.add(name, shape, family, split_axis=0, parts=d, why="value heads")
        elif name == "wo":
            s.add(name, shape, family, split_axis=0, parts=d, why="input rows by value head")
        else:  # o_norm
            s.add(name, shape, family, why="replicated")
    cache = recurrent.state_cache(
        heads_per_rank=vpr,
        state_elements=vpr * a.key_head_dim * a.value_head_dim,
        conv_channels=2 * k.per_rank * a.key_head_dim + vpr * a.value_head_dim,
        conv_width=a.conv_width,
        why="state per value head, split with the value heads",
    )
    return s.attention(
        kind_name, a, cache, heads_per_rank=vpr, kv_heads_per_rank=k.per_rank,
        kv_copies=k.copies, latent="none", why=f"{vpr} value heads per rank; {k.why}",
    )  # fmt: skip


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
