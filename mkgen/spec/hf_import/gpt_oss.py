"""gpt-oss: alternating sliding and full GQA attention with sinks, biased MoE experts."""

from __future__ import annotations

from mkgen.spec.hf_import.common import (
    Parts,
    check_router_groups,
    dims_of,
    gqa_kind,
    head_dim_of,
    quantization_of,
    rope_of,
    sliding_kinds,
    sliding_layers,
)
from mkgen.spec.hf_import.config import MOE_TRAINING_KEYS, Config

_GPT_OSS_DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def gpt_oss(c: Config) -> Parts:
    c.allow(*MOE_TRAINING_KEYS)
    # hidden_act: GptOssExperts ignores it (the activation is the clamped SwiGLU below).
    # initial_context_length: OpenAI's name for YaRN's original length; transformers
    # reads original_max_position_embeddings from the rope parameters instead.
    c.allow("hidden_act", "initial_context_length")
    count = c.get_layer_count()
    dims = dims_of(c, eps_default=1e-5)
    head_dim = head_dim_of(c, 64)
    rope = rope_of(
        c,
        head_dim=head_dim,
        default_theta=150000.0,
        partial=False,
        default_params=_GPT_OSS_DEFAULT_ROPE,
    )
    base = gqa_kind(c, head_dim_default=64, rope=rope, bias=c.get_bool("attention_bias", True))
    base["sinks"] = True
    window = c.get_int("sliding_window", 128, nullable=True)
    if c.has("layer_types"):
        sliding = sliding_layers(c, count, window=window)
    else:  # transformers: sliding on even layers, full on odd ones
        if window is None:
            raise c.error("sliding_window", "is null but gpt-oss alternates sliding layers")
        sliding = [i % 2 == 0 for i in range(count)]
    attention_kinds, attention_table = sliding_kinds(base, window, sliding)
    experts = c.get_int(("num_local_experts", "num_experts"))
    top_k = c.get_int(("num_experts_per_tok", "experts_per_token"))
    check_router_groups(
        c, experts, top_k, 1, 1, ("num_local_experts", "num_experts_per_tok", "", "")
    )
    alpha = c.get_float("swiglu_alpha", 1.702)
    limit = c.get_float("swiglu_limit", 7.0)
    for key, value in (("swiglu_alpha", alpha), ("swiglu_limit", limit)):
        if value <= 0:
            raise c.error(key, f"{value} must be positive")
    moe = {
        "type": "moe",
        "num_experts": experts,
        "top_k": top_k,
        "expert_width": c.get_int("intermediate_size"),
        "activation": {"kind": "clamped_swiglu", "alpha": alpha, "limit": limit},
        # top-k of the biased logits, softmax over the chosen = softmax then renormalise
        "router": {"score": "softmax", "bias": True, "renormalize": True},
        "expert_bias": True,
    }
    return Parts(
        dims=dims,
        attention_kinds=attention_kinds,
        attention_table=attention_table,
        ffn_kinds={"moe": moe},
        ffn_table=["moe"] * count,
        quantization=quantization_of(c, mxfp4_only_experts=True),
    )
