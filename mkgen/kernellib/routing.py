"""Choosing experts: the k largest scores of each row, lowest index first on ties (the
reference's order, so that a kernel and the reference choose alike)."""

import jax
import jax.numpy as jnp


def _top_k(values, k, lanes=128):
    """(indices, values) of the k largest per row, lowest index first on ties, in lanes
    0..k-1 of [rows, lanes] arrays (argmax loops: a stable top-k does not lower on TPU)."""
    rows, width = values.shape
    col = jax.lax.broadcasted_iota(jnp.int32, (rows, width), 1)
    lane = jax.lax.broadcasted_iota(jnp.int32, (rows, lanes), 1)
    ids = jnp.zeros((rows, lanes), jnp.int32)
    best = jnp.zeros((rows, lanes), jnp.float32)
    for j in range(k):
        top = jnp.max(values, axis=1, keepdims=True)
        index = jnp.min(jnp.where(values == top, col, width), axis=1, keepdims=True)
        ids = jnp.where(lane == j, index, ids)
        best = jnp.where(lane == j, top, best)
        values = jnp.where(col == index, -jnp.inf, values)
    return ids, best
