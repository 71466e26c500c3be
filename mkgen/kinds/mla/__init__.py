"""MLA, absorbed: one latent cache row per token, read by every q head
(macros.py.j2 beside it)."""

from __future__ import annotations

from typing import Any

from mkgen.kinds import cache_attention
from mkgen.kinds.common import no_state_dims
from mkgen.kinds.mla.record import MLALayout
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
    latent_choice,
    split_heads,
)
from mkgen.plan.stream import CHUNK, LANES, TensorView, part_of
from mkgen.spec.figures import CACHE_BYTES
from mkgen.spec.rope import mla_softmax_scale

TEMPLATE = "kinds/mla.py.j2"
RECORD = MLALayout
# Its weight-stream segments, in the order its ops consume them: tensors fused into one
# segment read the same input. Absorbed, wkv_b streams twice as views, its key half
# transposed (uk: q_nope -> latent) and its value half (uv: latent -> values); see
# views below.
SEGMENTS = [
    ("down", ["attn.wq_a", "attn.wq", "attn.wkv_a", "attn.wgate"]),
    ("q_b", ["attn.wq_b"]),
    ("uk", ["attn.wkv_b"]),
    ("uv", ["attn.wkv_b"]),
    ("o", ["attn.wo"]),
]
SLAB_VECTORS = None  # every vector-family tensor (q_norm, kv_norm) takes its rows
state_dims = no_state_dims  # LayerKind: none


def views(kind: Any) -> dict[tuple[str, str], TensorView]:
    """Views of MLA tensors by (segment, tensor): wkv_b's key and value halves, and the
    interleaved rotary columns of q and k_rope reordered to halves."""
    nope, rope_d, vd = kind.qk_nope_head_dim, kind.qk_rope_head_dim, kind.v_head_dim
    views = {
        ("uk", "attn.wkv_b"): TensorView(stride=nope + vd, size=nope, transpose=True),
        ("uv", "attn.wkv_b"): TensorView(stride=nope + vd, start=nope, size=vd),
    }
    if kind.rope is not None and kind.rope.interleaved:
        q = TensorView(stride=nope + rope_d, size=nope + rope_d, rotary=(nope, rope_d))
        kv = kind.kv_lora_rank + rope_d
        views[("q_b", "attn.wq_b")] = q
        views[("down", "attn.wq")] = q
        views[("down", "attn.wkv_a")] = TensorView(
            stride=kv, size=kv, rotary=(kind.kv_lora_rank, rope_d)
        )
    return views


def shard(ctx: Any, kind_name: str, a: Any) -> AttentionSharding:
    """How the kind's tensors split over the cores (mkgen.plan.sharding's context `ctx`):
    heads split over the cores; the low-rank latent projections replicated or split (latent_choice); the latent cache on every core."""
    d = ctx.d
    s, specs = attention_shards(ctx, kind_name, a)
    hpr = split_heads(ctx, kind_name, "heads", a.num_heads)
    a_names = [n for n, _, _ in specs if n in ("wq_a", "wkv_a")]
    latent, why_latent = latent_choice(ctx, kind_name, specs, a_names, "mla_latent")
    for name, shape, family in specs:
        if name in a_names:
            s.add_low_rank(name, shape, family, latent, why_latent)
        elif name in ("wq", "wq_b", "wkv_b", "wgate"):
            s.add(name, shape, family, split_axis=1, parts=d, why="heads")
        elif name == "wo":
            s.add(name, shape, family, split_axis=0, parts=d, why="input rows by head")
        else:  # q_norm, kv_norm: applied to the full latent
            s.add(name, shape, family, why="replicated (norm of the full latent)")
    s.gather_low_rank(latent, specs, a_names, "mla_latent", "attn.wq_a")
    per_token = (a.kv_lora_rank + a.qk_rope_head_dim) * CACHE_BYTES
    cache = CacheShard(
        kind="mla_latent", bytes_per_token=per_token, fixed_bytes=0, window=None,
        heads_per_rank=1, copies=float(d),
        why="every head reads the whole latent: the latent cache is replicated",
    )  # fmt: skip
    return s.attention(
        kind_name, a, cache, heads_per_rank=hpr, kv_heads_per_rank=0, kv_copies=float(d),
        latent=latent, why=f"{hpr} heads per rank; latent projections {latent} ({why_latent})",
    )  # fmt: skip


def layout(i: LayoutInputs) -> MLALayout:
    check_stream_formats(f"attention_kinds.{i.name}", i.segments, fused=False)
    kind, shard = i.kind, i.shard
    context, batch = i.options.context, i.options.batch
    parts = {t.name: part_of(t, i.devices) for t in shard.tensors}
    present = [n for n in ("q_norm", "kv_norm") if f"attn.{n}" in parts]
    vectors = [
        VectorRow(name=n, row=2 + j, part=parts[f"attn.{n}"], length=parts[f"attn.{n}"].size)
        for j, n in enumerate(present)
    ]
    width = kind.kv_lora_rank + kind.qk_rope_head_dim
    return MLALayout(
        name=i.name,
        index=i.index,
        layers=i.layers,
        heads=shard.heads_per_rank,
        group=shard.heads_per_rank,
        q_rows=q_rows(shard.heads_per_rank, i.options.rows),
        q_lora_rank=kind.q_lora_rank or 0,
        kv_lora_rank=kind.kv_lora_rank,
        nope_dim=kind.qk_nope_head_dim,
        rope_dim=kind.qk_rope_head_dim,
        v_dim=kind.v_head_dim,
        head_dim=width,
        value_dim=kind.kv_lora_rank,
        gate=kind.output_gate == "sigmoid",
        latent_eps=kind.latent_norm_eps if kind.latent_norm_eps is not None else i.dims.norm_eps,
        softmax_scale=mla_softmax_scale(kind),
        rope=rope_layout(kind.rope, kind.qk_rope_head_dim).model_copy(
            update={"interleaved": False}  # the views store rotary pairs as halves
        )
        if kind.rope
        else None,
        columns=segment_columns(i.segments, "down", "attn."),
        latent_split=shard.latent == "split",
        segments=i.segments,
        ops=ops(kind),
        vectors=vectors,
        kv_tile=i.kv_tile,
        caches=[
            CacheArray(
                name="latent", shape=[len(i.layers), batch, 1, context, width], dtype="bfloat16"
            )
        ],
    )


def rotary_dim(kind: Any) -> int:
    return kind.qk_rope_head_dim if kind.rope is not None else 0


def cache_geometry(kind: Any, shard: Any, rows: int) -> CacheGeometry:
    """Every query head's rows over the one latent cache, its values a prefix of its keys."""
    return CacheGeometry(
        q_rows=q_rows(shard.heads_per_rank, rows), key=kind.kv_lora_rank + kind.qk_rope_head_dim,
        value=kind.kv_lora_rank, window=None, caches=1, kv_heads=1, sinks=False,
    )  # fmt: skip


def buffers(out: Any, i: BufferInputs) -> None:
    kind, heads, dims = i.kind, i.shard.heads_per_rank, i.dims
    row = kind.kv_lora_rank + kind.qk_rope_head_dim
    qr = q_rows(heads, dims.rows)
    cache_attention.buffers(out, i.name, dims, 1, qr, (1, row, kind.kv_lora_rank))
    uk, uv = i.stream.attention[i.name].segment("uk"), i.stream.attention[i.name].segment("uv")
    stacked = heads * dims.tokens_padded
    out.add(f"{i.name}_xk_heads_vmem", "attention",
            (max(uk.k_chunks, uv.k_chunks), stacked, CHUNK), "bf16",
            why="uk / uv inputs, one row block per head")  # fmt: skip
    out.add(f"{i.name}_acc_heads_vmem", "attention",
            (max(uk.col_blocks, uv.col_blocks), stacked, LANES), "f32",
            why="uk / uv outputs, one row block per head")  # fmt: skip


def ops(kind: Any) -> list[str]:
    """The layer's ops in the order its kernel function runs them: `program` emits them in
    this order and the template prints them in it (MLALayout.ops)."""
    q_b = ["q_b"] if kind.q_lora_rank else []
    return ["cache_read", "down", "latent_norms", *q_b, "uk", "cache_write", "attend", "uv", "o",
            "combine"]  # fmt: skip


def program(b: Any, s: Step) -> int:
    """The layer's ops (`ops`): the cache block's read started, the down projection (q and
    kv latents), latent norms, q up-projection, q_nope into latent space (uk), cache write, attention over the latent
    cache's tiles, latent -> values (uv), output projection, all-reduce."""
    layer, name, kind = s.layer, s.name, s.kind
    lat = kind.kv_lora_rank + kind.qk_rope_head_dim
    y = wrote = s.x
    for op in ops(kind):
        if op in ("down", "q_b", "uk", "uv", "o"):
            y = b.segment(layer, name, s.segments[op], s.stream_row, y)
            if op == "down":  # the latent projections' all-gather when they are split
                y = b.collective(layer, s.collectives.get("mla_latent"), y)
        elif op == "latent_norms":
            y = b.vec(layer, f"{name}: latent norms", y, 5 * b.t * (
                (kind.q_lora_rank or 0) + kind.kv_lora_rank), ((s.vectors, None, 0),))  # fmt: skip
        elif op == "cache_read":
            read = cache_attention.cache_read(b, layer, name, 1, 1, lat)
        elif op == "cache_write":
            wrote = cache_attention.cache_write(b, layer, name, 1, 1, lat, read, y)
        elif op == "attend":
            y = _attend(b, s, y, wrote)
        else:  # combine
            y = b.collective(layer, s.collectives.get("attn_out"), y)
    return y


def _attend(b: Any, s: Step, q: int, wrote: int) -> int:
    """Online-softmax attention of each sequence's q heads over the latent cache's tiles."""
    layer, name, kind, dims = s.layer, s.name, s.kind, b.dims
    lat = kind.kv_lora_rank + kind.qk_rope_head_dim
    tile = dims.kv_tiles[name]
    n = kv_tiles(dims.context, tile, None, dims.rows)
    qr = q_rows(s.shard.heads_per_rank, dims.rows)
    sems = [(f"{name}_tile_sems[0,{buf}]",) for buf in range(2)]
    flops = 2 * qr * tile * (lat + kind.kv_lora_rank)
    out = {}

    def sequence() -> None:
        out["o"] = cache_attention.tiles(b, layer, name, wrote, q, n, tile * lat * 2,
                                         sems, flops)  # fmt: skip

    b.folded(dims.batch, sequence)
    return out["o"]
