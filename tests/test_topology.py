"""Topology strings parse to the device placement libtpu uses, and bad strings fail clearly."""

import pytest

from mkgen.errors import SpecError
from mkgen.hardware import CATALOG
from mkgen.spec.topology import Device, Topology, parse_topology


@pytest.mark.parametrize(
    ("text", "name", "chips", "devices", "hosts"),
    [
        ("2x2x4", "tpu7x:2x2x4", 16, 32, 4),
        ("tpu7x:2x2x4", "tpu7x:2x2x4", 16, 32, 4),
        ("1x1x1", "tpu7x:1x1x1", 1, 2, 1),
        ("2x2x1", "tpu7x:2x2x1", 4, 8, 1),
        ("2x2x2", "tpu7x:2x2x2", 8, 16, 2),
        ("4x4x8", "tpu7x:4x4x8", 128, 256, 32),
        ("4x8x8", "tpu7x:4x8x8", 256, 512, 64),  # beyond the list: cube rule
        ("v6e:2x2", "v6e:2x2", 4, 4, 1),
        ("v6e:4x4", "v6e:4x4", 16, 16, 2),
        ("v5e:2x2", "v5e:2x2", 4, 4, 1),
        ("v5p:2x2x1", "v5p:2x2x1", 4, 4, 1),  # megacore: one device per chip
        (" TPU7x:2x2x4 ", "tpu7x:2x2x4", 16, 32, 4),
    ],
)
def test_sizes(text, name, chips, devices, hosts):
    topo = parse_topology(text)
    assert topo.name == name
    assert (topo.num_chips, topo.num_devices, topo.num_hosts) == (chips, devices, hosts)
    assert len(topo.devices) == devices
    assert parse_topology(topo.name) == topo  # the canonical name round-trips


def test_2x2x4_device_order_matches_libtpu():
    topo = parse_topology("2x2x4")
    d = topo.devices
    # ids 0,1: chip (0,0,0) cores 0,1; ids 2,3: chip (1,0,0); ids 4,5: chip (0,1,0).
    assert [(x.chip_coords, x.core_on_chip) for x in d[:6]] == [
        ((0, 0, 0), 0),
        ((0, 0, 0), 1),
        ((1, 0, 0), 0),
        ((1, 0, 0), 1),
        ((0, 1, 0), 0),
        ((0, 1, 0), 1),
    ]
    assert d[8].chip_coords == (0, 0, 1)
    assert [x.index for x in d] == list(range(32))


def test_sibling_cores_are_adjacent():
    topo = parse_topology("2x2x4")
    for k in range(topo.num_chips):
        a, b = topo.devices[2 * k], topo.devices[2 * k + 1]
        assert a.chip_index == b.chip_index == k
        assert (a.core_on_chip, b.core_on_chip) == (0, 1)


def test_2x2x4_hosts_are_z_planes():
    topo = parse_topology("2x2x4")
    assert topo.host_grid == (1, 1, 4)  # process bounds 1,1,4
    assert topo.host_block == (2, 2, 1)  # chips per process 2,2,1
    for dev in topo.devices:
        assert dev.host == dev.chip_coords[2]
        assert dev.host == dev.index // 8  # hosts are contiguous device ranges here


def test_4x4x4_hosts_are_2x2_blocks():
    topo = parse_topology("4x4x4")
    assert topo.num_hosts == 16
    for dev in topo.devices:
        x, y, z = dev.chip_coords
        assert dev.host == x // 2 + 2 * (y // 2) + 4 * z
    counts = [sum(1 for d in topo.devices if d.host == h) for h in range(topo.num_hosts)]
    assert counts == [8] * 16


def test_levels():
    topo = parse_topology("2x2x4")
    assert topo.level_between(0, 1) == "core"
    assert topo.level_between(1, 0) == "core"
    assert topo.level_between(0, 2) == "chip"
    assert topo.level_between(1, 7) == "chip"
    assert topo.level_between(0, 8) == "host"
    assert topo.level_between(topo.devices[31], topo.devices[0]) == "host"
    assert (
        topo.link_between(0, 1).bandwidth_bytes_per_s
        > topo.link_between(0, 2).bandwidth_bytes_per_s
    )
    with pytest.raises(ValueError, match="itself"):
        topo.level_between(3, 3)
    with pytest.raises(ValueError, match="32"):
        topo.level_between(0, 32)


def test_single_core_chips_never_report_core_level():
    topo = parse_topology("v6e:2x2")
    pairs = [(a, b) for a in range(4) for b in range(4) if a != b]
    assert {topo.level_between(a, b) for a, b in pairs} == {"chip"}


def test_compile_only_names():
    assert parse_topology("2x2x4").compile_only_name == "tpu7x:2x2x4"
    assert parse_topology("2x2x1").compile_only_name == "tpu7x:2x2x1"
    assert parse_topology("1x1x1").compile_only_name == "tpu7x=1x1x1"  # hardware.md's spelling
    assert parse_topology("v6e:2x2").compile_only_name == "v6e:2x2"


def test_mesh_shapes():
    topo = parse_topology("2x2x4")
    assert topo.mesh_shape == (32,)
    assert topo.structured_mesh_shape == (4, 2, 2, 2)
    assert topo.structured_axis_names == ("z", "y", "x", "core")
    # The structured view is the device list reshaped C-order.
    z, y, x, c = topo.structured_mesh_shape
    for dev in topo.devices:
        dx, dy, dz = dev.chip_coords
        assert dev.index == ((dz * y + dy) * x + dx) * c + dev.core_on_chip
    v6e = parse_topology("v6e:2x4")
    assert v6e.structured_mesh_shape == (4, 2, 1)
    assert v6e.structured_axis_names == ("y", "x", "core")


def test_describe_is_one_line():
    line = parse_topology("2x2x4").describe()
    assert "\n" not in line
    for part in ("tpu7x:2x2x4", "16", "32 devices", "4 hosts"):
        assert part in line


def test_topology_validates_when_built_directly():
    assert Topology(chip="tpu7x", shape=(2, 2, 4)) == parse_topology("2x2x4")
    assert Topology.model_validate({"chip": "tpu7x", "shape": [2, 2, 4]}).num_devices == 32
    with pytest.raises(SpecError, match="2x2x3"):
        Topology(chip="tpu7x", shape=(2, 2, 3))
    with pytest.raises(SpecError, match="'v9'"):
        Topology(chip="v9", shape=(2, 2))


def test_devices_are_frozen_records():
    dev = parse_topology("1x1x1").devices[1]
    assert dev == Device(index=1, chip_index=0, core_on_chip=1, chip_coords=(0, 0, 0), host=0)


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("", "empty"),
        ("2x2x3", "2x2x3"),
        ("2x2", "3 dimensions"),
        ("v6e:2x2x1", "2 dimensions"),
        ("v9:2x2", "'v9'"),
        ("2x2x", "dimension ''"),
        ("0x2x4", "x=0"),
        ("2x-2x4", "'-2'"),
        ("2.5x2x4", "'2.5'"),
        ("two:2x2", "'two'"),
        ("tpu7x:2x2:4", "more than one ':'"),
        ("8x4x4", "tpu7x:4x4x8"),
        ("4x4x6", "z=6"),
        ("64x64x64", "262144 chips"),
        ("v6e:3x3", "3x3"),
        ("v5p:1x1x1", "1x1x1"),
    ],
)
def test_invalid_topologies(text, named):
    with pytest.raises(SpecError) as err:
        parse_topology(text)
    message = str(err.value)
    assert "\n" not in message
    assert f"topology {text!r}" in message
    assert named in message


def test_every_catalog_slice_parses_with_whole_hosts():
    for chip in CATALOG.values():
        for shape in chip.slice_shapes:
            topo = Topology(chip=chip.name, shape=shape)
            assert topo.num_hosts * topo.chips_per_host == topo.num_chips
            assert topo.chips_per_host <= chip.chips_per_host
            hosts = {d.host for d in topo.devices}
            assert hosts == set(range(topo.num_hosts))
