"""The XLA prefill over a build's per-core layouts: a prompt's tokens into the kernel's caches.

One jitted call a layer (one compilation per pair of attention and FFN kinds), a
shard_map over the kernel's mesh axis. Every core unpacks its own banks, vector slab and
expert arrays (mkgen.weights.unpack), computes its heads of the attention from its own
pieces (core_attention) and runs the reference layer's functions
(mkgen.reference.model) on its pieces. Routed experts stay where they are: each core
runs the experts it holds, one at a time over the prompt weighted by each token's
combine weight for it, and a psum adds the cores' shares. Each core then puts its share
of the layer's cache into the kernel's cache layout (own_kernel_cache_pieces,
kernel_cache_pieces), so decoding continues in the megakernel at the position after the
prompt.

Prompt lengths are bucketed: a layer runs over the prompt in chunks of powers of two
(prompt_chunks: 11 tokens go as 8, 2 and 1), each continuing the layer's reference
cache, so a build compiles a layer step only for the powers of two up to its context,
whatever the prompts' lengths.

Memory: besides the weights already placed, a device holds the prompt's activations,
its pieces of the layer's tensors (f32, unpacked), one expert's activations and the
layer's cache.
Attention (core_attention: a core's heads, its rows of wo), routed experts, and dense
MLPs and shared experts split by columns (_columns_split, _shared_columns_split) are
computed by their own cores, each on its share, a psum adding the shares; GQA and
recurrent cores keep only their own heads' cache. The MoE router and latent projections
and MLA's latent projections, where the plan splits them, are multiplied by each core's
own piece, the products all-gathered (column pieces) or summed (row pieces), as the
kernel joins them (_project_pieces). A replicated tensor is each core's own whole copy;
only the pieces of other split tensors (none in the shipped specs' layer kinds) are
gathered and computed whole on every core.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mkgen.kinds.dense.record import DenseLayout
from mkgen.kinds.gqa.record import GQALayout
from mkgen.kinds.mla.record import MLALayout
from mkgen.kinds.moe.record import MoELayout
from mkgen.kinds.recurrent.record import RecurrentLayout
from mkgen.plan.layout import KernelLayout
from mkgen.plan.stream import Part
from mkgen.reference import model as reference
from mkgen.reference.attention import Cache
from mkgen.reference.ffn import moe_ffn, shared_mlp
from mkgen.reference.layers import Project, gated_activation, mm, multiply, rms_norm
from mkgen.spec.schema import AttentionKind, ModelSpec
from mkgen.spec.weights import attention_weights, model_weights
from mkgen.weights import unpack
from mkgen.weights.pack import expert_arrays

AttentionLayout = GQALayout | MLALayout | RecurrentLayout


def _piece(x: jax.Array, axis: int, size: int, index: jax.Array | int) -> jax.Array:
    """Piece `index` of `size` along `axis` (index may be traced: a core's own rank)."""
    return jax.lax.dynamic_slice_in_dim(x, index * size, size, axis)


def kernel_cache_pieces(
    spec: ModelSpec, kind: AttentionLayout, cache: Mapping[str, jax.Array], rank: jax.Array | int
) -> dict[str, jax.Array]:
    """What core `rank` (an int, or traced) holds of a `kind` layer's reference cache
    (mkgen.reference.model.init_cache), per cache array of the kernel's `kind` without the
    kind's layer axis: GQA k and v [B, kv heads of the core, context, head_dim] (kv heads
    split, or shared by kv_rank_divisor consecutive cores); MLA latent [B, 1, context,
    latent | k_rope], whole on every core, rotary pairs stored as halves where the model's
    rope is interleaved; Gated DeltaNet / KDA conv [B, ROWS, W - 1, the core's q | k | v
    channels] and f32 state [B, ROWS, the core's value heads, Dk, Dv], the reference's in
    snapshot ROWS - 1 (the one a step starts from), the others zero."""
    if isinstance(kind, GQALayout):
        piece = rank // kind.kv_rank_divisor
        return {
            n: _piece(cache[n], 2, kind.kv_heads, piece).transpose(0, 2, 1, 3) for n in ("k", "v")
        }
    if isinstance(kind, MLALayout):
        k_rope = cache["k_rope"]
        rope = spec.attention_kinds[kind.name].rope
        if rope is not None and rope.interleaved:  # as mkgen.kinds.mla.views stores it
            k_rope = jnp.concatenate([k_rope[..., 0::2], k_rope[..., 1::2]], axis=-1)
        row = jnp.concatenate([cache["latent"].astype(k_rope.dtype), k_rope], axis=-1)
        return {"latent": row[:, None]}
    parts = {row.name: row.part for row in kind.vectors}
    widths = {n: shape[-1] for n, shape, _ in attention_weights(spec.attention_kinds[kind.name], 1)}
    conv, start = [], 0
    for name in ("conv_q", "conv_k", "conv_v"):
        channels = cache["conv"][..., start : start + widths[name]]
        part = parts[name]
        if part.axis is not None:
            channels = _piece(channels, -1, part.size, rank // part.rank_divisor)
        conv.append(channels)
        start += widths[name]
    state = _piece(cache["state"], 1, kind.value_heads, rank)
    rows = _snapshot_rows(kind)
    return {"conv": _current(jnp.concatenate(conv, axis=-1), rows), "state": _current(state, rows)}


def _snapshot_rows(kind: RecurrentLayout) -> int:
    """The snapshots a recurrent kind's kernel caches keep per sequence (one a row)."""
    return next(c for c in kind.caches if c.name == "state").shape[2]


def _current(x: jax.Array, rows: int) -> jax.Array:
    """x [B, ...] -> [B, rows, ...]: x as the snapshot a step starts from (row rows - 1),
    the others zero."""
    return jnp.zeros((x.shape[0], rows, *x.shape[1:]), x.dtype).at[:, rows - 1].set(x)


def own_kernel_cache_pieces(
    kind: GQALayout | RecurrentLayout, cache: Mapping[str, jax.Array]
) -> dict[str, jax.Array]:
    """A core's own cache of its heads (core_attention) in the kernel's layout, what
    kernel_cache_pieces cuts for that core from the whole reference cache: GQA's [B,
    context, kv heads, head_dim] as [B, kv heads, context, head_dim]; a recurrent kind's
    conv tail and state in the snapshot a step starts from."""
    if isinstance(kind, GQALayout):
        return {n: v.transpose(0, 2, 1, 3) for n, v in cache.items()}
    rows = _snapshot_rows(kind)
    return {n: _current(v, rows) for n, v in cache.items()}


def prefill_cache_of_kernel(
    spec: ModelSpec, kind: AttentionLayout, pieces: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """A `kind` layer's prefill cache from its kernel cache arrays on the host (each
    [devices, B, ...]: the layer's slot of every core's array), what _cache_cutter cut
    undone: for a kind whose cores keep their own caches (_own_cache), each core's own
    reference cache [devices, B, ...] (GQA's kv heads and positions swapped back, a
    recurrent kind's snapshot a step starts from); for MLA, the whole reference cache
    [B, ...] from core 0's latent row [latent | k_rope], its rotary halves interleaved
    again where the model's rope is."""
    if isinstance(kind, GQALayout):
        return {n: v.transpose(0, 1, 3, 2, 4) for n, v in pieces.items()}
    if isinstance(kind, RecurrentLayout):
        return {n: v[:, :, -1] for n, v in pieces.items()}
    mla = spec.attention_kinds[kind.name]
    row = pieces["latent"][0, :, 0]  # [B, context, latent | k_rope]
    latent, k_rope = row[..., : mla.kv_lora_rank], row[..., mla.kv_lora_rank :]
    if mla.rope is not None and mla.rope.interleaved:
        half = k_rope.shape[-1] // 2
        k_rope = np.stack([k_rope[..., :half], k_rope[..., half:]], axis=-1).reshape(k_rope.shape)
    return {"latent": latent, "k_rope": k_rope}


def _routed_on_this_core(ffn: MoELayout, experts: Mapping[str, jax.Array], axis: str):
    """A routed-experts function (mkgen.reference.ffn.RoutedExperts) for inside shard_map:
    the experts and columns this core holds (MoELayout: group rank // width_parts), summed
    over the cores. One expert at a time over every token, weighted by the token's combine
    weight for it (zero when it did not choose it): memory stays one expert's activations,
    where gathering each token's chosen matrices would hold T x top_k of them."""

    def routed(kind, _weights, x, chosen, weights):
        rank = jax.lax.axis_index(axis)
        first = rank // ffn.width_parts * ffn.experts_per_rank
        held = jnp.arange(ffn.experts_per_rank) + first  # [E_r] expert ids
        combine = jnp.sum(jnp.where(chosen[..., None] == held, weights[..., None], 0.0), axis=1)
        adds_down_bias = rank % ffn.width_parts == 0  # the width parts' partial sums add up

        def one_expert(total, mine):
            w, scale = mine
            gate, up = mm(x, w["experts_gate"]), mm(x, w["experts_up"])
            if kind.expert_bias:
                gate, up = gate + w["experts_b_gate"], up + w["experts_b_up"]
            out = mm(gated_activation(kind.activation, gate, up), w["experts_down"])
            if kind.expert_bias:
                out = out + jnp.where(adds_down_bias, w["experts_b_down"], 0.0)
            return total + scale[:, None] * out, None

        total = jnp.zeros((x.shape[0], experts["experts_down"].shape[-1]), jnp.float32)
        total, _ = jax.lax.scan(one_expert, total, (dict(experts), combine.T))
        return jax.lax.psum(total, axis)

    return routed


def prompt_chunks(length: int) -> list[tuple[int, int]]:
    """(start, size) of the pieces a prompt of `length` tokens is prefilled in: the powers
    of two of its binary form, largest first. A prompt of any length compiles a layer
    step only for chunk sizes among the powers of two up to the build's context (at most
    log2(context) + 1 of them), never for its own length."""
    chunks, start = [], 0
    for bit in reversed(range(length.bit_length())):
        if length >> bit & 1:
            chunks.append((start, 1 << bit))
            start += 1 << bit
    return chunks


def _columns_split(ffn: DenseLayout | MoELayout) -> bool:
    """Whether a dense FFN kind is split over the cores as tensor parallelism splits it:
    W_gate and W_up by columns, W_down by rows, each core its own piece, no biases. Each
    core then runs the MLP on its columns alone and a psum adds the cores' outputs, so
    no core computes the whole MLP."""
    if not isinstance(ffn, DenseLayout) or ffn.vectors:
        return False
    parts = {p.tensor: p for segment in ffn.segments for p in segment.parts}
    inputs = [n for n in ("ffn.w_gate", "ffn.w_up") if n in parts]
    return len(parts) == len(inputs) + 1 and _split_as_mlp(parts, inputs, "ffn.w_down")


def _shared_columns_split(ffn: DenseLayout | MoELayout) -> bool:
    """Whether a MoE kind's shared experts are split over the cores by columns
    (shared_gate and shared_up by columns, shared_down by rows, each core its own piece),
    so each core runs them on its columns alone and a psum adds the cores' outputs."""
    if not isinstance(ffn, MoELayout) or not ffn.shared_width:
        return False
    parts = {p.tensor: p for segment in ffn.segments for p in segment.parts}
    return _split_as_mlp(parts, ["ffn.shared_gate", "ffn.shared_up"], "ffn.shared_down")


def _split_as_mlp(parts: Mapping[str, Part], inputs: list[str], down: str) -> bool:
    """Whether the `inputs` tensors are all split by columns and `down` by rows, in pieces
    of one size, one per core, without views."""
    if down not in parts or not inputs or any(n not in parts for n in inputs):
        return False
    return all(
        p.view is None and p.rank_divisor == 1 and p.size == parts[down].size and p.axis == axis
        for p, axis in [(parts[down], -2), *((parts[n], -1) for n in inputs)]
    )


# The tensors each core multiplies by its own piece alone where the plan splits them,
# joining the products rather than the weight (_project_pieces): MoE's router and latent
# projections, MLA's latent (A) projections.
PROJECTED = ("ffn.router", "ffn.latent_in", "ffn.latent_out", "attn.wq_a", "attn.wkv_a")


def _projected_parts(kind: AttentionLayout | DenseLayout | MoELayout) -> dict[str, Part]:
    """A layer kind's parts of the PROJECTED tensors the plan splits, by tensor name."""
    parts = {p.tensor: p for segment in kind.segments for p in segment.parts}
    split = {n: parts[n] for n in PROJECTED if n in parts and parts[n].axis is not None}
    # One piece per core (KindShards.add_low_rank, mkgen.kinds.moe); a view (MLA's rotary
    # columns reordered) only on a column split, undone on the gathered product.
    assert all(p.rank_divisor == 1 and (p.view is None or p.axis == -1) for p in split.values())
    return split


def _project_pieces(
    parts: Mapping[str, Part],
    pieces: Mapping[str, jax.Array],
    prefix: str,
    axis: str,
    others: Project,
) -> Project:
    """x @ W for a split tensor `prefix` + name among `parts` (_projected_parts), from this
    core's piece of W (`pieces`, by unpack.piece_key) inside shard_map over `axis`: a column
    piece's product all-gathered, the cores' columns side by side in rank order (a view's
    columns put back in W's order); a row piece's product (of this core's columns of x)
    summed over the cores by a psum. So no core multiplies by the whole W, and every core
    ends with the whole x @ W, as the kernel's all-gathers and all-reduces leave it. Other
    names (replicated tensors: whole on every core) go to `others`."""

    def project(x: jax.Array, name: str) -> jax.Array:
        part = parts.get(prefix + name)
        if part is None:
            return others(x, name)
        piece = pieces[unpack.piece_key(part)]
        if part.axis == -1:
            product = jax.lax.all_gather(mm(x, piece), axis, axis=x.ndim - 1, tiled=True)
            return unpack.unviewed_columns(part.view, product) if part.view else product
        mine = _piece(x, -1, part.size, jax.lax.axis_index(axis))
        return jax.lax.psum(mm(mine, piece), axis)

    return project


def _replicated_pieces(*kinds: AttentionLayout | DenseLayout | MoELayout) -> set[str]:
    """The keys (unpack.piece_key) of the layer kinds' replicated pieces and the layer's
    norms: whole on every core, so that no core gathers them from the others."""
    parts = [p for kind in kinds for segment in kind.segments for p in segment.parts]
    parts += [row.part for kind in kinds for row in kind.vectors]
    return {unpack.piece_key(p) for p in parts if p.axis is None} | {"attn_norm", "ffn_norm"}


def _heads_split(attention: AttentionLayout) -> bool:
    """Whether each core computes a kind's attention for its own heads alone, from its
    own pieces (a psum adds the cores' output projections): every kind the layouts have
    (GQA, MLA, Gated DeltaNet, KDA)."""
    return isinstance(attention, GQALayout | MLALayout | RecurrentLayout)


def _own_cache(attention: AttentionLayout) -> bool:
    """Whether each core keeps its own prefill cache, of its own heads (GQA kv heads, a
    recurrent kind's conv channels and state), rather than the whole reference cache that
    every core computes alike (MLA's latent cache, whole on every core)."""
    return isinstance(attention, GQALayout | RecurrentLayout)


def _own_heads_kind(spec: ModelSpec, layer: int, attention: AttentionLayout) -> AttentionKind:
    """Layer `layer`'s attention kind cut to one core's heads: its q (value) heads and the
    kv (key) heads they read, kv heads shared by several cores computed by each of them;
    no output bias (added once, after the cores' outputs are summed)."""
    kind = spec.attention_of(layer)
    fields = type(kind).model_fields
    own: dict[str, object] = {
        field: getattr(attention, count)
        for field, count in attention.own_heads.items()
        if field in fields
    }
    if "o_bias" in fields:
        own["o_bias"] = False
    return kind.model_copy(update=own)


def core_attention(
    spec: ModelSpec,
    layout: KernelLayout,
    layer: int,
    pieces: Mapping[str, jax.Array],
    shapes: Mapping[str, tuple[int, ...]],
    x: jax.Array,
    cache: Cache,
    position: jax.Array | int,
    axis: str,
) -> tuple[jax.Array, Cache]:
    """One core's share of layer `layer`'s attention of x [B, T, hidden] (normed): its
    heads' output through its rows of wo (summed over the cores, plus bo, it is the
    layer's attention) and its cache holding the chunk too, the reference cache of its
    heads (GQA: [B, context, its kv heads, head_dim]; Gated DeltaNet / KDA: its q | k | v
    conv channels and its value heads' state; MLA: the whole latent cache). MLA's latent
    projections, where the plan splits them, go through the core's columns of wq_a and
    wkv_a, the products all-gathered over `axis` (_project_pieces): every core then
    norms the whole latents. `pieces` are the core's attention pieces
    (unpack.layer_pieces), `shapes` the layer's full tensor shapes."""
    attention = layout.attention[layout.attention_table[layer]]
    kind = _own_heads_kind(spec, layer, attention)
    split = _projected_parts(attention)
    keys = {unpack.piece_key(p) for p in split.values()}
    own = unpack.own_tensors(
        layout, layer, {n: v for n, v in pieces.items() if n not in keys}, shapes
    )
    project = _project_pieces(split, pieces, "attn.", axis, multiply(own))
    return reference.kind_attention(kind, own, x, cache, position, spec.dims, project)


def _layer_step(
    spec: ModelSpec,
    layout: KernelLayout,
    mesh: Mesh,
    axis: str,
    layer: int,
    shapes: Mapping[str, tuple[int, ...]],
):
    """A jitted pass of one prompt chunk through one layer of `layer`'s kinds (layers of
    the same attention and FFN kinds share it, one compilation per chunk size): (stream,
    vectors, the FFN kind's expert arrays, h [B, chunk, hidden], the layer's reference
    cache, the chunk's first position, the first stream rows of the layer's attention and
    FFN kinds, its index, its FFN slot) -> (h after the layer, the cache holding the chunk
    too)."""
    attention = layout.attention[layout.attention_table[layer]]
    ffn = layout.ffn[layout.ffn_table[layer]]
    sizes = (layout.stream.attention[attention.name].rows, layout.stream.ffn[ffn.name].rows)
    columns_split, shared_split = _columns_split(ffn), _shared_columns_split(ffn)
    heads_split, own_cache = _heads_split(attention), _own_cache(attention)
    projected_parts = _projected_parts(ffn)
    whole = _replicated_pieces(attention, ffn)
    kind = spec.attention_of(layer)
    o_bias = heads_split and getattr(kind, "o_bias", False)  # kinds with an output bias

    def body(stream, vectors, experts, h, cache, position, firsts, index, slot):
        rows = stream[0].reshape(-1, stream.shape[-1])
        kind_rows = tuple(
            jax.lax.dynamic_slice_in_dim(rows, first, size, axis=0)
            for first, size in zip(firsts, sizes, strict=True)
        )
        slab = vectors[0, index]
        own = [array[0, slot] for array in experts]
        pieces = unpack.layer_pieces(layout, layer, kind_rows, slab, own, shapes)
        kept = _kept_pieces(pieces, projected_parts, columns_split, shared_split, heads_split)
        gathered = {  # as unpack.assemble takes them: [ranks, *piece], a replicated one [1, ...]
            n: v[None] if n in whole else jax.lax.all_gather(v, axis) for n, v in pieces.items()
        }
        w = unpack.assemble(layout, layer, gathered, shapes)
        zero_centered = layout.zero_centered
        x = rms_norm(h, w["attn_norm"], layout.norm_eps, zero_centered)
        if heads_split:
            heads = kept.heads
            if own_cache:  # without the mesh axis
                cache = {n: v[0] for n, v in cache.items()}
            out, cache = core_attention(
                spec, layout, layer, heads, shapes, x, cache, position, axis
            )
            out = jax.lax.psum(out, axis) + (heads["attn.bo"] if o_bias else 0.0)
            if own_cache:
                cache = {n: v[None] for n, v in cache.items()}
        else:
            attn = reference.layer_weights(w, "attn.")
            out, cache = reference.attention(spec, layer, attn, x, cache, position)
        h = h + out
        x = rms_norm(h, w["ffn_norm"], layout.norm_eps, zero_centered)
        return h + _ffn_out(spec, layer, ffn, w, x, kept, projected_parts, axis), cache

    replicated, sharded = P(), P(axis)
    n_experts = len(_expert_arrays(layout, layer))
    cache_spec = sharded if own_cache else replicated
    step = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(
            sharded, sharded, (sharded,) * n_experts, replicated, cache_spec,
            *(replicated,) * 4,
        ),
        out_specs=(replicated, cache_spec),
        check_vma=False,
    )  # fmt: skip
    return jax.jit(step, donate_argnums=4)  # not h: the attention residual keeps snapshots


@dataclass
class _KeptPieces:
    """A core's pieces of one layer that its layer step uses as they are, not
    all-gathered (_kept_pieces): its experts, the projections multiplied in pieces, and,
    None where the layer is not split so, the MLP's columns, the shared experts' columns
    and the attention's pieces of the heads it computes alone."""

    routed: dict[str, Any]
    projected: dict[str, Any]
    mine: dict[str, Any] | None
    shared: dict[str, Any] | None
    heads: dict[str, Any] | None


def _kept_pieces(
    pieces: dict[str, Any],
    projected_parts: Mapping[str, Any],
    columns_split: bool,
    shared_split: bool,
    heads_split: bool,
) -> _KeptPieces:
    """Take the _KeptPieces out of `pieces`, in this order; what stays in `pieces` is
    assembled whole."""

    def take(chosen: Callable[[str], bool], strip: str = "") -> dict[str, Any]:
        return {n.removeprefix(strip): pieces.pop(n) for n in list(pieces) if chosen(n)}

    expert_keys = {f"ffn.{n}" for n in unpack.EXPERT_TENSORS}
    projected_keys = set(map(unpack.piece_key, projected_parts.values()))
    routed = take(lambda n: n in expert_keys, "ffn.")
    projected = take(lambda n: n in projected_keys)
    mine = take(lambda n: "ffn.w_" in n, "ffn.") if columns_split else None
    shared = take(lambda n: n.startswith("ffn.shared_"), "ffn.") if shared_split else None
    heads = take(lambda n: n.startswith("attn.")) if heads_split else None
    return _KeptPieces(routed, projected, mine, shared, heads)


def _ffn_out(
    spec: ModelSpec,
    layer: int,
    ffn: Any,
    w: Mapping[str, Any],
    x: jax.Array,
    kept: _KeptPieces,
    projected_parts: Mapping[str, Any],
    axis: str,
) -> jax.Array:
    """The FFN's output for the normed chunk `x` on one core: an MLP split by columns
    from the core's columns (summed over `axis`), a MoE layer from the core's experts
    (and its shared experts' columns, when split), anything else from the whole weights."""
    if kept.mine is not None:
        return jax.lax.psum(reference.ffn(spec, layer, kept.mine, x), axis)
    weights = reference.layer_weights(w, "ffn.")
    if not isinstance(ffn, MoELayout):
        return reference.ffn(spec, layer, weights, x)
    moe, on_this_core = spec.ffn_of(layer), _routed_on_this_core(ffn, kept.routed, axis)
    project = _project_pieces(projected_parts, kept.projected, "ffn.", axis, multiply(weights))
    shared = kept.shared
    if shared is None:
        return moe_ffn(moe, weights, x, spec.dims, on_this_core, project=project)
    routed_only = moe.model_copy(update={"shared_experts": None})
    out = moe_ffn(routed_only, weights, x, spec.dims, on_this_core, project=project)
    mlp = jax.lax.psum(shared_mlp(moe, shared, x), axis)
    if moe.shared_experts.gate:  # one scalar a token: gating the sum gates each share
        mlp = mlp * jax.nn.sigmoid(mm(x, shared["shared_gate_proj"]))
    return out + mlp


def _cache_cutter(spec: ModelSpec, layout: KernelLayout, mesh: Mesh, axis: str, layer: int):
    """A jitted cut of layer `layer`'s prefill cache into its kernel cache pieces, each
    [devices, B, ...] sharded on `axis`: every core keeps its own share. A kind whose
    cores keep their own caches (_own_cache) comes as those, sharded on `axis`, each put in
    the kernel's layout (own_kernel_cache_pieces); another as the whole
    reference cache, replicated, cut per core."""
    attention = layout.attention[layout.attention_table[layer]]
    if _own_cache(attention):  # vmapped over the cores' axis, which stays sharded
        return jax.jit(jax.vmap(lambda cache: own_kernel_cache_pieces(attention, cache)))

    def body(cache):
        mine = kernel_cache_pieces(spec, attention, cache, jax.lax.axis_index(axis))
        return {n: v[None] for n, v in mine.items()}

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(axis), check_vma=False))


def _start_cache(
    spec: ModelSpec,
    layout: KernelLayout,
    mesh: Mesh,
    axis: str,
    layer: int,
    batch: int,
    cached: Sequence[np.ndarray] | None,
) -> dict[str, jax.Array]:
    """Layer `layer`'s prefill cache before the prompt's first chunk (bf16 entries,
    recurrent states f32), made on the host so that each process places the same: zeros,
    or the layer's part of `cached` (the kernel's cache arrays on the host, in
    kernel.cache_shapes() order) turned back by prefill_cache_of_kernel. The reference
    cache, replicated; for a kind whose cores keep their own (_own_cache), each core's own
    reference cache of its heads, [devices, ...] sharded on `axis`."""
    attention = layout.attention[layout.attention_table[layer]]
    if _own_cache(attention):
        kind = _own_heads_kind(spec, layer, attention)
        to, lead = NamedSharding(mesh, P(axis)), (layout.devices,)
    else:
        kind, to, lead = spec.attention_of(layer), NamedSharding(mesh, P()), ()
    empty = jax.eval_shape(
        lambda: reference.init_kind_cache(kind, batch, layout.context, jnp.bfloat16)
    )
    if cached is None:
        values = {n: np.zeros(lead + a.shape, a.dtype) for n, a in empty.items()}
    else:
        first = sum(len(k.caches) for k in layout.attention[: attention.index])
        arrays = cached[first : first + len(attention.caches)]
        slot = layout.attention_slot[layer]
        pieces = {c.name: a[:, slot] for c, a in zip(attention.caches, arrays, strict=True)}
        values = prefill_cache_of_kernel(spec, attention, pieces)
    return {n: jax.device_put(values[n].astype(a.dtype), to) for n, a in empty.items()}


def _expert_arrays(layout: KernelLayout, layer: int) -> list[int]:
    """Indices (among the kernel's expert arrays: pack.expert_arrays) of layer `layer`'s
    FFN kind's arrays; [] for a dense layer."""
    kind = layout.ffn_table[layer]
    return [i for i, (index, _) in enumerate(expert_arrays(layout)) if index == kind]


class XlaPrefill:
    """The XLA prefill of one build's layout on one mesh. Its layer steps compile once
    per pair of kinds and chunk size (prompt_chunks) and are kept for later prompts:
    prefill_steps hands out one per build and mesh."""

    def __init__(self, spec: ModelSpec, layout: KernelLayout, mesh: Mesh, axis: str) -> None:
        self.spec, self.layout, self.mesh, self.axis = spec, layout, mesh, axis
        self.shapes = {w.name: w.shape for w in model_weights(spec)}
        self.steps: dict[tuple[int, int], Callable[..., tuple[jax.Array, dict]]] = {}
        self.cutters: dict[int, Callable[..., dict[str, jax.Array]]] = {}

    def _step(self, layer: int) -> Callable[..., tuple[jax.Array, dict]]:
        pair = (self.layout.attention_table[layer], self.layout.ffn_table[layer])
        if pair not in self.steps:
            shapes = reference.layer_weights(self.shapes, f"layers.{layer}.")
            self.steps[pair] = _layer_step(
                self.spec, self.layout, self.mesh, self.axis, layer, shapes
            )
            self.cutters[pair[0]] = _cache_cutter(
                self.spec, self.layout, self.mesh, self.axis, layer
            )
        return self.steps[pair]

    def __call__(
        self,
        placed: Mapping[str, object],
        embedding: np.ndarray,
        tokens: np.ndarray,
        progress: Callable[[jax.Array], None] | None = None,
        start: int = 0,
        cached: Sequence[np.ndarray] | None = None,
    ) -> list[jax.Array]:
        """prefill's caches of tokens [B, T] at positions start.. (prefill)."""
        spec, layout = self.spec, self.layout
        replicated = NamedSharding(self.mesh, P())
        embedded = np.asarray(embedding, np.float32)[np.asarray(tokens)]
        chunks = prompt_chunks(tokens.shape[1])
        h = [jax.device_put(embedded[:, a : a + n], replicated) for a, n in chunks]
        written: dict[tuple[int, str], list[jax.Array]] = {}
        snapshots: list[list[jax.Array]] = [[] for _ in chunks]  # per chunk
        residual = layout.attention_residual
        batch = tokens.shape[0]
        for layer in range(len(layout.attention_table)):
            if residual and layer % residual.block_size == 0:
                logits = placed["vectors"][0, layer, residual.logits_row]
                h = [
                    reference.mix_snapshots(spec, layer, piece, kept, logits)
                    for piece, kept in zip(h, snapshots, strict=True)
                ]
            step = self._step(layer)
            experts = tuple(placed["experts"][i] for i in _expert_arrays(layout, layer))
            stream = layout.stream
            firsts = (jnp.int32(stream.attention_rows[layer]), jnp.int32(stream.ffn_rows[layer]))
            cache = _start_cache(spec, layout, self.mesh, self.axis, layer, batch, cached)
            for c, (position, _) in enumerate(chunks):
                h[c], cache = step(
                    placed["stream"], placed["vectors"], experts, h[c], cache,
                    jnp.int32(start + position),
                    firsts, jnp.int32(layer), jnp.int32(layout.ffn_slot[layer]),
                )  # fmt: skip
            kind = layout.attention_table[layer]
            for name, value in self.cutters[kind](cache).items():
                written.setdefault((kind, name), []).append(value)
            if progress is not None:
                progress(h[-1])
        sharded = NamedSharding(self.mesh, P(self.axis))
        caches = []
        for kind in layout.attention:
            for array in kind.caches:
                stacked = jnp.stack(written[(kind.index, array.name)], axis=1)
                caches.append(jax.device_put(stacked.astype(array.dtype), sharded))
        return caches


# prefill_steps' prefills by (id(spec), id(layout), mesh, axis); each entry keeps its spec
# and layout alive, so their ids are not reused while it stands.
_PREFILLS: dict[tuple[int, int, Mesh, str], tuple[ModelSpec, KernelLayout, XlaPrefill]] = {}


def prefill_steps(spec: ModelSpec, layout: KernelLayout, mesh: Mesh, axis: str) -> XlaPrefill:
    """The XlaPrefill of a build's (spec, layout) on `mesh`, made once: a server's prompts
    reuse its compiled steps."""
    key = (id(spec), id(layout), mesh, axis)
    if key not in _PREFILLS:
        _PREFILLS[key] = (spec, layout, XlaPrefill(spec, layout, mesh, axis))
    return _PREFILLS[key][2]


def prefill(
    spec: ModelSpec,
    layout: KernelLayout,
    mesh: Mesh,
    axis: str,
    placed: Mapping[str, object],
    embedding: np.ndarray,
    tokens: np.ndarray,
    progress: Callable[[jax.Array], None] | None = None,
    start: int = 0,
    cached: Sequence[np.ndarray] | None = None,
) -> list[jax.Array]:
    """The kernel's cache arrays (in kernel.cache_shapes() order, [devices, ...] sharded on
    `axis`) holding tokens [B, T] at positions start..start + T - 1 and, before them,
    what `cached` holds (kernel cache arrays on the host, as offloaded, holding the
    sequences' first `start` tokens; None: start is 0). `placed` holds the build's
    stream, vectors and experts as the runner places them; `progress` gets each layer's
    output as it is dispatched (the runner's progress bar waits for it).

    Layer by layer, the prompt goes through in chunks (prompt_chunks), each continuing
    the layer's reference cache (empty, or `cached` turned back into it), which is then
    cut into the kernel's layout."""
    return prefill_steps(spec, layout, mesh, axis)(
        placed, embedding, tokens, progress, start, cached
    )
