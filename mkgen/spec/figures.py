"""Derived figures of a spec: parameters, bytes per weight family, cache bytes.

Conventions (documented in docs/spec-reference.md): active parameters count
everything a token touches, embedding row table and lm_head included (the
convention of the Qwen3 and Mixtral model cards), with routed experts counted
at top_k / num_experts. Cache tensors are bf16; recurrent states are f32.
"""

from __future__ import annotations

from dataclasses import dataclass

from mkgen.spec.schema import (
    GatedDeltaNetAttention,
    GQAAttention,
    KDAAttention,
    MLAAttention,
    ModelSpec,
)
from mkgen.spec.tensors import VECTORS
from mkgen.spec.weights import model_weights

CACHE_BYTES = 2  # bf16 KV / latent cache entries
STATE_BYTES = 4  # f32 recurrent state


def params_total(spec: ModelSpec) -> int:
    return sum(w.numel for w in model_weights(spec))


def params_active(spec: ModelSpec) -> int:
    return round(sum(w.numel * w.active_fraction for w in model_weights(spec)))


def bytes_by_family(spec: ModelSpec) -> dict[str, int]:
    """HBM bytes of each weight family at the spec's formats (vectors always bf16)."""
    out: dict[str, int] = {}
    for w in model_weights(spec):
        fmt = "bf16" if w.family == VECTORS else getattr(spec.quantization, w.family)
        out[w.family] = out.get(w.family, 0) + w.nbytes(fmt)
    return out


@dataclass(frozen=True)
class LayerCache:
    """What one layer keeps between decode steps, per sequence."""

    kind: str  # kv | mla_latent | state
    bytes_per_token: int  # grows with context (0 for recurrent layers)
    fixed_bytes: int  # does not grow (recurrent state and conv taps)
    window: int | None  # tokens kept at most (sliding window)


def layer_cache(attn: object) -> LayerCache:
    """Cache of one attention kind (bf16 KV or latent, f32 state, bf16 conv taps)."""
    if isinstance(attn, GQAAttention):
        per_token = 2 * attn.num_kv_heads * attn.head_dim * CACHE_BYTES
        return LayerCache("kv", per_token, 0, attn.sliding_window)
    if isinstance(attn, MLAAttention):
        per_token = (attn.kv_lora_rank + attn.qk_rope_head_dim) * CACHE_BYTES
        return LayerCache("mla_latent", per_token, 0, None)
    if isinstance(attn, KDAAttention):
        d = attn.num_heads * attn.head_dim
        state = attn.num_heads * attn.head_dim * attn.head_dim * STATE_BYTES
        conv = (attn.conv_width - 1) * 3 * d * CACHE_BYTES
        return LayerCache("state", 0, state + conv, None)
    assert isinstance(attn, GatedDeltaNetAttention)
    k, v = attn.num_key_heads * attn.key_head_dim, attn.num_value_heads * attn.value_head_dim
    state = attn.num_value_heads * attn.key_head_dim * attn.value_head_dim * STATE_BYTES
    conv = (attn.conv_width - 1) * (2 * k + v) * CACHE_BYTES
    return LayerCache("state", 0, state + conv, None)


def cache_bytes_per_token(spec: ModelSpec) -> dict[str, int]:
    """Bytes one more token of context adds, by cache kind, plus the total."""
    out = {"kv": 0, "mla_latent": 0}
    for layer in range(spec.layers.count):
        cache = layer_cache(spec.attention_of(layer))
        if cache.bytes_per_token:
            out[cache.kind] += cache.bytes_per_token
    out["total"] = out["kv"] + out["mla_latent"]
    return out


def state_bytes_per_sequence(spec: ModelSpec) -> int:
    """Recurrent state and conv taps of every linear-attention layer, per sequence."""
    return sum(layer_cache(spec.attention_of(i)).fixed_bytes for i in range(spec.layers.count))


def cache_bytes(spec: ModelSpec, context: int) -> int:
    """All cache bytes of one sequence at `context` tokens (sliding windows capped)."""
    total = 0
    for layer in range(spec.layers.count):
        cache = layer_cache(spec.attention_of(layer))
        tokens = min(context, cache.window) if cache.window else context
        total += cache.bytes_per_token * tokens + cache.fixed_bytes
    return total
