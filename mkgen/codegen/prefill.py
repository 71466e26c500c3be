"""The XLA prefill over a build's per-core layouts: a prompt's tokens into the kernel's caches.

One jitted call a layer (one compilation per pair of attention and FFN kinds), a
shard_map over the kernel's mesh axis. Every core unpacks its own banks, vector slab and
expert arrays (mkgen.codegen.unpack), all-gathers the pieces of the layer's other
tensors and runs the reference layer (mkgen.reference.model) on the whole prompt.
Routed experts stay where they are: each core runs the experts it holds, one at a time
over the prompt weighted by each token's combine weight for it, and a psum adds the
cores' shares. Each core then cuts its share of the
reference caches the layer wrote into the kernel's cache layout (kernel_cache_pieces), so
decoding continues in the megakernel at the position after the prompt.

Memory: besides the weights already placed, a device holds the prompt's activations,
one layer's tensors other than routed experts (f32), one expert's activations and the
layer's reference cache. Compute for everything but the routed experts is replicated on
every core (a head-split prefill would divide it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mkgen.codegen import unpack
from mkgen.codegen.pack import expert_arrays
from mkgen.plan.layout import GQALayout, KernelLayout, MLALayout, MoELayout, RecurrentLayout
from mkgen.reference import model as reference
from mkgen.reference.layers import gated_activation, mm, rms_norm
from mkgen.spec.schema import ModelSpec
from mkgen.spec.weights import attention_weights, model_weights

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
        if rope is not None and rope.interleaved:  # as mkgen.plan.stream.mla_views stores it
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
    rows = next(c for c in kind.caches if c.name == "state").shape[2]

    def current(x):  # [B, ...] -> [B, rows, ...]: the snapshot a step starts from
        return jnp.zeros((x.shape[0], rows, *x.shape[1:]), x.dtype).at[:, rows - 1].set(x)

    return {"conv": current(jnp.concatenate(conv, axis=-1)), "state": current(state)}


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


def _layer_step(
    spec: ModelSpec,
    layout: KernelLayout,
    mesh: Mesh,
    axis: str,
    layer: int,
    shapes: Mapping[str, tuple[int, ...]],
):
    """A jitted pass through one layer of `layer`'s kinds (layers of the same attention
    and FFN kinds share it): (stream, vectors, the FFN kind's expert arrays, h [B, T,
    hidden], the first stream rows of its attention and FFN kinds, its index, its FFN slot) -> (h after the layer, its
    kernel cache pieces, each [devices, B, ...])."""
    attention = layout.attention[layout.attention_table[layer]]
    ffn = layout.ffn[layout.ffn_table[layer]]
    sizes = (layout.stream.attention[attention.name].rows, layout.stream.ffn[ffn.name].rows)

    def body(stream, vectors, experts, h, firsts, index, slot):
        rank = jax.lax.axis_index(axis)
        rows = stream[0].reshape(-1, stream.shape[-1])
        kind_rows = tuple(
            jax.lax.dynamic_slice_in_dim(rows, first, size, axis=0)
            for first, size in zip(firsts, sizes, strict=True)
        )
        slab = vectors[0, index]
        own = [array[0, slot] for array in experts]
        pieces = unpack.layer_pieces(layout, layer, kind_rows, slab, own, shapes)
        routed = {n: pieces.pop(f"ffn.{n}") for n in unpack.EXPERT_TENSORS if f"ffn.{n}" in pieces}
        gathered = {n: jax.lax.all_gather(v, axis) for n, v in pieces.items()}
        w = unpack.assemble(layout, layer, gathered, shapes)
        zero_centered = layout.zero_centered
        x = rms_norm(h, w["attn_norm"], layout.norm_eps, zero_centered)
        cache = reference.init_layer_cache(spec, layer, h.shape[0], layout.context, jnp.bfloat16)
        attn = reference.layer_weights(w, "attn.")
        out, cache = reference.attention(spec, layer, attn, x, cache, jnp.int32(0))
        h = h + out
        x = rms_norm(h, w["ffn_norm"], layout.norm_eps, zero_centered)
        weights = reference.layer_weights(w, "ffn.")
        kwargs = {}
        if isinstance(ffn, MoELayout):
            kwargs["routed"] = _routed_on_this_core(ffn, routed, axis)
        h = h + reference.ffn(spec, layer, weights, x, **kwargs)
        mine = kernel_cache_pieces(spec, attention, cache, rank)
        return h, {n: v[None] for n, v in mine.items()}

    replicated, sharded = P(), P(axis)
    n_experts = len(_expert_arrays(layout, layer))
    step = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(
            sharded,
            sharded,
            (sharded,) * n_experts,
            replicated,
            replicated,
            replicated,
            replicated,
        ),
        out_specs=(replicated, sharded),
        check_vma=False,
    )
    return jax.jit(step)


def _expert_arrays(layout: KernelLayout, layer: int) -> list[int]:
    """Indices (among the kernel's expert arrays: pack.expert_arrays) of layer `layer`'s
    FFN kind's arrays; [] for a dense layer."""
    kind = layout.ffn_table[layer]
    return [i for i, (index, _) in enumerate(expert_arrays(layout)) if index == kind]


def prefill(
    spec: ModelSpec,
    layout: KernelLayout,
    mesh: Mesh,
    axis: str,
    placed: Mapping[str, object],
    embedding: np.ndarray,
    tokens: np.ndarray,
    progress: Callable[[jax.Array], None] | None = None,
) -> list[jax.Array]:
    """The kernel's cache arrays (in kernel.cache_shapes() order, [devices, ...] sharded on
    `axis`) holding tokens [B, T] at positions 0..T - 1. `placed` holds the build's
    stream, vectors and experts as the runner places them; `progress` gets each layer's
    output as it is dispatched (the runner's progress bar waits for it)."""
    shapes = {w.name: w.shape for w in model_weights(spec)}
    replicated = NamedSharding(mesh, P())
    h = jax.device_put(np.asarray(embedding, np.float32)[np.asarray(tokens)], replicated)
    steps: dict[tuple[int, int], object] = {}
    written: dict[tuple[int, str], list[jax.Array]] = {}
    snapshots: list[jax.Array] = []
    residual = layout.attention_residual
    for layer in range(len(layout.attention_table)):
        if residual and layer % residual.block_size == 0:
            logits = placed["vectors"][0, layer, residual.logits_row]
            h = reference.mix_snapshots(spec, layer, h, snapshots, logits)
        pair = (layout.attention_table[layer], layout.ffn_table[layer])
        if pair not in steps:
            steps[pair] = _layer_step(
                spec, layout, mesh, axis, layer, reference.layer_weights(shapes, f"layers.{layer}.")
            )
        experts = tuple(placed["experts"][i] for i in _expert_arrays(layout, layer))
        stream = layout.stream
        firsts = (jnp.int32(stream.attention_rows[layer]), jnp.int32(stream.ffn_rows[layer]))
        h, pieces = steps[pair](
            placed["stream"], placed["vectors"], experts, h, firsts,
            jnp.int32(layer), jnp.int32(layout.ffn_slot[layer]),
        )  # fmt: skip
        for name, value in pieces.items():
            written.setdefault((pair[0], name), []).append(value)
        if progress is not None:
            progress(h)
    sharded = NamedSharding(mesh, P(axis))
    caches = []
    for kind in layout.attention:
        for array in kind.caches:
            stacked = jnp.stack(written[(kind.index, array.name)], axis=1)
            caches.append(jax.device_put(stacked.astype(array.dtype), sharded))
    return caches
