"""Collective stages planned from the topology, and why the staged sums are deterministic."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from mkgen.plan import plan_build
from mkgen.plan.collectives import (
    arrange_devices,
    flat_sum,
    plan_collectives,
    plan_stages,
    stage_sum,
)
from mkgen.plan.options import BuildOptions
from mkgen.spec.loader import load_spec
from mkgen.spec.topology import parse_topology

# topology -> (group sizes, strides, levels), sibling core first
STAGES = {
    "1x1x1": ([2], [1], ["core"]),
    "2x2x1": ([2, 2, 2], [1, 2, 4], ["core", "chip", "chip"]),
    "2x2x2": ([2, 2, 2, 2], [1, 2, 4, 8], ["core", "chip", "chip", "host"]),
    "2x2x4": ([2, 2, 2, 4], [1, 2, 4, 8], ["core", "chip", "chip", "host"]),
    "2x4x4": ([2, 2, 4, 4], [1, 2, 4, 16], ["core", "chip", "host", "host"]),
    "v6e:2x2": ([2, 2], [1, 2], ["chip", "chip"]),
    "v6e:1x1": ([], [], []),
}


@pytest.mark.parametrize("topology", list(STAGES))
def test_stages_follow_the_device_order(topology: str) -> None:
    topo = parse_topology(topology)
    stages = plan_stages(topo)
    sizes, strides, levels = STAGES[topology]
    assert [s.size for s in stages] == sizes
    assert [s.stride for s in stages] == strides
    assert [s.level for s in stages] == levels
    assert int(np.prod(sizes or [1])) == topo.num_devices
    # Members of a stage-1 group are the two cores of one chip.
    if stages and stages[0].axis == "core":
        for d in range(0, topo.num_devices, 2):
            assert topo.level_between(d, d + 1) == "core"


def test_kimi_k3_slice_sends_6_copies_instead_of_31_into_10_slots() -> None:
    plan = plan_collectives(parse_topology("2x2x4"), [[("attn_out", "all_reduce", 7168)]])
    assert plan.copies == 6 and plan.slots == 10
    assert plan.mesh_order == list(range(32))


def test_buffers_are_as_wide_as_the_widest_piece_a_stage_lands() -> None:
    topo = parse_topology("2x2x4")  # last stage: groups of 4
    uses = [
        [("attn_out", "all_reduce", 7168)],
        [("latent_in", "all_gather", 3584)],
        [("expert_out", "reduce_scatter", 3584)],
    ]
    plan = plan_collectives(topo, uses)
    assert [b.width for b in plan.buffers] == [7168, 896, 896]
    assert [b.send_rows for b in plan.buffers] == [0, 0, 4]


def _staged_all_gather(pieces: list[np.ndarray], stages) -> list[np.ndarray]:
    cur = list(pieces)
    for s in stages:
        nxt = []
        for me in range(len(cur)):
            base = me - ((me // s.stride) % s.size) * s.stride
            nxt.append(np.concatenate([cur[base + j * s.stride] for j in range(s.size)]))
        cur = nxt
    return cur


def _staged_reduce_scatter(partials: list[np.ndarray], stages) -> list[np.ndarray]:
    cur = list(partials)
    for s in reversed(stages):
        nxt = []
        for me in range(len(cur)):
            pos = (me // s.stride) % s.size
            base = me - pos * s.stride
            parts = [np.split(cur[base + j * s.stride], s.size)[pos] for j in range(s.size)]
            total = parts[0]
            for p in parts[1:]:
                total = total + p
            nxt.append(total)
        cur = nxt
    return cur


@pytest.mark.parametrize("topology", ["2x2x1", "2x2x4", "2x4x4"])
def test_staged_and_flat_sums_are_deterministic_and_every_core_is_identical(topology) -> None:
    topo = parse_topology(topology)
    stages = plan_stages(topo)
    rng = np.random.default_rng(0)
    partials = [rng.standard_normal(64).astype(np.float32) * 10.0**k for k in range(-3, 3)]
    partials = [partials[d % 6] * (d + 1) for d in range(topo.num_devices)]
    staged, again = stage_sum(partials, stages), stage_sum(partials, stages)
    flat = flat_sum(partials)
    for core in range(topo.num_devices):
        assert np.array_equal(staged[core], staged[0])  # every core bit-identical
        assert np.array_equal(staged[core], again[core])  # and the same run after run
        assert np.array_equal(flat[core], flat[0])
    exact = np.sum(np.asarray(partials, np.float64), axis=0)
    np.testing.assert_allclose(staged[0], exact, rtol=1e-5, atol=1e-3)
    # The staged order is another association than the flat one: close, not equal bits.
    np.testing.assert_allclose(staged[0], flat[0], rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("topology", ["2x2x1", "2x2x4"])
def test_staged_all_gather_ends_in_device_order(topology) -> None:
    topo = parse_topology(topology)
    pieces = [np.full(3, d, np.float32) for d in range(topo.num_devices)]
    for out in _staged_all_gather(pieces, plan_stages(topo)):
        assert np.array_equal(out, np.repeat(np.arange(topo.num_devices, dtype=np.float32), 3))


@pytest.mark.parametrize("topology", ["2x2x1", "2x2x4"])
def test_staged_reduce_scatter_leaves_core_d_its_slice_d(topology) -> None:
    topo = parse_topology(topology)
    d = topo.num_devices
    rng = np.random.default_rng(1)
    partials = [rng.standard_normal(4 * d).astype(np.float32) for _ in range(d)]
    exact = np.sum(np.asarray(partials, np.float64), axis=0)
    for core, out in enumerate(_staged_reduce_scatter(partials, plan_stages(topo))):
        np.testing.assert_allclose(out, exact[4 * core : 4 * (core + 1)], rtol=1e-5, atol=1e-5)


def test_mesh_order_puts_sibling_cores_side_by_side() -> None:
    topo = parse_topology("2x2x2")
    # Devices as a TPU runtime might number them: cores of a chip far apart.
    devices = []
    for i, dev in enumerate(topo.devices):
        z = dev.chip_coords[2]
        coords = [dev.chip_coords[0], dev.chip_coords[1], z]
        devices.append(
            SimpleNamespace(id=(i % 2) * 100 + i // 2, coords=coords, core_on_chip=i % 2)
        )
    ordered = arrange_devices(devices, topo, list(range(16)))
    for pos, dev in enumerate(ordered):
        assert dev.core_on_chip == pos % 2
        assert topo.devices[pos].chip_coords == tuple(dev.coords)


def test_latent_moe_designs_in_the_layout() -> None:
    spec = "tests/specs/latent-moe-shared.yaml"
    layout = plan_build(load_spec(spec), parse_topology("2x2x1"), BuildOptions.create()).kernel
    moe = next(f for f in layout.ffn if f.type == "moe")
    assert moe.latent_design == "rs_ar" and moe.shared_width
    latent_out = next(s for s in moe.segments if s.name == "latent_out")
    assert latent_out.fan_in == moe.latent_width // layout.devices  # the scattered slice
    assert layout.collectives.buffers[2].send_rows == 2
    plain = plan_build(
        load_spec("tests/specs/latent-moe.yaml"), parse_topology("2x2x1"), BuildOptions.create()
    ).kernel
    assert next(f for f in plain.ffn if f.type == "moe").latent_design == "ar_ag"
