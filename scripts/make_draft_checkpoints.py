"""Make tiny drafter checkpoints, one per drafter kind, in their published tensor names:
what `mkgen convert --draft-checkpoint` reads (tests/test_draft_convert.py).

Each is assembled from the transformers fixtures (tests/fixtures/hf, made by
scripts/make_hf_fixtures.py with torch: their names are the ones transformers and the
torch ports of the published drafters write), so no weight is drawn here and the output
is byte-identical from run to run. Only the project's own dependencies are used (numpy,
safetensors). Per kind, OUT/<kind>/ holds config.json and model.safetensors:

  mtp     DeepSeek-V3 with its own MTP layer, as DeepSeek-V3 and Kimi checkpoints ship
          it: the deepseek_v3 fixture's tensors, then the MTP module of
          drafters/mtp_deepseek_v3 after its decoder layers (model.layers.3.*: enorm,
          hnorm, eh_proj, shared_head and a decoder layer), and that drafter's config
          (num_nextn_predict_layers 1). The target's checkpoint and the drafter's at once.
  block   drafters/dflash_qwen3: a DFlash drafter (z-lab/dflash's DFlashDraftModel: fc,
          hidden_norm, norm, Qwen3 layers.{i}.*) for the qwen3 fixture.
  model   the qwen3 fixture itself (Qwen3ForCausalLM names): a model drafter identical to
          its target.

Run from anywhere:

    python scripts/make_draft_checkpoints.py --out DIR
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from safetensors.numpy import load_file, save_file

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "hf"
KINDS = ("mtp", "block", "model")
# The checkpoint each kind's drafter drafts for (mtp: its own directory holds both).
TARGETS = {"mtp": None, "block": FIXTURES / "qwen3", "model": FIXTURES / "qwen3"}


def _save(tensors: dict, config: Path, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(config, out / "config.json")
    save_file(dict(sorted(tensors.items())), str(out / "model.safetensors"), {"format": "pt"})
    return out


def write_mtp(out: Path) -> Path:
    """DeepSeek-V3's checkpoint with its MTP layer after the decoder layers."""
    drafter = FIXTURES / "drafters" / "mtp_deepseek_v3"
    tensors = load_file(FIXTURES / "deepseek_v3" / "model.safetensors")
    tensors |= load_file(drafter / "drafter.safetensors")
    return _save(tensors, drafter / "config.json", out)


def write_block(out: Path) -> Path:
    """A DFlash drafter's checkpoint."""
    drafter = FIXTURES / "drafters" / "dflash_qwen3"
    return _save(load_file(drafter / "drafter.safetensors"), drafter / "config.json", out)


def write_model(out: Path) -> Path:
    """A Qwen3 checkpoint: the qwen3 fixture's."""
    qwen3 = FIXTURES / "qwen3"
    return _save(load_file(qwen3 / "model.safetensors"), qwen3 / "config.json", out)


def write(out: Path) -> dict[str, Path]:
    """Every kind's checkpoint under `out`: {kind: its directory}."""
    writers = {"mtp": write_mtp, "block": write_block, "model": write_model}
    return {kind: writers[kind](out / kind) for kind in KINDS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory to write into")
    for kind, path in write(parser.parse_args().out).items():
        print(f"{kind}: {path}")


if __name__ == "__main__":
    main()
