"""The reference model: prefill equals decode, weights are deterministic, routing edge cases,
the sliding-window convention, and tame activations in random mini models."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mkgen.reference import (
    compile_forward,
    forward_traced,
    generate,
    init_cache,
    init_weights,
    route,
)
from mkgen.reference.attention import masked_softmax
from mkgen.reference.ffn import moe_ffn
from mkgen.reference.layers import rope_frequencies
from mkgen.spec.files import spec_from_dict
from mkgen.spec.loader import list_spec_names, load_spec
from mkgen.spec.mini import mini_twin
from mkgen.spec.schema import ModelSpec, MoEFFN, Rope

# f32 tolerances of prefill-vs-decode: the same math summed in a different order.
RTOL = 1e-5
ATOL_REL = 1e-5  # absolute tolerance, relative to the largest logit

# ---------------------------------------------------------------- named scenarios

DIMS = {"hidden": 64, "vocab": 96, "norm_eps": 1e-6}
YARN = {"factor": 8.0, "original_max_position": 64, "truncate": False}

GQA_SPEC = {
    "name": "ref-gqa",
    "dims": DIMS | {"logit_softcap": 5.0, "logit_multiplier": 0.7, "tie_embeddings": True},
    "attention_kinds": {
        # gpt-oss-like: window smaller than the sequence, sinks, biases, YaRN.
        "slide": {
            "type": "gqa", "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
            "rope": {"theta": 1.5e5, "scaling": YARN}, "sliding_window": 3, "sinks": True,
            "qkv_bias": True, "o_bias": True,
        },
        # Qwen3.8-like: q/k norm, output gate, partial rotary.
        "gated": {
            "type": "gqa", "num_heads": 4, "num_kv_heads": 1, "head_dim": 16,
            "rope": {"theta": 1e7, "rotary_dim": 8}, "qk_norm": "rms", "output_gate": "sigmoid",
        },
        # Muse-Spark-like: parameter-free q/k norm, interleaved pairs, explicit scale.
        "plain": {
            "type": "gqa", "num_heads": 2, "num_kv_heads": 2, "head_dim": 16,
            "rope": {"theta": 1e4, "interleaved": True}, "qk_norm": "rms_noparam",
            "softmax_scale": 0.2,
        },
    },
    "ffn_kinds": {
        "moe": {
            "type": "moe", "num_experts": 4, "top_k": 2, "expert_width": 32,
            "activation": {"kind": "clamped_swiglu", "alpha": 1.702, "limit": 1.0},
            "router": {"score": "softmax", "bias": True}, "expert_bias": True,
        },
        "gelu": {"type": "dense", "width": 48, "activation": "gelu_tanh", "bias": True},
        "plain_mlp": {"type": "dense", "width": 48, "activation": "gelu", "gated": False},
        "toy": {"type": "mlp", "width": 48, "activation": "silu"},  # the plain MLP kind
    },
    "layers": {
        "count": 4,
        "attention": {"pattern": ["slide", "gated", "plain", "slide"]},
        "ffn": {"default": "moe", "rules": [{"kind": "gelu", "indices": [1]},
                                            {"kind": "plain_mlp", "indices": [2]},
                                            {"kind": "toy", "indices": [3]}]},
    },
}  # fmt: skip

KIMI_SPEC = {
    "name": "ref-mla-kda",
    "dims": DIMS | {"norm_eps": 1e-5},
    "attention_kinds": {
        # Kimi K3's KDA: lower-bounded decay, full-rank output gate.
        "kda_bound": {
            "type": "kda", "num_heads": 2, "head_dim": 16, "conv_width": 4,
            "gate_lower_bound": -5.0, "decay_gate_rank": 8,
        },
        # Kimi Linear's KDA: softplus decay, low-rank output gate.
        "kda_softplus": {
            "type": "kda", "num_heads": 2, "head_dim": 16, "conv_width": 3,
            "decay_gate_rank": 16, "output_gate_rank": 16,
        },
        # DeepSeek-V3 MLA: q LoRA, interleaved YaRN rope, mscale.
        "mla_lora": {
            "type": "mla", "num_heads": 2, "q_lora_rank": 24, "kv_lora_rank": 32,
            "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
            "rope": {"theta": 1e4, "interleaved": True,
                     "scaling": {"factor": 40.0, "original_max_position": 64,
                                 "mscale": 1.0, "mscale_all_dim": 0.5}},
            "latent_norm_eps": 1e-6,
        },
        # Kimi K3 MLA: no q LoRA, NoPE, output gate.
        "mla_nope": {
            "type": "mla", "num_heads": 2, "q_lora_rank": None, "kv_lora_rank": 32,
            "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
            "rope": None, "output_gate": "sigmoid",
        },
    },
    "ffn_kinds": {
        "dense": {"type": "dense", "width": 96, "activation": "silu"},
        # DeepSeek-style grouped sigmoid routing with selection bias and a latent (Kimi K3).
        "moe": {
            "type": "moe", "num_experts": 8, "top_k": 3, "expert_width": 16, "activation": "situ",
            "router": {"score": "sigmoid", "selection_bias": True, "routed_scaling": 2.5,
                       "n_group": 4, "topk_group": 2},
            "shared_experts": {"count": 2, "width": 32, "gate": True},
            "latent": {"width": 32, "norm": True},
        },
    },
    "layers": {
        "count": 4,
        "attention": {"pattern": ["kda_bound", "kda_softplus", "mla_lora", "mla_nope"]},
        "ffn": {"default": "moe", "rules": [{"kind": "dense", "first": 1}]},
    },
    "attention_residual": {"block_size": 2, "max_snapshots": 2},
}  # fmt: skip

QWEN_NEXT_SPEC = {
    "name": "ref-qwen-next",
    "dims": DIMS | {"norm_style": "zero_centered"},
    "attention_kinds": {
        "gdn": {
            "type": "gated_deltanet", "num_key_heads": 2, "num_value_heads": 4,
            "key_head_dim": 16, "value_head_dim": 8, "conv_width": 4,
        },
        "full": {
            "type": "gqa", "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
            "rope": {"theta": 1e7, "rotary_dim": 4}, "qk_norm": "rms", "output_gate": "sigmoid",
        },
    },
    "ffn_kinds": {
        "moe": {
            "type": "moe", "num_experts": 6, "top_k": 2, "expert_width": 16, "activation": "silu",
            "router": {"score": "softmax", "renormalize": False},
            "shared_experts": {"count": 1, "width": 24, "gate": True},
            "latent": {"width": 32, "norm": False},
        },
    },
    "layers": {"count": 3, "attention": {"pattern": ["gdn", "gdn", "full"]},
               "ffn": {"default": "moe"}},
    "attention_residual": {"block_size": 1, "max_snapshots": 3},
}  # fmt: skip

SCENARIOS = {"gqa": GQA_SPEC, "mla_kda": KIMI_SPEC, "qwen_next": QWEN_NEXT_SPEC}

# One batch shape for most tests, so they share their XLA compilations.
BATCH, LENGTH, MAX_LEN = 2, 7, 9


def _spec(data: dict) -> ModelSpec:
    return spec_from_dict(data, data["name"])


@functools.cache
def _scenario(name: str):
    """(spec, weights, jitted forward, jitted forward_traced) of a named scenario or of the
    mini twin of a checked-in spec, built once per session."""
    spec = _spec(SCENARIOS[name]) if name in SCENARIOS else mini_twin(load_spec(name))
    traced = jax.jit(functools.partial(forward_traced, spec))
    return spec, init_weights(spec, seed=0), compile_forward(spec), traced


def _tokens(spec: ModelSpec, batch: int = BATCH, length: int = LENGTH, seed: int = 1):
    return jax.random.randint(jax.random.key(seed), (batch, length), 0, spec.dims.vocab)


def _assert_close(actual, expected, what: str) -> None:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = max(float(np.max(np.abs(expected))), 1.0)
    np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=ATOL_REL * scale, err_msg=what)


def _assert_caches_close(got, want, what: str) -> None:
    assert int(got["length"]) == int(want["length"])
    for i, (mine, theirs) in enumerate(zip(got["layers"], want["layers"], strict=True)):
        assert mine.keys() == theirs.keys()
        for key in theirs:
            a, b = mine[key].astype(jnp.float32), theirs[key].astype(jnp.float32)
            _assert_close(a, b, f"{what}: layer {i} cache {key}")


def _assert_tame(stream: jax.Array) -> None:
    """Residual RMS after every layer within 0.1..10 (init_weights' scaling works)."""
    rms = np.sqrt(np.mean(np.asarray(stream, np.float64) ** 2, axis=(1, 2, 3)))
    assert np.all((rms > 0.1) & (rms < 10)), f"residual RMS per layer {np.round(rms, 3)}"


def _prefill_vs_decode(name: str, batch=BATCH, length=LENGTH, max_len=MAX_LEN, dtype=None):
    """Prefill of `length` tokens equals `length` decode steps: logits at every position and
    the final caches. Returns the prefill's residual stream."""
    spec, weights, run, traced = _scenario(name)
    dtype = dtype or jnp.float32
    tokens = _tokens(spec, batch, length)
    prefill_logits, prefill_cache, stream = traced(
        weights, tokens, init_cache(spec, batch, max_len, dtype)
    )
    assert bool(jnp.all(jnp.isfinite(prefill_logits)))
    cache = init_cache(spec, batch, max_len, dtype)
    steps = []
    for t in range(length):
        logits, cache = run(weights, tokens[:, t : t + 1], cache)
        steps.append(logits)
    _assert_close(jnp.concatenate(steps, axis=1), prefill_logits, f"{name}: logits")
    _assert_caches_close(cache, prefill_cache, name)
    assert int(cache["length"]) == length
    return stream


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_prefill_equals_decode_steps(name):
    _prefill_vs_decode(name)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_residual_stream_stays_tame(name):
    spec, weights, _, traced = _scenario(name)
    stream = traced(weights, _tokens(spec), init_cache(spec, BATCH, MAX_LEN))[2]
    assert stream.shape == (spec.layers.count, BATCH, LENGTH, spec.dims.hidden)
    _assert_tame(stream)


def test_prefill_in_chunks_equals_one_prefill():
    """Verify rows: a multi-token forward continued from a cache (start_pos > 0) matches
    one prefill, for MLA's latent cache and KDA's conv and recurrent state."""
    spec, weights, run, traced = _scenario("mla_kda")
    tokens = _tokens(spec)
    whole, whole_cache, _ = traced(weights, tokens, init_cache(spec, BATCH, MAX_LEN))
    first, cache = run(weights, tokens[:, :4], init_cache(spec, BATCH, MAX_LEN))
    second, cache = run(weights, tokens[:, 4:], cache, 4)
    _assert_close(jnp.concatenate([first, second], axis=1), whole, "chunked prefill")
    _assert_caches_close(cache, whole_cache, "chunked prefill")


def test_bf16_cache_rounds_prefill_and_decode_alike():
    """KV and conv entries pass through the cache dtype before use, in both paths."""
    _prefill_vs_decode("qwen_next", batch=1, length=5, max_len=5, dtype=jnp.bfloat16)


@pytest.mark.parametrize("name", list_spec_names())
def test_mini_twin_of_every_checked_in_spec(name):
    """The mini twin of each model_specs/ YAML: prefill equals decode, activations stay tame."""
    _assert_tame(_prefill_vs_decode(name, batch=1, length=5, max_len=5))


# ---------------------------------------------------------------- weights


def test_weights_are_deterministic_per_seed():
    spec = _spec(QWEN_NEXT_SPEC)
    a, b, c = init_weights(spec, 0), init_weights(spec, 0), init_weights(spec, 1)
    assert a.keys() == b.keys() == c.keys()
    for name in a:
        assert a[name].dtype == jnp.float32
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
        assert not np.array_equal(a[name], c[name]), f"{name} does not depend on the seed"


def test_a_tensor_does_not_depend_on_the_others():
    """fold_in per name: adding layers leaves the shared tensors bit-identical."""
    small = _spec(QWEN_NEXT_SPEC)
    bigger = _spec(QWEN_NEXT_SPEC | {"layers": QWEN_NEXT_SPEC["layers"] | {"count": 5}})
    a, b = init_weights(small, 3), init_weights(bigger, 3)
    for name in ("embedding", "layers.0.attn.wq", "layers.2.ffn.experts_up", "lm_head"):
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_forward_is_deterministic():
    spec, weights, _, traced = _scenario("gqa")
    tokens = _tokens(spec)
    first = traced(weights, tokens, init_cache(spec, BATCH, MAX_LEN))[0]
    second = traced(weights, tokens, init_cache(spec, BATCH, MAX_LEN))[0]
    np.testing.assert_array_equal(first, second)


def test_greedy_generation_continues_prefill():
    spec, weights, _, traced = _scenario("qwen_next")
    prompt = _tokens(spec)[:, : LENGTH - 2]
    ids = generate(spec, weights, prompt, 2, max_len=MAX_LEN)
    full = jnp.concatenate([prompt, jnp.asarray(ids)], axis=1)
    logits = traced(weights, full, init_cache(spec, BATCH, MAX_LEN))[0]
    np.testing.assert_array_equal(ids, np.argmax(np.asarray(logits[:, -3:-1]), axis=-1))


# ---------------------------------------------------------------- attention conventions


def test_sliding_window_sees_window_keys_including_itself():
    """transformers' convention: query p sees keys p-w+1..p (one layer, so a token reaches a
    later position only through attention)."""
    window, length = 3, 7
    spec = _spec({
        "name": "window",
        "dims": DIMS,
        "attention_kinds": {"a": {"type": "gqa", "num_heads": 2, "num_kv_heads": 1,
                                  "head_dim": 16, "rope": {"theta": 1e4},
                                  "sliding_window": window}},
        "ffn_kinds": {"f": {"type": "dense", "width": 32, "activation": "silu"}},
        "layers": {"count": 1, "attention": {"default": "a"}, "ffn": {"default": "f"}},
    })  # fmt: skip
    weights, run = init_weights(spec, 0), compile_forward(spec)
    tokens = _tokens(spec, 1, length)
    base = run(weights, tokens, init_cache(spec, 1, length))[0][0, -1]
    p = length - 1
    for moved, visible in ((p - window, False), (p - window + 1, True)):
        changed = tokens.at[0, moved].set((tokens[0, moved] + 1) % spec.dims.vocab)
        logits = run(weights, changed, init_cache(spec, 1, length))[0][0, -1]
        assert bool(jnp.any(logits != base)) == visible, f"token {moved} seen from {p}"


def test_sinks_join_the_denominator_only():
    logits = jnp.array([[1.0, 2.0, 0.5, -3.0]])
    visible = jnp.array([[True, True, True, False]])
    sink = jnp.array([[0.7]])
    p = masked_softmax(logits, visible, sink)
    expected = np.exp([1.0, 2.0, 0.5]) / (np.exp([1.0, 2.0, 0.5]).sum() + np.exp(0.7))
    np.testing.assert_allclose(p[0, :3], expected, rtol=1e-6)
    assert float(p[0, 3]) == 0.0


def test_yarn_matches_transformers_formula():
    """gpt-oss-20b's YaRN (truncate false) and DeepSeek's mscale ratio, recomputed here."""
    rope = Rope(theta=150000.0, scaling={"factor": 32.0, "original_max_position": 4096,
                                         "truncate": False})  # fmt: skip
    inv_freq, factor = rope_frequencies(rope, 64)
    assert factor == pytest.approx(0.1 * np.log(32.0) + 1.0)
    base = 150000.0 ** -(np.arange(0, 64, 2) / 64)
    assert inv_freq[0] == pytest.approx(base[0], rel=1e-6)  # highest frequency: extrapolated
    assert inv_freq[-1] == pytest.approx(base[-1] / 32.0, rel=1e-5)  # lowest: interpolated
    deepseek = Rope(theta=1e4, scaling={"factor": 40.0, "original_max_position": 4096,
                                        "mscale": 1.0, "mscale_all_dim": 0.5})  # fmt: skip
    _, factor = rope_frequencies(deepseek, 64)
    assert factor == pytest.approx((0.1 * np.log(40) + 1) / (0.05 * np.log(40) + 1))


# ---------------------------------------------------------------- routing edge cases


def _moe(**router) -> MoEFFN:
    return MoEFFN.model_validate({
        "type": "moe", "num_experts": 4, "top_k": 2, "expert_width": 8, "activation": "silu",
        "router": {"score": "sigmoid"} | router,
    })  # fmt: skip


def _router_for(scores: list[float]) -> tuple[jax.Array, jax.Array]:
    """(x [1, 4], router [4, E]) whose sigmoid scores are `scores`: x picks router row 0."""
    logits = np.log(np.array(scores) / (1 - np.array(scores)))
    router = np.zeros((4, len(scores)), np.float32)
    router[0] = logits
    return jnp.array([[1.0, 0.0, 0.0, 0.0]]), jnp.asarray(router)


def test_selection_bias_changes_the_choice_not_the_weights():
    kind = _moe(selection_bias=True, renormalize=False)
    x, router = _router_for([0.9, 0.8, 0.3, 0.2])
    unbiased, w0 = route(kind, {"router": router, "selection_bias": jnp.zeros(4)}, x)
    biased, w1 = route(kind, {"router": router, "selection_bias": jnp.array([0, 0, 0.0, 1.0])}, x)
    assert sorted(np.asarray(unbiased[0]).tolist()) == [0, 1]
    assert sorted(np.asarray(biased[0]).tolist()) == [0, 3]
    chosen = dict(zip(np.asarray(biased[0]).tolist(), np.asarray(w1[0]).tolist(), strict=True))
    assert chosen == pytest.approx({0: 0.9, 3: 0.2})  # the scores, without the bias
    assert np.asarray(w0[0]).tolist() == pytest.approx([0.9, 0.8])


def test_grouped_topk_scores_groups_by_their_best_two():
    """DeepSeek-V3: the best single expert loses when its group's top-2 sum is lower."""
    kind = _moe(n_group=2, topk_group=1, renormalize=True, routed_scaling=2.0)
    x, router = _router_for([0.9, 0.01, 0.6, 0.6])  # group sums 0.91 vs 1.2
    chosen, weights = route(kind, {"router": router}, x)
    assert sorted(np.asarray(chosen[0]).tolist()) == [2, 3]
    np.testing.assert_allclose(weights[0], [1.0, 1.0], rtol=1e-6)  # 2.0 * (0.6 / 1.2)


def test_tied_scores_choose_the_lowest_indices():
    kind = _moe(score="softmax")
    chosen, weights = route(kind, {"router": jnp.zeros((4, 4))}, jnp.ones((3, 4)))
    np.testing.assert_array_equal(chosen, [[0, 1]] * 3)
    np.testing.assert_allclose(weights, 0.5, rtol=1e-6)


def test_an_expert_nobody_picked_is_never_read():
    spec, weights, _, _ = _scenario("mla_kda")
    kind = spec.ffn_of(1)
    w = {k.removeprefix("layers.1.ffn."): v for k, v in weights.items()
         if k.startswith("layers.1.ffn.")}  # fmt: skip
    x = jax.random.normal(jax.random.key(5), (1, 6, spec.dims.hidden))
    chosen, _ = route(kind, w, x.reshape(-1, spec.dims.hidden))
    unpicked = sorted(set(range(kind.num_experts)) - set(np.asarray(chosen).ravel().tolist()))
    assert unpicked, "every expert was picked; choose another seed"
    poisoned = dict(w)
    for name in ("experts_gate", "experts_up", "experts_down"):
        poisoned[name] = w[name].at[jnp.array(unpicked)].set(jnp.nan)
    ffn = jax.jit(lambda w: moe_ffn(kind, w, x, spec.dims))
    np.testing.assert_array_equal(ffn(poisoned), ffn(w))


def test_attention_residual_with_all_weight_on_the_current_snapshot_is_a_no_op():
    spec, weights, _, traced = _scenario("qwen_next")
    plain = _spec({k: v for k, v in QWEN_NEXT_SPEC.items() if k != "attention_residual"})
    logits = np.full(weights["attn_res_logits"].shape, -1e9, np.float32)
    for block in range(logits.shape[0]):
        logits[block, min(block + 1, spec.attention_residual.max_snapshots) - 1] = 0.0
    weights = dict(weights, attn_res_logits=jnp.asarray(logits))
    tokens = _tokens(spec)
    mixed = traced(weights, tokens, init_cache(spec, BATCH, MAX_LEN))[0]
    plain_weights = {k: v for k, v in weights.items() if k != "attn_res_logits"}
    unmixed = compile_forward(plain)(plain_weights, tokens, init_cache(plain, BATCH, MAX_LEN))[0]
    _assert_close(mixed, unmixed, "attention residual")
