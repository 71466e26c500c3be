"""The residual stream: a layer's update added a row block at a time, and the attention
residual: each block of layers starts from a softmax mixture of the stream's snapshots at
earlier block starts."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mkgen.kernellib.constants import MAX_SNAPSHOTS, RESIDUAL_LOGITS_ROW, ROW_BLOCK


def _add_to_stream(x_res, update):
    """The residual stream plus a layer's `update`, a row block at a time: each block of the
    stream is read as it is added, so no copy of the whole stream stays live while the
    layer computes `update` (Mosaic would keep it in its own scratch)."""
    for first in range(0, x_res.shape[0], ROW_BLOCK):
        size = min(ROW_BLOCK, x_res.shape[0] - first)
        x_res[pl.ds(first, size), :] = x_res[pl.ds(first, size), :] + update[first : first + size]


def _mix_weights(vec, n):
    """The softmax of the block's logits over its n live snapshots, [1, MAX_SNAPSHOTS]
    (zero past n)."""
    logits = vec[RESIDUAL_LOGITS_ROW : RESIDUAL_LOGITS_ROW + 1, :MAX_SNAPSHOTS]
    live = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1) < n
    top = jnp.max(jnp.where(live, logits, -jnp.inf), axis=1, keepdims=True)
    weights = jnp.where(live, jnp.exp(logits - top), 0.0)
    return weights / jnp.sum(weights, axis=1, keepdims=True)


def _attention_residual(snapshots, x_res, vec, block):
    """Block `block` starts: snapshot the stream; from the second block on, the stream (and
    its snapshot) becomes the softmax mixture of the last n = min(block + 1, MAX_SNAPSHOTS)
    snapshots, oldest first (snapshots live in a ring of MAX_SNAPSHOTS slots)."""
    slot = block % MAX_SNAPSHOTS
    snapshots[slot] = x_res[...]

    @pl.when(block >= 1)
    def _():
        n = jnp.minimum(block + 1, MAX_SNAPSHOTS)
        mix = _mix_weights(vec, n)
        mixed = jnp.zeros(x_res.shape, jnp.float32)
        for j in range(MAX_SNAPSHOTS):
            source = (block - n + 1 + j) % MAX_SNAPSHOTS
            # Slots past n may hold nothing yet: select, never multiply them in.
            mixed = jnp.where(j < n, mixed + mix[:, j : j + 1] * snapshots[source], mixed)
        snapshots[slot] = mixed
        x_res[...] = mixed


def _attention_residual_hbm(snapshots_hbm, landing, sem, x_res, vec, block):
    """_attention_residual with the snapshots in HBM: from the second block on, the stream
    (the newest snapshot) is mixed a row block of `landing`'s rows at a time: the block is
    scaled by its weight and the block of each of the n - 1 earlier snapshots, copied into
    `landing`, added in place, oldest first (no loop-carried value, and no value wider than
    one row block: Mosaic would keep each in its own scratch); the mixed stream is then
    copied out as the block's snapshot."""
    slot = block % MAX_SNAPSHOTS

    @pl.when(block >= 1)
    def _():
        n = jnp.minimum(block + 1, MAX_SNAPSHOTS)
        mix = _mix_weights(vec, n)
        lanes = jax.lax.broadcasted_iota(jnp.int32, mix.shape, 1)
        tokens, block_rows = x_res.shape[0], landing.shape[0]
        for first in range(0, tokens, block_rows):
            rows = pl.ds(first, min(block_rows, tokens - first))
            _mix_row_block(snapshots_hbm, landing, sem, x_res, mix, lanes, block, n, rows)

    copy = pltpu.make_async_copy(x_res, snapshots_hbm.at[slot], sem.at[0])
    copy.start()
    copy.wait()


def _mix_row_block(snapshots_hbm, landing, sem, x_res, mix, lanes, block, n, rows):
    """Rows `rows` of the stream mixed with the same rows of the n - 1 earlier snapshots."""
    x_res[rows, :] = (
        jnp.sum(jnp.where(lanes == n - 1, mix, 0.0), axis=1, keepdims=True) * x_res[rows, :]
    )
    land = landing.at[pl.ds(0, rows.size)]

    @pl.loop(0, n - 1)
    def _(j):
        copy = pltpu.make_async_copy(
            snapshots_hbm.at[(block - n + 1 + j) % MAX_SNAPSHOTS, rows], land, sem.at[0]
        )
        copy.start()
        copy.wait()
        weight = jnp.sum(jnp.where(lanes == j, mix, 0.0), axis=1, keepdims=True)
        x_res[rows, :] = x_res[rows, :] + weight * land[...]
