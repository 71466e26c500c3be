"""JAX's devices for a runner: the environment set before JAX is imported, the start of
jax.distributed, the mesh in the plan's order, and kernel outputs brought to the host."""

from __future__ import annotations

import os
from argparse import Namespace
from typing import Any

from mkgen.errors import MkgenError
from mkgen.runtime.build import Build


def configure(build: Build, interpret: bool) -> None:
    """Before JAX is imported: interpret mode runs on virtual CPU devices."""
    if interpret:
        os.environ["JAX_PLATFORMS"] = "cpu"
        flags = os.environ.get("XLA_FLAGS", "")
        count = f"--xla_force_host_platform_device_count={build.devices}"
        os.environ["XLA_FLAGS"] = f"{flags} {count}".strip()


def start_distributed(args: Namespace) -> None:
    """One process per host: jax.distributed.initialize from the flags, or (on a TPU pod)
    from what the TPU runtime tells it."""
    if not args.multi_host:
        return
    import jax

    given = {
        "coordinator_address": args.coordinator,
        "num_processes": args.num_processes,
        "process_id": args.process_id,
    }
    jax.distributed.initialize(**{k: v for k, v in given.items() if v is not None})


def visible_devices() -> list[Any]:
    """JAX's devices in id order. Starting the backends is where libtpu, on a host without
    a TPU, writes its start-up noise to stderr before JAX falls back to the CPU; it is
    swallowed so that the runner's own error about the devices is the line users see."""
    import jax

    from mkgen.verify.tpu_compile import quiet_stderr

    with quiet_stderr():
        try:
            devices = jax.devices()
        except RuntimeError as error:
            first = (str(error).splitlines() or [type(error).__name__])[0]
            raise MkgenError(f"JAX could not start a backend: {first}") from None
    return sorted(devices, key=lambda d: d.id)


def make_mesh(build: Build, kernel: Any, layout: Any) -> Any:
    """The build's devices in the plan's mesh order (sibling cores adjacent, then chips x,
    y, z: the collectives' stages), on the kernel's one mesh axis."""
    import numpy as np
    from jax.sharding import Mesh

    from mkgen.plan.collectives import arrange_devices
    from mkgen.spec.topology import parse_topology

    devices = visible_devices()
    if len(devices) < build.devices:
        raise MkgenError(
            f"this build needs {build.devices} devices, JAX sees {len(devices)} "
            f"{devices[0].platform} device(s): run on a {build.topology} slice or pass --interpret"
        )
    order = arrange_devices(devices, parse_topology(build.topology), layout.collectives.mesh_order)
    return Mesh(np.array(order), (kernel.AXIS,))


def host_value(array: Any) -> Any:
    """A kernel output on this host: replicated outputs from a local shard, sharded ones
    gathered across processes."""
    import jax
    import numpy as np

    if jax.process_count() == 1:
        return np.asarray(array)
    if array.sharding.is_fully_replicated:
        return np.asarray(array.addressable_data(0))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))
