"""Row-wise f32 math of every kind: RMSNorm, sigmoid, softplus, and token rows padded to
the f32 sublanes."""

import jax
import jax.numpy as jnp

from mkgen.kernellib.constants import NORM_EPS, NORM_OFFSET, TOKENS, TOKENS_PADDED


def _rms_norm(x, weight, eps=NORM_EPS):
    """RMSNorm in f32; `weight` is [1, n]."""
    var = jnp.mean(x * x, axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(var + eps) * (weight + NORM_OFFSET)


def _sigmoid(x):
    return 1.0 / (1.0 + jnp.exp(-x))


def _stack_rows(rows):
    """Token rows [TOKENS, w] (as a list of blocks) padded with zero rows to TOKENS_PADDED."""
    if TOKENS_PADDED > TOKENS:
        rows = rows + [jnp.zeros((TOKENS_PADDED - TOKENS, rows[0].shape[1]), jnp.float32)]
    return jnp.concatenate(rows, axis=0)


def _softplus(x):
    return jnp.maximum(x, 0.0) + jnp.log(1.0 + jnp.exp(-jnp.abs(x)))
