"""A drafter's own config.json as a drafter (mkgen/spec/draft.py, docs/drafting.md)."""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from mkgen.errors import SpecError
from mkgen.spec.files import describe_validation_error, read_json
from mkgen.spec.hf_import import import_hf_dict
from mkgen.spec.schema import BlockDraft

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
