"""Importing a Hugging Face config.json as a ModelSpec.

Supported architectures (``architectures[0]``, or ``model_type`` when that list is
absent): DeepseekV3ForCausalLM (incl. Kimi K2), Qwen3ForCausalLM,
Qwen3MoeForCausalLM, MixtralForCausalLM, Qwen3NextForCausalLM, GptOssForCausalLM
and KimiLinearForCausalLM. Both config flavours are read: the published ones
(``rope_theta`` + ``rope_scaling``, Kimi Linear's ``linear_attn_config`` with
1-based layer lists) and the ones transformers 5 writes (``rope_parameters``,
``layer_types``, ``mlp_layer_types``, attribute-map aliases such as
``num_local_experts``). Where a key is absent the transformers 5 default of that
architecture applies, except for the DeepSeek routing keys whose defaults differ
between transformers and DeepSeek's own code (those must be given).

Nothing is dropped silently: every key of the config is either mapped into the
spec, checked to have the one value the spec can express, or on the explicit
allow-list of keys that do not change what a decode step computes (token ids,
training-only knobs, serialisation metadata). Any other key is an error naming
it, so a config with new semantics fails loudly instead of importing wrong.
Errors are one line: ``<file>: <field>: <what is wrong and what would fix it>``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mkgen.errors import SpecError
from mkgen.spec.draft import mtp_note, mtp_section
from mkgen.spec.files import dump_spec_yaml, read_json, spec_from_dict
from mkgen.spec.schema import MAX_LAYERS, MAX_VOCAB, LayerAssignment, ModelSpec

_MISSING: Any = object()

# Keys that never change what a decode step computes, accepted for every architecture:
# serialisation metadata, token ids (tokenizer / generation), runtime switches and
# training-only settings. max_position_embeddings is a context limit; YaRN reads it
# as transformers does when rope parameters leave original_max_position_embeddings out.
METADATA_KEYS = (
    "architectures",  # read by resolve_architecture
    "model_type",  # read by resolve_architecture
    "transformers_version",
    "torch_dtype",  # checkpoint storage dtype; weight formats come from quantization_config
    "dtype",
    "_name_or_path",
    "auto_map",  # remote-code class names; the architecture is mapped here instead
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "use_cache",
    "initializer_range",
    "attention_dropout",
    "max_position_embeddings",
)
# Training-only keys of the MoE architectures (auxiliary losses, router logit outputs).
MOE_TRAINING_KEYS = ("output_router_logits", "router_aux_loss_coef")


# ---------------------------------------------------------------- config reader


class _Config:
    """A config mapping read key by key; remembers which keys were consumed."""

    def __init__(self, data: dict[str, Any], source: str, arch: str, prefix: str = "") -> None:
        self.data = data
        self.source = source
        self.arch = arch
        self.prefix = prefix
        self.used: set[str] = set()
        self.notes: list[str] = []
        self.keep_mtp = False
        self.mtp_layers = 0

    def error(self, key: str, message: str) -> SpecError:
        return SpecError(f"{self.source}: {self.prefix}{key}: {message}")

    def has(self, key: str) -> bool:
        return key in self.data

    def allow(self, *keys: str) -> None:
        """Accept keys without mapping them (the allow-list)."""
        self.used.update(keys)

    def raw(self, keys: str | Sequence[str], default: Any = _MISSING) -> tuple[str, Any]:
        """(the key found, its value); aliases must agree when several are present."""
        names = (keys,) if isinstance(keys, str) else tuple(keys)
        self.used.update(names)
        found = [k for k in names if k in self.data]
        if not found:
            if default is _MISSING:
                also = f" (or {', '.join(names[1:])})" if len(names) > 1 else ""
                raise self.error(names[0], f"missing{also}; a {self.arch} config needs it")
            return names[0], default
        first = found[0]
        for other in found[1:]:
            if self.data[other] != self.data[first]:
                raise self.error(
                    other,
                    f"{self.data[other]!r} disagrees with its alias {first} "
                    f"{self.data[first]!r}; give one of them",
                )
        return first, self.data[first]

    def _typed(
        self,
        keys: str | Sequence[str],
        default: Any,
        nullable: bool,
        check: Callable[[Any], bool],
        expected: str,
    ) -> Any:
        """The value, type-checked; null counts as absent when nullable or the default is None."""
        key, value = self.raw(keys, default)
        if value is None and (nullable or default is None):
            return None
        if value is default and default is not _MISSING:
            return value
        if value is None or not check(value):
            raise self.error(key, f"expected {expected}, got {value!r}")
        return value

    def get_int(
        self,
        keys: str | Sequence[str],
        default: Any = _MISSING,
        *,
        minimum: int = 1,
        maximum: int = MAX_VOCAB,
        nullable: bool = False,
    ) -> Any:
        """An integer in minimum..maximum. The default maximum is the largest bound of any
        spec integer (int32 token ids); the spec's own bounds apply after the mapping."""
        value = self._typed(
            keys,
            default,
            nullable,
            lambda v: isinstance(v, int) and not isinstance(v, bool),
            "an integer",
        )
        names = (keys,) if isinstance(keys, str) else keys
        key = next((k for k in names if k in self.data), names[0])  # the alias given
        if isinstance(value, int) and value < minimum:
            raise self.error(key, f"{value} must be at least {minimum}")
        if isinstance(value, int) and value > maximum:
            raise self.error(
                key, f"{value} exceeds {maximum} (the bounds: docs/spec-reference.md#bounds)"
            )
        return value

    def get_float(
        self, keys: str | Sequence[str], default: Any = _MISSING, *, nullable: bool = False
    ) -> Any:
        value = self._typed(
            keys,
            default,
            nullable,
            lambda v: isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v),
            "a finite number",
        )
        return None if value is None else float(value)

    def get_layer_count(self) -> int:
        """num_hidden_layers, bounded before any per-layer table is built from it."""
        return self.get_int("num_hidden_layers", maximum=MAX_LAYERS)

    def get_bool(self, keys: str | Sequence[str], default: Any = _MISSING) -> Any:
        return self._typed(keys, default, False, lambda v: isinstance(v, bool), "true or false")

    def get_str(
        self, keys: str | Sequence[str], default: Any = _MISSING, *, nullable: bool = False
    ) -> Any:
        return self._typed(keys, default, nullable, lambda v: isinstance(v, str), "a string")

    def get_list(
        self, keys: str | Sequence[str], default: Any = _MISSING, *, item: type = int
    ) -> Any:
        def check(v: Any) -> bool:
            return isinstance(v, list) and all(
                isinstance(x, item) and not (item is int and isinstance(x, bool)) for x in v
            )

        return self._typed(keys, default, True, check, f"a list of {item.__name__}")

    def section(self, key: str) -> _Config | None:
        """A nested mapping (rope_scaling, quantization_config, ...) or None when null/absent."""
        _, value = self.raw(key, None)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self.error(key, f"expected a mapping, got {value!r}")
        return _Config(value, self.source, self.arch, f"{self.prefix}{key}.")

    def finish(self) -> None:
        """Every key must have been mapped or allow-listed."""
        unknown = sorted(k for k in self.data if k not in self.used)
        if unknown:
            raise self.error(
                unknown[0],
                f"unknown key for {self.arch} (not mapped and not on the allow-list of keys "
                "that do not affect inference); mkgen will not guess what it means: remove it "
                "if it has no effect, or teach mkgen/spec/hf_import.py to map it",
            )


# ---------------------------------------------------------------- shared pieces


_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
}


def _activation(c: _Config, *, silu_only_reason: str = "") -> str:
    key, name = c.raw("hidden_act", "silu")
    if not isinstance(name, str) or name not in _ACTIVATIONS:
        raise c.error(
            key,
            f"activation {name!r} is not supported; mkgen knows {', '.join(sorted(_ACTIVATIONS))}",
        )
    if silu_only_reason and _ACTIVATIONS[name] != "silu":
        raise c.error(key, f"{name!r} is not supported: {silu_only_reason}")
    return _ACTIVATIONS[name]


def _dims(c: _Config, *, eps_default: float, zero_centered: bool = False) -> dict[str, Any]:
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


def _rope(
    c: _Config,
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
        sub = _Config(dict(default_params), c.source, c.arch, "rope_parameters(default).")
    if sub is None:
        sub = _Config({}, c.source, c.arch, "rope_scaling.")
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


def _yarn(c: _Config, sub: _Config) -> dict[str, Any]:
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


def _layer_list(c: _Config, key: str, count: int, *, one_based: bool = False) -> list[int]:
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


def _check_router_groups(
    c: _Config,
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


def _check_heads(c: _Config, heads: int, kv_heads: int) -> None:
    if heads % kv_heads:
        raise c.error(
            "num_key_value_heads",
            f"{kv_heads} does not divide num_attention_heads {heads}",
        )


def _sliding_layers(
    c: _Config, count: int, *, window: int | None, names: Sequence[str] = ("sliding_attention",)
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


def _quantization(c: _Config, *, mxfp4_only_experts: bool = False) -> dict[str, str]:
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


def _mtp(c: _Config, keys: Sequence[str]) -> int:
    """Multi-token-prediction layers: not decoded by mkgen, recorded in the description."""
    count = 0
    for key in keys:
        value = c.get_int(key, 0, minimum=0, nullable=True) or 0
        count = max(count, value)
    c.mtp_layers = count  # kept as a draft section by import_hf_dict(keep_mtp=True)
    if count:
        c.notes.append(mtp_note(count, keys, kept=c.keep_mtp))
    return count


@dataclass
class _Parts:
    """What an architecture builder returns: dims, kinds and per-layer kind names."""

    dims: dict[str, Any]
    attention_kinds: dict[str, dict[str, Any]]
    attention_table: list[str]
    ffn_kinds: dict[str, dict[str, Any]]
    ffn_table: list[str]
    quantization: dict[str, str] = field(default_factory=dict)


def _used_kinds(kinds: dict[str, dict[str, Any]], table: list[str]) -> dict[str, dict[str, Any]]:
    return {name: kind for name, kind in kinds.items() if name in table}


# ---------------------------------------------------------------- DeepSeek-V3 / Kimi K2


def _mla_kind(c: _Config, *, rope: dict[str, Any] | None, q_lora_default: Any) -> dict[str, Any]:
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


def _deepseek_router(c: _Config, experts: int, top_k: int) -> dict[str, Any]:
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
    _check_router_groups(
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


def _deepseek_v3(c: _Config) -> _Parts:
    c.allow(*MOE_TRAINING_KEYS)
    # aux_loss_alpha / seq_aux: training loss; ep_size: expert parallelism of the trainer;
    # pretraining_tp: tensor-parallel slicing of the matmuls (same math).
    c.allow("aux_loss_alpha", "seq_aux", "ep_size", "pretraining_tp")
    count = c.get_layer_count()
    dims = _dims(c, eps_default=1e-6)
    rope_dim = c.get_int("qk_rope_head_dim")
    # transformers writes head_dim = qk_rope_head_dim (its rope dim) and overwrites it.
    if c.get_int("head_dim", rope_dim) != rope_dim:
        raise c.error("head_dim", f"must equal qk_rope_head_dim {rope_dim} (or be left out)")
    rope = _rope(
        c,
        head_dim=rope_dim,
        default_theta=10000.0,
        interleaved=c.get_bool("rope_interleave", True),
    )
    mla = _mla_kind(c, rope=rope, q_lora_default=1536)
    act = _activation(c)
    _mtp(c, ("num_nextn_predict_layers",))
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
    return _Parts(
        dims=dims,
        attention_kinds={"mla": mla},
        attention_table=["mla"] * count,
        ffn_kinds=_used_kinds(ffn_kinds, table),
        ffn_table=table,
        quantization=_quantization(c),
    )


# ---------------------------------------------------------------- Qwen3 / Qwen3-MoE / Mixtral


def _gqa_kind(
    c: _Config,
    *,
    head_dim_default: Any,
    rope: dict[str, Any] | None,
    qk_norm: str = "none",
    bias: bool = False,
) -> dict[str, Any]:
    heads = c.get_int("num_attention_heads")
    kv_heads = c.get_int("num_key_value_heads")
    _check_heads(c, heads, kv_heads)
    kind: dict[str, Any] = {
        "type": "gqa",
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": _head_dim(c, head_dim_default),
        "rope": rope,
    }
    if qk_norm != "none":
        kind["qk_norm"] = qk_norm
    if bias:
        kind["qkv_bias"] = kind["o_bias"] = True
    return kind


def _head_dim(c: _Config, default: Any) -> int:
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


def _qwen_sliding(
    c: _Config, count: int, *, per_layer_types: bool
) -> tuple[int | None, list[bool]]:
    """Qwen's use_sliding_window / sliding_window / max_window_layers (/ layer_types)."""
    use = c.get_bool("use_sliding_window", False)
    window = c.get_int("sliding_window", None, nullable=True)
    max_window = c.get_int("max_window_layers", None, minimum=0, nullable=True)
    if not use:
        # transformers: sliding_window = None unless use_sliding_window.
        if per_layer_types and any(_sliding_layers(c, count, window=0)):
            raise c.error(
                "layer_types",
                "has sliding_attention layers but use_sliding_window is false; make them "
                "full_attention or turn sliding on",
            )
        return None, [False] * count
    if window is None:
        raise c.error("sliding_window", "is null but use_sliding_window is true; give it")
    if per_layer_types and c.has("layer_types"):
        return window, _sliding_layers(c, count, window=window)
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


def _attention_table(
    base: dict[str, Any], window: int | None, sliding: list[bool]
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    if not any(sliding):
        return {"gqa": base}, ["gqa"] * len(sliding)
    if all(sliding):
        return {"gqa": {**base, "sliding_window": window}}, ["gqa"] * len(sliding)
    kinds = {"full": base, "sliding": {**base, "sliding_window": window}}
    return kinds, ["sliding" if s else "full" for s in sliding]


def _qwen3(c: _Config) -> _Parts:
    count = c.get_layer_count()
    dims = _dims(c, eps_default=1e-6)
    head_dim = _head_dim(c, 128)
    rope = _rope(c, head_dim=head_dim, default_theta=10000.0)
    base = _gqa_kind(
        c, head_dim_default=128, rope=rope, qk_norm="rms", bias=c.get_bool("attention_bias", False)
    )
    window, sliding = _qwen_sliding(c, count, per_layer_types=True)
    attention_kinds, attention_table = _attention_table(base, window, sliding)
    act = _activation(c)
    return _Parts(
        dims=dims,
        attention_kinds=attention_kinds,
        attention_table=attention_table,
        ffn_kinds={
            "dense": {"type": "dense", "width": c.get_int("intermediate_size"), "activation": act}
        },
        ffn_table=["dense"] * count,
        quantization=_quantization(c),
    )


def _qwen_moe_table(c: _Config, count: int, experts: int) -> list[str]:
    """transformers Qwen3-MoE / Qwen3-Next: MoE unless in mlp_only_layers or off the step."""
    step = c.get_int("decoder_sparse_step", 1)
    dense_only = set(_layer_list(c, "mlp_only_layers", count))
    return [
        "moe" if i not in dense_only and experts > 0 and (i + 1) % step == 0 else "dense"
        for i in range(count)
    ]


def _qwen3_moe(c: _Config) -> _Parts:
    c.allow(*MOE_TRAINING_KEYS)
    count = c.get_layer_count()
    dims = _dims(c, eps_default=1e-6)
    head_dim = _head_dim(c, "hidden/heads")
    rope = _rope(c, head_dim=head_dim, default_theta=10000.0)
    base = _gqa_kind(
        c,
        head_dim_default="hidden/heads",
        rope=rope,
        qk_norm="rms",
        bias=c.get_bool("attention_bias", False),
    )
    window, sliding = _qwen_sliding(c, count, per_layer_types=False)
    attention_kinds, attention_table = _attention_table(base, window, sliding)
    act = _activation(c)
    experts = c.get_int(("num_experts", "num_local_experts"), minimum=0)
    table = _qwen_moe_table(c, count, experts)
    ffn_kinds: dict[str, dict[str, Any]] = {
        "dense": {"type": "dense", "width": c.get_int("intermediate_size"), "activation": act}
    }
    top_k = c.get_int("num_experts_per_tok")
    width = c.get_int("moe_intermediate_size")
    renormalize = c.get_bool("norm_topk_prob", False)
    if "moe" in table:
        _check_router_groups(
            c, experts, top_k, 1, 1, ("num_experts", "num_experts_per_tok", "", "")
        )
        ffn_kinds["moe"] = {
            "type": "moe",
            "num_experts": experts,
            "top_k": top_k,
            "expert_width": width,
            "activation": act,
            "router": {"score": "softmax", "renormalize": renormalize},
        }
    return _Parts(
        dims=dims,
        attention_kinds=attention_kinds,
        attention_table=attention_table,
        ffn_kinds=_used_kinds(ffn_kinds, table),
        ffn_table=table,
        quantization=_quantization(c),
    )


def _mixtral(c: _Config) -> _Parts:
    c.allow(*MOE_TRAINING_KEYS)
    c.allow("router_jitter_noise")  # multiplicative noise on router inputs, training only
    count = c.get_layer_count()
    dims = _dims(c, eps_default=1e-5)
    head_dim = _head_dim(c, None)
    rope = _rope(c, head_dim=head_dim, default_theta=1e6)
    base = _gqa_kind(c, head_dim_default=None, rope=rope)
    window = c.get_int("sliding_window", None, nullable=True)
    if window is not None:  # Mistral semantics: every layer slides
        base["sliding_window"] = window
    act = _activation(c)
    experts = c.get_int(("num_local_experts", "num_experts"))
    top_k = c.get_int("num_experts_per_tok")
    _check_router_groups(
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
    return _Parts(
        dims=dims,
        attention_kinds={"gqa": base},
        attention_table=["gqa"] * count,
        ffn_kinds={"moe": moe},
        ffn_table=["moe"] * count,
        quantization=_quantization(c),
    )


# ---------------------------------------------------------------- Qwen3-Next


def _qwen3_next(c: _Config) -> _Parts:
    c.allow(*MOE_TRAINING_KEYS)
    # Only meaningful with MTP layers, which are not imported (see _mtp).
    c.allow("mtp_use_dedicated_embeddings")
    count = c.get_layer_count()
    dims = _dims(c, eps_default=1e-6, zero_centered=True)
    act = _activation(
        c,
        silu_only_reason="it is also the Gated DeltaNet conv activation, which mkgen fixes to SiLU",
    )
    head_dim = _head_dim(c, 256)
    # transformers 5 defaults partial_rotary_factor to 0.25 for Qwen3-Next.
    rope = _rope(c, head_dim=head_dim, default_theta=10000.0, partial=0.25)
    if c.get_bool("attention_bias", False):
        raise c.error(
            "attention_bias",
            "true is not supported for Qwen3-Next: its q_proj bias would include the output "
            "gate's, which mkgen's GQA has no tensor for",
        )
    full = _gqa_kind(c, head_dim_default=256, rope=rope, qk_norm="rms")
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
    types = c.get_list("layer_types", None, item=str)
    interval = c.get_int("full_attention_interval", None, nullable=True)
    if types is not None:
        if len(types) != count:
            raise c.error("layer_types", f"has {len(types)} entries for {count} layers")
        for i, t in enumerate(types):
            if t not in ("linear_attention", "full_attention"):
                raise c.error(
                    "layer_types", f"entry {i} is {t!r}; use linear_attention or full_attention"
                )
        if interval is not None:
            derived = [(i + 1) % interval == 0 for i in range(count)]
            if derived != [t == "full_attention" for t in types]:
                raise c.error(
                    "full_attention_interval",
                    f"{interval} contradicts layer_types; give one of them",
                )
    else:
        interval = interval or 4
        types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(count)
        ]
    attention_table = ["full" if t == "full_attention" else "linear" for t in types]
    experts = c.get_int(("num_experts", "num_local_experts"), minimum=0)
    table = _qwen_moe_table(c, count, experts)
    ffn_kinds: dict[str, dict[str, Any]] = {
        "dense": {"type": "dense", "width": c.get_int("intermediate_size"), "activation": act}
    }
    top_k = c.get_int("num_experts_per_tok")
    width = c.get_int("moe_intermediate_size")
    shared = c.get_int("shared_expert_intermediate_size")
    renormalize = c.get_bool("norm_topk_prob", True)
    if "moe" in table:
        _check_router_groups(
            c, experts, top_k, 1, 1, ("num_experts", "num_experts_per_tok", "", "")
        )
        ffn_kinds["moe"] = {
            "type": "moe",
            "num_experts": experts,
            "top_k": top_k,
            "expert_width": width,
            "activation": act,
            "router": {"score": "softmax", "renormalize": renormalize},
            "shared_experts": {"count": 1, "width": shared, "gate": True},
        }
    _mtp(c, ("num_nextn_predict_layers", "mtp_num_hidden_layers"))
    return _Parts(
        dims=dims,
        attention_kinds=_used_kinds({"linear": linear, "full": full}, attention_table),
        attention_table=attention_table,
        ffn_kinds=_used_kinds(ffn_kinds, table),
        ffn_table=table,
        quantization=_quantization(c),
    )


# ---------------------------------------------------------------- gpt-oss

_GPT_OSS_DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def _gpt_oss(c: _Config) -> _Parts:
    c.allow(*MOE_TRAINING_KEYS)
    # hidden_act: GptOssExperts ignores it (the activation is the clamped SwiGLU below).
    # initial_context_length: OpenAI's name for YaRN's original length; transformers
    # reads original_max_position_embeddings from the rope parameters instead.
    c.allow("hidden_act", "initial_context_length")
    count = c.get_layer_count()
    dims = _dims(c, eps_default=1e-5)
    head_dim = _head_dim(c, 64)
    rope = _rope(
        c,
        head_dim=head_dim,
        default_theta=150000.0,
        partial=False,
        default_params=_GPT_OSS_DEFAULT_ROPE,
    )
    base = _gqa_kind(c, head_dim_default=64, rope=rope, bias=c.get_bool("attention_bias", True))
    base["sinks"] = True
    window = c.get_int("sliding_window", 128, nullable=True)
    if c.has("layer_types"):
        sliding = _sliding_layers(c, count, window=window)
    else:  # transformers: sliding on even layers, full on odd ones
        if window is None:
            raise c.error("sliding_window", "is null but gpt-oss alternates sliding layers")
        sliding = [i % 2 == 0 for i in range(count)]
    attention_kinds, attention_table = _attention_table(base, window, sliding)
    experts = c.get_int(("num_local_experts", "num_experts"))
    top_k = c.get_int(("num_experts_per_tok", "experts_per_token"))
    _check_router_groups(
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
    return _Parts(
        dims=dims,
        attention_kinds=attention_kinds,
        attention_table=attention_table,
        ffn_kinds={"moe": moe},
        ffn_table=["moe"] * count,
        quantization=_quantization(c, mxfp4_only_experts=True),
    )


# ---------------------------------------------------------------- Kimi Linear


def _kimi_linear(c: _Config) -> _Parts:
    c.allow(*MOE_TRAINING_KEYS)
    # model_max_length: context limit (transformers' max_position_embeddings alias).
    # head_dim: hidden/heads in the published config, qk_rope_head_dim in transformers 5's;
    # neither MLA (qk_*/v_head_dim) nor KDA (linear head_dim) reads it. pretraining_tp:
    # tensor-parallel slicing of matmuls (same math).
    c.allow("model_max_length", "head_dim", "pretraining_tp")
    count = c.get_layer_count()
    dims = _dims(c, eps_default=1e-5)
    act = _activation(
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
        lac = _Config({}, c.source, c.arch, "linear_attn_config.")
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
    attention_table = _kimi_attention_table(c, lac, count)
    lac.finish()
    experts = c.get_int(("num_experts", "num_local_experts", "n_routed_experts"), minimum=0)
    ffn_table = _kimi_ffn_table(c, count, experts)
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
        _check_router_groups(
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
    _mtp(c, ("num_nextn_predict_layers",))
    return _Parts(
        dims=dims,
        attention_kinds=_used_kinds({"kda": kda, "mla": mla}, attention_table),
        attention_table=attention_table,
        ffn_kinds=_used_kinds(ffn_kinds, ffn_table),
        ffn_table=ffn_table,
        quantization=_quantization(c),
    )


def _agree(c: _Config, lac: _Config, keys: tuple[str, str], default: int) -> int:
    """A KDA dim given at the top level (transformers 5) and/or in linear_attn_config."""
    top = c.get_int(keys[0], None, nullable=True)
    nested = lac.get_int(keys[1], None, nullable=True)
    if top is not None and nested is not None and top != nested:
        raise lac.error(keys[1], f"{nested} disagrees with {keys[0]} {top}")
    return nested if nested is not None else top if top is not None else default


def _kimi_attention_table(c: _Config, lac: _Config, count: int) -> list[str]:
    types = c.get_list("layer_types", None, item=str)
    table: list[str] | None = None
    if types is not None:
        if len(types) != count:
            raise c.error("layer_types", f"has {len(types)} entries for {count} layers")
        for i, t in enumerate(types):
            if t not in ("linear_attention", "full_attention"):
                raise c.error(
                    "layer_types", f"entry {i} is {t!r}; use linear_attention or full_attention"
                )
        table = ["mla" if t == "full_attention" else "kda" for t in types]
    if lac.has("kda_layers") or lac.has("full_attn_layers"):
        kda = _layer_list(lac, "kda_layers", count, one_based=True)
        full = _layer_list(lac, "full_attn_layers", count, one_based=True)
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


def _kimi_ffn_table(c: _Config, count: int, experts: int) -> list[str]:
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


# ---------------------------------------------------------------- the table of architectures


@dataclass(frozen=True)
class _Architecture:
    model_types: tuple[str, ...]
    build: Callable[[_Config], _Parts]


ARCHITECTURES: dict[str, _Architecture] = {
    "DeepseekV3ForCausalLM": _Architecture(("deepseek_v3", "kimi_k2"), _deepseek_v3),
    "Qwen3ForCausalLM": _Architecture(("qwen3",), _qwen3),
    "Qwen3MoeForCausalLM": _Architecture(("qwen3_moe",), _qwen3_moe),
    "MixtralForCausalLM": _Architecture(("mixtral",), _mixtral),
    "Qwen3NextForCausalLM": _Architecture(("qwen3_next",), _qwen3_next),
    "GptOssForCausalLM": _Architecture(("gpt_oss",), _gpt_oss),
    "KimiLinearForCausalLM": _Architecture(("kimi_linear",), _kimi_linear),
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


def canonical_architecture(name: str, source: str = "config") -> str:
    """The architecture class for a class name or model_type (e.g. 'kimi_k2')."""
    if name in ARCHITECTURES:
        return name
    for arch, info in ARCHITECTURES.items():
        if name in info.model_types:
            return arch
    raise SpecError(
        f"{source}: architectures: {name!r} is not supported; mkgen imports "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def resolve_architecture(config: dict[str, Any], source: str) -> str:
    """The supported architecture a config describes (architectures[0], else model_type)."""
    archs = config.get("architectures")
    model_type = config.get("model_type")
    if archs is not None:
        if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
            raise SpecError(f"{source}: architectures: expected a list of class names")
        if len(archs) > 1:
            raise SpecError(
                f"{source}: architectures: lists {len(archs)} classes; give exactly one"
            )
        arch = canonical_architecture(archs[0], source)
        if model_type is not None and model_type not in ARCHITECTURES[arch].model_types:
            raise SpecError(
                f"{source}: model_type: {model_type!r} does not go with {arch} (expected "
                f"{' or '.join(ARCHITECTURES[arch].model_types)})"
            )
        return arch
    if isinstance(model_type, str):
        try:
            return canonical_architecture(model_type, source)
        except SpecError:
            raise SpecError(
                f"{source}: model_type: {model_type!r} is not supported; mkgen imports "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            ) from None
    raise SpecError(f"{source}: architectures: missing (and no model_type); cannot tell the model")


# ---------------------------------------------------------------- compact layer tables


def _rule_cost(rule: dict[str, Any]) -> int:
    if "indices" in rule:
        return 1 + len(rule["indices"])
    if "every" in rule:
        return 3 if rule.get("offset") else 2
    return 2


def _apply(table: list[str], rule: dict[str, Any]) -> list[str]:
    n = len(table)
    if "every" in rule:
        picked = range(rule.get("offset", 0), n, rule["every"])
    elif "first" in rule:
        picked = range(min(rule["first"], n))
    elif "last" in rule:
        picked = range(max(0, n - rule["last"]), n)
    else:
        picked = rule["indices"]
    out = list(table)
    for i in picked:
        out[i] = rule["kind"]
    return out


def _greedy_rules(base: list[str], target: list[str]) -> list[dict[str, Any]]:
    """Rules that turn `base` into `target`: each step takes the every/first/last rule that
    fixes the most layers net of its cost; leftovers become one `indices` rule per kind."""
    n = len(target)
    kinds = sorted(set(target))
    current = list(base)
    rules: list[dict[str, Any]] = []
    for _ in range(n):
        if current == target:
            break
        best: tuple[int, int, dict[str, Any]] | None = None
        for kind in kinds:
            # gain of writing `kind` on layer i: fixes it if wrong now, breaks it if right.
            delta = [
                (cur != want) - (kind != want) for cur, want in zip(current, target, strict=True)
            ]
            candidates: list[tuple[int, dict[str, Any]]] = []
            for every in range(2, n):
                for offset in range(every):
                    rule = {"kind": kind, "every": every}
                    if offset:
                        rule["offset"] = offset
                    candidates.append((sum(delta[offset::every]), rule))
            head = tail = 0
            for m in range(1, n):
                head += delta[m - 1]
                tail += delta[n - m]
                candidates.append((head, {"kind": kind, "first": m}))
                candidates.append((tail, {"kind": kind, "last": m}))
            for gain, rule in candidates:
                if gain <= 0:
                    continue
                cost = _rule_cost(rule)
                if best is None or (gain - cost, -cost) > best[:2]:
                    best = (gain - cost, -cost, rule)
        # An explicit list of the fixed layers would cost 1 + gain: take the rule when it
        # costs no more than that (a first/last/every rule reads better than a list).
        if best is None or best[0] < -1:
            break
        rules.append(best[2])
        current = _apply(current, best[2])
    for kind in kinds:
        rest = [i for i in range(n) if current[i] != target[i] and target[i] == kind]
        if rest:
            rules.append({"kind": kind, "indices": rest})
            current = _apply(current, rules[-1])
    return rules


def compact_layer_assignment(table: Sequence[str]) -> dict[str, Any]:
    """The most compact LayerAssignment (as plain data) whose expansion equals `table`.

    Candidates: each kind as the default, and each short repeating pattern (period 2..8,
    the majority kind at each position); each followed by greedily chosen every/offset,
    first and last rules, then explicit indices for whatever is left. The cheapest by
    the number of values written wins (ties: fewer rules, then a default over a pattern,
    then the most common kind as the default).
    """
    target = list(table)
    n = len(target)
    if not n:
        raise ValueError("empty layer table")
    options: list[tuple[int, int, int, int, dict[str, Any]]] = []
    for kind in sorted(set(target)):
        rules = _greedy_rules([kind] * n, target)
        cost = 1 + sum(map(_rule_cost, rules))
        options.append(
            (cost, len(rules), 0, -target.count(kind), {"default": kind, "rules": rules})
        )
    for period in range(2, min(8, n - 1) + 1):
        pattern = []
        for r in range(period):
            column = target[r::period]
            pattern.append(max(sorted(set(column)), key=column.count))
        if len(set(pattern)) < 2:
            continue
        base = [pattern[i % period] for i in range(n)]
        rules = _greedy_rules(base, target)
        cost = period + sum(map(_rule_cost, rules))
        options.append((cost, len(rules), 1, 0, {"pattern": pattern, "rules": rules}))
    best = min(options, key=lambda o: o[:4])[4]
    data = {k: v for k, v in best.items() if v or k != "rules"}
    expanded = LayerAssignment.model_validate(data).expand(n, "layers")
    if expanded != target:  # a bug here, never a user error
        raise AssertionError(f"compact_layer_assignment: {data} does not expand to {target}")
    return data


# ---------------------------------------------------------------- entry points


def default_spec_name(path: Path) -> str:
    """A checkpoint directory's name or a config file's stem, lowercased, with runs of
    other characters turned into '-'."""
    path = Path(path)
    base = path.resolve().name if path.is_dir() else path.stem
    name = re.sub(r"[^a-z0-9._-]+", "-", base.lower())
    name = re.sub(r"^[^a-z0-9]+", "", name)[:64].rstrip("-")
    return name or "model"


def import_hf_dict(
    config: dict[str, Any], name: str, source: str, keep_mtp: bool = False
) -> ModelSpec:
    """Map a parsed Hugging Face config to a ModelSpec; `source` names it in errors.
    keep_mtp: the checkpoint's multi-token-prediction layers become an `mtp` draft section
    (off by default, so every imported spec without it stays byte-identical)."""
    if not isinstance(config, dict):
        raise SpecError(
            f"{source}: expected a JSON object at the top level, got {type(config).__name__}"
        )
    arch = resolve_architecture(config, source)
    c = _Config(config, source, arch)
    c.keep_mtp = keep_mtp
    c.allow(*METADATA_KEYS)
    parts = ARCHITECTURES[arch].build(c)
    c.finish()
    model_type = config.get("model_type", "?")
    description = " ".join(
        [
            f"Imported from the Hugging Face config {Path(source).name} ({arch}, model_type "
            f"{model_type})."
        ]
        + c.notes
    )
    count = len(parts.attention_table)
    data = {
        "name": name,
        "description": description,
        "dims": parts.dims,
        "attention_kinds": parts.attention_kinds,
        "ffn_kinds": parts.ffn_kinds,
        "layers": {
            "count": count,
            "attention": compact_layer_assignment(parts.attention_table),
            "ffn": compact_layer_assignment(parts.ffn_table),
        },
    }
    if parts.quantization:
        data["quantization"] = parts.quantization
    if keep_mtp and c.mtp_layers:
        data["draft"] = mtp_section(
            c.mtp_layers, data, parts.attention_table, parts.ffn_table, arch
        )
    return spec_from_dict(data, source)


def import_hf_config(path: Path, name: str | None = None, keep_mtp: bool = False) -> ModelSpec:
    """Map a config.json, or a checkpoint directory's, to a ModelSpec (name: the
    directory's name or the file's stem by default; keep_mtp: see import_hf_dict)."""
    path = Path(path)
    config_path = path / "config.json" if path.is_dir() else path
    if path.is_dir() and not config_path.is_file():
        raise SpecError(f"{path}: no config.json in this directory (not a Hugging Face checkpoint)")
    config = read_json(config_path)
    return import_hf_dict(config, name or default_spec_name(path), str(config_path), keep_mtp)


def source_label(path: Path) -> str:
    """How a generated YAML names its source: a config inside the package (the shipped ones
    in mkgen/model_specs/hf-configs/) by its path from the checkout's root, else by its name."""
    package = Path(__file__).resolve().parents[1]
    resolved = Path(path).resolve()
    if resolved.is_relative_to(package):
        return resolved.relative_to(package.parent).as_posix()
    return Path(path).name


def render_spec_yaml(path: Path, name: str | None = None) -> str:
    """The model_specs/ YAML of an imported config: a header naming the source, then the spec."""
    spec = import_hf_config(path, name)
    label = source_label(path)
    # A shipped config's label is a path from the checkout's root; any other is a file name.
    where = "from the checkout's root " if "/" in label else ""
    header = (
        f"# Generated by mkgen import-hf from {label} (a Hugging Face config.json).\n"
        f"# Do not edit; regenerate {where}with\n"
        f"#   mkgen import-hf {label} --name {spec.name} "
        f"-o mkgen/model_specs/{spec.name}.yaml --force\n"
    )
    return dump_spec_yaml(spec, header)
