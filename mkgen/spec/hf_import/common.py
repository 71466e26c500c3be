"""The pieces every architecture family reads alike: dims, activation, RoPE and YaRN,
layer lists, router groups, sliding windows, quantization, MTP layers, GQA kinds, and
what an importer returns (`Parts`)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mkgen.spec.draft import mtp_note
from mkgen.spec.hf_import.config import Config

_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
}


def activation_of(c: Config, *, silu_only_reason: str = "") -> str:
    key, name = c.raw("hidden_act", "silu")
    if not isinstance(name, str) or name not in _ACTIVATIONS:
        raise c.error(
            key,
            f"activation {name!r} is not supported; mkgen knows {', '.join(sorted(_ACTIVATIONS))}",
        )
    if silu_only_reason and _ACTIVATIONS[name] != "silu":
        raise c.error(key, f"{name!r} is not supported: {silu_only_reason}")
    return _ACTIVATIONS[name]


def dims_of(c: Config, *, eps_default: float, zero_centered: bool = False) -> dict[str, Any]:
    dims: dict[str, Any] = {
        "hidden": c.get_int("hidden_size"),
        "vocab": c.get_int("vocab_size"),
        "norm_eps": c.get_float("rms_norm_eps", eps_default),
        "tie_embeddings": c.get_bool("tie_word_embeddings", False),
    }
    if dims["norm_eps"] <= 0:
        raise c.error("rms_norm_eps", f"{dims['norm_eps']} must be positive")
    if zero_centered:
        dims["norm_style"] = "zero_centered"
    return dims


_YARN_KEYS = (
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "truncate",
    "attention_factor",
)


def rope_of(
    c: Config,
    *,
    head_dim: int,
    default_theta: float,
    interleaved: bool = False,
    partial: bool | float = False,
    default_params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The Rope of an attention kind from rope_theta / rope_scaling / rope_parameters.

    head_dim: the dims a head rotates (qk_rope_head_dim for MLA). partial: the
    architecture honours partial_rotary_factor (rotating only the first dims).
    """
    scaling = c.section("rope_scaling")
    params = c.section("rope_parameters")
    if scaling is not None and params is not None:
        raise c.error("rope_parameters", "given together with rope_scaling; give one of them")
    sub = scaling or params
    if sub is None and default_params is not None:
        sub = Config(dict(default_params), c.source, c.arch, "rope_parameters(default).")
    if sub is None:
        sub = Config({}, c.source, c.arch, "rope_scaling.")
    top_theta = c.get_float("rope_theta", None)
    top_factor = c.get_float("partial_rotary_factor", None)
    rope_type = sub.get_str(("rope_type", "type"), "default")
    theta = sub.get_float("rope_theta", None)
    if theta is not None and top_theta is not None and theta != top_theta:
        raise sub.error("rope_theta", f"{theta} disagrees with rope_theta {top_theta}")
    theta = theta if theta is not None else top_theta if top_theta is not None else default_theta
    if theta <= 0:
        raise c.error("rope_theta", f"{theta} must be positive")
    factor = sub.get_float("partial_rotary_factor", None)
    if factor is not None and top_factor is not None and factor != top_factor:
        raise sub.error("partial_rotary_factor", f"{factor} disagrees with {top_factor}")
    factor = factor if factor is not None else top_factor
    if factor is None and partial and isinstance(partial, float):
        factor = partial
    rope: dict[str, Any] = {"theta": theta}
    if factor is not None and factor != 1.0:
        if not partial:
            raise c.error(
                "partial_rotary_factor",
                f"{factor}: {c.arch} rotates every dim of a head in transformers; only 1.0 "
                "is consistent",
            )
        rotary = int(head_dim * factor)
        if not 0 < factor <= 1 or rotary < 2 or rotary % 2:
            raise c.error(
                "partial_rotary_factor",
                f"{factor} of head_dim {head_dim} gives {rotary} rotary dims; it must give "
                "an even number of at least 2",
            )
        if rotary != head_dim:
            rope["rotary_dim"] = rotary
    if interleaved:
        rope["interleaved"] = True
    if rope_type == "yarn":
        rope["scaling"] = _yarn(c, sub)
    elif rope_type != "default":
        raise sub.error(
            "rope_type",
            f"{rope_type!r} is not supported: mkgen's Rope has plain RoPE and YaRN only "
            "(linear, dynamic, llama3, longrope and the others cannot be expressed)",
        )
    else:
        for key in _YARN_KEYS:
            if sub.has(key):
                raise sub.error(key, "only YaRN takes it; the rope type here is 'default'")
    sub.finish()
    return rope


def _yarn(c: Config, sub: Config) -> dict[str, Any]:
    """transformers' _compute_yarn_parameters, field by field."""
    original = sub.get_int("original_max_position_embeddings", None)
    if original is None:  # transformers falls back to max_position_embeddings
        original = c.get_int("max_position_embeddings")
    factor = sub.get_float("factor", nullable=True)
    if factor is None:  # transformers: max_position_embeddings / original
        factor = c.get_int("max_position_embeddings") / original
    if factor <= 0:
        raise sub.error("factor", f"{factor} must be positive")
    if sub.get_float("attention_factor", None) is not None:
        raise sub.error(
            "attention_factor",
            "an explicit YaRN attention_factor cannot be expressed; mkgen derives it from "
            "mscale/mscale_all_dim as transformers does when it is null",
        )
    # transformers: `beta_fast or 32`, `beta_slow or 1`, `mscale and mscale_all_dim`.
    beta_fast = sub.get_float("beta_fast", None) or 32.0
    beta_slow = sub.get_float("beta_slow", None) or 1.0
    mscale = sub.get_float("mscale", None)
    mscale_all_dim = sub.get_float("mscale_all_dim", None) or 0.0
    if mscale is None:
        # Absent mscale is falsy in transformers: the cos/sin factor is mscale(factor).
        mscale = 0.0 if mscale_all_dim else 1.0
    yarn: dict[str, Any] = {
        "type": "yarn",
        "factor": factor,
        "original_max_position": original,
        "beta_fast": beta_fast,
        "beta_slow": beta_slow,
        "mscale": mscale,
        "mscale_all_dim": mscale_all_dim,
        "truncate": sub.get_bool("truncate", True),
    }
    return yarn


def layer_list(c: Config, key: str, count: int, *, one_based: bool = False) -> list[int]:
    values = c.get_list(key, [])
    low = 1 if one_based else 0
    high = count if one_based else count - 1
    for v in values:
        if not low <= v <= high:
            base = "1-based" if one_based else "0-based"
            raise c.error(key, f"layer {v} is outside {low}..{high} (the list is {base})")
    if len(set(values)) != len(values):
        raise c.error(key, f"lists a layer twice: {values}")
    return [v - low for v in values]


def check_router_groups(
    c: Config,
    experts: int,
    top_k: int,
    groups: int,
    topk_group: int,
    names: tuple[str, str, str, str],
) -> None:
    e_key, k_key, g_key, tg_key = names
    if top_k > experts:
        raise c.error(k_key, f"{top_k} exceeds the {experts} experts ({e_key})")
    if experts % groups:
        raise c.error(g_key, f"{groups} does not divide {e_key} {experts}; use a divisor")
    if topk_group > groups:
        raise c.error(tg_key, f"{topk_group} exceeds {g_key} {groups}")
    if groups > 1 and top_k > topk_group * (experts // groups):
        raise c.error(
            k_key,
            f"{top_k} exceeds the {topk_group * (experts // groups)} experts that "
            f"{tg_key} {topk_group} groups hold",
        )


def check_heads(c: Config, heads: int, kv_heads: int) -> None:
    if heads % kv_heads:
        raise c.error(
            "num_key_value_heads",
            f"{kv_heads} does not divide num_attention_heads {heads}",
        )


def sliding_layers(
    c: Config, count: int, *, window: int | None, names: Sequence[str] = ("sliding_attention",)
) -> list[bool]:
    """Which layers slide, from layer_types (entries full_attention / sliding_attention)."""
    types = c.get_list("layer_types", None, item=str)
    if types is None:
        return [False] * count
    if len(types) != count:
        raise c.error("layer_types", f"has {len(types)} entries for {count} layers")
    out = []
    for i, t in enumerate(types):
        if t not in ("full_attention", *names):
            raise c.error(
                "layer_types",
                f"entry {i} is {t!r}; {c.arch} layers are full_attention or {' or '.join(names)}",
            )
        out.append(t != "full_attention")
    if any(out) and window is None:
        raise c.error(
            "sliding_window", "is null but layer_types has sliding_attention layers; give it"
        )
    return out


def quantization_of(c: Config, *, mxfp4_only_experts: bool = False) -> dict[str, str]:
    """Weight formats from quantization_config (fp8 blocks or MXFP4 experts)."""
    q = c.section("quantization_config")
    if q is None:
        return {}
    method = q.get_str("quant_method")
    not_convert = q.get_list("modules_to_not_convert", None, item=str) or []
    formats: dict[str, str] = {}
    if method == "fp8":
        fmt = q.get_str("fmt", "e4m3")
        if fmt != "e4m3":
            raise q.error("fmt", f"{fmt!r}: mkgen's fp8 format is e4m3")
        scheme = q.get_str("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise q.error(
                "activation_scheme",
                f"{scheme!r}: static activation scales cannot be expressed; only 'dynamic'",
            )
        block = q.get_list("weight_block_size")
        if not block or len(block) != 2 or block[0] != block[1]:
            raise q.error("weight_block_size", f"{block}: mkgen's fp8 needs square [B, B] blocks")
        b = block[0]
        if b <= 0 or b & (b - 1):
            raise q.error("weight_block_size", f"{block}: B must be a power of two")
        # DeepSeek-V3 / Kimi K2 checkpoints: every nn.Linear of the decoder layers is
        # fp8 (attention projections, dense MLP, shared and routed experts); the
        # embedding, lm_head and router gate (an nn.Parameter) stay bf16.
        for family in ("attention", "mlp", "shared_experts", "experts"):
            formats[family] = f"fp8:{b}"
    elif method == "mxfp4":
        formats["experts"] = "mxfp4"  # transformers' Mxfp4 quantizer converts experts only
    else:
        raise q.error(
            "quant_method",
            f"{method!r} is not supported; mkgen imports fp8 (block) and mxfp4 checkpoints",
        )
    for pattern in not_convert:
        family = _module_family(pattern)
        if family is None:
            raise q.error(
                "modules_to_not_convert",
                f"{pattern!r} does not name a whole weight family (embed_tokens, lm_head, "
                "self_attn, mlp.gate/router, shared_experts); mkgen sets formats per family",
            )
        if family == "experts" and mxfp4_only_experts:
            raise q.error("modules_to_not_convert", f"{pattern!r} leaves nothing to quantize")
        formats.pop(family, None)
    q.finish()
    if formats:
        listed = ", ".join(f"{family} {fmt}" for family, fmt in formats.items())
        c.notes.append(
            f"Weight formats from quantization_config ({method}): {listed}; the other "
            "families (embedding, lm_head, router among them) bf16."
        )
    return formats


def _module_family(pattern: str) -> str | None:
    p = re.sub(r"^model\.", "", pattern)
    p = re.sub(r"^layers\.\*\.", "", p)
    table = {
        "embed_tokens": "embedding",
        "lm_head": "lm_head",
        "self_attn": "attention",
        "mlp.gate": "router",
        "mlp.router": "router",
        "block_sparse_moe.gate": "router",
        "mlp.shared_experts": "shared_experts",
        "mlp.shared_expert": "shared_experts",
        "mlp.experts": "experts",
    }
    return table.get(p)


def mtp_layers(c: Config, keys: Sequence[str]) -> int:
    """Multi-token-prediction layers: recorded in the description, and kept as an `mtp`
    draft section when the import asks for it (import_hf_dict's keep_mtp)."""
    count = 0
    for key in keys:
        value = c.get_int(key, 0, minimum=0, nullable=True) or 0
        count = max(count, value)
    c.mtp_layers = count
    if count:
        c.notes.append(mtp_note(count, keys, kept=c.keep_mtp))
    return count


@dataclass
class Parts:
    """What an architecture builder returns: dims, kinds and per-layer kind names."""

    dims: dict[str, Any]
    attention_kinds: dict[str, dict[str, Any]]
    attention_table: list[str]
    ffn_kinds: dict[str, dict[str, Any]]
    ffn_table: list[str]
    quantization: dict[str, str] = field(default_factory=dict)


def used_kinds(kinds: dict[str, dict[str, Any]], table: list[str]) -> dict[str, dict[str, Any]]:
    return {name: kind for name, kind in kinds.items() if name in table}


def parts_of_used_kinds(
    c: Config,
    dims: dict[str, Any],
    attention: tuple[dict[str, dict[str, Any]], list[str]],
    ffn: tuple[dict[str, dict[str, Any]], list[str]],
) -> Parts:
    """The Parts of a model mixing kinds: each (kinds, table) keeps the kinds its table
    names; the quantization is the config's."""
    (attention_kinds, attention_table), (ffn_kinds, ffn_table) = attention, ffn
    return Parts(
        dims=dims,
        attention_kinds=used_kinds(attention_kinds, attention_table),
        attention_table=attention_table,
        ffn_kinds=used_kinds(ffn_kinds, ffn_table),
        ffn_table=ffn_table,
        quantization=quantization_of(c),
    )


def gqa_kind(
    c: Config,
    *,
    head_dim_default: Any,
    rope: dict[str, Any] | None,
    qk_norm: str = "none",
    bias: bool = False,
) -> dict[str, Any]:
    heads = c.get_int("num_attention_heads")
    kv_heads = c.get_int("num_key_value_heads")
    check_heads(c, heads, kv_heads)
    kind: dict[str, Any] = {
        "type": "gqa",
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim_of(c, head_dim_default),
        "rope": rope,
    }
    if qk_norm != "none":
        kind["qk_norm"] = qk_norm
    if bias:
        kind["qkv_bias"] = kind["o_bias"] = True
    return kind


def head_dim_of(c: Config, default: Any) -> int:
    """head_dim, or hidden_size // num_attention_heads when the architecture says so."""
    value = c.get_int("head_dim", default, nullable=True)
    if value is None or value == "hidden/heads":
        hidden, heads = c.get_int("hidden_size"), c.get_int("num_attention_heads")
        if hidden % heads:
            raise c.error(
                "head_dim",
                f"missing and hidden_size {hidden} is not a multiple of "
                f"num_attention_heads {heads}; give head_dim",
            )
        return hidden // heads
    return value


def sliding_kinds(
    base: dict[str, Any], window: int | None, sliding: list[bool]
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    if not any(sliding):
        return {"gqa": base}, ["gqa"] * len(sliding)
    if all(sliding):
        return {"gqa": {**base, "sliding_window": window}}, ["gqa"] * len(sliding)
    kinds = {"full": base, "sliding": {**base, "sliding_window": window}}
    return kinds, ["sliding" if s else "full" for s in sliding]


def check_layer_types(c: Config, types: list[str], count: int) -> None:
    """layer_types: one linear_attention or full_attention entry per layer."""
    if len(types) != count:
        raise c.error("layer_types", f"has {len(types)} entries for {count} layers")
    for i, t in enumerate(types):
        if t not in ("linear_attention", "full_attention"):
            raise c.error(
                "layer_types", f"entry {i} is {t!r}; use linear_attention or full_attention"
            )
