"""The weight stream's layout: what it holds, what it pads, and how the plan reports it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from cli_run import mkgen_here

from mkgen.codegen.build_list import BUILD_LIST, entry_inputs, read_build_list
from mkgen.codegen.package import mini_kernel_args
from mkgen.kinds import default_registry
from mkgen.plan import plan_build
from mkgen.plan.options import BuildOptions
from mkgen.plan.stream import LANES, BankVisit, bank_visits, make_segment
from mkgen.spec.hf_import import import_hf_config
from mkgen.spec.loader import load_spec
from mkgen.spec.mini import mini_twin
from mkgen.spec.topology import parse_topology
from mkgen.spec.weights import model_weights
from mkgen.weights import pack, unpack

BF16 = pack.BF16

FIXTURES = Path(__file__).parent / "fixtures" / "hf"


def test_the_packed_stream_holds_the_plans_weight_bytes_and_pads_the_rest() -> None:
    """Every weight packed as a nonzero value: the stream's nonzero bf16 elements are the
    plan's weight bytes, and every other byte is its padding."""
    spec = import_hf_config(FIXTURES / "qwen3_moe" / "config.json", "qwen3_moe")
    options = BuildOptions.create(context=64)
    plan = plan_build(
        options.apply(spec), parse_topology("1x1x1"), options, kinds=default_registry()
    )
    ones = {w.name: np.ones(w.shape, np.float32) for w in model_weights(spec)}
    stream = pack.pack_stream(plan.kernel, ones, 0).view(np.uint16)
    assert stream.nbytes == plan.stream.bytes_per_step
    assert 2 * np.count_nonzero(stream) == plan.stream.weight_bytes
    assert plan.stream.padding_bytes == stream.nbytes - plan.stream.weight_bytes > 0


def test_plan_reports_the_streams_padding_in_text_and_json() -> None:
    text = mkgen_here("plan", "mixtral-8x7b", "--topology", "2x2x1")
    assert text.returncode == 0, text.stderr
    data = json.loads(mkgen_here("plan", "mixtral-8x7b", "--topology", "2x2x1", "--json").stdout)
    stream = data["stream"]
    assert stream["padding_bytes"] == stream["bytes_per_step"] - stream["weight_bytes"]
    percent = 100 * stream["padding_bytes"] / stream["bytes_per_step"]
    assert stream["padding_percent"] == round(percent, 3)
    assert f"padding {stream['padding_bytes'] / 2**20:.1f} MiB ({percent:.2f} %" in text.stdout


def test_every_checked_in_build_streams_at_most_3_percent_padding() -> None:
    for entry in read_build_list(BUILD_LIST):
        spec, topo, options = entry_inputs(entry)
        stream = plan_build(spec, topo, options, kinds=default_registry()).stream
        assert stream.padding_percent <= 3.0, (entry.line, stream.describe())


@pytest.mark.parametrize(
    ("fan_in", "fan_out", "chunk_rows", "tail_rows", "rows"),
    [
        (112, 300, 112, 0, 2 * 112),  # one narrow chunk a column block
        (600, 512, 208, 0, 2 * 3 * 208),  # the fan-in spread over three chunks
        (512, 300, 256, 48, 2 * 256 + 2 * 48),  # the last 44 columns transposed
        (600, 300, 256, 48, 3 * 256 + 3 * 48),  # transposed beats spread: fewer rows
        (4096, 8, 256, 16, 16 * 16),  # a router of 8 experts: 16 rows a chunk
    ],
)
def test_a_bf16_segment_packs_as_narrow_as_its_matrix_and_unpacks_exactly(
    fan_in: int, fan_out: int, chunk_rows: int, tail_rows: int, rows: int
) -> None:
    seg = make_segment("x", [], fan_in, fan_out, 0, 512)
    assert (seg.chunk_rows, seg.tail_rows, seg.rows) == (chunk_rows, tail_rows, rows)
    matrix = np.random.default_rng(0).standard_normal((fan_in, fan_out)).astype(np.float32)
    matrix = matrix.astype(BF16).astype(np.float32)
    packed = pack.segment_rows(seg, matrix, 512).view(BF16)
    assert packed.shape == (seg.rows, LANES)
    np.testing.assert_array_equal(np.asarray(unpack.segment_matrix(seg, packed, 512)), matrix)


def test_a_chunk_that_straddles_two_banks_waits_for_the_second_and_reads_both() -> None:
    seg = make_segment("x", [], 512, 256, 0, 512)  # two 256-row chunks
    assert bank_visits(seg, 0, 512) == [BankVisit(bank=0, banks=(0,), chunks=2, macs=2 * 256 * 256)]
    # From row 384: the first chunk reaches from bank 0 into bank 1, the second stays in it.
    assert bank_visits(seg, 384, 512) == [
        BankVisit(bank=1, banks=(0, 1), chunks=2, macs=2 * 256 * 256)
    ]
    # From row 128: the first chunk lies in bank 0, reached before; the second reaches bank 1.
    assert bank_visits(seg, 128, 512) == [
        BankVisit(bank=None, banks=(0,), chunks=1, macs=256 * 256),
        BankVisit(bank=1, banks=(0, 1), chunks=1, macs=256 * 256),
    ]


def test_the_program_reads_both_banks_of_a_straddling_chunk_after_waiting_for_them() -> None:
    topo, options = parse_topology("2x2x4"), BuildOptions.create(rows=8, context=128)
    mini = mini_twin(options.apply(load_spec("kimi-k3")), topo.num_devices)
    plan = plan_build(mini, topo, options, **mini_kernel_args(), kinds=default_registry())
    schedule = plan.step_graph.schedule
    straddling = [
        n for n in schedule.nodes if n.cat == "matmul" and sum(r[1] == "ring" for r in n.reads) == 2
    ]
    assert straddling  # the mini twin's small banks make chunks straddle
    assert all(plan.graph.checks.values()), plan.graph.failures
