"""Weight formats as the kernels store them (numpy): quantize, dequantize, fake-quantize.

int4:G is symmetric: per column, every G consecutive input rows share one scale,
max |w| / 7 rounded to bf16 (the kernel's scale dtype), and codes are
round(w / scale) clipped to [-8, 7]. The verifier feeds the reference model the
dequantized weights, so a kernel is held to exactly the numbers it stores.
"""

from __future__ import annotations

from collections.abc import Mapping

import ml_dtypes
import numpy as np

from mkgen.spec.quant import parse_format
from mkgen.spec.schema import ModelSpec
from mkgen.spec.weights import model_weights

INT4_MAX = 7


def _groups(w: np.ndarray, group: int) -> np.ndarray:
    """[..., K, N] -> [..., ceil(K / G), G, N] (zero padded)."""
    k = w.shape[-2]
    padded_k = -(-k // group) * group
    pad = [(0, 0)] * (w.ndim - 2) + [(0, padded_k - k), (0, 0)]
    return np.pad(w, pad).reshape(*w.shape[:-2], padded_k // group, group, w.shape[-1])


def int4_quantize(w: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """(codes int8 [..., K, N] in [-8, 7], scales f32 [..., ceil(K / G), N], bf16-exact)."""
    grouped = _groups(np.asarray(w, np.float32), group)
    scales = np.abs(grouped).max(axis=-2) / INT4_MAX
    scales = scales.astype(ml_dtypes.bfloat16).astype(np.float32)
    safe = np.where(scales == 0, 1.0, scales)
    codes = np.clip(np.rint(grouped / safe[..., None, :]), -8, INT4_MAX).astype(np.int8)
    k = w.shape[-2]
    return codes.reshape(*w.shape[:-2], -1, w.shape[-1])[..., :k, :], scales


def int4_dequantize(codes: np.ndarray, scales: np.ndarray, group: int) -> np.ndarray:
    k = codes.shape[-2]
    grouped = _groups(codes.astype(np.float32), group) * scales[..., None, :]
    return grouped.reshape(*codes.shape[:-2], -1, codes.shape[-1])[..., :k, :]


def fake_quantize(spec: ModelSpec, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The weights as a kernel stores them: routed experts through their format."""
    fmt = parse_format(spec.quantization.experts)
    out = dict(weights)
    if fmt.kind == "bf16":
        return out
    if fmt.kind != "int4":
        raise NotImplementedError(f"fake quantization of {fmt}")
    for w in model_weights(spec):
        if w.family == "experts":
            codes, scales = int4_quantize(out[w.name], fmt.group)
            out[w.name] = int4_dequantize(codes, scales, fmt.group)
    return out


def pack_int4_chunks(chunks: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Chunks [n, CHUNK, LANES] -> (packed int8 [n, CHUNK / 2, LANES], scales [n, CHUNK / G, LANES]).

    Byte r of a chunk holds row r in its low nibble and row r + CHUNK / 2 in its high one."""
    codes, scales = int4_quantize(chunks, group)
    half = chunks.shape[1] // 2
    low = codes[:, :half].astype(np.uint8) & 0xF  # host-side bit packing
    high = codes[:, half:].astype(np.uint8) & 0xF
    return ((high << 4) | low).view(np.int8), scales
