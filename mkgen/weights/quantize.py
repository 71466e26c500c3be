"""Weight formats as the kernels store them (numpy): quantize, dequantize, fake-quantize.

Every function works on the last two axes, a ``[K, N]`` matrix (fan-in rows), with any
leading axes (stacked experts, chunks).

- int4:G: symmetric, per column every G input rows share one scale, max |w| / 7
  rounded to bf16 (the kernel's scale dtype); codes round(w / scale) in [-8, 7].
- int8: one f32 scale per output column over all K rows; codes in [-127, 127].
- fp8:B: float8_e4m3fn codes, one f32 scale per B x B block.
- mxfp4 (OCP MX): e2m1 codes, one E8M0 scale (a power of two) per 32 input rows and
  column: 2^(floor(log2 max |w|) - 2), values beyond 6 x scale saturate to 6.
- nvfp4: e2m1 codes, one e4m3 scale per 16 input rows and column, max |w| / 6 over the
  tensor scale, and one f32 tensor scale per matrix: the smallest power of two that
  keeps the block scales within e4m3's 448. The block's largest value always gets code
  6 (its scale is rounded to e4m3 within 1/16), so re-quantizing is exact as below.

mkgen's own int8, fp8 and nvfp4 tensor scales are powers of two (the smallest that keeps every code
in range: 2^ceil(log2(max |w| / 127 or 448))), as mxfp4's are. Then dequantization is
exact in bf16, and quantizing dequantized weights again over any sub-block of an
original block (a core's slice, a 256-row chunk) gives back exactly the same values:
the packer may re-quantize per core what `fake_quantize` fed the reference, and the
kernel is held to exactly the numbers it stores. The kernel itself takes any f32
scale (a checkpoint's).
"""

from __future__ import annotations

from collections.abc import Mapping

import ml_dtypes
import numpy as np

from mkgen.spec.draft import draft_weights
from mkgen.spec.quant import QuantFormat, parse_format
from mkgen.spec.schema import ModelSpec
from mkgen.spec.tensors import VECTORS
from mkgen.spec.weights import model_weights

INT4_MAX = 7
INT8_MAX = 127
FP8_MAX = 448.0  # largest finite float8_e4m3fn
E2M1_MAX = 6.0
E2M1_EMAX = 2  # exponent of e2m1's largest binade
MX_BLOCK = 32  # OCP MX: values per E8M0 scale
E8M0_BIAS = 127
# e2m1 code (sign bit 3, exponent bits 2-1, mantissa bit 0) -> value, codes 0..7
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
NV_BLOCK = 16  # nvfp4: values per e4m3 scale


def _groups(w: np.ndarray, group: int) -> np.ndarray:
    """[..., K, N] -> [..., ceil(K / G), G, N] (zero padded)."""
    k = w.shape[-2]
    padded_k = -(-k // group) * group
    pad = [(0, 0)] * (w.ndim - 2) + [(0, padded_k - k), (0, 0)]
    return np.pad(w, pad).reshape(*w.shape[:-2], padded_k // group, group, w.shape[-1])


def _ungroup(grouped: np.ndarray, k: int) -> np.ndarray:
    """[..., K / G, G, N] -> [..., K, N] (padding dropped)."""
    return grouped.reshape(*grouped.shape[:-3], -1, grouped.shape[-1])[..., :k, :]


def _blocks(w: np.ndarray, block: int) -> np.ndarray:
    """[..., K, N] -> [..., K / B, B, N / B, B] (zero padded on both axes)."""
    k, n = w.shape[-2:]
    pk, pn = -(-k // block) * block, -(-n // block) * block
    pad = [(0, 0)] * (w.ndim - 2) + [(0, pk - k), (0, pn - n)]
    return np.pad(w, pad).reshape(*w.shape[:-2], pk // block, block, pn // block, block)


# Exponents are read off the float's bits (frexp) and powers of two made by ldexp: exact on
# every machine, where numpy's log2 and exp2 follow the CPU's SIMD path and may round a
# value just below a power of two up to it.


def _floor_log2(x: np.ndarray) -> np.ndarray:
    """floor(log2(x)) of positive finite x, exactly (int32)."""
    return (np.frexp(x)[1] - 1).astype(np.int32)


def _pow2_at_least(x: np.ndarray) -> np.ndarray:
    """The smallest power of two >= x (1 where x is 0)."""
    mantissa, exponent = np.frexp(np.where(x > 0, x, 1.0))
    return np.ldexp(np.float32(1), np.where(mantissa == 0.5, exponent - 1, exponent))


# ---------------------------------------------------------------- int4:G


def int4_quantize(w: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """(codes int8 [..., K, N] in [-8, 7], scales f32 [..., ceil(K / G), N], bf16-exact)."""
    grouped = _groups(np.asarray(w, np.float32), group)
    scales = np.abs(grouped).max(axis=-2) / INT4_MAX
    scales = scales.astype(ml_dtypes.bfloat16).astype(np.float32)
    safe = np.where(scales == 0, 1.0, scales)
    codes = np.clip(np.rint(grouped / safe[..., None, :]), -8, INT4_MAX).astype(np.int8)
    return _ungroup(codes, w.shape[-2]), scales


def int4_dequantize(codes: np.ndarray, scales: np.ndarray, group: int) -> np.ndarray:
    grouped = _groups(codes.astype(np.float32), group) * scales[..., None, :]
    return _ungroup(grouped, codes.shape[-2])


# ---------------------------------------------------------------- int8 per output channel


def int8_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes int8 [..., K, N] in [-127, 127], scales f32 [..., 1, N], powers of two)."""
    w = np.asarray(w, np.float32)
    scales = _pow2_at_least(np.abs(w).max(axis=-2, keepdims=True) / INT8_MAX)
    codes = np.clip(np.rint(w / scales), -INT8_MAX, INT8_MAX).astype(np.int8)
    return codes, scales


def int8_dequantize(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    return codes.astype(np.float32) * scales


# ---------------------------------------------------------------- fp8:B (e4m3, B x B blocks)


def fp8_quantize(w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(codes float8_e4m3fn [..., K, N], scales f32 [..., ceil(K / B), ceil(N / B)])."""
    w = np.asarray(w, np.float32)
    blocks = _blocks(w, block)
    scales = _pow2_at_least(np.abs(blocks).max(axis=(-3, -1)) / FP8_MAX)
    scaled = np.clip(blocks / scales[..., :, None, :, None], -FP8_MAX, FP8_MAX)
    codes = scaled.astype(ml_dtypes.float8_e4m3fn)
    k, n = w.shape[-2:]
    codes = codes.reshape(*w.shape[:-2], blocks.shape[-4] * block, -1)[..., :k, :n]
    return codes, scales


def fp8_dequantize(codes: np.ndarray, scales: np.ndarray, block: int) -> np.ndarray:
    k, n = codes.shape[-2:]
    full = np.repeat(np.repeat(scales, block, axis=-2), block, axis=-1)[..., :k, :n]
    return codes.astype(np.float32) * full


# ---------------------------------------------------------------- mxfp4 (e2m1 + E8M0 per 32)


def e2m1_codes(values: np.ndarray) -> np.ndarray:
    """Values on the e2m1 grid -> 4-bit codes in int8 [0, 15] (sign bit 3)."""
    magnitude = np.searchsorted(E2M1_VALUES, np.abs(values)).astype(np.int8)
    return np.where(np.signbit(values) & (magnitude > 0), magnitude | 8, magnitude).astype(np.int8)


def e2m1_values(codes: np.ndarray) -> np.ndarray:
    """4-bit codes (low nibble) -> f32 values."""
    codes = np.asarray(codes).astype(np.int32) & 0xF
    value = E2M1_VALUES[codes & 7]
    return np.where(codes & 8, -value, value).astype(np.float32)


def mxfp4_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes int8 [..., K, N] in [0, 15], E8M0 scale bytes int8 [..., ceil(K / 32), N]).

    A scale byte is the biased exponent e + 127 of its power of two 2^e (stored as int8:
    the same byte; the kernel reads it back as e + 127 in [0, 255])."""
    grouped = _groups(np.asarray(w, np.float32), MX_BLOCK)
    amax = np.abs(grouped).max(axis=-2)
    exponent = np.where(amax > 0, _floor_log2(np.where(amax > 0, amax, 1.0)) - E2M1_EMAX, 0)
    exponent = np.clip(exponent, -E8M0_BIAS + 1, E8M0_BIAS).astype(np.int32)
    scaled = np.clip(grouped / np.ldexp(np.float32(1), exponent)[..., None, :], -E2M1_MAX, E2M1_MAX)
    values = scaled.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    codes = _ungroup(e2m1_codes(values), w.shape[-2])
    return codes, (exponent + E8M0_BIAS).astype(np.uint8).view(np.int8)


def mxfp4_dequantize(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    exponent = scales.view(np.uint8).astype(np.int32) - E8M0_BIAS
    grouped = (
        _groups(e2m1_values(codes), MX_BLOCK) * np.ldexp(np.float32(1), exponent)[..., None, :]
    )
    return _ungroup(grouped, codes.shape[-2]).astype(np.float32)


# ---------------------------------------------------------------- nvfp4 (e2m1 + e4m3 per 16 + tensor)


def nvfp4_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes int8 [..., K, N] in [0, 15], block scales float8_e4m3fn [..., ceil(K / 16),
    N], tensor scales f32 [..., 1, 1], powers of two): w ~ code x block x tensor."""
    w = np.asarray(w, np.float32)
    grouped = _groups(w, NV_BLOCK)
    amax = np.abs(grouped).max(axis=-2)  # [..., K / 16, N]
    tensor = _pow2_at_least(amax.max(axis=(-2, -1), keepdims=True) / (E2M1_MAX * FP8_MAX))
    block = (amax / (E2M1_MAX * tensor)).astype(ml_dtypes.float8_e4m3fn)
    full = block.astype(np.float32) * tensor
    safe = np.where(full == 0, 1.0, full)
    scaled = np.clip(grouped / safe[..., None, :], -E2M1_MAX, E2M1_MAX)
    values = scaled.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    return _ungroup(e2m1_codes(values), w.shape[-2]), block, tensor


def nvfp4_dequantize(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Codes times `scales` [..., ceil(K / 16), N] f32: block x tensor scale."""
    grouped = _groups(e2m1_values(codes), NV_BLOCK) * scales[..., None, :]
    return _ungroup(grouped, codes.shape[-2])


# ---------------------------------------------------------------- by format


def quantize(w: np.ndarray, fmt: QuantFormat) -> tuple[np.ndarray, np.ndarray]:
    """(codes, scales) of `w` [..., K, N] in `fmt` (not bf16)."""
    if fmt.kind == "int4":
        return int4_quantize(w, fmt.group)
    if fmt.kind == "int8":
        return int8_quantize(w)
    if fmt.kind == "fp8":
        return fp8_quantize(w, fmt.group)
    if fmt.kind == "mxfp4":
        return mxfp4_quantize(w)
    if fmt.kind == "nvfp4":  # scales: block x tensor, exact in f32
        codes, block, tensor = nvfp4_quantize(w)
        return codes, block.astype(np.float32) * tensor
    raise NotImplementedError(f"quantization to {fmt}")


def dequantize(codes: np.ndarray, scales: np.ndarray, fmt: QuantFormat) -> np.ndarray:
    if fmt.kind == "int4":
        return int4_dequantize(codes, scales, fmt.group)
    if fmt.kind == "int8":
        return int8_dequantize(codes, scales)
    if fmt.kind == "fp8":
        return fp8_dequantize(codes, scales, fmt.group)
    if fmt.kind == "mxfp4":
        return mxfp4_dequantize(codes, scales)
    if fmt.kind == "nvfp4":
        return nvfp4_dequantize(codes, scales)
    raise NotImplementedError(f"dequantization of {fmt}")


def fake_quantize(spec: ModelSpec, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The weights as a kernel stores them: every matrix through its family's format
    (vectors stay as they are; the embedding is gathered by XLA before the kernel). Of
    `weights`, some of the spec's (the LM head a drafter reads) come back alike."""
    formats = spec.quantization.model_dump()
    out = dict(weights)
    for w in model_weights(spec):
        if w.family in (VECTORS, "embedding") or w.name not in out:
            continue
        fmt = parse_format(formats[w.family])
        if fmt.kind != "bf16":
            out[w.name] = dequantize(*quantize(np.asarray(out[w.name], np.float32), fmt), fmt)
    return out


def stored_random_weights(spec: ModelSpec, seed: int) -> dict[str, np.ndarray]:
    """The reference model's random weights (mkgen.reference.model.init_weights) as a
    kernel stores them: rounded to bf16, then fake_quantize; what the reference must read
    to be compared with the kernel."""
    from mkgen.reference.model import init_weights  # jax: only when asked

    weights = {
        name: np.asarray(value).astype(ml_dtypes.bfloat16).astype(np.float32)
        for name, value in init_weights(spec, seed).items()
    }
    return fake_quantize(spec, weights)


def stored_draft_weights(spec: ModelSpec, seed: int) -> dict[str, np.ndarray]:
    """The random weights of the spec's mtp drafter (the reference's init_draft_weights) as a
    fused kernel stores them: rounded to bf16, each matrix through its family's format, as
    stored_random_weights does the target's."""
    from mkgen.reference.draft import init_draft_weights  # jax: only when asked

    formats = spec.quantization.model_dump()
    drawn = init_draft_weights(spec, seed)
    out = {}
    for w in draft_weights(spec):
        value = np.asarray(drawn[w.name]).astype(ml_dtypes.bfloat16).astype(np.float32)
        fmt = parse_format(formats[w.family]) if w.family != VECTORS else None
        if fmt is not None and fmt.kind != "bf16":
            value = dequantize(*quantize(value, fmt), fmt)
        out[w.name] = value
    return out


# ---------------------------------------------------------------- chunk packing


def _nibble_bytes(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    return (((high.astype(np.uint8) & 0xF) << 4) | (low.astype(np.uint8) & 0xF)).view(np.int8)


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """4-bit codes [n, CHUNK, LANES] -> bytes int8 [n, CHUNK / 2, LANES]: byte r of a
    chunk holds row r in its low nibble and row r + CHUNK / 2 in its high one (mxfp4's
    e2m1: the kernel turns the two halves into e4m3 with the same word ops)."""
    half = codes.shape[1] // 2
    return _nibble_bytes(codes[:, :half], codes[:, half:])


def pack_nibble_pairs(codes: np.ndarray) -> np.ndarray:
    """4-bit codes [n, CHUNK, LANES] -> bytes int8 [n, CHUNK / 2, LANES]: byte a holds row
    2a in its low nibble and row 2a + 1 in its high one, as Mosaic packs 4-bit types (the
    kernel bitcasts the bytes to int4, or nvfp4's to float4_e2m1fn)."""
    return _nibble_bytes(codes[:, 0::2], codes[:, 1::2])


def pack_int4_chunks(chunks: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Chunks [n, CHUNK, LANES] -> (packed int8 [n, CHUNK / 2, LANES], scales [n, CHUNK / G, LANES])."""
    codes, scales = int4_quantize(chunks, group)
    return pack_nibble_pairs(codes), scales


def pack_int8_chunks(chunks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Chunks [n, CHUNK, LANES] -> (int8 codes [n, CHUNK, LANES], f32 column scales [n, 1,
    LANES])."""
    return int8_quantize(chunks)


def pack_nvfp4_chunks(chunks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Chunks [n, CHUNK, LANES] -> (packed e2m1 int8 [n, CHUNK / 2, LANES], e4m3 block
    scale bytes int8 [n, CHUNK / 16, LANES], E8M0 tensor-scale bytes int8 [n, 1, LANES]:
    each chunk quantized as one tensor, its scale repeated over the columns)."""
    codes, block, tensor = nvfp4_quantize(chunks)
    exponent = _floor_log2(tensor) + E8M0_BIAS  # tensor scales are powers of two
    tensor_bytes = np.broadcast_to(exponent, (*tensor.shape[:-1], chunks.shape[-1]))
    return (
        pack_nibble_pairs(codes),
        block.view(np.int8),
        tensor_bytes.astype(np.uint8).view(np.int8),
    )


def pack_mxfp4_chunks(chunks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Chunks [n, CHUNK, LANES] -> (packed e2m1 int8 [n, CHUNK / 2, LANES], E8M0 bytes
    int8 [n, CHUNK / 32, LANES])."""
    codes, scales = mxfp4_quantize(chunks)
    return pack_nibbles(codes), scales


def pack_fp8_chunks(chunks: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Chunks [n, CHUNK, LANES] -> (e4m3 codes [n, CHUNK, LANES], scales f32 [n, CHUNK / B,
    LANES]: each block's scale repeated over its B columns, so the kernel broadcasts
    scales along rows only)."""
    codes, scales = fp8_quantize(chunks, block)
    return codes, np.repeat(scales, block, axis=-1)


def as_bf16_rows(data: np.ndarray) -> np.ndarray:
    """An 8- or 32-bit array [..., R, N] as the bf16 rows that hold its bytes.

    The kernel reads them back with ``pltpu.bitcast`` along rows, which packs
    consecutive rows: 8-bit rows 2a (low byte) and 2a + 1 (high byte) form bf16 row a;
    an f32 row a is bf16 rows 2a (low half) and 2a + 1 (high half)."""
    if data.dtype.itemsize == 1:
        pairs = data.view(np.uint8).astype(np.uint16)
        words = pairs[..., 0::2, :] | (pairs[..., 1::2, :] << 8)
        return words.view(ml_dtypes.bfloat16)
    if data.dtype.itemsize == 4:
        words = np.ascontiguousarray(data).view(np.uint32)
        halves = np.stack([words & 0xFFFF, words >> 16], axis=-2).astype(np.uint16)
        return halves.reshape(*data.shape[:-2], 2 * data.shape[-2], data.shape[-1]).view(
            ml_dtypes.bfloat16
        )
    raise ValueError(f"no bf16 row packing for {data.dtype}")
