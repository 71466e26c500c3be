"""Loading specs: a name in model_specs/, a YAML path, a Hugging Face config.json or a
checkpoint directory holding one (mkgen/spec/files.py reads the files)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from mkgen.errors import SpecError
from mkgen.spec.files import checked_path, read_yaml, spec_from_dict
from mkgen.spec.hf_import import import_hf_config
from mkgen.spec.schema import ModelSpec

# Package data: the shipped specs travel inside the wheel.
SPECS_DIR = resources.files("mkgen") / "model_specs"


def load_spec(ref: str | Path) -> ModelSpec:
    """Load a spec by name (model_specs/NAME.yaml), YAML path, config.json path or
    Hugging Face checkpoint directory (its config.json). A shipped name wins over a
    directory of the same name; ./NAME is the directory."""
    path = checked_path(ref)
    if str(ref) in list_spec_names():
        with resources.as_file(SPECS_DIR / f"{ref}.yaml") as shipped:
            return spec_from_dict(read_yaml(shipped), shipped.name)
    if path.suffix in (".yaml", ".yml"):
        if not path.exists():
            raise SpecError(f"{path}: no such file")
        return spec_from_dict(read_yaml(path), path.name)
    if path.suffix == ".json" or path.is_dir():
        return import_hf_config(path)
    if path.exists():
        raise SpecError(
            f"{path}: not a spec; give a .yaml spec, a config.json or a checkpoint directory"
        )
    known = ", ".join(list_spec_names()) or "none"
    raise SpecError(
        f"unknown spec {str(ref)!r}: not a file, not a checkpoint directory and not in "
        f"model_specs/ ({known})"
    )


def list_spec_names() -> list[str]:
    return sorted(
        p.name.removesuffix(".yaml") for p in SPECS_DIR.iterdir() if p.name.endswith(".yaml")
    )
