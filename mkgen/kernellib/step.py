"""Around the kernel: the context its phases read, the RoPE tables built before it (XLA),
and the decode step's arguments as shapes (compiling without weights)."""

import jax
import jax.numpy as jnp

from mkgen.kernellib.constants import (
    AXIS,
    BANK_ROWS,
    BATCH,
    HIDDEN,
    LANES,
    LAYER_TABLES,
    NUM_DEVICES,
    NUM_LAYERS,
    ROWS,
    TOKENS,
    TOKENS_PADDED,
    TOTAL_BANKS,
    VECTOR_ROWS,
    VECTOR_WIDTH,
    cache_shapes,
    expert_shapes,
)


class _Context:
    """What every phase reads: tables, positions, the stream, vectors, caches, scratch."""

    def __init__(self, **parts):
        self.__dict__.update(parts)


def _rope_tables(positions, inv_freq, attention_factor):
    """cos/sin [TOKENS_PADDED, len(inv_freq)] of every row's position (XLA, before the kernel)."""
    rows = jnp.repeat(positions, ROWS) + jnp.tile(jnp.arange(ROWS, dtype=jnp.int32), BATCH)
    rows = jnp.pad(rows, (0, TOKENS_PADDED - TOKENS))
    angles = rows.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]
    return jnp.cos(angles) * attention_factor, jnp.sin(angles) * attention_factor


# fmt: off

def argument_shapes(mesh):
    """Shape-only arguments of the decode step on `mesh` (for compiling without weights)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
    args = [
        jax.ShapeDtypeStruct((len(LAYER_TABLES), NUM_LAYERS), jnp.int32, sharding=replicated),
        jax.ShapeDtypeStruct((BATCH,), jnp.int32, sharding=replicated),
        jax.ShapeDtypeStruct((TOKENS_PADDED, HIDDEN), jnp.float32, sharding=replicated),
        jax.ShapeDtypeStruct((1, HIDDEN), jnp.float32, sharding=replicated),
        jax.ShapeDtypeStruct((NUM_DEVICES, TOTAL_BANKS, BANK_ROWS, LANES), jnp.bfloat16, sharding=sharded),
        jax.ShapeDtypeStruct((NUM_DEVICES, NUM_LAYERS, VECTOR_ROWS, VECTOR_WIDTH), jnp.float32, sharding=sharded),
    ]
    for shape, dtype in expert_shapes() + cache_shapes():
        args.append(jax.ShapeDtypeStruct((NUM_DEVICES, *shape), dtype, sharding=sharded))
    return args


# fmt: on
