"""Importing a Hugging Face config.json as a ModelSpec.

Supported architectures (``architectures[0]``, or ``model_type`` when that list is
absent): DeepseekV3ForCausalLM (incl. Kimi K2), Qwen3ForCausalLM,
Qwen3MoeForCausalLM, MixtralForCausalLM, Qwen3NextForCausalLM, GptOssForCausalLM
and KimiLinearForCausalLM. Both config flavours are read: the published ones
(``rope_theta`` + ``rope_scaling``, Kimi Linear's ``linear_attn_config`` with
1-based layer lists) and the ones transformers 5 writes (``rope_parameters``,
``layer_types``, ``mlp_layer_types``, attribute-map aliases such as
``num_local_experts``). Where a key is absent the transformers 5 default of that
architecture applies, except for the DeepSeek routing keys whose defaults differ
between transformers and DeepSeek's own code (those must be given).

Nothing is dropped silently: every key of the config is either mapped into the
spec, checked to have the one value the spec can express, or on the explicit
allow-list of keys that do not change what a decode step computes (token ids,
training-only knobs, serialisation metadata). Any other key is an error naming
it, so a config with new semantics fails loudly instead of importing wrong.
Errors are one line: ``<file>: <field>: <what is wrong and what would fix it>``.

One module per concern: config.py reads a config (typed getters, allow-lists),
common.py holds what every family reads alike, layers.py writes compact layer tables,
and one module per architecture family holds its importers (deepseek.py: DeepSeek-V3,
Kimi K2, Kimi Linear; qwen.py: Qwen3, Qwen3-MoE, Qwen3-Next; mixtral.py; gpt_oss.py).
`ARCHITECTURES` below is the dispatch table: architecture class -> its model_type
values and its importer.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mkgen.errors import SpecError
from mkgen.spec.draft import mtp_section
from mkgen.spec.files import dump_spec_yaml, read_json, spec_from_dict
from mkgen.spec.hf_import.common import Parts
from mkgen.spec.hf_import.config import METADATA_KEYS, Config
from mkgen.spec.hf_import.deepseek import deepseek_v3, kimi_linear
from mkgen.spec.hf_import.gpt_oss import gpt_oss
from mkgen.spec.hf_import.layers import compact_layer_assignment
from mkgen.spec.hf_import.mixtral import mixtral
from mkgen.spec.hf_import.qwen import qwen3, qwen3_moe, qwen3_next
from mkgen.spec.schema import ModelSpec

# ---------------------------------------------------------------- the table of architectures


@dataclass(frozen=True)
class _Architecture:
    model_types: tuple[str, ...]
    build: Callable[[Config], Parts]


ARCHITECTURES: dict[str, _Architecture] = {
    "DeepseekV3ForCausalLM": _Architecture(("deepseek_v3", "kimi_k2"), deepseek_v3),
    "Qwen3ForCausalLM": _Architecture(("qwen3",), qwen3),
    "Qwen3MoeForCausalLM": _Architecture(("qwen3_moe",), qwen3_moe),
    "MixtralForCausalLM": _Architecture(("mixtral",), mixtral),
    "Qwen3NextForCausalLM": _Architecture(("qwen3_next",), qwen3_next),
    "GptOssForCausalLM": _Architecture(("gpt_oss",), gpt_oss),
    "KimiLinearForCausalLM": _Architecture(("kimi_linear",), kimi_linear),
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


def canonical_architecture(name: str, source: str = "config") -> str:
    """The architecture class for a class name or model_type (e.g. 'kimi_k2')."""
    if name in ARCHITECTURES:
        return name
    for arch, info in ARCHITECTURES.items():
        if name in info.model_types:
            return arch
    raise SpecError(
        f"{source}: architectures: {name!r} is not supported; mkgen imports "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def resolve_architecture(config: dict[str, Any], source: str) -> str:
    """The supported architecture a config describes (architectures[0], else model_type)."""
    archs = config.get("architectures")
    model_type = config.get("model_type")
    if archs is not None:
        if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
            raise SpecError(f"{source}: architectures: expected a list of class names")
        if len(archs) > 1:
            raise SpecError(
                f"{source}: architectures: lists {len(archs)} classes; give exactly one"
            )
        arch = canonical_architecture(archs[0], source)
        if model_type is not None and model_type not in ARCHITECTURES[arch].model_types:
            raise SpecError(
                f"{source}: model_type: {model_type!r} does not go with {arch} (expected "
                f"{' or '.join(ARCHITECTURES[arch].model_types)})"
            )
        return arch
    if isinstance(model_type, str):
        try:
            return canonical_architecture(model_type, source)
        except SpecError:
            raise SpecError(
                f"{source}: model_type: {model_type!r} is not supported; mkgen imports "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            ) from None
    raise SpecError(f"{source}: architectures: missing (and no model_type); cannot tell the model")


def default_spec_name(path: Path) -> str:
    """A checkpoint directory's name or a config file's stem, lowercased, with runs of
    other characters turned into '-'."""
    path = Path(path)
    base = path.resolve().name if path.is_dir() else path.stem
    name = re.sub(r"[^a-z0-9._-]+", "-", base.lower())
    name = re.sub(r"^[^a-z0-9]+", "", name)[:64].rstrip("-")
    return name or "model"


def import_hf_dict(
    config: dict[str, Any], name: str, source: str, keep_mtp: bool = False
) -> ModelSpec:
    """Map a parsed Hugging Face config to a ModelSpec; `source` names it in errors.
    keep_mtp: the checkpoint's multi-token-prediction layers become an `mtp` draft section
    (off by default, so every imported spec without it stays byte-identical)."""
    if not isinstance(config, dict):
        raise SpecError(
            f"{source}: expected a JSON object at the top level, got {type(config).__name__}"
        )
    arch = resolve_architecture(config, source)
    c = Config(config, source, arch)
    c.keep_mtp = keep_mtp
    c.allow(*METADATA_KEYS)
    parts = ARCHITECTURES[arch].build(c)
    c.finish()
    model_type = config.get("model_type", "?")
    description = " ".join(
        [
            f"Imported from the Hugging Face config {Path(source).name} ({arch}, model_type "
            f"{model_type})."
        ]
        + c.notes
    )
    count = len(parts.attention_table)
    data = {
        "name": name,
        "description": description,
        "dims": parts.dims,
        "attention_kinds": parts.attention_kinds,
        "ffn_kinds": parts.ffn_kinds,
        "layers": {
            "count": count,
            "attention": compact_layer_assignment(parts.attention_table),
            "ffn": compact_layer_assignment(parts.ffn_table),
        },
    }
    if parts.quantization:
        data["quantization"] = parts.quantization
    if keep_mtp and c.mtp_layers:
        data["draft"] = mtp_section(
            c.mtp_layers, data, parts.attention_table, parts.ffn_table, arch
        )
    return spec_from_dict(data, source)


def import_hf_config(path: Path, name: str | None = None, keep_mtp: bool = False) -> ModelSpec:
    """Map a config.json, or a checkpoint directory's, to a ModelSpec (name: the
    directory's name or the file's stem by default; keep_mtp: see import_hf_dict)."""
    path = Path(path)
    config_path = path / "config.json" if path.is_dir() else path
    if path.is_dir() and not config_path.is_file():
        raise SpecError(f"{path}: no config.json in this directory (not a Hugging Face checkpoint)")
    config = read_json(config_path)
    return import_hf_dict(config, name or default_spec_name(path), str(config_path), keep_mtp)


def source_label(path: Path) -> str:
    """How a generated YAML names its source: a config inside the package (the shipped ones
    in mkgen/model_specs/hf-configs/) by its path from the checkout's root, else by its name."""
    package = Path(__file__).resolve().parents[2]  # mkgen/
    resolved = Path(path).resolve()
    if resolved.is_relative_to(package):
        return resolved.relative_to(package.parent).as_posix()
    return Path(path).name


def render_spec_yaml(path: Path, name: str | None = None, keep_mtp: bool = False) -> str:
    """The model_specs/ YAML of an imported config: a header naming the source, then the
    spec (keep_mtp: with the checkpoint's MTP layers as its `mtp` draft section; a config
    without any is an error, as the user asked for them)."""
    spec = import_hf_config(path, name, keep_mtp)
    label = source_label(path)
    if keep_mtp and spec.draft is None:
        raise SpecError(
            f"{label}: --keep-mtp: the config has no multi-token-prediction layers "
            "(num_nextn_predict_layers or mtp_num_hidden_layers); import it without --keep-mtp"
        )
    # A shipped config's label is a path from the checkout's root; any other is a file name.
    where = "from the checkout's root " if "/" in label else ""
    flag = " --keep-mtp" if keep_mtp else ""
    header = (
        f"# Generated by mkgen import-hf from {label} (a Hugging Face config.json).\n"
        f"# Do not edit; regenerate {where}with\n"
        f"#   mkgen import-hf {label}{flag} --name {spec.name} "
        f"-o mkgen/model_specs/{spec.name}.yaml --force\n"
    )
    return dump_spec_yaml(spec, header)
