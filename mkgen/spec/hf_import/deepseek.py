"""DeepSeek-V3 (and Kimi K2, the same architecture) and Kimi Linear: MLA attention,
DeepSeek-style routers (grouped top-k, selection bias, routed scaling), KDA layers."""

from __future__ import annotations

from typing import Any

from mkgen.spec.hf_import.common import (
    Parts,
    activation_of,
    check_layer_types,
    check_router_groups,
    dims_of,
    layer_list,
    mtp_layers,
    parts_of_used_kinds,
    quantization_of,
    rope_of,
    used_kinds,
)
from mkgen.spec.hf_import.config import MOE_TRAINING_KEYS, Config


def _mla_kind(c: Config, *, rope: dict[str, Any] | None, q_lora_default: Any) -> dict[str, Any]:
    heads = c.get_int("num_attention_heads")
    kv_heads = c.get_int("num_key_value_heads", heads)
    if kv_heads != heads:
        raise c.error(
            "num_key_value_heads",
            f"{kv_heads} must equal num_attention_heads {heads} for MLA (every head has its "
            "own key and value from the latent)",
        )
    if c.get_bool("attention_bias", False):
        raise c.error(
            "attention_bias", "true is not supported: mkgen's MLA has no projection biases"
        )
    kind: dict[str, Any] = {
        "type": "mla",
        "num_heads": heads,
        "q_lora_rank": c.get_int("q_lora_rank", q_lora_default, nullable=True),
        "kv_lora_rank": c.get_int("kv_lora_rank"),
        "qk_nope_head_dim": c.get_int("qk_nope_head_dim"),
        "qk_rope_head_dim": c.get_int("qk_rope_head_dim"),
        "v_head_dim": c.get_int("v_head_dim"),
        "rope": rope,
        # q_a_layernorm / kv_a_layernorm are built without an eps argument in both
        # DeepSeek-V3 and Kimi Linear: their default 1e-6, whatever rms_norm_eps says.
        "latent_norm_eps": 1e-6,
    }
    # transformers 5 writes derived head_dim (= qk_rope_head_dim) and qk_head_dim; its
    # __post_init__ overwrites both, so they carry no information of their own.
    qk = kind["qk_nope_head_dim"] + kind["qk_rope_head_dim"]
    if c.get_int("qk_head_dim", qk) != qk:
        raise c.error("qk_head_dim", f"must be qk_nope_head_dim + qk_rope_head_dim = {qk}")
    return kind


def _deepseek_router(c: Config, experts: int, top_k: int) -> dict[str, Any]:
    score = c.get_str("scoring_func", "sigmoid")
    if score not in ("sigmoid", "softmax"):
        raise c.error("scoring_func", f"{score!r} is not supported; use sigmoid or softmax")
    method = c.get_str("topk_method", "noaux_tc")
    # Defaults of these differ between transformers and DeepSeek's code: require them.
    groups = c.get_int("n_group", nullable=True) or 1
    topk_group = c.get_int("topk_group", nullable=True) or 1
    renormalize = c.get_bool("norm_topk_prob")
    scaling = c.get_float("routed_scaling_factor")
    if scaling <= 0:
        raise c.error("routed_scaling_factor", f"{scaling} must be positive")
    check_router_groups(
        c,
        experts,
        top_k,
        groups,
        topk_group,
        ("n_routed_experts", "num_experts_per_tok", "n_group", "topk_group"),
    )
    if method == "noaux_tc":
        selection_bias = True
    elif method in ("greedy", "group_limited_greedy"):
        if method == "group_limited_greedy" and groups > 1:
            raise c.error(
                "topk_method",
                "'group_limited_greedy' scores a group by its best expert; mkgen's grouped "
                "top-k scores by the best two (noaux_tc). Not expressible with n_group > 1",
            )
        selection_bias, groups, topk_group = False, 1, 1  # greedy ignores the groups
    else:
        raise c.error(
            "topk_method",
            f"{method!r} is not supported; use noaux_tc, greedy or group_limited_greedy",
        )
    return {
        "score": score,
        "selection_bias": selection_bias,
        "renormalize": renormalize,
        "routed_scaling": scaling,
        "n_group": groups,
        "topk_group": topk_group,
    }


def deepseek_v3(c: Config) -> Parts:
    c.allow(*MOE_TRAINING_KEYS)
    # aux_loss_alpha / seq_aux: training loss; ep_size: expert parallelism of the trainer;
    # pretraining_tp: tensor-parallel slicing of the matmuls (same math).
    c.allow("aux_loss_alpha", "seq_aux", "ep_size", "pretraining_tp")
    count = c.get_layer_count()
    dims = dims_of(c, eps_default=1e-6)
    rope_dim = c.get_int("qk_rope_head_dim")
    # transformers writes head_dim = qk_rope_head_dim (its rope dim) and overwrites it.
    if c.get_int("head_dim", rope_dim) != rope_dim:
        raise c.error("head_dim", f"must equal qk_rope_head_dim {rope_dim} (or be left out)")
    rope = rope_of(
        c,
        head_dim=rope_dim,
        default_theta=10000.0,
        interleaved=c.get_bool("rope_interleave", True),
    )
    mla = _mla_kind(c, rope=rope, q_lora_default=1536)
    act = activation_of(c)
    mtp_layers(c, ("num_nextn_predict_layers",))
    experts = c.get_int(("n_routed_experts", "num_local_experts"), nullable=True)
    first_k = c.get_int("first_k_dense_replace", 3, minimum=0)
    freq = c.get_int("moe_layer_freq", 1)
    ffn_kinds: dict[str, dict[str, Any]] = {
        "dense": {"type": "dense", "width": c.get_int("intermediate_size"), "activation": act}
    }
    # DeepSeek's code: MoE where layer >= first_k_dense_replace and layer % moe_layer_freq == 0.
    table = ["moe" if experts and i >= first_k and i % freq == 0 else "dense" for i in range(count)]
    top_k = c.get_int("num_experts_per_tok", None, nullable=True)
    width = c.get_int("moe_intermediate_size", None, nullable=True)
    shared = c.get_int("n_shared_experts", None, nullable=True, minimum=0)
    if "moe" in table:
        if top_k is None or width is None:
            key = "num_experts_per_tok" if top_k is None else "moe_intermediate_size"
            raise c.error(key, "is null but the config has MoE layers")
        moe: dict[str, Any] = {
            "type": "moe",
            "num_experts": experts,
            "top_k": top_k,
            "expert_width": width,
            "activation": act,
            "router": _deepseek_router(c, experts, top_k),
        }
        if shared:
            moe["shared_experts"] = {"count": shared, "width": shared * width}
        ffn_kinds["moe"] = moe
    else:
        c.allow("scoring_func", "topk_method", "n_group", "topk_group", "norm_topk_prob")
        c.allow("routed_scaling_factor")
    return Parts(
        dims=dims,
        attention_kinds={"mla": mla},
        attention_table=["mla"] * count,
        ffn_kinds=used_kinds(ffn_kinds, table),
        ffn_table=table,
        quantization=quantization_of(c),
    )


def kimi_linear(c: Config) -> Parts:
    c.allow(*MOE_TRAINING_KEYS)
    # model_max_length: context limit (transformers' max_position_embeddings alias).
    # head_dim: hidden/heads in the published config, qk_rope_head_dim in transformers 5's;
    # neither MLA (qk_*/v_head_dim) nor KDA (linear head_dim) reads it. pretraining_tp:
    # tensor-parallel slicing of matmuls (same math).
    c.allow("model_max_length", "head_dim", "pretraining_tp")
    count = c.get_layer_count()
    dims = dims_of(c, eps_default=1e-5)
    act = activation_of(
        c, silu_only_reason="it is also the KDA conv activation, which mkgen fixes to SiLU"
    )
    if not c.get_bool("mla_use_nope", True):
        raise c.error(
            "mla_use_nope",
            "false is not supported: transformers' Kimi Linear MLA is NoPE only and mkgen "
            "does not guess the RoPE layout of the other variant",
        )
    # NoPE: rope parameters exist in the published config but nothing rotates.
    c.allow("rope_theta", "rope_scaling", "rope_parameters")
    mla = _mla_kind(c, rope=None, q_lora_default=None)
    lac = c.section("linear_attn_config")
    if lac is None:
        lac = Config({}, c.source, c.arch, "linear_attn_config.")
    kda = _kda_kind(c, lac)
    attention_table = _kimi_attention_table(c, lac, count)
    lac.finish()
    experts = c.get_int(("num_experts", "num_local_experts", "n_routed_experts"), minimum=0)
    ffn_table = _kimi_ffn_table(c, count, experts)
    ffn_kinds = _kimi_ffn_kinds(c, act, ffn_table, experts)
    mtp_layers(c, ("num_nextn_predict_layers",))
    return parts_of_used_kinds(
        c, dims, ({"kda": kda, "mla": mla}, attention_table), (ffn_kinds, ffn_table)
    )


def _kda_kind(c: Config, lac: Config) -> dict[str, Any]:
    """Kimi Linear's KDA layers (dims at the top level and/or in linear_attn_config)."""
    head_dim = _agree(c, lac, ("linear_head_dim", "head_dim"), 128)
    heads = _agree(c, lac, ("linear_num_heads", "num_heads"), 32)
    width = _agree(c, lac, ("linear_conv_kernel_dim", "short_conv_kernel_size"), 4)
    kda = {
        "type": "kda",
        "num_heads": heads,
        "head_dim": head_dim,
        "conv_width": width,
        "decay_gate_rank": head_dim,  # f_a_proj: hidden -> head_dim
        "output_gate_rank": head_dim,  # g_a_proj: hidden -> head_dim
    }
    return kda


def _kimi_ffn_kinds(
    c: Config, act: str, ffn_table: list[str], experts: int
) -> dict[str, dict[str, Any]]:
    """Kimi Linear's dense MLP and its MoE: a DeepSeek-style router (sigmoid or softmax
    scores, selection bias, grouped top-k, routed scaling) and shared experts."""
    ffn_kinds: dict[str, dict[str, Any]] = {
        "dense": {"type": "dense", "width": c.get_int("intermediate_size"), "activation": act}
    }
    top_k = c.get_int(("num_experts_per_token", "num_experts_per_tok"))
    moe_width = c.get_int("moe_intermediate_size")
    shared = c.get_int(("num_shared_experts", "n_shared_experts"), 1, minimum=0, nullable=True)
    score = c.get_str("moe_router_activation_func", "sigmoid")
    if score not in ("sigmoid", "softmax"):
        raise c.error("moe_router_activation_func", f"{score!r}: use sigmoid or softmax")
    groups = c.get_int(("num_expert_group", "n_group"), 1, nullable=True) or 1
    topk_group = c.get_int("topk_group", 1, nullable=True) or 1
    if not c.get_bool("use_grouped_topk", True):
        groups = topk_group = 1
    renormalize = c.get_bool(("moe_renormalize", "norm_topk_prob"), True)
    scaling = c.get_float("routed_scaling_factor", 2.446)
    if "moe" in ffn_table:
        check_router_groups(
            c,
            experts,
            top_k,
            groups,
            topk_group,
            ("num_experts", "num_experts_per_token", "num_expert_group", "topk_group"),
        )
        moe: dict[str, Any] = {
            "type": "moe",
            "num_experts": experts,
            "top_k": top_k,
            "expert_width": moe_width,
            "activation": act,
            "router": {
                "score": score,
                "selection_bias": True,  # e_score_correction_bias
                "renormalize": renormalize,
                "routed_scaling": scaling,
                "n_group": groups,
                "topk_group": topk_group,
            },
        }
        if shared:
            moe["shared_experts"] = {"count": shared, "width": shared * moe_width}
        ffn_kinds["moe"] = moe
    return ffn_kinds


def _agree(c: Config, lac: Config, keys: tuple[str, str], default: int) -> int:
    """A KDA dim given at the top level (transformers 5) and/or in linear_attn_config."""
    top = c.get_int(keys[0], None, nullable=True)
    nested = lac.get_int(keys[1], None, nullable=True)
    if top is not None and nested is not None and top != nested:
        raise lac.error(keys[1], f"{nested} disagrees with {keys[0]} {top}")
    return nested if nested is not None else top if top is not None else default


def _kimi_attention_table(c: Config, lac: Config, count: int) -> list[str]:
    types = c.get_list("layer_types", None, item=str)
    table: list[str] | None = None
    if types is not None:
        check_layer_types(c, types, count)
        table = ["mla" if t == "full_attention" else "kda" for t in types]
    if lac.has("kda_layers") or lac.has("full_attn_layers"):
        kda = layer_list(lac, "kda_layers", count, one_based=True)
        full = layer_list(lac, "full_attn_layers", count, one_based=True)
        both = sorted(set(kda) & set(full))
        if both:
            raise lac.error(
                "full_attn_layers", f"layer {both[0] + 1} (1-based) is also in kda_layers"
            )
        missing = sorted(set(range(count)) - set(kda) - set(full))
        if missing:
            raise lac.error(
                "kda_layers",
                f"layer {missing[0] + 1} (1-based) is in neither kda_layers nor "
                "full_attn_layers; every layer needs one",
            )
        listed = ["mla" if i in set(full) else "kda" for i in range(count)]
        if table is not None and table != listed:
            raise c.error("layer_types", "contradicts linear_attn_config's layer lists")
        table = listed
    if table is None:  # transformers' default: full attention at i > 0 with i % 4 == 0
        table = ["mla" if i and i % 4 == 0 else "kda" for i in range(count)]
    return table


def _kimi_ffn_table(c: Config, count: int, experts: int) -> list[str]:
    types = c.get_list("mlp_layer_types", None, item=str)
    first_k = c.get_int("first_k_dense_replace", None, minimum=0, nullable=True)
    freq = c.get_int("moe_layer_freq", None, nullable=True)
    derived = None
    if first_k is not None or freq is not None or types is None:
        k = 1 if first_k is None else first_k
        f = 1 if freq is None else freq
        derived = ["moe" if experts and i >= k and i % f == 0 else "dense" for i in range(count)]
    if types is None:
        return derived or []
    if len(types) != count:
        raise c.error("mlp_layer_types", f"has {len(types)} entries for {count} layers")
    table = []
    for i, t in enumerate(types):
        if t not in ("dense", "sparse"):
            raise c.error("mlp_layer_types", f"entry {i} is {t!r}; use dense or sparse")
        table.append("moe" if t == "sparse" else "dense")
    if "moe" in table and not experts:
        raise c.error("mlp_layer_types", "has sparse layers but num_experts is 0")
    if derived is not None and derived != table:
        raise c.error(
            "mlp_layer_types", "contradicts first_k_dense_replace / moe_layer_freq; give one"
        )
    return table
