"""Per-core weight layouts: inventory tensors -> the arrays a generated kernel reads.

numpy only. A layout (mkgen/plan/layout.py) says, for every segment of the
weight stream and every vector row, which slice of which inventory tensor a
core stores; this module cuts and places them.
"""

from __future__ import annotations

from collections.abc import Mapping

import ml_dtypes
import numpy as np

from mkgen.plan.fused import DRAFT_NORMS, MODULE_PREFIX
from mkgen.plan.layout import KernelLayout
from mkgen.plan.stream import CHUNK, LANES, Part, Segment, TensorView
from mkgen.spec.quant import parse_format
from mkgen.weights.quantize import (
    as_bf16_rows,
    fp8_quantize,
    int8_quantize,
    pack_fp8_chunks,
    pack_int4_chunks,
    pack_int8_chunks,
    pack_mxfp4_chunks,
    pack_nvfp4_chunks,
)

BF16 = ml_dtypes.bfloat16


def viewed(tensor: np.ndarray, view: TensorView) -> np.ndarray:
    """`tensor` [K, heads * stride] seen through `view` (mkgen/plan/stream.py)."""
    k, n = tensor.shape
    heads = n // view.stride
    kept = tensor.reshape(k, heads, view.stride)[:, :, view.start : view.start + view.size]
    if view.rotary:
        offset, dims = view.rotary
        rot = kept[:, :, offset : offset + dims]
        kept = np.concatenate(
            [kept[:, :, :offset], rot[:, :, 0::2], rot[:, :, 1::2], kept[:, :, offset + dims :]],
            axis=2,
        )
    if view.transpose:
        return kept.transpose(1, 2, 0).reshape(heads * view.size, k)
    return kept.reshape(k, heads * view.size)


def part_slice(part: Part, tensor: np.ndarray, rank: int) -> np.ndarray:
    """The piece of `tensor` (seen through the part's view) that `rank` stores."""
    if part.view is not None:
        tensor = viewed(tensor, part.view)
    if part.axis is None:
        return tensor
    piece = rank // part.rank_divisor
    index = [slice(None)] * tensor.ndim
    index[part.axis] = slice(piece * part.size, (piece + 1) * part.size)
    out = tensor[tuple(index)]
    if out.shape[part.axis] != part.size:
        raise ValueError(
            f"{part.tensor}: rank {rank} piece is {out.shape}, expected size {part.size}"
        )
    return out


def segment_matrix(
    segment: Segment, tensors: Mapping[str, np.ndarray], prefix: str, rank: int
) -> np.ndarray:
    """The [fan_in, fan_out] matrix a rank stores for a segment (parts fused along N)."""
    pieces = [part_slice(p, np.asarray(tensors[prefix + p.tensor]), rank) for p in segment.parts]
    matrix = np.concatenate(pieces, axis=1) if len(pieces) > 1 else pieces[0]
    if matrix.shape != (segment.fan_in, segment.fan_out):
        raise ValueError(
            f"{prefix}{segment.name}: {matrix.shape} != {(segment.fan_in, segment.fan_out)}"
        )
    return matrix


def chunked(matrix: np.ndarray, k_chunks: int, col_blocks: int) -> np.ndarray:
    """[K, N] -> [k_chunks * col_blocks, CHUNK, LANES]: chunk (kc, cb) at cb * k_chunks + kc,
    the order in which the kernel's matmuls consume them (zero padded)."""
    padded = np.zeros((k_chunks * CHUNK, col_blocks * LANES), np.float32)
    padded[: matrix.shape[0], : matrix.shape[1]] = matrix
    blocks = padded.reshape(k_chunks, CHUNK, col_blocks, LANES).transpose(2, 0, 1, 3)
    return blocks.reshape(-1, CHUNK, LANES)


def bf16_chunk_rows(segment: Segment, matrix: np.ndarray) -> np.ndarray:
    """A bf16 segment's stream rows [segment.rows, LANES] (mkgen/plan/stream.py): each
    column block's `chunk_rows`-row chunks of the fan-in, then the transposed tail block's
    chunks (its columns as rows, LANES of the fan-in each)."""
    k, rows, tail = segment.k_chunks, segment.chunk_rows, segment.tail_rows
    padded = np.zeros((k * CHUNK, segment.col_blocks * LANES), np.float32)
    padded[: matrix.shape[0], : matrix.shape[1]] = matrix
    blocks = padded[: k * rows, : segment.blocks * LANES].reshape(k, rows, segment.blocks, LANES)
    out = [blocks.transpose(2, 0, 1, 3).reshape(-1, LANES)]
    if tail:
        columns = padded[:, segment.blocks * LANES : segment.blocks * LANES + tail]  # [K, tail]
        out.append(columns.reshape(k, LANES, tail).transpose(0, 2, 1).reshape(-1, LANES))
    return np.concatenate(out)


def _chunk_scales(segment: Segment, matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes [chunks, CHUNK, LANES], scales f32 [chunks, scale rows / 2, LANES]) of a
    quantized segment, chunks in stream order. int8: the column scales over the whole
    fan-in, repeated for every chunk of a column block; fp8:B: the B x B blocks of the
    segment (whole blocks of its tensors: the layout checks), each scale repeated over
    its B columns."""
    fmt = parse_format(segment.format)
    k, cb = segment.k_chunks, segment.col_blocks
    padded = np.zeros((k * CHUNK, cb * LANES), np.float32)
    padded[: matrix.shape[0], : matrix.shape[1]] = matrix
    if fmt.kind == "int8":
        codes, scales = int8_quantize(padded)  # scales [1, N]
        rows = np.broadcast_to(scales.reshape(cb, 1, 1, LANES), (cb, k, 1, LANES))
    else:
        codes, scales = fp8_quantize(padded, fmt.group)  # [K / B, N / B]
        per = CHUNK // fmt.group
        full = np.repeat(scales, fmt.group, axis=1)  # [K / B, N]
        rows = full.reshape(k, per, cb, LANES).transpose(2, 0, 1, 3)
    code_chunks = codes.reshape(k, CHUNK, cb, LANES).transpose(2, 0, 1, 3)
    return code_chunks.reshape(-1, CHUNK, LANES), np.ascontiguousarray(rows).reshape(
        k * cb, -1, LANES
    ).astype(np.float32)


def segment_rows(segment: Segment, matrix: np.ndarray, bank_rows: int) -> np.ndarray:
    """A segment's stream rows [segment.rows, LANES] of bf16 bits (uint16): bf16 chunks as
    bf16_chunk_rows lays them out; a quantized segment's whole banks, a chunk's code bytes
    as bf16 rows, and after the bank's chunks (Segment.scale_row) their scales."""
    if segment.format == "bf16":
        return bf16_chunk_rows(segment, matrix).astype(BF16).view(np.uint16)
    out = np.zeros((segment.rows // bank_rows, bank_rows, LANES), np.uint16)
    codes, scales = _chunk_scales(segment, matrix)
    code_rows = as_bf16_rows(codes).view(np.uint16)  # [chunks, code_rows, LANES]
    scale_rows = as_bf16_rows(scales).view(np.uint16)  # [chunks, scale_rows, LANES]
    per = segment.chunks_per_bank
    for c in range(len(codes)):
        bank, j = divmod(c, per)
        out[bank, j * segment.code_rows : (j + 1) * segment.code_rows] = code_rows[c]
        at = segment.scale_row + j * segment.scale_rows
        out[bank, at : at + segment.scale_rows] = scale_rows[c]
    return out.reshape(-1, LANES)


def layer_row_range(layout: KernelLayout, layer: int) -> tuple[int, int]:
    """[first, end) rows of the stream that hold the target's layer `layer` (attention,
    then FFN segments, and any rows before the next layer's); layer -1 is the tail (the
    lm_head, to the end of the last bank, or to the passes of a kernel that drafts:
    passes_row_range). Every layer's rows are contiguous and in layer order, so a stream
    is the concatenation of its layers' ranges, the tail's and the passes'."""
    s, passes = layout.stream, layout.draft_passes
    count = len(layout.attention_table) if passes is None else passes.first_layer
    if layer < 0:
        return s.lm_head_row, passes_row_range(layout)[0]
    end = s.attention_rows[layer + 1] if layer + 1 < count else s.lm_head_row
    return s.attention_rows[layer], end


def passes_row_range(layout: KernelLayout) -> tuple[int, int]:
    """[first, end) rows of the stream that hold a fused drafter's passes (each pass's
    eh_proj, layer and LM head again, to the end of the last bank); empty without one."""
    s = layout.stream
    end = s.total_banks * s.bank_rows
    return (end, end) if s.draft is None else (s.draft.eh_proj_rows[0], end)


def _place(out: np.ndarray, layout: KernelLayout, first: int, segments, tensors, prefix, rank):
    """Write `segments` into the rows `out`, their kind's first row at out[first]."""
    for segment in segments:
        start = first + segment.offset
        if start < 0 or start + segment.rows > len(out):
            raise ValueError(f"{prefix}{segment.name}: rows outside the layer's range")
        matrix = segment_matrix(segment, tensors, prefix, rank)
        out[start : start + segment.rows] = segment_rows(segment, matrix, layout.stream.bank_rows)


def pack_stream_layer(
    layout: KernelLayout, tensors: Mapping[str, np.ndarray], rank: int, layer: int
) -> np.ndarray:
    """One core's stream rows of one layer (layer -1: the lm_head tail) [rows, LANES] in
    bf16, as they sit in its stream (layer_row_range). Reads only that layer's tensors (or
    the lm_head's)."""
    first, end = layer_row_range(layout, layer)
    out = np.zeros((end - first, LANES), np.uint16)
    if layer < 0:
        _place(out, layout, 0, layout.stream.tail, tensors, "", rank)
        return out.view(BF16)
    _place_layer(out, layout, first, layer, tensors, f"layers.{layer}.", rank)
    return out.view(BF16)


def _place_layer(out: np.ndarray, layout: KernelLayout, first: int, layer: int, tensors, prefix,
                 rank: int) -> None:  # fmt: skip
    """Write the segments of `layer`'s attention and FFN kinds (tensors under `prefix`) into
    `out`, whose row 0 is the stream's row `first`."""
    s = layout.stream
    attention = layout.attention[layout.attention_table[layer]]
    ffn = layout.ffn[layout.ffn_table[layer]]
    _place(out, layout, s.attention_rows[layer] - first, attention.segments, tensors, prefix, rank)
    _place(out, layout, s.ffn_rows[layer] - first, ffn.segments, tensors, prefix, rank)


def pack_passes(layout: KernelLayout, tensors: Mapping[str, np.ndarray], rank: int) -> np.ndarray:
    """One core's stream rows of a fused drafter's passes (passes_row_range) [rows, LANES]
    in bf16: before each pass the MTP module's eh_proj, its layer (the module's tensors,
    `draft.0.*`); the target's LM head after each pass is left for copy_heads."""
    s, passes = layout.stream, layout.draft_passes
    assert s.draft is not None and passes is not None, "a fused drafter's stream holds its passes"
    first, end = passes_row_range(layout)
    out = np.zeros((end - first, LANES), np.uint16)
    for layer in passes.layers:
        _place_layer(out, layout, first, layer, tensors, MODULE_PREFIX, rank)
    for row in s.draft.eh_proj_rows:
        _place(out, layout, row - first, [s.draft.eh_proj], tensors, "", rank)
    return out.view(BF16)


def pack_stream(layout: KernelLayout, tensors: Mapping[str, np.ndarray], rank: int) -> np.ndarray:
    """One core's weight stream [total_banks, bank_rows, LANES] in bf16 (quantized
    segments: their bytes viewed as bf16): its layers' rows, then the lm_head's; with a
    fused drafter, its passes' rows after them (pack_passes)."""
    passes = layout.draft_passes
    layers = range(len(layout.attention_table) if passes is None else passes.first_layer)
    rows = [pack_stream_layer(layout, tensors, rank, layer) for layer in [*layers, -1]]
    if passes is not None:
        rows.append(pack_passes(layout, tensors, rank))
    stream = np.concatenate(rows)
    copy_heads(layout, stream)
    return stream.reshape(-1, layout.stream.bank_rows, LANES)


def copy_heads(layout: KernelLayout, rows: np.ndarray) -> None:
    """A fused drafter's LM head after each pass: the target's packed rows (one core's
    stream, [rows, LANES]) copied there; nothing without a drafter."""
    s = layout.stream
    if s.draft is None:
        return
    span = max(segment.offset + segment.rows for segment in s.tail)
    for head in s.draft.head_rows:
        rows[head : head + span] = rows[s.lm_head_row : s.lm_head_row + span]


def pack_vectors_layer(
    layout: KernelLayout, tensors: Mapping[str, np.ndarray], rank: int, layer: int
) -> np.ndarray:
    """One core's vector slab of one layer [vector_rows, vector_width] f32: the norms, the
    kinds' vector rows and, on the first layer of an attention-residual block, the
    block's mixing logits."""
    slab = np.zeros((layout.vector_rows, layout.vector_width), np.float32)
    passes = layout.draft_passes
    prefix = f"layers.{layer}." if passes is None else passes.tensor_prefix(layer)
    slab[0, : layout.hidden] = tensors[prefix + "attn_norm"]
    slab[1, : layout.hidden] = tensors[prefix + "ffn_norm"]
    rows = layout.attention[layout.attention_table[layer]].vectors
    rows = rows + layout.ffn[layout.ffn_table[layer]].vectors
    for row in rows:
        value = part_slice(row.part, np.asarray(tensors[prefix + row.part.tensor]), rank)
        slab[row.row : row.row + row.rows, : row.length] = value.reshape(row.rows, row.length)
    for at, block in layout.ffn[layout.ffn_table[layer]].slab_blocks(tensors, prefix, rank):
        slab[at : at + len(block), : block.shape[1]] = block
    residual = layout.attention_residual
    first_pass = passes.first_layer if passes is not None else len(layout.attention_table)
    if residual and layer % residual.block_size == 0 and layer < first_pass:  # its block's logits
        logits = np.asarray(tensors["attn_res_logits"])
        slab[residual.logits_row, : residual.max_snapshots] = logits[layer // residual.block_size]
    return slab


def pack_draft_norms(tensors: Mapping[str, np.ndarray]) -> np.ndarray:
    """A fused drafter's MTP module's norms [3, hidden] f32: enorm, hnorm, final norm."""
    return np.stack([np.asarray(tensors[MODULE_PREFIX + n], np.float32) for n in DRAFT_NORMS])


def pack_embedding(
    layout: KernelLayout, tensors: Mapping[str, np.ndarray], rank: int
) -> np.ndarray:
    """A fused drafter's rows of the token embeddings on one core [vocab_per_core, 1,
    hidden] bf16 (rows vocab_per_core x rank on; past the vocabulary zero): its passes
    gather a row a DMA."""
    table = np.asarray(tensors["embedding"], np.float32)
    per = layout.vocab_per_core
    out = np.zeros((per, 1, layout.hidden), np.float32)
    mine = table[rank * per : (rank + 1) * per]
    out[: len(mine), 0] = mine
    return out.astype(BF16)


def pack_vectors(layout: KernelLayout, tensors: Mapping[str, np.ndarray], rank: int) -> np.ndarray:
    """One core's per-layer vector slabs [layers, vector_rows, vector_width] in f32."""
    layers = range(len(layout.attention_table))
    return np.stack([pack_vectors_layer(layout, tensors, rank, layer) for layer in layers])


def _pieces(chunks: np.ndarray, pieces: int, piece_chunks: int) -> np.ndarray:
    """Chunks [n, ...] zero padded to [pieces * piece_chunks, ...]."""
    out = np.zeros((pieces * piece_chunks, *chunks.shape[1:]), chunks.dtype)
    out[: len(chunks)] = chunks
    return out


def expert_arrays(layout: KernelLayout) -> list[tuple[int, int]]:
    """(FFN kind index, array of the kind) of each routed-expert array, in the order of the
    kernel's expert_shapes(): per MoE kind its bf16 weights, or its codes and scales (one
    array when the scales are inline)."""
    out = []
    for index, f in enumerate(layout.ffn):
        if f.routed_experts:
            out += [(index, j) for j in range(f.experts.arrays)]
    return out


def pack_experts_layer(
    layout: KernelLayout, tensors: Mapping[str, np.ndarray], rank: int, layer: int
) -> list[np.ndarray]:
    """One core's routed experts of one layer: [] for a dense layer, else the arrays of its
    MoE kind (expert_arrays), each [held experts, pieces, rows, LANES]: bf16, or codes
    and scales as ExpertChunks describes them (int4 / mxfp4 / nvfp4: nibbles two rows a
    byte, bf16 / E8M0 / e4m3 and E8M0 tensor scales, mxfp4's and nvfp4's after the codes in
    one int8 array; fp8: e4m3 codes, f32 block scales; int8: int8 codes, f32 column
    scales). Rank r holds experts [g * E_r,
    (g + 1) * E_r) of group g = r // width_parts, then with expert sharing the last
    partner_experts of the next group's block (mod G), and of each the columns of width part
    r % width_parts (its record's held_experts). Every chunk is quantized on its own, so packing a layer at
    a time gives the same bytes as packing the kind at once."""
    f = layout.ffn[layout.ffn_table[layer]]
    if not f.routed_experts:
        return []
    e = f.experts
    ids, cols = f.held_experts(rank)
    passes = layout.draft_passes
    prefix = (f"layers.{layer}." if passes is None else passes.tensor_prefix(layer)) + "ffn."
    gate, up = tensors[prefix + "experts_gate"], tensors[prefix + "experts_up"]
    down = tensors[prefix + "experts_down"]
    pieces = []
    for expert in ids:
        gate_up = np.concatenate([gate[expert][:, cols], up[expert][:, cols]], axis=1)
        gate_up = chunked(gate_up, e.gate_up_k_chunks, e.gate_up_col_blocks)
        down_chunks = chunked(down[expert][cols, :], e.down_k_chunks, e.down_col_blocks)
        pieces.append(
            np.concatenate(
                [
                    _pieces(gate_up, e.gate_up_pieces, e.piece_chunks),
                    _pieces(down_chunks, e.down_pieces, e.piece_chunks),
                ]
            )
        )
    chunks = np.stack(pieces)  # [experts, pieces * piece_chunks, CHUNK, LANES]
    lead = (len(ids), e.pieces)
    flat = chunks.reshape(-1, CHUNK, LANES)
    if e.kind == "bf16":
        return [chunks.reshape(*lead, e.code_rows, LANES).astype(BF16)]
    if e.kind == "int4":
        codes, scales = pack_int4_chunks(flat, e.group)
        scales = scales.astype(BF16)
    elif e.kind == "mxfp4":
        codes, scales = pack_mxfp4_chunks(flat)
    elif e.kind == "fp8":
        codes, scales = pack_fp8_chunks(flat, e.group)
    elif e.kind == "int8":
        codes, scales = pack_int8_chunks(flat)
    elif e.kind == "nvfp4":  # a piece's block scales, then its chunks' tensor-scale rows
        codes, block, tensor = pack_nvfp4_chunks(flat)
        per_piece = (*lead, e.piece_chunks * block.shape[-2], LANES)
        tensor = tensor.reshape(*lead, e.piece_chunks, LANES)
        scales = np.concatenate([block.reshape(per_piece), tensor], axis=-2)
    else:
        raise NotImplementedError(f"packing {e.format} experts")
    codes = codes.reshape(*lead, e.code_rows, LANES)
    scales = scales.reshape(*lead, e.scale_rows, LANES)
    if e.inline_scales:  # one int8 array: each piece's code rows, then its scale rows
        piece = np.zeros((*lead, *e.array_shapes[0][:1], LANES), codes.dtype)
        piece[..., : e.code_rows, :] = codes
        piece[..., e.code_rows : e.code_rows + e.scale_rows, :] = scales.view(codes.dtype)
        return [piece]
    return [codes, scales]


def pack_experts(
    layout: KernelLayout, tensors: Mapping[str, np.ndarray], rank: int
) -> list[np.ndarray]:
    """One core's routed-expert arrays, in the order of the kernel's expert_shapes(): per
    MoE kind, its layers' pack_experts_layer arrays stacked [layers of the kind, ...]."""
    out = []
    for f in layout.ffn:
        if f.routed_experts:
            per_layer = [pack_experts_layer(layout, tensors, rank, n) for n in f.layers]
            out += [np.stack(arrays) for arrays in zip(*per_layer, strict=True)]
    return out
