"""Pallas' TPU interpret mode as every mkgen process that runs a kernel on CPU devices
enters it: verify's child, `mkgen run --interpret` and `mkgen serve --interpret`.

The interpreter runs each load, store, DMA and semaphore op of the kernel as a
`jax.experimental.io_callback` into Python. JAX's io_callback first copies every argument
of every such call onto a CPU device (`jax.device_put`, through its sharding machinery),
only for the interpreter to read it back as numpy: that copy is about 45 % of an
interpret-mode step (Kimi K3's 2x2x1 twin, one eager step: 25.0 s -> 13.5 s without it).
`interpret_mode` replaces it by numpy copies. The callbacks get the same values as numpy
arrays they own (a copy, as device_put's result is), so nothing they compute changes;
every twin the suite verifies runs through it, and tests/test_interpret.py runs a DMA
and semaphore kernel both ways. JAX has no option for this, so it is a replacement of one
private function, made only where that function is the one it was written for (JAX
0.12's signature and lowering), else JAX is left as it is (and interpret mode is only
slower).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import numpy as np
from jax._src import callback as jax_callback
from jax._src import config, sharding_impls, tree_util
from jax._src import mesh as mesh_lib
from jax._src import xla_bridge as xb
from jax.experimental.pallas import tpu as pltpu

# The parameters of the io_callback implementation this module replaces (JAX 0.12).
_EXPECTED_PARAMETERS = ("args", "result_avals", "callback", "sharding", "ordered")
# JAX's own implementation, as this module found it (tests compare with it).
JAX_IO_CALLBACK_IMPL = getattr(jax_callback, "io_callback_impl", None)


def _io_callback_in_numpy(
    *args: Any, result_avals: Any, callback: Any, sharding: Any, ordered: bool
) -> Any:
    """JAX's io_callback_impl with its arguments copied as numpy arrays, not put on a CPU
    device: the rest (the default device and empty meshes the callback runs under, numpy
    results) is JAX's."""
    del result_avals, sharding, ordered
    cpu_device, *_ = xb.local_devices(backend="cpu")
    args = tuple(np.array(a) for a in args)
    with (
        config.default_device(cpu_device),
        sharding_impls._internal_use_concrete_mesh(mesh_lib.empty_concrete_mesh),
        mesh_lib.use_abstract_mesh(mesh_lib.empty_abstract_mesh),
    ):
        return tree_util.tree_map(np.asarray, callback(*args))


def numpy_callback_arguments() -> bool:
    """Make io_callback hand its callbacks numpy copies (module docstring); True if it does
    now, False if this JAX's io_callback is not the one this was written for (left as it
    is). Idempotent."""
    current = getattr(jax_callback, "io_callback_impl", None)
    if current is _io_callback_in_numpy:
        return True
    lowering = getattr(jax_callback, "io_callback_lowering", None)
    if current is None or lowering is None:
        return False
    parameters = tuple(inspect.signature(current).parameters)
    # The lowering's callback looks the implementation up by name at each call.
    nested = [c for c in lowering.__code__.co_consts if inspect.iscode(c)]
    looked_up = any("io_callback_impl" in code.co_names for code in nested)
    if parameters != _EXPECTED_PARAMETERS or not looked_up:
        return False
    jax_callback.io_callback_impl = _io_callback_in_numpy
    return True


def interpret_mode(
    params: pltpu.InterpretParams | None = None,
) -> contextlib.AbstractContextManager[None]:
    """Pallas TPU interpret mode with `params` (JAX's defaults if None) for the kernels
    called inside it, io_callback's arguments as numpy copies."""
    numpy_callback_arguments()
    return pltpu.force_tpu_interpret_mode(params or pltpu.InterpretParams())
