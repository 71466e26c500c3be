"""KDA (Kimi Delta Attention): as many key as value heads, a per-key-dim decay from a
low-rank projection, an output gated by a sigmoid gate (macros.py.j2 beside it)."""

from __future__ import annotations

from typing import Any

from mkgen.kinds import recurrent
from mkgen.kinds.recurrent.record import RecurrentLayout
from mkgen.plan.kind import BufferInputs, LayoutInputs, StateDims, Step
from mkgen.plan.sharding import AttentionSharding, attention_shards, latent_choice, split_heads

TEMPLATE = "kinds/kda.py.j2"
RECORD = RecurrentLayout
# Its weight-stream segments, in the order its ops consume them: tensors fused into one
# segment read the same input.
SEGMENTS = [
    ("in", ["attn.wq", "attn.wk", "attn.wv", "attn.wf_a", "attn.wbeta", "attn.wg", "attn.wg_a"]),
    ("f_b", ["attn.wf_b"]),
    ("g_b", ["attn.wg_b"]),
    ("o", ["attn.wo"]),
]
SLAB_VECTORS = recurrent.SLAB_VECTORS
rotary_dim = recurrent.rotary_dim
cache_geometry = recurrent.cache_geometry
views = recurrent.views


def state_dims(kind: Any, shard: Any) -> StateDims:
    """As many key as value heads, each holding a state."""
    h = shard.heads_per_rank
    return StateDims(h, kind.head_dim, kind.head_dim, 3 * h * kind.head_dim, key_heads=h)


def ops(kind: Any) -> list[str]:
    """The decay's low-rank second half, the output gate's when it is low rank, the gates."""
    return recurrent.ops(["f_b", *(["g_b"] if kind.output_gate_rank else []), "gates"])


def shard(ctx: Any, kind_name: str, a: Any) -> AttentionSharding:
    """How the kind's tensors split over the cores (mkgen.plan.sharding's context `ctx`):
    heads (and their state) split over the cores; the low-rank gate projections replicated or split (latent_choice)."""
    d = ctx.d
    s, specs = attention_shards(ctx, kind_name, a)
    hpr = split_heads(ctx, kind_name, "heads", a.num_heads)
    a_names = [n for n, _, _ in specs if n in ("wf_a", "wg_a")]
    latent, why_latent = latent_choice(ctx, kind_name, specs, a_names, "kda_gate_rank")
    for name, shape, family in specs:
        if name in a_names:
            s.add_low_rank(name, shape, family, latent, why_latent)
        elif (
            name in ("wq", "wk", "wv", "wf_b", "wg_b", "wg", "wbeta", "conv_q", "conv_k")
            or name == "conv_v"
        ):
            s.add(name, shape, family, split_axis=1, parts=d, why="heads")
        elif name in ("A_log", "dt_bias"):
            s.add(name, shape, family, split_axis=0, parts=d, why="heads")
        elif name == "wo":
            s.add(name, shape, family, split_axis=0, parts=d, why="input rows by head")
        else:  # o_norm (per head dim)
            s.add(name, shape, family, why="replicated")
    s.gather_low_rank(latent, specs, a_names, "kda_gate_rank", "attn.wf_a")
    cache = recurrent.state_cache(
        heads_per_rank=hpr,
        state_elements=hpr * a.head_dim * a.head_dim,
        conv_channels=3 * hpr * a.head_dim,
        conv_width=a.conv_width,
        why="state heads split with the heads",
    )
    return s.attention(
        kind_name, a, cache, heads_per_rank=hpr, kv_heads_per_rank=hpr, kv_copies=1.0,
        latent=latent,
        why=f"{hpr} heads per rank; low-rank gate projections {latent} ({why_latent})",
    )  # fmt: skip


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
