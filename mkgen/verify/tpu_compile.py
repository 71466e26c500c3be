"""Compile kernels for a real TPU7x through libtpu's compile-only devices.

libtpu can describe a TPU slice it is not running on
(`jax.experimental.topologies.get_topology_desc`). Lowering and compiling
against those devices runs Mosaic for real: VMEM overflow, misaligned slices
and unsupported ops fail here as they would on the chip. The compiled module
records the scoped VMEM the kernel really uses, which the plan's figure is held
against.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from mkgen.errors import MkgenError, first_line
from mkgen.spec.topology import Topology

_USED_VMEM = re.compile(r'"used_scoped_memory_configs":\[([^\]]*)\]')
_SIZE = re.compile(r'"size":"(\d+)"')


class CompileError(MkgenError):
    """Mosaic or XLA refused the kernel; the message is the compiler's."""


@contextlib.contextmanager
def quiet_stderr() -> Iterator[list[str]]:
    """Silence C++ start-up noise (libtpu prints to fd 2); the text is kept in the list."""
    captured: list[str] = []
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield captured
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            captured.append(sink.read().decode(errors="replace"))


def compile_only_devices(topology: Topology) -> list[Any]:
    """The slice's TPU devices as libtpu describes them (no TPU needed), in device order."""
    # Compile-only devices touch no chip, so several processes (a test and the CLI it
    # runs, parallel builds) may load libtpu at once; without this libtpu refuses the
    # second load through its lockfile. The runner on a real TPU host never sets it.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    with quiet_stderr():
        desc = topologies.get_topology_desc(topology.compile_only_name, platform="tpu")
    devices = sorted(desc.devices, key=lambda d: d.id)
    if len(devices) != topology.num_devices:
        raise MkgenError(
            f"libtpu describes {len(devices)} devices for {topology.compile_only_name}, "
            f"the topology has {topology.num_devices}"
        )
    return devices


def used_vmem_bytes(hlo_text: str) -> int:
    """Largest scoped VMEM any Mosaic kernel of a compiled module uses (bytes)."""
    sizes = [
        int(size) for configs in _USED_VMEM.findall(hlo_text) for size in _SIZE.findall(configs)
    ]
    return max(sizes, default=0)


@dataclass(frozen=True)
class CompileReport:
    seconds: float
    vmem_bytes: int


def compile_for_tpu(fn: Callable[..., Any], args: Sequence[Any]) -> CompileReport:
    """Lower and compile a jitted function for TPU from shape-only arguments.

    `args` are jax.ShapeDtypeStructs carrying shardings over compile-only devices.
    """
    start = time.perf_counter()
    try:
        with quiet_stderr():
            compiled = fn.trace(*args).lower(lowering_platforms=("tpu",)).compile()
    except Exception as error:  # Mosaic reports through several exception types
        raise CompileError(f"TPU compile failed: {first_line(error)}") from error
    seconds = time.perf_counter() - start
    return CompileReport(seconds=seconds, vmem_bytes=used_vmem_bytes(compiled.as_text()))
