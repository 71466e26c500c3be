"""The chip catalog carries hardware.md's facts and names the values the cost model uses."""

import math

import pytest
from pydantic import ValidationError

from mkgen.errors import SpecError
from mkgen.hardware import (
    CATALOG,
    GB,
    GPU_COMPARISON,
    HBM_STREAM_FALLBACK_FRACTION,
    TB,
    KiB,
    MiB,
    get_chip,
    vmem_bytes_per_element,
    vmem_padded_bytes,
    vmem_tile,
)


def test_catalog_has_the_four_generations():
    assert set(CATALOG) == {"v5e", "v5p", "v6e", "tpu7x"}
    for name, chip in CATALOG.items():
        assert chip.name == name
        assert chip.compile_only_prefix == name


def test_tpu7x_memory_matches_hardware_md():
    chip = get_chip("tpu7x")
    assert chip.device_kind == "TPU7x"
    assert chip.cores_per_chip == 2 and chip.devices_per_chip == 2
    assert chip.vmem_bytes_per_core == 64 * MiB
    assert chip.vmem_budget_bytes == 58 * MiB
    assert chip.vmem_limit_bytes == 64 * MiB
    assert chip.smem_bytes_per_core == 1 * MiB
    assert chip.hbm_bytes_per_chip == 192 * 1024**3
    assert chip.hbm_usable_bytes_per_core == 94_700_000_000
    assert chip.hbm_usable_measured


def test_tpu7x_hbm_bandwidth_carries_spec_measured_range_and_cost_model_value():
    chip = get_chip("tpu7x")
    assert chip.hbm_bandwidth_spec_bytes_per_s == 7380 * GB
    assert chip.hbm_bandwidth_spec_bytes_per_s_per_core == pytest.approx(3.69 * TB)
    measured = chip.hbm_stream_bandwidth_measured
    assert measured is not None and measured.measured
    assert (measured.low, measured.high) == (3.0 * TB, 3.2 * TB)
    # measurements.md: "7.02 GB read per core per step = 2.19 ms at 3.2 TB/s".
    assert chip.cost_model_hbm_bandwidth == measured.cost_model == 3.2 * TB
    assert 7.02e9 / chip.cost_model_hbm_bandwidth == pytest.approx(2.19e-3, rel=0.01)


def test_unmeasured_chips_stream_at_the_documented_fraction_of_spec():
    assert math.isclose(HBM_STREAM_FALLBACK_FRACTION, 3.2 / 3.69, rel_tol=1e-3)
    for chip in CATALOG.values():
        if chip.hbm_stream_bandwidth_measured is None:
            expected = chip.hbm_bandwidth_spec_bytes_per_s_per_core * HBM_STREAM_FALLBACK_FRACTION
            assert chip.cost_model_hbm_bandwidth == pytest.approx(expected)
            assert not chip.hbm_usable_measured


def test_tpu7x_compute_has_no_int8_path():
    chip = get_chip("tpu7x")
    assert chip.mxu_shape == (256, 256) and chip.mxus_per_core == 2
    assert chip.mxu_dtypes == ("bf16", "fp8")
    assert chip.peak_flops_per_chip("bf16") == 2307 * TB
    assert chip.peak_flops_per_chip("fp8") == 4614 * TB
    assert chip.peak_flops_per_chip("int8") is None
    assert chip.peak_flops_per_core("bf16") == pytest.approx(2307 * TB / 2)
    with pytest.raises(SpecError, match="int4"):
        chip.peak_flops_per_chip("int4")


def test_every_mxu_dtype_has_a_peak_and_no_other_does():
    for chip in CATALOG.values():
        for dtype in ("bf16", "fp8", "int8"):
            has_peak = chip.peak_flops_per_chip(dtype) is not None
            assert has_peak == (dtype in chip.mxu_dtypes), (chip.name, dtype)


def test_tpu7x_ici_levels_reproduce_the_published_copies():
    chip = get_chip("tpu7x")
    assert [level.name for level in chip.ici_levels] == ["core", "chip", "host"]
    sibling = chip.ici_level("core")
    # Both published sibling points lie on the latency + bytes/bandwidth line.
    assert sibling.transfer_s(256 * KiB) == pytest.approx(256 * KiB / (101 * GB))
    assert sibling.transfer_s(16 * MiB) == pytest.approx(16 * MiB / (610 * GB))
    assert chip.ici_level("chip").bandwidth_bytes_per_s == 134 * GB
    assert sibling.bandwidth_bytes_per_s > 4 * chip.ici_level("chip").bandwidth_bytes_per_s
    assert not chip.ici_level("host").bandwidth_measured
    assert chip.ici_bandwidth_bytes_per_s_per_chip == 1200 * GB


def test_single_device_chips_have_no_core_level():
    for name in ("v5e", "v6e", "v5p"):
        with pytest.raises(SpecError, match="no ICI level 'core'"):
            get_chip(name).ici_level("core")


def test_tpu7x_latencies_and_dispatch():
    chip = get_chip("tpu7x")
    phase = chip.collective_phase_latency
    assert (phase.low, phase.high) == (3.5e-6, 4.7e-6)
    assert phase.low <= phase.cost_model <= phase.high and phase.measured
    assert chip.dispatch_s_per_call == pytest.approx(50e-6)
    assert not get_chip("v6e").collective_phase_latency.measured


def test_slice_geometry():
    chip = get_chip("tpu7x")
    assert chip.torus_dims == 3 and chip.chips_per_host == 4
    assert chip.host_bounds == (2, 2, 1)
    assert (2, 2, 4) in chip.slice_shapes
    assert get_chip("v6e").torus_dims == 2 and get_chip("v5e").torus_dims == 2
    assert get_chip("v5p").torus_dims == 3


def test_device_kind_strings_match_jax():
    kinds = {name: chip.device_kind for name, chip in CATALOG.items()}
    assert kinds == {"v5e": "TPU v5 lite", "v5p": "TPU v5", "v6e": "TPU v6 lite", "tpu7x": "TPU7x"}


def test_compile_only_names():
    chip = get_chip("tpu7x")
    assert chip.compile_only_name((2, 2, 4)) == "tpu7x:2x2x4"
    assert chip.compile_only_name((1, 1, 1)) == "tpu7x=1x1x1"  # as hardware.md spells it
    assert get_chip("v6e").compile_only_name((2, 2)) == "v6e:2x2"


def test_price_is_an_overridable_estimate():
    chip = get_chip("tpu7x")
    assert chip.price_per_chip_hour_usd == 1.21
    cheaper = chip.with_price(0.9)
    assert cheaper.price_per_chip_hour_usd == 0.9
    assert get_chip("tpu7x").price_per_chip_hour_usd == 1.21  # the catalog is untouched
    assert get_chip("v6e").price_per_chip_hour_usd is None
    with pytest.raises(SpecError, match="-1"):
        chip.with_price(-1)


def test_chips_are_frozen():
    with pytest.raises(ValidationError):
        get_chip("tpu7x").vmem_bytes_per_core = 1  # type: ignore[misc]


def test_get_chip_names_the_unknown_and_the_valid():
    with pytest.raises(SpecError) as err:
        get_chip("v7")
    message = str(err.value)
    assert "'v7'" in message
    for name in CATALOG:
        assert name in message


@pytest.mark.parametrize(
    ("bits", "tile", "per_element"),
    [(32, (8, 128), 4), (16, (16, 128), 2), (8, (32, 128), 1), (4, (32, 128), 1)],
)
def test_vmem_tile(bits, tile, per_element):
    assert vmem_tile(bits) == tile
    assert vmem_bytes_per_element(bits) == per_element
    # Every tile is one 4 KiB vreg-sized block.
    assert tile[0] * tile[1] * per_element == 4 * KiB


@pytest.mark.parametrize("bits", [1, 2, 64, 0])
def test_vmem_tile_rejects_unsupported_widths(bits):
    with pytest.raises(SpecError, match=f"{bits} bits"):
        vmem_tile(bits)


@pytest.mark.parametrize(
    ("shape", "bits", "expected"),
    [
        ((8, 128), 32, 8 * 128 * 4),
        ((1, 128), 32, 8 * 128 * 4),  # one row still takes a full (8,128) tile
        ((1, 128), 16, 16 * 128 * 2),
        ((3, 1, 7168), 8, 3 * 32 * 7168),
        ((2, 100, 200), 16, 2 * 112 * 256 * 2),
        ((7168, 512), 4, 7168 * 512),  # int4: one byte per element
        ((100,), 32, 128 * 4),
        ((600,), 8, 1024),
    ],
)
def test_vmem_padded_bytes(shape, bits, expected):
    assert vmem_padded_bytes(shape, bits) == expected


def test_gpu_comparison_rows():
    rows = {row.name: row for row in GPU_COMPARISON}
    assert {"B200", "GB200", "B300", "GB300"} <= set(rows)
    assert rows["B200"].hbm_bandwidth_bytes_per_s == 8 * TB
    assert rows["GB200"].dense_fp8_flops == (5000 * TB, 5000 * TB)
    assert rows["GB300"].price_per_chip_hour_usd == 2.31
    for row in rows.values():
        if row.hbm_bytes is not None:
            assert row.hbm_bytes[0] <= row.hbm_bytes[1]
