"""The environment of a process that runs kernels on virtual CPU devices (interpret mode):
JAX on the CPU with a given number of host devices. Set before jax is imported; shared by
the runtime (which sets its own process up) and verify (which starts a child)."""

from __future__ import annotations

from collections.abc import Mapping


def cpu_device_variables(count: int, environ: Mapping[str, str]) -> dict[str, str]:
    """JAX_PLATFORMS and XLA_FLAGS for `count` CPU devices: the XLA flags `environ` already
    has are kept, and the device count comes last, so it holds over any earlier one."""
    flags = environ.get("XLA_FLAGS", "")
    count_flag = f"--xla_force_host_platform_device_count={count}"
    return {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"{flags} {count_flag}".strip()}
