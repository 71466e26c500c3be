"""Qwen3, Qwen3-MoE and Qwen3-Next (Gated DeltaNet layers beside gated full attention)."""

from __future__ import annotations

from typing import Any

from mkgen.spec.hf_import.common import (
    Parts,
    activation_of,
    check_layer_types,
    check_router_groups,
    dims_of,
    gqa_kind,
    head_dim_of,
    layer_list,
    mtp_layers,
    parts_of_used_kinds,
    quantization_of,
    rope_of,
    sliding_kinds,
    sliding_layers,
    used_kinds,
)
from mkgen.spec.hf_import.config import MOE_TRAINING_KEYS, Config


def _qwen_sliding(c: Config, count: int, *, per_layer_types: bool) -> tuple[int | None, list[bool]]:
    """Qwen's use_sliding_window / sliding_window / max_window_layers (/ layer_types)."""
    use = c.get_bool("use_sliding_window", False)
    window = c.get_int("sliding_window", None, nullable=True)
    max_window = c.get_int("max_window_layers", None, minimum=0, nullable=True)
    if not use:
        # transformers: sliding_window = None unless use_sliding_window.
        if per_layer_types and any(sliding_layers(c, count, window=0)):
            raise c.error(
                "layer_types",
                "has sliding_attention layers but use_sliding_window is false; make them "
                "full_attention or turn sliding on",
            )
        return None, [False] * count
    if window is None:
        raise c.error("sliding_window", "is null but use_sliding_window is true; give it")
    if per_layer_types and c.has("layer_types"):
        return window, sliding_layers(c, count, window=window)
    if per_layer_types:
        # transformers Qwen3: layers i >= max_window_layers slide.
        limit = 28 if max_window is None else max_window
        return window, [i >= limit for i in range(count)]
    # transformers Qwen3-MoE slides every layer and ignores max_window_layers, which the
    # original Qwen code reads as "the first max_window_layers layers are full".
    if max_window:
        raise c.error(
            "max_window_layers",
            f"{max_window} contradicts use_sliding_window: transformers' {c.arch} slides "
            "every layer while Qwen's code keeps the first max_window_layers full; set it to "
            "0 or turn sliding off",
        )
    return window, [True] * count


def qwen3(c: Config) -> Parts:
    count = c.get_layer_count()
    dims = dims_of(c, eps_default=1e-6)
    head_dim = head_dim_of(c, 128)
    rope = rope_of(c, head_dim=head_dim, default_theta=10000.0)
    base = gqa_kind(
        c, head_dim_default=128, rope=rope, qk_norm="rms", bias=c.get_bool("attention_bias", False)
    )
    window, sliding = _qwen_sliding(c, count, per_layer_types=True)
    attention_kinds, attention_table = sliding_kinds(base, window, sliding)
    act = activation_of(c)
    return Parts(
        dims=dims,
        attention_kinds=attention_kinds,
        attention_table=attention_table,
        ffn_kinds={
            "dense": {"type": "dense", "width": c.get_int("intermediate_size"), "activation": act}
        },
        ffn_table=["dense"] * count,
        quantization=quantization_of(c),
    )


def _qwen_moe_table(c: Config, count: int, experts: int) -> list[str]:
    """transformers Qwen3-MoE / Qwen3-Next: MoE unless in mlp_only_layers or off the step."""
    step = c.get_int("decoder_sparse_step", 1)
    dense_only = set(layer_list(c, "mlp_only_layers", count))
    return [
        "moe" if i not in dense_only and experts > 0 and (i + 1) % step == 0 else "dense"
        for i in range(count)
    ]


def _qwen_ffn_kinds(
    c: Config, count: int, act: str, *, renormalize_default: bool, shared_key: str | None = None
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The dense and MoE FFN kinds of a Qwen3 MoE-family config and its FFN layer table
    (the MoE kind only where a layer uses it); with `shared_key`, the MoE kind has one
    gated shared expert of that width (Qwen3-Next)."""
    experts = c.get_int(("num_experts", "num_local_experts"), minimum=0)
    table = _qwen_moe_table(c, count, experts)
    ffn_kinds: dict[str, dict[str, Any]] = {
        "dense": {"type": "dense", "width": c.get_int("intermediate_size"), "activation": act}
    }
    top_k = c.get_int("num_experts_per_tok")
    width = c.get_int("moe_intermediate_size")
    shared = c.get_int(shared_key) if shared_key else None
    renormalize = c.get_bool("norm_topk_prob", renormalize_default)
    if "moe" in table:
        check_router_groups(c, experts, top_k, 1, 1, ("num_experts", "num_experts_per_tok", "", ""))
        moe: dict[str, Any] = {
            "type": "moe",
            "num_experts": experts,
            "top_k": top_k,
            "expert_width": width,
            "activation": act,
            "router": {"score": "softmax", "renormalize": renormalize},
        }
        if shared is not None:
            moe["shared_experts"] = {"count": 1, "width": shared, "gate": True}
        ffn_kinds["moe"] = moe
    return ffn_kinds, table


def qwen3_moe(c: Config) -> Parts:
    c.allow(*MOE_TRAINING_KEYS)
    count = c.get_layer_count()
    dims = dims_of(c, eps_default=1e-6)
    head_dim = head_dim_of(c, "hidden/heads")
    rope = rope_of(c, head_dim=head_dim, default_theta=10000.0)
    base = gqa_kind(
        c,
        head_dim_default="hidden/heads",
        rope=rope,
        qk_norm="rms",
        bias=c.get_bool("attention_bias", False),
    )
    window, sliding = _qwen_sliding(c, count, per_layer_types=False)
    attention_kinds, attention_table = sliding_kinds(base, window, sliding)
    act = activation_of(c)
    ffn_kinds, table = _qwen_ffn_kinds(c, count, act, renormalize_default=False)
    return Parts(
        dims=dims,
        attention_kinds=attention_kinds,
        attention_table=attention_table,
        ffn_kinds=used_kinds(ffn_kinds, table),
        ffn_table=table,
        quantization=quantization_of(c),
    )


def qwen3_next(c: Config) -> Parts:
    c.allow(*MOE_TRAINING_KEYS)
    # Only meaningful with MTP layers, which are not imported (see mtp_layers).
    c.allow("mtp_use_dedicated_embeddings")
    count = c.get_layer_count()
    dims = dims_of(c, eps_default=1e-6, zero_centered=True)
    act = activation_of(
        c,
        silu_only_reason="it is also the Gated DeltaNet conv activation, which mkgen fixes to SiLU",
    )
    head_dim = head_dim_of(c, 256)
    # transformers 5 defaults partial_rotary_factor to 0.25 for Qwen3-Next.
    rope = rope_of(c, head_dim=head_dim, default_theta=10000.0, partial=0.25)
    if c.get_bool("attention_bias", False):
        raise c.error(
            "attention_bias",
            "true is not supported for Qwen3-Next: its q_proj bias would include the output "
            "gate's, which mkgen's GQA has no tensor for",
        )
    full = _qwen3_next_full_attention(c, rope)
    linear = _gated_deltanet_kind(c)
    attention_table = [
        "full" if t == "full_attention" else "linear" for t in _qwen3_next_layer_types(c, count)
    ]
    ffn_kinds, table = _qwen_ffn_kinds(
        c, count, act, renormalize_default=True, shared_key="shared_expert_intermediate_size"
    )
    mtp_layers(c, ("num_nextn_predict_layers", "mtp_num_hidden_layers"))
    return parts_of_used_kinds(
        c, dims, ({"linear": linear, "full": full}, attention_table), (ffn_kinds, table)
    )


def _qwen3_next_full_attention(c: Config, rope: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-Next's full attention: GQA with q/k norm and a sigmoid output gate, no window."""
    full = gqa_kind(c, head_dim_default=256, rope=rope, qk_norm="rms")
    if c.get_bool("attn_output_gate", True):
        full["output_gate"] = "sigmoid"
    else:
        raise c.error(
            "attn_output_gate",
            "false is not supported: transformers' Qwen3-Next always gates the attention output",
        )
    if c.get_bool("use_sliding_window", False):
        raise c.error(
            "use_sliding_window",
            "true is not supported: Qwen3-Next has no sliding window attention in transformers",
        )
    c.allow("sliding_window", "max_window_layers")  # inert without use_sliding_window
    return full


def _gated_deltanet_kind(c: Config) -> dict[str, Any]:
    """Qwen3-Next's linear attention layers."""
    linear = {
        "type": "gated_deltanet",
        "num_key_heads": c.get_int("linear_num_key_heads", 16),
        "num_value_heads": c.get_int("linear_num_value_heads", 32),
        "key_head_dim": c.get_int("linear_key_head_dim", 128),
        "value_head_dim": c.get_int("linear_value_head_dim", 128),
        "conv_width": c.get_int("linear_conv_kernel_dim", 4),
    }
    if linear["num_value_heads"] % linear["num_key_heads"]:
        raise c.error(
            "linear_num_value_heads",
            f"{linear['num_value_heads']} is not a multiple of linear_num_key_heads "
            f"{linear['num_key_heads']}",
        )
    return linear


def _qwen3_next_layer_types(c: Config, count: int) -> list[str]:
    """Each layer's attention (linear_attention or full_attention): layer_types, or every
    full_attention_interval-th layer full (4 by default); both given must agree."""
    types = c.get_list("layer_types", None, item=str)
    interval = c.get_int("full_attention_interval", None, nullable=True)
    if types is not None:
        check_layer_types(c, types, count)
        if interval is not None:
            derived = [(i + 1) % interval == 0 for i in range(count)]
            if derived != [t == "full_attention" for t in types]:
                raise c.error(
                    "full_attention_interval",
                    f"{interval} contradicts layer_types; give one of them",
                )
        return types
    interval = interval or 4
    return [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(count)
    ]
