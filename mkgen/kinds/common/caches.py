"""jax helpers the kinds' cache hooks (their records' cache_pieces, own_cache_pieces) and
the XLA prefill share. Imported where a hook runs, not with the kinds: planning a build
imports no jax."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def piece(x: jax.Array, axis: int, size: int, index: jax.Array | int) -> jax.Array:
    """Piece `index` of `size` along `axis` (index may be traced: a core's own rank)."""
    return jax.lax.dynamic_slice_in_dim(x, index * size, size, axis)


def current_snapshot(x: jax.Array, rows: int) -> jax.Array:
    """x [B, ...] -> [B, rows, ...]: x as the snapshot a step starts from (row rows - 1),
    the others zero."""
    return jnp.zeros((x.shape[0], rows, *x.shape[1:]), x.dtype).at[:, rows - 1].set(x)
