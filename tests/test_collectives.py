"""Collective rounds planned from the topology, their wire dtypes and error bound, their
balance across cores and their price."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from mkgen.hardware import CATALOG
from mkgen.kinds import default_registry
from mkgen.plan import plan_build
from mkgen.plan.collectives import (
    BF16_UNIT_ROUNDOFF,
    CollectivePlan,
    arrange_devices,
    check_rounds,
    choose_rounds,
    collective_buffers,
    collective_time_us,
    ffn_out_buffer,
    flat_round,
    host_order,
    layer_uses,
    plan_collectives,
    plan_rounds,
    round_calls,
    scatter_calls,
    wire_dtype,
    wire_error_bound,
    wire_lanes,
)
from mkgen.plan.cost import CostConstants
from mkgen.plan.options import BuildOptions
from mkgen.plan.sharding import plan_sharding
from mkgen.spec.loader import load_spec
from mkgen.spec.topology import parse_topology

# topology -> (group sizes, strides, peers of core 0 by level in each round)
ROUNDS = {
    "1x1x1": ([2], [1], [{"core": 1}]),
    "2x2x1": ([8], [1], [{"core": 1, "chip": 6}]),
    "2x2x2": ([8, 2], [1, 8], [{"core": 1, "chip": 6}, {"host": 1}]),
    "2x2x4": ([8, 4], [1, 8], [{"core": 1, "chip": 6}, {"host": 3}]),
    "2x4x4": ([8, 8], [1, 8], [{"core": 1, "chip": 6}, {"host": 7}]),
    "4x4x4": ([8, 16], [1, 8], [{"core": 1, "chip": 6}, {"host": 15}]),
    "v6e:2x2": ([4], [1], [{"chip": 3}]),
    "v6e:1x1": ([], [], []),
}


def _peers(counts: dict[str, int]) -> dict[str, int]:
    return {"core": 0, "chip": 0, "host": 0} | counts


@pytest.mark.parametrize("topology", list(ROUNDS))
def test_one_round_inside_a_host_then_one_across_hosts(topology: str) -> None:
    topo = parse_topology(topology)
    rounds = plan_rounds(topo)
    sizes, strides, peers = ROUNDS[topology]
    assert [r.size for r in rounds] == sizes
    assert [r.stride for r in rounds] == strides
    assert [r.peers for r in rounds] == [_peers(p) for p in peers]
    assert int(np.prod(sizes or [1])) == topo.num_devices
    # The first round's group is one host: its members are its cores, in mesh order.
    order = host_order(topo)
    if rounds and rounds[0].name == "host":
        for p in range(topo.num_devices):
            same = p // rounds[0].size == 0
            assert (topo.devices[order[p]].host == topo.devices[order[0]].host) == same


def test_hosts_that_are_not_contiguous_in_device_order_are_made_so_by_the_mesh_order() -> None:
    topo = parse_topology("4x4x4")  # hosts of 2x2x1 chips: x splits over two hosts
    order = host_order(topo)
    assert order != list(range(topo.num_devices))
    assert sorted(order) == list(range(topo.num_devices))
    hosts = [topo.devices[d].host for d in order]
    assert hosts == sorted(hosts)  # each host's 8 cores side by side
    for p in range(0, topo.num_devices, 2):  # sibling cores stay adjacent
        assert topo.level_between(order[p], order[p + 1]) == "core"


def test_kimi_k3_slice_sends_10_copies_in_two_rounds_into_12_slots() -> None:
    plan = plan_collectives(parse_topology("2x2x4"), [[("attn_out", "all_reduce", 7168, "staged")]])
    assert [r.size for r in plan.rounds] == [8, 4]
    assert plan.copies == 10 and plan.slots == 12
    assert plan.mesh_order == list(range(32))
    assert check_rounds(plan, 32) is None


def test_buffers_hold_the_widest_copy_a_round_lands_in_32_bit_words() -> None:
    topo = parse_topology("2x2x4")  # rounds of 8 (in a host) and 4 (across hosts)
    uses = [
        [("attn_out", "all_reduce", 7168, "staged")],
        [("latent_in", "all_gather", 3584, "staged")],
        [("expert_out", "reduce_scatter", 3584, "staged")],
    ]
    plan = plan_collectives(topo, uses)
    # all-reduce: 7168 bf16 values in 3584 words; all-gather: 112 f32 columns in one
    # 128-lane row, then 896 bf16 in 512 words; reduce-scatter: the other way round.
    assert [b.wires for b in plan.buffers] == [
        [("all_reduce", 7168, [(0, "all_reduce", "bf16", 3584), (1, "all_reduce", "bf16", 3584)])],
        [("all_gather", 112, [(0, "all_gather", "f32", 128), (1, "all_gather", "bf16", 512)])],
        [
            (
                "reduce_scatter",
                3584,
                [(1, "reduce_scatter", "bf16", 512), (0, "reduce_scatter", "f32", 128)],
            )
        ],
    ]
    assert [b.width for b in plan.buffers] == [3584, 512, 512]
    assert [b.send_rows for b in plan.buffers] == [0, 0, 8]


@pytest.mark.parametrize(
    ("columns", "wire", "lanes"),
    [
        (112, "f32", 128),
        (128, "f32", 128),
        (256, "bf16", 128),
        (896, "bf16", 512),
        (7168, "bf16", 3584),
    ],
)
def test_bf16_only_where_it_moves_fewer_128_lane_rows(columns: int, wire: str, lanes: int) -> None:
    assert wire_dtype(columns) == wire
    assert wire_lanes(columns, wire) == lanes
    assert wire_lanes(columns, "f32") >= lanes


# --------------------------------------------------------------------------- the kernel's sums


def _bf16(x: np.ndarray) -> np.ndarray:
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


def _rounds(topology: str, flat: bool) -> list:
    topo = parse_topology(topology)
    return [flat_round(topo)] if flat and flat_round(topo) else plan_rounds(topo)


def _round_sums(
    values: list[np.ndarray], topology: str, width: int, flat: bool
) -> list[np.ndarray]:
    """What every core holds after the kernel's all-reduce: per round, each member's
    running sum on its wire dtype, summed in f32 in member order."""
    rounds = _rounds(topology, flat)
    calls = round_calls("x", "all_reduce", width, 8, rounds)
    cur = [v.astype(np.float32) for v in values]
    for r, call in zip(rounds, calls, strict=True):
        sent = [_bf16(v) if call.wire == "bf16" else v for v in cur]
        nxt = []
        for me in range(len(cur)):
            base = me - ((me // r.stride) % r.size) * r.stride
            total = sent[base]
            for j in range(1, r.size):
                total = total + sent[base + j * r.stride]
            nxt.append(total)
        cur = nxt
    return cur


def _scattered_sums(values: list[np.ndarray], topology: str, width: int) -> list[np.ndarray]:
    """What every core holds after the kernel's scattered all-reduce: the host's part p
    summed on core p of each host (each member's part on its wire dtype, in member order),
    that part summed across hosts the same way, the parts gathered over the host on
    their wire dtype."""
    topo = parse_topology(topology)
    calls = scatter_calls("x", width, 8, topo)
    assert calls is not None
    rounds = plan_rounds(topo)
    host, across = rounds[0].size, rounds[1:]
    part = width // host

    def wire(v: np.ndarray, call) -> np.ndarray:
        return _bf16(v) if call.wire == "bf16" else v

    d = len(values)
    # Reduce-scatter over the host: core c (position p in its host) sums part p.
    cur = []
    for me in range(d):
        p, base = me % host, me - me % host
        pieces = [wire(values[base + j][p * part : (p + 1) * part], calls[0]) for j in range(host)]
        cur.append(sum(pieces[1:], pieces[0]))
    # All-reduce of the part across hosts, in member order.
    for r, call in zip(across, calls[1:-1], strict=True):
        sent = [wire(v, call) for v in cur]
        cur = [
            sum((sent[me - ((me // r.stride) % r.size) * r.stride + j * r.stride] for j in range(1, r.size)),
                sent[me - ((me // r.stride) % r.size) * r.stride])
            for me in range(d)
        ]  # fmt: skip
    # All-gather of the parts over the host again.
    return [
        np.concatenate([wire(cur[me - me % host + j], calls[-1]) for j in range(host)])
        for me in range(d)
    ]


@pytest.mark.parametrize("topology", ["2x2x1", "2x2x4"])
def test_a_scattered_all_reduce_is_bit_identical_on_every_core_and_within_its_bound(
    topology,
) -> None:
    """Reduce-scatter in the host, all-reduce across hosts, all-gather in the host, each
    piece on the bf16 wire: every core ends with the same bits, within the bound, which
    counts the gather's rounding of the sum too."""
    d = parse_topology(topology).num_devices
    width = 8192  # 1024 columns a part: bf16 on the wire in every round
    rng = np.random.default_rng(1)
    partials = [
        rng.standard_normal(width).astype(np.float32) * 10.0 ** (k % 5 - 2) for k in range(d)
    ]
    out = _scattered_sums(partials, topology, width)
    for core in range(d):
        assert np.array_equal(out[core], out[0])
    calls = scatter_calls("x", width, 8, parse_topology(topology))
    assert calls is not None and {c.wire for c in calls} == {"bf16"}
    exact = np.sum(np.asarray(partials, np.float64), axis=0)
    magnitude = np.sum(np.abs(np.asarray(partials, np.float64)), axis=0)
    bound = wire_error_bound("all_reduce", calls)
    error = np.abs(out[0] - exact) / magnitude
    assert error.max() <= bound
    assert error.max() > bound / 8
    assert len(calls) * BF16_UNIT_ROUNDOFF < bound < len(calls) * BF16_UNIT_ROUNDOFF * 1.01


@pytest.mark.parametrize("flat", [False, True], ids=["staged", "flat"])
@pytest.mark.parametrize("topology", ["2x2x1", "2x2x2", "2x2x4", "2x4x4"])
def test_bf16_wire_sum_is_within_its_bound_and_bit_identical_on_every_core(topology, flat) -> None:
    d = parse_topology(topology).num_devices
    width = 4096
    rng = np.random.default_rng(0)
    # Partials of mixed scales and signs, so the sum cancels and the bound is relative to
    # the magnitudes summed, not to the sum.
    partials = [
        rng.standard_normal(width).astype(np.float32) * 10.0 ** (k % 5 - 2) for k in range(d)
    ]
    out = _round_sums(partials, topology, width, flat)
    for core in range(d):
        assert np.array_equal(out[core], out[0])
    exact = np.sum(np.asarray(partials, np.float64), axis=0)
    magnitude = np.sum(np.abs(np.asarray(partials, np.float64)), axis=0)
    calls = round_calls("x", "all_reduce", width, 8, _rounds(topology, flat))
    bound = wire_error_bound("all_reduce", calls)
    error = np.abs(out[0] - exact) / magnitude
    assert error.max() <= bound
    # The bound is not loose: bf16 rounding shows at about a quarter of it or more.
    assert error.max() > bound / 8
    # And it is the bf16 unit roundoff per round plus the f32 sums' few ulps.
    rounds = len(calls)
    assert rounds * BF16_UNIT_ROUNDOFF < bound < rounds * BF16_UNIT_ROUNDOFF * 1.01


def test_f32_rounds_bound_only_the_f32_sums() -> None:
    rounds = plan_rounds(parse_topology("2x2x4"))
    narrow = round_calls("x", "all_reduce", 128, 8, rounds)
    assert [c.wire for c in narrow] == ["f32", "f32"]
    assert wire_error_bound("all_reduce", narrow) < 1e-6
    gather = round_calls("x", "all_gather", 3584, 8, rounds)  # f32, then bf16
    assert wire_error_bound("all_gather", gather) == pytest.approx(BF16_UNIT_ROUNDOFF)


# --------------------------------------------------------------------------- balance


def _two_hosts(**second_round: int) -> CollectivePlan:
    """2x2x2's rounds with fields of the second (across the hosts) replaced."""
    plan = plan_collectives(parse_topology("2x2x2"), [[("attn_out", "all_reduce", 256, "staged")]])
    host, hosts = plan.rounds
    rounds = [host.model_dump(), hosts.model_dump() | second_round]
    return CollectivePlan.model_validate(plan.model_dump() | {"rounds": rounds})


@pytest.mark.parametrize(
    ("second_round", "problem"),
    [
        ({}, None),
        # Groups of 2 at stride 4 pair cores of one host: no partial crosses to the other.
        ({"stride": 4}, "core 0 combines the partials of 8 of 16 cores"),
        ({"size": 1}, "rounds of [8, 1] members do not cover 16 cores"),
        ({"offset": 9}, "round hosts: slots 9..10 past 10"),
    ],
)
def test_rounds_that_do_not_balance_across_the_cores_are_named(second_round, problem) -> None:
    assert check_rounds(_two_hosts(**second_round), 16) == problem


# --------------------------------------------------------------------------- price


def test_a_round_costs_the_catalog_phase_or_its_copies_over_the_links_if_longer() -> None:
    chip = CATALOG["tpu7x"]
    rounds = plan_rounds(parse_topology("2x2x4"))
    host, hosts = round_calls("attn_out", "all_reduce", 7168, 8, rounds)
    assert host.bytes_per_peer == 8 * 3584 * 4  # bf16: half the f32 bytes
    phase_us = chip.collective_phase_latency.cost_model * 1e6
    chip_bw = chip.ici_level("chip").bandwidth_bytes_per_s
    # In a host: 6 copies over the cross-chip links (the sibling's runs beside them), more
    # than a latency-bound phase; across hosts: 3 copies, within one.
    in_host = collective_time_us({"collective": host.model_dump()}, chip)
    assert in_host == pytest.approx(6 * host.bytes_per_peer / chip_bw * 1e6)
    assert in_host > phase_us
    across = collective_time_us({"collective": hosts.model_dump()}, chip)
    assert across == pytest.approx(phase_us) and 3 * hosts.bytes_per_peer / chip_bw * 1e6 < phase_us


def test_a_copy_moves_only_the_real_token_rows() -> None:
    """At batch 1 x rows 1 the landing slots keep 8 rows (sublane padding), but a copy moves
    the one real row: an eighth of the bytes, so a wide in-host all-reduce that was
    wire-bound is back within the phase latency."""
    chip = CATALOG["tpu7x"]
    rounds = plan_rounds(parse_topology("2x2x4"))
    padded, _ = round_calls("attn_out", "all_reduce", 7168, 8, rounds)
    one, _ = round_calls("attn_out", "all_reduce", 7168, 1, rounds)
    assert (one.rows, one.copy_rows, padded.rows, padded.copy_rows) == (8, 1, 8, 8)
    assert one.bytes_per_peer == 3584 * 4 and padded.bytes_per_peer == 8 * one.bytes_per_peer
    phase_us = chip.collective_phase_latency.cost_model * 1e6
    assert collective_time_us({"collective": padded.model_dump()}, chip) > phase_us
    assert collective_time_us({"collective": one.model_dump()}, chip) == pytest.approx(phase_us)


def test_the_program_carries_what_pricing_needs_for_every_round() -> None:
    plan = plan_build(
        load_spec("kimi-k3"),
        parse_topology("2x2x4"),
        BuildOptions.create(rows=8),
        kinds=default_registry(),
    )
    program = plan.program
    rounds = [e for e in program["kda/moe"] if e["event"] == "start" and "collective" in e]
    # attn_out, latent_in, expert_out, ffn_out in execution order: the all-reduces (of
    # hidden, of the latent) in two rounds, the gathers flat (the cost model's choice).
    assert [(e["collective"]["collective"], e["collective"]["round"]) for e in rounds] == [
        ("attn_out", "host"), ("attn_out", "hosts"),
        ("latent_in", "all"),
        ("expert_out", "host"), ("expert_out", "hosts"),
        ("ffn_out", "all"),
    ]  # fmt: skip
    chip = CATALOG["tpu7x"]
    layer_us = sum(collective_time_us(e, chip) for e in rounds)
    priced = plan.sharding.attention["kda"].collectives + plan.sharding.ffn["moe"].collectives
    assert layer_us == pytest.approx(sum(c.time_s for c in priced) * 1e6)
    for e in rounds:
        call = e["collective"]
        assert e["bytes"] == (call["members"] - 1) * call["bytes_per_peer"]
        assert e["dmas"] == 2 * (call["members"] - 1)
    assert plan.graph.checks["collectives_balanced"]


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
    spec, topology = load_spec("tests/specs/latent-moe-shared.yaml"), parse_topology("2x2x1")

    def moe_of(options: BuildOptions):  # the layout, its MoE record, its segments by name
        layout = plan_build(spec, topology, options, kinds=default_registry()).kernel
        moe = next(f for f in layout.ffn if f.type == "moe")
        return layout, moe, {s.name: s for s in moe.segments}

    # The planner's choice: the latent all-reduced, hidden all-gathered; the shared
    # experts' activation gathered with the latent, their down projection by columns.
    layout, moe, segments = moe_of(BuildOptions.create())
    assert moe.latent_design == "ar_ag" and moe.shared_gathered and not moe.shared_in_flight
    shared = spec.ffn_kinds["moe"].shared_experts.width
    assert segments["shared_down"].fan_in == shared
    assert segments["latent_out"].fan_in == moe.latent_width
    assert segments["shared_down"].fan_out == segments["latent_out"].fan_out
    # Forced the other way (a full-size build that reduce-scatters, as Kimi K3 at batch 8):
    # each core's slice of the latent, the shared experts in the scatter's flight.
    layout, moe, segments = moe_of(BuildOptions.create(splits=()))
    assert moe.latent_design == "rs_ar" and moe.shared_in_flight and not moe.shared_gathered
    assert segments["latent_out"].fan_in == moe.latent_width // layout.devices
    assert layout.collectives.buffers[2].send_rows == 8  # one round of 8 parts
    plain = plan_build(
        load_spec("tests/specs/latent-moe.yaml"),
        parse_topology("2x2x1"),
        BuildOptions.create(),
        kinds=default_registry(),
    ).kernel
    assert next(f for f in plain.ffn if f.type == "moe").latent_design == "ar_ag"


# --------------------------------------------------------------------------- flat


def test_a_flat_round_is_every_core_in_one_group_where_the_staged_rounds_are_two() -> None:
    flat = flat_round(parse_topology("2x2x4"))
    assert flat is not None
    assert (flat.name, flat.size, flat.stride, flat.offset) == ("all", 32, 1, 0)
    assert flat.peers == {"core": 1, "chip": 6, "host": 24} and flat.level == "host"
    # One host (or one core) already runs a single round: nothing to flatten.
    assert flat_round(parse_topology("2x2x1")) is None
    assert flat_round(parse_topology("1x1x1")) is None


def _choice(op: str, width: int, constants: CostConstants) -> list[str]:
    topo = parse_topology("2x2x4")
    return [c.round for c in choose_rounds(topo, "x", op, width, 8, constants, "auto")]


def test_auto_takes_the_flat_round_only_where_the_cost_model_prices_it_lower() -> None:
    """Kimi K3's latent gather (140 columns a core) and scatter (112) send a few KiB to each
    of 31 peers: one phase plus 21 more copies beats two phases. Its all-reduce of hidden
    (7168, bf16) would move 30 x 112 KiB over the chip's links: more than a second phase."""
    c = CostConstants.from_chip(CATALOG["tpu7x"])
    assert _choice("all_gather", 32 * 140, c) == ["all"]
    assert _choice("reduce_scatter", 3584, c) == ["all"]
    assert _choice("all_reduce", 7168, c) == ["host", "hosts"]
    # The cross-host constants move the choice: host links of 20 GB/s make the gather's 24
    # cross-host copies slower than the staged rounds' 3.
    narrow = c.with_inputs(host_bandwidth=20e9)
    assert _choice("all_gather", 32 * 140, narrow) == ["host", "hosts"]
    # A dearer copy issue does too: at 0.5 us a copy the 21 extra copies cost more than a phase.
    dear = c.with_inputs(dma_overhead_s=0.5e-6)
    assert _choice("reduce_scatter", 3584, dear) == ["hosts", "host"]  # across hosts first


@pytest.mark.parametrize("mode", ["staged", "flat"])
def test_a_forced_mode_runs_every_collective_that_way(mode: str) -> None:
    c = CostConstants.from_chip(CATALOG["tpu7x"])
    topo = parse_topology("2x2x4")
    calls = choose_rounds(topo, "x", "all_reduce", 7168, 8, c, mode)
    assert [call.round for call in calls] == (["all"] if mode == "flat" else ["host", "hosts"])


def test_staged_and_flat_collectives_share_buffers_and_balance() -> None:
    """A buffer that lands a staged all-reduce and a flat gather holds 32 slots; the greedy
    runs flat; the entry barrier signals every core once (31 signals), and every scheme's
    copies balance (the same check as the graph's `collectives_balanced`)."""
    uses = [
        [("attn_out", "all_reduce", 7168, "staged")],
        [("ffn_out", "all_reduce", 7168, "staged"), ("latent_in", "all_gather", 4480, "flat")],
        [("expert_out", "reduce_scatter", 3584, "flat")],
    ]
    plan = plan_collectives(parse_topology("2x2x4"), uses, "flat")
    assert [r.name for r in plan.rounds] == ["host", "hosts", "all"]
    assert [b.slots for b in plan.buffers] == [12, 32, 32]
    assert [b.send_rows for b in plan.buffers] == [0, 0, 32]
    assert plan.buffers[1].wires[1] == ("all_gather", 140, [(2, "all_gather", "f32", 256)])
    assert plan.greedy == [2] and plan.barrier == [2] and plan.copies == 31
    assert plan.schemes() == [[2], [0, 1]]
    assert check_rounds(plan, 32) is None
    # A barrier that signals only the staged rounds' members misses the flat round's.
    short = CollectivePlan.model_validate(plan.model_dump() | {"barrier": [0, 1]})
    assert check_rounds(short, 32) == "round all: core 0 is written to before its barrier signal"


def test_a_flat_round_sums_in_one_round_and_bounds_its_error_by_one_rounding() -> None:
    """A flat all-reduce in bf16 rounds each partial once: its bound is one round's (3.9e-3),
    half the staged two rounds' (7.8e-3); a flat f32 scatter only sums (31 f32 additions)."""
    c = CostConstants.from_chip(CATALOG["tpu7x"])
    topo = parse_topology("2x2x4")
    flat = choose_rounds(topo, "x", "all_reduce", 7168, 8, c, "flat")
    staged = choose_rounds(topo, "x", "all_reduce", 7168, 8, c, "staged")
    assert wire_error_bound("all_reduce", flat) == pytest.approx(BF16_UNIT_ROUNDOFF, rel=1e-3)
    assert wire_error_bound("all_reduce", staged) > 2 * BF16_UNIT_ROUNDOFF
    scatter = choose_rounds(topo, "x", "reduce_scatter", 3584, 8, c, "flat")
    assert [x.wire for x in scatter] == ["f32"] and wire_error_bound(
        "reduce_scatter", scatter
    ) < 2e-6


@pytest.mark.parametrize(
    ("spec", "topology"),
    [("kimi-k3", "2x2x4"), (str(Path(__file__).parent / "specs/mla-hybrid.yaml"), "2x2x1")],
)
def test_no_two_collectives_in_a_row_share_a_landing_buffer(spec: str, topology: str) -> None:
    """Over the step's layers in order, each collective lands in another buffer than the
    one before it (a peer done with the earlier one may already write the next); every
    FFN's last all-reduce lands in one buffer, so Kimi K3's dense first layer does not
    widen the latent all-gather's buffer (3584 words a row there; 384 now, where the
    latent gathers run flat and land a core's piece a slot: its latent columns, the
    router's scores and the shared experts' activation) nor its MoE's output all-gather's
    (256)."""
    topo = parse_topology(topology)
    sharding = plan_sharding(load_spec(spec), topo, BuildOptions.create(), kinds=default_registry())
    ffn_out = ffn_out_buffer(sharding)
    order = []
    for attn, ffn in sharding.layer_table:
        a, f = sharding.attention[attn], sharding.ffn[ffn]
        buffers = collective_buffers(a.collectives, f.collectives, ffn_out)
        order += [buffers[c.name] for c in (*a.collectives, *f.collectives)]
    assert all(x != y for x, y in zip(order, order[1:], strict=False))
    if spec == "kimi-k3":
        plan = plan_collectives(topo, layer_uses(sharding))
        assert [b.width for b in plan.buffers] == [3584, 384, 256, 3584]


# --------------------------------------------------------------------------- scattered


def _rounds_at(topology: str, rows: int, mode: str = "auto") -> list[tuple[str, str]]:
    c = CostConstants.from_chip(CATALOG["tpu7x"])
    calls = choose_rounds(parse_topology(topology), "x", "all_reduce", 7168, rows, c, mode)
    return [(call.phase, call.round) for call in calls]


def test_a_wide_all_reduce_runs_scattered_once_its_copies_outlast_a_phase() -> None:
    """Kimi K3's all-reduce of hidden (7168 columns, bf16) on 2x2x4: at 8 token rows the
    staged rounds (112 KiB a copy, 8.6 us) beat three rounds; at 32 rows each staged copy
    is 448 KiB (31 us), while the scattered rounds send 56 KiB a copy (11 us); one host
    (2x2x1) scatters and gathers in its own round at 64 rows."""
    staged = [("all_reduce", "host"), ("all_reduce", "hosts")]
    scattered = [("reduce_scatter", "host"), ("all_reduce", "hosts"), ("all_gather", "host_gather")]
    assert _rounds_at("2x2x4", 8) == staged
    assert _rounds_at("2x2x4", 32) == scattered
    assert _rounds_at("2x2x4", 64) == scattered
    assert _rounds_at("2x2x1", 8) == [("all_reduce", "host")]
    assert _rounds_at("2x2x1", 64) == [("reduce_scatter", "host"), ("all_gather", "host_gather")]
    # Forced: every all-reduce scattered, other ops as staged; one core has no round to
    # scatter over, and a width must split into the host's parts.
    assert _rounds_at("2x2x4", 8, "scatter") == scattered
    c = CostConstants.from_chip(CATALOG["tpu7x"])
    gather = choose_rounds(parse_topology("2x2x4"), "x", "all_gather", 4480, 8, c, "scatter")
    assert [(g.phase, g.round) for g in gather] == [("all_gather", "host"), ("all_gather", "hosts")]
    assert scatter_calls("x", 7168, 8, parse_topology("v6e:1x1")) is None
    assert scatter_calls("x", 100, 8, parse_topology("2x2x1")) is None  # 100 / 8 cores


def test_a_scattered_all_reduce_gathers_into_slots_of_its_own() -> None:
    """The gather's round has the host's groups but lands after the staged rounds' slots
    (a member may gather before this core has read what it scattered to it); a plan whose
    gather lands in the scatter's slots is named, the rounds otherwise balance."""
    uses = [
        [("attn_out", "all_reduce", 7168, "scatter")],
        [("latent_in", "all_gather", 4480, "staged")],
    ]
    plan = plan_collectives(parse_topology("2x2x4"), uses)
    assert [(r.name, r.size, r.offset) for r in plan.rounds] == [
        ("host", 8, 0), ("hosts", 4, 8), ("host_gather", 8, 12),
    ]  # fmt: skip
    first = plan.buffers[0]
    assert first.wires == [
        ("all_reduce", 7168, [
            (0, "reduce_scatter", "bf16", 512), (1, "all_reduce", "bf16", 512), (2, "all_gather", "bf16", 512),
        ]),
    ]  # fmt: skip
    assert (first.slots, first.width, first.send_rows) == (20, 512, 8)
    assert plan.schemes() == [[0, 1]] and check_rounds(plan, 32) is None
    rounds = [r.model_dump() for r in plan.rounds]
    rounds[2]["offset"] = 0
    shared = CollectivePlan.model_validate(plan.model_dump() | {"rounds": rounds})
    assert check_rounds(shared, 32) == (
        "all_reduce: round host_gather lands in slots 0..7, which an earlier round of the "
        "same collective uses"
    )
