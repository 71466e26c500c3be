"""The planner's store: results of walks it made before, on disk, keyed by all they depend on.

A plan's calibrated regime and sensitivity table (mkgen/plan/confidence.py) take about ten
walks of the step's program, a second of Kimi K3's three-second `mkgen plan`. Planning the
same build again reads them back instead of walking again. An entry's key is a hash of
mkgen's own package files (its code, the chip catalog, the tuned tables, the templates),
the spec, the topology and the plan itself (its sharding, memory, ring, VMEM, layout and
program), so a change that could change a figure changes the key; an entry is never
updated, only written once under a new key.

The store lives in ``$MKGEN_CACHE_DIR`` (default ``$XDG_CACHE_HOME/mkgen`` or
``~/.cache/mkgen``); an empty ``MKGEN_CACHE_DIR`` turns it off. It is an accelerator only:
an entry that cannot be read or parsed is walked again, a store that cannot be written is
skipped, and neither changes a figure. A file in the folder that is not an entry mkgen
wrote is never replaced.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from pydantic import BaseModel

from mkgen.errors import MkgenError
from mkgen.output import write_atomic

PACKAGE = Path(__file__).resolve().parents[1]
# The format of an entry: {"mkgen_store": STORE_FORMAT, "key": ..., "value": ...}.
STORE_FORMAT = 1
# Files in the package that are not its inputs: compiled bytecode.
_NOT_INPUTS = ("__pycache__",)


def store_dir() -> Path | None:
    """Where entries are kept, None when the store is off (module docstring)."""
    configured = os.environ.get("MKGEN_CACHE_DIR")
    if configured is not None:
        return Path(configured) if configured else None
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mkgen"


@functools.cache
def package_digest() -> str:
    """A hash of every file of the mkgen package (paths and bytes), once per process."""
    digest = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*")):
        if path.is_file() and not any(part in _NOT_INPUTS for part in path.parts):
            digest.update(str(path.relative_to(PACKAGE)).encode() + b"\0")
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def entry_key(kind: str, inputs: Iterable[str]) -> str:
    """The key of a `kind` of result computed from `inputs` by this mkgen."""
    digest = hashlib.sha256(f"{kind}\0{package_digest()}".encode())
    for text in inputs:
        digest.update(b"\0" + hashlib.sha256(text.encode()).digest())
    return digest.hexdigest()


def stored[Model: BaseModel](key: str, model: type[Model], compute: Callable[[], Model]) -> Model:
    """The entry under `key` read back as `model`, else `compute()` (then stored)."""
    folder = store_dir()
    if folder is None:
        return compute()
    path = folder / f"{key}.json"
    found = _read(path, key, model)
    if found is not None:
        return found
    value = compute()
    entry = {"mkgen_store": STORE_FORMAT, "key": key, "value": value.model_dump(mode="json")}
    # Not writable, or a file mkgen did not write: the store is skipped.
    with contextlib.suppress(MkgenError):
        write_atomic(path, json.dumps(entry), may_replace=_is_entry, refusal="is not an entry")
    return value


def _read[Model: BaseModel](path: Path, key: str, model: type[Model]) -> Model | None:
    """The entry at `path` if it is one, of `key`, that parses as `model`."""
    try:
        entry = json.loads(path.read_text())
        if entry.get("mkgen_store") == STORE_FORMAT and entry.get("key") == key:
            return model.model_validate(entry["value"])
    except (OSError, ValueError, AttributeError, KeyError):  # ValidationError is a ValueError
        pass
    return None


def _is_entry(text: str) -> bool:
    """Whether `text` is an entry mkgen wrote (one that no longer parses as its model)."""
    try:
        return json.loads(text).get("mkgen_store") == STORE_FORMAT
    except (ValueError, AttributeError):
        return False
