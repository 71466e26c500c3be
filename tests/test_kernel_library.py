"""The kernel's runtime library (mkgen/kernellib) on its own: how the template includes it,
and what verify cannot see of it (tie order, each format's product against numpy, the
ring's unit order and slots, stream chunks across banks), kernels in TPU interpret mode."""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mkgen import kernellib
from mkgen.codegen import digest, library
from mkgen.codegen.render import TEMPLATES
from mkgen.errors import MkgenError
from mkgen.kernellib import collectives, products, residual, ring, routing
from mkgen.kernellib.constants import (
    CHUNK,
    LANES,
    MAX_SNAPSHOTS,
    RESIDUAL_LOGITS_ROW,
    TOKENS_PADDED,
)
from mkgen.kernellib.segment import Segment
from mkgen.plan.options import BuildOptions
from mkgen.plan.stream import make_segment
from mkgen.spec.loader import load_spec
from mkgen.spec.quant import parse_format
from mkgen.spec.topology import parse_topology
from mkgen.weights import pack
from mkgen.weights.quantize import (
    dequantize,
    pack_fp8_chunks,
    pack_int4_chunks,
    pack_int8_chunks,
    pack_mxfp4_chunks,
    pack_nvfp4_chunks,
    quantize,
)

KERNEL_TEMPLATE = "megakernel.py.j2"
INTERPRET = pltpu.InterpretParams()
BF16 = ml_dtypes.bfloat16
LIBRARY = Path(kernellib.__file__).parent


# ---------------------------------------------------------------- including members

SOURCE = '''import jax

# Not attached: a blank line follows.

# The constant's note.
SCALE = 2.0  # trailing


@jax.jit
def twice(x):
    """Docstring kept."""
    return x * SCALE  # kept


class Box:
    # What the method does.
    def open(self):
        return 1
'''


@pytest.mark.parametrize(
    ("member", "text"),
    [
        ("SCALE", "# The constant's note.\nSCALE = 2.0  # trailing"),
        (
            "twice",
            '@jax.jit\ndef twice(x):\n    """Docstring kept."""\n    return x * SCALE  # kept',
        ),
        ("Box.open", "    # What the method does.\n    def open(self):\n        return 1"),
    ],
)
def test_a_member_is_its_lines_from_the_comments_directly_above_it(member: str, text: str) -> None:
    assert library.member_source(SOURCE, "probe", member) == text


@pytest.mark.parametrize(
    ("source", "member", "message"),
    [
        (SOURCE, "thrice", "mkgen/kernellib/probe.py has no member thrice"),
        (SOURCE, "Crate.open", "has no class Crate"),
        ("def f():\n    return '{{ x }}'\n", "f", "f holds Jinja syntax"),
    ],
)
def test_a_member_that_cannot_be_included_is_one_line(
    source: str, member: str, message: str
) -> None:
    with pytest.raises(MkgenError, match=re.escape(message)):
        library.member_source(source, "probe", member)


@pytest.mark.parametrize(
    ("template", "message"),
    [
        (
            '{{ library("ring", "Ring") }} + 1\n',
            'line 1: write a library directive as {{ library("module"',
        ),
        ('    {{ library("ring", "Ring") }}\n', "indent the directive for ring.Ring by 0 spaces"),
        ('{{ library("no_such", "Ring") }}\n', "the kernel library has no module no_such"),
    ],
)
def test_a_misplaced_directive_is_one_line(template: str, message: str) -> None:
    with pytest.raises(MkgenError, match=re.escape(message)):
        library.expand(template, "probe.j2")


def _directives(template: str) -> set[tuple[str, str]]:
    raw = (TEMPLATES / template).read_text()
    return {(m["module"], m["member"]) for m in library.DIRECTIVE.finditer(raw)}


def test_every_library_function_and_class_reaches_the_kernel_template() -> None:
    """Every function and class of the library (constants.py's representative values
    aside) reaches the kernels, whole or method by method; expanded, no directive is left."""
    included = _directives(KERNEL_TEMPLATE)
    for path in sorted(LIBRARY.glob("*.py")):
        if path.stem in ("__init__", "constants"):
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef):
                methods = {
                    f"{node.name}.{n.name}" for n in node.body if isinstance(n, ast.FunctionDef)
                }
                whole = (path.stem, node.name) in included
                assert whole or {(path.stem, m) for m in methods} & included, node.name
    expanded = library.expanded_template(
        (TEMPLATES / KERNEL_TEMPLATE).read_bytes(), KERNEL_TEMPLATE
    )
    assert "library(" not in expanded
    assert library.member_source(library.library_source("ring"), "ring", "Ring") in expanded


def test_the_inputs_hash_covers_the_kernel_library(tmp_path: Path, monkeypatch) -> None:
    spec, topology = load_spec("qwen3-32b"), parse_topology("2x2x1")
    options, args = BuildOptions.create(), {"bank_rows": 4096, "ring_depth": 12}
    before = digest.inputs_digest(spec, topology, options, args)
    copy = tmp_path / "kernellib"
    shutil.copytree(LIBRARY, copy)
    monkeypatch.setattr(library, "LIBRARY", copy)
    assert digest.inputs_digest(spec, topology, options, args) == before
    source = (copy / "ring.py").read_text()
    (copy / "ring.py").write_text(source.replace("self.depth = depth", "self.depth = depth + 0"))
    assert digest.inputs_digest(spec, topology, options, args) != before


def test_a_changed_library_member_is_rendered_as_it_now_is(tmp_path: Path, monkeypatch) -> None:
    """Templates compiled once are kept by their source's checksum (CompiledTemplates in
    mkgen/codegen/render.py): a kernel rendered after a member changed holds the change."""
    from mkgen.codegen.build import render_kernel
    from mkgen.kinds import default_registry
    from mkgen.plan import plan_build

    spec, topology = load_spec("qwen3-32b"), parse_topology("2x2x1")
    layout = plan_build(spec, topology, BuildOptions.create(), kinds=default_registry()).kernel
    assert "self.depth = depth + 0" not in render_kernel(layout, "test")
    copy = tmp_path / "kernellib"
    shutil.copytree(LIBRARY, copy)
    monkeypatch.setattr(library, "LIBRARY", copy)
    source = (copy / "ring.py").read_text()
    (copy / "ring.py").write_text(source.replace("self.depth = depth", "self.depth = depth + 0"))
    assert "self.depth = depth + 0" in render_kernel(layout, "test")


# ---------------------------------------------------------------- routing


def _ties_go_to_the_lowest_index(top_k) -> bool:
    """top_k's choice on scores full of ties against a stable descending sort."""
    scores = np.random.default_rng(0).integers(0, 4, (8, 64)).astype(np.float32)
    ids, best = jax.jit(lambda v: top_k(v, 6))(jnp.asarray(scores))
    expected = np.argsort(-scores, axis=1, kind="stable")[:, :6]
    np.testing.assert_array_equal(np.asarray(best)[:, :6], np.take_along_axis(scores, expected, 1))
    return bool((np.asarray(ids)[:, :6] == expected).all())


def test_top_k_takes_the_lowest_index_on_ties() -> None:
    assert _ties_go_to_the_lowest_index(routing._top_k)


def test_the_tie_check_fails_a_top_k_that_takes_the_highest_index() -> None:
    source = library.member_source(library.library_source("routing"), "routing", "_top_k")
    lowest = "jnp.min(jnp.where(values == top, col, width)"
    assert lowest in source
    namespace = dict(vars(routing))
    exec(source.replace(lowest, "jnp.max(jnp.where(values == top, col, -1)"), namespace)
    assert not _ties_go_to_the_lowest_index(namespace["_top_k"])


# ---------------------------------------------------------------- quantized products

DEPTH, CHUNKS = 2, 2  # slots, and chunks in each


def _flat_chunks() -> np.ndarray:
    """DEPTH * CHUNKS weight chunks [n, CHUNK, LANES], bf16 values, some rows of outliers."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((DEPTH * CHUNKS, CHUNK, LANES)).astype(np.float32) * 0.05
    w[:, 3, :] *= 40.0
    return w.astype(BF16).astype(np.float32)


def _slots(array: np.ndarray) -> np.ndarray:
    """Per-chunk rows [n, r, LANES] -> DEPTH slots of CHUNKS chunks [DEPTH, CHUNKS * r, LANES]."""
    return np.ascontiguousarray(array).reshape(DEPTH, -1, LANES)


def _inline(codes: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, int]:
    """One int8 piece per slot: its code rows, then its scale rows (the mxfp4 / nvfp4
    experts' layout); and the row its scales start at."""
    return np.concatenate([codes, scales.view(np.int8)], axis=1), codes.shape[1]


def _product_case(fmt: str, rows: int):
    """(the product's slot arrays, a maker of the product from their refs, the dequantized
    chunks [n, CHUNK, LANES] it must multiply by)."""
    chunks = _flat_chunks()
    if fmt == "bf16":
        return [_slots(chunks).astype(BF16)], products._bf16_product, chunks
    reference = dequantize(*quantize(chunks, parse_format(fmt)), parse_format(fmt))
    if fmt == "int4:32":
        codes, scales = pack_int4_chunks(chunks, 32)
        arrays = [_slots(codes), _slots(scales).astype(BF16)]
        return arrays, lambda c, s: products._int4_product(c, s, 32, rows), reference
    if fmt == "int8":
        arrays = [_slots(a) for a in pack_int8_chunks(chunks)]
        return arrays, products._int8_product, reference
    if fmt == "fp8:32":
        arrays = [_slots(a) for a in pack_fp8_chunks(chunks, 32)]
        return arrays, lambda c, s: products._fp8_product(c, s, 32, rows), reference
    if fmt == "mxfp4":
        piece, at = _inline(*[_slots(a) for a in pack_mxfp4_chunks(chunks)])
        return [piece], lambda p: products._mxfp4_product(p, at, rows), reference
    codes, block, tensor = (_slots(a) for a in pack_nvfp4_chunks(chunks))
    piece, at = _inline(codes, np.concatenate([block, tensor], axis=1))
    tensor_row = block.shape[1]  # the tensor-scale rows follow the block scales
    return [piece], lambda p: products._nvfp4_product(p, at, tensor_row), reference


def _run_product(arrays: list[np.ndarray], make_product, x: np.ndarray) -> np.ndarray:
    """product(x, slot, j) for every slot and chunk, in a kernel: [DEPTH, CHUNKS, n, LANES]."""

    def body(x_ref, *refs):
        *slot_refs, out_ref = refs
        product = make_product(*slot_refs)
        for slot in range(DEPTH):
            for j in range(CHUNKS):
                out_ref[slot, j] = product(x_ref[...], slot, j)

    out = pl.pallas_call(
        body,
        out_shape=jax.ShapeDtypeStruct((DEPTH, CHUNKS, x.shape[0], LANES), jnp.float32),
        interpret=INTERPRET,
    )(jnp.asarray(x), *[jnp.asarray(a) for a in arrays])
    return np.asarray(out)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("fmt", "rows"),
    [
        ("bf16", TOKENS_PADDED),
        ("int4:32", TOKENS_PADDED),
        ("int4:32", 2 * TOKENS_PADDED),  # another row count builds its group pattern per chunk
        ("int8", TOKENS_PADDED),
        ("fp8:32", TOKENS_PADDED),
        ("mxfp4", TOKENS_PADDED),
        ("nvfp4", TOKENS_PADDED),
    ],
)
def test_each_formats_product_is_x_times_the_dequantized_chunk(fmt: str, rows: int) -> None:
    arrays, make_product, reference = _product_case(fmt, rows)
    x = np.random.default_rng(2).standard_normal((rows, CHUNK)).astype(BF16)
    got = _run_product(arrays, make_product, x)
    expected = np.einsum("rk,nkl->nrl", x.astype(np.float64), reference).reshape(got.shape)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


# ---------------------------------------------------------------- the ring


class _LoggedRing(ring.Ring):
    """A Ring that notes, in kernel order, each unit it starts (q + 1) and waits for -(q + 1)."""

    def __init__(self, log, count, *args):
        super().__init__(*args)
        self.log, self.count = log, count

    def _note(self, code):
        n = self.count[0]
        self.log[n] = code
        self.count[0] = n + 1

    def start(self, q):
        @pl.when(q < self.limit)
        def _():
            self._note(q + 1)

        super().start(q)

    def wait(self, q):
        self._note(-(q + 1))
        super().wait(q)


@pytest.mark.timeout(120)
def test_the_ring_waits_each_unit_once_in_order_and_refills_its_slot_q_mod_depth() -> None:
    depth, k_chunks, col_blocks = 2, 2, 3
    units = k_chunks * col_blocks
    rng = np.random.default_rng(3)
    w = rng.standard_normal((k_chunks * CHUNK, col_blocks * LANES)).astype(BF16).astype(np.float32)
    x = rng.standard_normal((TOKENS_PADDED, k_chunks * CHUNK)).astype(BF16).astype(np.float32)
    segment = Segment(0, k_chunks * CHUNK, col_blocks * LANES, k_chunks, col_blocks)

    def body(units_hbm, x_ref, out_ref, log_ref, slots, sems, xk, acc, count):
        def copies(q):
            return [pltpu.make_async_copy(units_hbm.at[q], slots.at[q % depth], sems.at[q % depth])]

        count[0] = 0
        product = products._bf16_product(slots)
        the_ring = _LoggedRing(log_ref, count, copies, depth, 1, units, product, xk, acc)
        the_ring.prime()
        out_ref[...] = the_ring.matmul(x_ref[...], 0, segment)

    out, log = pl.pallas_call(
        body,
        in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pltpu.VMEM)],
        out_specs=[pl.BlockSpec(memory_space=pltpu.VMEM), pl.BlockSpec(memory_space=pltpu.SMEM)],
        out_shape=[
            jax.ShapeDtypeStruct((TOKENS_PADDED, col_blocks * LANES), jnp.float32),
            jax.ShapeDtypeStruct((2 * units,), jnp.int32),
        ],
        scratch_shapes=[
            pltpu.VMEM((depth, CHUNK, LANES), jnp.bfloat16),
            pltpu.SemaphoreType.DMA((depth,)),
            pltpu.VMEM((k_chunks, TOKENS_PADDED, CHUNK), jnp.bfloat16),
            pltpu.VMEM((col_blocks, TOKENS_PADDED, LANES), jnp.float32),
            pltpu.SMEM((1,), jnp.int32),
        ],
        interpret=INTERPRET,
    )(jnp.asarray(pack.chunked(w, k_chunks, col_blocks), jnp.bfloat16), jnp.asarray(x))
    expected = list(range(1, depth + 1))  # primed
    for q in range(units):  # waited, then its slot refilled with unit q + depth
        expected += [-(q + 1)] + ([q + depth + 1] if q + depth < units else [])
    assert np.asarray(log).tolist() == expected
    np.testing.assert_allclose(np.asarray(out), x @ w, rtol=1e-5, atol=1e-4)


def _stream_segments():
    """Two bf16 segments over three 512-row banks: 208-row chunks (a fan-in of 600 in
    three), then a 44-column block stored transposed (48 rows of fan-in per chunk)."""
    first = make_segment("a", [], 600, 512, 0, ring.BANK_ROWS)
    second = make_segment("b", [], 256, 44, first.rows, ring.BANK_ROWS)
    assert (first.chunk_rows, first.tail_rows, second.tail_rows) == (208, 0, 48)
    return first, second


@pytest.mark.timeout(120)
def test_the_weight_stream_reads_chunks_across_banks_and_through_the_wrap(monkeypatch) -> None:
    """Chunks reach from bank 0 into bank 1 and from bank 1 (slot 1) into bank 2 (slot 0,
    read from the rows after the last slot) in a ring of 2; the stream goes on into the
    next segment's transposed block."""
    plans = _stream_segments()
    banks = -(-(plans[1].offset + plans[1].rows) // ring.BANK_ROWS)
    assert banks == 3 and ring.RING_DEPTH == 2
    monkeypatch.setattr(ring, "TOTAL_BANKS", banks)
    rng = np.random.default_rng(4)
    matrices = [
        rng.standard_normal((p.fan_in, p.fan_out)).astype(BF16).astype(np.float32) for p in plans
    ]
    inputs = [rng.standard_normal((TOKENS_PADDED, p.fan_in)).astype(np.float32) for p in plans]
    stream = np.zeros((banks * ring.BANK_ROWS, LANES), np.uint16)
    for p, matrix in zip(plans, matrices, strict=True):
        stream[p.offset : p.offset + p.rows] = pack.segment_rows(p, matrix, ring.BANK_ROWS)
    segments = [
        Segment(
            p.offset, p.fan_in, p.fan_out, p.k_chunks, p.col_blocks, None, p.chunk_rows, p.tail_rows
        )
        for p in plans
    ]

    def body(stream_hbm, x0, x1, out0, out1, ring_vmem, ring_sems, xk, acc):
        weights = ring.WeightStream(stream_hbm, ring_vmem, ring_sems, xk, acc, {})
        weights.prime()
        out0[...] = weights.matmul(x0[...], 0, segments[0])
        out1[...] = weights.matmul(x1[...], 0, segments[1])

    outs = pl.pallas_call(
        body,
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)] + [pl.BlockSpec(memory_space=pltpu.VMEM)] * 2,
        out_shape=[jax.ShapeDtypeStruct((TOKENS_PADDED, p.fan_out), jnp.float32) for p in plans],
        scratch_shapes=[
            pltpu.VMEM((ring.RING_DEPTH * ring.BANK_ROWS + CHUNK, LANES), jnp.bfloat16),
            pltpu.SemaphoreType.DMA((ring.RING_DEPTH + 1,)),
            pltpu.VMEM((max(p.k_chunks for p in plans), TOKENS_PADDED, CHUNK), jnp.bfloat16),
            pltpu.VMEM((max(p.col_blocks for p in plans), TOKENS_PADDED, LANES), jnp.float32),
        ],
        interpret=INTERPRET,
    )(jnp.asarray(stream.view(BF16).reshape(1, banks, ring.BANK_ROWS, LANES)), *inputs)
    for out, x, matrix in zip(outs, inputs, matrices, strict=True):
        expected = x.astype(BF16).astype(np.float32) @ matrix
        np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------- collectives' wire


def test_the_bf16_wire_carries_values_rounded_to_nearest_even_and_f32_exactly() -> None:
    rng = np.random.default_rng(6)
    value = rng.standard_normal((TOKENS_PADDED, 200)).astype(np.float32)
    value[0, :4] = [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 0.0]  # ties: to even

    def round_trip(wire, lanes):
        words = collectives._to_wire(jnp.asarray(value), wire, lanes)
        return words.shape, np.asarray(collectives._from_wire(words, wire, value.shape[1]))

    shape, bf16 = round_trip("bf16", 128)
    assert shape == (TOKENS_PADDED, 128)  # two columns a 32-bit word
    np.testing.assert_array_equal(bf16, value.astype(BF16).astype(np.float32))
    assert bf16[0, :3].tolist() == [1.0, 1 + 2**-6, -1.0]
    shape, f32 = round_trip("f32", 200)
    assert shape == (TOKENS_PADDED, 200)
    np.testing.assert_array_equal(f32, value)


# ---------------------------------------------------------------- attention residual


@pytest.mark.timeout(120)
@pytest.mark.parametrize("block", [1, 5])  # two live snapshots; all four, the ring wrapped
def test_the_residual_mix_from_hbm_runs_row_block_by_row_block(block: int) -> None:
    """_attention_residual_hbm mixes 24 token rows through a 16-row landing buffer (a whole
    block, then a partial one): the stream and each of its snapshots' rows become the
    softmax mixture of the live snapshots, oldest first, as the reference mixes them."""
    tokens, hidden, landing_rows = 24, 256, 16
    rng = np.random.default_rng(7)
    snapshots = rng.standard_normal((MAX_SNAPSHOTS, tokens, hidden)).astype(np.float32)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    vec = np.zeros((RESIDUAL_LOGITS_ROW + 1, LANES), np.float32)
    vec[RESIDUAL_LOGITS_ROW, :MAX_SNAPSHOTS] = rng.standard_normal(MAX_SNAPSHOTS)

    def body(block_smem, vec_ref, x_ref, snapshots_in, x_out, snapshots_hbm, landing, sem):
        del snapshots_in  # aliased to snapshots_hbm
        x_out[...] = x_ref[...]
        residual._attention_residual_hbm(
            snapshots_hbm, landing, sem, x_out, vec_ref[...], block_smem[0]
        )

    mixed, written = pl.pallas_call(
        body,
        in_specs=[
            pl.BlockSpec(memory_space=pltpu.SMEM),
            pl.BlockSpec(memory_space=pltpu.VMEM),
            pl.BlockSpec(memory_space=pltpu.VMEM),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=[pl.BlockSpec(memory_space=pltpu.VMEM), pl.BlockSpec(memory_space=pl.ANY)],
        out_shape=[
            jax.ShapeDtypeStruct(x.shape, jnp.float32),
            jax.ShapeDtypeStruct(snapshots.shape, jnp.float32),
        ],
        scratch_shapes=[
            pltpu.VMEM((landing_rows, hidden), jnp.float32),
            pltpu.SemaphoreType.DMA((1,)),
        ],
        input_output_aliases={3: 1},
        interpret=INTERPRET,
    )(jnp.asarray([block], jnp.int32), jnp.asarray(vec), jnp.asarray(x), jnp.asarray(snapshots))
    n = min(block + 1, MAX_SNAPSHOTS)
    logits = vec[RESIDUAL_LOGITS_ROW, :n]
    weights = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    sources = [snapshots[(block - n + 1 + j) % MAX_SNAPSHOTS] for j in range(n - 1)] + [x]
    expected = sum(w * s for w, s in zip(weights, sources, strict=True))
    np.testing.assert_allclose(np.asarray(mixed), expected, rtol=1e-5, atol=1e-5)
    written = np.asarray(written)
    np.testing.assert_array_equal(written[block % MAX_SNAPSHOTS], np.asarray(mixed))
    others = [s for s in range(MAX_SNAPSHOTS) if s != block % MAX_SNAPSHOTS]
    np.testing.assert_array_equal(written[others], snapshots[others])
