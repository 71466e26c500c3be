"""Drafters in the spec (mkgen/spec/draft.py, the draft section of mkgen/spec/schema.py):
checked against their target in one line, imported from config.json, absent from every
spec that has none."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from cli_run import assert_user_error, mkgen_here

from mkgen.errors import SpecError
from mkgen.spec.draft import draft_weights, with_draft
from mkgen.spec.draft_import import import_block_draft
from mkgen.spec.files import spec_from_dict
from mkgen.spec.hf_import import import_hf_config, import_hf_dict
from mkgen.spec.loader import list_spec_names, load_spec
from mkgen.spec.mini import mini_twin
from mkgen.spec.schema import BlockDraft, ModelDraft

FIXTURES = Path(__file__).parent / "fixtures" / "hf"

TARGET = {
    "name": "target",
    "dims": {"hidden": 64, "vocab": 128, "norm_eps": 1e-6},
    "attention_kinds": {
        "gqa": {"type": "gqa", "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
                "rope": {"theta": 1e6}, "qk_norm": "rms"},
        "gdn": {"type": "gated_deltanet", "num_key_heads": 2, "num_value_heads": 2,
                "key_head_dim": 16, "value_head_dim": 16, "conv_width": 4},
    },
    "ffn_kinds": {"mlp": {"type": "dense", "width": 96, "activation": "silu"}},
    "layers": {"count": 4, "attention": {"pattern": ["gdn", "gqa"]}, "ffn": {"default": "mlp"}},
}  # fmt: skip
BLOCK = {
    "kind": "block", "hidden": 64, "layers": 2, "attention": TARGET["attention_kinds"]["gqa"],
    "ffn": {"type": "dense", "width": 96, "activation": "silu"}, "norm_eps": 1e-6,
    "block_size": 8, "feature_layers": [1, 3], "mask_token": 127,
}  # fmt: skip
MTP = {"kind": "mtp", "layers": 1, "attention": "gqa", "ffn": "mlp"}
MODEL = {"kind": "model", "model": TARGET | {"name": "small"}}


def _spec(draft: dict | None):
    return spec_from_dict(TARGET | ({"draft": draft} if draft is not None else {}), "t.yaml")


@pytest.mark.parametrize("draft", [BLOCK, MTP, MODEL], ids=lambda d: d["kind"])
def test_each_drafter_kind_is_accepted_on_a_fitting_target(draft):
    assert _spec(draft).draft.kind == draft["kind"]


BAD = [
    (BLOCK | {"feature_layers": [1, 4]}, "draft.feature_layers: layer 4 does not exist in the "
     "target's 4 layers (0..3); name target layers below 4"),
    (BLOCK | {"hidden": 128}, "draft.hidden 128 does not fit the target's hidden 64"),
    (BLOCK | {"mask_token": 128}, "draft.mask_token 128 is outside the target's vocabulary of 128"),
    (BLOCK | {"lm_head": "own", "draft_vocab": 256}, "draft.draft_vocab 256 exceeds the target's "
     "vocabulary of 128"),
    (BLOCK | {"draft_vocab": 32}, "draft: draft_vocab needs lm_head: own"),
    (BLOCK | {"feature_layers": []}, "draft.feature_layers: name at least one target layer"),
    (BLOCK | {"attention": BLOCK["attention"] | {"sliding_window": 4}},
     "attention.sliding_window is not supported in a block drafter"),
    (MTP | {"ffn": "moe"}, "draft.ffn: 'moe' is not one of the target's ffn kinds (mlp)"),
    (MTP | {"attention": "gdn"}, "draft.attention: 'gdn' is a gated_deltanet kind; an MTP layer "
     "is a full-attention layer: name a gqa or mla kind"),
    ({"kind": "model", "model": TARGET | {"name": "s", "dims": TARGET["dims"] | {"vocab": 256}}},
     "draft.model.dims: vocabulary 256 (used all) does not match the target's 128 (used all)"),
    ({"kind": "model", "model": TARGET | {"name": "s", "draft": MTP}},
     "a drafter model has no draft section of its own"),
    ({"kind": "eagle"}, "draft: type 'eagle' found using 'kind' does not match"),
]  # fmt: skip


@pytest.mark.parametrize(("draft", "message"), BAD, ids=[m[:40] for _, m in BAD])
def test_a_drafter_that_does_not_fit_its_target_is_one_line_naming_it(draft, message):
    with pytest.raises(SpecError) as error:
        _spec(draft)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert str(error.value).startswith("t.yaml: ")


def test_the_cli_refuses_a_spec_with_a_misfit_drafter_with_exit_2(tmp_path: Path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(TARGET | {"draft": BLOCK | {"feature_layers": [9]}}))
    assert_user_error(mkgen_here("show", str(path)), "bad.yaml", "draft.feature_layers", "layer 9")


def test_draft_mtp_on_a_target_without_mtp_layers_is_refused():
    with pytest.raises(SpecError, match="target: draft mtp needs the target's multi-token-"):
        with_draft(_spec(None), "mtp")
    assert with_draft(_spec(MTP), "mtp").draft.kind == "mtp"


def test_with_draft_checks_the_drafter_against_the_target():
    drafter = BlockDraft.model_validate(BLOCK | {"feature_layers": [7]})
    with pytest.raises(SpecError, match="target: draft.feature_layers: layer 7 does not exist"):
        with_draft(_spec(None), drafter)
    assert with_draft(_spec(None), BlockDraft.model_validate(BLOCK)).draft.feature_layers == [1, 3]
    assert isinstance(with_draft(_spec(None), ModelDraft.model_validate(MODEL)).draft, ModelDraft)


@pytest.mark.parametrize("name", list_spec_names())
def test_a_spec_without_a_drafter_dumps_no_draft_key(name):
    spec = load_spec(name)
    assert spec.draft is None
    assert "draft" not in spec.model_dump(mode="json") and '"draft"' not in spec.model_dump_json()


def test_a_spec_with_a_drafter_round_trips_through_its_dump():
    spec = _spec(BLOCK)
    assert spec_from_dict(spec.model_dump(mode="json"), "again") == spec


def test_the_mini_twin_keeps_the_drafter_at_its_sizes():
    # verify's kernel writes the hidden states the twin's drafter reads.
    twin = mini_twin(_spec(BLOCK))
    assert twin.draft.hidden == twin.dims.hidden and twin.draft.attention.head_dim <= 32
    assert max(twin.draft.feature_layers) < twin.layers.count
    assert mini_twin(_spec(MTP)).draft == _spec(MTP).draft
    assert mini_twin(_spec(MODEL)).draft.model.dims.vocab == twin.dims.vocab


def test_draft_weights_name_every_drafter_tensor_and_nothing_for_no_drafter():
    assert draft_weights(_spec(None)) == []
    mtp = {w.name: w.shape for w in draft_weights(_spec(MTP))}
    assert mtp["draft.0.eh_proj"] == (128, 64) and mtp["draft.0.attn.wq"] == (64, 64)
    assert {"draft.0.enorm", "draft.0.hnorm", "draft.0.final_norm", "draft.0.ffn.w_up"} <= set(mtp)
    block = {w.name: w.shape for w in draft_weights(_spec(BLOCK | {"lm_head": "own",
                                                                   "draft_vocab": 32}))}  # fmt: skip
    assert block["draft.fc"] == (128, 64) and block["draft.lm_head"] == (64, 32)
    assert block["draft.d2t"] == (32,) and "draft.layers.1.attn.k_norm" in block
    model = {w.name for w in draft_weights(_spec(MODEL))}
    assert {"draft.embedding", "draft.lm_head", "draft.layers.3.ffn.w_down"} <= model


# ---------------------------------------------------------------- import from config.json


def _config(folder: str, **changes) -> dict:
    return json.loads((FIXTURES / folder / "config.json").read_text()) | changes


@pytest.mark.parametrize(
    ("folder", "key", "kinds"),
    [
        ("deepseek_v3", "num_nextn_predict_layers", ("mla", "moe")),
        ("qwen3_next", "mtp_num_hidden_layers", ("full", "moe")),
        ("kimi_linear", "num_nextn_predict_layers", ("mla", "moe")),
    ],
)
def test_import_keeps_mtp_layers_as_an_mtp_draft_section(folder, key, kinds):
    spec = import_hf_dict(_config(folder, **{key: 1}), "m", folder, keep_mtp=True)
    assert (spec.draft.kind, spec.draft.layers, spec.draft.attention, spec.draft.ffn) == (
        "mtp",
        1,
        *kinds,
    )
    assert "kept as the draft section (kind mtp)" in spec.description
    qwen = folder == "qwen3_next"  # vLLM's qwen3_next_mtp.py: no mask, normed chain
    assert (spec.draft.mask_first_embedding, spec.draft.chain) == (
        (False, "normed") if qwen else (True, "pre_norm")
    )


def test_import_without_keep_mtp_is_unchanged_and_has_no_drafter():
    config = _config("deepseek_v3", num_nextn_predict_layers=1)
    spec = import_hf_dict(config, "m", "deepseek_v3")
    assert spec.draft is None and "are not imported" in spec.description
    kept = import_hf_dict(config, "m", "deepseek_v3", keep_mtp=True)
    assert kept.model_copy(update={"draft": None, "description": spec.description}) == spec


def test_import_keep_mtp_without_mtp_layers_adds_no_drafter():
    assert import_hf_config(FIXTURES / "qwen3" / "config.json", keep_mtp=True).draft is None


def test_a_dflash_config_imports_as_a_block_drafter():
    draft = import_block_draft(FIXTURES / "drafters" / "dflash_qwen3")
    assert (draft.layers, draft.block_size, draft.feature_layers, draft.mask_token) == (
        2,
        4,
        [0, 1],
        1,
    )
    assert draft.attention.qk_norm == "rms" and draft.attention.rope.theta == 1e6
    assert (draft.ffn.width, draft.hidden, draft.lm_head) == (96, 64, "shared")


def test_a_config_that_is_not_a_dflash_drafter_is_refused(tmp_path: Path):
    with pytest.raises(SpecError, match="not a DFlash drafter config"):
        import_block_draft(FIXTURES / "qwen3")
    config = _config("drafters/dflash_qwen3", is_causal=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecError, match="is_causal: a block drafter drafts non-causally"):
        import_block_draft(tmp_path)


def test_import_hf_keep_mtp_writes_the_mtp_draft_section_and_names_the_flag(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(_config("deepseek_v3", num_nextn_predict_layers=1)))
    kept = mkgen_here("import-hf", str(config), "--name", "m", "--keep-mtp")
    assert kept.returncode == 0, kept.stderr
    assert "mkgen import-hf config.json --keep-mtp --name m" in kept.stdout
    assert spec_from_dict(yaml.safe_load(kept.stdout), "stdout").draft.kind == "mtp"
    plain = mkgen_here("import-hf", str(config), "--name", "m")
    assert plain.returncode == 0, plain.stderr
    assert (
        "--keep-mtp" not in plain.stdout
        and spec_from_dict(yaml.safe_load(plain.stdout), "stdout").draft is None
    )


def test_import_hf_keep_mtp_on_a_config_without_mtp_layers_is_one_line():
    result = mkgen_here("import-hf", str(FIXTURES / "qwen3" / "config.json"), "--keep-mtp")
    assert_user_error(result, "--keep-mtp: the config has no multi-token-prediction layers")
