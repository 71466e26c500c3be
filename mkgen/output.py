"""Where mkgen writes: output paths checked before any work, single files written atomically,
and the progress bars drawn on stderr.

Both refuse in one line (MkgenError) rather than fail half-way with a traceback: the
filesystem root, a path under a file, under /proc or /sys, under a read-only or immutable
directory, or a device such as /dev/null (which a rename would replace, and root may
rename it).
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from mkgen.errors import MkgenError


def umask() -> int:
    """The process umask (reading it means setting it: set it straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _writable_from(start: Path, path: Path) -> Path:
    """The nearest existing directory at or above `start`, once it is known to take new
    entries; errors name `path`, what the caller will write.

    Writability is probed (a directory made and removed), not read from the mode bits:
    root ignores them, and /proc, /sys, read-only mounts and immutable directories
    refuse root as well."""
    ancestor = start
    while not os.path.lexists(ancestor):
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise MkgenError(f"{ancestor} is not a directory, so {path} cannot be written under it")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=f".{Path(path).name}.", suffix=".tmp", dir=ancestor))
    except OSError as error:
        where = "it" if ancestor == Path(os.path.abspath(path)) else str(ancestor)
        raise MkgenError(
            f"cannot write {path}: {where} is not writable ({error.strerror})"
        ) from None
    return ancestor


def check_parent(path: Path) -> Path:
    """The nearest existing ancestor of `path`, once it is known to take new entries
    (what a file, or a directory renamed into place, needs)."""
    return _writable_from(Path(os.path.abspath(path)).parent, path)


def check_directory(path: Path) -> Path:
    """The directory `path`, or its nearest existing ancestor while it does not exist, once
    it is known to take new entries (what files written in `path` need)."""
    return _writable_from(Path(os.path.abspath(path)), path)


def resolved_target(path: Path, remedy: str) -> Path:
    """An output directory `path` absolute with links resolved, unless it is the
    filesystem root (`remedy` says what to give instead): checked before any scan of it
    (`-o /` would walk the whole filesystem)."""
    resolved = Path(os.path.realpath(path))
    if resolved == resolved.parent:
        raise MkgenError(f"{path} is the filesystem root; {remedy}")
    return resolved


def progress_bar(items: Iterable[Any] | None = None, *, shown: bool = True, **options: Any) -> Any:
    """A tqdm bar over `items` (or `total=`) on stderr, so that stdout stays the command's
    output; drawn only when stderr is a terminal (and `shown`), and gone when done."""
    from tqdm import tqdm

    return tqdm(items, file=sys.stderr, disable=None if shown else True, leave=False, **options)


def write_atomic(
    path: Path, data: str | bytes, *, may_replace: Callable[[str], bool], refusal: str
) -> None:
    """Write `data` (text, or bytes such as a PNG) to the file `path` through a temp file and
    a rename, with the umask's mode.

    An existing file is replaced only when `may_replace(its text)` holds (the user passed
    --force, or mkgen recognises its own earlier output; binary content is decoded with
    replacement characters, so a marker such as a PNG's title still shows); otherwise MkgenError
    `"{path} {refusal}"`. A directory or a device is never replaced. A symbolic link is
    written through, so the file it names is replaced, not the link."""
    target = Path(os.path.realpath(path))
    if target.exists() and not target.is_file():
        kind = "a directory" if target.is_dir() else "not a regular file"
        raise MkgenError(f"{path} is {kind}; give a file path")
    check_parent(target)
    try:
        if target.exists() and not may_replace(target.read_text(errors="replace")):
            raise MkgenError(f"{path} {refusal}")
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        try:
            os.fchmod(fd, 0o666 & ~umask())  # mkstemp makes 0600 files
            with os.fdopen(fd, "wb") as handle:
                handle.write(data.encode() if isinstance(data, str) else data)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as error:
        raise MkgenError(f"cannot write {path}: {error.strerror or error}") from None
