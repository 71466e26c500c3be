"""The mini twin of a spec: the same architecture at sizes a CPU can run.

A mini twin keeps every feature (each attention and FFN kind with all its
options, routing rules, quantization formats, the attention residual) and the
same layer-table rules, and shrinks every size: hidden 256, vocabulary 512, a
few heads and experts, and just enough layers that every (attention, FFN) pair
of the full model appears, every `every` rule fires at least twice, every
pattern repeats and no rule is redundant. It is a pure function of the spec
(and of the number of shards a test mesh splits heads over), so it is
deterministic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from mkgen.spec.quant import parse_format
from mkgen.spec.rope import inverse_sqrt
from mkgen.spec.schema import BlockDraft, LayerAssignment, ModelDraft, ModelSpec

MINI_HIDDEN = 256
MINI_VOCAB = 512
MINI_GROUP = 32  # largest quantization group in a twin
# fp8 blocks cut the columns too: they must divide a twin's per-core head slices (an MLA
# head of 32 nope + 16 rope dims is 48 columns).
MINI_FP8_BLOCK = 16


@dataclass(frozen=True)
class Shrink:
    """What a kind's mini rule (its schema class's `mini`, mkgen/spec/schema.py) reads: the
    twin's sizes, the cores a test mesh splits heads over, and the quantization block the
    shared experts keep whole on each core (0: none)."""

    HEAD_DIM: ClassVar[int] = 32
    MAX_HEADS: ClassVar[int] = 4
    FFN_WIDTH: ClassVar[int] = 512
    EXPERTS: ClassVar[int] = 8
    EXPERT_WIDTH: ClassVar[int] = 64
    LATENT: ClassVar[int] = 128
    RANK: ClassVar[int] = 64
    GATE_RANK: ClassVar[int] = 16
    WINDOW: ClassVar[int] = 8

    shards: int
    shared_block: int = 0

    def heads(self, count: int, multiple_of: int = 1) -> int:
        """A few heads, a multiple of `multiple_of`, and divisible across the shards."""
        small = max(multiple_of, min(count, self.MAX_HEADS) // multiple_of * multiple_of)
        return math.lcm(small, self.shards)

    @staticmethod
    def scaled_rotary(rotary_dim: int | None, head_dim: int, mini_head_dim: int) -> int | None:
        """A rotary width scaled as the head is (whole pairs, at least one)."""
        if rotary_dim is None:
            return None
        return max(2, rotary_dim * mini_head_dim // head_dim // 2 * 2)

    @staticmethod
    def inverse_sqrt(n: float) -> float:
        """1 / sqrt(n) rounded once (mkgen.spec.rope.inverse_sqrt)."""
        return inverse_sqrt(n)


def _restricted(assignment: LayerAssignment, count: int) -> dict[str, Any]:
    """The same rules for a shorter model: explicit indices past the end are dropped."""
    data = assignment.model_dump(mode="json", exclude_defaults=True)
    rules = []
    for rule in data.get("rules", []):
        if "indices" in rule:
            rule["indices"] = [i for i in rule["indices"] if i < count]
            if not rule["indices"]:
                continue
        rules.append(rule)
    data["rules"] = rules
    return data


def _good_layer_count(spec: ModelSpec, count: int) -> bool:
    """Whether `count` layers show every kind pair, repeat every rule and pattern."""
    for section in ("attention", "ffn"):
        assignment: LayerAssignment = getattr(spec.layers, section)
        if assignment.pattern and count < 2 * len(assignment.pattern):
            return False
        restricted = LayerAssignment.model_validate(_restricted(assignment, count))
        try:
            table = restricted.expand(count, section)
        except ValueError:
            return False  # dropping out-of-range indices left layers uncovered
        for n, rule in enumerate(restricted.rules):
            if rule.every is not None and len(rule.selects(count)) < 2:
                return False
            others = restricted.model_copy(update={"rules": restricted.rules[:n]})
            try:
                before = others.expand(count, section)
            except ValueError:
                continue  # the rule covers layers nothing else does: it is needed
            if before == table:
                return False  # the rule changes nothing at this count
    return True


def _mini_layer_count(spec: ModelSpec) -> int:
    pairs = set(spec.layer_table())
    for count in range(2, spec.layers.count):
        if not _good_layer_count(spec, count):
            continue
        restricted = {
            s: LayerAssignment.model_validate(_restricted(getattr(spec.layers, s), count))
            for s in ("attention", "ffn")
        }
        table = set(
            zip(
                restricted["attention"].expand(count, "attention"),
                restricted["ffn"].expand(count, "ffn"),
                strict=True,
            )
        )
        if table == pairs:
            return count
    return spec.layers.count


def _mini_format(text: str) -> str:
    kind, _, group = text.partition(":")
    largest = MINI_FP8_BLOCK if kind == "fp8" else MINI_GROUP
    return f"{kind}:{min(int(group), largest)}" if group else text


def _mini_draft(spec: ModelSpec, count: int, shrink: Shrink) -> dict[str, Any]:
    """The twin's draft section: the same drafter at the twin's sizes. A block drafter's
    feature layers keep their places in the shorter model (the first and the last stay
    first and last), each once."""
    draft = spec.draft
    assert draft is not None
    if isinstance(draft, ModelDraft):
        return {
            "kind": "model",
            "model": mini_twin(draft.model, shrink.shards).model_dump(mode="json"),
        }
    data = draft.model_dump(mode="json")
    if isinstance(draft, BlockDraft):
        last = max(spec.layers.count - 1, 1)
        layers = [round(i * (count - 1) / last) for i in draft.feature_layers]
        data |= {
            "hidden": MINI_HIDDEN,
            "attention": draft.attention.mini(shrink),
            "ffn": draft.ffn.mini(shrink),
            "feature_layers": list(dict.fromkeys(layers)),
            "mask_token": min(draft.mask_token, MINI_VOCAB - 1),
        }
        if draft.draft_vocab is not None:
            data["draft_vocab"] = min(draft.draft_vocab, MINI_VOCAB)
    return data


def mini_twin(spec: ModelSpec, shards: int = 1) -> ModelSpec:
    """The small twin of `spec`; head counts are multiples of `shards` (test mesh cores)."""
    count = _mini_layer_count(spec)
    data = spec.model_dump(mode="json")
    data["name"] = f"{spec.name}-mini"
    if spec.draft is not None:  # the kernel writes the hidden states the drafter reads
        data["draft"] = _mini_draft(spec, count, Shrink(shards))
    data["description"] = f"mini twin of {spec.name} for CPU tests"
    dims = data["dims"]
    dims["hidden"], dims["vocab"] = MINI_HIDDEN, MINI_VOCAB
    if spec.dims.vocab_used is not None:
        # Keep padding rows in the twin: the used vocabulary stays a strict prefix.
        dims["vocab_used"] = MINI_VOCAB - max(
            1, MINI_VOCAB * (spec.dims.vocab - spec.dims.vocab_used) // spec.dims.vocab
        )
    shared_block = parse_format(_mini_format(spec.quantization.shared_experts)).block or 0
    shrink = Shrink(shards, shared_block)
    data["attention_kinds"] = {name: k.mini(shrink) for name, k in spec.attention_kinds.items()}
    data["ffn_kinds"] = {name: k.mini(shrink) for name, k in spec.ffn_kinds.items()}
    data["layers"] = {
        "count": count,
        "attention": _restricted(spec.layers.attention, count),
        "ffn": _restricted(spec.layers.ffn, count),
    }
    if spec.attention_residual:
        data["attention_residual"] = {
            "block_size": 2,
            "max_snapshots": min(spec.attention_residual.max_snapshots, 3),
        }
    data["quantization"] = {k: _mini_format(v) for k, v in data["quantization"].items()}
    return ModelSpec.model_validate(data)
