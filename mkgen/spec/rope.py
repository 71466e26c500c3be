"""RoPE frequency tables (numpy only: the planner renders them, the reference uses them)."""

from __future__ import annotations

import math

import numpy as np

from mkgen.spec.schema import MLAAttention, Rope


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention-scale correction (transformers / DeepSeek-V3)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(rope: Rope, rotary_dim: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies [rotary_dim // 2] (f32) and the cos/sin attention factor.

    Plain RoPE: theta ** -(2i / rotary_dim), factor 1. YaRN: transformers'
    `_compute_yarn_parameters` (interpolation blended with extrapolation by a linear
    ramp over the correction range, `truncate` flooring/ceiling the range, and
    attention_factor = mscale(factor, mscale) / mscale(factor, mscale_all_dim) when
    both are non-zero, else mscale(factor)).
    """
    base = rope.theta
    exponents = np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim)
    pos_freqs = np.float32(base) ** exponents
    inv_freq = (1.0 / pos_freqs).astype(np.float32)
    y = rope.scaling
    if y is None:
        return inv_freq, 1.0
    if y.mscale and y.mscale_all_dim:
        attention_factor = yarn_get_mscale(y.factor, y.mscale) / yarn_get_mscale(
            y.factor, y.mscale_all_dim
        )
    else:
        attention_factor = yarn_get_mscale(y.factor)

    def correction_dim(rotations: float) -> float:
        return (rotary_dim * math.log(y.original_max_position / (rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # transformers: prevent a division by zero
    ramp = np.clip(
        (np.arange(rotary_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low),
        0,
        1,
    ).astype(np.float32)
    extrapolation_weight = (1 - ramp).astype(np.float32)
    inv_freq_interp = (1.0 / (np.float32(y.factor) * pos_freqs)).astype(np.float32)
    inv_freq = inv_freq_interp * (1 - extrapolation_weight) + inv_freq * extrapolation_weight
    return inv_freq.astype(np.float32), float(attention_factor)


def mla_softmax_scale(kind: MLAAttention) -> float:
    """qk_head_dim ** -0.5, times yarn mscale(factor, mscale_all_dim)**2 when YaRN sets
    mscale_all_dim (transformers yarn_apply_mscale); an explicit softmax_scale wins."""
    if kind.softmax_scale is not None:
        return kind.softmax_scale
    scale = kind.qk_head_dim**-0.5
    scaling = kind.rope.scaling if kind.rope else None
    if scaling is not None and scaling.mscale_all_dim:
        m = yarn_get_mscale(scaling.factor, scaling.mscale_all_dim)
        scale *= m * m
    return scale
