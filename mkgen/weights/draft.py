"""A drafter's converted weights: `mkgen convert --build B --checkpoint TARGET
--draft-checkpoint DRAFT -o W` (docs/drafting.md).

The build's drafter (its spec's draft section, `mkgen build --draft`) reads DRAFT in the
tensor names its kind's published code uses (mkgen.reference.draft.load_draft_weights):
`mtp` DeepSeek-V3's MTP layers after the target's decoder layers (DRAFT may be the
target's own checkpoint), `block` DFlash's, `model` an ordinary Hugging Face checkpoint.
Before anything is written, the drafter's config.json is held against the build's
drafter (its vocabulary against the target's first) and every tensor's name and shape
(the headers) against the drafter's inventory (mkgen.spec.draft.draft_weights): a
one-line MkgenError naming the field or tensor.

The converted tensors sit beside the target's, one file each, as the kernel stores a
model's: vectors (norms, biases) in f32, matrices rounded to bf16, integer tables as they
are::

    W/draft/draft.0.enorm.npy ...     the drafter's tensors, by their inventory names
    W/draft/lm_head.npy               an mtp or block drafter of an untied target: the
                                      target's LM head (the kernel's copy is packed in its
                                      stream banks, which nothing unpacks)

layout.json's `draft` names them: the drafter's kind and `weights_sha256`, a digest of its
inventory, which the runner holds against its build's drafter (read_drafter).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from mkgen.errors import MkgenError
from mkgen.spec.draft import draft_weights
from mkgen.spec.schema import BlockDraft, ModelDraft, ModelSpec, MtpDraft
from mkgen.spec.tensors import VECTORS

DRAFT_DIR = "draft"
TARGET_HEAD = "lm_head"  # the target's LM head, for a drafter that reads it
FIX = "give the drafter checkpoint the build was made for (mkgen build --draft)"


def reads_target_head(spec: ModelSpec) -> bool:
    """Whether the drafter reads the target's own untied LM head (mtp, block: their
    drafts go through it; a model drafter has its own)."""
    return not isinstance(spec.draft, ModelDraft) and not spec.dims.tie_embeddings


def draft_digest(spec: ModelSpec) -> str:
    """sha256 of the drafter's kind and inventory (names and shapes)."""
    assert spec.draft is not None
    data = {
        "kind": spec.draft.kind,
        "inventory": [[w.name, list(w.shape)] for w in draft_weights(spec)],
        "target_head": reads_target_head(spec),
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


@dataclass
class DraftCheckpoint:
    """A drafter checkpoint checked against the build's drafter, ready to convert."""

    spec: ModelSpec  # the target's, with the build's draft section
    arch: str
    tensors: Any  # SafetensorsCheckpoint
    source: str
    fingerprint: dict[str, Any]

    def arrays(self, target: Any) -> Iterator[tuple[str, np.ndarray]]:
        """(file name, array) of the drafter's files; `target` is the target's source
        (HFMapping), whose LM head an mtp or block drafter reads."""
        from mkgen.reference.draft import load_draft_weights

        weights = load_draft_weights(self.spec, self.arch, self.tensors, self.source)
        families = {w.name: w.family for w in draft_weights(self.spec)}
        for name, value in weights.items():
            yield f"{DRAFT_DIR}/{name}.npy", _stored(np.asarray(value), families[name])
        if reads_target_head(self.spec):
            head = target.globals()["lm_head"]
            yield f"{DRAFT_DIR}/{TARGET_HEAD}.npy", _stored(head, "lm_head")

    def entry(self) -> dict[str, Any]:
        """layout.json's `draft`."""
        assert self.spec.draft is not None
        return {"kind": self.spec.draft.kind, "weights_sha256": draft_digest(self.spec)}

    def bytes(self) -> int:
        """The drafter's tensors in bf16: what the progress bar counts."""
        return sum(2 * int(np.prod(w.shape)) for w in draft_weights(self.spec))


def _stored(value: np.ndarray, family: str) -> np.ndarray:
    """A tensor as the kernel stores its family: vectors (norms, biases) in f32, matrices
    rounded to bf16; integer tables (d2t) as they are."""
    if value.dtype.kind in "iu":
        return value
    return value.astype(np.float32 if family == VECTORS else ml_dtypes.bfloat16)


def draft_checkpoint(spec: ModelSpec, directory: Path) -> DraftCheckpoint:
    """The drafter checkpoint in `directory` for the build's drafter, once its config.json
    agrees with the drafter and every tensor's name and shape fits its inventory (read
    from the headers: nothing is converted or written first)."""
    from mkgen.reference.draft import load_draft_weights
    from mkgen.reference.hf_weights import header_shapes, read_safetensors
    from mkgen.spec.hf_import import canonical_architecture
    from mkgen.weights.convert import read_checkpoint_config

    if spec.draft is None:
        raise MkgenError(
            f"--draft-checkpoint: {spec.name} carries no drafter (mkgen build --draft DRAFT "
            "makes a build that does); convert without --draft-checkpoint"
        )
    config_path = Path(directory) / "config.json"
    config = read_checkpoint_config(
        config_path, f"--draft-checkpoint {directory}: no config.json; not a checkpoint"
    )
    check_draft_config(spec, config, config_path)
    arch = (config.get("architectures") or [config.get("model_type", "")])[0]
    if not isinstance(spec.draft, BlockDraft):  # DFlash's layers read as Qwen3's
        arch = canonical_architecture(arch, str(config_path))
    tensors = read_safetensors(directory)
    source = str(tensors.path)
    shapes = load_draft_weights(spec, arch, header_shapes(tensors, source), source)
    _check_shapes(spec, shapes, source)
    fingerprint = {
        "config_sha256": hashlib.sha256(config_path.read_bytes()).hexdigest(),
        "files": {name: path.stat().st_size for name, path in sorted(tensors.shards.items())},
    }
    return DraftCheckpoint(spec, arch, tensors, source, fingerprint)


def check_draft_config(spec: ModelSpec, config: Mapping[str, Any], path: Path) -> None:
    """The drafter checkpoint's config.json against the build's drafter: the vocabulary
    first (a drafter drafts its target's token ids), then the kind's own figures."""
    from mkgen.spec.draft_import import import_block_draft
    from mkgen.weights.convert import check_config

    draft = spec.draft
    vocab = config.get("vocab_size")
    if vocab != spec.dims.vocab:
        raise MkgenError(
            f"{path}: vocab_size is {vocab} in the drafter's config but the target "
            f"{spec.name} has {spec.dims.vocab}; a drafter drafts its target's token ids: "
            f"give a drafter made for {spec.name}"
        )
    if isinstance(draft, ModelDraft):
        check_config(draft.model, config, path)
    elif isinstance(draft, MtpDraft):
        check_config(spec, config, path)
        _check_mtp_layers(draft, config, path)
    else:
        assert isinstance(draft, BlockDraft)
        theirs = import_block_draft(path).model_dump(mode="json")
        for field, ours in draft.model_dump(mode="json").items():
            if theirs.get(field) != ours:
                raise MkgenError(
                    f"{path}: draft.{field} is {theirs.get(field)} in the drafter's config "
                    f"but {ours} in the build's drafter; {FIX}"
                )


def _check_mtp_layers(draft: MtpDraft, config: Mapping[str, Any], path: Path) -> None:
    from mkgen.reference.hf_weights import mtp_layer_count

    count = mtp_layer_count(config)
    if count != draft.layers:
        raise MkgenError(
            f"{path}: num_nextn_predict_layers is {count}, the build's mtp drafter has "
            f"{draft.layers} module(s); give the checkpoint that ships the MTP layers (the "
            "target's own, DeepSeek-V3 style model.layers.N.*)"
        )


def _check_shapes(spec: ModelSpec, shapes: Mapping[str, Any], source: str) -> None:
    """Every tensor of the drafter's inventory mapped from the checkpoint, in its shape."""
    for w in draft_weights(spec):
        got = shapes.get(w.name)
        if got is None:
            raise MkgenError(f"{source}: no tensor maps to {w.name}, which the build's drafter "
                             f"has; {FIX}")  # fmt: skip
        if tuple(got.shape) != tuple(w.shape):
            origin = getattr(got, "origin", f"{source}: {w.name}")
            raise MkgenError(
                f"{origin}: gives {w.name} of shape {tuple(got.shape)}, the build's drafter "
                f"needs {tuple(w.shape)}; {FIX}"
            )


def without_drafter(weights: Path | str, kind: str) -> str:
    """The one line for converted weights without the build's drafter's."""
    return (
        f"--weights {weights}: holds no weights of the build's {kind} drafter; convert with "
        "mkgen convert --draft-checkpoint DRAFT, or pass --drafter ngram (prompt lookup)"
    )


def read_drafter(
    directory: Path, manifest: Mapping[str, Any], spec: ModelSpec, *, verify: bool = True
) -> dict[str, np.ndarray]:
    """The converted drafter of the build (float32, tables int32) by inventory name, and
    the target's LM head (`lm_head`) when the drafter reads it. Converted weights without a
    drafter, or with another drafter's, are one line."""
    from mkgen.weights.convert import read_array

    assert spec.draft is not None
    entry = manifest.get("draft")
    if entry is None:
        raise MkgenError(without_drafter(directory, spec.draft.kind))
    if entry.get("weights_sha256") != draft_digest(spec):
        raise MkgenError(
            f"--weights {directory}: its drafter weights are of another drafter ({entry.get('kind')}) "
            "than the build's; convert with the build's drafter checkpoint "
            "(--draft-checkpoint), or pass --drafter ngram (prompt lookup)"
        )
    names = [w.name for w in draft_weights(spec)]
    names += [TARGET_HEAD] if reads_target_head(spec) else []
    out = {}
    for name in names:
        array = read_array(directory, manifest["files"], f"{DRAFT_DIR}/{name}.npy", verify=verify)
        out[name] = np.asarray(array, np.int32 if array.dtype.kind in "iu" else np.float32)
    return out
