"""Converted weights: a checkpoint packed into every core's arrays, on disk, once.

``mkgen convert SPEC --checkpoint DIR --topology T -o WEIGHTS`` maps a Hugging Face
checkpoint onto the inventory a layer at a time (mkgen.reference.hf_weights.HFMapping),
packs each layer into every core's stream banks, vector slab and expert arrays with the
packer the runner uses for random weights (mkgen.weights.pack, quantizing to the build's
formats), and writes::

    WEIGHTS/
      layout.json                  written last: what was converted for which build
      embedding.npy  final_norm.npy          replicated (the runner embeds on the host)
      core-000/layer-000.stream.npy          the core's stream rows of layer 0 (bf16 bits)
      core-000/layer-000.vectors.npy         its vector slab row block (f32)
      core-000/layer-000.experts-0.npy ...   its routed experts of layer 0 (MoE layers)
      core-000/head.stream.npy               its lm_head rows (to the last bank's end)
      tokenizer.json                         the checkpoint's tokenizer, when it has one
      tokenizer_config.json                  its chat template and special tokens (mkgen serve)
      draft/draft.0.enorm.npy ...            the build's drafter (--draft-checkpoint,
                                             mkgen.weights.draft), named by layout.json's draft
      ...

A core's stream is its layers' rows then the head's, in that order
(pack.layer_row_range); its expert array of a MoE kind stacks the kind's layers. A build
whose kernel drafts (--fuse-draft) converts its target's layers and its MTP module as a
drafter (draft/): the readers pack the passes' rows, slabs and experts from those
(`module`), and its stream ends with them (pack.passes_row_range).

Properties:

- Bounded memory: the checkpoint is read through memory maps, one layer's tensors at a
  time; a layer's arrays for every core are written before the next layer is read.
- Atomic per file: each file is written under a temporary name and renamed once
  complete; ``layout.json`` (with every file's size and sha256) is renamed into place
  last, so a directory without it is never taken for a conversion. Files get the
  umask's mode.
- Resumable: ``progress.json`` records each finished unit (the globals, a layer, the
  head) with its files' checksums; a re-run with the same inputs verifies them and
  skips those units.
- Checked before the first layer: config.json against the spec (check_config), every
  header and the index (mkgen.reference.hf_weights) and the whole tensor inventory,
  names, shapes and dtypes (HFMapping.check_inventory); while converting, NaN or Inf
  per tensor. Each is a one-line MkgenError naming the file and the tensor.
- Its own directory: a file there that convert does not write is refused (so is a
  tokenizer file a complete conversion's layout.json does not list); replacing a
  conversion of other inputs (``force``) first removes the files its layout.json and
  progress.json list, so nothing stale remains. One it cannot write in (mkgen.output's
  probe, as for a build: read-only, immutable, /proc) is refused before any work.
- Tokenizer files follow the checkpoint: a conversion is up to date only with the
  checkpoint's tokenizer files beside it; one added, changed or removed there since is
  copied or removed on the next run, the weights kept.
- Bound to its build: ``weights_sha256`` is a digest of everything in the kernel layout
  that decides the weight arrays (stream plan, segments, vector rows, expert chunks,
  formats, inventory); the runner refuses weights whose digest differs from its build's.
  Batch, rows and context do not enter it, so one conversion serves builds that differ
  only in those.
- Read back verified: the readers (read_stream, read_vectors, read_experts,
  read_globals, and tokenizer_file for run's and serve's tokenizer files) check each
  file's sha256 against layout.json unless called with ``verify=False``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from mkgen import __version__
from mkgen.errors import MkgenError
from mkgen.output import check_directory, progress_bar, resolved_target
from mkgen.plan.layout import KernelLayout
from mkgen.spec.schema import ModelSpec
from mkgen.spec.weights import model_weights
from mkgen.weights import pack

CONTAINER_FORMAT = 1
LAYOUT_FILE = "layout.json"
TOKENIZER_FILE = "tokenizer.json"  # Hugging Face `tokenizers` format
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"  # chat template, bos and eos (transformers)
# The checkpoint files copied beside the weights when the checkpoint has them.
TOKENIZER_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE)
PROGRESS_FILE = "progress.json"
# How an array is stored in a .npy file: numpy has no bf16 / fp8 descriptors, so those are
# kept as their bits and viewed back on load (the dtype is recorded in layout.json).
_STORED = {"bfloat16": np.uint16, "float8_e4m3fn": np.uint8}
_LOGICAL = {"bfloat16": ml_dtypes.bfloat16, "float8_e4m3fn": ml_dtypes.float8_e4m3fn}


def _canonical(data: Any) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


def weights_digest(spec: ModelSpec, layout: KernelLayout) -> str:
    """sha256 of what decides the per-core weight arrays of a build (not batch, rows,
    context, caches or the spec's name)."""
    data = layout.model_dump(mode="json")
    keep = {
        k: data[k]
        for k in (
            "devices",
            "hidden",
            "vocab",
            "vocab_used",
            "stream",
            "attention_table",
            "ffn_table",
            "vector_rows",
            "vector_width",
            "attention_residual",
            "final_norm",
        )
    }
    # How far the ring fetches ahead does not move a weight.
    keep["stream"] = {
        k: v
        for k, v in keep["stream"].items()
        if k not in ("ring_depth", "held_refills", "refills_per_round")
    }
    keep["mesh_order"] = data["collectives"]["mesh_order"]
    keep["attention"] = [
        {k: a.get(k) for k in ("name", "type", "layers", "segments", "vectors")}
        for a in data["attention"]
    ]
    keep["ffn"] = [
        {
            k: f.get(k)
            for k in (
                "name",
                "type",
                "layers",
                "segments",
                "vectors",
                "experts",
                "experts_per_rank",
                "partner_experts",
                "width_parts",
            )
        }
        for f in data["ffn"]
    ]
    keep["formats"] = spec.quantization.model_dump(mode="json")
    keep["inventory"] = [[w.name, list(w.shape)] for w in model_weights(spec)]
    return hashlib.sha256(_canonical(keep)).hexdigest()


# ---------------------------------------------------------------- sources of weights


class InventorySource:
    """Weights already in inventory names (the reference's random weights): the same
    interface as HFMapping, so that both go through one conversion path."""

    def __init__(self, weights: Mapping[str, np.ndarray]) -> None:
        self.weights = weights

    def globals(self) -> dict[str, np.ndarray]:
        return {k: v for k, v in self.weights.items() if not k.startswith("layers.")}

    def layer(self, i: int) -> dict[str, np.ndarray]:
        prefix = f"layers.{i}."
        return {k: v for k, v in self.weights.items() if k.startswith(prefix)}

    def skip_globals(self) -> None:
        pass

    def skip_layer(self, i: int) -> None:
        pass

    def check_complete(self) -> None:
        pass


# An FFN kind's routing fields (spec name -> the name a mismatch is reported by).
ROUTING_FACTS = {"num_experts": "experts", "top_k": "top_k"}


def _architecture(spec: ModelSpec) -> dict[str, Any]:
    """The figures a checkpoint's config must share with the spec it is converted for,
    by name (layer by layer, since a YAML spec may name its kinds otherwise)."""
    facts: dict[str, Any] = {
        "hidden size": spec.dims.hidden,
        "vocabulary": spec.dims.vocab,
        "layer count": spec.layers.count,
        "norm eps": spec.dims.norm_eps,
    }
    for i, (attn_name, ffn_name) in enumerate(spec.layer_table()):
        attn, ffn = spec.attention_kinds[attn_name], spec.ffn_kinds[ffn_name]
        rope = getattr(attn, "rope", None)
        facts[f"layer {i} attention"] = attn.type
        facts[f"layer {i} rope theta"] = rope.theta if rope is not None else None
        facts[f"layer {i} ffn"] = ffn.type
        # Routed kinds' routing figures, by the spec's field names (kinds without them
        # have none).
        fields = type(ffn).model_fields
        for field, fact in ROUTING_FACTS.items():
            if field in fields:
                facts[f"layer {i} {fact}"] = getattr(ffn, field)
    return facts


def check_config(spec: ModelSpec, config: Mapping[str, Any], config_path: Path) -> None:
    """The checkpoint's config.json, imported as mkgen imports any config, against the
    spec the build was made from: the first figure that differs is a one-line error."""
    from mkgen.spec.hf_import import import_hf_dict

    theirs = _architecture(import_hf_dict(dict(config), spec.name, str(config_path)))
    for what, ours in _architecture(spec).items():
        if theirs.get(what) != ours:
            raise MkgenError(
                f"{config_path}: {what} is {theirs.get(what)} in the checkpoint's config but "
                f"{ours} in spec {spec.name}; convert a checkpoint of this model (or build "
                "from this config.json)"
            )


def read_checkpoint_config(config_path: Path, missing: str) -> dict[str, Any]:
    """A checkpoint's config.json, which must be a JSON object; `missing` is the one-line
    error when there is none."""
    from mkgen.spec.files import read_json

    if not config_path.exists():
        raise MkgenError(missing)
    config = read_json(config_path)
    if not isinstance(config, dict):
        raise MkgenError(f"{config_path}: expected a JSON object, got {type(config).__name__}")
    return config


def checkpoint_source(spec: ModelSpec, checkpoint: Path) -> tuple[Any, dict[str, Any]]:
    """(HFMapping over the checkpoint, its fingerprint: config and shard sizes), once the
    config agrees with the spec and every tensor's name, shape and dtype (the headers) fits
    it, before anything is converted."""
    from mkgen.reference.hf_weights import HFMapping, mtp_layer_count, read_safetensors
    from mkgen.spec.hf_import import canonical_architecture

    config_path = checkpoint / "config.json"
    config = read_checkpoint_config(
        config_path, f"{checkpoint}: no config.json; not a Hugging Face checkpoint"
    )
    check_config(spec, config, config_path)
    arch = canonical_architecture(
        (config.get("architectures") or [config.get("model_type", "")])[0], str(config_path)
    )
    tensors = read_safetensors(checkpoint)
    mapping = HFMapping(
        spec, arch, tensors, mtp_layers=mtp_layer_count(config), source=str(tensors.path)
    )
    mapping.check_inventory()
    fingerprint = {
        "config_sha256": hashlib.sha256(config_path.read_bytes()).hexdigest(),
        "files": {name: path.stat().st_size for name, path in sorted(tensors.shards.items())},
    }
    return mapping, fingerprint


# ---------------------------------------------------------------- files

# Every file name mkgen convert writes in a weights directory, besides layout.json and
# progress.json: only these are ever listed, trusted or removed.
_OUR_FILE = re.compile(
    r"(embedding|final_norm)\.npy|tokenizer\.json|tokenizer_config\.json"
    r"|core-\d{3,}/(layer-\d{3,}|head)\.(stream|vectors|experts-\d+)\.npy"
    r"|draft/[A-Za-z0-9_.]+\.npy"
)
# Directories of a weights directory: each core's, and the drafter's.
_OUR_DIRECTORY = re.compile(r"core-\d{3,}|draft")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def _temporary(path: Path) -> Path:
    """The name a file is written under before it is renamed into place (created with
    open(), so it has the umask's mode, as the final file does)."""
    return path.with_name(f".{path.name}.tmp")


def _renamed_into_place(path: Path, write: Callable[[Path], None]) -> None:
    tmp = _temporary(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_json(path: Path, data: Any) -> None:
    text = json.dumps(data, indent=1, sort_keys=True) + "\n"
    _renamed_into_place(path, lambda tmp: tmp.write_text(text))


def _copy_file(source: Path, path: Path) -> dict[str, Any]:
    """Copy a checkpoint file (a tokenizer file) into place; its entry for layout.json."""
    _renamed_into_place(path, lambda tmp: tmp.write_bytes(source.read_bytes()))
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


def _write_array(path: Path, array: np.ndarray) -> dict[str, Any]:
    """Write `array` as .npy through a memory-mapped temp file, then rename; its entry
    for layout.json (dtype, shape, bytes, sha256)."""
    dtype = array.dtype.name
    stored = np.ascontiguousarray(array).view(_STORED.get(dtype, array.dtype))
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp: Path) -> None:
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=stored.dtype, shape=stored.shape)
        out[...] = stored
        out.flush()
        del out

    _renamed_into_place(path, write)
    return {
        "dtype": dtype,
        "shape": list(array.shape),
        "bytes": path.stat().st_size,
        "sha256": _sha256(path),
    }


def read_array(
    directory: Path, files: Mapping[str, Any], name: str, *, verify: bool = True
) -> np.ndarray:
    """One stored array (memory-mapped), viewed as its dtype; its size checked and, with
    `verify`, its sha256 against layout.json's (False: the trusted fast path, which reads
    the file only as the caller uses it)."""
    path = Path(directory) / name
    entry = files.get(name)
    if entry is None:
        raise MkgenError(f"{Path(directory) / LAYOUT_FILE}: lists no {name} (convert again)")
    if not path.exists():
        raise MkgenError(f"{path}: missing from the converted weights (convert again)")
    if path.stat().st_size != entry["bytes"]:
        raise MkgenError(
            f"{path}: {path.stat().st_size} bytes, layout.json says {entry['bytes']} "
            "(truncated or replaced; convert again)"
        )
    if verify and _sha256(path) != entry["sha256"]:
        raise MkgenError(
            f"{path}: sha256 differs from layout.json's (the file was damaged or replaced; "
            "convert again)"
        )
    array = np.load(path, mmap_mode="r")
    dtype = entry.get("dtype")
    return array.view(_LOGICAL[dtype]) if dtype in _LOGICAL else array


def _checked_files(files: Any, where: str) -> dict[str, dict[str, Any]]:
    """A `files` table of layout.json or progress.json: names mkgen writes, each with
    its byte count and sha256."""
    if not isinstance(files, dict):
        raise MkgenError(f"{where}: expected a table of files, got {type(files).__name__}")
    for name, entry in files.items():
        if not _OUR_FILE.fullmatch(name):
            raise MkgenError(f"{where}: {name!r} is not a file mkgen convert writes")
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("bytes"), int)
            and isinstance(entry.get("sha256"), str)
        ):
            raise MkgenError(f"{where}: {name}: expected bytes and sha256")
    return files


def read_state(path: Path) -> dict[str, Any]:
    """layout.json or progress.json of a weights directory, checked before anything in it
    is trusted or removed: damage or a foreign file is a one-line error."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        reason = error.strerror if isinstance(error, OSError) else f"not JSON: {error}"
        raise MkgenError(f"{path}: not a {path.name} of mkgen convert ({reason})") from None
    if not isinstance(data, dict) or not isinstance(data.get("identity"), dict):
        raise MkgenError(f"{path}: not a {path.name} of mkgen convert (no identity object)")
    if path.name == LAYOUT_FILE:
        _checked_files(data.get("files"), f"{path}: files")
    else:
        units_done = data.get("units")
        if not isinstance(units_done, dict):
            raise MkgenError(f"{path}: units: expected a table of finished units")
        for unit, files in units_done.items():
            _checked_files(files, f"{path}: units: {unit}")
    return data


# ---------------------------------------------------------------- units of work


@dataclass(frozen=True)
class Unit:
    """A piece of the conversion done and recorded at once: `globals`, `layer-N`, `head`."""

    name: str
    layer: int | None  # decoder layer, -1 for the head, None for the globals


# The build's drafter's tensors (mkgen.weights.draft), converted after the target's.
DRAFT_UNIT = Unit("draft", None)


def units(layout: KernelLayout) -> list[Unit]:
    """The target's units: a fused drafter's passes are packed from the drafter's tensors
    as the weights are read (read_stream, read_vectors, read_experts: `module`)."""
    passes = layout.draft_passes
    count = len(layout.attention_table) if passes is None else passes.first_layer
    return [
        Unit("globals", None),
        *(Unit(f"layer-{i:03d}", i) for i in range(count)),
        Unit("head", -1),
    ]


def core_dir(rank: int) -> str:
    return f"core-{rank:03d}"


def _unit_arrays(
    layout: KernelLayout, unit: Unit, tensors: Mapping[str, np.ndarray], rank: int
) -> Iterator[tuple[str, np.ndarray]]:
    """(file name, array) of one core's share of a unit."""
    base = f"{core_dir(rank)}/{unit.name}"
    yield f"{base}.stream.npy", pack.pack_stream_layer(layout, tensors, rank, unit.layer)
    if unit.layer is not None and unit.layer >= 0:
        yield f"{base}.vectors.npy", pack.pack_vectors_layer(layout, tensors, rank, unit.layer)
        for j, array in enumerate(pack.pack_experts_layer(layout, tensors, rank, unit.layer)):
            yield f"{base}.experts-{j}.npy", array


def _global_arrays(tensors: Mapping[str, np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
    embedding = np.asarray(tensors["embedding"])
    yield "embedding.npy", embedding.astype(ml_dtypes.bfloat16)
    yield "final_norm.npy", np.asarray(tensors["final_norm"], np.float32)


def _verified(directory: Path, files: Mapping[str, Mapping[str, Any]]) -> bool:
    for name, entry in files.items():
        path = directory / name
        if not path.exists() or path.stat().st_size != entry["bytes"]:
            return False
        if _sha256(path) != entry["sha256"]:
            return False
    return True


def _foreign_entry(output: Path) -> str | None:
    """The first entry of a weights directory that mkgen convert does not write (its
    files, temp files of its atomic writes, core-NNN directories); a symlink is foreign."""
    for root, dirs, files in os.walk(output):
        here = Path(root)
        for name in sorted(dirs + files):
            path, rel = here / name, (here / name).relative_to(output).as_posix()
            if path.is_symlink():
                return rel
            if name in dirs:
                ours = here == output and _OUR_DIRECTORY.fullmatch(name) is not None
            else:
                ours = (
                    rel in (LAYOUT_FILE, PROGRESS_FILE)
                    or _OUR_FILE.fullmatch(rel) is not None
                    or (name.startswith(".") and name.endswith(".tmp"))
                )
            if not ours:
                return rel
    return None


def _remove_conversion(
    output: Path, manifest: Mapping[str, Any] | None, state: Mapping[str, Any] | None
) -> None:
    """Remove what an earlier conversion's layout.json (`manifest`) and progress.json
    (`state`, both checked by read_state) list, those two files and the core directories
    left empty. Done before the new conversion writes anything: nothing stale stays behind,
    and the disk holds one conversion at a time."""
    names = set(manifest["files"]) if manifest is not None else set()
    for files in state["units"].values() if state is not None else ():
        names.update(files)
    (output / LAYOUT_FILE).unlink(missing_ok=True)  # first: nothing looks complete
    for name in sorted(names):
        (output / name).unlink(missing_ok=True)
    (output / PROGRESS_FILE).unlink(missing_ok=True)
    for directory in sorted(output.iterdir()):
        ours = _OUR_DIRECTORY.fullmatch(directory.name) is not None
        if ours and directory.is_dir() and not any(directory.iterdir()):
            directory.rmdir()


def _unit_bytes(spec: ModelSpec, work: list[Unit], draft: Any) -> list[int]:
    """Each unit's tensors' bytes in bf16 (the checkpoint's bytes for a bf16 checkpoint):
    what the progress bar counts."""
    sizes = {w.name: math.prod(w.shape) * 2 for w in model_weights(spec)}
    layers = [0] * spec.layers.count
    for name, size in sizes.items():
        if name.startswith("layers."):
            layers[int(name.split(".")[1])] += size
    head = sizes.get("lm_head", sizes["embedding"])  # tied: the embedding is the head
    outside = sum(v for k, v in sizes.items() if not k.startswith("layers.") and k != "lm_head")
    return [
        draft.bytes() if u == DRAFT_UNIT
        else outside if u.layer is None else head if u.layer < 0 else layers[u.layer]
        for u in work
    ]  # fmt: skip


@dataclass
class ConvertResult:
    directory: Path
    files: int
    bytes: int
    skipped: list[str]  # units found complete and verified
    seconds: float
    # Of converted weights kept as they were: the tokenizer files copied from the
    # checkpoint (new or changed there) and those removed (gone from it).
    tokenizers_copied: tuple[str, ...] = ()
    tokenizers_removed: tuple[str, ...] = ()


def check_output(output: Path) -> None:
    """A one-line MkgenError unless files may be written in `output` (before any work): it
    is no file, not the filesystem root, and it (or, while it does not exist, its nearest
    ancestor) takes new entries: a read-only, immutable, /proc or /sys directory does not."""
    resolved_target(output, "choose another output directory")
    if output.exists() and not output.is_dir():
        raise MkgenError(f"{output} is not a directory; choose another output directory")
    check_directory(output)


def convert(
    spec: ModelSpec,
    layout: KernelLayout,
    source: Any,
    output: Path,
    *,
    identity: Mapping[str, Any],
    force: bool = False,
    progress: bool = False,
    tokenizer_files: Sequence[Path] = (),
    draft: Any = None,
) -> ConvertResult:
    """Pack `source` (HFMapping or InventorySource) for `layout` into `output`, with a
    copy of each of the checkpoint's `tokenizer_files` (TOKENIZER_FILES) and, given
    `draft` (mkgen.weights.draft.DraftCheckpoint), the build's drafter; `progress`: a
    progress bar on a terminal's stderr (tqdm: bytes/s and ETA).

    `identity` describes the inputs (build and checkpoint); a progress.json with the same
    identity resumes, a complete conversion with the same identity is left as it is (its
    tokenizer files made the checkpoint's), and one of other inputs is only replaced with
    `force`, which first removes the files it lists. A file in `output` that mkgen convert
    does not write is refused; a file that cannot be written is a one-line MkgenError."""
    start = time.perf_counter()
    output = Path(output)
    check_output(output)
    identity = {
        **identity, "weights_sha256": weights_digest(spec, layout), "format": CONTAINER_FORMAT
    }  # fmt: skip
    try:
        manifest, state = _existing_conversion(output)
        if manifest is not None and manifest["identity"] == identity:
            weights = {k: v for k, v in manifest["files"].items() if k not in TOKENIZER_FILES}
            if _verified(output, weights):
                copied, removed = _match_tokenizers(output, manifest, tokenizer_files)
                files = manifest["files"]
                size = sum(e["bytes"] for e in files.values())
                seconds = time.perf_counter() - start
                return ConvertResult(
                    output, len(files), size, ["all"], seconds, copied, removed
                )  # fmt: skip
        resumable = state is not None and state["identity"] == identity
        replaced = None if resumable else state  # an interrupted conversion of other inputs
        if manifest is not None or replaced is not None:
            _refuse_or_remove(output, manifest, replaced, identity, force)
        done = dict(state["units"]) if resumable and state else {}
        return _write_conversion(
            spec, layout, (source, draft), output, identity, done, progress, tokenizer_files,
            start,
        )  # fmt: skip
    except OSError as error:  # a full disk, or a directory made read-only meanwhile
        raise MkgenError(f"{error.filename or output}: {error.strerror or error}") from None


def _existing_conversion(output: Path) -> tuple[dict | None, dict | None]:
    """(layout.json, progress.json) of a conversion already in `output` (None: absent), once
    `output` is known to hold nothing else: an empty or new directory, or convert's own."""
    manifest = read_state(output / LAYOUT_FILE) if (output / LAYOUT_FILE).exists() else None
    state = read_state(output / PROGRESS_FILE) if (output / PROGRESS_FILE).exists() else None
    if manifest is None and state is None:
        if output.exists() and any(output.iterdir()):
            raise MkgenError(
                f"{output} exists and is not a mkgen weights directory; choose another"
            )
    elif foreign := _foreign_entry(output) or _unlisted_tokenizer(output, manifest):
        raise MkgenError(
            f"{output}: {foreign} was not written by mkgen convert; move it out of the weights "
            "directory (or choose another output directory)"
        )
    return manifest, state


def _unlisted_tokenizer(output: Path, manifest: Mapping[str, Any] | None) -> str | None:
    """A tokenizer file beside a complete conversion that its layout.json does not list:
    put there by hand, since convert copies them just before it writes layout.json."""
    if manifest is None:
        return None
    names = (name for name in TOKENIZER_FILES if name not in manifest["files"])
    return next((name for name in names if os.path.lexists(output / name)), None)


def _refuse_or_remove(
    output: Path,
    manifest: Mapping[str, Any] | None,
    replaced: Mapping[str, Any] | None,
    identity: Mapping[str, Any],
    force: bool,
) -> None:
    """Without `force`, a one-line refusal to replace the conversion in `output` (its
    layout.json `manifest`, or the progress.json `replaced` of other inputs); with it, its
    files removed."""
    if not force:
        earlier = (manifest if manifest is not None else replaced or {})["identity"]
        target = lambda ids: {k: v for k, v in ids.items() if k != "draft_checkpoint"}  # noqa: E731
        if earlier == identity:
            what = "a conversion whose files no longer match its layout.json"
        elif target(earlier) == target(identity):
            what = "a conversion of this target with other drafter weights (or none)"
        else:
            what = f"another conversion ({earlier.get('spec')} for {earlier.get('topology')})"
        raise MkgenError(f"{output} holds {what}; pass --force to replace it")
    _remove_conversion(output, manifest, replaced)


def _match_tokenizers(
    output: Path, manifest: dict[str, Any], tokenizer_files: Sequence[Path]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Make the tokenizer files beside converted weights the checkpoint's
    `tokenizer_files`: copy those added or changed there since (or damaged in `output`),
    remove those it no longer has, and rewrite layout.json if any was. (copied, removed)."""
    files = manifest["files"]
    wanted = {path.name: path for path in tokenizer_files}
    copied, removed = [], []
    for name in TOKENIZER_FILES:
        entry, source = files.get(name), wanted.get(name)
        if source is None and entry is not None:
            del files[name]
            (output / name).unlink(missing_ok=True)
            removed.append(name)
        elif source is not None and not (
            entry is not None
            and entry["sha256"] == _sha256(source)
            and _verified(output, {name: entry})
        ):
            files[name] = _copy_file(source, output / name)
            copied.append(name)
    if copied or removed:
        _write_json(output / LAYOUT_FILE, manifest)
    return tuple(copied), tuple(removed)


def _write_conversion(
    spec: ModelSpec,
    layout: KernelLayout,
    sources: tuple[Any, Any],
    output: Path,
    identity: Mapping[str, Any],
    done: dict[str, dict[str, Any]],
    progress: bool,
    tokenizer_files: Sequence[Path],
    start: float,
) -> ConvertResult:
    """Convert every unit not `done` (and verified) into `output` from `sources` (the
    target's and the drafter's, or None), recording each in progress.json, then copy the
    tokenizer files and write layout.json."""
    layout_path, progress_path = output / LAYOUT_FILE, output / PROGRESS_FILE
    created = not output.exists()
    output.mkdir(parents=True, exist_ok=True)
    try:
        skipped: list[str] = []
        files: dict[str, dict[str, Any]] = {}
        source, draft = sources
        work = units(layout) + ([DRAFT_UNIT] if draft is not None else [])
        sizes = _unit_bytes(spec, work, draft)
        bar = progress_bar(
            total=sum(sizes), desc="convert", unit="B", unit_scale=True, unit_divisor=1024,
            shown=progress,
        )  # fmt: skip
        with bar:
            for unit, size in zip(work, sizes, strict=True):
                bar.set_postfix_str(unit.name, refresh=False)
                recorded = done.get(unit.name)
                if recorded is not None and _verified(output, recorded):
                    files.update(recorded)
                    skipped.append(unit.name)
                    _skip(source, unit)
                    bar.update(size)
                    continue
                done.pop(unit.name, None)
                unit_files = _convert_unit(layout, sources, unit, output)
                files.update(unit_files)
                done[unit.name] = unit_files
                _write_json(progress_path, {"identity": identity, "units": done})
                bar.update(size)
        source.check_complete()
        for tokenizer_file in tokenizer_files:
            files[tokenizer_file.name] = _copy_file(tokenizer_file, output / tokenizer_file.name)
        total = sum(e["bytes"] for e in files.values())
        manifest = {
            "identity": identity,
            "mkgen_version": __version__,
            "cores": layout.devices,
            "units": [u.name for u in work],
            "expert_arrays": [list(x) for x in pack.expert_arrays(layout)],
            "files": files,
            **({"draft": draft.entry()} if draft is not None else {}),
        }
        _write_json(layout_path, manifest)
        progress_path.unlink(missing_ok=True)
        return ConvertResult(output, len(files), total, skipped, time.perf_counter() - start)
    except BaseException:
        # A conversion that fails before finishing any unit leaves nothing behind (with
        # finished units, progress.json keeps them for a resumed run).
        if created and not progress_path.exists():
            shutil.rmtree(output, ignore_errors=True)
        raise


def _skip(source: Any, unit: Unit) -> None:
    """Count a unit an earlier run converted (and verified) as taken from the target's
    `source` (the drafter's unit takes nothing from it)."""
    if unit == DRAFT_UNIT:
        return
    if unit.layer is None or unit.layer < 0:
        source.skip_globals()
    else:
        source.skip_layer(unit.layer)


def _convert_unit(
    layout: KernelLayout, sources: tuple[Any, Any], unit: Unit, output: Path
) -> dict[str, dict[str, Any]]:
    """Read one unit's tensors from `sources` (the target's, the drafter's), pack and write
    them for every core (the drafter's: once, unpacked): the entries of its files."""
    source, draft = sources
    if unit == DRAFT_UNIT:
        return {name: _write_array(output / name, array) for name, array in draft.arrays(source)}
    if unit.layer is None or unit.layer < 0:
        tensors = source.globals()
    else:
        tensors = source.layer(unit.layer)
        if layout.attention_residual:  # the blocks' logits ride with the layers
            tensors = {**tensors, "attn_res_logits": source.globals()["attn_res_logits"]}
    arrays: Iterator[tuple[str, np.ndarray]]
    if unit.layer is None:
        arrays = _global_arrays(tensors)
    else:
        arrays = (
            item
            for rank in range(layout.devices)
            for item in _unit_arrays(layout, unit, tensors, rank)
        )
    try:
        return {name: _write_array(output / name, array) for name, array in arrays}
    except ValueError as error:  # a packing shape check: the checkpoint and spec disagree
        raise MkgenError(f"{unit.name}: {error}") from None


def build_identity(
    spec: ModelSpec, topology: str, options: Mapping[str, Any], kernel_args: Mapping[str, Any]
) -> dict[str, Any]:
    return {
        "spec": spec.name,
        "topology": topology,
        "options": dict(options),
        "kernel_args": dict(kernel_args),
        "formats": spec.quantization.model_dump(mode="json"),
    }


# ---------------------------------------------------------------- reading it back
#
# The readers check each file's size against layout.json and, with `verify` (the
# default), its sha256: a file with flipped bytes is a one-line error instead of other
# tokens. verify=False is the trusted fast path (weights checked before, on storage the
# caller trusts): the file is read only as the caller uses it.


def read_manifest(directory: Path) -> dict:
    """layout.json of the converted weights in `directory`, checked (one-line errors)."""
    directory = Path(directory)
    path = directory / LAYOUT_FILE
    if not path.exists():
        hint = (
            "an interrupted conversion: run mkgen convert again to finish it"
            if (directory / PROGRESS_FILE).exists()
            else "not converted weights (mkgen convert writes them)"
        )
        raise MkgenError(f"{directory}: no {LAYOUT_FILE}; {hint}")
    return read_state(path)


def tokenizer_file(directory: Path, name: str, *, verify: bool = True) -> Path | None:
    """The tokenizer file `name` (TOKENIZER_FILES) beside the converted weights in
    `directory`, or None without one. With `verify`, it must be the file mkgen convert
    copied there, by layout.json's sha256: one edited, added or deleted since is a
    one-line MkgenError naming it (verify=False: --trust-weights takes it as it is)."""
    path = Path(directory) / name
    if not verify:
        return path if path.is_file() else None
    entry = read_manifest(directory)["files"].get(name)
    if entry is None and not path.exists():
        return None
    again = "re-run mkgen convert to copy the checkpoint's again"
    trust = " (or pass --trust-weights to take it as it is)"
    if entry is None:
        problem = "was added after the conversion (layout.json does not list it)"
        again = "move it out, or put it in the checkpoint and re-run mkgen convert"
    elif not path.is_file():
        problem, trust = "is missing (layout.json lists it)", ""
    elif _sha256(path) != entry["sha256"]:
        problem = "was changed after the conversion (its sha256 differs from layout.json's)"
    else:
        return path
    raise MkgenError(f"{path} {problem}; {again}{trust}")


def open_weights(directory: Path, spec: ModelSpec, layout: KernelLayout, build: str) -> dict:
    """layout.json of converted weights, checked against this build (one-line errors)."""
    manifest = read_manifest(directory)
    path = Path(directory) / LAYOUT_FILE
    identity = manifest["identity"]
    if identity.get("format") != CONTAINER_FORMAT:
        raise MkgenError(f"{path}: container format {identity.get('format')!r} unknown")
    if identity.get("weights_sha256") != weights_digest(spec, layout):
        raise MkgenError(
            f"{directory}: converted for {identity.get('spec')} on {identity.get('topology')} "
            f"(formats {_formats(identity.get('formats'))}, kernel args "
            f"{identity.get('kernel_args')}), which lays weights out differently from {build} "
            f"({layout.topology}, formats {_formats(spec.quantization.model_dump(mode='json'))});"
            " convert the checkpoint for this build (mkgen convert --build)"
        )
    return manifest


def _formats(formats: Any) -> str:
    if not isinstance(formats, dict):
        return "?"
    return ", ".join(f"{k}={v}" for k, v in sorted(formats.items()) if v != "bf16") or "bf16"


def read_stream(
    directory: Path,
    manifest: Mapping[str, Any],
    layout: KernelLayout,
    rank: int,
    *,
    verify: bool = True,
    module: Mapping[str, np.ndarray] | None = None,
) -> np.ndarray:
    """One core's weight stream [total_banks, bank_rows, LANES] bf16, from its unit files;
    a fused drafter's passes packed from `module` (its `draft.*` tensors: the MTP
    module's; the LM head after each pass copied from the target's packed rows)."""
    stream = np.empty((layout.stream.total_banks, layout.stream.bank_rows, pack.LANES), pack.BF16)
    rows = stream.reshape(-1, pack.LANES)
    for unit in units(layout)[1:]:
        first, end = pack.layer_row_range(layout, unit.layer)
        name = f"{core_dir(rank)}/{unit.name}.stream.npy"
        rows[first:end] = read_array(directory, manifest["files"], name, verify=verify)
    if layout.draft_passes is not None:
        assert module is not None, "a fused drafter's passes are packed from its tensors"
        first, end = pack.passes_row_range(layout)
        rows[first:end] = pack.pack_passes(layout, module, rank)
        pack.copy_heads(layout, rows)
    return stream


def read_vectors(
    directory: Path,
    manifest: Mapping[str, Any],
    layout: KernelLayout,
    rank: int,
    *,
    verify: bool = True,
    module: Mapping[str, np.ndarray] | None = None,
) -> np.ndarray:
    """One core's vector slabs [layers, vector_rows, vector_width] f32 (a fused drafter's
    passes' packed from `module`: read_stream)."""

    def slab(layer: int) -> np.ndarray:
        if _in_passes(layout, layer, module):
            return pack.pack_vectors_layer(layout, module, rank, layer)
        name = f"{core_dir(rank)}/layer-{layer:03d}.vectors.npy"
        return read_array(directory, manifest["files"], name, verify=verify)

    return np.stack([slab(layer) for layer in range(len(layout.ffn_table))])


def _in_passes(layout: KernelLayout, layer: int, module: Any) -> bool:
    """Whether `layer` is a fused drafter's pass, packed from `module` (checked given)."""
    passes = layout.draft_passes
    if passes is None or layer not in passes.layers:
        return False
    assert module is not None, "a fused drafter's passes are packed from its tensors"
    return True


def read_experts(
    directory: Path,
    manifest: Mapping[str, Any],
    layout: KernelLayout,
    rank: int,
    which: int,
    *,
    verify: bool = True,
    module: Mapping[str, np.ndarray] | None = None,
) -> np.ndarray:
    """One core's routed-expert array `which` (pack.expert_arrays order), its MoE kind's
    layers stacked (a fused drafter's pass packed from `module`: read_stream)."""
    index, j = pack.expert_arrays(layout)[which]

    def layer_array(layer: int) -> np.ndarray:
        if _in_passes(layout, layer, module):
            return pack.pack_experts_layer(layout, module, rank, layer)[j]
        name = f"{core_dir(rank)}/layer-{layer:03d}.experts-{j}.npy"
        return read_array(directory, manifest["files"], name, verify=verify)

    return np.stack([layer_array(layer) for layer in layout.ffn[index].layers])


def read_globals(
    directory: Path, manifest: Mapping[str, Any], *, verify: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """(embedding [vocab, hidden] bf16, final_norm [hidden] f32)."""
    files = manifest["files"]
    return (
        read_array(directory, files, "embedding.npy", verify=verify),
        read_array(directory, files, "final_norm.npy", verify=verify),
    )
