"""`mkgen build / verify / compile / inspect / regen`: output, exit codes, one-line errors."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from cli_run import assert_user_error, mkgen, mkgen_here
from click.testing import CliRunner

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    directory = tmp_path_factory.mktemp("cli") / "qwen3-32b-2x2x1"
    return directory, mkgen_here("build", "qwen3-32b", "--topology", "2x2x1", "-o", str(directory))


def test_build_writes_the_directory_and_says_what_is_in_it(built) -> None:
    directory, result = built
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith(f"wrote {directory}/ in ")
    for fragment in (
        "qwen3-32b on tpu7x:2x2x1 (8 cores), batch 1 x rows 1, context 4096",
        "megakernel.py",
        "64 layers in a runtime loop",
        "runner.py",
        "plan.json",
        "REPORT.md",
        "ms/step",
        "mini/",
        "qwen3-32b-mini",
        "inputs sha256",
        "next: mkgen verify qwen3-32b --topology 2x2x1",
    ):
        assert fragment in out, fragment
    assert (directory / "megakernel.py").exists() and (directory / "mini" / "runner.py").exists()
    assert result.stderr == ""


def test_build_again_is_a_no_op_and_edits_need_force(built) -> None:
    directory, _ = built
    again = mkgen_here("build", "qwen3-32b", "--topology", "2x2x1", "-o", str(directory))
    assert again.returncode == 0 and "up to date" in again.stdout
    report = directory / "REPORT.md"
    original = report.read_text()
    report.write_text(original + "my notes\n")
    refused = mkgen_here("build", "qwen3-32b", "--topology", "2x2x1", "-o", str(directory))
    assert_user_error(refused, "REPORT.md was edited", "pass --force")
    assert report.read_text().endswith("my notes\n")
    forced = mkgen_here(
        "build", "qwen3-32b", "--topology", "2x2x1", "-o", str(directory), "--force"
    )
    assert forced.returncode == 0, forced.stderr
    assert report.read_text() == original


def test_unsupported_features_fail_in_one_line_and_write_nothing(tmp_path: Path) -> None:
    import yaml

    # Tied embeddings: the lm_head would be the embedding, which the stream does not hold.
    spec = yaml.safe_load((REPO / "model_specs" / "qwen3-32b.yaml").read_text())
    spec["name"] = "qwen3-32b-tied"
    spec["dims"]["tie_embeddings"] = True
    path = tmp_path / "spec" / "qwen3-32b-tied.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(spec))
    target = tmp_path / "build"
    result = mkgen_here("build", str(path), "--topology", "2x2x1", "-o", str(target))
    assert_user_error(result, "tied embeddings", "not supported by the")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec"]
    assert_user_error(mkgen_here("build", str(path), "--topology", "2x2x1"), "not supported by the")
    assert not (REPO / "generated" / "qwen3-32b-tied-2x2x1").exists()
    assert_user_error(mkgen("verify", str(path), "--topology", "2x2x1"), "not supported by the")
    # int4 groups a split would cut (they are not re-grouped): the error names one that fits.
    quant = ["--quant", "mlp=int4:128"]
    result = mkgen_here("build", "kimi-k2", "--topology", "2x2x4", *quant, "-o", str(target))
    assert_user_error(result, "576 per device", "(e.g. int4:64)")
    assert not target.exists()


def test_bad_inputs_are_one_line_exit_2(tmp_path: Path) -> None:
    assert_user_error(mkgen_here("build", "qwen3-32b", "--topology", "3x3x3"), "3x3x3")
    assert_user_error(
        mkgen_here("build", "qwen3-32b", "--topology", "2x2x1", "--batch", "0"), "--batch 0"
    )
    assert_user_error(mkgen_here("build", "no-such-model", "--topology", "2x2x1"), "no-such-model")
    assert_user_error(mkgen_here("inspect", str(tmp_path)), "not a build directory")
    assert_user_error(mkgen_here("build", "qwen3-32b"), "--topology")


def test_inspect_prints_the_outline_with_line_ranges(built) -> None:
    directory, _ = built
    result = mkgen_here("inspect", str(directory))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    source = (directory / "megakernel.py").read_text().splitlines()
    match = re.search(r"_attention_gqa lines (\d+)-(\d+)", out)
    assert match, out
    first, last = int(match.group(1)), int(match.group(2))
    assert source[first - 1].startswith("def _attention_gqa(")
    assert source[last].strip() == "" or not source[last].startswith(" ")
    for fragment in (
        "attention 'gqa' (gqa): layers 0-63 (64)",
        "ffn 'dense' (dense): layers 0-63 (64)",
        "matmul qkv [5120 x 1280] from the weight stream",
        "consumes rows +0..+25599 of the layer's attention",
        "_write_cache_gqa",
        "K and V tiles of 1024 tokens",  # the planner's choice for this build
        "all-reduce across 8 cores",
        "lm_head (once per step)",
        "kernel structure:",
        "_kernel ",
        "make_decode_step ",
        "VMEM map",
        "ring_vmem",
        "65792x256",  # 16 banks of 4096 rows and the 256-row wrap
    ):
        assert fragment in out, fragment
    # Every phase's range lies inside its function.
    for a, b in re.findall(r"\[lines (\d+)-(\d+)\]", out):
        assert int(a) <= int(b)


def test_inspect_outlines_the_moe_phases_of_a_checked_in_build() -> None:
    result = mkgen_here("inspect", "qwen3-30b-a3b-2x2x1")  # a name in generated/
    assert result.returncode == 0, result.stderr
    assert "ffn 'moe' (moe): layers 0-47 (48)" in result.stdout
    assert re.search(r"_route_moe: .*\[lines \d+-\d+\]", result.stdout)
    assert "streams in" in result.stdout and "through 4 expert slots" in result.stdout
    assert "SMEM scratch:" in result.stdout


def test_inspect_layer_shows_its_rows_banks_slot_and_source(built) -> None:
    directory, _ = built
    result = mkgen_here("inspect", str(directory / "mini"), "--layer", "1")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "layer 1 of 2 (qwen3-32b-mini on tpu7x:2x2x1)" in out
    assert "attention stream: first row" in out and "in flight on entry (ring of 4)" in out
    assert "cache slot 1 of kind 'gqa'" in out
    assert re.search(r"^\s+\d+  def _attention_gqa\(", out, re.M)
    assert re.search(r"^\s+\d+  def _ffn_dense\(", out, re.M)
    assert_user_error(mkgen_here("inspect", str(directory), "--layer", "64"), "--layer 64")


def test_compile_prints_seconds_and_vmem() -> None:
    result = mkgen("compile", "qwen3-32b", "--topology", "2x2x1")
    assert result.returncode == 0, result.stderr
    assert re.search(r"compiled in \d+\.\d s", result.stdout)
    assert re.search(r"VMEM: Mosaic uses \d+\.\d\d MiB \([\d,]+ B\)", result.stdout)
    assert result.stderr == ""


def test_compile_failure_exits_1_with_the_compilers_message(monkeypatch) -> None:
    from mkgen import cli
    from mkgen.verify import checks
    from mkgen.verify.tpu_compile import CompileError

    def refuse(*args, **kwargs):
        raise CompileError("TPU compile failed: Mosaic: scoped VMEM limit exceeded")

    monkeypatch.setattr(checks, "compile_full_size", refuse)
    result = CliRunner().invoke(cli.cli, ["compile", "qwen3-32b", "--topology", "2x2x1"])
    assert result.exit_code == 1
    assert "scoped VMEM limit exceeded" in result.output


def test_verify_failure_exits_1_naming_the_mode_step_and_check(monkeypatch) -> None:
    from mkgen import cli
    from mkgen.verify import checks
    from mkgen.verify.numerics import NumericsReport, StepCheck

    def run(spec_ref, topology, *, modes, steps, batch, rows, **_):
        report = NumericsReport(spec_ref, topology, 8, modes[0], batch, rows)
        bad = 0.5 if modes[0] == "eager" else 0.001
        fields = {  # the residual check's fields when the harness has them
            "max_residual_diff": 0.001,
            "residual_tolerance": 0.02,
            "first_diverging_layer": None,
            "cores_identical": True,
        }
        fields = {k: v for k, v in fields.items() if k in StepCheck.__dataclass_fields__}
        report.steps = [
            StepCheck(
                step=s,
                max_logit_diff=bad if s == 1 else 0.001,
                logit_tolerance=0.08,
                tokens_equal=1,
                tokens_near_tie=0,
                tokens_total=1,
                max_cache_diff=0.01,
                cache_tolerance=0.06,
                finite=True,
                seconds=1.0,
                **fields,
            )  # fmt: skip
            for s in range(steps)
        ]
        return [report]

    monkeypatch.setattr(checks, "run_verify", run)
    result = CliRunner().invoke(cli.cli, ["verify", "qwen3-32b", "--topology", "2x2x1"])
    assert result.exit_code == 1, result.output
    assert "DMA mode on_wait" in result.output and "DMA mode eager" in result.output
    last = result.output.strip().splitlines()[-1]
    assert last == "verify: FAILED: eager: step 1: logits differ by 0.5 (tolerance 0.08)"


def test_regen_rebuilds_every_listed_build(tmp_path: Path, monkeypatch) -> None:
    from mkgen import cli
    from mkgen.codegen import build_list, naming

    (tmp_path / "BUILDS").write_text("# checked-in builds\nqwen3-32b --topology 2x2x1\n")
    monkeypatch.setattr(naming, "GENERATED", tmp_path)
    monkeypatch.setattr(build_list, "BUILD_LIST", tmp_path / "BUILDS")
    runner = CliRunner()
    first = runner.invoke(cli.cli, ["regen"])
    assert first.exit_code == 0, first.output
    assert "qwen3-32b-2x2x1: rewritten (mkgen build qwen3-32b --topology 2x2x1)" in first.output
    (tmp_path / "qwen3-32b-2x2x1" / "runner.py").write_text("edited")
    second = runner.invoke(cli.cli, ["regen"])
    assert "rewritten" in second.output  # regen always forces
    assert (tmp_path / "qwen3-32b-2x2x1" / "runner.py").read_text() != "edited"
    third = runner.invoke(cli.cli, ["regen"])
    assert ": unchanged" in third.output


def test_regen_measure_verifies_each_build_at_its_recorded_seed(
    tmp_path: Path, monkeypatch
) -> None:
    """The seed of a build's recorded verify (Kimi K3's twin: 10, whose drafts are no near
    ties), else 0; read before the rebuild, which drops a record of another kernel text.
    The compile and verify are stubbed: what runs is the bookkeeping."""
    from mkgen import cli
    from mkgen.cli import build as build_commands
    from mkgen.codegen import build_list, naming
    from mkgen.codegen.package import record_measurement

    (tmp_path / "BUILDS").write_text("qwen3-32b --topology 2x2x1\n")
    monkeypatch.setattr(naming, "GENERATED", tmp_path)
    monkeypatch.setattr(build_list, "BUILD_LIST", tmp_path / "BUILDS")
    seeds = []
    monkeypatch.setattr(build_commands, "compile_and_print", lambda *args: None)
    monkeypatch.setattr(
        build_commands, "verify_and_print", lambda *args, seed, **kw: seeds.append(seed)
    )
    runner = CliRunner()
    assert runner.invoke(cli.cli, ["regen", "--measure"]).exit_code == 0
    record = {"steps_requested": 2, "batch": 1, "rows": 1, "context": 128, "seed": 10,
              "quant": [], "runs": []}  # fmt: skip
    record_measurement(tmp_path / "qwen3-32b-2x2x1", "verify", record)
    result = runner.invoke(cli.cli, ["regen", "--measure"])
    assert result.exit_code == 0, result.output
    assert seeds == [0, 10]


@pytest.mark.slow
def test_verify_passes_for_qwen3_32b_on_one_chip() -> None:
    # The CLI around verify_numerics (both DMA modes); 2x2x1 runs in test_codegen_numerics.
    result = mkgen("verify", "qwen3-32b", "--topology", "1x1x1", "--steps", "1", timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "tolerances: logits: max |kernel - reference| <= 0.01 + 0.02 x max |reference|" in out
    assert "DMA mode on_wait" in out and "DMA mode eager" in out
    assert "a failure names the step" in out
    assert out.strip().endswith("verify: passed (2 mode(s) x 1 step(s))")
