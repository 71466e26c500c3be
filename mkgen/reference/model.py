"""The reference model: random weights, caches, forward (prefill and decode), greedy generation.

Every generated kernel is checked against this model, and this model is checked
against transformers (tests/test_reference_hf.py). It is plain jnp, one layer at
a time, in f32.

Forward pass (one code path for prefill, T tokens, and decode, T = 1)::

    h = embedding[tokens]
    for each layer i:
        (attention residual: see below)
        h += attention_i(attn_norm_i(h))
        h += ffn_i(ffn_norm_i(h))
    logits = final_norm(h) @ lm_head            (embedding.T when tied)
    logits *= logit_multiplier
    logits = softcap * tanh(logits / softcap)   (when logit_softcap is set)

Attention residual (Kimi K3; our definition, the public sources do not give the
exact form): layers form blocks of `block_size`. At the start of block b (layer
b * block_size, before its attention norm) the residual stream h is snapshotted.
For b >= 1, h becomes sum_j softmax(attn_res_logits[b, :n])_j * snapshot_j over
the n = min(b + 1, max_snapshots) most recent snapshots, oldest first (the
current block's own snapshot is the last), and the mixed h replaces the current
snapshot. It acts per position, so prefill and decode agree without any cache.

Random weights (`init_weights`), f32, deterministic: tensor `name` draws from
jax.random.fold_in(key(seed), crc32(name)), so it does not depend on the other
tensors or on the order. Scales keep a mini twin's activations tame across all
layers:

- matrices N(0, 1/fan_in), so x @ W keeps unit variance (fan_in = shape[-2]);
  output projections (wo, w_down, experts_down, shared_down, latent_out) are
  scaled further by 1/sqrt(2 * num_layers) so the residual stream grows slowly;
- embedding N(0, 1); lm_head N(0, 1/hidden);
- norm weights 1 + 0.1 N (zero-centred norms: 0.1 N; the gated output norms of
  KDA and Gated DeltaNet are plain-weight in every model);
- biases 0.1 N; attention sinks 0.5 N; router selection_bias 0.1 N;
  attn_res_logits 0.1 N;
- conv taps N(0, 1/conv_width);
- A_log = log U(1, 16) (the FLA / transformers initialisation); dt_bias: KDA
  inverse-softplus of a log-uniform dt in [1e-3, 1e-1] (Kimi Linear), Gated
  DeltaNet 1 + 0.1 N (Qwen3-Next initialises it to 1).
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# The math modules fill the dispatch tables (mkgen.reference.dispatch) as they load.
from mkgen.reference import attention as _attention_math  # noqa: F401
from mkgen.reference import linear_attention as _linear_attention_math  # noqa: F401
from mkgen.reference.dispatch import ATTENTION, CACHE, FFN
from mkgen.reference.ffn import ChooseExperts, RoutedExperts, routed_experts
from mkgen.reference.layers import Project, mm, rms_norm, softcap
from mkgen.spec.schema import AttentionKind, Dims, FFNKind, KDAAttention, ModelSpec, MoEFFN
from mkgen.spec.tensors import VECTORS, WeightSpec
from mkgen.spec.weights import model_weights

Weights = Mapping[str, jax.Array]
Cache = dict[str, Any]  # {"length": int32 [], "layers": [per-layer dict of arrays]}
# ChooseExperts with the layer index first: (layer, kind, choice [N, E], chosen [N, top_k])
# -> the experts that layer uses (forward_traced).
ChooseLayerExperts = Callable[[int, MoEFFN, jax.Array, jax.Array], jax.Array]

OUTPUT_PROJECTIONS = ("wo", "w_down", "experts_down", "shared_down", "latent_out")
MODEL_STYLE_NORMS = ("attn_norm", "ffn_norm", "final_norm", "q_norm", "k_norm", "kv_norm",
                     "latent_norm", "enorm", "hnorm", "hidden_norm")  # fmt: skip
PLAIN_NORMS = ("o_norm",)  # KimiLinearRMSNormGated / Qwen3NextRMSNormGated: weight, not 1 + w
BIASES = ("bq", "bk", "bv", "bo", "b_gate", "b_up", "b_down", "router_bias",
          "experts_b_gate", "experts_b_up", "experts_b_down")  # fmt: skip


# ---------------------------------------------------------------- weights


# Random tensors are drawn in fixed blocks of this many values (block j of a tensor from
# fold_in(tensor key, j)), so XLA compiles one generator instead of one per tensor shape
# (threefry costs about 0.25 s to compile per shape on CPU). A tuning choice.
DRAW_BLOCK = 16384


def tensor_key(seed: int, name: str) -> jax.Array:
    return jax.random.fold_in(jax.random.key(seed), zlib.crc32(name.encode()) & 0x7FFFFFFF)


@jax.jit
def _normal_block(key: jax.Array) -> jax.Array:
    return jax.random.normal(key, (DRAW_BLOCK,), jnp.float32)


@jax.jit
def _uniform_block(key: jax.Array) -> jax.Array:
    return jax.random.uniform(key, (DRAW_BLOCK,), jnp.float32)


def _draw(
    block: Callable[[jax.Array], jax.Array], key: jax.Array, shape: tuple[int, ...]
) -> np.ndarray:
    """Values of `shape` from consecutive blocks; host numpy, so no per-shape compiles."""
    count = math.prod(shape)
    blocks = [np.asarray(block(jax.random.fold_in(key, j))) for j in range(-(-count // DRAW_BLOCK))]
    return np.concatenate(blocks)[:count].reshape(shape)


def init_tensor(spec: ModelSpec, w: WeightSpec, key: jax.Array) -> np.ndarray:
    """One tensor drawn by the scheme in the module docstring (f32 numpy)."""
    leaf = w.name.rsplit(".", 1)[-1]
    if leaf == "A_log":
        return np.log(1.0 + 15.0 * _draw(_uniform_block, key, w.shape))
    if leaf == "dt_bias" and isinstance(_attention_kind_of(spec, w.name), KDAAttention):
        u = _draw(_uniform_block, key, w.shape)
        dt = np.exp(math.log(1e-3) + u * (math.log(1e-1) - math.log(1e-3)))
        return dt + np.log(-np.expm1(-dt))  # inverse softplus
    normal = _draw(_normal_block, key, w.shape)
    if w.name == "embedding":
        return normal
    if w.family != VECTORS:
        scale = w.shape[-2] ** -0.5  # fan_in
        if leaf in OUTPUT_PROJECTIONS:
            scale /= math.sqrt(2 * spec.layers.count)
        return normal * np.float32(scale)
    if leaf in MODEL_STYLE_NORMS and spec.dims.norm_style == "zero_centered":
        return 0.1 * normal
    if leaf in MODEL_STYLE_NORMS or leaf in PLAIN_NORMS or leaf == "dt_bias":
        return 1.0 + 0.1 * normal
    if leaf in BIASES or leaf in ("selection_bias", "attn_res_logits"):
        return 0.1 * normal
    if leaf == "sinks":
        return 0.5 * normal
    if leaf.startswith("conv_"):
        return normal * np.float32(w.shape[0] ** -0.5)
    raise ValueError(f"init_weights: no initialisation rule for tensor {w.name!r}")


def _attention_kind_of(spec: ModelSpec, name: str) -> object:
    return spec.attention_of(int(name.split(".")[1]))


def init_weights(spec: ModelSpec, seed: int = 0) -> dict[str, jax.Array]:
    """Random f32 weights for every tensor of the inventory (mkgen.spec.weights)."""
    return {
        w.name: jnp.asarray(init_tensor(spec, w, tensor_key(seed, w.name)), jnp.float32)
        for w in model_weights(spec)
    }


def layer_weights(weights: Weights, prefix: str) -> dict[str, jax.Array]:
    """The tensors under `prefix` (e.g. "layers.3.attn."), keyed by the rest of the name."""
    return {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}


# ---------------------------------------------------------------- caches


def init_cache(spec: ModelSpec, batch: int, max_len: int, dtype: jnp.dtype = jnp.float32) -> Cache:
    """Empty caches for `batch` sequences of up to `max_len` tokens.

    Per layer: GQA {"k", "v": [B, max_len, KV, D]}; MLA {"latent": [B, max_len,
    kv_lora_rank], "k_rope": [B, max_len, rope]}; KDA / Gated DeltaNet {"state": f32
    [B, H, Dk, Dv], "conv": [B, W-1, channels of q|k|v]}. KV, latent and conv entries
    use `dtype` (f32 keeps the reference exact; bf16 is what the kernels store);
    recurrent states are always f32. Sliding-window layers keep the full length and
    mask. "length" counts the tokens already in the cache.
    """
    layers = [init_layer_cache(spec, i, batch, max_len, dtype) for i in range(spec.layers.count)]
    return {"length": jnp.zeros((), jnp.int32), "layers": layers}


def init_layer_cache(
    spec: ModelSpec, layer: int, batch: int, max_len: int, dtype: jnp.dtype = jnp.float32
) -> dict[str, jax.Array]:
    """Layer `layer`'s empty cache (init_cache)."""
    return init_kind_cache(spec.attention_of(layer), batch, max_len, dtype)


def init_kind_cache(
    kind: AttentionKind, batch: int, max_len: int, dtype: jnp.dtype = jnp.float32
) -> dict[str, jax.Array]:
    """An empty cache of attention `kind` (init_cache)."""
    return CACHE(kind, batch=batch, max_len=max_len, dtype=dtype)


# ---------------------------------------------------------------- forward


def attention(
    spec: ModelSpec,
    layer: int,
    w: Weights,
    x: jax.Array,
    cache: dict[str, jax.Array],
    start_pos: jax.Array,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Layer `layer`'s attention of x [B, T, hidden] (normed) at positions start_pos..:
    its output and updated cache."""
    return kind_attention(spec.attention_of(layer), w, x, cache, start_pos, spec.dims)


def kind_attention(
    kind: AttentionKind,
    w: Weights,
    x: jax.Array,
    cache: dict[str, jax.Array],
    start_pos: jax.Array | int,
    dims: Dims,
    project: Project | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Attention of `kind` of x [B, T, hidden] (normed) at positions start_pos..: its
    output and updated cache. `project` computes MLA's latent projections
    (mla_attention); the other kinds multiply by their weights in w."""
    return ATTENTION(kind, w=w, x=x, cache=cache, start_pos=start_pos, dims=dims, project=project)


def ffn(
    spec: ModelSpec,
    layer: int,
    w: Weights,
    x: jax.Array,
    routed: RoutedExperts = routed_experts,
    choose: ChooseExperts | None = None,
) -> jax.Array:
    """Layer `layer`'s FFN of x [B, T, hidden] (normed); `routed` computes the routed
    experts and `choose` may replace the routing's choice of them (moe_ffn)."""
    return kind_ffn(spec.ffn_of(layer), w, x, spec.dims, routed, choose)


def kind_ffn(
    kind: FFNKind,
    w: Weights,
    x: jax.Array,
    dims: Dims,
    routed: RoutedExperts = routed_experts,
    choose: ChooseExperts | None = None,
) -> jax.Array:
    """The FFN of `kind` of x [B, T, hidden] (normed) (ffn)."""
    return FFN(kind, w=w, x=x, dims=dims, routed=routed, choose=choose)


def decoder_layer(
    attention_kind: AttentionKind,
    ffn_kind: FFNKind,
    w: Weights,
    h: jax.Array,
    cache: dict[str, jax.Array],
    start_pos: jax.Array | int,
    dims: Dims,
    choose: ChooseExperts | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One pre-norm decoder layer on the residual stream h [B, T, hidden]: h + attention,
    then + FFN. w holds the layer's tensors (attn_norm, attn.*, ffn_norm, ffn.*)."""
    zero_centered = dims.norm_style == "zero_centered"
    x = rms_norm(h, w["attn_norm"], dims.norm_eps, zero_centered)
    out, cache = kind_attention(
        attention_kind, layer_weights(w, "attn."), x, cache, start_pos, dims
    )
    h = h + out
    x = rms_norm(h, w["ffn_norm"], dims.norm_eps, zero_centered)
    h = h + kind_ffn(ffn_kind, layer_weights(w, "ffn."), x, dims, choose=choose)
    return h, cache


def mix_snapshots(
    spec: ModelSpec, layer: int, h: jax.Array, snapshots: list[jax.Array], logits: jax.Array
) -> jax.Array:
    """The attention residual at the first layer of a block: snapshot h (appended to
    `snapshots`), then for blocks after the first mix the latest snapshots by the softmax
    of the block's `logits` [max_snapshots]; the mix replaces the block's snapshot."""
    block = layer // spec.attention_residual.block_size
    snapshots.append(h)
    if block >= 1:
        n = min(block + 1, spec.attention_residual.max_snapshots)
        mix = jax.nn.softmax(logits[:n].astype(jnp.float32))
        h = sum(mix[j] * snapshots[len(snapshots) - n + j] for j in range(n))
        snapshots[-1] = h
    return h


def _run(
    spec: ModelSpec,
    weights: Weights,
    tokens: jax.Array,
    cache: Cache,
    start_pos: jax.Array | int | None,
    choose: ChooseLayerExperts | None = None,
) -> tuple[jax.Array, Cache, list[jax.Array]]:
    """Logits, the new cache, and the residual stream after every layer."""
    dims = spec.dims
    zero_centered = dims.norm_style == "zero_centered"
    start = cache["length"] if start_pos is None else jnp.asarray(start_pos, jnp.int32)
    tokens = jnp.asarray(tokens, jnp.int32)
    h = jnp.asarray(weights["embedding"], jnp.float32)[tokens]  # [B, T, hidden]
    residual = spec.attention_residual
    snapshots: list[jax.Array] = []
    after_layer: list[jax.Array] = []
    new_layers = []
    for i in range(spec.layers.count):
        if residual and i % residual.block_size == 0:
            h = mix_snapshots(
                spec, i, h, snapshots, weights["attn_res_logits"][i // residual.block_size]
            )
        layer_choose = functools.partial(choose, i) if choose else None
        h, layer_cache = decoder_layer(
            spec.attention_of(i),
            spec.ffn_of(i),
            layer_weights(weights, f"layers.{i}."),
            h,
            cache["layers"][i],
            start,
            dims,
            layer_choose,
        )
        new_layers.append(layer_cache)
        after_layer.append(h)
    logits = head_logits(
        dims, weights, rms_norm(h, weights["final_norm"], dims.norm_eps, zero_centered)
    )
    new_cache = {"length": start + tokens.shape[1], "layers": new_layers}
    return logits, new_cache, after_layer


def head_logits(dims: Dims, weights: Weights, normed: jax.Array) -> jax.Array:
    """Logits of the final-normed stream: the lm_head (embedding.T when tied), then the
    logit multiplier and softcap."""
    head = weights["embedding"].T if dims.tie_embeddings else weights["lm_head"]
    logits = mm(normed, head) * dims.logit_multiplier
    if dims.logit_softcap is not None:
        logits = softcap(logits, dims.logit_softcap)
    return logits


def forward(
    spec: ModelSpec,
    weights: Weights,
    tokens: jax.Array,
    cache: Cache,
    start_pos: jax.Array | int | None = None,
) -> tuple[jax.Array, Cache]:
    """Logits [B, T, vocab] of tokens [B, T] at positions start_pos.. and the updated cache.

    start_pos None continues after the tokens already in the cache (cache["length"]).
    Prefill is T prompt tokens into an empty cache, decode is T = 1.
    """
    logits, cache, _ = _run(spec, weights, tokens, cache, start_pos)
    return logits, cache


def forward_traced(
    spec: ModelSpec,
    weights: Weights,
    tokens: jax.Array,
    cache: Cache,
    start_pos: jax.Array | int | None = None,
    choose: ChooseLayerExperts | None = None,
) -> tuple[jax.Array, Cache, jax.Array]:
    """`forward` that also returns the residual stream after every layer,
    [layers, B, T, hidden] (transformers' per-decoder-layer hidden states, before the
    final norm): for locating a mismatch layer by layer. `choose` (unjitted callers)
    may replace each MoE layer's choice of experts, tokens in [B, T] row-major order."""
    logits, cache, after_layer = _run(spec, weights, tokens, cache, start_pos, choose)
    return logits, cache, jnp.stack(after_layer)


def residual_stream(spec: ModelSpec, weights: Weights, tokens: jax.Array) -> jax.Array:
    """The residual stream after every layer of a fresh prefill, [layers, B, T, hidden]."""
    tokens = jnp.asarray(tokens)
    cache = init_cache(spec, tokens.shape[0], tokens.shape[1])
    return forward_traced(spec, weights, tokens, cache, 0)[2]


def jit_once[K, R](
    jitted: dict[K, Callable[..., R]], key: K, fn: Callable[..., R]
) -> Callable[..., R]:
    """jitted[key], jax.jit of `fn` the first time: the jitted function keeps its
    compilations, so later calls with an equal key reuse them."""
    if key not in jitted:
        jitted[key] = jax.jit(fn)
    return jitted[key]


# One jitted forward per distinct spec (ModelSpec holds dicts, so it cannot be a static
# jit argument); keyed by the spec's JSON so equal specs share their compilations.
_COMPILED: dict[str, Callable[..., tuple[jax.Array, Cache]]] = {}


def compile_forward(spec: ModelSpec) -> Callable[..., tuple[jax.Array, Cache]]:
    """jax.jit of `forward` for one spec: f(weights, tokens, cache, start_pos=None)."""
    return jit_once(_COMPILED, spec.model_dump_json(), functools.partial(forward, spec))


def prefill(
    spec: ModelSpec,
    weights: Weights,
    tokens: jax.Array,
    max_len: int,
    dtype: jnp.dtype = jnp.float32,
) -> tuple[jax.Array, Cache]:
    """Logits [B, T, vocab] of a prompt [B, T] and a cache of `max_len` holding it (jitted)."""
    tokens = jnp.asarray(tokens)
    cache = init_cache(spec, tokens.shape[0], max_len, dtype)
    return compile_forward(spec)(weights, tokens, cache)


def decode_step(
    spec: ModelSpec, weights: Weights, tokens: jax.Array, cache: Cache
) -> tuple[jax.Array, Cache]:
    """One token per sequence (tokens [B]) after the cache's contents: logits [B, vocab]
    (jitted)."""
    logits, cache = compile_forward(spec)(weights, jnp.asarray(tokens)[:, None], cache)
    return logits[:, 0], cache


def greedy_token(spec: ModelSpec, logits: jax.Array) -> jax.Array:
    """argmax over the used vocabulary (padding rows of the table are never chosen)."""
    used = spec.dims.vocab_used or spec.dims.vocab
    return jnp.argmax(logits[..., :used], axis=-1).astype(jnp.int32)


def generate(
    spec: ModelSpec,
    weights: Weights,
    prompt: jax.Array,
    steps: int,
    max_len: int | None = None,
    dtype: jnp.dtype = jnp.float32,
) -> np.ndarray:
    """Greedy continuation of prompt [B, T] (or [T]): the `steps` new tokens, [B, steps]
    (or [steps]). Prefill, then one decode step per further token, all jitted; the
    cache holds max_len tokens (default: prompt + steps)."""
    prompt = jnp.asarray(prompt, jnp.int32)
    single = prompt.ndim == 1
    if single:
        prompt = prompt[None]
    run = compile_forward(spec)
    max_len = max_len or prompt.shape[1] + steps
    if max_len < prompt.shape[1] + steps:
        raise ValueError(f"max_len {max_len} is below prompt {prompt.shape[1]} + steps {steps}")
    cache = init_cache(spec, prompt.shape[0], max_len, dtype)
    logits, cache = run(weights, prompt, cache)
    out = []
    token = greedy_token(spec, logits[:, -1])
    for step in range(steps):
        out.append(token)
        if step + 1 < steps:
            logits, cache = run(weights, token[:, None], cache)
            token = greedy_token(spec, logits[:, -1])
    ids = np.asarray(jnp.stack(out, axis=1))
    return ids[0] if single else ids
