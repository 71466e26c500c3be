"""The wheel: built from the checkout and installed into a fresh venv, the `mkgen` command
works from a directory outside the checkout and builds what the checkout builds."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from mkgen.spec.loader import list_spec_names

REPO = Path(__file__).resolve().parents[1]
BUILD = "qwen3-30b-a3b-2x2x1"  # a checked-in build (generated/BUILDS) that renders quickly


def _run(
    command: list[str | Path], cwd: Path, *, isolated: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run `command`; `isolated` drops PYTHONPATH (a checkout on it would shadow the installed
    package); pip runs as this interpreter does, with this test's environment."""
    env = {k: v for k, v in os.environ.items() if not (isolated and k == "PYTHONPATH")}
    result = subprocess.run(
        [str(part) for part in command],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**env, "JAX_PLATFORMS": "cpu", "PYTHONDONTWRITEBYTECODE": "1"},
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the venv's bin directory, a working directory outside the checkout)."""
    work = tmp_path_factory.mktemp("wheel")
    # Built from a copy: setuptools writes build/ and an egg-info beside its source.
    source = work / "source"
    shutil.copytree(REPO / "mkgen", source / "mkgen", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    pip = [sys.executable, "-m", "pip"]
    offline = ["--no-deps", "--no-index", "--no-cache-dir"]
    _run(
        [*pip, "wheel", *offline, "--no-build-isolation", "-w", work, source], work, isolated=False
    )
    (wheel,) = work.glob("mkgen_tpu-*.whl")
    environment = work / "venv"
    venv.create(environment, with_pip=False)
    python = environment / "bin" / "python"
    _run([*pip, "--python", python, "install", *offline, wheel], work, isolated=False)
    # The dependencies: this interpreter's site-packages, instead of downloading them again.
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], work)
    Path(purelib.stdout.strip(), "dependencies.pth").write_text(
        "\n".join(site.getsitepackages()) + "\n"
    )
    outside = work / "elsewhere"
    outside.mkdir()
    return environment / "bin", outside


def test_the_installed_package_is_the_wheel_with_its_data(installed: tuple[Path, Path]) -> None:
    bin_dir, outside = installed
    origin = _run([bin_dir / "python", "-c", "import mkgen; print(mkgen.__file__)"], outside)
    package = Path(origin.stdout.strip()).parent
    assert package.is_relative_to(bin_dir.parent)
    # The configs the shipped specs were imported from travel with them (list and build below
    # use the templates and the specs).
    shipped = REPO / "mkgen" / "model_specs" / "hf-configs"
    in_wheel = package / "model_specs" / "hf-configs"
    assert sorted(p.name for p in in_wheel.iterdir()) == sorted(p.name for p in shipped.iterdir())
    # So do the drafter specs `mkgen plan --draft NAME` reads.
    drafters = REPO / "mkgen" / "model_specs" / "drafters"
    in_wheel = package / "model_specs" / "drafters"
    assert sorted(p.name for p in in_wheel.iterdir()) == sorted(p.name for p in drafters.iterdir())


def test_mkgen_list_shows_every_shipped_spec(installed: tuple[Path, Path]) -> None:
    bin_dir, outside = installed
    listed = _run([bin_dir / "mkgen", "list"], outside).stdout
    names = list_spec_names()
    assert len(names) == 8
    for name in names:
        assert f"\n  {name} " in listed, name


def test_mkgen_build_outside_the_checkout_equals_the_checked_in_build(
    installed: tuple[Path, Path],
) -> None:
    bin_dir, outside = installed
    _run([bin_dir / "mkgen", "build", "qwen3-30b-a3b", "--topology", "2x2x1", "-o", "out"], outside)
    built, checked_in = outside / "out", REPO / "generated" / BUILD
    for name in ("megakernel.py", "runner.py", "plan.json", "REPORT.md", "mini/megakernel.py"):
        assert (built / name).is_file(), name
    # A build names no output directory: `-o out` gives the checked-in bytes.
    for name in ("megakernel.py", "runner.py", "plan.json", "mini/megakernel.py"):
        assert (built / name).read_bytes() == (checked_in / name).read_bytes(), name


def test_mkgen_build_of_the_installed_package_writes_into_the_working_directory(
    installed: tuple[Path, Path],
) -> None:
    bin_dir, outside = installed
    _run([bin_dir / "mkgen", "build", "qwen3-32b", "--topology", "2x2x1"], outside)
    assert (outside / "generated" / "qwen3-32b-2x2x1" / "megakernel.py").is_file()
    assert not list(bin_dir.parent.rglob("qwen3-32b-2x2x1"))
