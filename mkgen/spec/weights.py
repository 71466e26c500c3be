"""The weight inventory of a spec: every tensor, its shape and its weight family.

Each layer kind's schema class says which tensors it has (its `tensors` method,
mkgen/spec/schema.py); this module assembles the model's. Parameter counts, bytes per
family, the reference model's random weights, the Hugging Face importer's name mapping
and the planner's sharding all read it.

Conventions: matrices are stored [fan_in, fan_out] so that a layer computes
``x @ W``; expert tensors carry a leading expert axis. Names are
``layers.{i}.attn.*`` / ``layers.{i}.ffn.*`` inside layers and plain names for
globals.
"""

from __future__ import annotations

import math

from mkgen.spec.schema import AttentionKind, FFNKind, ModelSpec
from mkgen.spec.tensors import VECTORS, Tensor, WeightSpec


def attention_weights(kind: AttentionKind, hidden: int) -> list[Tensor]:
    """(name, shape, family) of one attention kind's tensors: its schema class's `tensors`."""
    return kind.tensors(hidden)


def ffn_weights(kind: FFNKind, hidden: int) -> list[WeightSpec]:
    """The tensors of one FFN kind (names relative to the layer's ``ffn.``): its schema
    class's `tensors`."""
    return kind.tensors(hidden)


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
