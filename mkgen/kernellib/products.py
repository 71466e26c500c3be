"""A weight chunk's product in each stored format: `*_product(slot arrays, ...)` returns
product(x, slot, j) = x [rows, CHUNK] bf16 @ chunk j of the slot, f32, as a Ring reads
it; the scaled formats multiply on the MXU in the codes' own dtype (_grouped_dot) and
scale the partial products, except nvfp4, whose 16-row block scales are applied to the
weights in bf16 before one dot (_nvfp4_product). The layouts are the packer's
(mkgen/weights/quantize.py, pack_*_chunks)."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mkgen.kernellib.constants import CHUNK, TOKENS_PADDED


def _bf16_product(slots):
    """Chunk j of a bf16 slot [depth, chunks * CHUNK, LANES]."""

    def product(x, slot, j):
        w = slots[slot, pl.ds(j * CHUNK, CHUNK), :]
        return jnp.dot(x, w, preferred_element_type=jnp.float32)

    return product


def _block_pattern(groups, rows):
    """[groups * rows, CHUNK] bf16: 1 where row block g meets the columns of group g."""
    shape = (groups * rows, CHUNK)
    block = jax.lax.broadcasted_iota(jnp.int32, shape, 0) // rows
    group = jax.lax.broadcasted_iota(jnp.int32, shape, 1) // (CHUNK // groups)
    return (block == group).astype(jnp.bfloat16)


def _grouped_dot(groups, rows=TOKENS_PADDED):
    """(x [n, CHUNK], w [CHUNK, LANES], scale [groups, LANES] f32) -> x @ w with the
    products of w's rows g * CHUNK / groups .. (g + 1) * CHUNK / groups scaled by row g
    of `scale` (per column).

    The MXU multiplies in w's own dtype (int4, int8, fp8 e4m3 beside bf16 x) in one dot:
    the left operand is block-diagonal, [groups * n, CHUNK] with row block g holding x's
    columns of group g (zeros elsewhere), so the dot returns one partial product per
    group; they are scaled and summed in f32. Its 0/1 pattern for n = `rows` (the token
    rows) is built here, once, outside the matmul loops (built per chunk it cost more
    than the dot's other vector ops); inputs of other row counts (MLA's heads x rows)
    build theirs per chunk."""
    if groups == 1:
        return lambda x, w, scale: jnp.dot(x, w, preferred_element_type=jnp.float32) * scale
    pattern = _block_pattern(groups, rows)

    def dot(x, w, scale):
        n = x.shape[0]
        mask = pattern if n == rows else _block_pattern(groups, n)
        left = jnp.concatenate([x] * groups, axis=0) * mask
        parts = jnp.dot(left, w, preferred_element_type=jnp.float32).reshape(groups, n, w.shape[1])
        return jnp.sum(parts * scale[:, None, :], axis=0)

    return dot


def _int4_product(codes, scales, group, rows=TOKENS_PADDED):
    """Chunk j of an int4 slot: codes [depth, chunks * CHUNK / 2, LANES] int8, byte a
    holding rows 2a (low nibble) and 2a + 1 (high nibble) of the chunk, which is how
    Mosaic packs int4, so a bitcast unpacks them; scales [depth, chunks * CHUNK / group,
    LANES] bf16, one per `group` rows and column. bf16 x int4 on the MXU."""
    half = CHUNK // 2
    groups = CHUNK // group
    dot = _grouped_dot(groups, rows)

    def product(x, slot, j):
        w = pltpu.bitcast(codes[slot, pl.ds(j * half, half), :], jnp.int4)
        return dot(x, w, scales[slot, pl.ds(j * groups, groups), :].astype(jnp.float32))

    return product


def _int8_product(codes, scales):
    """Chunk j of an int8 slot: codes [depth, chunks * CHUNK, LANES] int8; scales [depth,
    chunks, LANES] f32, one row of column scales a chunk, applied to the product."""

    dot = _grouped_dot(1)

    def product(x, slot, j):
        return dot(x, codes[slot, pl.ds(j * CHUNK, CHUNK), :], scales[slot, pl.ds(j, 1), :])

    return product


# e2m1 codes as e4m3 bytes, four a 32-bit word: each code's sign bit to bit 7, its three
# magnitude bits (exponent, mantissa) to bits 4-2. Then e4m3's exponent is e2m1's (bias
# 7 instead of 1) and e2m1's subnormal 0.5 is e4m3's subnormal 2^-7: every code n reads
# exactly e2m1(n) x 2^-6, which the scales undo.
E4M3_SIGNS = -0x7F7F7F80  # 0x80808080
E4M3_MAGNITUDES = 0x1C1C1C1C
E2M1_IN_E4M3 = 2.0**6


# fmt: off

def _e2m1_as_e4m3(packed):
    """Packed e2m1 codes [CHUNK / 2, LANES] int8, byte r holding rows r (low nibble) and r +
    CHUNK / 2 (high nibble) -> the chunk [CHUNK, LANES] float8_e4m3fn, x 2^-6. Signed ops
    only (unsigned vector ops were reported to crash TPU7x); the masks drop what the
    arithmetic shift smears in."""
    words = pltpu.bitcast(packed, jnp.int32)
    low = ((words << 4) & E4M3_SIGNS) | ((words << 2) & E4M3_MAGNITUDES)
    high = (words & E4M3_SIGNS) | ((words >> 2) & E4M3_MAGNITUDES)
    return jnp.concatenate([pltpu.bitcast(low, jnp.float8_e4m3fn), pltpu.bitcast(high, jnp.float8_e4m3fn)], axis=0)


def _power_of_two(biased):
    """E8M0 bytes (int8, read as 0..255) -> 2^(byte - 127) in f32: exact for bytes 1 to
    254 (byte 0's 2^-127 reads 0, byte 255, E8M0's NaN, reads inf)."""
    return jax.lax.bitcast_convert_type((biased.astype(jnp.int32) & 255) << 23, jnp.float32)


# fmt: on


def _mxfp4_product(pieces, scale_row, rows=TOKENS_PADDED):
    """Chunk j of an mxfp4 slot of `pieces` [depth, rows, LANES] int8: from row 0 the codes
    of its chunks, CHUNK / 2 rows a chunk, byte r holding the e2m1 codes of rows r (low
    nibble) and r + CHUNK / 2 (high nibble); from row `scale_row` their E8M0 scale bytes,
    CHUNK / 32 rows a chunk, 2^(byte - 127) for 32 rows of a column. The codes as e4m3,
    bf16 x fp8 on the MXU, the scales (x 2^6, undoing _e2m1_as_e4m3's 2^-6: exact for
    bytes 1 to 248) on the products."""
    half = CHUNK // 2
    groups = CHUNK // 32
    dot = _grouped_dot(groups, rows)

    def product(x, slot, j):
        w = _e2m1_as_e4m3(pieces[slot, pl.ds(j * half, half), :])
        scales = _power_of_two(pieces[slot, pl.ds(scale_row + j * groups, groups), :])
        return dot(x, w, scales * E2M1_IN_E4M3)

    return product


def _nvfp4_product(pieces, scale_row, tensor_row):
    """Chunk j of an nvfp4 slot of `pieces` [depth, rows, LANES] int8: from row 0 the codes
    of its chunks, CHUNK / 2 rows a chunk, byte a holding the e2m1 codes of rows 2a (low
    nibble) and 2a + 1 (high nibble), as Mosaic packs 4-bit types, so a bitcast unpacks
    them; from row `scale_row` on the scales: from row j * CHUNK / 16 of them the chunk's
    e4m3 scales, one per 16 rows of a column, and at row `tensor_row` + j the E8M0 bytes of
    its columns' tensor scales (powers of two).

    The weights are dequantized in bf16 and multiplied in ONE dot: w = code x block scale,
    then (x @ w) x tensor scale in f32. Exact: e2m1 and e4m3 values are bf16 values (the
    codes go e2m1 -> e4m3 -> bf16, conversions the VPU does in one op each); a code's
    significand has at most 2 bits and a block scale's 4, so their product has at most 6
    of bf16's 8; |code| is 0 or in [0.5, 6] and a scale 0 or in [2^-9, 448], so a nonzero
    product lies in [2^-10, 2688], far inside bf16's normal range: the bf16 multiply
    rounds nothing, the MXU's bf16 x bf16 products are exact in its f32 sums, and the
    tensor scale is a power of two (_power_of_two). A bf16 vreg
    is [16, 128], so a 16-row block is one vreg and its scale row one replicate (Mosaic
    broadcasts a packed bf16 row in one op). Against _grouped_dot's 16 partial products
    (the MXU streaming 16 x the token rows, 16 scalings and sums in f32 a chunk) this
    compiles to fewer vector ALU and MXU ops (docs/quantized-paths.md)."""
    half = CHUNK // 2
    groups = CHUNK // 16

    def product(x, slot, j):
        codes = pltpu.bitcast(pieces[slot, pl.ds(j * half, half), :], jnp.float4_e2m1fn)
        # through e4m3: Mosaic turns e2m1 -> bf16 into e2m1 -> f32 -> bf16 (80 more ops)
        codes = codes.astype(jnp.float8_e4m3fn).astype(jnp.bfloat16)
        block = pieces[slot, pl.ds(scale_row + j * groups, groups), :]
        block = jax.lax.bitcast_convert_type(block, jnp.float8_e4m3fn).astype(jnp.bfloat16)
        lanes = codes.shape[1]
        scale = jnp.concatenate(
            [jnp.broadcast_to(block[g : g + 1], (16, lanes)) for g in range(groups)], axis=0
        )
        tensor = _power_of_two(pieces[slot, pl.ds(scale_row + tensor_row + j, 1), :])
        return jnp.dot(x, codes * scale, preferred_element_type=jnp.float32) * tensor

    return product


# fmt: off

def _fp8_product(codes, scales, block, rows=TOKENS_PADDED):
    """Chunk j of an fp8 slot: codes [depth, chunks * CHUNK, LANES] e4m3; scales [depth,
    chunks * CHUNK / block, LANES] f32, one per block x block (repeated over its columns).
    bf16 x fp8 on the MXU, the scales on the products."""
    groups = CHUNK // block
    dot = _grouped_dot(groups, rows)

    def product(x, slot, j):
        return dot(x, codes[slot, pl.ds(j * CHUNK, CHUNK), :], scales[slot, pl.ds(j * groups, groups), :])

    return product


# fmt: on
