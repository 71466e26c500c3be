"""Topology strings ("2x2x4", "tpu7x:2x2x4", "v6e:2x2") -> a validated Topology.

A Topology is the hardware half of a build: which chip, how many, and where
every JAX device sits (chip, core on the chip, host). The planner reads device
placement from here to make collectives topology aware (sibling core, then
chip, then host), and the verifier reads ``compile_only_name`` to ask libtpu
for a compile-only device set of the same shape.

Which shapes are accepted (a decision, so that a typo fails here rather than
deep inside libtpu):

- every slice listed for the chip in the catalog (``Chip.slice_shapes``: for
  TPU7x 1x1x1, 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, 4x4x8);
- on 3-D chips (v5p, TPU7x) also larger slices AxBxC with A <= B <= C, every
  dim a multiple of 4, up to the pod size: the v4/v5p cube rule, which TPU7x
  is assumed to follow;
- nothing else. Powers of two alone are not enough: 1x2x2 or 8x2x2 are not
  slices Google sells.

Device order follows libtpu's compile-only topology: chips x fastest, then y,
then z; the cores of one chip are adjacent (devices 2k and 2k+1 are chip k on
TPU7x). Hosts are blocks of ``Chip.host_bounds`` chips (2x2x1 on TPU7x, so each
z-plane of a 2x2x4 is one host), numbered in the same x-fastest order.
"""

from __future__ import annotations

import math
import re
from functools import cached_property

from pydantic import BaseModel, ConfigDict, model_validator

from mkgen.errors import SpecError
from mkgen.hardware import CATALOG, DEFAULT_CHIP, Chip, IciLevel, IciLevelName, get_chip

_AXES = ("x", "y", "z")


class Device(BaseModel):
    """Where one JAX device sits in the slice."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    index: int  # JAX device id in the compile-only topology
    chip_index: int  # chips numbered x fastest, then y, then z
    core_on_chip: int  # 0 .. devices_per_chip - 1
    chip_coords: tuple[int, ...]  # (x, y) or (x, y, z)
    host: int  # process index: blocks of host_bounds chips


def _dims(shape: tuple[int, ...]) -> str:
    return "x".join(str(d) for d in shape)


def _example_shape(chip: Chip) -> str:
    # The 2-host TPU7x slice is the project default; otherwise the first multi-chip slice.
    if chip.name == DEFAULT_CHIP:
        return "2x2x4"
    return _dims(next(s for s in chip.slice_shapes if math.prod(s) > 1))


def _supported_text(chip: Chip) -> str:
    text = ", ".join(_dims(s) for s in chip.slice_shapes)
    if chip.large_slice_multiple:
        m = chip.large_slice_multiple
        text += (
            f", or a larger AxBxC with A<=B<=C, each a multiple of {m}, "
            f"at most {chip.pod_chips} chips"
        )
    return text


def check_shape(chip: Chip, shape: tuple[int, ...], text: str) -> None:
    """Raise a SpecError naming ``text`` unless ``shape`` is a slice of ``chip``.

    Separate from parsing so that a Topology loaded from a saved plan is checked
    by the same rules as one parsed from the command line.
    """
    where = f"topology {text!r}"
    if len(shape) != chip.torus_dims:
        raise SpecError(
            f"{where}: {chip.display_name} has a {chip.torus_dims}-D torus, so it needs "
            f"{chip.torus_dims} dimensions like {chip.name}:{_example_shape(chip)}, "
            f"got {len(shape)}"
        )
    for axis, d in zip(_AXES, shape, strict=False):
        if d < 1:
            raise SpecError(f"{where}: dimension {axis}={d} must be a positive integer")
    if shape in chip.slice_shapes:
        return
    m = chip.large_slice_multiple
    if m is not None and min(shape) >= m:
        bad = [f"{axis}={d}" for axis, d in zip(_AXES, shape, strict=False) if d % m]
        if bad:
            raise SpecError(
                f"{where}: dimension {', '.join(bad)} is not a multiple of {m}; "
                f"use one of {_supported_text(chip)}"
            )
        if list(shape) != sorted(shape):
            raise SpecError(
                f"{where}: large slices are written smallest dimension first; "
                f"use {chip.name}:{_dims(tuple(sorted(shape)))}"
            )
        if math.prod(shape) > chip.pod_chips:
            raise SpecError(
                f"{where}: {math.prod(shape)} chips exceed a {chip.display_name} pod "
                f"({chip.pod_chips} chips)"
            )
        return
    raise SpecError(
        f"{where}: {_dims(shape)} is not a supported {chip.display_name} slice; "
        f"use one of {_supported_text(chip)}"
    )


class Topology(BaseModel):
    """A slice of one chip type: the chip's catalog name and the chip grid shape."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    chip: str
    shape: tuple[int, ...]  # chips along (x, y[, z])

    @model_validator(mode="after")
    def _valid_slice(self) -> Topology:
        # SpecError is not a ValueError, so pydantic lets it through unwrapped.
        check_shape(get_chip(self.chip), self.shape, f"{self.chip}:{_dims(self.shape)}")
        return self

    # --- sizes ---
    @property
    def chip_info(self) -> Chip:
        """The catalog entry for this topology's chip."""
        return get_chip(self.chip)

    @property
    def num_chips(self) -> int:
        return math.prod(self.shape)

    @property
    def devices_per_chip(self) -> int:
        return self.chip_info.devices_per_chip

    @property
    def num_devices(self) -> int:
        """JAX devices: chips x devices per chip (= TensorCores on TPU7x)."""
        return self.num_chips * self.devices_per_chip

    @property
    def host_block(self) -> tuple[int, ...]:
        """Chips per host along each axis (host bounds clipped to the slice)."""
        return tuple(min(b, d) for b, d in zip(self.chip_info.host_bounds, self.shape, strict=True))

    @property
    def host_grid(self) -> tuple[int, ...]:
        """Hosts along each axis (the process bounds, e.g. (1, 1, 4) for TPU7x 2x2x4)."""
        return tuple(d // b for d, b in zip(self.shape, self.host_block, strict=True))

    @property
    def num_hosts(self) -> int:
        return math.prod(self.host_grid)

    @property
    def chips_per_host(self) -> int:
        return math.prod(self.host_block)

    # --- names ---
    @property
    def shape_name(self) -> str:
        return _dims(self.shape)

    @property
    def name(self) -> str:
        """Canonical spelling, e.g. "tpu7x:2x2x4"; parse_topology(name) gives this topology back."""
        return f"{self.chip}:{self.shape_name}"

    @property
    def compile_only_name(self) -> str:
        """Name for ``jax.experimental.topologies.get_topology_desc(name, platform="tpu")``.

        Usually the canonical name; TPU7x 1x1x1 is spelled "tpu7x=1x1x1" as hardware.md
        states (unverified, see ``Chip.compile_only_name_overrides``).
        """
        return self.chip_info.compile_only_name(self.shape)

    # --- devices ---
    @cached_property
    def devices(self) -> tuple[Device, ...]:
        """Every device in JAX id order: sibling cores adjacent, chips x fastest."""
        block = self.host_block
        grid = self.host_grid
        out: list[Device] = []
        for chip_index in range(self.num_chips):
            coords = self._chip_coords(chip_index)
            host_coords = tuple(c // b for c, b in zip(coords, block, strict=True))
            host = 0
            for hc, g in zip(reversed(host_coords), reversed(grid), strict=True):
                host = host * g + hc
            for core in range(self.devices_per_chip):
                out.append(
                    Device(
                        index=len(out),
                        chip_index=chip_index,
                        core_on_chip=core,
                        chip_coords=coords,
                        host=host,
                    )
                )
        return tuple(out)

    def _chip_coords(self, chip_index: int) -> tuple[int, ...]:
        coords = []
        for d in self.shape:
            coords.append(chip_index % d)
            chip_index //= d
        return tuple(coords)

    def _device(self, d: int | Device) -> Device:
        index = d.index if isinstance(d, Device) else d
        if not 0 <= index < self.num_devices:
            raise ValueError(f"device {index} not in {self.name} (0..{self.num_devices - 1})")
        return self.devices[index]

    def level_between(self, a: int | Device, b: int | Device) -> IciLevelName:
        """How two distinct devices are connected: "core" (same chip), "chip" (same host), "host".

        Collectives are planned level by level (sibling core first, then chips of a host,
        then hosts), so the cost of a transfer depends on this answer.
        """
        da, db = self._device(a), self._device(b)
        if da.index == db.index:
            raise ValueError(f"device {da.index} to itself is not an interconnect transfer")
        if da.chip_index == db.chip_index:
            return "core"
        if da.host == db.host:
            return "chip"
        return "host"

    def link_between(self, a: int | Device, b: int | Device) -> IciLevel:
        """The catalog's ICI level (latency, bandwidth) for a transfer from ``a`` to ``b``."""
        return self.chip_info.ici_level(self.level_between(a, b))

    # --- meshes ---
    @property
    def mesh_shape(self) -> tuple[int]:
        """1-D JAX mesh over all devices in id order: the tensor-parallel axis."""
        return (self.num_devices,)

    @property
    def structured_mesh_shape(self) -> tuple[int, ...]:
        """The device list reshaped C-order by physical axis: (z, y, x, core) or (y, x, core)."""
        return (*reversed(self.shape), self.devices_per_chip)

    @property
    def structured_axis_names(self) -> tuple[str, ...]:
        """Axis names matching ``structured_mesh_shape``."""
        return (*reversed(_AXES[: len(self.shape)]), "core")

    def describe(self) -> str:
        """One line for logs and reports."""
        chip = self.chip_info
        return (
            f"{self.name}: {self.num_chips} {chip.display_name} chip"
            f"{'s' if self.num_chips != 1 else ''} x {self.devices_per_chip} device"
            f"{'s' if self.devices_per_chip != 1 else ''} = {self.num_devices} devices on "
            f"{self.num_hosts} host{'s' if self.num_hosts != 1 else ''} "
            f"({self.chips_per_host} chip{'s' if self.chips_per_host != 1 else ''} each), "
            f"{chip.torus_dims}-D torus"
        )


_DIM_RE = re.compile(r"[0-9]+")


def parse_topology(text: str) -> Topology:
    """Parse "[chip:]AxB[xC]" into a Topology; the chip defaults to TPU7x.

    Every error is a one-line SpecError that quotes the input and says what to write.
    """
    if not isinstance(text, str) or not text.strip():
        raise SpecError(f"topology {text!r}: empty; write [chip:]shape like tpu7x:2x2x4 or v6e:2x2")
    raw = text.strip()
    where = f"topology {text!r}"
    parts = raw.split(":")
    if len(parts) > 2:
        raise SpecError(f"{where}: more than one ':'; write [chip:]shape like tpu7x:2x2x4")
    chip_name, shape_text = (DEFAULT_CHIP, parts[0]) if len(parts) == 1 else parts
    chip_name = chip_name.strip().lower()
    if chip_name not in CATALOG:
        raise SpecError(f"{where}: unknown chip {chip_name!r}; use one of {', '.join(CATALOG)}")
    chip = CATALOG[chip_name]
    fields = shape_text.strip().lower().split("x")
    for field in fields:
        if not _DIM_RE.fullmatch(field.strip()):
            raise SpecError(
                f"{where}: dimension {field.strip()!r} is not a positive integer; "
                f"write the shape like {chip.name}:{_example_shape(chip)}"
            )
        # Python parses at most 4300 digits; a pod's chip count has a handful.
        if len(field.strip()) > len(str(chip.pod_chips)):
            raise SpecError(
                f"{where}: a dimension of {len(field.strip())} digits exceeds a "
                f"{chip.display_name} pod ({chip.pod_chips} chips)"
            )
    shape = tuple(int(field) for field in fields)
    check_shape(chip, shape, text)
    return Topology(chip=chip.name, shape=shape)
