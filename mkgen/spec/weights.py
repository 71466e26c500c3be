"""The weight inventory of a spec: every tensor, its shape and its weight family.

This is the one place that says which tensors a layer kind has. Parameter
counts, bytes per family, the reference model's random weights, the Hugging
Face importer's name mapping and (later) the planner's sharding all read it.

Conventions: matrices are stored [fan_in, fan_out] so that a layer computes
``x @ W``; expert tensors carry a leading expert axis. Names are
``layers.{i}.attn.*`` / ``layers.{i}.ffn.*`` inside layers and plain names for
globals.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mkgen.spec.quant import parse_format
from mkgen.spec.schema import (
    DenseFFN,
    GatedDeltaNetAttention,
    GQAAttention,
    KDAAttention,
    MLAAttention,
    ModelSpec,
    MoEFFN,
    PlainMLP,
)

VECTORS = "vectors"  # norms, biases, conv taps, gate constants: always bf16


@dataclass(frozen=True)
class WeightSpec:
    """One tensor of the model."""

    name: str
    shape: tuple[int, ...]
    family: str
    # Number of routed experts stacked on axis 0 (0: not an expert tensor).
    experts: int = 0
    # Fraction of the tensor one token reads (top_k / num_experts for routed experts).
    active_fraction: float = 1.0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_matrix(self) -> bool:
        return self.family != VECTORS

    @property
    def fan_in_out(self) -> tuple[int, int]:
        """(fan_in, fan_out) of one matrix (per expert for expert tensors).

        The embedding table is stored [vocab, hidden] but quantized per vocabulary row,
        like an lm_head: hidden is its fan-in."""
        if self.family == "embedding":
            return self.shape[1], self.shape[0]
        return self.shape[-2], self.shape[-1]

    def nbytes(self, fmt_text: str) -> int:
        """HBM bytes of this tensor stored in the given format (vectors: bf16)."""
        if not self.is_matrix:
            return 2 * self.numel
        fan_in, fan_out = self.fan_in_out
        count = self.numel // (fan_in * fan_out)
        return count * parse_format(fmt_text).matrix_bytes(fan_in, fan_out)


def _gqa(a: GQAAttention, h: int) -> list[tuple[str, tuple[int, ...], str]]:
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    out: list[tuple[str, tuple[int, ...], str]] = [
        ("wq", (h, q), "attention"),
        ("wk", (h, kv), "attention"),
        ("wv", (h, kv), "attention"),
    ]
    if a.output_gate == "sigmoid":
        out.append(("wgate", (h, q), "attention"))
    out.append(("wo", (q, h), "attention"))
    if a.qkv_bias:
        out += [("bq", (q,), VECTORS), ("bk", (kv,), VECTORS), ("bv", (kv,), VECTORS)]
    if a.o_bias:
        out.append(("bo", (h,), VECTORS))
    if a.qk_norm == "rms":
        out += [("q_norm", (a.head_dim,), VECTORS), ("k_norm", (a.head_dim,), VECTORS)]
    if a.sinks:
        out.append(("sinks", (a.num_heads,), VECTORS))
    return out


def _mla(a: MLAAttention, h: int) -> list[tuple[str, tuple[int, ...], str]]:
    n = a.num_heads
    out: list[tuple[str, tuple[int, ...], str]] = []
    if a.q_lora_rank:
        out += [
            ("wq_a", (h, a.q_lora_rank), "attention"),
            ("q_norm", (a.q_lora_rank,), VECTORS),
            ("wq_b", (a.q_lora_rank, n * a.qk_head_dim), "attention"),
        ]
    else:
        out.append(("wq", (h, n * a.qk_head_dim), "attention"))
    out += [
        ("wkv_a", (h, a.kv_lora_rank + a.qk_rope_head_dim), "attention"),
        ("kv_norm", (a.kv_lora_rank,), VECTORS),
        ("wkv_b", (a.kv_lora_rank, n * (a.qk_nope_head_dim + a.v_head_dim)), "attention"),
    ]
    if a.output_gate == "sigmoid":
        out.append(("wgate", (h, n * a.v_head_dim), "attention"))
    out.append(("wo", (n * a.v_head_dim, h), "attention"))
    return out


def _kda(a: KDAAttention, h: int) -> list[tuple[str, tuple[int, ...], str]]:
    d = a.num_heads * a.head_dim
    out: list[tuple[str, tuple[int, ...], str]] = [
        ("wq", (h, d), "attention"),
        ("wk", (h, d), "attention"),
        ("wv", (h, d), "attention"),
        ("conv_q", (a.conv_width, d), VECTORS),
        ("conv_k", (a.conv_width, d), VECTORS),
        ("conv_v", (a.conv_width, d), VECTORS),
        ("wf_a", (h, a.decay_gate_rank), "attention"),
        ("wf_b", (a.decay_gate_rank, d), "attention"),
        ("A_log", (a.num_heads,), VECTORS),
        ("dt_bias", (d,), VECTORS),
        ("wbeta", (h, a.num_heads), "attention"),
    ]
    if a.output_gate_rank:
        out += [
            ("wg_a", (h, a.output_gate_rank), "attention"),
            ("wg_b", (a.output_gate_rank, d), "attention"),
        ]
    else:
        out.append(("wg", (h, d), "attention"))
    out += [("o_norm", (a.head_dim,), VECTORS), ("wo", (d, h), "attention")]
    return out


def _gated_deltanet(a: GatedDeltaNetAttention, h: int) -> list[tuple[str, tuple[int, ...], str]]:
    k, v = a.num_key_heads * a.key_head_dim, a.num_value_heads * a.value_head_dim
    return [
        ("wq", (h, k), "attention"),
        ("wk", (h, k), "attention"),
        ("wv", (h, v), "attention"),
        ("wz", (h, v), "attention"),
        ("wb", (h, a.num_value_heads), "attention"),
        ("wa", (h, a.num_value_heads), "attention"),
        ("conv_q", (a.conv_width, k), VECTORS),
        ("conv_k", (a.conv_width, k), VECTORS),
        ("conv_v", (a.conv_width, v), VECTORS),
        ("A_log", (a.num_value_heads,), VECTORS),
        ("dt_bias", (a.num_value_heads,), VECTORS),
        ("o_norm", (a.value_head_dim,), VECTORS),
        ("wo", (v, h), "attention"),
    ]


def attention_weights(kind: object, hidden: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, family) of one attention kind's tensors."""
    builders = {
        GQAAttention: _gqa,
        MLAAttention: _mla,
        KDAAttention: _kda,
        GatedDeltaNetAttention: _gated_deltanet,
    }
    return builders[type(kind)](kind, hidden)  # type: ignore[operator]


def _gated_mlp(prefix: str, fan_in: int, width: int, family: str, gated: bool = True):
    out = [(f"{prefix}gate", (fan_in, width), family)] if gated else []
    return out + [
        (f"{prefix}up", (fan_in, width), family),
        (f"{prefix}down", (width, fan_in), family),
    ]


def ffn_weights(kind: object, hidden: int) -> list[WeightSpec]:
    """The tensors of one FFN kind (names relative to the layer's ``ffn.``)."""
    if isinstance(kind, DenseFFN):
        out = [
            WeightSpec(n, s, f)
            for n, s, f in _gated_mlp("w_", hidden, kind.width, "mlp", kind.gated)
        ]
        if kind.bias:
            if kind.gated:
                out.append(WeightSpec("b_gate", (kind.width,), VECTORS))
            out += [
                WeightSpec("b_up", (kind.width,), VECTORS),
                WeightSpec("b_down", (hidden,), VECTORS),
            ]
        return out
    if isinstance(kind, PlainMLP):
        return [
            WeightSpec(n, s, f) for n, s, f in _gated_mlp("w_", hidden, kind.width, "mlp", False)
        ]
    assert isinstance(kind, MoEFFN)
    e, f = kind.num_experts, kind.expert_width
    d = kind.latent.width if kind.latent else hidden
    active = kind.top_k / e
    out = [WeightSpec("router", (hidden, e), "router")]
    if kind.router.bias:
        out.append(WeightSpec("router_bias", (e,), VECTORS))
    if kind.router.selection_bias:
        out.append(WeightSpec("selection_bias", (e,), VECTORS))
    if kind.latent:
        out.append(WeightSpec("latent_in", (hidden, d), "projections"))
        if kind.latent.norm:
            out.append(WeightSpec("latent_norm", (d,), VECTORS))
        out.append(WeightSpec("latent_out", (d, hidden), "projections"))
    for name, shape, family in _gated_mlp("experts_", d, f, "experts"):
        out.append(WeightSpec(name, (e, *shape), family, experts=e, active_fraction=active))
    if kind.expert_bias:
        for name, size in (("experts_b_gate", f), ("experts_b_up", f), ("experts_b_down", d)):
            out.append(WeightSpec(name, (e, size), VECTORS, experts=e, active_fraction=active))
    if kind.shared_experts:
        s = kind.shared_experts
        out += [
            WeightSpec(n, sh, fam)
            for n, sh, fam in _gated_mlp("shared_", hidden, s.width, "shared_experts")
        ]
        if s.gate:
            out.append(WeightSpec("shared_gate_proj", (hidden, 1), "router"))
    return out


def model_weights(spec: ModelSpec) -> list[WeightSpec]:
    """Every tensor of the model, in a fixed order (globals, then layer by layer)."""
    h, v = spec.dims.hidden, spec.dims.vocab
    out = [WeightSpec("embedding", (v, h), "embedding")]
    for i, (attn_name, ffn_name) in enumerate(spec.layer_table()):
        attn, ffn = spec.attention_kinds[attn_name], spec.ffn_kinds[ffn_name]
        out.append(WeightSpec(f"layers.{i}.attn_norm", (h,), VECTORS))
        out += [WeightSpec(f"layers.{i}.attn.{n}", s, f) for n, s, f in attention_weights(attn, h)]
        out.append(WeightSpec(f"layers.{i}.ffn_norm", (h,), VECTORS))
        for w in ffn_weights(ffn, h):
            out.append(
                WeightSpec(
                    f"layers.{i}.ffn.{w.name}", w.shape, w.family, w.experts, w.active_fraction
                )
            )
    if spec.attention_residual:
        r = spec.attention_residual
        blocks = math.ceil(spec.layers.count / r.block_size)
        out.append(WeightSpec("attn_res_logits", (blocks, r.max_snapshots), VECTORS))
    out.append(WeightSpec("final_norm", (h,), VECTORS))
    if not spec.dims.tie_embeddings:
        out.append(WeightSpec("lm_head", (h, v), "lm_head"))
    return out
