"""Linear attention of the reference model: Kimi Delta Attention and Gated DeltaNet.

Both are a short causal depthwise convolution (with SiLU) over the concatenated
[q, k, v] channels followed by the gated delta rule on a per-head f32 state
S [Dk, Dv]. One token's step (transformers `torch_recurrent_gated_delta_rule` /
`recurrent_kimi_delta_attention`):

    S <- S * exp(g)            g: [Dk] per head (KDA) or a scalar per head (GDN)
    u  = beta * (v - k^T S)    the part of v the state does not yet predict
    S <- S + outer(k, u)
    o  = q^T S

Prefill is a `lax.scan` of that same step over the tokens, so prefill and decode
share every line (transformers' chunked form is the same recurrence regrouped).

Conv taps are stored [W, channels] (mkgen.spec.weights): tap W-1 multiplies the
current input, tap W-1-j the input j steps back (transformers' depthwise Conv1d
weight [channels, 1, W] transposed). The conv state keeps the last W-1 inputs of
the concatenated channels, oldest first.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from mkgen.reference.dispatch import ATTENTION, CACHE
from mkgen.reference.layers import einsum, l2_normalize, mm, rms_norm
from mkgen.spec.schema import Dims, GatedDeltaNetAttention, KDAAttention

Cache = dict[str, jax.Array]
Weights = Mapping[str, jax.Array]

L2_EPS = 1e-6  # transformers / FLA l2norm eps for q and k


def causal_conv(x: jax.Array, state: jax.Array, taps: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Causal depthwise conv of x [B, T, C] continuing `state` [B, W-1, C], then SiLU.

    Returns (y [B, T, C], new state [B, W-1, C]). Inputs pass through the state's dtype
    first so a bf16 conv state rounds prefill and decode alike.
    """
    width, t = taps.shape[0], x.shape[1]
    x = x.astype(state.dtype).astype(jnp.float32)
    window = jnp.concatenate([state.astype(jnp.float32), x], axis=1)  # [B, W-1+T, C]
    y = sum(window[:, i : i + t] * taps[i].astype(jnp.float32) for i in range(width))
    new_state = window[:, t:].astype(state.dtype)
    return jax.nn.silu(y), new_state


def delta_rule_step(
    state: jax.Array,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """One token of the gated delta rule.

    state [B, H, Dk, Dv] f32; q, k [B, H, Dk]; v [B, H, Dv]; g [B, H, Dk] or
    [B, H, 1] (log decay, <= 0); beta [B, H]. Returns (new state, o [B, H, Dv]).
    """
    state = state * jnp.exp(g)[..., None]
    predicted = einsum("bhkv,bhk->bhv", state, k)
    u = (v - predicted) * beta[..., None]
    state = state + k[..., :, None] * u[..., None, :]
    return state, einsum("bhkv,bhk->bhv", state, q)


def delta_rule_scan(
    state: jax.Array,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """The step over T tokens: inputs carry a time axis after batch ([B, T, H, ...]).

    Returns (o [B, T, H, Dv], final state)."""

    def step(s: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        return delta_rule_step(s, *xs)

    time_major = [jnp.moveaxis(a.astype(jnp.float32), 1, 0) for a in (q, k, v, g, beta)]
    state, out = jax.lax.scan(step, state.astype(jnp.float32), tuple(time_major))
    return jnp.moveaxis(out, 0, 1), state


# ---------------------------------------------------------------- KDA


@CACHE.computes(KDAAttention)
def init_kda_cache(kind: KDAAttention, batch: int, dtype: jnp.dtype) -> Cache:
    d = kind.num_heads * kind.head_dim
    return {
        "state": jnp.zeros((batch, kind.num_heads, kind.head_dim, kind.head_dim), jnp.float32),
        "conv": jnp.zeros((batch, kind.conv_width - 1, 3 * d), dtype),
    }


def kda_decay(kind: KDAAttention, w: Weights, x: jax.Array) -> jax.Array:
    """Per-key-dim log decay g [B, T, H, D] (<= 0).

    gate_lower_bound set (Kimi K3, transformers Glm5NextTextForgetGate):
    lower_bound * sigmoid(exp(A_log) * (raw + dt_bias)); else (Kimi Linear):
    -exp(A_log) * softplus(raw + dt_bias); raw = (x @ wf_a) @ wf_b.
    """
    b, t, _ = x.shape
    h, d = kind.num_heads, kind.head_dim
    raw = mm(mm(x, w["wf_a"]), w["wf_b"]) + w["dt_bias"].astype(jnp.float32)
    raw = raw.reshape(b, t, h, d)
    rate = jnp.exp(w["A_log"].astype(jnp.float32))[:, None]  # [H, 1]
    if kind.gate_lower_bound is not None:
        return kind.gate_lower_bound * jax.nn.sigmoid(rate * raw)
    return -rate * jax.nn.softplus(raw)


@ATTENTION.computes(KDAAttention)
def kda_attention(
    kind: KDAAttention, w: Weights, x: jax.Array, cache: Cache, dims: Dims
) -> tuple[jax.Array, Cache]:
    """Kimi Delta Attention (transformers KimiLinearDeltaAttention) of x [B, T, hidden].

    q, k, v = x @ wq, wk, wv -> causal conv + SiLU -> q, k L2-normalised per head,
    q scaled by head_dim**-0.5; beta = sigmoid(x @ wbeta); delta rule with the
    per-key-dim decay of `kda_decay`; o = rmsnorm(o; o_norm) * sigmoid(gate) per
    head (o_norm is a plain-weight norm in every model: KimiLinearRMSNormGated),
    gate = x @ wg or (x @ wg_a) @ wg_b; out = o @ wo.
    """
    b, t, _ = x.shape
    h, d = kind.num_heads, kind.head_dim
    qkv = jnp.concatenate([mm(x, w["wq"]), mm(x, w["wk"]), mm(x, w["wv"])], axis=-1)
    taps = jnp.concatenate([w["conv_q"], w["conv_k"], w["conv_v"]], axis=-1)
    qkv, conv_state = causal_conv(qkv, cache["conv"], taps)
    q, k, v = (a.reshape(b, t, h, d) for a in jnp.split(qkv, 3, axis=-1))
    q = l2_normalize(q, L2_EPS) * d**-0.5
    k = l2_normalize(k, L2_EPS)
    g = kda_decay(kind, w, x)
    beta = jax.nn.sigmoid(mm(x, w["wbeta"]))  # [B, T, H]
    o, state = delta_rule_scan(cache["state"], q, k, v, g, beta)
    gate = mm(mm(x, w["wg_a"]), w["wg_b"]) if kind.output_gate_rank else mm(x, w["wg"])
    o = rms_norm(o, w["o_norm"], dims.norm_eps) * jax.nn.sigmoid(gate.reshape(b, t, h, d))
    return mm(o.reshape(b, t, h * d), w["wo"]), {"state": state, "conv": conv_state}


# ---------------------------------------------------------------- Gated DeltaNet


@CACHE.computes(GatedDeltaNetAttention)
def init_gated_deltanet_cache(kind: GatedDeltaNetAttention, batch: int, dtype: jnp.dtype) -> Cache:
    k = kind.num_key_heads * kind.key_head_dim
    v = kind.num_value_heads * kind.value_head_dim
    shape = (batch, kind.num_value_heads, kind.key_head_dim, kind.value_head_dim)
    return {
        "state": jnp.zeros(shape, jnp.float32),
        "conv": jnp.zeros((batch, kind.conv_width - 1, 2 * k + v), dtype),
    }


@ATTENTION.computes(GatedDeltaNetAttention)
def gated_deltanet_attention(
    kind: GatedDeltaNetAttention, w: Weights, x: jax.Array, cache: Cache, dims: Dims
) -> tuple[jax.Array, Cache]:
    """Gated DeltaNet (transformers Qwen3NextGatedDeltaNet) of x [B, T, hidden].

    Causal conv + SiLU over [q, k, v] channels; beta = sigmoid(x @ wb);
    g = -exp(A_log) * softplus(x @ wa + dt_bias), one scalar per value head; q, k
    L2-normalised, key heads repeated to value heads (value head j reads key head
    j // (Hv / Hk)), q scaled by key_head_dim**-0.5; o = rmsnorm(o; o_norm) *
    silu(x @ wz) per value head. o_norm is a plain-weight norm even in a
    zero-centred model (Qwen3NextRMSNormGated multiplies by w, initialised to 1).
    """
    b, t, _ = x.shape
    hk, hv = kind.num_key_heads, kind.num_value_heads
    dk, dv = kind.key_head_dim, kind.value_head_dim
    qkv = jnp.concatenate([mm(x, w["wq"]), mm(x, w["wk"]), mm(x, w["wv"])], axis=-1)
    taps = jnp.concatenate([w["conv_q"], w["conv_k"], w["conv_v"]], axis=-1)
    qkv, conv_state = causal_conv(qkv, cache["conv"], taps)
    q = qkv[..., : hk * dk].reshape(b, t, hk, dk)
    k = qkv[..., hk * dk : 2 * hk * dk].reshape(b, t, hk, dk)
    v = qkv[..., 2 * hk * dk :].reshape(b, t, hv, dv)
    repeat = hv // hk
    q = jnp.repeat(l2_normalize(q, L2_EPS), repeat, axis=2) * dk**-0.5
    k = jnp.repeat(l2_normalize(k, L2_EPS), repeat, axis=2)
    beta = jax.nn.sigmoid(mm(x, w["wb"]))  # [B, T, Hv]
    a = mm(x, w["wa"]) + w["dt_bias"].astype(jnp.float32)
    g = -jnp.exp(w["A_log"].astype(jnp.float32)) * jax.nn.softplus(a)  # [B, T, Hv]
    o, state = delta_rule_scan(cache["state"], q, k, v, g[..., None], beta)
    z = mm(x, w["wz"]).reshape(b, t, hv, dv)
    o = rms_norm(o, w["o_norm"], dims.norm_eps) * jax.nn.silu(z)
    return mm(o.reshape(b, t, hv * dv), w["wo"]), {"state": state, "conv": conv_state}
