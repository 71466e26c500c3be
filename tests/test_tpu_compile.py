"""Compile-only TPU7x: a real Mosaic compile on a CPU host, its VMEM figure, its failures."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import SingleDeviceSharding

from mkgen.spec.topology import parse_topology
from mkgen.verify.tpu_compile import CompileError, compile_for_tpu, compile_only_devices

MiB = 1024 * 1024


def _streaming_kernel(scratch_rows: int):
    """A kernel that DMAs 4 weight tiles from HBM through a 2-slot VMEM buffer."""

    def kernel(w_hbm, x_ref, o_ref, ring_vmem, sems):
        def body(i, acc):
            slot = i % 2
            copy = pltpu.make_async_copy(w_hbm.at[i], ring_vmem.at[slot], sems.at[slot])
            copy.start()
            copy.wait()
            return acc + jnp.dot(x_ref[...], ring_vmem[slot], preferred_element_type=jnp.float32)

        o_ref[...] = jax.lax.fori_loop(0, 4, body, jnp.zeros(o_ref.shape, jnp.float32))

    def call(w, x):
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((8, 256), jnp.float32),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pltpu.VMEM)],
            out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
            scratch_shapes=[
                pltpu.VMEM((2, scratch_rows, 256), jnp.bfloat16),
                pltpu.SemaphoreType.DMA((2,)),
            ],
            compiler_params=pltpu.CompilerParams(vmem_limit_bytes=64 * MiB),
        )(w, x)

    return jax.jit(call)


def _shapes(device, rows: int):
    sharding = SingleDeviceSharding(device)
    return [
        jax.ShapeDtypeStruct((4, rows, 256), jnp.bfloat16, sharding=sharding),
        jax.ShapeDtypeStruct((8, rows), jnp.bfloat16, sharding=sharding),
    ]


@pytest.fixture(scope="module")
def tpu7x_device():
    return compile_only_devices(parse_topology("2x2x1"))[0]


def test_compile_only_topology_has_every_core() -> None:
    devices = compile_only_devices(parse_topology("2x2x4"))
    assert len(devices) == 32
    assert {d.device_kind for d in devices} == {"TPU7x"}


def test_compiled_kernel_reports_its_real_vmem(tpu7x_device) -> None:
    report = compile_for_tpu(_streaming_kernel(512), _shapes(tpu7x_device, 512))
    ring = 2 * 512 * 256 * 2
    # The ring is what we asked for; Mosaic adds the in/out blocks and little else.
    assert ring <= report.vmem_bytes < ring + 1 * MiB
    assert report.seconds > 0


def test_oversized_vmem_request_fails_the_compile(tpu7x_device) -> None:
    rows = 80 * 1024  # a 2 x 40 MiB ring: more than TPU7x's 64 MiB of VMEM
    with pytest.raises(CompileError, match="would exceed memory"):
        compile_for_tpu(_streaming_kernel(rows), _shapes(tpu7x_device, rows))


def _one_buffer_kernel(scratch_bytes: int):
    """A kernel of one bf16 scratch buffer of `scratch_bytes` and an [8, 256] block in and out."""
    rows = scratch_bytes // (256 * 2)

    def kernel(x_ref, o_ref, big):
        big[0:8, :] = x_ref[...]
        o_ref[...] = big[rows - 8 : rows, :].astype(jnp.float32)

    def call(x):
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((8, 256), jnp.float32),
            in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)],
            out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
            scratch_shapes=[pltpu.VMEM((rows, 256), jnp.bfloat16)],
            compiler_params=pltpu.CompilerParams(vmem_limit_bytes=64 * MiB),
        )(x)

    return jax.jit(call)


def test_mosaic_keeps_64_kib_of_the_vmem_limit(tpu7x_device) -> None:
    """The measurement behind hardware.MOSAIC_RESERVED_VMEM_BYTES: under a 64 MiB limit,
    Mosaic lets a kernel use 64 MiB - 64 KiB (the blocks in and out take 12 KiB)."""
    usable = parse_topology("2x2x1").chip_info.vmem_usable_bytes
    assert usable == 64 * MiB - 64 * 1024
    x = [jax.ShapeDtypeStruct((8, 256), jnp.bfloat16, sharding=SingleDeviceSharding(tpu7x_device))]
    fits = compile_for_tpu(_one_buffer_kernel(usable - 20 * 1024), x)
    assert usable - 8 * 1024 <= fits.vmem_bytes <= usable
    with pytest.raises(CompileError, match="of 63.94M vmem"):
        compile_for_tpu(_one_buffer_kernel(usable), x)
