"""JAX's devices for a runner: the environment set before JAX is imported, the start of
jax.distributed, the mesh in the plan's order, and kernel outputs brought to the host."""

from __future__ import annotations

import os
from argparse import Namespace
from typing import Any

from mkgen.errors import MkgenError, first_line
from mkgen.host_devices import cpu_device_variables
from mkgen.runtime.build import Build


def configure(build: Build, interpret: bool, meshes: int = 1, processes: int = 1) -> None:
    """Before JAX is imported: interpret mode runs on virtual CPU devices, the build's
    devices for each of `meshes` meshes (a disaggregated prefill has its own), shared
    evenly by the `processes` of a multi-host job."""
    if interpret:
        per_process = build.devices * meshes // processes
        os.environ.update(cpu_device_variables(per_process, os.environ))


# Why `--multi-host --interpret` is refused (mkgen run, mkgen serve).
INTERPRET_ACROSS_PROCESSES = (
    "--multi-host --interpret: the interpret-mode kernel cannot decode across processes "
    "(each process simulates only its own cores' memory and semaphores, so the first remote "
    "DMA waits forever); run it in one process, or on TPUs"
)


def check_multi_host_flags(
    multi_host: bool,
    disaggregate: bool,
    coordinator: str | None,
    num_processes: int | None,
    process_id: int | None,
) -> None:
    """The multi-host flags that mean something only together (mkgen run, mkgen serve)."""
    given = {"--coordinator": coordinator, "--num-processes": num_processes}
    given["--process-id"] = process_id
    for flag, value in given.items():
        if value is not None and not multi_host:
            raise MkgenError(f"{flag}: only with --multi-host")
    if disaggregate and multi_host:
        raise MkgenError(
            "--disaggregate: not with --multi-host (a prefill mesh is tested in one process only)"
        )
    if num_processes is not None and process_id is not None and process_id >= num_processes:
        raise MkgenError(
            f"--process-id: must be below --num-processes ({num_processes}), got {process_id}"
        )


def start_distributed(args: Namespace) -> None:
    """One process per host: jax.distributed.initialize from the flags, or (on a TPU pod)
    from what the TPU runtime tells it."""
    if not args.multi_host:
        return
    import jax

    if args.interpret:  # the processes' CPU devices reach each other through gloo
        jax.config.update("jax_cpu_collectives_implementation", "gloo")

    given = {
        "coordinator_address": args.coordinator,
        "num_processes": args.num_processes,
        "process_id": args.process_id,
    }
    jax.distributed.initialize(**{k: v for k, v in given.items() if v is not None})


def broadcast_prompts(prompts: list[list[int]]) -> list[list[int]]:
    """Process 0's prompts in every process of a multi-host job (each process passes its
    own, of the same count: what it read, or placeholders): process 0 reads a request,
    the others receive it, so every process feeds its devices the same tokens."""
    import jax
    import numpy as np
    from jax.experimental.multihost_utils import broadcast_one_to_all

    lengths = broadcast_one_to_all(np.array([len(p) for p in prompts], np.int32))
    padded = np.zeros((len(prompts), int(lengths.max())), np.int32)
    if jax.process_index() == 0:
        for row, prompt in zip(padded, prompts, strict=True):
            row[: len(prompt)] = prompt
    padded = broadcast_one_to_all(padded)
    return [row[:length].tolist() for row, length in zip(padded, lengths, strict=True)]


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
            raise MkgenError(f"JAX could not start a backend: {first_line(error)}") from None
    return sorted(devices, key=lambda d: d.id)


def make_mesh(build: Build, kernel: Any, layout: Any, group: int = 0, meshes: int = 1) -> Any:
    """The build's devices in the plan's mesh order (sibling cores adjacent, then chips x,
    y, z: the collectives' stages), on the kernel's one mesh axis. Of `meshes` meshes
    (a disaggregated prefill's and the decode's), mesh `group` takes the group-th
    build.devices devices in id order."""
    import numpy as np
    from jax.sharding import Mesh

    from mkgen.plan.collectives import arrange_devices
    from mkgen.spec.topology import parse_topology

    devices = visible_devices()
    needed = build.devices * meshes
    if len(devices) < needed:
        what = f"this build needs {build.devices} devices"
        where = f"a {build.topology} slice"
        if meshes > 1:
            what = f"a prefill mesh and a decode mesh need {needed} devices"
            where = f"two {build.topology} slices"
        raise MkgenError(
            f"{what}, JAX sees {len(devices)} {devices[0].platform} device(s): "
            f"run on {where} or pass --interpret"
        )
    devices = devices[group * build.devices : (group + 1) * build.devices]
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
