"""The drafter's step priced by the cost model (mkgen/plan/draft.py) and `--draft` on
`mkgen plan` and `mkgen estimate`: the passes, the estimate's fields, the bad inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_run import assert_user_error, mkgen_here

from mkgen.errors import SpecError
from mkgen.kinds import default_registry
from mkgen.plan import BuildOptions, plan_build
from mkgen.plan.draft import price_draft
from mkgen.plan.published import HAND_WRITTEN
from mkgen.spec.draft_import import drafter_target, list_drafter_names, load_drafter
from mkgen.spec.loader import load_spec
from mkgen.spec.topology import parse_topology

REPO = Path(__file__).resolve().parents[1]
KINDS = default_registry()
KIMI_TOPOLOGY = parse_topology("2x2x4")
QWEN_TOPOLOGY = parse_topology("2x2x1")


@pytest.fixture(scope="module")
def kimi_mtp():
    return load_drafter("kimi-k3-mtp", load_spec("kimi-k3"))


@pytest.fixture(scope="module")
def qwen_block():
    return load_drafter("qwen3.8-27b-dflash", load_spec("qwen3.8-27b"))


def _price(spec, topo, rows: int):
    return price_draft(spec, topo, BuildOptions.create(rows=rows), kinds=KINDS)


def test_mtp_draft_grows_with_rows_by_its_chained_single_row_passes(kimi_mtp) -> None:
    prices = {rows: _price(kimi_mtp, KIMI_TOPOLOGY, rows) for rows in (2, 4, 8)}
    for rows, price in prices.items():
        first, chained = price.passes
        assert (first.rows, first.count) == (rows, 1)
        assert (chained.rows, chained.count) == (1, rows - 2)
        assert price.ms == pytest.approx(sum(p.ms for p in price.passes))
        assert first.projection_ms > 0  # eh_proj, which the program cannot express
    assert prices[2].ms < prices[4].ms < prices[8].ms
    # Each chained draft adds one single-row pass, priced alike at any rows.
    per_pass = prices[8].passes[1].ms / 6
    assert prices[8].ms - prices[4].ms == pytest.approx(
        4 * per_pass + prices[8].passes[0].ms - prices[4].passes[0].ms
    )


def test_block_draft_is_one_pass_whatever_the_rows(qwen_block, kimi_mtp) -> None:
    short, full = _price(qwen_block, QWEN_TOPOLOGY, 2), _price(qwen_block, QWEN_TOPOLOGY, 8)
    for price in (short, full):
        (only,) = price.passes
        assert only.count == 1 and only.projection_ms > 0  # fc, the context features
    # 6 more rows add context rows to the one pass, not 6 more passes.
    assert full.ms - short.ms < 0.2 * short.ms
    chained = _price(kimi_mtp, KIMI_TOPOLOGY, 8).passes[1]
    assert chained.count == 6


def test_draft_price_grows_with_the_drafters_layers(qwen_block) -> None:
    draft = qwen_block.draft
    deeper = qwen_block.model_copy(update={"draft": draft.model_copy(update={"layers": 10})})
    assert _price(deeper, QWEN_TOPOLOGY, 8).ms > _price(qwen_block, QWEN_TOPOLOGY, 8).ms
    target = load_spec("qwen3-32b")

    def small_model(layers: int):
        model = target.model_copy(update={"layers": target.layers.model_copy(
            update={"count": layers})})  # fmt: skip
        return load_drafter_model(target, model)

    two, four = (_price(small_model(n), QWEN_TOPOLOGY, 8) for n in (2, 4))
    assert [p.count for p in two.passes] == [1, 6]
    assert four.ms > two.ms


def load_drafter_model(target, model):
    from mkgen.spec.draft import with_draft
    from mkgen.spec.schema import ModelDraft

    return with_draft(target, ModelDraft(kind="model", model=model))


def test_a_plan_without_a_drafter_is_unchanged(qwen_block) -> None:
    options = BuildOptions.create(rows=8, acceptance=6)
    plain = plan_build(load_spec("qwen3.8-27b"), QWEN_TOPOLOGY, options, kinds=KINDS)
    est = plain.estimate
    assert plain.draft is None and est.draft_ms is None
    assert est.drafted_step_ms == est.step_ms
    assert est.tokens_per_s_per_user == pytest.approx(6 / (est.step_ms / 1e3))
    assert "verify only, no drafting" in est.headline
    record = plain.to_dict()["estimate"]
    assert record["step_ms"] == record["verify_ms"] == est.step_ms
    assert record["draft_ms"] is None and record["draft"] is None
    # A draft section the plan is not asked to price adds only the hidden states the kernel
    # writes for the drafter (5 feature layers x 8 rows x 5120 f32: under a microsecond).
    unpriced = plan_build(qwen_block, QWEN_TOPOLOGY, options, kinds=KINDS)
    assert est.step_ms < unpriced.estimate.step_ms < est.step_ms + 1e-3
    assert unpriced.draft is None
    assert unpriced.hand_written == plain.hand_written


def test_plan_json_gives_verify_draft_and_their_sum() -> None:
    result = mkgen_here("plan", "qwen3.8-27b", "--topology", "2x2x1", "--rows", "8",
                   "--acceptance", "6", "--draft", "qwen3.8-27b-dflash", "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    est = json.loads(result.stdout)["estimate"]
    assert est["step_ms"] == pytest.approx(est["verify_ms"] + est["draft_ms"])
    assert est["draft_ms"] == pytest.approx(sum(p["ms"] for p in est["draft"]["passes"]))
    assert est["draft"]["drafter"].startswith("block: 5 layers, block_size 16")
    assert est["tokens_per_s_per_user"] == pytest.approx(6 / (est["step_ms"] / 1e3))
    assert sum(est["breakdown_ms"].values()) == pytest.approx(est["verify_ms"])
    assert est["hand_written"]["drafter"].startswith("DFlash2")
    # The calibrated step is verify + draft too, as the estimate's CSV gives it.
    assert est["calibrated_verify_ms"] > est["verify_ms"]
    assert est["calibrated_step_ms"] == pytest.approx(est["calibrated_verify_ms"] + est["draft_ms"])
    # So are the sensitivity table's steps: the core clock's catalog end (4.4 GHz) is the step.
    clock = next(r for r in est["sensitivity"] if r["input"] == "core clock (GHz)")
    assert clock["step_ms_high"] == pytest.approx(est["step_ms"])
    assert clock["step_ms_low"] > est["step_ms"]


def test_plan_text_says_verify_plus_draft_is_predicted_and_not_run() -> None:
    result = mkgen_here("plan", "kimi-k3", "--topology", "2x2x4", "--rows", "8", "--draft",
                   "kimi-k3-mtp")  # fmt: skip
    assert result.returncode == 0, result.stderr
    line = next(x for x in result.stdout.splitlines() if x.startswith("Estimate: "))
    assert (
        "ms/step at batch 1 x rows 8 (the draft priced as fused into the kernel; a build's "
        "runner drafts with it in a separate jitted JAX step between kernel calls; " in line
    )
    # The calibrated regime is of the verify step, and says so.
    calibrated = next(x for x in result.stdout.splitlines() if x.startswith("Calibrated regime"))
    assert "rows 8, the verify step alone (the draft adds " in calibrated
    verify, draft, total = (float(x) for x in _numbers(line))
    assert total == pytest.approx(verify + draft, abs=2e-3)  # each rounded to 1e-3
    bar = next(x for x in result.stdout.splitlines() if x.startswith("Against the bar: "))
    assert "like for like: both steps include drafting" in bar and "DSpark" in bar


def _numbers(line: str) -> tuple[str, str, str]:
    """The three figures of 'verify X + draft Y = Z ms/step'."""
    words = line.removeprefix("Estimate: predicted verify ").split()
    return words[0], words[3], words[5]


def test_estimate_prices_every_point_with_its_draft() -> None:
    from mkgen.plan.report import sweep
    from mkgen.plan.tco import scenario

    spec = load_drafter("qwen3.8-27b-dflash", load_spec("qwen3.8-27b"))
    options = BuildOptions.create(rows=8, acceptance=6)
    (row,) = sweep(spec, QWEN_TOPOLOGY, options, scenario("decode"), batches=(1,), rows=(8,),
                   kinds=KINDS, price_drafter=True)  # fmt: skip
    plan = plan_build(spec, QWEN_TOPOLOGY, options, kinds=KINDS, price_drafter=True)
    assert row.step_ms == pytest.approx(plan.estimate.drafted_step_ms)
    assert row.calibrated_step_ms == pytest.approx(plan.confidence.record()["calibrated_step_ms"])
    assert row.tokens_per_s_per_user == pytest.approx(6 / (row.step_ms / 1e3))
    from mkgen.plan.report import estimate_chart_text

    _, notes = estimate_chart_text("qwen3.8-27b", QWEN_TOPOLOGY, 1.21, scenario("decode"), {},
                                   "qwen3.8-27b-dflash")  # fmt: skip
    assert "its step verify + draft with --draft qwen3.8-27b-dflash" in notes[0]


def test_each_seed_names_a_shipped_drafter_for_its_model() -> None:
    seeds = [hand for hand in HAND_WRITTEN if hand.drafting]
    assert {hand.shipped_drafter for hand in seeds} <= set(list_drafter_names())
    for hand in seeds:
        assert hand.drafter and drafter_target(hand.shipped_drafter) == hand.model
        assert load_drafter(hand.shipped_drafter, load_spec(hand.model)).draft is not None


def _drafter_file(tmp_path: Path, target: str, **fields) -> str:
    base = {"kind": "block", "hidden": 5120, "layers": 2, "norm_eps": 1e-6, "block_size": 16,
            "feature_layers": [1, 61], "mask_token": 248070,
            "attention": {"type": "gqa", "num_heads": 32, "num_kv_heads": 8, "head_dim": 128},
            "ffn": {"type": "dense", "width": 1024, "activation": "silu"}}  # fmt: skip
    path = tmp_path / "drafter.yaml"
    path.write_text(json.dumps({"target": target, "draft": {**base, **fields}}))
    return str(path)


@pytest.mark.parametrize(
    ("target", "draft", "fragment"),
    [
        ("kimi-k3", "mtp", "kimi-k3: draft mtp needs the target's multi-token-prediction"),
        ("qwen3-32b", "qwen3.8-27b-dflash", "drafts for qwen3.8-27b, not qwen3-32b"),
        ("qwen3-32b", "mkgen/model_specs/hf-configs/mixtral-8x7b.json", "vocabulary 32000"),
        ("qwen3.8-27b", "tests/fixtures/hf/drafters/dflash_qwen3/config.json", "draft.hidden"),
        ("qwen3.8-27b", "nothing-such", "not mtp, not a drafter spec"),
    ],
)
def test_a_drafter_that_does_not_fit_is_one_line(target, draft, fragment) -> None:
    with pytest.raises(SpecError, match=fragment.replace("(", r"\(")) as error:
        load_drafter(str(REPO / draft) if "/" in draft else draft, load_spec(target))
    assert "\n" not in str(error.value)


def test_a_drafter_file_with_missing_feature_layers_or_a_short_block_is_one_line(tmp_path) -> None:
    target = load_spec("qwen3.8-27b")
    missing = _drafter_file(tmp_path, "qwen3.8-27b", feature_layers=[1, 70])
    with pytest.raises(SpecError, match="draft.feature_layers: layer 70 does not exist"):
        load_drafter(missing, target)
    short = load_drafter(_drafter_file(tmp_path, "qwen3.8-27b", block_size=4), target)
    with pytest.raises(SpecError, match="lower --rows to 4"):
        _price(short, QWEN_TOPOLOGY, 8)
    with pytest.raises(SpecError, match=r"drafter.yaml: draft.blocks: unknown key"):
        load_drafter(_drafter_file(tmp_path, "qwen3.8-27b", blocks=2), target)


def test_draft_on_the_command_line_refuses_bad_input_in_one_line(tmp_path) -> None:
    assert_user_error(
        mkgen_here("plan", "kimi-k3", "--topology", "2x2x4", "--draft", "kimi-k3-mtp"),
        "--draft kimi-k3-mtp: --rows 1 verifies no drafts", "--rows 2 or more",
    )  # fmt: skip
    missing = _drafter_file(tmp_path, "qwen3.8-27b", feature_layers=[70])
    assert_user_error(
        mkgen_here("plan", "qwen3.8-27b", "--topology", "2x2x1", "--rows", "8", "--draft", missing),
        "qwen3.8-27b: draft.feature_layers: layer 70 does not exist",
    )
    assert_user_error(
        mkgen_here("estimate", "qwen3.8-27b", "--topology", "2x2x1", "--draft", "qwen3.8-27b-dflash",
              "-o", str(tmp_path)),
        "--rows 1 verifies no drafts",
    )  # fmt: skip
    assert not list(tmp_path.glob("*estimate*"))


@pytest.mark.parametrize("command", ["build", "verify", "compile"])
def test_build_verify_and_compile_refuse_a_bad_draft_in_one_line(command, tmp_path) -> None:
    """They take --draft as plan does: on rows 1, or a drafter the spec lacks, one line."""
    out = ["-o", str(tmp_path / "b")] if command == "build" else []
    base = [command, "qwen3.8-27b", "--topology", "2x2x1", *out, "--draft"]
    assert_user_error(mkgen_here(*base, "qwen3.8-27b-dflash"), "--rows 1 verifies no drafts")
    assert_user_error(mkgen_here(*base, "mtp", "--rows", "8"), "draft mtp needs")


def test_a_build_with_a_drafter_carries_it_and_prices_verify_plus_draft(tmp_path) -> None:
    """`build --draft`: the spec in plan.json holds the drafter (the inputs hash covers
    it), the header and rebuild line name it, the plan prices verify + draft, and a
    generated/BUILDS line with the same --draft renders the same build."""
    from mkgen.codegen.build_list import entry_inputs, read_build_list
    from mkgen.codegen.naming import CommandLine
    from mkgen.codegen.package import render_build

    config = str(REPO / "tests" / "fixtures" / "hf" / "qwen3" / "config.json")
    flags = [config, "--topology", "1x1x1", "--rows", "3", "--context", "64", "--draft", config]
    result = mkgen_here("build", *flags, "-o", str(tmp_path / "b"))
    assert result.returncode == 0, result.stderr
    plan = json.loads((tmp_path / "b" / "plan.json").read_text())
    assert plan["spec"]["draft"]["kind"] == "model"
    assert f"--draft {config}" in plan["build"]["rebuild"]
    estimate = plan["plan"]["estimate"]
    assert estimate["draft_ms"] > 0
    assert estimate["step_ms"] == pytest.approx(estimate["verify_ms"] + estimate["draft_ms"])
    assert "drafter model: config, 2 layers" in (tmp_path / "b" / "runner.py").read_text()
    (tmp_path / "BUILDS").write_text(" ".join(flags) + "\n")
    (entry,) = read_build_list(tmp_path / "BUILDS")
    line = CommandLine(spec=config, draft=entry.draft)
    again = render_build(*entry_inputs(entry), line=line)
    assert again.inputs_sha256 == plan["build"]["inputs_sha256"]
    assert again.files["runner.py"] == (tmp_path / "b" / "runner.py").read_text()
    plain = render_build(*entry_inputs(entry.__class__(**{**vars(entry), "draft": None})))
    assert plain.inputs_sha256 != again.inputs_sha256


def test_the_bar_names_both_drafters_and_the_draft_that_makes_it_like_for_like() -> None:
    from mkgen.plan.floor import IdealFloor
    from mkgen.plan.published import bar_text

    floor = IdealFloor(
        weight_bytes_per_core=9.572e9, expert_bytes_per_core=0, cache_bytes_per_core=0,
        stream_rate=3.2e12,
    )  # fmt: skip
    (kimi,) = (hand for hand in HAND_WRITTEN if hand.model == "kimi-k3")
    build = bar_text(6.967, floor, kimi)  # a build: it drafts nothing
    assert "with a DSpark drafter" in build and "not like for like" in build
    command = "mkgen plan kimi-k3 --topology 2x2x4 --rows 8 --draft kimi-k3-mtp"
    assert f"`{command}` prices verify + draft" in build
    drafted = bar_text(6.967, floor, kimi, 0.747, "mtp: 1 module(s)")
    assert "verify 6.967 + draft 0.747 = 7.714 ms (predicted, drafter mtp: 1 module(s))" in drafted
    assert "9% faster, like for like" in drafted and "not like for like" not in drafted
    assert "the predicted verify step is 2.3x the ideal floor" in drafted
