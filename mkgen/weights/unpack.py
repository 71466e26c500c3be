"""Per-core layouts back to tensors: the inverse of mkgen.weights.pack, in jax.numpy.

Every shape comes from the layout, so the functions trace: the sharded XLA prefill
(mkgen/runtime/prefill.py) unpacks each core's own banks, slab and expert arrays on its
device, gathers the pieces and assembles the layer's tensors, without the host ever
holding a weight. Quantized values come back as the kernel reads them (codes times
scales), so the prefill and the kernel compute with the same numbers.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from mkgen.plan.layout import ExpertChunks, KernelLayout
from mkgen.plan.stream import CHUNK, LANES, Part, Segment, TensorView
from mkgen.spec.quant import parse_format
from mkgen.weights.quantize import E2M1_VALUES

# A rank's routed pieces (its experts, its width part): they stay on their rank.
EXPERT_TENSORS = (
    "experts_gate", "experts_up", "experts_down", "experts_b_gate", "experts_b_up",
    "experts_b_down",
)  # fmt: skip


# ---------------------------------------------------------------- bytes in bf16 rows


def _row_bytes(rows: jax.Array) -> jax.Array:
    """bf16 rows [..., R, LANES] -> the uint8 rows they hold [..., 2R, LANES] (row 2a is
    the low byte of bf16 row a: mkgen.weights.quantize.as_bf16_rows)."""
    words = jax.lax.bitcast_convert_type(rows, jnp.uint16)
    low, high = (words & 0xFF).astype(jnp.uint8), (words >> 8).astype(jnp.uint8)
    pairs = jnp.stack([low, high], axis=-2)  # [..., R, 2, LANES]
    return pairs.reshape(*rows.shape[:-2], 2 * rows.shape[-2], rows.shape[-1])


def _row_floats(rows: jax.Array) -> jax.Array:
    """bf16 rows [..., 2R, LANES] -> the f32 rows they hold [..., R, LANES] (row 2a is the
    low half)."""
    words = jax.lax.bitcast_convert_type(rows, jnp.uint16).astype(jnp.uint32)
    words = words.reshape(*rows.shape[:-2], rows.shape[-2] // 2, 2, rows.shape[-1])
    return jax.lax.bitcast_convert_type(words[..., 0, :] | (words[..., 1, :] << 16), jnp.float32)


def _scaled(codes: jax.Array, scales: jax.Array) -> jax.Array:
    """Codes [n, CHUNK, LANES] times scales [n, S, LANES], scale row s covering CHUNK / S
    consecutive code rows."""
    repeat = codes.shape[-2] // scales.shape[-2]
    return codes.astype(jnp.float32) * jnp.repeat(scales.astype(jnp.float32), repeat, axis=-2)


def _nibbles(packed: jax.Array) -> jax.Array:
    """int8 bytes [..., CHUNK / 2, LANES] -> 4-bit codes [..., CHUNK, LANES] in [0, 15]
    (mkgen.weights.quantize.pack_nibbles: low nibble row r, high nibble row r + CHUNK / 2)."""
    byte = jax.lax.bitcast_convert_type(packed, jnp.uint8).astype(jnp.int32)
    return jnp.concatenate([byte & 0xF, byte >> 4], axis=-2)


def _nibble_pairs(packed: jax.Array) -> jax.Array:
    """int8 bytes [..., CHUNK / 2, LANES] -> 4-bit codes [..., CHUNK, LANES] in [0, 15]
    (mkgen.weights.quantize.pack_nibble_pairs: low nibble row 2a, high nibble row 2a + 1)."""
    byte = jax.lax.bitcast_convert_type(packed, jnp.uint8).astype(jnp.int32)
    pairs = jnp.stack([byte & 0xF, byte >> 4], axis=-2)  # [..., CHUNK / 2, 2, LANES]
    return pairs.reshape(*byte.shape[:-2], 2 * byte.shape[-2], byte.shape[-1])


def _e2m1(nibbles: jax.Array) -> jax.Array:
    magnitude = jnp.asarray(E2M1_VALUES)[nibbles & 7]
    return jnp.where(nibbles & 8, -magnitude, magnitude)


def _powers_of_two(e8m0: jax.Array) -> jax.Array:
    """E8M0 bytes -> 2^(byte - 127), built as f32 bits (exact, where exp2 may not be)."""
    biased = jax.lax.bitcast_convert_type(e8m0, jnp.uint8).astype(jnp.int32)
    return jax.lax.bitcast_convert_type(biased << 23, jnp.float32)


# ---------------------------------------------------------------- chunks and segments


def from_chunks(chunks: jax.Array, k_chunks: int, col_blocks: int, shape: tuple[int, int]):
    """Chunks [k_chunks * col_blocks, CHUNK, LANES] in stream order (pack.chunked) -> the
    [K, N] matrix of `shape` (padding dropped)."""
    blocks = chunks[: k_chunks * col_blocks].reshape(col_blocks, k_chunks, CHUNK, LANES)
    matrix = blocks.transpose(1, 2, 0, 3).reshape(k_chunks * CHUNK, col_blocks * LANES)
    return matrix[: shape[0], : shape[1]]


def segment_matrix(segment: Segment, rows: jax.Array, bank_rows: int) -> jax.Array:
    """A segment's stream rows [segment.rows, LANES] (bf16) -> its f32 matrix [fan_in,
    fan_out] (pack.segment_rows, inverted; quantized chunks times their scales)."""
    shape = (segment.fan_in, segment.fan_out)
    if segment.format == "bf16":
        k, size, tail = segment.k_chunks, segment.chunk_rows, segment.tail_rows
        body = rows[: segment.blocks * k * size].astype(jnp.float32)
        blocks = body.reshape(segment.blocks, k * size, LANES).transpose(1, 0, 2)
        matrix = blocks.reshape(k * size, segment.blocks * LANES)[: segment.fan_in]
        if tail:
            columns = rows[segment.blocks * k * size :].astype(jnp.float32)
            columns = columns.reshape(k, tail, LANES).transpose(0, 2, 1).reshape(k * LANES, tail)
            matrix = jnp.concatenate([matrix, columns[: segment.fan_in]], axis=1)
        return matrix[:, : segment.fan_out]
    banks = rows.reshape(-1, bank_rows, LANES)
    per, n = segment.chunks_per_bank, len(banks) * segment.chunks_per_bank
    code_rows = banks[:, : per * segment.code_rows].reshape(n, segment.code_rows, LANES)
    at = segment.scale_row
    scale_rows = banks[:, at : at + per * segment.scale_rows].reshape(n, segment.scale_rows, LANES)
    codes = _row_bytes(code_rows[: segment.chunks])  # [chunks, CHUNK, LANES] uint8
    fmt = parse_format(segment.format)
    codes = jax.lax.bitcast_convert_type(
        codes, jnp.int8 if fmt.kind == "int8" else jnp.float8_e4m3fn
    )
    values = _scaled(codes, _row_floats(scale_rows[: segment.chunks]))
    return from_chunks(values, segment.k_chunks, segment.col_blocks, shape)


def expert_values(experts: ExpertChunks, arrays: list[jax.Array]) -> jax.Array:
    """A layer's routed-expert arrays ([experts, pieces, rows, LANES]: bf16, or codes and
    scales, inline or not) -> f32 chunks [experts, pieces * piece_chunks, CHUNK, LANES]."""
    codes = arrays[0]
    if experts.inline_scales:  # the scale rows after the codes, then tile padding
        at = experts.code_rows
        codes, arrays = codes[..., :at, :], [None, codes[..., at : at + experts.scale_rows, :]]
    count = codes.shape[0] * experts.pieces * experts.piece_chunks
    lead = (codes.shape[0], experts.pieces * experts.piece_chunks)
    if experts.kind == "bf16":
        return codes.reshape(*lead, CHUNK, LANES).astype(jnp.float32)
    if experts.kind == "nvfp4":  # per piece: block scales, then a tensor-scale row a chunk
        pieces = arrays[1].reshape(-1, experts.scale_rows, LANES)
        at = experts.tensor_scale_row
        block = jax.lax.bitcast_convert_type(pieces[:, :at], jnp.float8_e4m3fn)
        tensor = _powers_of_two(pieces[:, at:]).reshape(count, 1, LANES)
        scales = block.astype(jnp.float32).reshape(count, -1, LANES) * tensor
    else:
        scales = arrays[1].reshape(count, -1, LANES)
    if experts.kind in ("fp8", "int8"):
        values = _scaled(codes.reshape(count, CHUNK, LANES), scales)
    elif experts.kind == "int4":  # two's complement nibbles
        nibbles = _nibble_pairs(codes.reshape(count, CHUNK // 2, LANES))
        values = _scaled(nibbles - 16 * (nibbles >= 8), scales)
    elif experts.kind == "nvfp4":  # e2m1 codes in nibble pairs; block x tensor scales
        values = _scaled(_e2m1(_nibble_pairs(codes.reshape(count, CHUNK // 2, LANES))), scales)
    else:  # mxfp4: e2m1 codes in half-chunk nibbles; E8M0 power-of-two scales
        nibbles = _nibbles(codes.reshape(count, CHUNK // 2, LANES))
        values = _scaled(_e2m1(nibbles), _powers_of_two(scales))
    return values.reshape(*lead, CHUNK, LANES)


def expert_matrices(experts: ExpertChunks, chunks: jax.Array) -> dict[str, jax.Array]:
    """f32 chunks of a rank's experts [E_r, chunks, CHUNK, LANES] -> its pieces of
    experts_gate / experts_up [E_r, d, width] and experts_down [E_r, width, d]."""
    d, width = experts.d, experts.width
    down_first = experts.gate_up_pieces * experts.piece_chunks

    def one(expert_chunks):
        gate_up = from_chunks(
            expert_chunks, experts.gate_up_k_chunks, experts.gate_up_col_blocks, (d, 2 * width)
        )
        down = from_chunks(
            expert_chunks[down_first:], experts.down_k_chunks, experts.down_col_blocks, (width, d)
        )
        return gate_up[:, :width], gate_up[:, width:], down

    gate, up, down = jax.vmap(one)(chunks)
    return {"experts_gate": gate, "experts_up": up, "experts_down": down}


# ---------------------------------------------------------------- one core's pieces


def layer_pieces(
    layout: KernelLayout,
    layer: int,
    kind_rows: tuple[jax.Array, jax.Array],
    slab: jax.Array,
    experts: list[jax.Array],
    shapes: Mapping[str, tuple[int, ...]],
) -> dict[str, jax.Array]:
    """One core's pieces of layer `layer`'s tensors, keyed by their names in the layer
    (attn.wq, ffn.experts_up, attn_norm, ...): the stream rows of its attention kind and of
    its FFN kind (each from the kind's first row, KindStream.rows of them), its vector slab
    and (MoE layers) its expert arrays. Each piece has the shape pack.part_slice cuts (in
    its part's view), routed-expert tensors (EXPERT_TENSORS) the rank's own group's experts
    (with expert sharing not the next group's shared part: FFNRecord.own_experts) and width
    part; `shapes` holds the layer's full tensor shapes by the same names."""
    attention = layout.attention[layout.attention_table[layer]]
    ffn = layout.ffn[layout.ffn_table[layer]]
    pieces = {"attn_norm": slab[0, : layout.hidden], "ffn_norm": slab[1, : layout.hidden]}
    for rows, segments in zip(kind_rows, (attention.segments, ffn.segments), strict=True):
        for segment in segments:
            own = rows[segment.offset : segment.offset + segment.rows]
            matrix = segment_matrix(segment, own, layout.stream.bank_rows)
            column = 0
            for part in segment.parts:
                width = piece_shape(part, shapes[part.tensor])[-1]
                pieces[piece_key(part)] = matrix[:, column : column + width]
                column += width
    for row in attention.vectors + ffn.vectors:
        shape = piece_shape(row.part, shapes[row.part.tensor])
        pieces[piece_key(row.part)] = slab[row.row : row.row + row.rows, : row.length].reshape(
            shape
        )
    routed = ffn.routed_chunks()
    if routed is not None:
        chunks = expert_values(routed, ffn.own_experts(experts))
        for name, value in expert_matrices(routed, chunks).items():
            pieces[f"ffn.{name}"] = value
    pieces.update(ffn.slab_pieces(slab))  # what its slab_blocks packed (expert biases)
    return pieces


def piece_shape(part: Part, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of one rank's piece of a tensor of `shape` (seen through the part's view)."""
    shape = part.view.shape(shape) if part.view else tuple(shape)
    if part.axis is None:
        return shape
    out = list(shape)
    out[part.axis] = part.size
    return tuple(out)


# ---------------------------------------------------------------- every core's pieces -> tensors


def _unview(view: TensorView, viewed: jax.Array, heads: int, k: int) -> jax.Array:
    """The [K, heads, size] block a view kept, from the viewed matrix (pack.viewed,
    inverted)."""
    if view.transpose:
        kept = viewed.reshape(heads, view.size, k).transpose(2, 0, 1)
    else:
        kept = viewed.reshape(k, heads, view.size)
    if view.rotary:
        offset, dims = view.rotary
        half = dims // 2
        rot = kept[:, :, offset : offset + dims]
        pairs = jnp.stack([rot[:, :, :half], rot[:, :, half:]], axis=-1)  # evens, odds
        kept = jnp.concatenate(
            [kept[:, :, :offset], pairs.reshape(k, heads, dims), kept[:, :, offset + dims :]],
            axis=2,
        )
    return kept


def _joined(part: Part, gathered: jax.Array) -> jax.Array:
    """Every rank's piece [ranks, *piece] -> the whole (viewed) tensor: one piece of each
    group of `rank_divisor` ranks, in order along the part's axis."""
    if part.axis is None:
        return gathered[0]
    distinct = gathered[:: part.rank_divisor]
    return jnp.concatenate(list(distinct), axis=part.axis)


def assemble(
    layout: KernelLayout,
    layer: int,
    gathered: Mapping[str, jax.Array],
    shapes: Mapping[str, tuple[int, ...]],
) -> dict[str, jax.Array]:
    """Layer `layer`'s tensors (not its routed experts, which stay split: prefill.py) from
    every rank's pieces, `gathered[name]` [ranks, *piece] (layer_pieces of every rank,
    stacked). Tensors seen through several views (MLA's wkv_b: uk and uv) are put back
    together from all of them. A tensor whose pieces `gathered` lacks (one the caller
    computes with piece by piece) is left out."""
    attention = layout.attention[layout.attention_table[layer]]
    ffn = layout.ffn[layout.ffn_table[layer]]
    parts = [p for s in attention.segments + ffn.segments for p in s.parts]
    parts += [row.part for row in attention.vectors + ffn.vectors]
    tensors = {name: gathered[name][0] for name in ("attn_norm", "ffn_norm")}
    viewed: dict[str, list[Part]] = {}
    for part in parts:
        if piece_key(part) not in gathered:
            continue
        if part.view is not None:
            viewed.setdefault(part.tensor, []).append(part)
        else:
            tensors[part.tensor] = _joined(part, gathered[piece_key(part)])
    for name, views in viewed.items():
        joined = [(p.view, _joined(p, gathered[piece_key(p)])) for p in views]
        tensors[name] = _from_views(joined, shapes[name][0])
    return tensors


def _from_views(views: list[tuple[TensorView, jax.Array]], k: int) -> jax.Array:
    """The [k, heads * stride] matrix (or its columns of some heads) that every view of a
    tensor, each with the viewed values of the same heads, was taken from."""
    first, values = views[0]
    heads = values.shape[0 if first.transpose else -1] // first.size
    full = jnp.zeros((k, heads, first.stride), jnp.float32)
    for view, viewed in views:
        kept = _unview(view, viewed, heads, k)
        full = full.at[:, :, view.start : view.start + view.size].set(kept)
    return full.reshape(k, heads * first.stride)


def unviewed_columns(view: TensorView, product: jax.Array) -> jax.Array:
    """x @ V [..., columns] for V a view of W that keeps all of W's columns, reordered
    (MLA's rotary columns as halves: not transposed, one head's whole stride) -> x @ W."""
    assert not view.transpose and view.start == 0 and view.size == view.stride, view
    rows = product.reshape(-1, product.shape[-1])
    return _from_views([(view, rows)], rows.shape[0]).reshape(product.shape)


def own_tensors(
    layout: KernelLayout,
    layer: int,
    pieces: Mapping[str, jax.Array],
    shapes: Mapping[str, tuple[int, ...]],
) -> dict[str, jax.Array]:
    """One core's attention tensors of layer `layer` from its own pieces (layer_pieces),
    keyed without "attn.": a tensor split by heads as the columns (or rows) of the core's
    heads, a replicated one whole; views undone (MLA's wkv_b from its uk and uv pieces,
    rotary columns back in the model's order). A tensor whose piece `pieces` lacks (one
    the caller multiplies by piece by piece: prefill._project_pieces) is left out."""
    attention = layout.attention[layout.attention_table[layer]]
    parts = [p for s in attention.segments for p in s.parts] + [r.part for r in attention.vectors]
    tensors: dict[str, jax.Array] = {}
    viewed: dict[str, list[tuple[TensorView, jax.Array]]] = {}
    for part in parts:
        if piece_key(part) not in pieces:
            continue
        if part.view is None:
            tensors[part.tensor] = pieces[piece_key(part)]
        else:
            viewed.setdefault(part.tensor, []).append((part.view, pieces[piece_key(part)]))
    for name, views in viewed.items():
        tensors[name] = _from_views(views, shapes[name][0])
    return {name.removeprefix("attn."): value for name, value in tensors.items()}


def _view_key(view: TensorView) -> str:
    """The suffix that keeps apart the pieces of one tensor's different views."""
    return f"@{view.start}:{view.size}"


def piece_key(part: Part) -> str:
    """The key layer_pieces stores a part's piece under (views of one tensor differ)."""
    return part.tensor + (_view_key(part.view) if part.view else "")
