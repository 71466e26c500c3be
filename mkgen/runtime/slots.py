"""One sequence's place in the decode caches: the kernel's cache arrays hold BATCH
sequences ([devices, layers, BATCH, ...], mkgen.runtime.decode.prefill's layout), and a
server moves sequences in and out of those slots between device calls.

Imports JAX: imported after the device environment is set.
"""

from __future__ import annotations

import functools

import jax

BATCH_AXIS = 2  # of every global cache array: [devices, layers, BATCH, ...]


@functools.partial(jax.jit, donate_argnums=0)
def insert_sequence(
    caches: list[jax.Array], slot: int | jax.Array, sequence_caches: list[jax.Array]
) -> list[jax.Array]:
    """`caches` with slot `slot` replaced by one sequence's caches (batch 1, as
    decode.prefill_sequence returns them): every position of the slot is overwritten, so
    nothing of the slot's previous sequence stays. The caches are donated (updated in
    place); `slot` is traced, so one compile serves every slot."""
    return [
        jax.lax.dynamic_update_slice_in_dim(c, s.astype(c.dtype), slot, BATCH_AXIS)
        for c, s in zip(caches, sequence_caches, strict=True)
    ]


@jax.jit
def extract_sequence(caches: list[jax.Array], slot: int | jax.Array) -> list[jax.Array]:
    """Slot `slot` of `caches` as one sequence's caches (batch 1), the inverse of
    insert_sequence: a sequence moved to other devices or to host memory and back."""
    return [jax.lax.dynamic_slice_in_dim(c, slot, 1, BATCH_AXIS) for c in caches]
