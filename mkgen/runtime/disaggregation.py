"""Prefill/decode disaggregation: prompts prefilled on their own devices, their caches
handed to the decode mesh; idle sequences' caches offloaded to host memory and back.

A prefill model is the decode model's build and weights placed again on a second mesh
of build.devices devices (prefill_model). Its prefill (mkgen.runtime.prefill) writes the
kernel's cache arrays on that mesh, in the kernel's layout ([devices, layers, batch, ...]
sharded on the mesh axis: KV caches, MLA latent caches, recurrent conv tails and states),
so handing them over is a device-to-device copy of each core's share to the same core of
the decode mesh (hand_over), with nothing recomputed. Offloading copies the arrays to
host memory (numpy) and restoring places them again with the decode mesh's shardings.

Imports JAX: imported by `run` after the device environment is set.
"""

from __future__ import annotations

from dataclasses import replace

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mkgen.runtime import devices
from mkgen.runtime.decode import Model
from mkgen.runtime.weights import place_weights

MESHES = 2  # a disaggregated runner's meshes: the decode mesh (group 0) and the prefill mesh


def prefill_model(model: Model) -> Model:
    """`model` on the prefill mesh: the second group of build.devices devices, holding
    its own copy of every core's weights."""
    mesh = devices.make_mesh(model.build, model.kernel, model.layout, group=1, meshes=MESHES)
    placed = place_weights(model.build, model.weights, mesh, model.kernel)
    return replace(model, mesh=mesh, placed=placed)


def cache_sharding(model: Model) -> NamedSharding:
    """Where a kernel cache array lives on `model`'s mesh: split over the cores."""
    return NamedSharding(model.mesh, P(model.kernel.AXIS))


def hand_over(caches: list[jax.Array], to: Model) -> list[jax.Array]:
    """Kernel caches from another mesh on `to`'s mesh: core i's share to core i."""
    sharding = cache_sharding(to)
    return [jax.device_put(cache, sharding) for cache in caches]


def offload(caches: list[jax.Array]) -> list[np.ndarray]:
    """Kernel caches copied to host memory (numpy), every core's share: the device
    arrays can then be dropped and their memory reused."""
    return [devices.host_value(cache) for cache in caches]


def restore(host: list[np.ndarray], to: Model) -> list[jax.Array]:
    """Offloaded caches placed again on `to`'s mesh (each process places its own cores'
    shares)."""
    sharding = cache_sharding(to)
    return [jax.make_array_from_callback(a.shape, sharding, lambda i, a=a: a[i]) for a in host]
