"""Drafters: what proposes a step's rows - 1 tokens for the target to verify.

A spec's optional `draft:` section names one drafter (docs/spec-reference.md#draft,
docs/drafting.md). Three kinds:

- `mtp`: the target checkpoint's own multi-token-prediction layers (DeepSeek-V3 and Kimi
  `num_nextn_predict_layers`, Qwen3-Next `mtp_num_hidden_layers`). Each is: the token's
  embedding and the previous hidden state, each RMS-normed, concatenated (embedding first)
  and projected 2H -> H, one decoder layer of the target's own kinds, then its own final
  norm and the target's LM head. Chained: draft j runs layer j % layers.
- `block`: a DFlash-style block drafter: a few GQA decoder layers whose keys and values
  also see a projection of the target's hidden states at `feature_layers`, drafting the
  `block_size - 1` masked positions after the last accepted token in one non-causal pass.
- `model`: a standalone small model (a whole ModelSpec) with the target's vocabulary.

The drafter classes live in mkgen/spec/schema.py (a ModelDraft nests a ModelSpec); each
is checked against its target when the spec is validated (ModelSpec calls
`check_against`): one line naming the mismatch. This module holds a drafter's weight
inventory, `with_draft`, which attaches a drafter to a target, and the MTP section of an
import; mkgen/spec/draft_import.py reads a drafter's own config.json. No kernel drafts
yet (a build writes the hidden states the drafter reads: `target_layers`,
docs/drafting.md); a build's inputs include the section only when it is present, so specs
without one are unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mkgen.errors import SpecError
from mkgen.spec.schema import BlockDraft, ModelDraft, ModelSpec, MtpDraft
from mkgen.spec.tensors import VECTORS, WeightSpec
from mkgen.spec.weights import attention_weights, ffn_weights, model_weights

# ---------------------------------------------------------------- weights


def _prefixed(prefix: str, weights: list[WeightSpec]) -> list[WeightSpec]:
    return [WeightSpec(prefix + w.name, w.shape, w.family, w.experts, w.active_fraction)
            for w in weights]  # fmt: skip


def decoder_layer_weights(prefix: str, attention: object, ffn: object, h: int) -> list[WeightSpec]:
    """The tensors of one decoder layer (norms, attention, FFN) under `prefix`."""
    out = [WeightSpec(f"{prefix}attn_norm", (h,), VECTORS)]
    out += [WeightSpec(f"{prefix}attn.{n}", s, f) for n, s, f in attention_weights(attention, h)]
    out.append(WeightSpec(f"{prefix}ffn_norm", (h,), VECTORS))
    return out + _prefixed(f"{prefix}ffn.", ffn_weights(ffn, h))


def draft_weights(spec: ModelSpec) -> list[WeightSpec]:
    """Every tensor of the spec's drafter, named `draft.*` (none without a draft section).

    mtp: per module k `draft.{k}.{enorm,hnorm,eh_proj,final_norm}` and its decoder layer;
    block: `draft.fc` (features x hidden -> hidden), `draft.hidden_norm`, the layers
    `draft.layers.{i}.*`, `draft.final_norm` and, with its own head, `draft.lm_head` and
    `draft.d2t` (int32 offsets: target id = draft id + d2t[draft id], EAGLE-3's map);
    model: the small model's own inventory under `draft.`.
    """
    draft, h = spec.draft, spec.dims.hidden
    if draft is None:
        return []
    if isinstance(draft, ModelDraft):
        return _prefixed("draft.", model_weights(draft.model))
    if isinstance(draft, MtpDraft):
        out: list[WeightSpec] = []
        for k in range(draft.layers):
            p = f"draft.{k}."
            out += [
                WeightSpec(f"{p}enorm", (h,), VECTORS),
                WeightSpec(f"{p}hnorm", (h,), VECTORS),
                WeightSpec(f"{p}eh_proj", (2 * h, h), "projections"),
            ]
            attention, ffn = spec.attention_kinds[draft.attention], spec.ffn_kinds[draft.ffn]
            out += decoder_layer_weights(p, attention, ffn, h)
            out.append(WeightSpec(f"{p}final_norm", (h,), VECTORS))
        return out
    out = [
        WeightSpec("draft.fc", (len(draft.feature_layers) * h, h), "projections"),
        WeightSpec("draft.hidden_norm", (h,), VECTORS),
    ]
    for i in range(draft.layers):
        out += decoder_layer_weights(f"draft.layers.{i}.", draft.attention, draft.ffn, h)
    out.append(WeightSpec("draft.final_norm", (h,), VECTORS))
    if draft.lm_head == "own":
        rows = draft.draft_vocab or spec.dims.vocab
        out.append(WeightSpec("draft.lm_head", (h, rows), "lm_head"))
        if draft.draft_vocab is not None:
            out.append(WeightSpec("draft.d2t", (rows,), VECTORS))
    return out


# ---------------------------------------------------------------- choosing a drafter


def with_draft(target: ModelSpec, draft: str | MtpDraft | BlockDraft | ModelDraft) -> ModelSpec:
    """`target` drafting with `draft`: "mtp" (the target's own MTP section) or a drafter.

    One-line SpecErrors name the mismatch (the check `--draft` runs)."""
    if draft == "mtp":
        if not isinstance(target.draft, MtpDraft):
            raise SpecError(
                f"{target.name}: draft mtp needs the target's multi-token-prediction layers, "
                "and this spec has none (no draft section of kind mtp; `mkgen import-hf "
                "CONFIG --keep-mtp` keeps a checkpoint's); name a drafter spec instead (one in "
                "model_specs/drafters/, a .yaml or a drafter's config.json)"
            )
        return target
    assert not isinstance(draft, str), f"unknown drafter {draft!r}"
    try:
        draft.check_against(target)
    except ValueError as error:
        raise SpecError(f"{target.name}: {error}") from None
    return target.model_copy(update={"draft": draft})


# ---------------------------------------------------------------- import from config.json

# Attention kinds an MTP module's decoder layer can have: a checkpoint's MTP layer is a
# full-attention layer (Qwen3-Next's is its gated attention even where the last layer is
# linear; DeepSeek-V3's and Kimi's are MLA).
_SOFTMAX_ATTENTION = ("gqa", "mla")


def mtp_note(count: int, keys: Sequence[str], kept: bool) -> str:
    """The imported spec's description of the checkpoint's MTP layers."""
    where = f"{count} multi-token-prediction layer(s) ({'/'.join(keys)} = {count})"
    if kept:
        return f"The checkpoint's {where} are kept as the draft section (kind mtp)."
    return (
        f"The checkpoint's {where} are not imported: they only draft tokens for speculative "
        "decoding and do not change the main model's output."
    )


def mtp_section(
    count: int,
    data: dict[str, Any],
    attention_table: Sequence[str],
    ffn_table: Sequence[str],
    arch: str,
) -> dict[str, Any]:
    """The `mtp` draft section of an imported spec `data`: `count` modules whose decoder
    layer has the kinds of the target's last full-attention layer (DeepSeek-V3's MTP layer
    is built like its last layer; Qwen3-Next's is a full-attention MoE layer)."""
    kinds = data["attention_kinds"]
    full = [
        i for i, name in enumerate(attention_table) if kinds[name]["type"] in _SOFTMAX_ATTENTION
    ]
    if not full:
        raise SpecError(
            f"{data['name']}: the config has {count} multi-token-prediction layer(s) but no "
            "full-attention layer whose kind they could take; import without keep_mtp"
        )
    last = full[-1]
    section = {"kind": "mtp", "layers": count, "attention": attention_table[last],
               "ffn": ffn_table[last]}  # fmt: skip
    if arch.startswith("Qwen3Next"):  # vLLM's qwen3_next_mtp.py
        section |= {"mask_first_embedding": False, "chain": "normed"}
    return section
