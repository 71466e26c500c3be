"""The model spec language: what the network is, nothing about hardware.

Every model is a ModelSpec: global dims, named attention and FFN kinds, a layer
table that assigns one attention kind and one FFN kind to every layer, optional
cross-block attention residual, and a weight format per weight family. All
models are strict (unknown keys and wrong types are rejected) and frozen.
docs/spec-reference.md documents every field.

Each layer kind's class also holds its rules of the spec stage: its tensors (`tensors`,
the weight inventory's part of it, mkgen.spec.weights) and how its sizes shrink in the
mini twin (`mini`, mkgen.spec.mini).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from mkgen.errors import SpecError
from mkgen.spec.quant import parse_format
from mkgen.spec.tensors import VECTORS, Tensor, WeightSpec, gated_mlp

if TYPE_CHECKING:  # annotations only: mkgen.spec.mini builds on this module
    from mkgen.spec.mini import Shrink

# Upper bounds of the integer fields, each from the hardware or a number format
# (docs/spec-reference.md#bounds). Floats must be finite (StrictModel).
#
# Sizes (hidden, heads, head and FFN widths, ranks, conv taps): one f32 activation row of
# that width must fit a core's VMEM, 64 MiB on TPU7x = 2^24 f32.
MAX_WIDTH = 2**24
# Token ids are int32.
MAX_VOCAB = 2**31
# The kernel marks the experts a step chose in an int32 table with one entry per expert
# in SMEM (1 MiB per core on every chip of the catalog): 2^16 experts take a quarter.
MAX_EXPERTS = 2**16
# The per-layer tables in SMEM hold six int32 a layer: 2^14 layers take 384 KiB. With
# the token rows' expert ids (options.MAX_TOKEN_ROWS) the three fit together.
MAX_LAYERS = 2**14
# Positions enter the RoPE angles as f32, which holds integers exactly up to 2^24.
MAX_POSITIONS = 2**24
# Text: a description is a paragraph for people, copied into every build's runner.py and
# REPORT.md; names (of the spec, its kinds) and weight formats are short identifiers that
# errors quote. Bounded so that no spec can swell those files and messages.
MAX_DESCRIPTION = 4096
MAX_NAME = 64

Width = Annotated[int, Field(gt=0, le=MAX_WIDTH)]
ExpertCount = Annotated[int, Field(gt=0, le=MAX_EXPERTS)]
LayerCount = Annotated[int, Field(gt=0, le=MAX_LAYERS)]
LayerIndex = Annotated[int, Field(ge=0, lt=MAX_LAYERS)]
TokenCount = Annotated[int, Field(gt=0, le=MAX_POSITIONS)]
VocabSize = Annotated[int, Field(gt=0, le=MAX_VOCAB)]
PositiveFloat = Annotated[float, Field(gt=0)]
Name = Annotated[str, Field(max_length=MAX_NAME)]


class StrictModel(BaseModel):
    """Base: unknown keys rejected, no type coercion, finite floats, immutable."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


# ---------------------------------------------------------------- positions


class YarnScaling(StrictModel):
    """YaRN context extension of RoPE (DeepSeek-V3 / Kimi K2 / gpt-oss)."""

    type: Literal["yarn"] = "yarn"
    factor: PositiveFloat
    original_max_position: TokenCount
    beta_fast: PositiveFloat = 32.0
    beta_slow: PositiveFloat = 1.0
    # Attention-scale correction: DeepSeek multiplies the softmax scale by
    # yarn_mscale(factor, mscale_all_dim)**2; cos/sin by the ratio of the two mscales.
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    # gpt-oss computes the correction ranges without flooring/ceiling them.
    truncate: bool = True


class Rope(StrictModel):
    """Rotary position embedding; absent (null) on a layer kind means NoPE."""

    theta: PositiveFloat
    # Dims rotated per head (partial rotary); null rotates the whole rotary part.
    rotary_dim: Width | None = None
    # true: pairs are adjacent (x0,x1),(x2,x3)...; false: halves (x_i, x_{i+d/2}).
    interleaved: bool = False
    scaling: YarnScaling | None = None

    @field_validator("rotary_dim")
    @classmethod
    def _even(cls, value: int | None) -> int | None:
        if value is not None and value % 2:
            raise ValueError(f"rotary_dim {value} must be even (dims rotate in pairs)")
        return value


# ---------------------------------------------------------------- attention kinds


class GQAAttention(StrictModel):
    """Grouped-query (or multi-head: num_kv_heads == num_heads) softmax attention."""

    type: Literal["gqa"]
    num_heads: Width
    num_kv_heads: Width
    head_dim: Width
    rope: Rope | None = None
    # rms: learned per-head-dim RMSNorm on q and k; rms_noparam: the same without weights.
    qk_norm: Literal["none", "rms", "rms_noparam"] = "none"
    # sigmoid: the q projection also yields a per-element gate on the attention output.
    output_gate: Literal["none", "sigmoid"] = "none"
    sliding_window: TokenCount | None = None
    # One learned logit per head that joins the softmax denominator (gpt-oss).
    sinks: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    # null: head_dim ** -0.5.
    softmax_scale: PositiveFloat | None = None

    @model_validator(mode="after")
    def _check(self) -> GQAAttention:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.rope and self.rope.rotary_dim and self.rope.rotary_dim > self.head_dim:
            raise ValueError(
                f"rope.rotary_dim {self.rope.rotary_dim} exceeds head_dim {self.head_dim}"
            )
        if self.rotary_dim % 2:
            raise ValueError(
                f"rope rotates the whole head_dim {self.head_dim}, which is odd (dims rotate in "
                "pairs); give an even rope.rotary_dim or an even head_dim"
            )
        return self

    @property
    def rotary_dim(self) -> int:
        if self.rope is None:
            return 0
        return self.rope.rotary_dim or self.head_dim

    def tensors(self, hidden: int) -> list[Tensor]:
        """Its tensors (mkgen.spec.weights.attention_weights)."""
        h = hidden
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        out: list[Tensor] = [
            ("wq", (h, q), "attention"),
            ("wk", (h, kv), "attention"),
            ("wv", (h, kv), "attention"),
        ]
        if self.output_gate == "sigmoid":
            out.append(("wgate", (h, q), "attention"))
        out.append(("wo", (q, h), "attention"))
        if self.qkv_bias:
            out += [("bq", (q,), VECTORS), ("bk", (kv,), VECTORS), ("bv", (kv,), VECTORS)]
        if self.o_bias:
            out.append(("bo", (h,), VECTORS))
        if self.qk_norm == "rms":
            out += [("q_norm", (self.head_dim,), VECTORS), ("k_norm", (self.head_dim,), VECTORS)]
        if self.sinks:
            out.append(("sinks", (self.num_heads,), VECTORS))
        return out

    def mini(self, shrink: Shrink) -> dict[str, Any]:
        """Its fields in the mini twin (mkgen.spec.mini)."""
        data = self.model_dump(mode="json")
        kv = min(self.num_kv_heads, 2)
        ratio = min(self.num_heads // self.num_kv_heads, shrink.MAX_HEADS)
        head_dim = min(self.head_dim, shrink.HEAD_DIM)
        data |= {
            "num_kv_heads": kv,
            "num_heads": math.lcm(kv * ratio, shrink.shards),
            "head_dim": head_dim,
        }
        if self.rope:
            data["rope"]["rotary_dim"] = shrink.scaled_rotary(
                self.rope.rotary_dim, self.head_dim, head_dim
            )
        if self.sliding_window:
            data["sliding_window"] = min(self.sliding_window, shrink.WINDOW)
        if self.softmax_scale:
            data["softmax_scale"] = shrink.inverse_sqrt(head_dim)
        return data


class MLAAttention(StrictModel):
    """Multi-head latent attention (DeepSeek-V3, Kimi K2/K3): low-rank q and kv."""

    type: Literal["mla"]
    num_heads: Width
    # null: q is projected directly from the hidden state.
    q_lora_rank: Width | None
    kv_lora_rank: Width
    qk_nope_head_dim: Width
    qk_rope_head_dim: Width
    v_head_dim: Width
    # null: NoPE (the rope part of q/k exists but no rotation is applied).
    rope: Rope | None = None
    output_gate: Literal["none", "sigmoid"] = "none"
    # Epsilon of the q and kv latent RMSNorms; null: dims.norm_eps. DeepSeek-V3 and
    # Kimi Linear fix it at 1e-6 whatever rms_norm_eps says.
    latent_norm_eps: PositiveFloat | None = None
    # null: (qk_nope_head_dim + qk_rope_head_dim) ** -0.5 (times YaRN's mscale**2).
    softmax_scale: PositiveFloat | None = None

    @model_validator(mode="after")
    def _check(self) -> MLAAttention:
        if self.rope and self.rope.rotary_dim not in (None, self.qk_rope_head_dim):
            raise ValueError(
                f"rope.rotary_dim {self.rope.rotary_dim} must equal qk_rope_head_dim "
                f"{self.qk_rope_head_dim} (or be omitted)"
            )
        if self.rope and self.qk_rope_head_dim % 2:
            raise ValueError(
                f"qk_rope_head_dim {self.qk_rope_head_dim} must be even when rope is set "
                "(dims rotate in pairs)"
            )
        return self

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def tensors(self, hidden: int) -> list[Tensor]:
        """Its tensors (mkgen.spec.weights.attention_weights)."""
        h, n = hidden, self.num_heads
        out: list[Tensor] = []
        if self.q_lora_rank:
            out += [
                ("wq_a", (h, self.q_lora_rank), "attention"),
                ("q_norm", (self.q_lora_rank,), VECTORS),
                ("wq_b", (self.q_lora_rank, n * self.qk_head_dim), "attention"),
            ]
        else:
            out.append(("wq", (h, n * self.qk_head_dim), "attention"))
        kv_b = n * (self.qk_nope_head_dim + self.v_head_dim)
        out += [
            ("wkv_a", (h, self.kv_lora_rank + self.qk_rope_head_dim), "attention"),
            ("kv_norm", (self.kv_lora_rank,), VECTORS),
            ("wkv_b", (self.kv_lora_rank, kv_b), "attention"),
        ]
        if self.output_gate == "sigmoid":
            out.append(("wgate", (h, n * self.v_head_dim), "attention"))
        out.append(("wo", (n * self.v_head_dim, h), "attention"))
        return out

    def mini(self, shrink: Shrink) -> dict[str, Any]:
        """Its fields in the mini twin (mkgen.spec.mini)."""
        data = self.model_dump(mode="json")
        shards, head_dim = shrink.shards, shrink.HEAD_DIM
        rope = head_dim // 2
        q_lora, kv_lora = shrink.RANK, shrink.RANK
        # Where the full wq_a and wkv_a split over the cores, the twin's do too, so that it
        # can split them as the full-size build does (mkgen.plan.sharding.full_size_splits).
        if self.q_lora_rank and self.q_lora_rank % shards == 0:
            q_lora = -(-q_lora // shards) * shards
        if (self.kv_lora_rank + self.qk_rope_head_dim) % shards == 0:
            kv_lora = -(-(kv_lora + rope) // shards) * shards - rope
        data |= {
            "num_heads": shrink.heads(self.num_heads),
            "q_lora_rank": q_lora if self.q_lora_rank else None,
            "kv_lora_rank": kv_lora,
            "qk_nope_head_dim": head_dim,
            "qk_rope_head_dim": rope,
            "v_head_dim": head_dim,
        }
        if self.rope and self.rope.rotary_dim:
            data["rope"]["rotary_dim"] = head_dim // 2
        if self.softmax_scale:
            data["softmax_scale"] = shrink.inverse_sqrt(head_dim * 3 // 2)
        return data


class KDAAttention(StrictModel):
    """Kimi Delta Attention: gated delta-rule linear attention with a per-key-dim decay."""

    type: Literal["kda"]
    num_heads: Width
    head_dim: Width
    conv_width: Width
    # Decay g = lower_bound * sigmoid(exp(A_log) * (raw + dt_bias)) when set (Kimi K3);
    # null: g = -exp(A_log) * softplus(raw + dt_bias) (Kimi Linear).
    gate_lower_bound: float | None = None
    # The decay gate projection is low rank: hidden -> rank -> heads * head_dim.
    decay_gate_rank: Width
    # Output gate projection rank; null: full rank hidden -> heads * head_dim.
    output_gate_rank: Width | None = None

    @field_validator("gate_lower_bound")
    @classmethod
    def _negative(cls, value: float | None) -> float | None:
        if value is not None and value >= 0:
            raise ValueError(f"gate_lower_bound {value} must be negative (a log-decay bound)")
        return value

    def tensors(self, hidden: int) -> list[Tensor]:
        """Its tensors (mkgen.spec.weights.attention_weights)."""
        h, d = hidden, self.num_heads * self.head_dim
        out: list[Tensor] = [
            ("wq", (h, d), "attention"),
            ("wk", (h, d), "attention"),
            ("wv", (h, d), "attention"),
            ("conv_q", (self.conv_width, d), VECTORS),
            ("conv_k", (self.conv_width, d), VECTORS),
            ("conv_v", (self.conv_width, d), VECTORS),
            ("wf_a", (h, self.decay_gate_rank), "attention"),
            ("wf_b", (self.decay_gate_rank, d), "attention"),
            ("A_log", (self.num_heads,), VECTORS),
            ("dt_bias", (d,), VECTORS),
            ("wbeta", (h, self.num_heads), "attention"),
        ]
        if self.output_gate_rank:
            out += [
                ("wg_a", (h, self.output_gate_rank), "attention"),
                ("wg_b", (self.output_gate_rank, d), "attention"),
            ]
        else:
            out.append(("wg", (h, d), "attention"))
        out += [("o_norm", (self.head_dim,), VECTORS), ("wo", (d, h), "attention")]
        return out

    def mini(self, shrink: Shrink) -> dict[str, Any]:
        """Its fields in the mini twin (mkgen.spec.mini)."""
        return self.model_dump(mode="json") | {
            "num_heads": shrink.heads(self.num_heads),
            "head_dim": shrink.HEAD_DIM,
            "decay_gate_rank": shrink.GATE_RANK,
            "output_gate_rank": shrink.GATE_RANK if self.output_gate_rank else None,
        }


class GatedDeltaNetAttention(StrictModel):
    """Gated DeltaNet linear attention (Qwen3-Next, Qwen3.8)."""

    type: Literal["gated_deltanet"]
    num_key_heads: Width
    num_value_heads: Width
    key_head_dim: Width
    value_head_dim: Width
    conv_width: Width

    @model_validator(mode="after")
    def _check(self) -> GatedDeltaNetAttention:
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(
                f"num_value_heads {self.num_value_heads} is not a multiple of num_key_heads "
                f"{self.num_key_heads}"
            )
        return self

    def tensors(self, hidden: int) -> list[Tensor]:
        """Its tensors (mkgen.spec.weights.attention_weights)."""
        h = hidden
        k = self.num_key_heads * self.key_head_dim
        v = self.num_value_heads * self.value_head_dim
        return [
            ("wq", (h, k), "attention"),
            ("wk", (h, k), "attention"),
            ("wv", (h, v), "attention"),
            ("wz", (h, v), "attention"),
            ("wb", (h, self.num_value_heads), "attention"),
            ("wa", (h, self.num_value_heads), "attention"),
            ("conv_q", (self.conv_width, k), VECTORS),
            ("conv_k", (self.conv_width, k), VECTORS),
            ("conv_v", (self.conv_width, v), VECTORS),
            ("A_log", (self.num_value_heads,), VECTORS),
            ("dt_bias", (self.num_value_heads,), VECTORS),
            ("o_norm", (self.value_head_dim,), VECTORS),
            ("wo", (v, h), "attention"),
        ]

    def mini(self, shrink: Shrink) -> dict[str, Any]:
        """Its fields in the mini twin (mkgen.spec.mini)."""
        key_heads = shrink.heads(self.num_key_heads)
        ratio = min(self.num_value_heads // self.num_key_heads, 3)
        return self.model_dump(mode="json") | {
            "num_key_heads": key_heads,
            "num_value_heads": key_heads * ratio,
            "key_head_dim": shrink.HEAD_DIM,
            "value_head_dim": shrink.HEAD_DIM,
        }


AttentionKind = Annotated[
    GQAAttention | MLAAttention | KDAAttention | GatedDeltaNetAttention,
    Field(discriminator="type"),
]


# ---------------------------------------------------------------- FFN kinds

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "situ", "clamped_swiglu")


class Activation(StrictModel):
    """The activation of a gated MLP: out = act(gate, up) @ down.

    silu/gelu/gelu_tanh: act(x) * up. situ (Kimi K3):
    gate_cap*tanh(g/gate_cap)*sigmoid(g) * value_cap*tanh(v/value_cap).
    clamped_swiglu (gpt-oss): g = min(g, limit), v = clip(v, -limit, limit),
    g*sigmoid(alpha*g) * (v + 1).
    """

    kind: Literal["silu", "gelu", "gelu_tanh", "situ", "clamped_swiglu"]
    alpha: PositiveFloat | None = None
    limit: PositiveFloat | None = None
    gate_cap: PositiveFloat | None = None
    value_cap: PositiveFloat | None = None

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, data: Any) -> Any:
        if isinstance(data, str):
            if data not in ACTIVATIONS:
                raise ValueError(
                    f"unknown activation {data!r}; use one of {', '.join(ACTIVATIONS)}"
                )
            defaults = {
                "clamped_swiglu": {"alpha": 1.702, "limit": 7.0},
                "situ": {"gate_cap": 4.0, "value_cap": 25.0},
            }
            return {"kind": data, **defaults.get(data, {})}
        return data

    @model_validator(mode="after")
    def _params(self) -> Activation:
        needs = {"clamped_swiglu": ("alpha", "limit"), "situ": ("gate_cap", "value_cap")}
        wanted = needs.get(self.kind, ())
        for name in ("alpha", "limit", "gate_cap", "value_cap"):
            value = getattr(self, name)
            if name in wanted and value is None:
                raise ValueError(f"activation {self.kind} needs {name}")
            if name not in wanted and value is not None:
                raise ValueError(f"activation {self.kind} takes no {name}")
        return self


class DenseFFN(StrictModel):
    """A dense MLP: gated (act(x W_gate) * x W_up) W_down, or plain act(x W_up) W_down."""

    type: Literal["dense"]
    width: Width
    activation: Activation
    gated: bool = True
    bias: bool = False

    def tensors(self, hidden: int) -> list[WeightSpec]:
        """Its tensors (mkgen.spec.weights.ffn_weights)."""
        mlp = gated_mlp("w_", hidden, self.width, "mlp", self.gated)
        out = [WeightSpec(n, s, f) for n, s, f in mlp]
        if self.bias:
            if self.gated:
                out.append(WeightSpec("b_gate", (self.width,), VECTORS))
            out += [
                WeightSpec("b_up", (self.width,), VECTORS),
                WeightSpec("b_down", (hidden,), VECTORS),
            ]
        return out

    def mini(self, shrink: Shrink) -> dict[str, Any]:
        """Its fields in the mini twin (mkgen.spec.mini)."""
        return self.model_dump(mode="json") | {"width": min(self.width, shrink.FFN_WIDTH)}


class PlainMLP(StrictModel):
    """A plain MLP: act(x W_up) W_down, no gate and no biases (the kind
    docs/adding-a-layer-kind.md adds as its worked example)."""

    type: Literal["mlp"]
    width: Width
    # Single-input activations the kernel has (its gated _activation with up = 1).
    activation: Literal["silu", "gelu_tanh"]

    def tensors(self, hidden: int) -> list[WeightSpec]:
        """Its tensors (mkgen.spec.weights.ffn_weights): w_up and w_down."""
        return [WeightSpec(*t) for t in gated_mlp("w_", hidden, self.width, "mlp", gated=False)]

    def mini(self, shrink: Shrink) -> dict[str, Any]:
        """Its fields in the mini twin (mkgen.spec.mini)."""
        return self.model_dump(mode="json") | {"width": min(self.width, shrink.FFN_WIDTH)}


class Router(StrictModel):
    """How a token chooses its experts and weighs their outputs."""

    score: Literal["softmax", "sigmoid"]
    # A learned per-expert bias added to scores for choosing only, not for weighting.
    selection_bias: bool = False
    # A learned bias of the router's linear layer (enters the scores themselves).
    bias: bool = False
    # Divide the chosen weights by their sum.
    renormalize: bool = True
    routed_scaling: PositiveFloat = 1.0
    # Grouped top-k: experts in n_group groups; keep the topk_group best groups
    # (each scored by the sum of its two best experts), then top-k within them.
    n_group: ExpertCount = 1
    topk_group: ExpertCount = 1


class SharedExperts(StrictModel):
    """Experts every token uses, on the full hidden size."""

    count: ExpertCount
    # Combined intermediate width of all shared experts.
    width: Width
    # A sigmoid gate (hidden -> 1) on the shared output (Qwen3-Next).
    gate: bool = False


class LatentProjection(StrictModel):
    """Routed experts work in a smaller space: hidden -> width (norm) -> experts -> hidden.

    Kimi K3's latent MoE has a norm; Muse Spark's pre/post expert projections do not.
    """

    width: Width
    norm: bool


class MoEFFN(StrictModel):
    """Mixture of experts: routed gated experts, optional shared experts and latent space."""

    type: Literal["moe"]
    num_experts: ExpertCount
    top_k: ExpertCount
    expert_width: Width
    activation: Activation
    router: Router
    shared_experts: SharedExperts | None = None
    latent: LatentProjection | None = None
    # Per-expert biases on gate/up and down (gpt-oss).
    expert_bias: bool = False

    @model_validator(mode="after")
    def _check(self) -> MoEFFN:
        r = self.router
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k {self.top_k} exceeds num_experts {self.num_experts}")
        if self.num_experts % r.n_group:
            raise ValueError(
                f"router.n_group {r.n_group} does not divide num_experts {self.num_experts}"
            )
        if r.topk_group > r.n_group:
            raise ValueError(f"router.topk_group {r.topk_group} exceeds n_group {r.n_group}")
        if r.n_group > 1 and self.top_k > r.topk_group * (self.num_experts // r.n_group):
            raise ValueError(
                f"top_k {self.top_k} exceeds the experts in topk_group {r.topk_group} groups"
            )
        return self

    def tensors(self, hidden: int) -> list[WeightSpec]:
        """Its tensors (mkgen.spec.weights.ffn_weights): router, latent projections,
        routed experts stacked on a leading axis, shared experts."""
        e, f = self.num_experts, self.expert_width
        d = self.latent.width if self.latent else hidden
        active = self.top_k / e
        out = [WeightSpec("router", (hidden, e), "router")]
        if self.router.bias:
            out.append(WeightSpec("router_bias", (e,), VECTORS))
        if self.router.selection_bias:
            out.append(WeightSpec("selection_bias", (e,), VECTORS))
        if self.latent:
            out.append(WeightSpec("latent_in", (hidden, d), "projections"))
            if self.latent.norm:
                out.append(WeightSpec("latent_norm", (d,), VECTORS))
            out.append(WeightSpec("latent_out", (d, hidden), "projections"))
        for name, shape, family in gated_mlp("experts_", d, f, "experts"):
            out.append(WeightSpec(name, (e, *shape), family, experts=e, active_fraction=active))
        if self.expert_bias:
            for name, size in (("experts_b_gate", f), ("experts_b_up", f), ("experts_b_down", d)):
                out.append(WeightSpec(name, (e, size), VECTORS, experts=e, active_fraction=active))
        if self.shared_experts:
            s = self.shared_experts
            shared = gated_mlp("shared_", hidden, s.width, "shared_experts")
            out += [WeightSpec(n, sh, fam) for n, sh, fam in shared]
            if s.gate:
                out.append(WeightSpec("shared_gate_proj", (hidden, 1), "router"))
        return out

    def mini(self, shrink: Shrink) -> dict[str, Any]:
        """Its fields in the mini twin (mkgen.spec.mini)."""
        data = self.model_dump(mode="json")
        shards = shrink.shards
        experts = min(self.num_experts, shrink.EXPERTS)
        if self.num_experts % shards == 0 and experts % shards:
            # As many whole columns per core as the full router has, so a twin can split its
            # router the way the full-size build does (mkgen.plan.sharding.full_size_splits).
            experts = -(-shrink.EXPERTS // shards) * shards
        router = data["router"]
        if self.router.n_group > 1:
            router["n_group"] = min(self.router.n_group, experts // 2)
            router["topk_group"] = max(1, min(self.router.topk_group, router["n_group"] // 2))
        per_group = experts // router["n_group"]
        top_k = min(self.top_k, 2, router["topk_group"] * per_group)
        # On many cores the experts also split by width: keep whole quantization blocks per core.
        width = shrink.EXPERT_WIDTH * max(1, shards // experts)
        data |= {"num_experts": experts, "top_k": top_k, "expert_width": width}
        if self.shared_experts:
            shared = shrink.EXPERT_WIDTH * self.shared_experts.count
            if shrink.shared_block:  # split over every core: whole quantization blocks on each
                block = shrink.shared_block
                shared = -(-shared // (block * shards)) * block * shards
            data["shared_experts"]["width"] = shared
        if self.latent:
            data["latent"]["width"] = shrink.LATENT
        return data


FFNKind = Annotated[DenseFFN | PlainMLP | MoEFFN, Field(discriminator="type")]


# ---------------------------------------------------------------- layer table


class LayerRule(StrictModel):
    """Assigns a kind to a set of layers; exactly one selector is given.

    every/offset: layers i with i % every == offset; indices: explicit 0-based list;
    first: layers 0..first-1; last: the last `last` layers.
    """

    kind: Name
    every: LayerCount | None = None
    offset: LayerIndex = 0
    indices: list[LayerIndex] | None = None
    first: LayerCount | None = None
    last: LayerCount | None = None

    @model_validator(mode="after")
    def _one_selector(self) -> LayerRule:
        given = [n for n in ("every", "indices", "first", "last") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(
                f"rule for {self.kind!r} needs exactly one of every, indices, first, last "
                f"(got {', '.join(given) or 'none'})"
            )
        if self.every is not None and self.offset >= self.every:
            raise ValueError(f"offset {self.offset} must be smaller than every {self.every}")
        if self.every is None and self.offset:
            raise ValueError("offset goes with every")
        return self

    def outside(self, count: int) -> str | None:
        """What of this rule lies beyond a model of `count` layers, or None."""
        if self.indices is not None:
            outside = [i for i in self.indices if i >= count]
            return f"indices {outside} are outside 0..{count - 1}" if outside else None
        # offset < every, so an every within the count keeps its offset within it too.
        if self.every is not None and self.every > count:
            return f"every {self.every} exceeds the {count} layers; use indices"
        for name in ("first", "last"):
            value = getattr(self, name)
            if value is not None and value > count:
                return f"{name} {value} exceeds the {count} layers"
        return None

    def selects(self, count: int) -> list[int]:
        """The 0-based layers this rule selects in a model of `count` layers."""
        if self.every is not None:
            return list(range(self.offset, count, self.every))
        if self.first is not None:
            return list(range(min(self.first, count)))
        if self.last is not None:
            return list(range(max(0, count - self.last), count))
        return sorted(set(self.indices or []))


class LayerAssignment(StrictModel):
    """One kind per layer: a default or a repeating pattern, then rules in order (later wins)."""

    default: Name | None = None
    # Repeats from layer 0: pattern[i % len(pattern)].
    pattern: list[Name] | None = None
    rules: list[LayerRule] = []

    @model_validator(mode="after")
    def _base(self) -> LayerAssignment:
        if self.default is not None and self.pattern is not None:
            raise ValueError("give either default or pattern, not both")
        if self.pattern is not None and not self.pattern:
            raise ValueError("pattern must not be empty")
        return self

    def kind_names(self) -> set[str]:
        names = {r.kind for r in self.rules} | set(self.pattern or [])
        return names | ({self.default} if self.default else set())

    def expand(self, count: int, field: str) -> list[str]:
        """The kind name of every layer; raises ValueError naming uncovered layers."""
        if self.pattern:
            table: list[str | None] = [self.pattern[i % len(self.pattern)] for i in range(count)]
        else:
            table = [self.default] * count
        for n, rule in enumerate(self.rules):
            outside = rule.outside(count)
            if outside:
                raise ValueError(f"{field}.rules[{n}]: {outside}")
            for i in rule.selects(count):
                table[i] = rule.kind
        missing = [i for i, kind in enumerate(table) if kind is None]
        if missing:
            shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
            raise ValueError(
                f"{field}: layers {shown} have no kind; add a default, a pattern or a rule"
            )
        return [kind for kind in table if kind is not None]


class Layers(StrictModel):
    count: LayerCount
    attention: LayerAssignment
    ffn: LayerAssignment


class AttentionResidual(StrictModel):
    """Kimi K3's cross-block residual: at the start of each block of `block_size` layers
    the residual stream becomes a learned softmax mixture of the snapshots taken at the
    starts of the current and up to `max_snapshots - 1` earlier blocks."""

    block_size: LayerCount
    max_snapshots: Annotated[int, Field(ge=2, le=MAX_LAYERS)]


# ---------------------------------------------------------------- dims, quantization

WEIGHT_FAMILIES = (
    "embedding",
    "attention",
    "mlp",
    "shared_experts",
    "projections",
    "experts",
    "router",
    "lm_head",
)
# `dense` in a spec or on the command line sets every family of dense layer matmuls.
DENSE_GROUP = ("attention", "mlp", "shared_experts", "projections")


class Dims(StrictModel):
    hidden: Width
    vocab: VocabSize
    # Rows of the vocabulary that real tokens use (the rest is padding); null: all.
    vocab_used: VocabSize | None = None
    norm_eps: PositiveFloat
    # zero_centered: RMSNorm scales by (1 + w) (Qwen3-Next, Qwen3.8).
    norm_style: Literal["plain", "zero_centered"] = "plain"
    tie_embeddings: bool = False
    # logits = softcap * tanh(logits * multiplier / softcap) when set.
    logit_softcap: PositiveFloat | None = None
    logit_multiplier: PositiveFloat = 1.0

    @model_validator(mode="after")
    def _check(self) -> Dims:
        if self.vocab_used is not None and self.vocab_used > self.vocab:
            raise ValueError(f"vocab_used {self.vocab_used} exceeds vocab {self.vocab}")
        return self


class Quantization(StrictModel):
    """Storage format per weight family (see mkgen.spec.quant). Norms, biases, conv
    taps and gate constants ("vectors") are always bf16."""

    embedding: Name = "bf16"
    attention: Name = "bf16"
    mlp: Name = "bf16"
    shared_experts: Name = "bf16"
    projections: Name = "bf16"
    experts: Name = "bf16"
    router: Name = "bf16"
    lm_head: Name = "bf16"

    @model_validator(mode="before")
    @classmethod
    def _expand_dense(cls, data: Any) -> Any:
        if isinstance(data, dict) and "dense" in data:
            data = dict(data)
            dense = data.pop("dense")
            for family in DENSE_GROUP:
                data.setdefault(family, dense)
        return data

    @field_validator(*WEIGHT_FAMILIES)
    @classmethod
    def _format(cls, text: str, info: ValidationInfo) -> str:
        try:
            return str(parse_format(text, info.field_name or "format"))
        except SpecError as error:
            # pydantic adds the field's path; keep only what is wrong.
            raise ValueError(str(error).partition(": ")[2]) from None


# ---------------------------------------------------------------- drafters

# (docs/spec-reference.md#draft, docs/drafting.md; inventory and checks: mkgen/spec/draft.py)
# Rows a step verifies are at most options.MAX_TOKEN_ROWS; a block is one step's rows.
MAX_BLOCK = 512


class MtpDraft(StrictModel):
    """The target's own multi-token-prediction layers (DeepSeek-V3 MTP, Qwen3-Next MTP)."""

    kind: Literal["mtp"]
    # MTP modules in the checkpoint; draft j (0-based) runs module j % layers.
    layers: LayerCount
    # The target's attention and FFN kinds (names in attention_kinds / ffn_kinds) of the
    # MTP modules' decoder layer.
    attention: Name
    ffn: Name
    # DeepSeek-V3 (vLLM's deepseek_mtp.py) zeroes the token embedding at position 0;
    # Qwen3-Next (qwen3_next_mtp.py) does not.
    mask_first_embedding: bool = True
    # What draft j + 1 reads as the previous hidden state: the module's output before its
    # final norm (DeepSeek-V3) or after it (Qwen3-Next).
    chain: Literal["pre_norm", "normed"] = "pre_norm"

    def target_layers(self, count: int) -> list[int]:
        """The target layers (of `count`) whose hidden state the drafter reads: the last
        (final-normed, as vLLM hands the MTP module its hidden state)."""
        return [count - 1]

    def check_against(self, target: ModelSpec) -> None:
        for field, name, kinds in (
            ("attention", self.attention, target.attention_kinds),
            ("ffn", self.ffn, target.ffn_kinds),
        ):
            if name not in kinds:
                raise ValueError(
                    f"draft.{field}: {name!r} is not one of the target's {field} kinds "
                    f"({', '.join(kinds)}); name the kind of the MTP layer"
                )
        attention = target.attention_kinds[self.attention]
        if not isinstance(attention, GQAAttention | MLAAttention):
            raise ValueError(
                f"draft.attention: {self.attention!r} is a {attention.type} kind; an MTP "
                "layer is a full-attention layer: name a gqa or mla kind"
            )


class BlockDraft(StrictModel):
    """A DFlash-style block drafter: GQA layers reading injected target features."""

    kind: Literal["block"]
    # Must equal the target's hidden: the drafter embeds its block with the target's table.
    hidden: Width
    layers: LayerCount
    attention: GQAAttention
    ffn: DenseFFN
    norm_eps: PositiveFloat
    # Rows of one verify step: the last accepted token and block_size - 1 drafts.
    block_size: Annotated[int, Field(ge=2, le=MAX_BLOCK)]
    # Target layers whose output (the residual stream after the layer) feeds the drafter,
    # concatenated in this order (DFlash's target_layer_ids).
    feature_layers: list[LayerIndex]
    # The token id that fills the drafted positions of the block (DFlash's mask_token_id).
    mask_token: Annotated[int, Field(ge=0, lt=2**31)]
    # shared: the target's LM head (DFlash); own: the drafter's, over draft_vocab rows.
    lm_head: Literal["shared", "own"] = "shared"
    # A reduced draft vocabulary (EAGLE-3's d2t map): own head rows, mapped to target ids.
    draft_vocab: VocabSize | None = None

    @field_validator("feature_layers")
    @classmethod
    def _features(cls, layers: list[int]) -> list[int]:
        if not layers:
            raise ValueError("name at least one target layer")
        if len(set(layers)) != len(layers):
            raise ValueError(f"{layers} names a layer twice")
        return layers

    def target_layers(self, count: int) -> list[int]:
        """The target layers whose hidden state the drafter reads: its feature layers, in
        their order (the last one final-normed, transformers' hidden_states[count])."""
        return list(self.feature_layers)

    @model_validator(mode="after")
    def _check(self) -> BlockDraft:
        a = self.attention
        unsupported = [
            ("sliding_window", a.sliding_window is not None),
            ("sinks", a.sinks),
            ("output_gate", a.output_gate != "none"),
        ]
        for name, used in unsupported:
            if used:
                raise ValueError(
                    f"attention.{name} is not supported in a block drafter (DFlash's layers "
                    "attend over the whole context and block); leave it out"
                )
        if self.draft_vocab is not None and self.lm_head != "own":
            raise ValueError("draft_vocab needs lm_head: own (the shared head has the target's)")
        return self

    def check_against(self, target: ModelSpec) -> None:
        if self.hidden != target.dims.hidden:
            raise ValueError(
                f"draft.hidden {self.hidden} does not fit the target's hidden "
                f"{target.dims.hidden}: a block drafter embeds with the target's table; "
                f"use a drafter trained for this target (hidden {target.dims.hidden})"
            )
        count = target.layers.count
        missing = [i for i in self.feature_layers if i >= count]
        if missing:
            raise ValueError(
                f"draft.feature_layers: layer {missing[0]} does not exist in the target's "
                f"{count} layers (0..{count - 1}); name target layers below {count}"
            )
        vocab = target.dims.vocab
        if self.mask_token >= vocab:
            raise ValueError(
                f"draft.mask_token {self.mask_token} is outside the target's vocabulary "
                f"of {vocab}; use the mask id of the target's tokenizer"
            )
        if self.draft_vocab is not None and self.draft_vocab > vocab:
            raise ValueError(
                f"draft.draft_vocab {self.draft_vocab} exceeds the target's vocabulary of "
                f"{vocab}; a reduced draft vocabulary maps into the target's"
            )


class ModelDraft(StrictModel):
    """A standalone small model with the target's vocabulary."""

    kind: Literal["model"]
    model: ModelSpec

    @field_validator("model")
    @classmethod
    def _no_nested_draft(cls, model: ModelSpec) -> ModelSpec:
        if model.draft is not None:
            raise ValueError("a drafter model has no draft section of its own; remove it")
        return model

    def target_layers(self, count: int) -> list[int]:
        """None: a standalone model reads only the tokens."""
        return []

    def check_against(self, target: ModelSpec) -> None:
        ours, theirs = self.model.dims, target.dims
        if (ours.vocab, ours.vocab_used) != (theirs.vocab, theirs.vocab_used):
            raise ValueError(
                f"draft.model.dims: vocabulary {ours.vocab} (used {ours.vocab_used or 'all'}) "
                f"does not match the target's {theirs.vocab} (used {theirs.vocab_used or 'all'}); "
                "a drafter model must share the target's tokenizer"
            )


Drafter = Annotated[MtpDraft | BlockDraft | ModelDraft, Field(discriminator="kind")]


# ---------------------------------------------------------------- the model


class ModelSpec(StrictModel):
    """A whole decoder-only model."""

    name: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9._-]*$", max_length=MAX_NAME)]
    description: Annotated[str, Field(max_length=MAX_DESCRIPTION)] = ""
    dims: Dims
    attention_kinds: dict[str, AttentionKind]
    ffn_kinds: dict[str, FFNKind]
    layers: Layers
    attention_residual: AttentionResidual | None = None
    quantization: Quantization = Quantization()
    # The drafter that proposes a step's rows (no kernel drafts yet; a build at rows > 1
    # writes the hidden states it reads).
    draft: Drafter | None = None

    @model_serializer(mode="wrap")
    def _without_absent_draft(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A spec without a drafter dumps exactly as before drafters existed, so the inputs
        # hash of every build without one (and the tuned holds keyed by it) is unchanged.
        data = handler(self)
        if self.draft is None:
            data.pop("draft", None)
        return data

    @field_validator("attention_kinds", "ffn_kinds")
    @classmethod
    def _kind_names(cls, kinds: dict[str, Any]) -> dict[str, Any]:
        if not kinds:
            raise ValueError("define at least one kind")
        for name in kinds:
            if len(name) > MAX_NAME:
                raise ValueError(
                    f"kind name {name[:16]!r}... has {len(name)} characters, over {MAX_NAME}"
                )
            if not name.isidentifier() or not name.isascii():
                raise ValueError(f"kind name {name!r} must be an ASCII identifier")
        return kinds

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        for section, kinds in (("attention", self.attention_kinds), ("ffn", self.ffn_kinds)):
            assignment: LayerAssignment = getattr(self.layers, section)
            unknown = sorted(assignment.kind_names() - set(kinds))
            if unknown:
                raise ValueError(
                    f"layers.{section}: unknown kind {unknown[0]!r}; defined: {', '.join(kinds)}"
                )
            assignment.expand(self.layers.count, f"layers.{section}")
        h = self.dims.hidden
        for name, ffn in self.ffn_kinds.items():
            if isinstance(ffn, MoEFFN) and ffn.latent and ffn.latent.width >= h:
                raise ValueError(
                    f"ffn_kinds.{name}.latent.width {ffn.latent.width} must be below hidden {h}"
                )
        if self.draft is not None:
            self.draft.check_against(self)
        return self

    # Derived views (cheap; the table is recomputed on demand to keep the model frozen).

    def attention_table(self) -> list[str]:
        """Attention kind name of every layer."""
        return self.layers.attention.expand(self.layers.count, "layers.attention")

    def ffn_table(self) -> list[str]:
        """FFN kind name of every layer."""
        return self.layers.ffn.expand(self.layers.count, "layers.ffn")

    def layer_table(self) -> list[tuple[str, str]]:
        """(attention kind name, FFN kind name) of every layer."""
        return list(zip(self.attention_table(), self.ffn_table(), strict=True))

    def attention_of(self, layer: int) -> AttentionKind:
        return self.attention_kinds[self.attention_table()[layer]]

    def ffn_of(self, layer: int) -> FFNKind:
        return self.ffn_kinds[self.ffn_table()[layer]]


# ModelDraft nests a ModelSpec, defined after it.
ModelDraft.model_rebuild()
ModelSpec.model_rebuild()
