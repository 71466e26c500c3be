"""GQA: grouped-query attention over a k and a v cache (macros.py.j2 beside it)."""

from __future__ import annotations

from typing import Any

from mkgen.kinds import cache_attention
from mkgen.kinds.common import no_state_dims, no_views
from mkgen.kinds.gqa.record import GQALayout
from mkgen.plan.kind import BufferInputs, CacheGeometry, LayoutInputs, Step
from mkgen.plan.layout import (
    CacheArray,
    VectorRow,
    check_stream_formats,
    rope_layout,
    segment_columns,
)
from mkgen.plan.options import kv_tiles, q_rows
from mkgen.plan.sharding import (
    AttentionSharding,
    CacheShard,
    attention_shards,
    held_heads,
    split_heads,
)
from mkgen.plan.stream import part_of
from mkgen.spec.figures import CACHE_BYTES
from mkgen.spec.rope import inverse_sqrt

TEMPLATE = "kinds/gqa.py.j2"
RECORD = GQALayout
# Its weight-stream segments, in the order its ops consume them: tensors fused into one
# segment read the same input.
SEGMENTS = [("qkv", ["attn.wq", "attn.wk", "attn.wv", "attn.wgate"]), ("o", ["attn.wo"])]
# The layer's ops in the order its kernel function runs them: `program` emits them in this
# order and the template prints them in it (GQALayout.ops).
OPS = ["cache_read", "qkv", "heads", "cache_write", "attend", "rows", "o", "combine"]
# The small vectors a GQA layer reads from its slab, in slab order (the VMEM plan counts
# only these rows; other kinds keep every vector-family tensor in the slab).
SLAB_VECTORS = ("q_norm", "k_norm", "bq", "bk", "bv", "bo", "sinks")
state_dims = no_state_dims  # LayerKind: none
views = no_views  # LayerKind: none


def shard(ctx: Any, kind_name: str, a: Any) -> AttentionSharding:
    """How the kind's tensors split over the cores (mkgen.plan.sharding's context `ctx`):
    q heads split over the cores; kv heads split, or each core holds the ones its q heads read."""
    d = ctx.d
    s, specs = attention_shards(ctx, kind_name, a)
    hpr = split_heads(ctx, kind_name, "query heads", a.num_heads)
    kv = held_heads(
        ctx, a.num_heads, a.num_kv_heads, a.head_dim, "KV heads split",
        lambda kv_pr, kv_copies: f"{a.num_kv_heads} KV heads < or not divisible by {d}: each "
        f"rank holds the {kv_pr} its {hpr} q heads use (x{kv_copies:g} copies)",
    )  # fmt: skip
    for name, shape, family in specs:
        if name in ("wq", "wgate"):
            s.add(name, shape, family, split_axis=1, parts=d, why="q heads")
        elif name in ("wk", "wv"):
            s.add_held(name, shape, family, 1, kv, why_split="KV heads")
        elif name == "wo":
            s.add(name, shape, family, split_axis=0, parts=d, why="input rows by q head")
        elif name == "bq" or name == "sinks":
            s.add(name, shape, family, split_axis=0, parts=d, why="per q head")
        elif name in ("bk", "bv"):
            s.add_held(name, shape, family, 0, kv, why_split="per KV head")
        else:  # bo (added once after the all-reduce), q_norm, k_norm
            s.add(name, shape, family, why="replicated")
    cache = CacheShard(
        kind="kv",
        bytes_per_token=2 * kv.per_rank * a.head_dim * CACHE_BYTES,
        fixed_bytes=0,
        window=a.sliding_window,
        heads_per_rank=kv.per_rank,
        copies=kv.copies,
        why=kv.why,
    )
    return s.attention(
        kind_name, a, cache, heads_per_rank=hpr, kv_heads_per_rank=kv.per_rank,
        kv_copies=kv.copies, latent="none", why=f"{hpr} q heads per rank; {kv.why}",
    )  # fmt: skip


def layout(i: LayoutInputs) -> GQALayout:
    check_stream_formats(f"attention_kinds.{i.name}", i.segments, fused=False)
    kind, shard = i.kind, i.shard
    context, batch = i.options.context, i.options.batch
    parts = {t.name: part_of(t, i.devices) for t in shard.tensors}
    heads, kv_heads = shard.heads_per_rank, shard.kv_heads_per_rank
    d = kind.head_dim
    present = [n for n in SLAB_VECTORS if f"attn.{n}" in parts]
    # Rows 0 and 1 of a layer's slab hold its attn_norm and ffn_norm.
    vectors = [
        VectorRow(name=n, row=2 + j, part=parts[f"attn.{n}"], length=parts[f"attn.{n}"].size)
        for j, n in enumerate(present)
    ]
    group = heads // kv_heads  # q heads per kv head on a core
    return GQALayout(
        name=i.name,
        index=i.index,
        layers=i.layers,
        heads=heads,
        kv_heads=kv_heads,
        kv_rank_divisor=parts["attn.wk"].rank_divisor,
        group=group,
        head_dim=d,
        value_dim=d,
        q_cols=heads * d,
        kv_cols=kv_heads * d,
        q_rows=q_rows(group, i.options.rows),
        columns=segment_columns(i.segments, "qkv", "attn."),
        gate=kind.output_gate == "sigmoid",
        qk_norm=kind.qk_norm,
        sinks=kind.sinks,
        qkv_bias=kind.qkv_bias,
        o_bias=kind.o_bias,
        window=kind.sliding_window,
        softmax_scale=kind.softmax_scale or inverse_sqrt(d),
        rope=rope_layout(kind.rope, kind.rotary_dim) if kind.rope else None,
        segments=i.segments,
        ops=OPS,
        vectors=vectors,
        kv_tile=i.kv_tile,
        cache_arrays=2,
        caches=[
            CacheArray(name=n, shape=[len(i.layers), batch, kv_heads, context, d], dtype="bfloat16")
            for n in ("k", "v")
        ],
    )


def rotary_dim(kind: Any) -> int:
    return kind.rotary_dim


def cache_geometry(kind: Any, shard: Any, rows: int) -> CacheGeometry:
    """A kv head's query rows over its k and v caches (the cost model's attention)."""
    kv_heads = shard.kv_heads_per_rank
    return CacheGeometry(
        q_rows=q_rows(shard.heads_per_rank // kv_heads, rows), key=kind.head_dim,
        value=kind.head_dim, window=kind.sliding_window, caches=2, kv_heads=kv_heads,
        sinks=kind.sinks,
    )  # fmt: skip


def buffers(out: Any, i: BufferInputs) -> None:
    kvh, d = i.shard.kv_heads_per_rank, i.kind.head_dim
    qr = q_rows(i.shard.heads_per_rank // kvh, i.dims.rows)
    cache_attention.buffers(out, i.name, i.dims, kvh, qr, (2, d, d), i.kind.sinks)


def program(b: Any, s: Step) -> int:
    """The layer's ops (OPS): the cache blocks' reads started, q|k|v, q/k norm and RoPE,
    cache write, attention over the tiles of every (sequence, kv head), output gate, output
    projection, all-reduce."""
    layer, name, kind, a = s.layer, s.name, s.kind, s.shard
    dims = b.dims
    g = a.kv_heads_per_rank
    y = wrote = s.x
    for op in OPS:
        if op in ("qkv", "o"):
            y = b.segment(layer, name, s.segments[op], s.stream_row, y)
        elif op == "heads":
            qkv = y = b.vec(layer, f"{name}: q/k norm, rope, new rows", y, 8 * b.t * dims.hidden,
                            ((s.vectors, None, 0),))  # fmt: skip
        elif op == "cache_read":
            read = cache_attention.cache_read(b, layer, name, 2, g, kind.head_dim)
        elif op == "cache_write":
            wrote = cache_attention.cache_write(b, layer, name, 2, g, kind.head_dim, read, y)
        elif op == "attend":
            y = _attend(b, s, qkv, wrote)
        elif op == "rows":
            gate = ", output gate" if kind.output_gate != "none" else ""
            y = b.vec(layer, f"{name}: heads -> rows{gate}", y,
                      b.t * a.heads_per_rank * kind.head_dim, ((qkv, None, 0),))  # fmt: skip
        else:  # combine
            y = b.collective(layer, s.collectives.get("attn_out"), y)
    return y


def _attend(b: Any, s: Step, q: int, wrote: int) -> int:
    """Online-softmax attention of each (sequence, kv head) over its cache's tiles."""
    layer, name, kind, a, dims = s.layer, s.name, s.kind, s.shard, b.dims
    g = a.kv_heads_per_rank
    tile = dims.kv_tiles[name]
    n = kv_tiles(dims.context, tile, kind.sliding_window, dims.rows)
    qr = q_rows(a.heads_per_rank // g, dims.rows)
    sems = [(f"{name}_tile_sems[0,{buf}]", f"{name}_tile_sems[1,{buf}]") for buf in range(2)]
    flops = 4 * qr * tile * kind.head_dim
    out = {}

    def pair() -> None:
        out["o"] = cache_attention.tiles(b, layer, name, wrote, q, n,
                                         2 * tile * kind.head_dim * 2, sems, flops)  # fmt: skip

    b.folded(dims.batch * g, pair)  # for each (sequence, kv head)
    return out["o"]
