"""The ideal floor: what a core must read per step with no replication, even experts and
no padding, at the catalog's streaming rate."""

from __future__ import annotations

import pytest

from mkgen.plan import BuildOptions
from mkgen.plan.floor import expected_distinct_experts, ideal_floor
from mkgen.spec.figures import cache_bytes, state_bytes_per_sequence
from mkgen.spec.loader import load_spec
from mkgen.spec.topology import parse_topology
from mkgen.spec.weights import model_weights


def _floor(model: str, topology: str, **options):
    built = BuildOptions.create(**options)
    spec = built.apply(load_spec(model))
    return spec, ideal_floor(spec, parse_topology(topology), built)


def test_one_row_reads_exactly_its_top_k_experts_and_many_rows_saturate() -> None:
    assert expected_distinct_experts(128, 8, 1) == pytest.approx(8)
    assert expected_distinct_experts(128, 8, 10_000) == pytest.approx(128)
    assert 8 < expected_distinct_experts(128, 8, 2) < 16


def test_a_dense_model_reads_every_weight_once_split_over_the_cores() -> None:
    spec, floor = _floor("qwen3-32b", "2x2x1", batch=2, context=1024)
    weights = sum(w.nbytes("bf16") for w in model_weights(spec) if w.family != "embedding")
    assert floor.weight_bytes_per_core == pytest.approx(weights / 8)
    assert floor.expert_bytes_per_core == 0
    per_sequence = cache_bytes(spec, 1024) + state_bytes_per_sequence(spec)
    assert floor.cache_bytes_per_core == pytest.approx(2 * per_sequence / 8)
    assert floor.ms == pytest.approx(floor.bytes_per_core / 3.2e12 * 1e3)


def test_more_rows_read_more_experts_and_quantized_experts_read_fewer_bytes() -> None:
    _, one = _floor("kimi-k3", "2x2x4")
    _, eight = _floor("kimi-k3", "2x2x4", rows=8)
    assert eight.weight_bytes_per_core == one.weight_bytes_per_core
    assert eight.expert_bytes_per_core > 5 * one.expert_bytes_per_core
    _, bf16 = _floor("qwen3-30b-a3b", "2x2x1")
    _, int4 = _floor("qwen3-30b-a3b", "2x2x1", quant=[("experts", "int4:128")])
    assert int4.expert_bytes_per_core < 0.3 * bf16.expert_bytes_per_core


def test_the_calibration_override_of_distinct_experts_is_honoured() -> None:
    _, uniform = _floor("muse-spark-1.2", "2x2x1", batch=8)
    _, pinned = _floor("muse-spark-1.2", "2x2x1", batch=8, distinct_experts_per_layer=8)
    _, one = _floor("muse-spark-1.2", "2x2x1")
    assert pinned.expert_bytes_per_core == pytest.approx(one.expert_bytes_per_core)
    assert uniform.expert_bytes_per_core > pinned.expert_bytes_per_core
