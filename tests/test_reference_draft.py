"""The drafters' plain-JAX reference (mkgen/reference/draft.py).

Against independent torch ports (scripts/make_hf_fixtures.py: DeepSeek-V3's MTP head as
vLLM runs it, the DFlash block drafter as z-lab's code runs it; the committed drafts and
logits of three draft-and-verify steps in tests/fixtures/hf/drafters/<name>/), and on the
plumbing: a drafter identical to its target accepts every row, a perturbed one some, and
whatever the drafter, greedy drafting yields the target's own greedy tokens, which a
mutated accept rule breaks.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from mkgen.reference.draft import (
    accept_greedy,
    compile_draft_step,
    compile_traced,
    init_draft_state,
    init_draft_weights,
    load_draft_weights,
    mean_acceptance,
    perturbed,
    speculative_generate,
)
from mkgen.reference.hf_weights import load_hf_weights
from mkgen.reference.model import generate, init_cache, init_weights
from mkgen.spec.draft import with_draft
from mkgen.spec.draft_import import import_block_draft
from mkgen.spec.files import spec_from_dict
from mkgen.spec.hf_import import import_hf_config

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
# float32 against float32, as tests/test_reference_hf.py (logits O(1..4)).
ATOL = 2e-5


# ---------------------------------------------------------------- against the torch ports


def _target_weights(folder: str, spec) -> dict[str, jax.Array]:
    config = json.loads((FIXTURES / folder / "config.json").read_text())
    tensors = load_file(FIXTURES / folder / "model.safetensors")
    return load_hf_weights(spec, config["architectures"][0], tensors)


def _replay(spec, weights, expected, rows: int) -> None:
    """The reference drafts each step of the torch run from the same committed tokens."""
    seq, lengths = expected["committed_ids"], list(expected["step_lengths"])
    weights = {k: jnp.asarray(v) for k, v in weights.items()}
    run, draft = compile_traced(spec), compile_draft_step(spec, rows)
    cache = init_cache(spec, 1, len(seq) + rows)
    state = init_draft_state(spec, 1, len(seq) + rows)
    tokens = jnp.asarray(seq[: lengths[0] - 1])[None]
    for step, length in enumerate(lengths):
        _, cache, hidden = run(weights, tokens, cache)
        drafts, logits, state = draft(
            weights, state, tokens, hidden, jnp.asarray([seq[length - 1]])
        )
        error = float(np.max(np.abs(np.asarray(logits[0]) - expected["draft_logits"][step])))
        assert error <= ATOL, f"step {step}: draft logits off by {error:.2e}"
        np.testing.assert_array_equal(drafts[0], expected["draft_ids"][step], f"step {step}")
        following = lengths[step + 1] if step + 1 < len(lengths) else len(seq)
        tokens = jnp.asarray(seq[length - 1 : following - 1])[None]


def test_mtp_reference_matches_the_torch_port_of_deepseek_v3_mtp():
    folder = FIXTURES / "drafters" / "mtp_deepseek_v3"
    spec = import_hf_config(folder / "config.json", keep_mtp=True)
    weights = _target_weights("deepseek_v3", spec)
    arch = json.loads((folder / "config.json").read_text())["architectures"][0]
    weights |= load_draft_weights(spec, arch, load_file(folder / "drafter.safetensors"))
    _replay(spec, weights, np.load(folder / "expected_drafts.npz"), rows=4)


def test_block_reference_matches_the_torch_port_of_dflash():
    folder = FIXTURES / "drafters" / "dflash_qwen3"
    spec = with_draft(
        import_hf_config(FIXTURES / "qwen3" / "config.json"), import_block_draft(folder)
    )
    weights = _target_weights("qwen3", spec)
    weights |= load_draft_weights(
        spec, "DFlashDraftModel", load_file(folder / "drafter.safetensors")
    )
    _replay(spec, weights, np.load(folder / "expected_drafts.npz"), rows=4)


def test_a_drafter_checkpoint_with_a_tensor_the_mapping_does_not_read_is_refused():
    folder = FIXTURES / "drafters" / "dflash_qwen3"
    spec = with_draft(
        import_hf_config(FIXTURES / "qwen3" / "config.json"), import_block_draft(folder)
    )
    tensors = load_file(folder / "drafter.safetensors") | {"lm_head.weight": np.zeros((128, 64))}
    with pytest.raises(Exception, match="lm_head.weight: not a tensor of this block drafter"):
        load_draft_weights(spec, "DFlashDraftModel", tensors)


# ---------------------------------------------------------------- plumbing on a tiny target

TINY = {
    "name": "tiny-target",
    "dims": {"hidden": 32, "vocab": 64, "norm_eps": 1e-6},
    "attention_kinds": {
        "gqa": {"type": "gqa", "num_heads": 2, "num_kv_heads": 1, "head_dim": 16,
                "rope": {"theta": 1e4}, "qk_norm": "rms"},
    },
    "ffn_kinds": {"mlp": {"type": "dense", "width": 48, "activation": "silu"}},
    "layers": {"count": 2, "attention": {"default": "gqa"}, "ffn": {"default": "mlp"}},
}  # fmt: skip
BLOCK = {
    "kind": "block", "hidden": 32, "layers": 1, "attention": TINY["attention_kinds"]["gqa"],
    "ffn": {"type": "dense", "width": 32, "activation": "silu"}, "norm_eps": 1e-6,
    "block_size": 4, "feature_layers": [0, 1], "mask_token": 63,
}  # fmt: skip
DRAFTS = {
    "mtp": {"kind": "mtp", "layers": 1, "attention": "gqa", "ffn": "mlp"},
    "block": BLOCK,
    "model": {"kind": "model", "model": TINY | {"name": "tiny-drafter"}},
}
PROMPT = np.array([5, 17, 42, 9, 33, 2], np.int32)
ROWS, STEPS = 4, 10


def _tiny(draft: dict | None = None):
    return spec_from_dict(TINY | ({"draft": draft} if draft else {}), "tiny")


@pytest.fixture(scope="module")
def target():
    spec = _tiny()
    weights = init_weights(spec)
    return spec, weights, generate(spec, weights, PROMPT, STEPS)


def _model_drafter(weights) -> tuple:
    """The tiny target drafting for itself as a `model` drafter with these weights."""
    return _tiny(DRAFTS["model"]), {f"draft.{k}": v for k, v in weights.items()}


@pytest.mark.parametrize("kind", sorted(DRAFTS))
def test_greedy_drafting_yields_the_targets_greedy_tokens(target, kind):
    base, weights, expected = target
    spec = _tiny(DRAFTS[kind])
    tokens, produced = speculative_generate(
        spec, weights | init_draft_weights(spec, seed=3), PROMPT, STEPS, ROWS
    )
    np.testing.assert_array_equal(tokens, expected)
    assert all(1 <= n <= ROWS for n in produced) and sum(produced) + 1 >= STEPS


def test_a_drafter_identical_to_the_target_accepts_every_row(target):
    base, weights, expected = target
    spec, draft = _model_drafter(weights)
    tokens, produced = speculative_generate(spec, weights | draft, PROMPT, STEPS, ROWS)
    np.testing.assert_array_equal(tokens, expected)
    assert produced == [ROWS] * len(produced)


def test_a_perturbed_copy_of_the_target_accepts_some_rows_but_not_all(target):
    base, weights, expected = target
    spec, draft = _model_drafter(perturbed(weights, 0.3))
    tokens, produced = speculative_generate(spec, weights | draft, PROMPT, STEPS, ROWS)
    np.testing.assert_array_equal(tokens, expected)
    assert 1 < mean_acceptance(produced) < ROWS, produced


def test_accepting_one_draft_too_many_breaks_the_greedy_tokens(target):
    base, weights, expected = target
    spec, draft = _model_drafter(perturbed(weights, 0.3))

    def one_too_many(drafts, verified):
        accepted, _ = accept_greedy(drafts, verified)
        accepted = np.minimum(accepted + 1, drafts.shape[1])
        return accepted, verified[np.arange(len(verified)), accepted]

    tokens, _ = speculative_generate(
        spec, weights | draft, PROMPT, STEPS, ROWS, accept=one_too_many
    )
    assert not np.array_equal(tokens, expected)


def test_accept_greedy_takes_the_longest_matching_prefix_and_the_bonus():
    drafts = np.array([[7, 8, 9], [7, 8, 9], [1, 8, 9], [7, 8, 9]])
    verified = np.array([[7, 8, 9, 4], [7, 2, 9, 4], [7, 8, 9, 4], [7, 8, 5, 4]])
    accepted, bonus = accept_greedy(drafts, verified)
    assert accepted.tolist() == [3, 1, 0, 2]
    assert bonus.tolist() == [4, 2, 7, 5]


def _first_step(spec, weights, rows=ROWS, hidden=None):
    """The drafter's first step after the prompt (jitted): (drafts, logits, hidden, next
    token); `hidden` replaces the target's residual streams."""
    logits, _, streams = compile_traced(spec)(weights, PROMPT[None], init_cache(spec, 1, 16))
    next_token = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
    hidden = streams if hidden is None else hidden
    state = init_draft_state(spec, 1, 16)
    drafts, draft_logits, _ = compile_draft_step(spec, rows)(
        weights, state, PROMPT[None], hidden, next_token
    )
    return drafts, draft_logits, hidden, next_token


def test_a_model_drafter_drafts_the_small_models_greedy_continuation(target):
    _, weights, _ = target
    small = TINY | {"name": "tiny-drafter", "layers": TINY["layers"] | {"count": 1}}
    spec = _tiny({"kind": "model", "model": small})
    draft = init_draft_weights(spec, seed=5)
    drafts, _, _, next_token = _first_step(spec, weights | draft)
    small_spec = spec_from_dict(small, "small")
    small_weights = {k.removeprefix("draft."): v for k, v in draft.items()}
    fed = np.concatenate([PROMPT, np.asarray(next_token)])
    np.testing.assert_array_equal(drafts[0], generate(small_spec, small_weights, fed, ROWS - 1))


def test_a_block_drafter_reads_its_feature_layers_and_no_other(target):
    _, weights, _ = target
    spec = _tiny(BLOCK | {"feature_layers": [1]})
    weights = weights | init_draft_weights(spec)
    _, logits, hidden, _ = _first_step(spec, weights)
    for layer, moves in ((0, False), (1, True)):
        other = _first_step(spec, weights, hidden=hidden.at[layer].add(1.0))[1]
        assert bool(jnp.any(jnp.abs(other - logits) > 1e-3)) == moves, f"layer {layer}"


def test_a_reduced_draft_vocabulary_maps_drafts_into_the_targets(target):
    _, weights, _ = target
    spec = _tiny(BLOCK | {"lm_head": "own", "draft_vocab": 8})
    draft = init_draft_weights(spec)
    drafts, logits, _, _ = _first_step(spec, weights | draft)
    image = np.arange(8) + np.asarray(draft["draft.d2t"])
    assert logits.shape[-1] == 8 and set(np.asarray(drafts[0]).tolist()) <= set(image.tolist())


def test_drafting_fewer_rows_than_a_block_keeps_its_first_drafts(target):
    _, weights, _ = target
    spec = _tiny(BLOCK)
    weights = weights | init_draft_weights(spec)
    full = _first_step(spec, weights, rows=4)[0]
    short = _first_step(spec, weights, rows=2)[0]
    np.testing.assert_array_equal(short[0], full[0, :1])


def test_mtp_variants_change_what_they_should_and_nothing_else(target):
    _, weights, _ = target
    deepseek = _tiny(DRAFTS["mtp"])
    weights = weights | init_draft_weights(deepseek)
    logits = _first_step(deepseek, weights)[1]
    # Qwen3-Next's MTP chains the normed output: draft 1 is the same, the later ones move.
    normed = _first_step(_tiny(DRAFTS["mtp"] | {"chain": "normed"}), weights)[1]
    np.testing.assert_allclose(normed[:, 0], logits[:, 0], rtol=1e-6, atol=1e-6)
    assert float(jnp.max(jnp.abs(normed[:, 1:] - logits[:, 1:]))) > 1e-3
    # Without the position-0 mask the first entry, which every later one attends to, moves.
    unmasked = _first_step(_tiny(DRAFTS["mtp"] | {"mask_first_embedding": False}), weights)[1]
    assert float(jnp.max(jnp.abs(unmasked[:, 0] - logits[:, 0]))) > 1e-4
