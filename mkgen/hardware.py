"""The chip catalog: what each TPU generation offers a decode megakernel.

mkgen plans without a TPU attached (``pltpu.get_tpu_info()`` needs libtpu and a
device), so every hardware number the planner, the cost model and the reports
use comes from here. Two kinds of number live side by side:

- *spec* values, as Google publishes them (peak FLOP/s, HBM bandwidth, ICI);
- *measured* values from hand-written TPU7x megakernels (Inferact
  ``tpu-megakernels``), which is what a kernel really gets.

Where sources disagree the catalog carries every figure and names the one the
cost model uses (``cost_model_*`` fields, ``MeasuredRange.cost_model``) with
the reason beside it. Where a chip has no measurement the catalog says so
(``measured=False``) and derives a documented fallback from the TPU7x ratio of
measured to spec, rather than pretending to know.

Facts and their sources: Google Cloud TPU pages for v5e, v5p, v6e and tpu7x, and the
measurements of Inferact ``tpu-megakernels``; per-core VMEM/SMEM/MXU figures agree with
``jax/_src/tpu_info.py`` (jax 0.12).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator

from mkgen.errors import SpecError

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
GB = 10**9
TB = 10**12
US = 1e-6

IciLevelName = Literal["core", "chip", "host"]
"""Where two devices sit relative to each other: sibling core on one chip,
another chip on the same host, or a chip on another host of the slice."""

ICI_LEVEL_NAMES: tuple[IciLevelName, ...] = ("core", "chip", "host")

MxuDtype = Literal["bf16", "fp8", "int8"]

# Physical limit: Mosaic keeps this much VMEM for its own spills and internal
# scratch. The Inferact kernels keep explicit VMEM at or under 58 of 64 MiB;
# we apply the same reserve to every chip (only TPU7x is measured).
VMEM_SPILL_RESERVE_BYTES = 6 * MiB
# Measured: of the vmem_limit_bytes a kernel passes, Mosaic (libtpu as pinned) keeps 64 KiB
# for itself. Under a 64 MiB limit a kernel of 64 MiB - 72 KiB compiles and one of 64 MiB -
# 52 KiB is refused: "Used 63.95M of 63.94M vmem" (tests/test_tpu_compile.py). The plan
# holds its total (explicit buffers + the estimate of Mosaic's scratch) to the limit less this.
MOSAIC_RESERVED_VMEM_BYTES = 64 * KiB


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class MeasuredRange(_Frozen):
    """A quantity public sources give as a range, plus the one value the cost model uses.

    Carrying both ends keeps the disagreement visible in reports; ``cost_model``
    is the single number the planner computes with, and ``why`` says why.
    """

    low: float
    high: float
    cost_model: float
    measured: bool
    why: str
    source: str

    @model_validator(mode="after")
    def _cost_model_in_range(self) -> MeasuredRange:
        if not self.low <= self.cost_model <= self.high:
            raise ValueError(
                f"cost_model {self.cost_model} outside the range [{self.low}, {self.high}]"
            )
        return self


class IciLevel(_Frozen):
    """One level of the interconnect as the cost model sees it.

    A transfer of ``n`` bytes between two devices at this level costs
    ``latency_s + n / bandwidth_bytes_per_s``; bandwidth is per core, one
    direction. ``source`` says where each number came from or how it was derived.
    """

    name: IciLevelName
    latency_s: float
    bandwidth_bytes_per_s: float
    latency_measured: bool
    bandwidth_measured: bool
    source: str
    # (low, high) bytes/s where sources disagree or the figure is assumed: the ends of the
    # plan's sensitivity table (mkgen/plan/confidence.py); `source` names them.
    bandwidth_range: tuple[float, float] | None = None

    def transfer_s(self, nbytes: int | float) -> float:
        """Seconds to move ``nbytes`` one way between two devices at this level."""
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s


class Chip(_Frozen):
    """One TPU generation. Numbers are per TensorCore unless the name says per chip."""

    # --- identity ---
    name: str  # catalog key, also the topology-string prefix ("tpu7x:2x2x4")
    display_name: str
    device_kind: str  # jax.Device.device_kind on real hardware
    compile_only_prefix: str  # libtpu compile-only topology name prefix ("tpu7x:2x2x1")
    # Shapes whose compile-only name is spelled differently from "<prefix>:<shape>".
    # (shape string, name) pairs; kept as written in hardware.md, not verified.
    compile_only_name_overrides: tuple[tuple[str, str], ...] = ()

    # --- cores and devices ---
    cores_per_chip: int  # physical TensorCores
    # JAX devices per chip. Differs from cores_per_chip on megacore chips (v5p), where
    # JAX fuses both TensorCores into one device by default.
    devices_per_chip: int

    # --- memory (bytes) ---
    vmem_bytes_per_core: int
    vmem_budget_bytes: int  # explicit VMEM the planner may allocate (capacity - spill reserve)
    vmem_limit_bytes: int  # vmem_limit_bytes passed to Mosaic
    smem_bytes_per_core: int
    hbm_bytes_per_chip: int
    hbm_usable_bytes_per_core: int  # what a kernel can really place per core
    hbm_usable_measured: bool  # False: derived as per-chip / cores, no runtime overhead known

    # --- HBM bandwidth (bytes/s) ---
    hbm_bandwidth_spec_bytes_per_s: float  # per chip, Google's spec
    hbm_stream_bandwidth_measured: MeasuredRange | None  # per core, HBM -> VMEM streaming
    # Per core: the HBM -> VMEM rate the cost model streams weights at. The measured
    # value where one exists, else spec per core x HBM_STREAM_FALLBACK_FRACTION.
    cost_model_hbm_bandwidth: float

    # --- compute ---
    mxu_shape: tuple[int, int]
    mxus_per_core: int
    peak_bf16_flops_per_chip: float
    peak_fp8_flops_per_chip: float | None  # None: no fp8 MXU rate
    peak_int8_ops_per_chip: float | None  # None: no int8 MXU path
    mxu_dtypes: tuple[MxuDtype, ...]  # dtypes with a published MXU rate on this chip

    # --- interconnect ---
    ici_bandwidth_bytes_per_s_per_chip: float  # bidirectional, Google's spec
    ici_ports: int | None
    ici_levels: tuple[IciLevel, ...]
    # One latency-bound in-kernel collective phase (all-reduce / all-gather step) at
    # batch 1: barrier + remote DMA + semaphore wait, independent of the payload.
    collective_phase_latency: MeasuredRange
    # Each collective stage whose group spans hosts: one more latency-bound phase on top
    # of the in-host ones (collective_phase_latency covers every stage inside a host).
    cross_host_phase_latency: MeasuredRange
    dispatch_s_per_call: float  # host-side cost of one jitted pallas_call

    # --- slice geometry ---
    torus_dims: int  # 2 or 3: the number of dimensions in a topology string
    chips_per_host: int
    host_bounds: tuple[int, ...]  # chips per host along (x, y[, z])
    pod_chips: int  # largest slice
    # Slices known to exist (hardware.md / Google Cloud docs), listed verbatim.
    slice_shapes: tuple[tuple[int, ...], ...]
    # 3-D chips: larger slices are AxBxC with A <= B <= C, each a multiple of this
    # (the v4/v5p cube rule). None: only slice_shapes are accepted.
    large_slice_multiple: int | None

    # --- money ---
    # Analyst TCO estimate per chip-hour (not a list price); None where hardware.md
    # gives none. Override with with_price().
    price_per_chip_hour_usd: float | None

    notes: tuple[str, ...] = ()  # hazards a kernel author must know
    sources: str

    @model_validator(mode="after")
    def _consistent(self) -> Chip:
        if self.cores_per_chip % self.devices_per_chip:
            raise ValueError(
                f"{self.name}: cores_per_chip {self.cores_per_chip} not a multiple of "
                f"devices_per_chip {self.devices_per_chip}"
            )
        if len(self.host_bounds) != self.torus_dims:
            raise ValueError(
                f"{self.name}: host_bounds {self.host_bounds} is not {self.torus_dims}-D"
            )
        if not self.vmem_budget_bytes <= self.vmem_usable_bytes < self.vmem_limit_bytes:
            raise ValueError(f"{self.name}: need vmem_budget <= vmem_limit - Mosaic's reserve")
        if self.vmem_limit_bytes > self.vmem_bytes_per_core:
            raise ValueError(f"{self.name}: need vmem_limit <= VMEM capacity")
        names = [level.name for level in self.ici_levels]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.name}: duplicate ICI levels {names}")
        return self

    # --- derived values ---
    @property
    def vmem_usable_bytes(self) -> int:
        """What a kernel's VMEM (explicit buffers and Mosaic's scratch) may total: the limit
        passed to Mosaic less the part Mosaic keeps for itself."""
        return self.vmem_limit_bytes - MOSAIC_RESERVED_VMEM_BYTES

    @property
    def cores_per_device(self) -> int:
        """TensorCores behind one JAX device (2 on a megacore v5p, else 1)."""
        return self.cores_per_chip // self.devices_per_chip

    @property
    def hbm_bandwidth_spec_bytes_per_s_per_core(self) -> float:
        """Spec HBM bandwidth per TensorCore: the chip figure split evenly."""
        return self.hbm_bandwidth_spec_bytes_per_s / self.cores_per_chip

    def peak_flops_per_chip(self, dtype: str) -> float | None:
        """Peak MXU rate for ``dtype`` ("bf16", "fp8", "int8"); None if the chip has no such path."""
        table = {
            "bf16": self.peak_bf16_flops_per_chip,
            "fp8": self.peak_fp8_flops_per_chip,
            "int8": self.peak_int8_ops_per_chip,
        }
        if dtype not in table:
            raise SpecError(f"MXU dtype {dtype!r}: unknown; use one of {', '.join(table)}")
        return table[dtype]

    def peak_flops_per_core(self, dtype: str) -> float | None:
        """Per-TensorCore share of the chip peak (the planner works per core)."""
        peak = self.peak_flops_per_chip(dtype)
        return None if peak is None else peak / self.cores_per_chip

    def ici_level(self, name: IciLevelName) -> IciLevel:
        """The interconnect level ``name``; chips with one device per chip have no "core" level."""
        for level in self.ici_levels:
            if level.name == name:
                return level
        have = ", ".join(level.name for level in self.ici_levels)
        raise SpecError(f"chip {self.name}: no ICI level {name!r}; it has {have}")

    def compile_only_name(self, shape: tuple[int, ...]) -> str:
        """libtpu compile-only topology name for a slice of this chip."""
        dims = "x".join(str(d) for d in shape)
        return dict(self.compile_only_name_overrides).get(
            dims, f"{self.compile_only_prefix}:{dims}"
        )

    def with_price(self, usd_per_chip_hour: float | None) -> Chip:
        """A copy with another chip-hour price: prices are estimates and change."""
        if usd_per_chip_hour is not None and usd_per_chip_hour <= 0:
            raise SpecError(f"chip-hour price {usd_per_chip_hour}: must be positive")
        return self.model_copy(update={"price_per_chip_hour_usd": usd_per_chip_hour})


# ---------------------------------------------------------------------------
# VMEM tiling (Mosaic): every VMEM buffer's two minor dims are padded to the
# native tile. Rules for TPU7x from hardware.md; earlier generations use the
# same (8, 128) 32-bit tile, so the same function is a safe upper bound there.
# ---------------------------------------------------------------------------

LANES = 128


def vmem_bytes_per_element(dtype_bits: int) -> int:
    """Bytes one element occupies in VMEM. int4 is not packed: one byte per element."""
    match dtype_bits:
        case 32:
            return 4
        case 16:
            return 2
        case 8 | 4:
            return 1
        case _:
            raise SpecError(f"dtype of {dtype_bits} bits: VMEM holds 32, 16, 8 or 4-bit data")


def vmem_tile(dtype_bits: int) -> tuple[int, int]:
    """Native (sublanes, lanes) tile Mosaic pads the two minor dims of a VMEM buffer to.

    (8,128) for 32-bit, (16,128) for bf16, (32,128) for 8-bit; int4 is held as one
    byte per element in VMEM, so it takes the 8-bit tile.
    """
    return (32 // vmem_bytes_per_element(dtype_bits), LANES)


def vmem_padded_bytes(shape: tuple[int, ...], dtype_bits: int) -> int:
    """Bytes a VMEM buffer of ``shape`` really takes after tile padding.

    Leading dims multiply; the two minor dims round up to ``vmem_tile``. A 1-D
    buffer rounds up to one lane row of packed 32-bit words (512 bytes), as
    ``jax._src.tpu_info.infer_tiling`` does for 1-D shapes.
    """
    if not shape or any(d < 0 for d in shape):
        raise SpecError(f"VMEM buffer shape {shape}: need at least one non-negative dim")
    per = vmem_bytes_per_element(dtype_bits)
    if len(shape) == 1:
        chunk = LANES * 4 // per  # elements per 512-byte lane row
        return -(-shape[0] // chunk) * chunk * per
    sub, lanes = vmem_tile(dtype_bits)
    *lead, rows, cols = shape
    n = 1
    for d in lead:
        n *= d
    return n * (-(-rows // sub) * sub) * (-(-cols // lanes) * lanes) * per


# ---------------------------------------------------------------------------
# TPU7x measurements, and the fallbacks derived from them for other chips.
# ---------------------------------------------------------------------------

_TPU7X_HBM_SPEC_PER_CHIP = 7380 * GB

_TPU7X_HBM_STREAM = MeasuredRange(
    low=3.0 * TB,
    high=3.2 * TB,
    # The HBM floor in measurements.md is defined at 3.2 TB/s ("7.02 GB per core =
    # 2.19 ms at 3.2 TB/s"); using the same rate keeps our floor comparable with the
    # published one. 3.0 TB/s is the rate the dense-weight stream reached inside the
    # kernel (76 MiB in 25 us), i.e. an achieved figure, not the ceiling.
    cost_model=3.2 * TB,
    measured=True,
    why="measurements.md defines the HBM floor at 3.2 TB/s; 3.0 TB/s is the dense "
    "stream achieved inside the Muse Spark kernel",
    source="Inferact tpu-megakernels README and musespark/README.md (TPU7x, per core); "
    "spec is 3.69 TB/s per core (7.38 TB/s per chip)",
)

# Tuning fallback for chips without a streaming measurement: the fraction of spec
# per-core bandwidth that TPU7x streams at (3.2 / 3.69 = 0.867).
HBM_STREAM_FALLBACK_FRACTION = _TPU7X_HBM_STREAM.cost_model / (_TPU7X_HBM_SPEC_PER_CHIP / 2)

# Sibling-core remote VMEM copy: 101 GB/s at 256 KiB (2.6 us) and 610 GB/s at 16 MiB.
# A latency + bytes/bandwidth line through both points reproduces both exactly.
_SIB_SMALL_BYTES, _SIB_SMALL_BW = 256 * KiB, 101 * GB
_SIB_LARGE_BYTES, _SIB_LARGE_BW = 16 * MiB, 610 * GB
_SIB_SMALL_S = _SIB_SMALL_BYTES / _SIB_SMALL_BW
_SIB_LARGE_S = _SIB_LARGE_BYTES / _SIB_LARGE_BW
_SIB_BW = (_SIB_LARGE_BYTES - _SIB_SMALL_BYTES) / (_SIB_LARGE_S - _SIB_SMALL_S)  # ~663 GB/s
_SIB_LATENCY_S = _SIB_SMALL_S - _SIB_SMALL_BYTES / _SIB_BW  # ~2.2 us

# Cross-chip: three links in parallel, ~134 GB/s per core per direction (Inferact,
# in-kernel remote DMA). Google's all-gather microbenchmark reaches ~179 GB/s on
# 2x2x1 and 2x2x2, but that is an XLA collective over both cores; the cost model
# uses the in-kernel figure since our collectives are in-kernel remote DMAs.
_TPU7X_CHIP_BW = 134 * GB
_TPU7X_LINK_BW = 45 * GB  # one of the three links
_TPU7X_XLA_ALL_GATHER_BW = 179 * GB
_TPU7X_ICI_SPEC_PER_CHIP = 1200 * GB

# Tuning fallback for chips without an ICI measurement: the fraction of the spec
# one-direction per-core ICI bandwidth that TPU7x reaches (134 / 300 = 0.447).
ICI_FALLBACK_FRACTION = _TPU7X_CHIP_BW / (_TPU7X_ICI_SPEC_PER_CHIP / 2 / 2)

_TPU7X_ICI_LEVELS = (
    IciLevel(
        name="core",
        latency_s=_SIB_LATENCY_S,
        bandwidth_bytes_per_s=_SIB_BW,
        latency_measured=True,
        bandwidth_measured=True,
        source="fit of latency + bytes/bandwidth through Inferact's sibling-core remote "
        "VMEM copies: 101 GB/s at 256 KiB (2.6 us) and 610 GB/s at 16 MiB; about 10x "
        "faster than a cross-chip copy",
    ),
    IciLevel(
        name="chip",
        latency_s=_SIB_LATENCY_S,
        bandwidth_bytes_per_s=_TPU7X_CHIP_BW,
        latency_measured=False,
        bandwidth_measured=True,
        source="bandwidth: Inferact, each cross-chip link ~45 GB/s per core per direction, "
        "three links in parallel ~134 GB/s (Google all-gather microbench ~179 GB/s, not "
        "used: XLA collective, not an in-kernel DMA). Latency: not published per copy; "
        "assumed equal to the sibling fit (DMA issue + semaphore dominate)",
    ),
    IciLevel(
        name="host",
        latency_s=_SIB_LATENCY_S,
        bandwidth_bytes_per_s=_TPU7X_CHIP_BW,
        latency_measured=False,
        bandwidth_measured=False,
        source="not measured: hosts of one slice are joined by the same ICI torus, so "
        "assumed equal to the chip level (extra hops not modelled); range: one cross-chip "
        "link (Inferact, ~45 GB/s per core per direction) to Google's all-gather "
        "microbenchmark (~179 GB/s on 2x2x1 and 2x2x2)",
        bandwidth_range=(_TPU7X_LINK_BW, _TPU7X_XLA_ALL_GATHER_BW),
    ),
)

_TPU7X_COLLECTIVE_PHASE = MeasuredRange(
    low=3.5 * US,
    high=4.7 * US,
    # measurements.md breaks down ~14 us of collectives per layer over 4 phases,
    # i.e. 3.5 us each on average, the low end of the quoted range.
    cost_model=3.5 * US,
    measured=True,
    why="the per-layer breakdown gives ~14 us for 4 phases = 3.5 us per phase",
    source="Inferact musespark/README.md: latency-bound in-kernel collective phase at "
    "batch 1, 8 cores on one host, 3.5 to 4.7 us",
)

# No published measurement crosses hosts: every in-kernel collective of measurements.md
# runs on the 8 cores of one host. Assumed equal to the in-host phase (the catalog's
# host-level ICI latency and bandwidth are likewise assumed equal to the chip level's).
# The range is stated, not measured: from the in-host phase to twice it (a round across
# hosts adds hops and a host boundary); the plan's sensitivity table walks both ends.
_TPU7X_CROSS_HOST_PHASE = _TPU7X_COLLECTIVE_PHASE.model_copy(
    update={
        "high": 7.0 * US,
        "measured": False,
        "why": "no cross-host collective is measured; the in-host phase (3.5 us, "
        "measured on one host of 8 cores) is reused for each cross-host round",
        "source": "assumption, from Inferact musespark/README.md's in-host phase "
        "(3.5 to 4.7 us); no multi-host measurement is published; range 3.5 to 7 us "
        "stated (the in-host phase to twice it)",
    }
)

# Host side, measured on TPU7x; assumed the same on other chips (it is host work).
_DISPATCH_S = 50 * US


def _estimated_ici_levels(
    chip: str, spec_bidir_per_chip: float, devices_per_chip: int
) -> tuple[IciLevel, ...]:
    """ICI levels for a chip with no measurement: TPU7x ratios applied to its spec."""
    bw = spec_bidir_per_chip / 2 / devices_per_chip * ICI_FALLBACK_FRACTION
    why = (
        f"estimate for {chip}: spec ICI per device per direction x ICI_FALLBACK_FRACTION "
        f"({ICI_FALLBACK_FRACTION:.3f}, TPU7x measured / spec); latency from the TPU7x "
        "sibling-copy fit"
    )
    return tuple(
        IciLevel(
            name=name,
            latency_s=_SIB_LATENCY_S,
            bandwidth_bytes_per_s=bw,
            latency_measured=False,
            bandwidth_measured=False,
            source=why,
        )
        for name in ("chip", "host")
    )


def _unmeasured_collective_phase(chip: str) -> MeasuredRange:
    return _TPU7X_COLLECTIVE_PHASE.model_copy(
        update={
            "measured": False,
            "why": f"not measured on {chip}: TPU7x figure reused",
        }
    )


def _fallback_stream_bw(spec_per_chip: float, cores: int) -> float:
    return spec_per_chip / cores * HBM_STREAM_FALLBACK_FRACTION


_SOURCES_COMMON = (
    "Google Cloud TPU pages for v5e, v5p, v6e, tpu7x; "
    "jax/_src/tpu_info.py (per-TensorCore table behind pltpu.get_tpu_info())"
)

# 2-D slices Google sells for v5e / v6e (v5litepod-1 .. -256, v6e-1 .. -256).
_LITE_SLICES: tuple[tuple[int, ...], ...] = (
    (1, 1),
    (2, 2),
    (2, 4),
    (4, 4),
    (4, 8),
    (8, 8),
    (8, 16),
    (16, 16),
)

_V5E = Chip(
    name="v5e",
    display_name="TPU v5e",
    device_kind="TPU v5 lite",
    compile_only_prefix="v5e",
    cores_per_chip=1,
    devices_per_chip=1,
    vmem_bytes_per_core=128 * MiB,
    vmem_budget_bytes=128 * MiB - VMEM_SPILL_RESERVE_BYTES,
    vmem_limit_bytes=128 * MiB,
    smem_bytes_per_core=1 * MiB,
    # hardware.md says "16 GB"; Google's page and tpu_info.py (17.2e9) mean 16 GiB.
    hbm_bytes_per_chip=16 * GiB,
    hbm_usable_bytes_per_core=16 * GiB,
    hbm_usable_measured=False,
    hbm_bandwidth_spec_bytes_per_s=819 * GB,
    hbm_stream_bandwidth_measured=None,
    cost_model_hbm_bandwidth=_fallback_stream_bw(819 * GB, 1),
    mxu_shape=(128, 128),
    mxus_per_core=4,
    peak_bf16_flops_per_chip=197 * TB,
    peak_fp8_flops_per_chip=None,
    peak_int8_ops_per_chip=394 * TB,
    mxu_dtypes=("bf16", "int8"),
    ici_bandwidth_bytes_per_s_per_chip=400 * GB,
    ici_ports=4,
    ici_levels=_estimated_ici_levels("v5e", 400 * GB, 1),
    collective_phase_latency=_unmeasured_collective_phase("v5e"),
    cross_host_phase_latency=_unmeasured_collective_phase("v5e"),
    dispatch_s_per_call=_DISPATCH_S,
    torus_dims=2,
    chips_per_host=8,  # 4 on some VMs
    host_bounds=(2, 4),
    pod_chips=256,
    slice_shapes=_LITE_SLICES,
    large_slice_multiple=None,
    price_per_chip_hour_usd=None,
    sources=_SOURCES_COMMON + ". HBM streaming, ICI levels and collective latency are "
    "estimates derived from TPU7x, not measured on v5e.",
)

_V5P = Chip(
    name="v5p",
    display_name="TPU v5p",
    device_kind="TPU v5",
    compile_only_prefix="v5p",
    cores_per_chip=2,
    # hardware.md lists 2 JAX devices per chip, but v5p supports megacore
    # (tpu_info.py ChipVersion.supports_megacore) and JAX shows one device per chip
    # by default (a v5p-8 = 2x2x1 has 4 devices). Flagged for review.
    devices_per_chip=1,
    vmem_bytes_per_core=64 * MiB,
    vmem_budget_bytes=64 * MiB - VMEM_SPILL_RESERVE_BYTES,
    vmem_limit_bytes=64 * MiB,
    smem_bytes_per_core=1 * MiB,
    hbm_bytes_per_chip=95 * GiB,
    hbm_usable_bytes_per_core=95 * GiB // 2,
    hbm_usable_measured=False,
    hbm_bandwidth_spec_bytes_per_s=2765 * GB,
    hbm_stream_bandwidth_measured=None,
    cost_model_hbm_bandwidth=_fallback_stream_bw(2765 * GB, 2),
    mxu_shape=(128, 128),
    mxus_per_core=4,
    peak_bf16_flops_per_chip=459 * TB,
    peak_fp8_flops_per_chip=None,
    peak_int8_ops_per_chip=918 * TB,
    mxu_dtypes=("bf16", "int8"),
    ici_bandwidth_bytes_per_s_per_chip=1200 * GB,
    ici_ports=None,
    ici_levels=_estimated_ici_levels("v5p", 1200 * GB, 1),
    collective_phase_latency=_unmeasured_collective_phase("v5p"),
    cross_host_phase_latency=_unmeasured_collective_phase("v5p"),
    dispatch_s_per_call=_DISPATCH_S,
    torus_dims=3,
    chips_per_host=4,
    host_bounds=(2, 2, 1),
    pod_chips=8960,
    slice_shapes=((2, 2, 1), (2, 2, 2), (2, 2, 4), (2, 4, 4)),
    large_slice_multiple=4,
    price_per_chip_hour_usd=None,
    sources=_SOURCES_COMMON + ". HBM streaming, ICI levels and collective latency are "
    "estimates derived from TPU7x, not measured on v5p.",
)

_V6E = Chip(
    name="v6e",
    display_name="TPU v6e (Trillium)",
    device_kind="TPU v6 lite",
    compile_only_prefix="v6e",
    cores_per_chip=1,
    devices_per_chip=1,
    vmem_bytes_per_core=128 * MiB,
    vmem_budget_bytes=128 * MiB - VMEM_SPILL_RESERVE_BYTES,
    vmem_limit_bytes=128 * MiB,
    smem_bytes_per_core=1 * MiB,
    # hardware.md says "32 GB"; Google's page and tpu_info.py (34.4e9) mean 32 GiB.
    hbm_bytes_per_chip=32 * GiB,
    hbm_usable_bytes_per_core=32 * GiB,
    hbm_usable_measured=False,
    hbm_bandwidth_spec_bytes_per_s=1638 * GB,
    hbm_stream_bandwidth_measured=None,
    cost_model_hbm_bandwidth=_fallback_stream_bw(1638 * GB, 1),
    mxu_shape=(256, 256),
    mxus_per_core=2,
    peak_bf16_flops_per_chip=918 * TB,
    peak_fp8_flops_per_chip=918 * TB,
    peak_int8_ops_per_chip=1836 * TB,
    mxu_dtypes=("bf16", "fp8", "int8"),
    ici_bandwidth_bytes_per_s_per_chip=800 * GB,
    ici_ports=4,
    ici_levels=_estimated_ici_levels("v6e", 800 * GB, 1),
    collective_phase_latency=_unmeasured_collective_phase("v6e"),
    cross_host_phase_latency=_unmeasured_collective_phase("v6e"),
    dispatch_s_per_call=_DISPATCH_S,
    torus_dims=2,
    chips_per_host=8,  # 4 on some VMs
    host_bounds=(2, 4),
    pod_chips=256,
    slice_shapes=_LITE_SLICES,
    large_slice_multiple=None,
    price_per_chip_hour_usd=None,
    sources=_SOURCES_COMMON + ". HBM streaming, ICI levels and collective latency are "
    "estimates derived from TPU7x, not measured on v6e.",
)

_TPU7X = Chip(
    name="tpu7x",
    display_name="TPU7x (Ironwood)",
    device_kind="TPU7x",
    compile_only_prefix="tpu7x",
    # hardware.md: '"tpu7x=1x1x1" is one chip'. Stored as written, not verified
    # against libtpu; if get_topology_desc rejects it, "tpu7x:1x1x1" is the guess.
    compile_only_name_overrides=(("1x1x1", "tpu7x=1x1x1"),),
    cores_per_chip=2,
    devices_per_chip=2,  # devices 2k and 2k+1 are the two TensorCores of chip k
    vmem_bytes_per_core=64 * MiB,
    vmem_budget_bytes=58 * MiB,  # Inferact kernels stay at or under 58 MiB explicit
    vmem_limit_bytes=64 * MiB,
    smem_bytes_per_core=1 * MiB,
    hbm_bytes_per_chip=192 * GiB,
    # Measured: what a kernel can allocate per TensorCore (192 GiB / 2 = 103 GB before
    # runtime reservations).
    hbm_usable_bytes_per_core=94_700_000_000,
    hbm_usable_measured=True,
    hbm_bandwidth_spec_bytes_per_s=_TPU7X_HBM_SPEC_PER_CHIP,
    hbm_stream_bandwidth_measured=_TPU7X_HBM_STREAM,
    cost_model_hbm_bandwidth=_TPU7X_HBM_STREAM.cost_model,
    mxu_shape=(256, 256),
    mxus_per_core=2,
    peak_bf16_flops_per_chip=2307 * TB,
    peak_fp8_flops_per_chip=4614 * TB,
    peak_int8_ops_per_chip=None,  # no int8/int4 MXU path: feed them as bf16 or fp8
    mxu_dtypes=("bf16", "fp8"),
    ici_bandwidth_bytes_per_s_per_chip=_TPU7X_ICI_SPEC_PER_CHIP,
    ici_ports=None,
    ici_levels=_TPU7X_ICI_LEVELS,
    collective_phase_latency=_TPU7X_COLLECTIVE_PHASE,
    cross_host_phase_latency=_TPU7X_CROSS_HOST_PHASE,
    dispatch_s_per_call=_DISPATCH_S,
    torus_dims=3,
    chips_per_host=4,
    host_bounds=(2, 2, 1),  # process bounds for 2x2x4 are 1,1,4; chips per process 2,2,1
    pod_chips=9216,
    slice_shapes=((1, 1, 1), (2, 2, 1), (2, 2, 2), (2, 2, 4), (2, 4, 4), (4, 4, 4), (4, 4, 8)),
    large_slice_multiple=4,  # assumed by analogy with v5p (Google: TPU7x is v5p-like)
    price_per_chip_hour_usd=1.21,
    notes=(
        "no int8/int4 MXU path: dequantize int8/int4 weights to bf16 or fp8 before the MXU",
        "unsigned integer vector ops were reported to crash the core: unpack nibbles with "
        "signed types or on the host",
        "tpu-inference caps some TPU7x kernels at 48 MiB of VMEM",
    ),
    sources=_SOURCES_COMMON + "; measured figures (HBM streaming 3.0-3.2 TB/s per core, "
    "usable HBM 94.7 GB per core, ICI levels, collective phase 3.5-4.7 us, dispatch "
    "~50 us, VMEM 58 of 64 MiB) from Inferact tpu-megakernels README and "
    "musespark/README.md. Price: analyst TCO estimate $1.21 per chip-hour.",
)

CATALOG: dict[str, Chip] = {chip.name: chip for chip in (_V5E, _V5P, _V6E, _TPU7X)}

DEFAULT_CHIP = "tpu7x"


def get_chip(name: str) -> Chip:
    """The catalog entry for ``name``; a SpecError naming the valid chips otherwise."""
    try:
        return CATALOG[name]
    except KeyError:
        raise SpecError(f"chip {name!r}: unknown; use one of {', '.join(CATALOG)}") from None


# ---------------------------------------------------------------------------
# Issue rates of one TensorCore, for the static profile (`mkgen compile --profile`).
# ---------------------------------------------------------------------------


class IssueRates(_Frozen):
    """Ops one TensorCore issues per cycle, by kind (the profile's bound times)."""

    clock_hz: float
    vpu_ops_per_cycle: float  # vector ALU ops, one (8, 128) vreg each
    mxu_ops_per_cycle: float  # MXU pushes, latches and pops over all MXUs
    vector_loads_per_cycle: float
    vector_stores_per_cycle: float
    # Scalar ALU and SMEM ops (the expert listing's loops), and the (low, high) rate the
    # sensitivity table walks, with why.
    scalar_ops_per_cycle: float
    scalar_range: tuple[float, float]
    scalar_source: str
    # (low, high) clocks the public figures allow, and why: the ends of the plan's
    # sensitivity table (mkgen/plan/confidence.py).
    clock_range_hz: tuple[float, float]
    clock_source: str

    def at_clock(self, clock_hz: float) -> IssueRates:
        """These rates at another clock, with the MXU ops a cycle that keep the MXUs' peak
        (the catalog's peak FLOP/s is published; the clock and the MXU count are not)."""
        return self.model_copy(
            update={
                "clock_hz": clock_hz,
                "mxu_ops_per_cycle": self.mxu_ops_per_cycle * self.clock_hz / clock_hz,
            }
        )


def _derived_clock_hz(chip: Chip) -> float:
    """The clock at which the catalog's MXUs reach its peak bf16 rate: every MXU does
    rows x columns multiply-adds (2 flops) a cycle."""
    rows, columns = chip.mxu_shape
    per_cycle = chip.cores_per_chip * chip.mxus_per_core * 2 * rows * columns
    return chip.peak_bf16_flops_per_chip / per_cycle


TPU7X_ISSUE_RATES = IssueRates(
    # Google publishes no TPU7x clock. Derived from the catalog (2,307 TFLOP/s bf16 per
    # chip over 2 cores x 2 MXUs of 256 x 256): 4.4 GHz, which would be high for a TPU;
    # with 4 MXUs a core (as some third-party diagrams draw) it is 2.2 GHz. An assumption
    # either way: the bound times scale with it.
    clock_hz=_derived_clock_hz(_TPU7X),
    # Assumptions, no public TPU7x figure: 4 vector ALU slots in a VLIW bundle, each MXU
    # takes one op a cycle, one vector load slot and one store slot a bundle.
    vpu_ops_per_cycle=4,
    mxu_ops_per_cycle=_TPU7X.mxus_per_core,
    vector_loads_per_cycle=1,
    vector_stores_per_cycle=1,
    # Assumption: two scalar slots a VLIW bundle, as Google describes the TPUv2/v3 core's
    # bundle (Jouppi et al., "A Domain-Specific Supercomputer for Training Deep Neural
    # Networks", CACM 2020), each op (SMEM loads and stores too) in one slot without a
    # stall; a loop of dependent SMEM loads may issue one a cycle or fewer.
    scalar_ops_per_cycle=2,
    scalar_range=(1, 2),
    scalar_source="assumption: two scalar slots a VLIW bundle (Jouppi et al., CACM 2020, "
    "for TPUv2/v3), every op one slot; one a cycle if the listing's dependent SMEM loads "
    "stall every other slot",
    clock_range_hz=(_derived_clock_hz(_TPU7X) / 2, _derived_clock_hz(_TPU7X)),
    clock_source="no public TPU7x clock: 4.4 GHz if a core has 2 MXUs of 256 x 256 (the "
    "catalog's peak bf16 rate), 2.2 GHz with 4 MXUs a core, as some third-party diagrams "
    "draw them",
)
# Chips whose issue rates the catalog states (as assumptions): the plan's compute
# timeline exists for these only.
ISSUE_RATES = {_TPU7X.name: TPU7X_ISSUE_RATES}


# ---------------------------------------------------------------------------
# GPU comparison rows: for reports only, never planned for.
# ---------------------------------------------------------------------------


class GpuRow(_Frozen):
    """A GPU to compare tokens/s and tokens/$ against. Ranges carry both ends."""

    name: str
    hbm_bytes: tuple[float, float] | None  # (low, high)
    hbm_bandwidth_bytes_per_s: float | None
    dense_bf16_flops: tuple[float, float] | None  # (low, high)
    dense_fp8_flops: tuple[float, float] | None
    price_per_chip_hour_usd: float | None  # analyst TCO estimate


_B300_FAMILY = dict(
    hbm_bytes=(270 * GB, 288 * GB),
    hbm_bandwidth_bytes_per_s=8 * TB,
    dense_bf16_flops=(2250 * TB, 2500 * TB),
    dense_fp8_flops=(4500 * TB, 5000 * TB),
)

GPU_COMPARISON: tuple[GpuRow, ...] = (
    GpuRow(
        name="B200",
        hbm_bytes=(180 * GB, 192 * GB),
        hbm_bandwidth_bytes_per_s=8 * TB,
        dense_bf16_flops=(2250 * TB, 2250 * TB),
        dense_fp8_flops=(4500 * TB, 4500 * TB),
        price_per_chip_hour_usd=1.73,
    ),
    GpuRow(
        name="GB200",
        hbm_bytes=(186 * GB, 192 * GB),
        hbm_bandwidth_bytes_per_s=8 * TB,
        dense_bf16_flops=(2500 * TB, 2500 * TB),
        dense_fp8_flops=(5000 * TB, 5000 * TB),
        price_per_chip_hour_usd=1.86,
    ),
    GpuRow(name="B300", price_per_chip_hour_usd=2.26, **_B300_FAMILY),
    GpuRow(name="GB300", price_per_chip_hour_usd=2.31, **_B300_FAMILY),
    # hardware.md gives only a price for MI355X.
    GpuRow(
        name="MI355X",
        hbm_bytes=None,
        hbm_bandwidth_bytes_per_s=None,
        dense_bf16_flops=None,
        dense_fp8_flops=None,
        price_per_chip_hour_usd=1.50,
    ),
)
