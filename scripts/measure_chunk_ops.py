"""Measure the ops one ring matmul compiles to, per weight format (mkgen/plan/opcount.py).

Renders muse-spark-1.2 on 2x2x4 (where it fits in every format) with its routed
experts (or, for "stream:FORMAT", its dense weights) in each format, takes the
template's own `Ring` and chunk product from that kernel, and compiles a
one-ring-matmul Pallas kernel for one TPU7x core through libtpu's compile-only devices
with Mosaic's LLO dump on, for k_chunks x col_blocks of 2 x 2 and 4 x 4 in units of
UNIT_CHUNKS chunks (several units, so that the chunks' guards are decided at run time
as in the kernel, where a unit is an expert piece or a bank) and 8 and 16 token rows.
It prints, per format and row count, the ops of one chunk (the guarded product and
accumulate), of one input chunk (`_to_chunks`) and of one output block (zeroing and
`_from_blocks`). The figures in mkgen/plan/opcount.py were printed by this script.
Formats named on the command line are measured alone.

    PYTHONPATH=. .venv/bin/python scripts/measure_chunk_ops.py [bf16 mxfp4 stream:int8 ...]

`measure_chunk_ops.py delta_rule` measures one row of the recurrent kinds' delta rule
on one head's state the same way; `measure_chunk_ops.py attend` the cache attention kinds'
`_write_cache_<kind>` and `_attend_<kind>` of the builds tests/test_profile.py holds to
the compiled kernel, per KV tile and per (sequence, kv head) pair;
`measure_chunk_ops.py vector` the vector phase's `_rms_norm` (per 128 lanes of width)
and GQA's heads op (each head's q/k norm and RoPE) of each shipped GQA geometry.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

UNIT_CHUNKS = 2
DUMP = tempfile.mkdtemp(prefix="mkgen-chunk-ops-")
atexit.register(shutil.rmtree, DUMP, ignore_errors=True)  # the LLO dumps are only read here
os.environ["LIBTPU_INIT_ARGS"] = (
    f"--xla_mosaic_dump_to={DUMP} --xla_mosaic_enable_dump_debug_info=true"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


# JAX and libtpu read the dump flags above when they are imported.
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from mkgen.codegen.build import load_module, render_kernel  # noqa: E402
from mkgen.kinds import default_registry  # noqa: E402
from mkgen.kinds.gqa.record import GQALayout  # noqa: E402
from mkgen.plan import plan_build  # noqa: E402
from mkgen.plan.layout import INT8_TILE_ROWS, JNP_DTYPES, round_up  # noqa: E402
from mkgen.plan.options import KV_TILE_CHOICES, BuildOptions  # noqa: E402
from mkgen.spec.loader import load_spec  # noqa: E402
from mkgen.spec.topology import parse_topology  # noqa: E402
from mkgen.verify.llo import GROUPS, LloKernel, StepCounter, parse_llo  # noqa: E402
from mkgen.verify.tpu_compile import compile_only_devices, quiet_stderr  # noqa: E402

FORMATS = ("bf16", "int8", "int4:128", "mxfp4", "nvfp4", "fp8:128", "stream:int8", "stream:fp8:128")
# One build of each shipped attention geometry (key and value widths, window).
ATTENTION_BUILDS = (("qwen3-30b-a3b", "2x2x1"), ("muse-spark-1.2", "2x2x1"),
                    ("qwen3.8-27b", "2x2x1"), ("kimi-k3", "2x2x4"))  # fmt: skip
GQA_BUILDS = (("qwen3-30b-a3b", "2x2x1"), ("muse-spark-1.2", "2x2x1"), ("qwen3.8-27b", "2x2x1"),
              ("qwen3-32b", "2x2x1"), ("mixtral-8x7b", "2x2x1"))  # fmt: skip


def main() -> None:
    if sys.argv[1:] == ["attend"]:
        print_attend_ops()
    elif sys.argv[1:] == ["vector"]:
        print_vector_ops()
    elif sys.argv[1:] == ["delta_rule"]:
        print_delta_rule_ops()
    else:
        print_chunk_ops(sys.argv[1:] or FORMATS)
    sys.stdout.flush()


@functools.cache
def device() -> Any:
    """The TPU7x core every kernel here compiles for."""
    return compile_only_devices(parse_topology("1x1x1"))[0]


def rendered(quant: str, spec: str = "muse-spark-1.2") -> tuple[Any, Any]:
    """(the kernel module, its layout) of `spec` on 2x2x4 with the format override `quant`."""
    options = BuildOptions.create(rows=1, quant=[quant])
    plan = plan_build(
        options.apply(load_spec(spec)), parse_topology("2x2x4"), options, kinds=default_registry()
    )
    name = "chunk_ops_" + "".join(c if c.isalnum() else "_" for c in spec + quant)
    return load_module(render_kernel(plan.kernel, "chunk ops"), name), plan.kernel


def build_kernel(spec: str, topology: str, prefix: str, what: str) -> tuple[Any, Any]:
    """(the kernel module, the plan) of `spec`'s default build on `topology`."""
    options = BuildOptions.create()
    plan = plan_build(
        options.apply(load_spec(spec)), parse_topology(topology), options, kinds=default_registry()
    )
    module = prefix + "".join(c if c.isalnum() else "_" for c in spec)
    return load_module(render_kernel(plan.kernel, what), module), plan


def stream_slot_and_product(fmt: str, chunks: int) -> tuple[Any, list[Any], Any]:
    """A weight-stream bank of `chunks` chunks of a dense format (codes, then their
    scales) and the stream's chunk product over it."""
    kernel, layout = rendered(f"projections={fmt}")  # the latent projections
    sf = layout.features.stream_formats[0]
    scale_row = chunks * kernel.CHUNK // 2
    region = -(-chunks * sf.scale_rows // 16) * 16
    shape = jax.ShapeDtypeStruct((1, scale_row + region, kernel.LANES), jnp.bfloat16)
    code = getattr(jnp, sf.code)

    def product(refs, rows):  # noqa: ANN001, ANN202
        return kernel._stream_product(*refs, code, chunks, scale_row, sf.scale_rows, sf.block, rows)

    return kernel, [shape], product


def slots_and_product(fmt: str, chunks: int) -> tuple[Any, list[Any], Any]:
    """The kernel rendered with experts in `fmt`, one slot's arrays as it declares an
    expert slot's (for a unit of `chunks` chunks) and its chunk product over them;
    "stream:FORMAT" a weight-stream bank of a dense format."""
    if fmt.startswith("stream:"):
        return stream_slot_and_product(fmt.removeprefix("stream:"), chunks)
    kernel, layout = rendered(f"experts={fmt}")
    e = next(f for f in layout.ffn if f.type == "moe").experts
    # Each array of a slot as the kernel declares it, for `chunks` chunks. Inline scales:
    # the chunks' codes, then their scales from scale_row on, padded to whole int8 tiles
    # as a piece's are (a slot of other rows gets another VMEM tiling: the nvfp4 and mxfp4
    # chunks measured 56 vector ALU ops more, in relayouts the kernel does not have).
    scale_row = chunks * e.code_rows // e.piece_chunks
    if e.inline_scales:
        scales = round_up(chunks * e.scale_rows // e.piece_chunks, INT8_TILE_ROWS)
        arrays = [(scale_row + scales, e.code_dtype)]
    else:
        arrays = [(chunks * rows // e.piece_chunks, dtype) for rows, dtype in e.array_shapes]
    shapes = [
        jax.ShapeDtypeStruct((1, rows, kernel.LANES), getattr(jnp, JNP_DTYPES[dtype]))
        for rows, dtype in arrays
    ]
    product = {
        "bf16": lambda refs, rows: kernel._bf16_product(*refs),
        "int8": lambda refs, rows: kernel._int8_product(*refs),
        "int4": lambda refs, rows: kernel._int4_product(*refs, e.group, rows),
        "mxfp4": lambda refs, rows: kernel._mxfp4_product(*refs, scale_row, rows),
        # a slot of `chunks` chunks: their block scales, then their tensor-scale rows
        "nvfp4": lambda refs, rows: kernel._nvfp4_product(
            *refs, scale_row, chunks * kernel.CHUNK // 16
        ),
        "fp8": lambda refs, rows: kernel._fp8_product(*refs, e.group, rows),
    }[e.kind]
    return kernel, shapes, product


def compiled_llo(
    call: Any, in_specs: tuple, out_specs: Any, args: list[Any], name: str
) -> LloKernel:
    """The final LLO of the Pallas `call` named `name`, compiled for one TPU7x core on
    `args` (shapes, replicated) through shard_map over the compile-only device, as the
    megakernel is: Mosaic then knows which TPU it lowers for."""
    mesh = Mesh(np.array([device()]), ("d",))
    sharding = NamedSharding(mesh, P())
    step = jax.jit(jax.shard_map(call, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                 check_vma=False))  # fmt: skip
    placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
    with quiet_stderr():
        step.trace(*placed).lower(lowering_platforms=("tpu",)).compile()
    return parse_llo(next(Path(DUMP).glob(f"*{name}*post-finalize-llo.txt")).read_text())


def compiled_counts(body, x_shape, out_shape, scratch, name):  # noqa: ANN001, ANN201
    """(frames, group) -> ops of a one-core Pallas kernel body(x_ref, out_ref,
    *scratch) compiled for TPU7x."""
    call = pl.pallas_call(
        body,
        out_shape=jax.ShapeDtypeStruct(out_shape, jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)],
        out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
        scratch_shapes=[pltpu.VMEM(shape, dtype) for shape, dtype in scratch],
        name=name,
    )
    x = jax.ShapeDtypeStruct(x_shape, jnp.float32)
    llo = compiled_llo(call, (P(),), P(), [x], name)
    return StepCounter(llo, lambda frames: None).count()


def compile_one(fmt: str, rows: int, k: int, c: int) -> dict[str, dict[str, float]]:
    """Ops of one ring matmul of k x c chunks of `fmt` on `rows` token rows, by part:
    "chunk" (the guarded product and accumulate), "k_chunk" (`_to_chunks`), "block"."""
    kernel, shapes, product = slots_and_product(fmt, UNIT_CHUNKS)
    chunk = kernel.CHUNK

    def body(x_ref, out_ref, xk, acc, *weights):  # noqa: ANN001, ANN202
        units = k * c // UNIT_CHUNKS
        ring = kernel.Ring(lambda q: [], 1, UNIT_CHUNKS, units, product(weights, rows), xk, acc)
        segment = kernel.Segment(
            offset=0, fan_in=k * chunk, fan_out=c * kernel.LANES, k_chunks=k, col_blocks=c
        )
        out_ref[...] = ring.matmul(x_ref[...], 0, segment)

    # The slots are scratch, as the kernel's ring and expert slots are (an input
    # block would get another VMEM tiling); compiling needs no weight values.
    scratch = [((k, rows, chunk), jnp.bfloat16), ((c, rows, kernel.LANES), jnp.float32)]
    scratch += [(s.shape, s.dtype) for s in shapes]
    name = f"chunk_{fmt.replace(':', '_')}_{rows}_{k}x{c}"
    counts = compiled_counts(body, (rows, k * chunk), (rows, c * kernel.LANES), scratch, name)
    parts: dict[str, dict[str, float]] = {}
    for (frames, group), n in counts.items():
        names = " ".join(frames)
        part = "chunk" if "unit_step" in names else "k_chunk" if "_to_chunks" in names else "block"
        parts.setdefault(part, dict.fromkeys(GROUPS, 0.0))[group] += n
    return parts


def print_chunk_ops(formats: tuple[str, ...] | list[str]) -> None:
    """Per format and row count, the ops of one chunk, one input chunk, one output block."""
    for fmt in formats:
        for rows in (8, 16):
            one = compile_one(fmt, rows, 2, 2)
            two = compile_one(fmt, rows, 4, 4)
            # 4 x 4 has 12 more chunks, 2 more input chunks and 2 more output blocks.
            per_chunk = {g: (two["chunk"][g] - one["chunk"][g]) / 12 for g in GROUPS}
            per_k = {g: (two.get("k_chunk", {}).get(g, 0) - one.get("k_chunk", {}).get(g, 0)) / 2
                     for g in GROUPS}  # fmt: skip
            per_block = {g: (two.get("block", {}).get(g, 0) - one.get("block", {}).get(g, 0)) / 2
                         for g in GROUPS}  # fmt: skip
            print(f"{fmt} rows {rows}: chunk {per_chunk}")
            print(f"{fmt} rows {rows}: input chunk {per_k}")
            print(f"{fmt} rows {rows}: output block {per_block}")


def delta_rule_ops(per_key_decay: bool, heads: int) -> dict[str, float]:
    """Ops of one row of the template's _delta_rule_step on `heads` heads' 128 x 128
    f32 states that share one query and key (Gated DeltaNet's value heads of one key
    head; Mosaic computes the shared normalisation once): 2 rows less 1. KDA: a decay
    per key dim, read from a row as the template does; Gated DeltaNet: one decay."""
    kernel, _ = rendered("experts=mxfp4", "kimi-k3")  # KDA layers
    dk = dv = 128
    totals = []
    for n in (1, 2):

        def body(x_ref, out_ref, state_ref, n=n):  # noqa: ANN001, ANN202
            states = [state_ref[j] for j in range(heads)]
            for i in range(n):
                x = x_ref[i : i + 1]
                q, k, v = x[:, :dk], x[:, dk : 2 * dk], x[:, 2 * dk : 3 * dk]
                row = x[:, 3 * dk :]
                decay = jnp.transpose(row) if per_key_decay else row[:, :1]
                for j in range(heads):
                    states[j], out = kernel._delta_rule_step(
                        states[j], q, k, v, decay, row[:, j + 1 : j + 2]
                    )
                    out_ref[i : i + 1, :] += out
            for j in range(heads):
                state_ref[j] = states[j]

        name = f"delta_{'kda' if per_key_decay else 'gdn'}_{heads}_{n}"
        scratch = [((heads, dk, dv), jnp.float32)]
        counts = compiled_counts(body, (8, 4 * dk), (8, dv), scratch, name)
        totals.append(dict.fromkeys(GROUPS, 0.0))
        for (_frames, group), ops in counts.items():
            totals[-1][group] += ops
    return {g: totals[1][g] - totals[0][g] for g in GROUPS}


def print_delta_rule_ops() -> None:
    print(f"delta rule, per-key decay (KDA), 1 head: {delta_rule_ops(True, 1)}")
    for heads in (1, 2):
        ops = delta_rule_ops(False, heads)
        print(f"delta rule, one decay (Gated DeltaNet), {heads} heads of a key: {ops}")


def compiled_attend(kernel: Any, a: Any, rows: int, q_rows: int, tile: int) -> LloKernel:
    """`_write_cache_<kind>` then `_attend_<kind>` of attention kind `a` of `kernel`
    compiled alone for one core with ROWS = rows, the kind's query rows q_rows and KV
    tile `tile` (the template reads them as module constants when it is traced)."""
    align = kernel.CACHE_ALIGN
    kernel.ROWS = rows
    kernel.CACHE_BLOCK = -(-(rows + align - 1) // align) * align
    prefix = a.name.upper()
    setattr(kernel, f"{prefix}_Q_ROWS", q_rows)
    setattr(kernel, f"{prefix}_KV_TILE", tile)
    caches, kvh = getattr(kernel, f"{prefix}_CACHES"), getattr(kernel, f"{prefix}_KV_HEADS")
    d, dv = getattr(kernel, f"{prefix}_HEAD_DIM"), getattr(kernel, f"{prefix}_VALUE_DIM")
    batch = kernel.BATCH
    cache = jax.ShapeDtypeStruct((1, 1, batch, kvh, kernel.CONTEXT, d), jnp.bfloat16)
    sinks = bool(getattr(a, "sinks", False))
    scratch = [
        pltpu.VMEM((caches, batch, kvh, rows, d), jnp.bfloat16),
        pltpu.VMEM((batch, kvh, q_rows, d), jnp.float32),
        pltpu.VMEM((batch, kvh, q_rows, dv), jnp.float32),
        pltpu.VMEM((caches, 2, tile, d), jnp.bfloat16),
        pltpu.SemaphoreType.DMA((caches, 2)),
        pltpu.SemaphoreType.DMA((caches, batch, kvh)),
        pltpu.VMEM((caches, batch, kvh, kernel.CACHE_BLOCK, d), jnp.bfloat16),
    ] + ([pltpu.VMEM((kvh, q_rows, 128), jnp.float32)] if sinks else [])

    def body(positions, *refs):  # noqa: ANN001, ANN202
        cache_refs = refs[caches : 2 * caches]
        kv, q, o, tiles, tile_sems, write_sems, block, *sink = refs[2 * caches :]
        parts = {
            a.name: (kv, q, o),
            f"{a.name}_tiles": (tiles, tile_sems),
            f"{a.name}_write_sems": write_sems,
            f"{a.name}_block": block,
        }
        if sinks:
            parts[f"{a.name}_sinks"] = sink[0]
        ctx = kernel._Context(positions=positions, caches={a.name: cache_refs}, scratch=parts)
        getattr(kernel, f"_write_cache_{a.name}")(ctx, 0)
        getattr(kernel, f"_attend_{a.name}")(ctx, 0)

    name = f"attend_{a.name}_{d}_{rows}_{q_rows}_{tile}"
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    call = pl.pallas_call(
        body,
        out_shape=[cache] * caches,
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)] + [hbm] * caches,
        out_specs=[hbm] * caches,
        scratch_shapes=scratch,
        input_output_aliases={1 + j: j for j in range(caches)},
        name=name,
    )
    positions = jax.ShapeDtypeStruct((batch,), jnp.int32)
    args = [positions, *[cache] * caches]
    return compiled_llo(call, (P(),) * (1 + caches), (P(),) * caches, args, name)


def attend_counts(kernel, a, rows: int, q_rows: int, tile: int) -> dict[str, dict[str, float]]:  # noqa: ANN001
    """Ops of `_write_cache_<kind>` ("write", per pair and cache array), one KV tile
    ("tile") and the rest of `_attend_<kind>` ("pair", per pair) of attention kind `a`
    of `kernel` (compiled_attend)."""
    llo = compiled_attend(kernel, a, rows, q_rows, tile)
    prefix = a.name.upper()
    caches, kvh = getattr(kernel, f"{prefix}_CACHES"), getattr(kernel, f"{prefix}_KV_HEADS")

    def counted(tiles: int) -> dict[str, dict[str, float]]:
        """The tile loop (the only runtime-bounded one) run `tiles` times."""
        parts: dict[str, dict[str, float]] = {}
        for (frames, group), n in StepCounter(llo, lambda frames: tiles).count().items():
            part = "write" if any("_write_cache_" in f for f in frames) else "attend"
            parts.setdefault(part, dict.fromkeys(GROUPS, 0.0))[group] += n
        return parts

    one, two = counted(1), counted(2)
    pairs = kernel.BATCH * kvh
    per_tile = {g: (two["attend"][g] - one["attend"][g]) / pairs for g in GROUPS}
    return {
        "tile": per_tile,
        "pair": {g: one["attend"][g] / pairs - per_tile[g] for g in GROUPS},
        "write": {g: one["write"][g] / pairs / caches for g in GROUPS},
    }


def print_attend_ops() -> None:
    """Per shipped attention geometry, row count and KV tile: the ops per tile, per pair
    and per cache write, at 8 query rows and per further query row."""
    for spec, topology in ATTENTION_BUILDS:
        kernel, plan = build_kernel(spec, topology, "attend_", "attend ops")
        for a in plan.kernel.attention:
            if not hasattr(kernel, f"_attend_{a.name}"):
                continue  # a recurrent kind
            # Every KV tile the planner chooses from (256 is also the calibrated
            # kernel's); 8 and 24 query rows (24: Kimi K3's MLA at 8 rows on 2x2x4).
            for rows, tile in itertools.product((1, 8), KV_TILE_CHOICES):
                low = attend_counts(kernel, a, rows, 8, tile)
                high = attend_counts(kernel, a, rows, 24, tile)
                entry = []
                for part in ("tile", "pair", "write"):
                    more = {g: (high[part][g] - low[part][g]) / 2 for g in GROUPS}
                    entry += [low[part]] + ([more] if part != "write" else [])
                ops = ", ".join(
                    "(" + ", ".join(f"{e[g]:g}" for g in ("vpu", "mxu", "loads", "stores")) + ")"
                    for e in entry
                )  # fmt: skip
                kind = "mla" if a.values_in_keys else "gqa"
                key = f"{kind}, {a.head_dim}, {a.value_dim}, {a.window is not None}, {rows}"
                print(f"    ({key}, {tile}): ({ops}),".replace(kind, f'"{kind}"', 1))


def vector_vpu_ops(  # noqa: ANN201
    kernel,  # noqa: ANN001
    op,  # noqa: ANN001
    width: int,
    rows: int,
    vector_width: int,
    scratch,  # noqa: ANN001
    name: str,
) -> float:
    """Vector ALU ops of op(x, vectors, *scratch refs) -> [rows, width] on x [rows,
    width] f32 with the layer's vectors slab as the kernel reads it (the slab of
    `layer % 2` loaded in the layer loop, a norm's weight a row of it), per layer."""
    layers = 2

    def body(x_ref, out_ref, vec_ref, *refs):  # noqa: ANN001, ANN202
        def layer_step(layer, carry):  # noqa: ANN001, ANN202
            out_ref[...] = op(x_ref[...], vec_ref[layer % 2], *refs)
            return carry

        jax.lax.fori_loop(0, layers, layer_step, 0)

    slab = ((2, kernel.VECTOR_ROWS, vector_width), jnp.float32)
    counts = compiled_counts(body, (rows, width), (rows, width), [slab, *scratch], name)
    return sum(n for (_frames, group), n in counts.items() if group == "vpu") / layers


def norm_ops(kernel, width: int, rows: int) -> float:  # noqa: ANN001
    """The template's _rms_norm of [rows, width] by a row of the vectors slab."""
    op = lambda x, vec: kernel._rms_norm(x, vec[0:1, :width])  # noqa: E731
    return vector_vpu_ops(kernel, op, width, rows, width, [], f"norm_{width}_{rows}")


def heads_ops(kernel, a, heads: int, rows: int) -> float:  # noqa: ANN001
    """GQA's heads op on `heads` heads of attention kind `a`: each head's q/k norm
    (by a row of the vectors slab, or parameter-free) and RoPE, as
    _attention_<kind> runs them (the new rows' bf16 copies are stores)."""
    d = a.head_dim
    rope = getattr(kernel, f"_rope_{a.name}", None)

    def op(x, vec, *tables):  # noqa: ANN001, ANN202
        out = [x[:, i * d : (i + 1) * d] for i in range(heads)]
        if a.qk_norm != "none":
            weight = vec[2:3, :d] if a.qk_norm == "rms" else jnp.ones((1, d), jnp.float32)
            out = [kernel._rms_norm(t, weight) for t in out]
        if rope is not None:
            cos, sin = (t[...] for t in tables)
            out = [rope(t, cos, sin) for t in out]
        return jnp.concatenate(out, axis=1)

    tables = [((rows, a.rope.half), jnp.float32)] * 2 if rope is not None else []
    name = f"heads_{a.name}_{heads}_{rows}"
    return vector_vpu_ops(kernel, op, heads * d, rows, max(d, 128), tables, name)


def print_vector_ops() -> None:
    """The vector phase's norms (per 128 lanes of width and once, from two widths) and
    GQA's heads op (per head and once, from 2 and 4 heads) of each shipped GQA
    geometry, at 8 and 16 token rows."""
    kernel, _ = rendered("experts=mxfp4", "qwen3-30b-a3b")
    for rows in (8, 16):
        low, high = norm_ops(kernel, 1024, rows), norm_ops(kernel, 2048, rows)
        per_lanes = (high - low) / 8
        print(f"norm rows {rows}: {per_lanes:g} per 128 lanes, {high - 16 * per_lanes:g} once"
              f" (8192 wide: {norm_ops(kernel, 8192, rows):g}, "
              f"linear: {high + 48 * per_lanes:g})")  # fmt: skip
    measured = set()
    for spec, topology in GQA_BUILDS:
        kernel, plan = build_kernel(spec, topology, "vector_", "vector ops")
        for a in plan.kernel.attention:
            if not isinstance(a, GQALayout):
                continue
            half = a.rope.half if a.rope else 0
            key = (a.head_dim, a.qk_norm, half)
            if key in measured:
                continue
            measured.add(key)
            for rows in (8, 16):
                two, four = heads_ops(kernel, a, 2, rows), heads_ops(kernel, a, 4, rows)
                per_head = (four - two) / 2
                print(
                    f'    ({a.head_dim}, "{a.qk_norm}", {half}, {rows}): '
                    f"({per_head:g}, {two - 2 * per_head:g}),  # {spec} {a.name}"
                )


if __name__ == "__main__":
    main()
