"""RoPE frequency tables and attention scales (the planner renders them, the reference uses
them).

They land in generated code, so their bits must not depend on the machine: the powers,
logarithms and square roots are computed in decimal arithmetic (software, the same on
every CPU) and everything else in float64 basic operations (correctly rounded everywhere),
rounded to float32 once at the end. numpy's float32 and float64 power take the CPU's SIMD
path (AVX2 and AVX-512 differ in the last bit), and libm's have per-CPU variants.
"""

from __future__ import annotations

import decimal
import math

import numpy as np

from mkgen.spec.schema import MLAAttention, Rope

# 40 significant digits: far beyond float64's 17, so rounding the result to float64 once
# gives the correctly rounded value.
_EXACT = decimal.Context(prec=40)


def _power(base: float, exponent: float) -> float:
    """base ** exponent, correctly rounded to float64 on every machine."""
    return float(_EXACT.power(decimal.Decimal(base), decimal.Decimal(exponent)))


def _ln(x: float) -> float:
    """The natural logarithm of x, correctly rounded to float64 on every machine."""
    return float(_EXACT.ln(decimal.Decimal(x)))


def inverse_sqrt(n: float) -> float:
    """n ** -0.5 (a softmax scale), correctly rounded to float64 on every machine."""
    return float(_EXACT.divide(1, _EXACT.sqrt(decimal.Decimal(n))))


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention-scale correction (transformers / DeepSeek-V3)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * _ln(scale) + 1.0


def rope_frequencies(rope: Rope, rotary_dim: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies [rotary_dim // 2] (f32) and the cos/sin attention factor.

    Plain RoPE: theta ** -(2i / rotary_dim), factor 1. YaRN: transformers'
    `_compute_yarn_parameters` (interpolation blended with extrapolation by a linear
    ramp over the correction range, `truncate` flooring/ceiling the range, and
    attention_factor = mscale(factor, mscale) / mscale(factor, mscale_all_dim) when
    both are non-zero, else mscale(factor)).
    """
    base = rope.theta
    # theta ** (2i / rotary_dim), each power correctly rounded (module docstring), then float64.
    pos_freqs = np.array([_power(base, i / rotary_dim) for i in range(0, rotary_dim, 2)])
    inv_freq = 1.0 / pos_freqs
    y = rope.scaling
    if y is None:
        return inv_freq.astype(np.float32), 1.0
    if y.mscale and y.mscale_all_dim:
        attention_factor = yarn_get_mscale(y.factor, y.mscale) / yarn_get_mscale(
            y.factor, y.mscale_all_dim
        )
    else:
        attention_factor = yarn_get_mscale(y.factor)

    def correction_dim(rotations: float) -> float:
        return (rotary_dim * _ln(y.original_max_position / (rotations * 2 * math.pi))) / (
            2 * _ln(base)
        )

    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # transformers: prevent a division by zero
    ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq_interp = 1.0 / (y.factor * pos_freqs)
    inv_freq = inv_freq_interp * (1 - extrapolation_weight) + inv_freq * extrapolation_weight
    return inv_freq.astype(np.float32), float(attention_factor)


def mla_softmax_scale(kind: MLAAttention) -> float:
    """qk_head_dim ** -0.5, times yarn mscale(factor, mscale_all_dim)**2 when YaRN sets
    mscale_all_dim (transformers yarn_apply_mscale); an explicit softmax_scale wins."""
    if kind.softmax_scale is not None:
        return kind.softmax_scale
    scale = inverse_sqrt(kind.qk_head_dim)
    scaling = kind.rope.scaling if kind.rope else None
    if scaling is not None and scaling.mscale_all_dim:
        m = yarn_get_mscale(scaling.factor, scaling.mscale_all_dim)
        scale *= m * m
    return scale
