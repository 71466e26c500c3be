"""The command line: output, JSON shape, exit codes and errors without tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cli_run import assert_user_error, mkgen

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "reference"


def test_list_names_specs_and_topologies() -> None:
    result = mkgen("list")
    assert result.returncode == 0, result.stderr
    assert "kimi-k3" in result.stdout and "qwen3.8-27b" in result.stdout
    assert "2x2x4" in result.stdout and "tpu7x" in result.stdout


def test_show_human_output() -> None:
    result = mkgen("show", "kimi-k3")
    assert result.returncode == 0, result.stderr
    assert "2.78 T total" in result.stdout
    assert "mla (mla) x24" in result.stdout
    assert "mxfp4" in result.stdout


def test_show_json_has_the_documented_keys() -> None:
    result = mkgen("show", "qwen3.8-27b", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    for key in (
        "name",
        "params_total",
        "params_active",
        "bytes_by_family",
        "cache_bytes_per_token",
    ):
        assert key in data
    assert data["name"] == "qwen3.8-27b"
    assert len(data["layers"]) == 64
    assert data["layers"][3] == {
        "index": 3,
        "attention": "full",
        "attention_type": "gqa",
        "ffn": "mlp",
        "ffn_type": "dense",
    }
    assert data["cache_bytes_per_token"] == 16 * 2 * 4 * 256 * 2


def test_show_accepts_a_yaml_path(tmp_path: Path) -> None:
    spec = tmp_path / "copy.yaml"
    spec.write_text((REPO / "model_specs" / "muse-spark-1.2.yaml").read_text())
    result = mkgen("show", str(spec), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["name"] == "muse-spark-1.2"


def test_show_does_not_import_jax() -> None:
    code = (
        "import sys, time; t = time.perf_counter();"
        "from mkgen.cli import main;"
        "import contextlib, io;"
        "out = io.StringIO();"
        "ctx = contextlib.redirect_stdout(out);"
        "ctx.__enter__(); main(['show', 'kimi-k3']); ctx.__exit__(None, None, None);"
        "print(time.perf_counter() - t, 'jax' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    _, jax_imported = result.stdout.split()
    # What keeps `show` fast (under 2 s; `make bench` times it): JAX is never imported.
    assert jax_imported == "False"


@pytest.mark.parametrize(
    ("content", "fragments"),
    [
        ("name: x\ndims: [\n", ("malformed YAML",)),
        ("name: tiny\nfoo: 1\n", ("foo: unknown key",)),
        ("- a\n", ("expected a mapping",)),
    ],
    ids=["malformed", "unknown-key", "not-a-mapping"],
)
def test_bad_spec_file_is_exit_2_one_line(tmp_path: Path, content: str, fragments: tuple) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    assert_user_error(mkgen("show", str(path)), "bad.yaml", *fragments)


def test_unknown_spec_name_is_exit_2() -> None:
    assert_user_error(mkgen("show", "no-such-model"), "unknown spec 'no-such-model'")


def test_unknown_command_and_option_are_exit_2() -> None:
    assert_user_error(mkgen("frobnicate"), "No such command")
    assert_user_error(mkgen("show", "kimi-k3", "--colour"), "--colour")


# ------------------------------------------------------------------ checkpoint directories


@pytest.fixture
def checkpoint_dir(tmp_path: Path) -> Path:
    """A Hugging Face checkpoint directory whose name has a dot (not a file suffix)."""
    directory = tmp_path / "Qwen3.5-MoE-Tiny"
    directory.mkdir()
    config = REPO / "tests" / "fixtures" / "hf" / "qwen3_moe" / "config.json"
    (directory / "config.json").write_text(config.read_text())
    return directory


def test_show_takes_a_checkpoint_directory_named_after_it(checkpoint_dir: Path) -> None:
    result = mkgen("show", str(checkpoint_dir), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["name"] == "qwen3.5-moe-tiny"


def test_import_hf_takes_a_checkpoint_directory(checkpoint_dir: Path) -> None:
    result = mkgen("import-hf", str(checkpoint_dir))
    assert result.returncode == 0, result.stderr
    assert "\nname: qwen3.5-moe-tiny\n" in result.stdout


def test_plan_and_build_take_a_checkpoint_directory(checkpoint_dir: Path, tmp_path: Path) -> None:
    plan = mkgen("plan", str(checkpoint_dir), "--topology", "1x1x1", "--json")
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["model"] == "qwen3.5-moe-tiny"
    build = mkgen("build", str(checkpoint_dir), "--topology", "1x1x1", "-o", str(tmp_path / "b"))
    assert build.returncode == 0, build.stderr
    assert "qwen3.5-moe-tiny on tpu7x:1x1x1" in build.stdout


def test_a_directory_without_config_json_is_one_line(tmp_path: Path) -> None:
    result = mkgen("show", str(tmp_path))
    assert_user_error(result, "no config.json in this directory")


def test_a_shipped_name_wins_over_a_directory_of_that_name(tmp_path: Path) -> None:
    (tmp_path / "qwen3-32b").mkdir()
    shipped = mkgen("show", "qwen3-32b", cwd=tmp_path)
    assert shipped.returncode == 0, shipped.stderr
    assert_user_error(mkgen("show", "./qwen3-32b", cwd=tmp_path), "no config.json")
