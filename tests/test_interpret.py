"""mkgen/interpret.py: io_callback hands its callbacks numpy copies instead of arrays put on
a CPU device, only on the JAX it was written for, and a kernel that DMAs and signals
semaphores in interpret mode computes the same bytes either way."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax._src import callback as jax_callback
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mkgen import interpret


@pytest.fixture
def stock_io_callback(monkeypatch: pytest.MonkeyPatch):
    """JAX's own io_callback implementation in place (another test in this process may have
    entered mkgen's interpret mode), and whatever was there put back after the test."""
    monkeypatch.setattr(jax_callback, "io_callback_impl", interpret.JAX_IO_CALLBACK_IMPL)
    return interpret.JAX_IO_CALLBACK_IMPL


def test_callbacks_get_owned_numpy_copies_of_their_arguments(stock_io_callback) -> None:
    assert stock_io_callback.__module__ == "jax._src.callback"
    assert interpret.numpy_callback_arguments()
    assert jax_callback.io_callback_impl is not stock_io_callback
    assert interpret.numpy_callback_arguments()  # idempotent
    seen = []

    def record(x, y):
        seen.append((x, y))
        out = x.astype(np.float32) * 2 + y.astype(np.float32)
        x[0] = 7  # the callback's own copy: the traced value is untouched
        return out

    @jax.jit
    def f(x, y):
        out = jax.ShapeDtypeStruct(x.shape, jnp.float32)
        return jax.experimental.io_callback(record, out, x, y), x

    x = jnp.arange(4, dtype=jnp.int32)
    y = jnp.full((4,), 0.5, jnp.bfloat16)
    doubled, same = f(x, y)
    (got_x, got_y), = seen  # fmt: skip
    assert type(got_x) is np.ndarray and type(got_y) is np.ndarray
    assert got_y.dtype == ml_dtypes.bfloat16 and got_x.flags.owndata
    np.testing.assert_array_equal(np.asarray(doubled), [0.5, 2.5, 4.5, 6.5])
    np.testing.assert_array_equal(np.asarray(same), [0, 1, 2, 3])


def test_another_io_callback_is_left_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    def other(*args, result_avals, callback):  # not JAX 0.12's signature
        raise AssertionError("not called")

    monkeypatch.setattr(jax_callback, "io_callback_impl", other)
    assert not interpret.numpy_callback_arguments()
    assert jax_callback.io_callback_impl is other


def _kernel(x_hbm, o_ref, buf, sems):
    """Two DMAs from HBM into VMEM, each waited on its own semaphore, then a sum."""
    first = pltpu.make_async_copy(x_hbm.at[0], buf.at[0], sems.at[0])
    second = pltpu.make_async_copy(x_hbm.at[1], buf.at[1], sems.at[1])
    first.start()
    second.start()
    first.wait()
    second.wait()
    o_ref[...] = buf[0].astype(jnp.float32) * 3 + buf[1].astype(jnp.float32)


@jax.jit
def _run(x):
    return pl.pallas_call(
        _kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape[1:], jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM(x.shape, x.dtype), pltpu.SemaphoreType.DMA((2,))],
    )(x)


def test_a_kernel_in_interpret_mode_computes_the_same_bytes_either_way(
    stock_io_callback,
) -> None:
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 16, 128)), jnp.bfloat16)
    params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
    with pltpu.force_tpu_interpret_mode(params):
        stock = np.asarray(_run(x))
    with interpret.interpret_mode(params):
        assert jax_callback.io_callback_impl is not stock_io_callback
        numpy = np.asarray(_run(x))
    expected = np.asarray(x[0], np.float32) * 3 + np.asarray(x[1], np.float32)
    np.testing.assert_array_equal(stock, expected)
    np.testing.assert_array_equal(numpy, stock)
