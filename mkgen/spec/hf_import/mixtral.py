"""Mixtral: GQA attention and a softmax-routed MoE in every layer."""

from __future__ import annotations

from mkgen.spec.hf_import.common import (
    Parts,
    activation_of,
    check_router_groups,
    dims_of,
    gqa_kind,
    head_dim_of,
    quantization_of,
    rope_of,
)
from mkgen.spec.hf_import.config import MOE_TRAINING_KEYS, Config


def mixtral(c: Config) -> Parts:
    c.allow(*MOE_TRAINING_KEYS)
    c.allow("router_jitter_noise")  # multiplicative noise on router inputs, training only
    count = c.get_layer_count()
    dims = dims_of(c, eps_default=1e-5)
    head_dim = head_dim_of(c, None)
    rope = rope_of(c, head_dim=head_dim, default_theta=1e6)
    base = gqa_kind(c, head_dim_default=None, rope=rope)
    window = c.get_int("sliding_window", None, nullable=True)
    if window is not None:  # Mistral semantics: every layer slides
        base["sliding_window"] = window
    act = activation_of(c)
    experts = c.get_int(("num_local_experts", "num_experts"))
    top_k = c.get_int("num_experts_per_tok")
    check_router_groups(
        c, experts, top_k, 1, 1, ("num_local_experts", "num_experts_per_tok", "", "")
    )
    moe = {
        "type": "moe",
        "num_experts": experts,
        "top_k": top_k,
        "expert_width": c.get_int("intermediate_size"),
        "activation": act,
        "router": {"score": "softmax", "renormalize": True},
    }
    return Parts(
        dims=dims,
        attention_kinds={"gqa": base},
        attention_table=["gqa"] * count,
        ffn_kinds={"moe": moe},
        ffn_table=["moe"] * count,
        quantization=quantization_of(c),
    )
