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
from typing import Any

from mkgen.spec.quant import parse_format
from mkgen.spec.rope import inverse_sqrt
from mkgen.spec.schema import (
    DenseFFN,
    GatedDeltaNetAttention,
    GQAAttention,
    KDAAttention,
    LayerAssignment,
    MLAAttention,
    ModelSpec,
    MoEFFN,
    PlainMLP,
)

MINI_HIDDEN = 256
MINI_VOCAB = 512
MINI_HEAD_DIM = 32
MINI_MAX_HEADS = 4
MINI_FFN_WIDTH = 512
MINI_EXPERTS = 8
MINI_EXPERT_WIDTH = 64
MINI_LATENT = 128
MINI_RANK = 64
MINI_GATE_RANK = 16
MINI_WINDOW = 8
MINI_GROUP = 32  # largest quantization group in a twin
# fp8 blocks cut the columns too: they must divide a twin's per-core head slices (an MLA
# head of 32 nope + 16 rope dims is 48 columns).
MINI_FP8_BLOCK = 16


def _heads(count: int, shards: int, multiple_of: int = 1) -> int:
    """A few heads, a multiple of `multiple_of`, and divisible across `shards` cores."""
    small = max(multiple_of, min(count, MINI_MAX_HEADS) // multiple_of * multiple_of)
    return math.lcm(small, shards)


def _scaled_rotary(rotary_dim: int | None, head_dim: int, mini_head_dim: int) -> int | None:
    if rotary_dim is None:
        return None
    return max(2, rotary_dim * mini_head_dim // head_dim // 2 * 2)


def _mini_attention(kind: Any, shards: int) -> dict[str, Any]:
    data = kind.model_dump(mode="json")
    if isinstance(kind, GQAAttention):
        kv = min(kind.num_kv_heads, 2)
        ratio = min(kind.num_heads // kind.num_kv_heads, MINI_MAX_HEADS)
        head_dim = min(kind.head_dim, MINI_HEAD_DIM)
        data |= {
            "num_kv_heads": kv,
            "num_heads": math.lcm(kv * ratio, shards),
            "head_dim": head_dim,
        }
        if kind.rope:
            data["rope"]["rotary_dim"] = _scaled_rotary(
                kind.rope.rotary_dim, kind.head_dim, head_dim
            )
        if kind.sliding_window:
            data["sliding_window"] = min(kind.sliding_window, MINI_WINDOW)
        if kind.softmax_scale:
            data["softmax_scale"] = inverse_sqrt(head_dim)
    elif isinstance(kind, MLAAttention):
        rope = MINI_HEAD_DIM // 2
        q_lora, kv_lora = MINI_RANK, MINI_RANK
        # Where the full wq_a and wkv_a split over the cores, the twin's do too, so that it
        # can split them as the full-size build does (mkgen.plan.sharding.full_size_splits).
        if kind.q_lora_rank and kind.q_lora_rank % shards == 0:
            q_lora = -(-q_lora // shards) * shards
        if (kind.kv_lora_rank + kind.qk_rope_head_dim) % shards == 0:
            kv_lora = -(-(kv_lora + rope) // shards) * shards - rope
        data |= {
            "num_heads": _heads(kind.num_heads, shards),
            "q_lora_rank": q_lora if kind.q_lora_rank else None,
            "kv_lora_rank": kv_lora,
            "qk_nope_head_dim": MINI_HEAD_DIM,
            "qk_rope_head_dim": rope,
            "v_head_dim": MINI_HEAD_DIM,
        }
        if kind.rope and kind.rope.rotary_dim:
            data["rope"]["rotary_dim"] = MINI_HEAD_DIM // 2
        if kind.softmax_scale:
            data["softmax_scale"] = inverse_sqrt(MINI_HEAD_DIM * 3 // 2)
    elif isinstance(kind, KDAAttention):
        data |= {
            "num_heads": _heads(kind.num_heads, shards),
            "head_dim": MINI_HEAD_DIM,
            "decay_gate_rank": MINI_GATE_RANK,
            "output_gate_rank": MINI_GATE_RANK if kind.output_gate_rank else None,
        }
    else:
        assert isinstance(kind, GatedDeltaNetAttention)
        key_heads = _heads(kind.num_key_heads, shards)
        ratio = min(kind.num_value_heads // kind.num_key_heads, 3)
        data |= {
            "num_key_heads": key_heads,
            "num_value_heads": key_heads * ratio,
            "key_head_dim": MINI_HEAD_DIM,
            "value_head_dim": MINI_HEAD_DIM,
        }
    return data


def _mini_ffn(kind: Any, shards: int, shared_block: int = 0) -> dict[str, Any]:
    data = kind.model_dump(mode="json")
    if isinstance(kind, DenseFFN | PlainMLP):
        data["width"] = min(kind.width, MINI_FFN_WIDTH)
        return data
    assert isinstance(kind, MoEFFN)
    experts = min(kind.num_experts, MINI_EXPERTS)
    if kind.num_experts % shards == 0 and experts % shards:
        # As many whole columns per core as the full router has, so a twin can split its
        # router the way the full-size build does (mkgen.plan.sharding.full_size_splits).
        experts = -(-MINI_EXPERTS // shards) * shards
    router = data["router"]
    if kind.router.n_group > 1:
        router["n_group"] = min(kind.router.n_group, experts // 2)
        router["topk_group"] = max(1, min(kind.router.topk_group, router["n_group"] // 2))
    per_group = experts // router["n_group"]
    top_k = min(kind.top_k, 2, router["topk_group"] * per_group)
    # On many cores the experts also split by width: keep whole quantization blocks per core.
    width = MINI_EXPERT_WIDTH * max(1, shards // experts)
    data |= {"num_experts": experts, "top_k": top_k, "expert_width": width}
    if kind.shared_experts:
        shared = MINI_EXPERT_WIDTH * kind.shared_experts.count
        if shared_block:  # split over every core: whole quantization blocks on each
            shared = -(-shared // (shared_block * shards)) * shared_block * shards
        data["shared_experts"]["width"] = shared
    if kind.latent:
        data["latent"]["width"] = MINI_LATENT
    return data


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


def mini_twin(spec: ModelSpec, shards: int = 1) -> ModelSpec:
    """The small twin of `spec`; head counts are multiples of `shards` (test mesh cores)."""
    count = _mini_layer_count(spec)
    data = spec.model_dump(mode="json")
    data["name"] = f"{spec.name}-mini"
    # No kernel reads a drafter yet, so the twin (what verify runs) has none.
    data.pop("draft", None)
    data["description"] = f"mini twin of {spec.name} for CPU tests"
    dims = data["dims"]
    dims["hidden"], dims["vocab"] = MINI_HIDDEN, MINI_VOCAB
    if spec.dims.vocab_used is not None:
        # Keep padding rows in the twin: the used vocabulary stays a strict prefix.
        dims["vocab_used"] = MINI_VOCAB - max(
            1, MINI_VOCAB * (spec.dims.vocab - spec.dims.vocab_used) // spec.dims.vocab
        )
    data["attention_kinds"] = {
        name: _mini_attention(kind, shards) for name, kind in spec.attention_kinds.items()
    }
    shared_block = parse_format(_mini_format(spec.quantization.shared_experts)).block or 0
    data["ffn_kinds"] = {
        name: _mini_ffn(kind, shards, shared_block) for name, kind in spec.ffn_kinds.items()
    }
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
