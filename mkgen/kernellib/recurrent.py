"""The recurrent kinds' per-row math (Gated DeltaNet, KDA): the causal depthwise conv step
and the gated delta rule on a head's f32 state."""

import jax
import jax.numpy as jnp

from mkgen.kernellib.elementwise import _sigmoid


def _l2_normalize(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + 1e-6)


def _conv_step(tail, x, taps):
    """One row through a causal depthwise conv: (SiLU(output) [1, C], new tail).

    The tail stores bf16 inputs, so the row is rounded as it will be stored."""
    window = jnp.concatenate([tail, x.astype(jnp.bfloat16).astype(jnp.float32)], axis=0)
    out = window[0:1] * taps[0:1]
    for i in range(1, taps.shape[0]):
        out = out + window[i : i + 1] * taps[i : i + 1]
    return out * _sigmoid(out), window[1:]


def _delta_rule_step(state, q, k, v, log_decay, beta):
    """One token of the gated delta rule on a head's f32 state [dk, dv].

    q, k [1, dk] (L2-normalised here), v [1, dv], log_decay [1, 1] or [dk, 1] (per key
    dim), beta [1, 1]. Returns (new state, output [1, dv])."""
    dk = q.shape[1]
    q = _l2_normalize(q) * dk**-0.5
    k_col = jnp.transpose(_l2_normalize(k))  # [dk, 1]
    state = state * jnp.exp(log_decay)
    predicted = jnp.sum(state * k_col, axis=0, keepdims=True)  # k^T S
    state = state + k_col * ((v - predicted) * beta)
    return state, jnp.sum(state * jnp.transpose(q), axis=0, keepdims=True)  # q^T S
