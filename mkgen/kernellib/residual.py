"""The attention residual: each block of layers starts from a softmax mixture of the
stream's snapshots at earlier block starts."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from mkgen.kernellib.constants import MAX_SNAPSHOTS, RESIDUAL_LOGITS_ROW


def _attention_residual(snapshots, x_res, vec, block):
    """Block `block` starts: snapshot the stream; from the second block on, the stream (and
    its snapshot) becomes the softmax mixture of the last n = min(block + 1, MAX_SNAPSHOTS)
    snapshots, oldest first (snapshots live in a ring of MAX_SNAPSHOTS slots)."""
    slot = block % MAX_SNAPSHOTS
    snapshots[slot] = x_res[...]

    @pl.when(block >= 1)
    def _():
        n = jnp.minimum(block + 1, MAX_SNAPSHOTS)
        logits = vec[RESIDUAL_LOGITS_ROW : RESIDUAL_LOGITS_ROW + 1, :MAX_SNAPSHOTS]
        live = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1) < n
        top = jnp.max(jnp.where(live, logits, -jnp.inf), axis=1, keepdims=True)
        weights = jnp.where(live, jnp.exp(logits - top), 0.0)
        mix = weights / jnp.sum(weights, axis=1, keepdims=True)
        mixed = jnp.zeros(x_res.shape, jnp.float32)
        for j in range(MAX_SNAPSHOTS):
            source = (block - n + 1 + j) % MAX_SNAPSHOTS
            # Slots past n may hold nothing yet: select, never multiply them in.
            mixed = jnp.where(j < n, mixed + mix[:, j : j + 1] * snapshots[source], mixed)
        snapshots[slot] = mixed
        x_res[...] = mixed
