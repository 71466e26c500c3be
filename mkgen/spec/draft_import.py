"""Drafters from outside a target's spec (mkgen/spec/draft.py, docs/drafting.md): a
DFlash drafter's own config.json, and `--draft DRAFT` (`load_drafter`): the target's own
MTP section, a drafter's config.json, or a drafter spec file (a YAML `draft:` section)
by path or by name in mkgen/model_specs/drafters/."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from pydantic import TypeAdapter, ValidationError

from mkgen.errors import SpecError
from mkgen.spec.draft import with_draft
from mkgen.spec.files import checked_path, describe_validation_error, read_json, read_yaml
from mkgen.spec.hf_import import import_hf_config, import_hf_dict
from mkgen.spec.schema import BlockDraft, Drafter, ModelDraft, ModelSpec, MtpDraft

# Package data: the shipped drafter specs, one per file, named by their file's stem.
DRAFTERS_DIR = resources.files("mkgen") / "model_specs" / "drafters"
_DRAFTER_FILE_KEYS = ("target", "draft")
_SECTION = TypeAdapter(dict[str, Drafter])

# DFlash's keys beside its Qwen3 layers' (z-lab/dflash: DFlashDraftModel's config).
_DFLASH_KEYS = ("block_size", "dflash_config", "num_target_layers", "is_causal")


def import_block_draft(path: Path) -> BlockDraft:
    """A DFlash drafter's config.json (or checkpoint directory) as a block drafter: its
    layers read as a Qwen3 config, `block_size`, `dflash_config.target_layer_ids` (the
    feature layers) and `dflash_config.mask_token_id`. One-line SpecErrors."""
    path = Path(path)
    config_path = path / "config.json" if path.is_dir() else path
    config = read_json(config_path)
    source = str(config_path)
    if not isinstance(config, dict) or config.get("architectures") != ["DFlashDraftModel"]:
        raise SpecError(f"{source}: not a DFlash drafter config (architectures DFlashDraftModel)")
    dflash = config.get("dflash_config")
    if not isinstance(dflash, dict):
        raise SpecError(f"{source}: dflash_config: missing; a DFlash config names its layers there")
    if config.get("is_causal") not in (None, False):
        raise SpecError(f"{source}: is_causal: a block drafter drafts non-causally; use false")
    layers = {k: v for k, v in config.items() if k not in _DFLASH_KEYS}
    layers["architectures"] = ["Qwen3ForCausalLM"]
    spec = import_hf_dict(layers, "dflash-drafter", source)
    if len(spec.attention_kinds) != 1:
        raise SpecError(f"{source}: layer_types: a block drafter's layers share one attention kind")
    (attention,) = spec.attention_kinds.values()
    (ffn,) = spec.ffn_kinds.values()
    data = {
        "kind": "block",
        "hidden": spec.dims.hidden,
        "layers": spec.layers.count,
        "attention": attention.model_dump(mode="json"),
        "ffn": ffn.model_dump(mode="json"),
        "norm_eps": spec.dims.norm_eps,
        "block_size": config.get("block_size", dflash.get("block_size")),
        "feature_layers": dflash.get("target_layer_ids"),
        "mask_token": dflash.get("mask_token_id"),
    }
    try:
        return BlockDraft.model_validate(data)
    except ValidationError as error:
        raise SpecError(describe_validation_error(error, f"{source} (as draft)")) from None


def list_drafter_names() -> list[str]:
    """The shipped drafter specs (mkgen/model_specs/drafters/NAME.yaml)."""
    return sorted(
        p.name.removesuffix(".yaml") for p in DRAFTERS_DIR.iterdir() if p.name.endswith(".yaml")
    )


def drafter_target(name: str) -> str | None:
    """The model a shipped drafter spec drafts for (its `target` key)."""
    with resources.as_file(DRAFTERS_DIR / f"{name}.yaml") as path:
        data = read_yaml(path)
    return data.get("target") if isinstance(data, dict) else None


def load_drafter(ref: str, target: ModelSpec) -> ModelSpec:
    """`target` drafting with `--draft ref` (mkgen.spec.draft.with_draft checks the fit):
    "mtp" (the target's own MTP section), a shipped drafter spec's name, a drafter spec
    file (.yaml: a `draft:` section and optionally the `target` it drafts for), or a
    drafter's config.json or checkpoint directory (a DFlash drafter as a block drafter,
    any other model as a model drafter). One-line SpecErrors."""
    if ref == "mtp":
        return with_draft(target, "mtp")
    path = checked_path(ref)
    if ref in list_drafter_names():
        with resources.as_file(DRAFTERS_DIR / f"{ref}.yaml") as shipped:
            return with_draft(target, _drafter_file(shipped, target))
    if path.suffix in (".yaml", ".yml"):
        if not path.exists():
            raise SpecError(f"--draft {ref}: no such file")
        return with_draft(target, _drafter_file(path, target))
    if path.suffix == ".json" or path.is_dir():
        config = path / "config.json" if path.is_dir() else path
        data = read_json(config)
        if isinstance(data, dict) and data.get("architectures") == ["DFlashDraftModel"]:
            return with_draft(target, import_block_draft(path))
        return with_draft(target, ModelDraft(kind="model", model=import_hf_config(path)))
    shipped = ", ".join(list_drafter_names()) or "none"
    raise SpecError(
        f"--draft {ref}: not mtp, not a drafter spec in model_specs/drafters/ ({shipped}), and "
        "not a .yaml drafter spec, a config.json or a checkpoint directory"
    )


def _drafter_file(path: Path, target: ModelSpec) -> MtpDraft | BlockDraft | ModelDraft:
    """The drafter of a drafter spec file, refused in one line when malformed or written
    for another model."""
    data = read_yaml(path)
    if not isinstance(data, dict) or "draft" not in data:
        raise SpecError(f"{path.name}: a drafter spec holds a `draft:` section; add one")
    unknown = sorted(set(data) - set(_DRAFTER_FILE_KEYS))
    if unknown:
        raise SpecError(
            f"{path.name}: {unknown[0]}: unknown key (a drafter spec holds "
            f"{' and '.join(_DRAFTER_FILE_KEYS)})"
        )
    named = data.get("target")
    if named is not None and named != target.name:
        raise SpecError(
            f"{path.name}: drafts for {named}, not {target.name}; give a drafter for {target.name}"
        )
    try:  # validated under its key, so that an error names draft.FIELD
        return _SECTION.validate_python({"draft": data["draft"]})["draft"]
    except ValidationError as error:
        raise SpecError(describe_validation_error(error, path.name)) from None
