"""Where mkgen writes: --force replaces only what mkgen wrote, a rebuild never deletes what
it did not write, a killed build is recovered by the next one, bad output paths are one
line (exit 2, nothing lost), and written files follow the umask."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cli_run import REPO, assert_user_error, mkgen_here

from mkgen.codegen import digest, package
from mkgen.codegen.package import make_build, render_build
from mkgen.codegen.writer import MANIFEST, local_edits, write_build
from mkgen.errors import MkgenError
from mkgen.output import write_atomic
from mkgen.plan.options import BuildOptions
from mkgen.spec.loader import load_spec
from mkgen.spec.topology import parse_topology

BUILD = ("build", "qwen3-32b", "--topology", "2x2x1")
HF_CONFIG = REPO / "tests" / "fixtures" / "hf" / "qwen3" / "config.json"


def _inputs():
    return load_spec("qwen3-32b"), parse_topology("2x2x1"), BuildOptions.create()


@pytest.fixture(scope="module")
def files() -> dict[str, str]:
    """A build without its mini twin: `mkgen build` renders it with one, so building over
    it with the CLI replaces it."""
    return render_build(*_inputs(), with_mini=False).files


def _snapshot(root: Path) -> dict[str, object]:
    """Every entry under `root`, links not followed: file bytes, link targets, folders."""
    entries: dict[str, object] = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            entries[rel] = ("link", os.readlink(path))
        elif path.is_dir():
            entries[rel] = "folder"
        else:
            entries[rel] = path.read_bytes()
    return entries


def _debris(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.parent.iterdir() if p.name.startswith("."))


# ---------------------------------------------------------------- what --force may replace


def test_force_never_replaces_a_git_repository(tmp_path: Path) -> None:
    repo = tmp_path / "work"
    repo.mkdir()
    (repo / "thesis.tex").write_text("years of work")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    before = _snapshot(repo)
    for force in ((), ("--force",)):
        result = mkgen_here(*BUILD, "-o", str(repo), *force)
        assert_user_error(result, f"{repo} holds files mkgen did not write", "give -o a new")
        assert "--force" not in result.stderr
    assert _snapshot(repo) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]


@pytest.mark.parametrize(
    ("target", "says"),
    [
        (REPO, "holds files mkgen did not write"),
        (REPO / "generated", "holds files mkgen did not write"),
        (Path("/dev/null"), "is not a directory"),
        (Path("/"), "is the filesystem root"),
    ],
)
def test_force_never_replaces_the_checkout_generated_dev_null_or_root(
    target: Path, says: str
) -> None:
    listing = sorted(os.listdir(target)) if target.is_dir() else None
    with pytest.raises(MkgenError, match=f"^{target} {says}.*give -o a new"):
        make_build(*_inputs(), output=target)
    result = mkgen_here(*BUILD, "-o", str(target), "--force")
    assert_user_error(result, f"{target} {says}", "give -o a new")
    assert "--force" not in result.stderr
    assert (sorted(os.listdir(target)) if target.is_dir() else None) == listing
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_root_is_refused_before_any_scan_or_rendering(monkeypatch) -> None:
    def forbidden(*args, **kwargs):
        raise AssertionError("scanned or rendered")

    monkeypatch.setattr(os, "scandir", forbidden)
    monkeypatch.setattr(package, "render_build", forbidden)
    with pytest.raises(MkgenError, match="^/ is the filesystem root"):
        make_build(*_inputs(), output=Path("/"), force=True)


def test_edits_to_mkgens_files_are_refused_without_force_and_replaced_with_it(
    tmp_path: Path, files: dict[str, str]
) -> None:
    target = tmp_path / "build"
    write_build(files, target, force=False)
    (target / "REPORT.md").write_text("my notes\n")
    (target / "plan.json").unlink()
    refused = mkgen_here(*BUILD, "-o", str(target))
    assert_user_error(refused, "REPORT.md was edited since mkgen wrote it", "pass --force")
    assert (target / "REPORT.md").read_text() == "my notes\n"
    forced = mkgen_here(*BUILD, "-o", str(target), "--force")
    assert forced.returncode == 0, forced.stderr
    assert local_edits(target) is None and (target / "mini" / "runner.py").exists()
    assert _debris(target) == []


# ---------------------------------------------------------------- a rebuild deletes nothing of the user's


def _pycache_notes(build: Path) -> None:
    (build / "__pycache__").mkdir()
    (build / "__pycache__" / "notes.txt").write_text("mine")


def _link_to_a_folder(build: Path) -> None:
    (build.parent / "data").mkdir()
    (build.parent / "data" / "weights.bin").write_bytes(b"\1\2\3")
    (build / "weights").symlink_to(build.parent / "data")


def _empty_folder(build: Path) -> None:
    (build / "scratch").mkdir()


def _link_to_a_file(build: Path) -> None:
    (build / "notes.md").symlink_to(build / "REPORT.md")


def _bytecode_of_a_users_module(build: Path) -> None:
    (build / "__pycache__").mkdir()
    (build / "__pycache__" / "mytool.cpython-312.pyc").write_bytes(b"\0")


@pytest.mark.parametrize(
    ("add", "added"),
    [
        (_pycache_notes, "__pycache__"),
        (_link_to_a_folder, "weights"),
        (_empty_folder, "scratch"),
        (_link_to_a_file, "notes.md"),
        (_bytecode_of_a_users_module, "__pycache__"),
    ],
)
def test_a_rebuild_refuses_to_delete_what_mkgen_did_not_write(
    tmp_path: Path, files: dict[str, str], add, added: str
) -> None:
    """Even with --force, and without suggesting it: the user moves it out first."""
    target = tmp_path / "build"
    write_build(files, target, force=False)
    add(target)
    before = _snapshot(tmp_path)
    refusal = (
        f"{target / added} was added since mkgen wrote the build; "
        f"mkgen does not delete what it did not write: move it out of {target}"
    )
    with pytest.raises(MkgenError) as refused:
        write_build({**files, "REPORT.md": "new\n"}, target, force=False)
    assert str(refused.value) == refusal
    result = mkgen_here(*BUILD, "-o", str(target), "--force")
    assert_user_error(result, refusal)
    assert "--force" not in result.stderr
    assert _snapshot(tmp_path) == before


def test_a_rebuild_drops_only_the_bytecode_of_the_builds_own_modules(
    tmp_path: Path, files: dict[str, str]
) -> None:
    """Python's cache of runner.py is not the user's: it goes with the build it was
    compiled from (a stale one could even be run, were the new file's size and mtime
    second the same)."""
    target = tmp_path / "build"
    tree = {**files, "mini/runner.py": files["runner.py"]}
    write_build(tree, target, force=False)
    for folder in (target, target / "mini"):
        (folder / "__pycache__").mkdir()
        (folder / "__pycache__" / "runner.cpython-312.pyc").write_bytes(b"\0")
    (target / "__pycache__" / "megakernel.cpython-312.opt-1.pyc").write_bytes(b"\0")
    assert local_edits(target) is None
    assert not write_build(tree, target, force=False)  # up to date: the caches stay
    assert (target / "mini" / "__pycache__" / "runner.cpython-312.pyc").exists()
    assert write_build({**tree, "REPORT.md": "new\n"}, target, force=False)
    assert not (target / "__pycache__").exists()
    assert not (target / "mini" / "__pycache__").exists()
    assert _debris(target) == []


# ---------------------------------------------------------------- a killed build


def _staging(target: Path, name: str, files: dict[str, str], manifest: bool = True) -> Path:
    """A staging directory as a build killed while writing leaves it: the manifest (written
    first), then some of the files."""
    staging = target.parent / f".{target.name}.{name}.tmp"
    staging.mkdir()
    if manifest:
        digests = {rel: digest.sha256_bytes(text.encode()) for rel, text in files.items()}
        (staging / MANIFEST).write_text(json.dumps({"files": digests}))
        (staging / "megakernel.py").write_text(files["megakernel.py"][:100])
    return staging


def test_the_next_build_removes_staging_directories_a_killed_build_left(
    tmp_path: Path, files: dict[str, str]
) -> None:
    target = tmp_path / "build"
    _staging(target, "abcdefgh", files)
    _staging(target, "ijklmnop", files, manifest=False)  # killed before the manifest
    (_staging(target, "cut_shor", files, manifest=False) / MANIFEST).write_text('{"fi')
    users = _staging(target, "qrstuvwx", files)
    (users / "notes.txt").write_text("not mkgen's")
    (tmp_path / ".build.tmp").mkdir()  # not a name mkgen gives
    assert write_build(files, target, force=False)
    assert local_edits(target) is None
    assert _debris(target) == [".build.qrstuvwx.tmp", ".build.tmp"]
    assert (users / "notes.txt").read_text() == "not mkgen's"


def test_a_kill_between_the_renames_gives_the_old_build_back(
    tmp_path: Path, files: dict[str, str]
) -> None:
    """The state a kill between moving the old build aside and moving the new one in
    leaves, built by hand: the next build restores the old one, edits and all, so that
    they are still refused without --force; then it cleans up."""
    target = tmp_path / "build"
    write_build(files, target, force=False)
    (target / "REPORT.md").write_text("my notes\n")
    target.rename(tmp_path / f".build.{'0' * 32}.old")
    _staging(target, "abcdefgh", files)
    refused = mkgen_here(*BUILD, "-o", str(target))
    assert_user_error(refused, "REPORT.md was edited since mkgen wrote it", "pass --force")
    assert (target / "REPORT.md").read_text() == "my notes\n"
    assert _debris(target) == []
    forced = mkgen_here(*BUILD, "-o", str(target), "--force")
    assert forced.returncode == 0, forced.stderr
    assert local_edits(target) is None and _debris(target) == []


def test_a_failing_rename_keeps_the_old_build_and_leaves_nothing(
    tmp_path: Path, files: dict[str, str], monkeypatch
) -> None:
    target = tmp_path / "build"
    write_build(files, target, force=False)
    before = _snapshot(tmp_path)
    real = os.rename

    def rename(source, destination):
        if str(source).endswith(".tmp"):
            raise OSError(28, "No space left on device")
        real(source, destination)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(MkgenError, match=f"^cannot write the build {target}: No space left"):
        write_build({**files, "REPORT.md": "new\n"}, target, force=False)
    assert _snapshot(tmp_path) == before


KILL_AT_SWAP = """
import os, signal, sys
real = os.rename
def rename(source, destination):
    if str(source).endswith(".tmp"):  # the new build's staging directory, moving in
        os.kill(os.getpid(), signal.SIGKILL)
    real(source, destination)
os.rename = rename
from mkgen.cli import main
main(sys.argv[1:])
"""


def test_a_build_killed_by_sigkill_mid_swap_is_recovered_by_the_next(
    tmp_path: Path, files: dict[str, str]
) -> None:
    target = tmp_path / "build"
    write_build(files, target, force=False)
    (target / "REPORT.md").write_text("my notes\n")
    killed = subprocess.run(
        [sys.executable, "-c", KILL_AT_SWAP, *BUILD, "-o", str(target), "--force"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONDONTWRITEBYTECODE": "1"},
    )  # fmt: skip
    assert killed.returncode == -9, killed.stderr
    assert not target.exists()
    assert sorted(name.rsplit(".", 1)[1] for name in _debris(target)) == ["old", "tmp"]
    refused = mkgen_here(*BUILD, "-o", str(target))  # the old build is back, with its edit
    assert_user_error(refused, "REPORT.md was edited since mkgen wrote it")
    assert _debris(target) == []
    forced = mkgen_here(*BUILD, "-o", str(target), "--force")
    assert forced.returncode == 0, forced.stderr
    assert local_edits(target) is None and (target / "mini" / "plan.json").exists()


# ---------------------------------------------------------------- output paths


def test_a_parent_that_is_a_file_is_one_line(tmp_path: Path) -> None:
    parent = tmp_path / "notes.txt"
    parent.write_text("mine")
    result = mkgen_here(*BUILD, "-o", str(parent / "sub" / "build"))
    assert_user_error(result, f"{parent} is not a directory, so {parent}/sub/build cannot")
    assert parent.read_text() == "mine"


@pytest.mark.parametrize("parent", ["/proc", "/sys"])
def test_a_parent_root_cannot_write_in_is_one_line(parent: str) -> None:
    result = mkgen_here(*BUILD, "-o", f"{parent}/mkgen-build")
    assert_user_error(result, f"cannot write {parent}/mkgen-build: {parent} is not writable")


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores mode bits (/proc and /sys cover it)")
def test_a_read_only_parent_is_one_line(tmp_path: Path) -> None:
    parent = tmp_path / "ro"
    parent.mkdir(mode=0o555)
    result = mkgen_here(*BUILD, "-o", str(parent / "build"))
    assert_user_error(result, f"{parent} is not writable")
    assert list(parent.iterdir()) == []


def test_an_immutable_parent_is_one_line(tmp_path: Path) -> None:
    parent = tmp_path / "immutable"
    parent.mkdir()
    if subprocess.run(["chattr", "+i", str(parent)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not permitted here")
    try:
        result = mkgen_here(*BUILD, "-o", str(parent / "build"))
        assert_user_error(result, f"{parent} is not writable (Operation not permitted)")
        assert list(parent.iterdir()) == []
    finally:
        subprocess.run(["chattr", "-i", str(parent)], check=True)


# ---------------------------------------------------------------- single files


def test_import_hf_force_overwrites_a_file_but_never_a_folder_or_a_device(
    tmp_path: Path,
) -> None:
    spec = tmp_path / "qwen3.yaml"
    spec.write_text("mine\n")
    refused = mkgen_here("import-hf", str(HF_CONFIG), "-o", str(spec))
    assert_user_error(refused, f"{spec} exists; pass --force to overwrite it")
    assert spec.read_text() == "mine\n"
    forced = mkgen_here("import-hf", str(HF_CONFIG), "-o", str(spec), "--force")
    assert forced.returncode == 0, forced.stderr
    assert spec.read_text().startswith("# Generated by mkgen import-hf")
    for target, says in ((tmp_path, "is a directory"), ("/dev/null", "is not a regular file")):
        result = mkgen_here("import-hf", str(HF_CONFIG), "-o", str(target), "--force")
        assert_user_error(result, f"{target} {says}; give a file path")
        assert "--force" not in result.stderr
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["qwen3.yaml"]


def test_plan_trace_replaces_its_own_trace_and_a_users_file_only_with_force(
    tmp_path: Path,
) -> None:
    trace = tmp_path / "trace.json"
    plan = ("plan", "qwen3-32b", "--topology", "2x2x1", "--trace", str(trace))
    assert mkgen_here(*plan).returncode == 0
    again = mkgen_here(*plan)  # its own trace: replaced without asking
    assert again.returncode == 0, again.stderr
    trace.write_text('{"traceEvents": []}')
    refused = mkgen_here(*plan)
    assert_user_error(refused, f"{trace} exists and is not a trace mkgen wrote", "--force")
    assert trace.read_text() == '{"traceEvents": []}'
    assert mkgen_here(*plan, "--force").returncode == 0
    assert "mkgen core 0" in trace.read_text()
    dev_null = mkgen_here("plan", "qwen3-32b", "--topology", "2x2x1", "--trace", "/dev/null")
    assert_user_error(dev_null, "/dev/null is not a regular file")


def test_estimate_replaces_its_own_files_but_never_a_users(tmp_path: Path) -> None:
    # One point (batch 1) is a table, a chart and their files; each point is a plan.
    estimate = ("estimate", "qwen3-32b", "--topology", "2x2x1", "--batches", "1")
    assert mkgen_here(*estimate, "-o", str(tmp_path)).returncode == 0
    again = mkgen_here(*estimate, "-o", str(tmp_path))  # its own files: replaced
    assert again.returncode == 0, again.stderr
    csv = tmp_path / "qwen3-32b-2x2x1-estimate.csv"
    csv.write_text("my,table\n")
    refused = mkgen_here(*estimate, "-o", str(tmp_path))
    assert_user_error(refused, f"{csv} exists and is not an estimate mkgen wrote")
    assert "--force" not in refused.stderr
    assert csv.read_text() == "my,table\n"
    into_a_file = mkgen_here(*estimate, "-o", str(csv))
    assert_user_error(into_a_file, f"{csv} is not a directory")


# ---------------------------------------------------------------- modes


@pytest.mark.parametrize(
    ("mask", "file_mode", "folder_mode"), [(0o022, 0o644, 0o755), (0o002, 0o664, 0o775)]
)
def test_written_files_follow_the_umask(
    tmp_path: Path, files: dict[str, str], mask: int, file_mode: int, folder_mode: int
) -> None:
    previous = os.umask(mask)
    try:
        write_build({**files, "mini/REPORT.md": "mini\n"}, tmp_path / "build", force=False)
        write_atomic(tmp_path / "spec.yaml", "a: 1\n", may_replace=lambda _: False, refusal="")
    finally:
        os.umask(previous)
    modes = {
        p.relative_to(tmp_path).as_posix(): stat.S_IMODE(p.stat().st_mode)
        for p in tmp_path.rglob("*")
    }
    folders = {"build", "build/mini"}
    assert modes == {p: folder_mode if p in folders else file_mode for p in modes}
    assert len(modes) == len(files) + 5  # the folders, mini/REPORT.md, manifest, spec.yaml
