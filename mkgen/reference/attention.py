"""Softmax attention of the reference model: GQA/MHA and multi-head latent attention.

Both kinds write the new tokens into a full-length cache first and then attend
over the whole cache with a mask, so prefill (T tokens) and decode (T = 1) run
exactly the same code. Values pass through the cache dtype before they are
used, so a bf16 cache rounds prefill and decode alike.

Mask convention (transformers' `sliding_window_overlay`, used by Mistral, Qwen3
and gpt-oss alike): a query at position p sees key positions j with
j <= p and j > p - window, i.e. `window` keys including itself. Unwritten cache
slots (j > p) are never visible.

Weights arrive as a mapping of this layer's tensors under their inventory names
(`wq`, `wkv_a`, ...; see mkgen.spec.weights), matrices [fan_in, fan_out].
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from mkgen.reference.dispatch import ATTENTION, CACHE
from mkgen.reference.layers import Project, apply_rope, einsum, mm, multiply, rms_norm
from mkgen.spec.rope import mla_softmax_scale
from mkgen.spec.schema import Dims, GQAAttention, MLAAttention

Cache = dict[str, jax.Array]
Weights = Mapping[str, jax.Array]


def store(cache: jax.Array, new: jax.Array, start_pos: jax.Array) -> jax.Array:
    """Write `new` [B, T, ...] into `cache` [B, L, ...] at time offset start_pos."""
    start_pos = jnp.asarray(start_pos, jnp.int32)
    zero = jnp.zeros((), jnp.int32)
    index = (zero, start_pos) + (zero,) * (cache.ndim - 2)
    return jax.lax.dynamic_update_slice(cache, new.astype(cache.dtype), index)


def causal_mask(q_positions: jax.Array, max_len: int, window: int | None = None) -> jax.Array:
    """[T, L] bool: which cache slots each query position may see."""
    k_positions = jnp.arange(max_len)[None, :]
    q_positions = q_positions[:, None]
    visible = k_positions <= q_positions
    if window is not None:
        visible &= k_positions > q_positions - window
    return visible


def masked_softmax(
    logits: jax.Array, visible: jax.Array, sinks: jax.Array | None = None
) -> jax.Array:
    """Softmax over the last axis of `logits` where `visible`; `sinks` (broadcastable
    to logits[..., :1]) join the denominator only (gpt-oss attention sinks)."""
    logits = jnp.where(visible, logits, -jnp.inf)
    peak = jnp.max(logits, axis=-1, keepdims=True)
    if sinks is not None:
        peak = jnp.maximum(peak, sinks)
    p = jnp.exp(logits - peak)
    denominator = jnp.sum(p, axis=-1, keepdims=True)
    if sinks is not None:
        denominator = denominator + jnp.exp(sinks - peak)
    return p / denominator


# ---------------------------------------------------------------- GQA


@CACHE.computes(GQAAttention)
def init_gqa_cache(kind: GQAAttention, batch: int, max_len: int, dtype: jnp.dtype) -> Cache:
    shape = (batch, max_len, kind.num_kv_heads, kind.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


@ATTENTION.computes(GQAAttention)
def gqa_attention(
    kind: GQAAttention,
    w: Weights,
    x: jax.Array,
    cache: Cache,
    start_pos: jax.Array,
    dims: Dims,
) -> tuple[jax.Array, Cache]:
    """Grouped-query attention of x [B, T, hidden] at positions start_pos + 0..T-1.

    Order (transformers Qwen3/Qwen3-Next/gpt-oss): project (+ bias), per-head q/k
    RMSNorm, RoPE on the first rotary_dim dims, cache write, masked softmax (with
    sinks), sigmoid output gate, output projection (+ bias). Query head h reads KV
    head h // (num_heads // num_kv_heads) (transformers repeat_kv).
    """
    positions = start_pos + jnp.arange(x.shape[1])
    q, k, v = gqa_project(kind, w, x, positions, dims)
    cache = {"k": store(cache["k"], k, start_pos), "v": store(cache["v"], v, start_pos)}
    keys, values = cache["k"].astype(jnp.float32), cache["v"].astype(jnp.float32)
    visible = causal_mask(positions, keys.shape[1], kind.sliding_window)
    return gqa_attend(kind, w, x, q, keys, values, visible), cache


def gqa_project(
    kind: GQAAttention, w: Weights, x: jax.Array, positions: jax.Array, dims: Dims
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [B, T, heads, D], k and v [B, T, kv heads, D] of x [B, T, hidden] at `positions`
    [T]: projected (+ bias), q/k RMS-normed per head, rotated."""
    b, t, _ = x.shape
    h, kv, d = kind.num_heads, kind.num_kv_heads, kind.head_dim
    q, k, v = mm(x, w["wq"]), mm(x, w["wk"]), mm(x, w["wv"])
    if kind.qkv_bias:
        q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
    q, k, v = q.reshape(b, t, h, d), k.reshape(b, t, kv, d), v.reshape(b, t, kv, d)
    zero_centered = dims.norm_style == "zero_centered"
    if kind.qk_norm == "rms":
        q = rms_norm(q, w["q_norm"], dims.norm_eps, zero_centered)
        k = rms_norm(k, w["k_norm"], dims.norm_eps, zero_centered)
    elif kind.qk_norm == "rms_noparam":
        q, k = rms_norm(q, None, dims.norm_eps), rms_norm(k, None, dims.norm_eps)
    if kind.rope is not None:
        q = apply_rope(q, positions, kind.rope, kind.rotary_dim)
        k = apply_rope(k, positions, kind.rope, kind.rotary_dim)
    return q, k, v


def gqa_attend(
    kind: GQAAttention,
    w: Weights,
    x: jax.Array,
    q: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    visible: jax.Array,
) -> jax.Array:
    """The attention output of queries q [B, T, heads, D] over keys and values [B, S, kv
    heads, D] where `visible` [T, S]: softmax (with sinks), output gate (of x), projection."""
    b, t, h, d = q.shape
    kv = kind.num_kv_heads
    group = h // kv
    scale = kind.softmax_scale if kind.softmax_scale is not None else d**-0.5
    q = q.reshape(b, t, kv, group, d)
    logits = einsum("btkgd,bskd->bkgts", q, keys) * scale  # [B, KV, G, T, S]
    sinks = w["sinks"].reshape(kv, group)[None, :, :, None, None] if kind.sinks else None
    p = masked_softmax(logits, visible, sinks)
    out = einsum("bkgts,bskd->btkgd", p, values).reshape(b, t, h * d)
    if kind.output_gate == "sigmoid":
        out = out * jax.nn.sigmoid(mm(x, w["wgate"]))
    out = mm(out, w["wo"])
    if kind.o_bias:
        out = out + w["bo"]
    return out


# ---------------------------------------------------------------- MLA


@CACHE.computes(MLAAttention)
def init_mla_cache(kind: MLAAttention, batch: int, max_len: int, dtype: jnp.dtype) -> Cache:
    return {
        "latent": jnp.zeros((batch, max_len, kind.kv_lora_rank), dtype),
        "k_rope": jnp.zeros((batch, max_len, kind.qk_rope_head_dim), dtype),
    }


@ATTENTION.computes(MLAAttention)
def mla_attention(
    kind: MLAAttention,
    w: Weights,
    x: jax.Array,
    cache: Cache,
    start_pos: jax.Array,
    dims: Dims,
    project: Project | None = None,
) -> tuple[jax.Array, Cache]:
    """Multi-head latent attention (transformers DeepseekV3Attention / KimiLinearAttention).

    q = q_norm(x @ wq_a) @ wq_b (or x @ wq), split per head into [nope | rope];
    x @ wkv_a = [latent | k_rope]; the latent is normed with kv_norm; k_rope is one
    key shared by all heads. The cache keeps the normed latent and the rotated
    k_rope per token (the MLA latent cache); per-head k_nope and v come from
    latent @ wkv_b. NoPE (rope null) skips the rotation but keeps the rope dims.
    The sigmoid output gate (Kimi K3) multiplies the attention output before wo.
    `project` computes the latent projections x @ wq_a and x @ wkv_a (by default with
    the whole weights in w).
    """
    project = project or multiply(w)
    b, t, _ = x.shape
    h, nope, rope_d, vd = (
        kind.num_heads,
        kind.qk_nope_head_dim,
        kind.qk_rope_head_dim,
        kind.v_head_dim,
    )
    zero_centered = dims.norm_style == "zero_centered"
    # transformers builds q_a_layernorm / kv_a_layernorm with eps 1e-6 whatever
    # rms_norm_eps says (DeepseekV3Attention, KimiLinearAttention): the importer sets it.
    eps = kind.latent_norm_eps if kind.latent_norm_eps is not None else dims.norm_eps
    if kind.q_lora_rank:
        q_latent = rms_norm(project(x, "wq_a"), w["q_norm"], eps, zero_centered)
        q = mm(q_latent, w["wq_b"])
    else:
        q = mm(x, w["wq"])
    q = q.reshape(b, t, h, nope + rope_d)
    q_nope, q_rope = q[..., :nope], q[..., nope:]
    kv_a = project(x, "wkv_a")
    latent = rms_norm(kv_a[..., : kind.kv_lora_rank], w["kv_norm"], eps, zero_centered)
    k_rope = kv_a[..., kind.kv_lora_rank :]
    positions = start_pos + jnp.arange(t)
    if kind.rope is not None:
        q_rope = apply_rope(q_rope, positions, kind.rope, rope_d)
        k_rope = apply_rope(k_rope[:, :, None, :], positions, kind.rope, rope_d)[:, :, 0, :]

    cache = {
        "latent": store(cache["latent"], latent, start_pos),
        "k_rope": store(cache["k_rope"], k_rope, start_pos),
    }
    latents = cache["latent"].astype(jnp.float32)  # [B, L, rank]
    k_ropes = cache["k_rope"].astype(jnp.float32)  # [B, L, rope]
    max_len = latents.shape[1]
    kv = mm(latents, w["wkv_b"]).reshape(b, max_len, h, nope + vd)
    k_nope, values = kv[..., :nope], kv[..., nope:]

    logits = einsum("bthd,bshd->bhts", q_nope, k_nope) + einsum("bthd,bsd->bhts", q_rope, k_ropes)
    logits = logits * mla_softmax_scale(kind)
    p = masked_softmax(logits, causal_mask(positions, max_len))
    out = einsum("bhts,bshd->bthd", p, values).reshape(b, t, h * vd)
    if kind.output_gate == "sigmoid":
        out = out * jax.nn.sigmoid(mm(x, w["wgate"]))
    return mm(out, w["wo"]), cache
