"""Building blocks of the reference model: matmul, norms, activations, rotary embeddings.

Everything computes in f32 with the highest matmul precision, so the reference
means the same thing on CPU and on TPU (where the default f32 matmul rounds its
inputs to bf16). The formulas follow Hugging Face transformers 5.x; each
function names the implementation it matches.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp

from mkgen.spec.rope import rope_frequencies
from mkgen.spec.schema import Activation, Rope

HIGHEST = jax.lax.Precision.HIGHEST


def mm(x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w in f32 at full precision (w is [fan_in, fan_out])."""
    return jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32), precision=HIGHEST)


# (x, weight name) -> x @ w[name]: how a layer multiplies by the weights that another
# caller may hold in pieces (MLA's latent projections, the MoE router and latent
# projections). The reference multiplies by the whole weight (`multiply`); the sharded
# prefill multiplies by a core's piece and joins the cores' products
# (mkgen/runtime/prefill.py).
Project = Callable[[jax.Array, str], jax.Array]


def multiply(w: Mapping[str, jax.Array]) -> Project:
    """The Project that multiplies by the whole weight w[name]."""
    return lambda x, name: mm(x, w[name])


def einsum(subscripts: str, *operands: jax.Array) -> jax.Array:
    """jnp.einsum in f32 at full precision."""
    return jnp.einsum(subscripts, *(o.astype(jnp.float32) for o in operands), precision=HIGHEST)


# ---------------------------------------------------------------- norms


def rms_norm(
    x: jax.Array, weight: jax.Array | None, eps: float, zero_centered: bool = False
) -> jax.Array:
    """RMSNorm over the last axis: x * rsqrt(mean(x^2) + eps) * w, in f32.

    zero_centered scales by (1 + w) (Qwen3-Next's Qwen3NextRMSNorm); weight None is
    the parameter-free norm.
    """
    x = x.astype(jnp.float32)
    y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    if weight is None:
        return y
    w = weight.astype(jnp.float32)
    return y * (1.0 + w if zero_centered else w)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x * rsqrt(sum(x^2) + eps) over the last axis (the FLA / transformers l2norm)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


# ---------------------------------------------------------------- activations


def act_fn(kind: str, x: jax.Array) -> jax.Array:
    """A single-input activation (the gate branch of silu/gelu/gelu_tanh)."""
    if kind == "silu":
        return jax.nn.silu(x)
    if kind == "gelu":
        return jax.nn.gelu(x, approximate=False)  # transformers "gelu" is the erf form
    if kind == "gelu_tanh":
        return jax.nn.gelu(x, approximate=True)
    raise ValueError(f"activation {kind!r} needs a gate and an up branch (a gated MLP)")


def gated_activation(act: Activation, gate: jax.Array, up: jax.Array) -> jax.Array:
    """The product that feeds the down projection of a gated MLP."""
    if act.kind == "situ":
        # Kimi K3's SiTU: both branches soft-capped by tanh, the gate also sigmoid-weighted.
        assert act.gate_cap is not None and act.value_cap is not None
        g = act.gate_cap * jnp.tanh(gate / act.gate_cap) * jax.nn.sigmoid(gate)
        return g * (act.value_cap * jnp.tanh(up / act.value_cap))
    if act.kind == "clamped_swiglu":
        # gpt-oss GptOssExperts._apply_gate: the gate is clamped from above only.
        assert act.alpha is not None and act.limit is not None
        g = jnp.minimum(gate, act.limit)
        u = jnp.clip(up, -act.limit, act.limit)
        return g * jax.nn.sigmoid(act.alpha * g) * (u + 1.0)
    return act_fn(act.kind, gate) * up


def softcap(x: jax.Array, cap: float) -> jax.Array:
    return cap * jnp.tanh(x / cap)


# ---------------------------------------------------------------- rotary embeddings


def apply_rope(x: jax.Array, positions: jax.Array, rope: Rope, rotary_dim: int) -> jax.Array:
    """Rotate the first `rotary_dim` dims of every head; the rest pass unchanged.

    x: [B, T, heads, D]; positions: [T] (int). Non-interleaved pairs are the halves
    (x_i, x_{i + r/2}) of the rotary part (transformers rotate_half); interleaved
    pairs are adjacent (x_{2i}, x_{2i+1}) and stay in place (transformers'
    `apply_rotary_pos_emb_interleave` writes them de-interleaved instead, a fixed
    permutation of q and k alike that leaves every q.k unchanged). cos and sin are
    scaled by YaRN's attention factor, as in transformers.
    """
    inv_freq, factor = rope_frequencies(rope, rotary_dim)
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [T, r/2]
    cos = (jnp.cos(angles) * factor)[None, :, None, :]  # [1, T, 1, r/2]
    sin = (jnp.sin(angles) * factor)[None, :, None, :]
    x = x.astype(jnp.float32)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if rope.interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        ra, rb = a * cos - b * sin, b * cos + a * sin
        rot = jnp.stack([ra, rb], axis=-1).reshape(rot.shape)
    else:
        half = rotary_dim // 2
        a, b = rot[..., :half], rot[..., half:]
        rot = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    return jnp.concatenate([rot, rest], axis=-1)
