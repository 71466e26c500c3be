"""Writing a build directory: atomically, guarded by a manifest, never over what mkgen did
not write.

- Atomic: the files are written and checked in a staging directory beside the target
  (``.NAME.XXXXXXXX.tmp``, manifest first), which then replaces the target by rename (the
  old build is moved aside to ``.NAME.<uuid>.old`` first and restored if the rename
  fails); no half-written build is ever left. A build killed midway is recovered by the
  next one: after a kill between the two renames the old build goes back, and leftovers
  holding nothing but what mkgen wrote are removed (builds in one folder take turns
  under an flock of the folder, so none mistakes another's staging for debris).
- Nothing mkgen did not write is ever deleted. A target is replaced only when it is new,
  empty, or a build with a manifest. Edits to the files the manifest lists (changed or
  deleted) are refused without ``force`` and overwritten with it. Anything else (a
  directory without a manifest, files, links or empty folders added to a build) is
  refused even with ``force``, and the message does not suggest it. The one exception is
  Python's bytecode of the build's own modules (``__pycache__/runner.cpython-312.pyc``,
  written when a user runs runner.py): a derivative of mkgen's files, stale once they
  change, it goes with the build it was compiled from.
- Output paths are checked before rendering: the filesystem root, a non-directory, a
  parent that is a file or that root cannot write (probed: /proc, /sys, read-only or
  immutable) give one line. Files and folders get the umask's modes.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from mkgen import __version__
from mkgen.codegen.digest import dump_json, sha256_bytes
from mkgen.errors import MkgenError
from mkgen.output import check_parent, resolved_target, umask

MANIFEST = ".mkgen-manifest.json"

# What a user whose directory mkgen may not replace can do instead.
_NEW_DIRECTORY = "give -o a new or empty directory, or a build mkgen wrote"
_FORCE = "pass --force to overwrite the build"
# Python's bytecode of a module, e.g. __pycache__/runner.cpython-312.pyc (or .opt-1.pyc).
_BYTECODE = re.compile(r"(?P<module>[^.]+)\.[^/]+\.pyc")


@dataclass(frozen=True)
class _Difference:
    """How a directory differs from the build mkgen wrote there."""

    reason: str
    remedy: str | None  # None: only files mkgen wrote differ, which --force may overwrite


def _read_manifest(directory: Path) -> dict[str, str]:
    """The manifest's {relative path: sha256}; ValueError when it is damaged."""
    try:
        files = json.loads((directory / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"unreadable: {error}") from None
    if not isinstance(files, dict) or not all(
        isinstance(rel, str)
        and isinstance(digest, str)
        and rel == PurePosixPath(rel).as_posix()
        and not PurePosixPath(rel).is_absolute()
        and ".." not in PurePosixPath(rel).parts
        for rel, digest in files.items()
    ):
        raise ValueError("not a map of relative paths to digests")
    return files


def _own_bytecode(cache: Path, folder: str, listed: set[str]) -> bool:
    """Whether the __pycache__ `cache` holds nothing but Python's bytecode of listed modules:
    Python writes it when a user runs runner.py, and it is only a derivative of mkgen's files
    (stale once they change), so it goes with the build it was compiled from."""
    prefix = f"{folder}/" if folder else ""
    with os.scandir(cache) as scan:
        return all(
            entry.is_file(follow_symlinks=False)
            and (match := _BYTECODE.fullmatch(entry.name)) is not None
            and f"{prefix}{match['module']}.py" in listed
            for entry in scan
        )


def _foreign(directory: Path, files: Collection[str]) -> Iterator[Path]:
    """Everything in `directory` mkgen did not write: anything but the listed files, the
    folders holding them, the manifest and the bytecode of listed modules. Links are never
    followed: a link (to a file or a directory) is itself something mkgen did not write."""
    listed = {*files, MANIFEST}
    folders = {parent.as_posix() for rel in files for parent in PurePosixPath(rel).parents}
    pending = [""]
    while pending:
        folder = pending.pop()
        with os.scandir(directory / folder) as scan:
            entries = sorted(scan, key=lambda entry: entry.name)
        for entry in entries:
            rel = f"{folder}/{entry.name}" if folder else entry.name
            if entry.is_dir(follow_symlinks=False) and rel in folders:
                pending.append(rel)
            elif not (
                (entry.is_file(follow_symlinks=False) and rel in listed)
                or (
                    entry.name == "__pycache__"
                    and entry.is_dir(follow_symlinks=False)
                    and _own_bytecode(Path(entry.path), folder, listed)
                )
            ):
                yield directory / rel


def _difference(directory: Path) -> _Difference | None:
    """How `directory` differs from the build mkgen wrote there (None: it is that build, or
    it does not exist or is empty)."""
    if not os.path.lexists(directory):
        return None
    if not directory.is_dir():
        return _Difference(f"{directory} is not a directory", _NEW_DIRECTORY)
    if not (directory / MANIFEST).is_file():
        with os.scandir(directory) as scan:
            if next(scan, None) is None:
                return None
        return _Difference(
            f"{directory} holds files mkgen did not write (no {MANIFEST})", _NEW_DIRECTORY
        )
    try:
        files = _read_manifest(directory)
    except ValueError:
        return _Difference(
            f"{directory / MANIFEST} is damaged, so mkgen cannot tell its files from others",
            _NEW_DIRECTORY,
        )
    for path in _foreign(directory, files):
        return _Difference(
            f"{path} was added since mkgen wrote the build",
            f"mkgen does not delete what it did not write: move it out of {directory}",
        )
    for rel, digest in sorted(files.items()):
        path = directory / rel
        if not path.exists():
            return _Difference(f"{path} was deleted since mkgen wrote it", None)
        if sha256_bytes(path.read_bytes()) != digest:
            return _Difference(f"{path} was edited since mkgen wrote it", None)
    return None


def local_edits(directory: Path) -> str | None:
    """Why `directory` is not exactly the build mkgen wrote there, or None if it is."""
    found = _difference(directory)
    return found.reason if found else None


def refuse(directory: Path, force: bool, fix_edits: str) -> _Difference | None:
    """MkgenError unless `directory` is new, empty, the build mkgen wrote there, or (with
    `force`) that build with files mkgen wrote edited or deleted, which is returned.
    --force is suggested only for those: it never replaces what mkgen did not write."""
    found = _difference(directory)
    if found is not None and (found.remedy is not None or not force):
        raise MkgenError(f"{found.reason}; {found.remedy or fix_edits}")
    return found


def check_target(target: Path, force: bool) -> Path:
    """`target` absolute with links resolved, once a build may be written there: checked
    before any rendering, and before any scan (`-o /` would walk the whole filesystem)."""
    resolved = resolved_target(target, _NEW_DIRECTORY)
    try:
        refuse(resolved, force, _FORCE)
    except OSError as error:
        raise MkgenError(f"cannot read {target}: {error.strerror or error}") from None
    check_parent(resolved)
    return resolved


@contextmanager
def _lock(folder: Path) -> Iterator[None]:
    """Builds beside each other take turns, so that none takes another's staging
    directory for the debris of a killed build. flock on the folder itself: the kernel
    releases it when a build is killed, and it leaves no file behind."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _recover(target: Path) -> None:
    """Clean up after a build of `target` that was killed: staging directories
    (`.NAME.XXXXXXXX.tmp`) and previous builds moved aside for the swap (`.NAME.<uuid>.old`).

    A kill between the swap's two renames leaves no build at `target`: the old one goes
    back (the state before that command; a partly written new one proves nothing). The
    rest is removed when it holds nothing but what mkgen wrote (its manifest, the files
    it lists, whole or partly written); anything else there is left alone."""
    debris_name = re.compile(
        rf"\.{re.escape(target.name)}\.(?:[a-z0-9_]{{8}}\.tmp|[0-9a-f]{{32}}\.old)"
    )
    with os.scandir(target.parent) as scan:
        debris = sorted(
            Path(entry.path)
            for entry in scan
            if debris_name.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)
        )
    moved_aside = [path for path in debris if path.suffix == ".old" and (path / MANIFEST).is_file()]
    if moved_aside and not os.path.lexists(target):
        newest = max(moved_aside, key=lambda path: (path / MANIFEST).stat().st_mtime_ns)
        os.rename(newest, target)
        debris.remove(newest)
    for path in debris:
        try:
            files = _read_manifest(path) if (path / MANIFEST).is_file() else {}
        except ValueError:
            files = {}  # a manifest cut short by the kill: nothing else was written yet
        if next(_foreign(path, files), None) is None:
            _remove_written(path)


def _remove_written(directory: Path) -> None:
    """Remove a directory mkgen wrote, its manifest last, so that a kill midway leaves a
    directory still recognisable as mkgen's (and removed by the next build)."""
    with os.scandir(directory) as scan:
        for entry in scan:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            elif entry.name != MANIFEST:
                os.unlink(entry.path)
    (directory / MANIFEST).unlink(missing_ok=True)
    directory.rmdir()


def _write_tree(root: Path, files: Mapping[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8", newline="\n") as handle:
            handle.write(text)


def _swap_in(target: Path, tree: Mapping[str, str], digests: Mapping[str, str]) -> None:
    """Write `tree` to a staging directory beside `target`, check it, then rename it to
    `target`; an existing `target` is moved aside first and removed last."""
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        os.chmod(staging, 0o777 & ~umask())  # mkdtemp makes it 0700
        _write_tree(staging, tree)
        for rel, digest in digests.items():  # read back before anything is replaced
            if sha256_bytes((staging / rel).read_bytes()) != digest:
                raise MkgenError(f"{rel}: written bytes differ from the rendered text")
            if rel.endswith(".py"):
                compile(tree[rel], rel, "exec")
        if os.path.lexists(target):
            old = target.parent / f".{target.name}.{uuid.uuid4().hex}.old"
            os.rename(target, old)
            try:
                os.rename(staging, target)
            except BaseException:
                os.rename(old, target)
                raise
            with suppress(OSError):  # the new build is in place; the next build retries
                _remove_written(old)
        else:
            os.rename(staging, target)
    except BaseException:
        with suppress(OSError):
            _remove_written(staging)
        raise


def write_build(files: Mapping[str, str], target: Path, *, force: bool) -> bool:
    """Write `files` (relative path -> text) as the build directory `target`, atomically.

    Returns False when the directory already holds exactly these files (nothing is
    written). Raises MkgenError, with nothing changed, when `target` is not a place for
    a build (see check_target), holds anything mkgen did not write, or has local edits
    to mkgen's files and `force` is not set. Debris of a killed build is cleaned up first."""
    target = check_target(target, force)
    manifest = {
        "files": {rel: sha256_bytes(text.encode()) for rel, text in sorted(files.items())},
        "generator": f"mkgen {__version__}",
    }
    manifest_text = dump_json(manifest)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with _lock(target.parent):
            _recover(target)
            # Again: a recovered build, or edits made while we rendered.
            edits = refuse(target, force, _FORCE)
            current = target / MANIFEST
            if edits is None and current.is_file() and current.read_text() == manifest_text:
                return False
            # The manifest first: a staging directory cut short by a kill is recognisable.
            _swap_in(target, {MANIFEST: manifest_text, **files}, manifest["files"])
    except OSError as error:
        raise MkgenError(f"cannot write the build {target}: {error.strerror or error}") from None
    return True
