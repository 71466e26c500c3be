"""Weight formats: quantize / dequantize round trips, the packer's layout, the plan's bytes."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from mkgen.errors import SpecError
from mkgen.kinds import default_registry
from mkgen.plan import plan_build
from mkgen.plan.options import BuildOptions
from mkgen.plan.stream import CHUNK, LANES, make_segment
from mkgen.reference import model as reference
from mkgen.spec.loader import load_spec
from mkgen.spec.quant import parse_format
from mkgen.spec.topology import parse_topology
from mkgen.weights import pack
from mkgen.weights.quantize import (
    E2M1_VALUES,
    as_bf16_rows,
    dequantize,
    e2m1_codes,
    e2m1_values,
    fake_quantize,
    nvfp4_quantize,
    pack_nibble_pairs,
    pack_nibbles,
    pack_nvfp4_chunks,
    quantize,
)

SPECS = Path(__file__).parent / "specs"
FORMATS = ["int4:32", "int8", "fp8:128", "fp8:32", "mxfp4", "nvfp4"]


def _weights(shape, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape).astype(np.float32) * 0.05
    w[..., 3, :] *= 40.0  # outliers: blocks with very different scales
    return w.astype(ml_dtypes.bfloat16).astype(np.float32)


@pytest.mark.parametrize("text", FORMATS)
def test_values_on_the_grid_quantize_exactly(text: str) -> None:
    fmt = parse_format(text)
    w = _weights((2, 512, 384))
    once = dequantize(*quantize(w, fmt), fmt)
    again = dequantize(*quantize(once, fmt), fmt)
    np.testing.assert_array_equal(again, once)
    assert np.abs(once - w).max() <= 0.25 * np.abs(w).max()  # and close to the weights


@pytest.mark.parametrize("text", ["int8", "fp8:128", "mxfp4", "nvfp4"])
def test_a_cores_slice_requantizes_to_the_same_values(text: str) -> None:
    """Power-of-two scales: the packer may re-quantize one core's rows / columns (whole
    blocks of the tensor) and gets exactly what the reference was fed."""
    fmt = parse_format(text)
    once = dequantize(*quantize(_weights((1024, 512)), fmt), fmt)
    for piece in (once[256:512], once[:, 128:256], once[512:768, 256:]):
        np.testing.assert_array_equal(dequantize(*quantize(piece, fmt), fmt), piece)


@pytest.mark.parametrize("text", ["int8", "fp8:128", "mxfp4", "nvfp4"])
def test_dequantized_values_are_exact_in_bf16(text: str) -> None:
    fmt = parse_format(text)
    once = dequantize(*quantize(_weights((512, 256)), fmt), fmt)
    as_bf16 = once.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(as_bf16, once)


def test_e2m1_codes_and_values_agree() -> None:
    codes = np.arange(16, dtype=np.int8)
    values = e2m1_values(codes)
    np.testing.assert_array_equal(values[:8], E2M1_VALUES)
    np.testing.assert_array_equal(values[9:], -E2M1_VALUES[1:])
    nonzero = codes % 8 != 0  # -0 (code 8) is written as code 0
    np.testing.assert_array_equal(e2m1_codes(values)[nonzero], codes[nonzero])
    # ml_dtypes' e2m1 encoding is the same.
    as_ml = values.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    np.testing.assert_array_equal(as_ml[nonzero], codes[nonzero].astype(np.uint8))


def test_mxfp4_scales_are_e8m0_bytes() -> None:
    w = np.zeros((64, 256), np.float32)
    w[:32, 0] = 6.0 * 2.0**-5  # the largest code times 2^-5
    codes, scales = quantize(w, parse_format("mxfp4"))
    assert scales.dtype == np.int8 and scales.shape == (2, 256)
    assert int(scales.view(np.uint8)[0, 0]) == 127 - 5
    assert int(codes[0, 0]) == 7  # e2m1 code of 6.0


def test_nvfp4_scales_are_e4m3_blocks_over_a_power_of_two() -> None:
    w = _weights((64, 256))
    codes, block, tensor = nvfp4_quantize(w)
    assert block.dtype == ml_dtypes.float8_e4m3fn and block.shape == (4, 256)
    assert tensor.shape == (1, 1) and np.log2(tensor[0, 0]) == np.rint(np.log2(tensor[0, 0]))
    largest = np.abs(block.astype(np.float32)).max()
    assert 224 < largest <= 448  # the smallest power of two that keeps them in e4m3
    # Every block's largest value gets the largest code (6.0 is code 7).
    assert ((codes.reshape(4, 16, 256) & 7).max(axis=1) == 7).all()


def test_nvfp4_chunks_carry_their_tensor_scale_as_e8m0_bytes() -> None:
    chunks = _weights((2, CHUNK, LANES))
    chunks[1] *= 2.0**-10
    _, _, tensor = nvfp4_quantize(chunks)
    packed, block, tensor_bytes = pack_nvfp4_chunks(chunks)
    assert packed.shape == (2, CHUNK // 2, LANES) and block.shape == (2, CHUNK // 16, LANES)
    assert tensor_bytes.shape == (2, 1, LANES)
    exponent = tensor_bytes.view(np.uint8).astype(int) - 127
    np.testing.assert_array_equal(np.exp2(exponent), np.broadcast_to(tensor, (2, 1, LANES)))
    assert exponent[0, 0, 0] - exponent[1, 0, 0] == 10


def test_e2m1_codes_placed_as_e4m3_bits_are_e2m1_times_2_to_the_minus_6() -> None:
    """The kernel's conversion (_e2m1_as_e4m3): sign bit 3 to bit 7, magnitude bits 2-0
    to bits 4-2, for every code, subnormal 0.5 and both zeros included."""
    n = np.arange(16)
    bits = ((n & 8) << 4) | ((n & 7) << 2)
    as_e4m3 = bits.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(as_e4m3, e2m1_values(n) * 2.0**-6)
    np.testing.assert_array_equal(np.signbit(as_e4m3), n >= 8)


def test_the_kernels_e2m1_conversion_reads_every_byte_exactly() -> None:
    """The template's _e2m1_as_e4m3 in TPU interpret mode on all 256 bytes (both nibbles
    of each, in the packer's rows r and r + CHUNK / 2)."""
    from jax.experimental import pallas as pl

    from mkgen.codegen.build import load_module, render_kernel

    spec = load_spec(str(SPECS / "formats-mxfp4.yaml"))
    layout = plan_build(
        spec, parse_topology("2x2x1"), BuildOptions.create(), kinds=default_registry()
    ).kernel
    kernel = load_module(render_kernel(layout, "e2m1 test"), "e2m1_test")
    lane = np.broadcast_to(np.arange(LANES), (CHUNK // 2, LANES))
    codes = np.concatenate([lane % 16, lane // 16])  # byte r, lane c: low c % 16, high c // 16
    packed = pack_nibbles(codes[None])[0]

    def body(packed_ref, out_ref):
        out_ref[...] = kernel._e2m1_as_e4m3(packed_ref[...]).astype(jnp.float32)

    out = pl.pallas_call(
        body,
        out_shape=jax.ShapeDtypeStruct((CHUNK, LANES), jnp.float32),
        interpret=pltpu.InterpretParams(),
    )(jnp.asarray(packed))
    np.testing.assert_array_equal(np.asarray(out), e2m1_values(codes) * 2.0**-6)
    assert set(np.unique(packed.view(np.uint8))) == set(range(256))


def test_int4_nibbles_pack_rows_2a_and_2a_plus_1_as_mosaic_bitcasts_them() -> None:
    codes = np.random.default_rng(1).integers(-8, 8, (2, CHUNK, LANES)).astype(np.int8)
    packed = pack_nibble_pairs(codes)
    assert packed.shape == (2, CHUNK // 2, LANES)
    unpacked = jax.jit(lambda x: pltpu.bitcast(x, jnp.int4).astype(jnp.int8))(packed[0])
    np.testing.assert_array_equal(np.asarray(unpacked), codes[0])


def test_nibbles_pack_rows_r_and_r_plus_half() -> None:
    codes = np.random.default_rng(1).integers(0, 16, (2, CHUNK, LANES)).astype(np.int8)
    packed = pack_nibbles(codes).view(np.uint8)
    assert packed.shape == (2, CHUNK // 2, LANES)
    np.testing.assert_array_equal(packed & 15, codes[:, : CHUNK // 2])
    np.testing.assert_array_equal(packed >> 4, codes[:, CHUNK // 2 :])


@pytest.mark.parametrize("dtype", [np.int8, ml_dtypes.float8_e4m3fn, np.float32])
def test_bf16_rows_are_what_the_kernels_bitcast_reads(dtype) -> None:
    rng = np.random.default_rng(2)
    data = (rng.standard_normal((64, 256)) * 20).astype(np.float32)
    data = np.clip(data, -127, 127).astype(dtype)
    rows = as_bf16_rows(data)
    assert rows.dtype == ml_dtypes.bfloat16
    back = jax.jit(lambda x: pltpu.bitcast(x, jnp.dtype(dtype)))(jnp.asarray(rows))
    np.testing.assert_array_equal(
        np.asarray(back).view(np.uint8), np.ascontiguousarray(data).view(np.uint8)
    )


# ---------------------------------------------------------------- the weight stream


def test_an_int8_bank_holds_codes_then_scales() -> None:
    seg = make_segment("x", [], 600, 300, 0, 512, "int8")
    # 3 chunks of 128 code rows + 3 x 2 scale rows (one f32 row a chunk), tile-padded.
    assert (seg.chunks_per_bank, seg.code_rows, seg.scale_rows, seg.scale_row) == (3, 128, 2, 384)
    w = dequantize(*quantize(_weights((600, 300)), parse_format("int8")), parse_format("int8"))
    banks = pack.segment_rows(seg, w, 512).view(np.uint16).reshape(-1, 512, LANES)
    assert banks.shape == (2, 512, LANES) and seg.rows == 2 * 512  # 3 x 2 chunks
    for c in range(seg.k_chunks * seg.col_blocks):
        bank, j = divmod(c, seg.chunks_per_bank)
        kc, cb = c % seg.k_chunks, c // seg.k_chunks
        codes = _unpack_rows(banks[bank, j * 128 : (j + 1) * 128], np.int8)
        scale = _unpack_rows(banks[bank, 384 + 2 * j : 386 + 2 * j], np.float32)
        expect = np.zeros((CHUNK, LANES), np.float32)
        block = w[kc * CHUNK : (kc + 1) * CHUNK, cb * LANES : (cb + 1) * LANES]
        expect[: block.shape[0], : block.shape[1]] = block
        np.testing.assert_array_equal(codes.astype(np.float32) * scale, expect)


def test_an_fp8_bank_holds_block_scales_per_chunk() -> None:
    fmt = parse_format("fp8:32")
    seg = make_segment("x", [], 512, 256, 0, 512, "fp8:32")
    assert (seg.chunks_per_bank, seg.scale_rows, seg.scale_row) == (3, 16, 384)
    w = dequantize(*quantize(_weights((512, 256)), fmt), fmt)
    banks = pack.segment_rows(seg, w, 512).view(np.uint16).reshape(-1, 512, LANES)
    for c in range(2):
        codes = _unpack_rows(banks[0, c * 128 : (c + 1) * 128], ml_dtypes.float8_e4m3fn)
        scales = _unpack_rows(banks[0, 384 + 16 * c : 400 + 16 * c], np.float32)  # [8, 256]
        full = np.repeat(scales, 32, axis=0)
        np.testing.assert_array_equal(codes.astype(np.float32) * full, w[c * 256 : (c + 1) * 256])


def _unpack_rows(rows: np.ndarray, dtype) -> np.ndarray:
    """bf16 rows (as uint16) -> the 8- or 32-bit rows they hold (as_bf16_rows inverted)."""
    words = rows.astype(np.uint16)
    if np.dtype(dtype).itemsize == 1:
        out = np.empty((2 * rows.shape[0], rows.shape[1]), np.uint8)
        out[0::2], out[1::2] = words & 0xFF, words >> 8
        return out.view(dtype)
    return (words[0::2].astype(np.uint32) | (words[1::2].astype(np.uint32) << 16)).view(dtype)


def test_quantized_segments_stream_fewer_banks() -> None:
    topo = parse_topology("2x2x1")
    plain = plan_build(
        load_spec("qwen3-32b"), topo, BuildOptions.create(), kinds=default_registry()
    ).kernel
    int8 = plan_build(
        load_spec("qwen3-32b"),
        topo,
        BuildOptions.create(quant=["dense=int8"]),
        kinds=default_registry(),
    ).kernel
    (name,) = int8.stream.ffn
    seg = int8.stream.ffn[name].segment("gate_up")
    assert seg.format == "int8" and seg.chunks_per_bank == 31  # 31 x 128 + 64 <= 4096
    assert int8.stream.total_banks < 0.6 * plain.stream.total_banks
    assert plain.stream.ffn[name].segment("gate_up").chunks_per_bank == 16


def test_tensors_in_different_formats_are_not_fused() -> None:
    spec = load_spec(str(SPECS / "formats-fp8.yaml"))
    layout = plan_build(
        spec, parse_topology("2x2x1"), BuildOptions.create(), kinds=default_registry()
    ).kernel
    moe = next(f for f in layout.ffn if f.type == "moe")
    in_segments = [s for s in moe.segments if s.name.startswith("in")]
    assert [(s.name, s.format) for s in in_segments] == [("in", "bf16"), ("in.1", "fp8:128")]
    assert [p.tensor for p in in_segments[0].parts] == ["ffn.router"]
    # Columns of the "in" outputs run on across the two segments.
    assert moe.columns["shared_gate"].start == moe.columns["router"].size


@pytest.mark.parametrize(
    ("quant", "what"),
    [
        (["experts=int4:512"], "routed experts in int4:512"),
        (["attention=int4:128"], "dense weights (attn.wq, attn.wk, attn.wv) in int4:128"),
        (["mlp=mxfp4"], "in mxfp4"),
    ],
)
def test_formats_not_generated_are_one_line_errors(quant: list[str], what: str) -> None:
    spec = load_spec(str(SPECS / "formats-mxfp4.yaml"))
    if quant[0].startswith("mlp"):
        spec = load_spec(str(SPECS / "formats-int8.yaml"))
    with pytest.raises(SpecError, match="is not supported by the code generator yet") as info:
        plan_build(
            spec,
            parse_topology("2x2x1"),
            BuildOptions.create(quant=quant),
            kinds=default_registry(),
        )
    assert what in str(info.value) and "\n" not in str(info.value)


def test_fake_quantize_covers_every_quantized_family() -> None:
    from mkgen.spec.mini import mini_twin

    spec = mini_twin(load_spec(str(SPECS / "formats-fp8.yaml")), 8)
    weights = {k: np.asarray(v) for k, v in reference.init_weights(spec, 0).items()}
    fake = fake_quantize(spec, weights)
    changed = {k for k in weights if not np.array_equal(fake[k], weights[k])}
    assert "layers.0.attn.wq" in changed and "layers.1.ffn.experts_up" in changed
    assert "layers.1.ffn.shared_down" in changed and "layers.0.ffn.w_down" in changed
    assert "layers.1.ffn.router" not in changed and "lm_head" not in changed
