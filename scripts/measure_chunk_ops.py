"""Measure the ops one ring matmul compiles to, per weight format (mkgen/plan/opcount.py).

Renders kernels whose experts are mxfp4 (kimi-k3 on 2x2x4) and int4:128 (muse-spark-1.2
on 2x2x1), takes the template's own `Ring` and chunk products from them, and compiles a one-ring-matmul
Pallas kernel for one TPU7x core through libtpu's compile-only devices with Mosaic's
LLO dump on, for k_chunks x col_blocks of 1 x 1 and 2 x 2 and 8 and 16 token rows. It
prints, per format and row count, the ops of one chunk (the guarded product and
accumulate), of one input chunk (`_to_chunks`) and of one output block (zeroing and
`_from_blocks`). The figures in mkgen/plan/opcount.py were printed by this script.

    PYTHONPATH=. .venv/bin/python scripts/measure_chunk_ops.py
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

DUMP = tempfile.mkdtemp(prefix="mkgen-chunk-ops-")
os.environ["LIBTPU_INIT_ARGS"] = (
    f"--xla_mosaic_dump_to={DUMP} --xla_mosaic_enable_dump_debug_info=true"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def main() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from mkgen.codegen.build import load_module, render_kernel
    from mkgen.plan import plan_build
    from mkgen.plan.options import BuildOptions
    from mkgen.spec.loader import load_spec
    from mkgen.spec.topology import parse_topology
    from mkgen.verify.llo import GROUPS, StepCounter, parse_llo
    from mkgen.verify.tpu_compile import compile_only_devices, quiet_stderr

    def rendered(spec_name: str, shape: str, rows: int):  # noqa: ANN202
        options = BuildOptions.create(rows=rows)
        spec = options.apply(load_spec(spec_name))
        plan = plan_build(spec, parse_topology(shape), options)
        return load_module(render_kernel(plan.kernel, "chunk ops"), f"chunk_ops_{spec_name}")

    # kimi-k3's experts are mxfp4, muse-spark-1.2's int4 with a scale per 128 rows.
    kimi = rendered("kimi-k3", "2x2x4", 8)
    muse = rendered("muse-spark-1.2", "2x2x1", 1)
    device = compile_only_devices(parse_topology("1x1x1"))[0]
    chunk = kimi.CHUNK
    lanes = kimi.LANES

    def slots(fmt: str, chunks: int) -> list[jax.ShapeDtypeStruct]:  # one slot's arrays
        if fmt == "bf16":
            return [jax.ShapeDtypeStruct((1, chunks * chunk, lanes), jnp.bfloat16)]
        if fmt == "mxfp4":
            return [
                jax.ShapeDtypeStruct((1, chunks * chunk // 2, lanes), jnp.int8),
                jax.ShapeDtypeStruct((1, chunks * chunk // 32, lanes), jnp.int8),
            ]
        return [  # int4:128
            jax.ShapeDtypeStruct((1, chunks * chunk // 2, lanes), jnp.int8),
            jax.ShapeDtypeStruct((1, chunks * chunk // 128, lanes), jnp.bfloat16),
        ]

    def product(fmt: str, refs):  # noqa: ANN001, ANN202
        if fmt == "bf16":
            return kimi._bf16_product(*refs)
        if fmt == "mxfp4":
            return kimi._mxfp4_product(*refs)
        return muse._int4_product(*refs, 128)

    kernel = kimi  # the ring and constants (CHUNK, LANES) are the same in every build

    def compile_one(fmt: str, rows: int, k: int, c: int) -> dict[str, dict[str, float]]:
        chunks = k * c
        shapes = slots(fmt, chunks)

        def body(x_ref, out_ref, xk, acc, *weights):  # noqa: ANN001, ANN202
            ring = kernel.Ring(lambda q: [], 1, chunks, 1, product(fmt, weights), xk, acc)
            out_ref[...] = ring.matmul(x_ref[...], 0, k * chunk, k, c, c * kernel.LANES)

        call = pl.pallas_call(
            body,
            out_shape=jax.ShapeDtypeStruct((rows, c * kernel.LANES), jnp.float32),
            in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)],
            out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
            scratch_shapes=[
                pltpu.VMEM((k, rows, chunk), jnp.bfloat16),
                pltpu.VMEM((c, rows, kernel.LANES), jnp.float32),
            ]
            # The slots are scratch, as the kernel's ring and expert slots are (an input
            # block would get another VMEM tiling); compiling needs no weight values.
            + [pltpu.VMEM(s.shape, s.dtype) for s in shapes],
            name=f"chunk_{fmt.replace(':', '_')}_{rows}_{k}x{c}",
        )
        # Through shard_map over the compile-only device, as the megakernel is: Mosaic
        # then knows which TPU it lowers for.
        mesh = Mesh(np.array([device]), ("d",))
        sharding = NamedSharding(mesh, P())
        step = jax.jit(
            jax.shard_map(
                call,
                mesh=mesh,
                in_specs=(P(),),
                out_specs=P(),
                check_vma=False,
            )  # fmt: skip
        )
        x = jax.ShapeDtypeStruct((rows, k * chunk), jnp.float32, sharding=sharding)
        with quiet_stderr():
            step.trace(x).lower(lowering_platforms=("tpu",)).compile()
        dump = next(
            Path(DUMP).glob(f"*chunk_{fmt.replace(':', '_')}_{rows}_{k}x{c}*post-finalize-llo.txt")
        )
        counts = StepCounter(parse_llo(dump.read_text()), lambda frames: None).count()
        parts: dict[str, dict[str, float]] = {}
        for (frames, group), n in counts.items():
            names = " ".join(frames)
            part = (
                "chunk" if "unit_step" in names else "k_chunk" if "_to_chunks" in names else "block"
            )
            parts.setdefault(part, dict.fromkeys(GROUPS, 0.0))[group] += n
        return parts

    for fmt in ("bf16", "mxfp4", "int4:128"):
        for rows in (8, 16):
            one = compile_one(fmt, rows, 1, 1)
            two = compile_one(fmt, rows, 2, 2)
            # 2 x 2 has 3 more chunks, 1 more input chunk and 1 more output block than 1 x 1.
            per_chunk = {g: (two["chunk"][g] - one["chunk"][g]) / 3 for g in GROUPS}
            per_k = {g: two.get("k_chunk", {}).get(g, 0) - one.get("k_chunk", {}).get(g, 0)
                     for g in GROUPS}  # fmt: skip
            per_block = {g: two.get("block", {}).get(g, 0) - one.get("block", {}).get(g, 0)
                         for g in GROUPS}  # fmt: skip
            print(f"{fmt} rows {rows}: chunk {per_chunk}")
            print(f"{fmt} rows {rows}: input chunk {per_k}")
            print(f"{fmt} rows {rows}: output block {per_block}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
