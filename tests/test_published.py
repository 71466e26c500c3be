"""The hand-written kernels' published steps, matched to the builds that do the same work."""

from __future__ import annotations

import pytest

from mkgen.plan import BuildOptions
from mkgen.plan.published import HAND_WRITTEN, hand_written_for
from mkgen.spec.loader import load_spec
from mkgen.spec.topology import parse_topology


def _match(model: str, topology: str, **options):
    built = BuildOptions.create(**options)
    base = load_spec(model)
    return hand_written_for(base, built.apply(base), parse_topology(topology), built)


def test_the_seeds_steps_follow_from_their_accepted_tokens_per_second() -> None:
    kimi = _match("kimi-k3", "2x2x4", rows=8)
    assert kimi is not None and kimi.step_ms == pytest.approx(8.46, abs=0.005)
    qwen = _match("qwen3.8-27b", "2x2x1", rows=8)
    assert qwen is not None and qwen.step_ms == pytest.approx(3.96, abs=0.005)


def test_muse_spark_matches_by_its_weight_formats() -> None:
    assert _match("muse-spark-1.2", "2x2x1").step_ms == 3.59  # the shipped int4 experts
    fastest = _match(
        "muse-spark-1.2", "2x2x1", quant=["experts=nvfp4", "dense=int8", "lm_head=int8"]
    )
    assert fastest.step_ms == 3.26
    assert _match("muse-spark-1.2", "2x2x1", quant=["dense=int8"]) is None


def test_other_shapes_have_no_published_kernel() -> None:
    assert _match("kimi-k3", "2x2x4") is None  # rows 1
    assert _match("muse-spark-1.2", "2x2x1", batch=2) is None
    assert _match("qwen3-30b-a3b", "2x2x1") is None
    assert len({(h.model, h.quant) for h in HAND_WRITTEN}) == len(HAND_WRITTEN)


def test_an_edited_spec_of_the_same_name_is_not_the_published_model() -> None:
    base = load_spec("qwen3.8-27b")
    edited = base.model_copy(update={"description": "mine"})
    built = BuildOptions.create(rows=8)
    assert hand_written_for(edited, built.apply(edited), parse_topology("2x2x1"), built) is None


def test_the_charts_reference_points_are_labelled_as_the_seeds_state_them() -> None:
    """The TPU7x point (2.2M total tokens per $ at ~390 tokens/s per user) is Kimi K3 served
    by TorchTPU vLLM with the megakernels (InferenceX, agentic), not a Muse Spark kernel;
    every reference is a Kimi K3 point, which the notes say when the chart is another
    model's."""
    from mkgen.plan.report import estimate_chart_text
    from mkgen.plan.tco import PUBLISHED_PRICES, REFERENCES, scenario

    tpu = next(curve for curve in REFERENCES if curve.chip == "TPU7x")
    assert tpu.points == ((390.0, 2.2e6),)
    assert tpu.label == (
        "Kimi K3 on TPUv7 (InferenceX agentic benchmark, TorchTPU vLLM with megakernels)"
    )
    assert all(curve.label.startswith("Kimi K3 on ") for curve in REFERENCES)
    assert not any("Muse Spark" in curve.label for curve in REFERENCES)
    topo = parse_topology("2x2x1")
    _, notes = estimate_chart_text("qwen3-32b", topo, 1.21, scenario("agentic"), PUBLISHED_PRICES)
    assert "as published, not qwen3-32b" in notes[-1] and "Kimi K3" in notes[-1]
    _, notes = estimate_chart_text("kimi-k3", topo, 1.21, scenario("agentic"), PUBLISHED_PRICES)
    assert "as published;" in notes[-1]
    assert any("mean error -3.3 %" in note for note in notes)


def test_a_published_step_that_drafts_is_not_compared_as_like_for_like() -> None:
    from mkgen.plan.floor import IdealFloor
    from mkgen.plan.published import bar_text

    floor = IdealFloor(
        weight_bytes_per_core=9.572e9, expert_bytes_per_core=0, cache_bytes_per_core=0,
        stream_rate=3.2e12,
    )  # fmt: skip
    kimi = _match("kimi-k3", "2x2x4", rows=8)
    text = bar_text(6.967, floor, kimi)
    assert "18% faster, but not like for like" in text and "drafts nothing" in text
    muse = _match("muse-spark-1.2", "2x2x1")
    assert "like for like" not in bar_text(2.72, floor, muse)  # batch 1, no drafting
