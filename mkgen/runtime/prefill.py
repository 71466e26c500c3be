"""The XLA prefill over a build's per-core layouts: a prompt's tokens into the kernel's caches.

One jitted call a layer (one compilation per pair of attention and FFN kinds), a
shard_map over the kernel's mesh axis. Every core unpacks its own banks, vector slab and
expert arrays (mkgen.weights.unpack), computes its heads of the attention from its own
pieces (core_attention) and runs the reference layer's functions
(mkgen.reference.model) on its pieces. Routed experts stay where they are: each core
runs the experts it holds, one at a time over the prompt weighted by each token's
combine weight for it, and a psum adds the cores' shares. Each core then puts its share
of the layer's cache into the kernel's cache layout (its attention record's
own_cache_pieces or cache_pieces), so decoding continues in the megakernel at the
position after the prompt.

Prompt lengths are bucketed: a layer runs over the prompt in chunks of powers of two
(prompt_chunks: 11 tokens go as 8, 2 and 1), each continuing the layer's reference
cache, so a build compiles a layer step only for the powers of two up to its context,
whatever the prompts' lengths.

Memory: besides the weights already placed, a device holds the prompt's activations,
its pieces of the layer's tensors (f32, unpacked), one expert's activations and the
layer's cache.
Attention (core_attention: a core's heads, its rows of wo), routed experts, and dense
MLPs and shared experts split by columns (the FFN record's columns_split and
shared_columns_split) are computed by their own cores, each on its share, a psum adding
the shares (shared experts split by output columns, shared_outputs_split: their gate and
up products all-gathered, then each core's columns of their output, all-gathered); GQA
and recurrent cores keep only their own heads' cache (own_cache). The
MoE router and latent projections and MLA's latent projections, where the plan splits
them, are multiplied by each core's own piece, the products all-gathered (column pieces)
or summed (row pieces), as the kernel joins them (_project_pieces). A replicated tensor
is each core's own whole copy; only the pieces of other split tensors (none in the
shipped specs' layer kinds) are gathered and computed whole on every core.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mkgen.kinds.common.caches import piece as cut_piece
from mkgen.plan.fused import MODULE_PREFIX, DraftPasses, fused_model
from mkgen.plan.layout import AttentionRecord, FFNRecord, KernelLayout, KindRecord
from mkgen.plan.stream import Part
from mkgen.reference import model as reference
from mkgen.reference.attention import Cache
from mkgen.reference.ffn import moe_ffn, shared_mlp
from mkgen.reference.layers import Project, gated_activation, mm, multiply, rms_norm, softcap
from mkgen.spec.schema import AttentionKind, ModelSpec
from mkgen.spec.weights import model_weights
from mkgen.weights import unpack
from mkgen.weights.pack import expert_arrays


def _routed_on_this_core(ffn: Any, experts: Mapping[str, jax.Array], axis: str):
    """A routed-experts function (mkgen.reference.ffn.RoutedExperts) for inside shard_map:
    the experts of its own group's block and its columns (with expert sharing not the
    next group's shared part, which that group runs: unpack.layer_pieces), summed
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


# The tensors each core multiplies by its own piece alone where the plan splits them,
# joining the products rather than the weight (_project_pieces): MoE's router and latent
# projections, MLA's latent (A) projections.
PROJECTED = ("ffn.router", "ffn.latent_in", "ffn.latent_out", "attn.wq_a", "attn.wkv_a")


def _projected_parts(kind: KindRecord) -> dict[str, Part]:
    """A layer kind's parts of the PROJECTED tensors the plan splits, by tensor name."""
    parts = kind.stream_parts()
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
            product = _gathered_product(x, piece, axis)
            return unpack.unviewed_columns(part.view, product) if part.view else product
        mine = cut_piece(x, -1, part.size, jax.lax.axis_index(axis))
        return jax.lax.psum(mm(mine, piece), axis)

    return project


def _gathered_product(x: jax.Array, piece: jax.Array, axis: str) -> jax.Array:
    """x @ W from this core's column piece of W: the cores' products side by side, in rank
    order (inside shard_map over `axis`)."""
    return jax.lax.all_gather(mm(x, piece), axis, axis=x.ndim - 1, tiled=True)


def _replicated_pieces(*kinds: KindRecord) -> set[str]:
    """The keys (unpack.piece_key) of the layer kinds' replicated pieces and the layer's
    norms: whole on every core, so that no core gathers them from the others."""
    parts = [p for kind in kinds for segment in kind.segments for p in segment.parts]
    parts += [row.part for kind in kinds for row in kind.vectors]
    return {unpack.piece_key(p) for p in parts if p.axis is None} | {"attn_norm", "ffn_norm"}


def _own_heads_kind(spec: ModelSpec, layer: int, attention: AttentionRecord) -> AttentionKind:
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
    columns_split = ffn.columns_split()
    shared_split = ffn.shared_columns_split() or ffn.shared_outputs_split()
    heads_split, own_cache = attention.heads_split, attention.own_cache
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
    ffn: FFNRecord,
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
    if not ffn.routed_experts:
        return reference.ffn(spec, layer, weights, x)
    moe, on_this_core = spec.ffn_of(layer), _routed_on_this_core(ffn, kept.routed, axis)
    project = _project_pieces(projected_parts, kept.projected, "ffn.", axis, multiply(weights))
    shared = kept.shared
    if shared is None:
        return moe_ffn(moe, weights, x, spec.dims, on_this_core, project=project)
    routed_only = moe.model_copy(update={"shared_experts": None})
    out = moe_ffn(routed_only, weights, x, spec.dims, on_this_core, project=project)
    if ffn.shared_outputs_split():  # every core's columns of their inputs, then its own outputs
        gate, up = (_gathered_product(x, shared[n], axis) for n in ("shared_gate", "shared_up"))
        hidden = gated_activation(moe.activation, gate, up)
        mlp = _gathered_product(hidden, shared["shared_down"], axis)
    else:
        mlp = jax.lax.psum(shared_mlp(moe, shared, x), axis)
    if moe.shared_experts.gate:  # one scalar a token: gating the sum gates each share
        mlp = mlp * jax.nn.sigmoid(mm(x, shared["shared_gate_proj"]))
    return out + mlp


def _cache_cutter(spec: ModelSpec, layout: KernelLayout, mesh: Mesh, axis: str, layer: int):
    """A jitted cut of layer `layer`'s prefill cache into its kernel cache pieces, each
    [devices, B, ...] sharded on `axis`: every core keeps its own share. A kind whose
    cores keep their own caches (own_cache) comes as those, sharded on `axis`, each put in
    the kernel's layout (its record's own_cache_pieces); another as the whole
    reference cache, replicated, cut per core (its record's cache_pieces)."""
    attention = layout.attention[layout.attention_table[layer]]
    if attention.own_cache:  # vmapped over the cores' axis, which stays sharded
        return jax.jit(jax.vmap(attention.own_cache_pieces))

    def body(cache):
        mine = attention.cache_pieces(spec, cache, jax.lax.axis_index(axis))
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
    kernel.cache_shapes() order) turned back by its record's prefill_cache. The reference
    cache, replicated; for a kind whose cores keep their own (own_cache), each core's own
    reference cache of its heads, [devices, ...] sharded on `axis`."""
    attention = layout.attention[layout.attention_table[layer]]
    if attention.own_cache:
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
        values = attention.prefill_cache(spec, pieces)
    return {n: jax.device_put(values[n].astype(a.dtype), to) for n, a in empty.items()}


def _expert_arrays(layout: KernelLayout, layer: int) -> list[int]:
    """Indices (among the kernel's expert arrays: pack.expert_arrays) of layer `layer`'s
    FFN kind's arrays; [] for a dense layer."""
    kind = layout.ffn_table[layer]
    return [i for i, (index, _) in enumerate(expert_arrays(layout)) if index == kind]


def _head_step(
    spec: ModelSpec, layout: KernelLayout, passes: DraftPasses, mesh: Mesh, axis: str
) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """A jitted greedy draft from the MTP module's output, as a pass's head in the kernel:
    (stream, the module's final norm, out [B, 1, hidden]) -> (token [B], what the next entry
    chains on [B, 1, hidden]). Each core multiplies by its own columns of the LM head,
    unpacked from its stream (at lm_head_row), and the cores' logits are gathered in rank
    order, the vocabulary's order."""
    segment, first = layout.stream.tail[0], layout.stream.lm_head_row
    bank_rows, dims = layout.stream.bank_rows, spec.dims

    def body(stream, final_norm, out):
        rows = stream[0].reshape(-1, stream.shape[-1])[first : first + segment.rows]
        head = unpack.segment_matrix(segment, rows, bank_rows)
        normed = rms_norm(out, final_norm, layout.norm_eps, layout.zero_centered)
        mine = mm(normed[:, 0], head) * dims.logit_multiplier
        if dims.logit_softcap is not None:
            mine = softcap(mine, dims.logit_softcap)
        logits = jax.lax.all_gather(mine, axis, axis=1, tiled=True)
        return reference.greedy_token(spec, logits), normed if passes.chain_normed else out

    replicated = P()
    step = jax.shard_map(
        body, mesh=mesh, in_specs=(P(axis), replicated, replicated),
        out_specs=(replicated, replicated), check_vma=False,
    )  # fmt: skip
    return jax.jit(step)


class XlaPrefill:
    """The XLA prefill of one build's layout on one mesh. Its layer steps compile once
    per pair of kinds and chunk size (prompt_chunks) and are kept for later prompts:
    prefill_steps hands out one per build and mesh."""

    def __init__(self, spec: ModelSpec, layout: KernelLayout, mesh: Mesh, axis: str) -> None:
        passes = layout.draft_passes
        if passes is not None:  # the model the kernel runs: the MTP module's layer after L
            spec = fused_model(spec, passes.passes + 1)[0]
        self.spec, self.layout, self.mesh, self.axis = spec, layout, mesh, axis
        self.shapes = {w.name: w.shape for w in model_weights(spec)}
        self.steps: dict[tuple[int, int], Callable[..., tuple[jax.Array, dict]]] = {}
        self.cutters: dict[int, Callable[..., dict[str, jax.Array]]] = {}
        self.head: Callable[..., tuple[jax.Array, jax.Array]] | None = None  # _head_step

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
        layer_output: Callable[[int, list[jax.Array]], None] | None = None,
        module: ModuleInputs | None = None,
        drafted: Callable[[int, jax.Array], None] | None = None,
    ) -> list[jax.Array]:
        """prefill's caches of tokens [B, T] at positions start.. (prefill)."""
        spec, layout = self.spec, self.layout
        replicated = NamedSharding(self.mesh, P())
        # The prompt's rows only, then f32: not the whole table (Kimi K3's is 4.7 GB in f32).
        embedded = np.asarray(embedding[np.asarray(tokens)], np.float32)
        chunks = prompt_chunks(tokens.shape[1])
        h = [jax.device_put(embedded[:, a : a + n], replicated) for a, n in chunks]
        written: dict[tuple[int, str], list[jax.Array]] = {}
        snapshots: list[list[jax.Array]] = [[] for _ in chunks]  # per chunk
        residual = layout.attention_residual
        run = functools.partial(
            self._layer, placed, chunks, start, tokens.shape[0], cached, written
        )
        passes = layout.draft_passes
        for layer in range(len(layout.attention_table) if passes is None else passes.first_layer):
            if residual and layer % residual.block_size == 0:
                logits = placed["vectors"][0, layer, residual.logits_row]
                h = [
                    reference.mix_snapshots(spec, layer, piece, kept, logits)
                    for piece, kept in zip(h, snapshots, strict=True)
                ]
            h, _ = run(layer, h)
            if progress is not None:
                progress(h[-1])
            if layer_output is not None:
                layer_output(layer, h)
        if passes is not None:  # the MTP module's entries of the prompt, into its cache slot
            assert module is not None, "a kernel that drafts prefills its MTP module's cache"
            entries = module.entries(layout, passes, h, chunks, start, replicated)
            out, cache = run(passes.first_layer, entries)
            if drafted is not None:
                last = out[-1][:, -1:]
                at = start + tokens.shape[1]
                drafted(tokens.shape[1], self._drafts(placed, module, cache, last, at))
        sharded = NamedSharding(self.mesh, P(self.axis))
        caches = []
        for kind in layout.attention:
            for array in kind.caches:
                stacked = jnp.stack(written[(kind.index, array.name)], axis=1)
                caches.append(jax.device_put(stacked.astype(array.dtype), sharded))
        return caches

    def _layer(
        self, placed: Mapping[str, Any], chunks: list[tuple[int, int]], start: int, batch: int,
        cached: Sequence[np.ndarray] | None, written: dict[tuple[int, str], list[jax.Array]],
        layer: int, h: list[jax.Array],
    ) -> tuple[list[jax.Array], dict[str, jax.Array]]:  # fmt: skip
        """Layer `layer` over the chunks `h`: its output and its reference cache holding
        them, which is also cut into `written`."""
        cache = _start_cache(self.spec, self.layout, self.mesh, self.axis, layer, batch, cached)
        out = list(h)
        for c, (position, _) in enumerate(chunks):
            out[c], cache = self._chunk(placed, layer, out[c], cache, start + position)
        kind = self.layout.attention_table[layer]
        for name, value in self.cutters[kind](cache).items():
            written.setdefault((kind, name), []).append(value)
        return out, cache

    def _chunk(
        self, placed: Mapping[str, Any], layer: int, h: jax.Array, cache: dict[str, jax.Array],
        position: int,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:  # fmt: skip
        """Layer `layer` over one chunk `h` at `position`: its output and the cache holding
        it too (`cache` is donated)."""
        layout, stream = self.layout, self.layout.stream
        experts = tuple(placed["experts"][i] for i in _expert_arrays(layout, layer))
        firsts = (jnp.int32(stream.attention_rows[layer]), jnp.int32(stream.ffn_rows[layer]))
        return self._step(layer)(
            placed["stream"], placed["vectors"], experts, h, cache, jnp.int32(position),
            firsts, jnp.int32(layer), jnp.int32(layout.ffn_slot[layer]),
        )  # fmt: skip

    def _drafts(
        self, placed: Mapping[str, Any], module: ModuleInputs, cache: dict[str, jax.Array],
        last: jax.Array, at: int,
    ) -> jax.Array:  # fmt: skip
        """The drafts [B, passes] after the prompt's next token, as the kernel's passes make
        them after a step: the MTP module's greedy chain from its last prompt entry (`last`,
        its output [B, 1, hidden]) over its prefilled `cache` (donated), chained entry j at
        position at + j (at: the next token's position)."""
        passes = self.layout.draft_passes
        assert passes is not None
        if self.head is None:
            self.head = _head_step(self.spec, self.layout, passes, self.mesh, self.axis)
        final_norm = jnp.asarray(module.tensors[MODULE_PREFIX + "final_norm"])
        replicated = NamedSharding(self.mesh, P())
        drafts, out = [], last
        for j in range(passes.passes):
            token, chained = self.head(placed["stream"], final_norm, out)
            drafts.append(token)
            if j + 1 < passes.passes:
                h = module.projected(self.layout, passes, np.asarray(token)[:, None], chained,
                                     at + j, replicated)  # fmt: skip
                out, cache = self._chunk(placed, passes.first_layer, h, cache, at + j)
        return jnp.stack(drafts, axis=1)


@dataclass(frozen=True)
class ModuleInputs:
    """What the prefill of a kernel that drafts (layout.draft_passes) needs to fill its MTP
    module's cache: the module's tensors (`draft.0.*`, as the kernel stores them), the
    target's final norm and embedding, and the token after each prompt position [B, T]."""

    tensors: Mapping[str, np.ndarray]
    final_norm: np.ndarray
    embedding: np.ndarray
    following: np.ndarray

    def entries(
        self, layout: KernelLayout, passes: DraftPasses, h: list[jax.Array],
        chunks: list[tuple[int, int]], start: int, to: NamedSharding,
    ) -> list[jax.Array]:  # fmt: skip
        """The module layer's input for each chunk of the target's output `h` (pass 1's rows
        in the kernel): entry p pairs the final-normed state at p with the token after p,
        each RMS-normed (enorm, hnorm), joined, through eh_proj; the embedding zeroed at
        position 0 where the module masks it."""
        eps, zero_centered = layout.norm_eps, layout.zero_centered
        out = []
        for (offset, n), state in zip(chunks, h, strict=True):
            previous = rms_norm(state, jnp.asarray(self.final_norm), eps, zero_centered)
            tokens = self.following[:, offset : offset + n]
            out.append(self.projected(layout, passes, tokens, previous, start + offset, to))
        return out

    def projected(
        self, layout: KernelLayout, passes: DraftPasses, tokens: np.ndarray,
        previous: jax.Array, at: int, to: NamedSharding,
    ) -> jax.Array:  # fmt: skip
        """The module layer's input for entries at positions at.. pairing `tokens` [B, n]
        with `previous` [B, n, hidden] (final-normed target states, or a chained output):
        each RMS-normed (enorm, hnorm), joined, through eh_proj; the embedding zeroed at
        position 0 where the module masks it."""
        w = reference.layer_weights(self.tensors, MODULE_PREFIX)
        eps, zero_centered = layout.norm_eps, layout.zero_centered
        embedded = np.asarray(self.embedding[tokens], np.float32)
        if passes.mask_first_embedding:
            positions = at + np.arange(tokens.shape[1])
            embedded = np.where((positions == 0)[None, :, None], 0.0, embedded)
        joined = jnp.concatenate(
            [
                rms_norm(jax.device_put(embedded, to), w["enorm"], eps, zero_centered),
                rms_norm(previous, w["hnorm"], eps, zero_centered),
            ],
            axis=-1,
        )
        return mm(joined, jnp.asarray(w["eh_proj"]))


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
    layer_output: Callable[[int, list[jax.Array]], None] | None = None,
    module: ModuleInputs | None = None,
    drafted: Callable[[int, jax.Array], None] | None = None,
) -> list[jax.Array]:
    """The kernel's cache arrays (in kernel.cache_shapes() order, [devices, ...] sharded on
    `axis`) holding tokens [B, T] at positions start..start + T - 1 and, before them,
    what `cached` holds (kernel cache arrays on the host, as offloaded, holding the
    sequences' first `start` tokens; None: start is 0). `placed` holds the build's
    stream, vectors and experts as the runner places them; `progress` gets each layer's
    output as it is dispatched (the runner's progress bar waits for it); `layer_output`
    gets (layer, its output [B, n, HIDDEN] f32 per chunk), the residual stream after it
    (the runner keeps the layers its mtp or block drafter reads).

    Layer by layer, the prompt goes through in chunks (prompt_chunks), each continuing
    the layer's reference cache (empty, or `cached` turned back into it), which is then
    cut into the kernel's layout. A kernel that drafts (layout.draft_passes) also gets its
    MTP module's cache: the module's layer over the entries of the prompt (`module`), and
    `drafted` gets (T, the drafts [B, passes] after each sequence's next token): the
    module's greedy chain from the prompt's last entry, which the kernel's first step
    verifies as it verifies the drafts its passes write for the step after."""
    return prefill_steps(spec, layout, mesh, axis)(
        placed, embedding, tokens, progress, start, cached, layer_output, module, drafted
    )
