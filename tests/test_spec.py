"""The spec language: loading, derived figures, mini twins and rejected inputs."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from cli_run import assert_user_error, mkgen, mkgen_here

from mkgen.errors import SpecError
from mkgen.spec.figures import (
    bytes_by_family,
    cache_bytes,
    cache_bytes_per_token,
    params_active,
    params_total,
    state_bytes_per_sequence,
)
from mkgen.spec.files import spec_from_dict, spec_to_dict
from mkgen.spec.loader import list_spec_names, load_spec
from mkgen.spec.mini import mini_twin
from mkgen.spec.quant import parse_format
from mkgen.spec.weights import ffn_weights, model_weights

# A small valid spec that every invalid case below breaks in exactly one place.
BASE: dict[str, Any] = {
    "name": "tiny",
    "dims": {"hidden": 64, "vocab": 128, "norm_eps": 1e-6},
    "attention_kinds": {
        "full": {"type": "gqa", "num_heads": 4, "num_kv_heads": 2, "head_dim": 16},
        "mla": {
            "type": "mla",
            "num_heads": 4,
            "q_lora_rank": None,
            "kv_lora_rank": 32,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
        },
    },
    "ffn_kinds": {
        "mlp": {"type": "dense", "width": 128, "activation": "silu"},
        "moe": {
            "type": "moe",
            "num_experts": 8,
            "top_k": 2,
            "expert_width": 32,
            "activation": "silu",
            "router": {"score": "softmax"},
        },
    },
    "layers": {
        "count": 4,
        "attention": {"default": "full", "rules": [{"kind": "mla", "every": 2, "offset": 1}]},
        "ffn": {"default": "moe", "rules": [{"kind": "mlp", "first": 1}]},
    },
}


def _with(path: str, value: Any) -> dict[str, Any]:
    """BASE with the value at a dotted path replaced (a '-' value deletes the key)."""
    data = copy.deepcopy(BASE)
    *parents, leaf = path.split(".")
    node = data
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if value == "-":
        del node[leaf]
    elif isinstance(node, list):
        node[int(leaf)] = value
    else:
        node[leaf] = value
    return data


def test_base_is_valid() -> None:
    spec = spec_from_dict(BASE)
    assert spec.attention_table() == ["full", "mla", "full", "mla"]
    assert spec.ffn_table() == ["mlp", "moe", "moe", "moe"]


def test_a_plain_mlp_kind_has_an_up_and_a_down_projection() -> None:
    spec = spec_from_dict(
        _with("ffn_kinds.mlp", {"type": "mlp", "width": 32, "activation": "silu"})
    )
    tensors = {w.name: w.shape for w in ffn_weights(spec.ffn_kinds["mlp"], spec.dims.hidden)}
    assert tensors == {"w_up": (spec.dims.hidden, 32), "w_down": (32, spec.dims.hidden)}


# (case id, broken spec, text the one-line error must contain)
INVALID_SPECS = [
    ("unknown-top-key", _with("colour", "blue"), "colour: unknown key"),
    ("unknown-nested-key", _with("dims.hiden", 64), "dims.hiden: unknown key"),
    ("hidden-wrong-type", _with("dims.hidden", "64"), "dims.hidden"),
    ("hidden-zero", _with("dims.hidden", 0), "dims.hidden: Input should be greater than 0"),
    ("vocab-negative", _with("dims.vocab", -5), "dims.vocab"),
    ("eps-zero", _with("dims.norm_eps", 0), "dims.norm_eps"),
    ("norm-style", _with("dims.norm_style", "layer"), "dims.norm_style"),
    ("vocab-used-too-big", _with("dims.vocab_used", 4096), "vocab_used 4096 exceeds vocab 128"),
    ("bad-name", _with("name", "Kimi K3!"), "name"),
    ("missing-dims", _with("dims", "-"), "dims: Field required"),
    (
        "heads-not-divisible",
        _with("attention_kinds.full.num_kv_heads", 3),
        "num_heads 4 is not a multiple of num_kv_heads 3",
    ),
    (
        "unknown-attention-type",
        _with("attention_kinds.full.type", "linear"),
        "attention_kinds.full",
    ),
    (
        "rotary-too-large",
        _with("attention_kinds.full.rope", {"theta": 1e4, "rotary_dim": 32}),
        "rotary_dim 32 exceeds head_dim 16",
    ),
    ("rotary-odd", _with("attention_kinds.full.rope", {"theta": 1e4, "rotary_dim": 5}), "even"),
    ("qk-norm-kind", _with("attention_kinds.full.qk_norm", "layernorm"), "qk_norm"),
    ("window-zero", _with("attention_kinds.full.sliding_window", 0), "sliding_window"),
    (
        "yarn-missing-factor",
        _with("attention_kinds.full.rope", {"theta": 1e4, "scaling": {"original_max_position": 8}}),
        "rope.scaling.factor: Field required",
    ),
    ("mla-kv-rank-zero", _with("attention_kinds.mla.kv_lora_rank", 0), "kv_lora_rank"),
    ("unknown-activation", _with("ffn_kinds.mlp.activation", "relu6"), "unknown activation"),
    (
        "plain-mlp-gated-activation",
        _with("ffn_kinds.mlp", {"type": "mlp", "width": 32, "activation": "situ"}),
        "ffn_kinds.mlp.activation: Input should be 'silu' or 'gelu_tanh'",
    ),
    (
        "activation-extra-param",
        _with("ffn_kinds.mlp.activation", {"kind": "silu", "limit": 7.0}),
        "activation silu takes no limit",
    ),
    ("top-k-too-big", _with("ffn_kinds.moe.top_k", 9), "top_k 9 exceeds num_experts 8"),
    ("router-score", _with("ffn_kinds.moe.router", {"score": "relu"}), "router.score"),
    (
        "n-group-not-dividing",
        _with("ffn_kinds.moe.router", {"score": "sigmoid", "n_group": 3}),
        "n_group 3 does not divide num_experts 8",
    ),
    (
        "topk-group-too-big",
        _with("ffn_kinds.moe.router", {"score": "sigmoid", "n_group": 2, "topk_group": 3}),
        "topk_group 3 exceeds n_group 2",
    ),
    ("layers-zero", _with("layers.count", 0), "layers.count"),
    (
        "pattern-does-not-cover",
        _with("layers.attention", {"rules": [{"kind": "mla", "every": 2, "offset": 1}]}),
        "layers.attention: layers 0, 2 have no kind",
    ),
    (
        "unknown-layer-kind",
        _with("layers.ffn.default", "sparse"),
        "layers.ffn: unknown kind 'sparse'",
    ),
    (
        "index-out-of-range",
        _with("layers.ffn.rules", [{"kind": "mlp", "indices": [0, 9]}]),
        "indices [9] are outside 0..3",
    ),
    (
        "two-selectors",
        _with("layers.ffn.rules", [{"kind": "mlp", "first": 1, "last": 1}]),
        "needs exactly one of every, indices, first, last",
    ),
    (
        "offset-too-big",
        _with("layers.attention.rules", [{"kind": "mla", "every": 2, "offset": 2}]),
        "offset 2 must be smaller than every 2",
    ),
    (
        "default-and-pattern",
        _with("layers.attention", {"default": "full", "pattern": ["full", "mla"]}),
        "either default or pattern",
    ),
    ("unknown-quant", _with("quantization", {"experts": "int3"}), "unknown weight format 'int3'"),
    ("quant-no-group", _with("quantization", {"experts": "int4"}), "int4 needs a group size"),
    (
        "quant-bad-group",
        _with("quantization", {"experts": "int4:100"}),
        "must be a power of two",
    ),
    ("quant-unknown-family", _with("quantization", {"moe": "int8"}), "quantization.moe"),
    (
        "latent-too-wide",
        _with("ffn_kinds.moe.latent", {"width": 64, "norm": True}),
        "latent.width 64 must be below hidden 64",
    ),
    (
        "kda-gate-bound-positive",
        _with(
            "attention_kinds.full",
            {
                "type": "kda",
                "num_heads": 4,
                "head_dim": 16,
                "conv_width": 4,
                "decay_gate_rank": 8,
                "gate_lower_bound": 5.0,
            },
        ),
        "gate_lower_bound 5.0 must be negative",
    ),
    (
        "deltanet-heads",
        _with(
            "attention_kinds.full",
            {
                "type": "gated_deltanet",
                "num_key_heads": 3,
                "num_value_heads": 4,
                "key_head_dim": 16,
                "value_head_dim": 16,
                "conv_width": 4,
            },
        ),
        "num_value_heads 4 is not a multiple of num_key_heads 3",
    ),
    ("no-ffn-kinds", _with("ffn_kinds", {}), "define at least one kind"),
    (
        "kind-name-too-long",
        _with("ffn_kinds", {"m" * 65: BASE["ffn_kinds"]["mlp"]}),
        "kind name 'mmmmmmmmmmmmmmmm'... has 65 characters, over 64",
    ),
]


@pytest.mark.parametrize(
    ("data", "expected"), [c[1:] for c in INVALID_SPECS], ids=[c[0] for c in INVALID_SPECS]
)
def test_invalid_spec_is_a_one_line_error_naming_the_field(data: dict, expected: str) -> None:
    with pytest.raises(SpecError) as info:
        spec_from_dict(data, "tiny.yaml")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("tiny.yaml")
    assert expected in message, message


def test_there_are_at_least_thirty_invalid_cases() -> None:
    assert len(INVALID_SPECS) >= 30


def test_malformed_yaml_names_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ndims: {hidden: 3\n")
    with pytest.raises(SpecError, match=r"bad.yaml: malformed YAML at line \d+"):
        load_spec(bad)


def test_yaml_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(SpecError, match="expected a mapping at the top level"):
        load_spec(bad)


def test_missing_spec_file_and_unknown_name() -> None:
    with pytest.raises(SpecError, match="no such file"):
        load_spec("does/not/exist.yaml")
    with pytest.raises(SpecError, match="unknown spec 'nope'.*kimi-k3"):
        load_spec("nope")


# ------------------------------------------------------------------ checked-in specs


def test_every_checked_in_spec_loads_and_round_trips() -> None:
    names = list_spec_names()
    assert {"kimi-k3", "qwen3.8-27b", "muse-spark-1.2"} <= set(names)
    for name in names:
        spec = load_spec(name)
        assert spec.name == name
        assert spec_from_dict(spec_to_dict(spec)) == spec


@pytest.mark.parametrize(
    ("name", "total", "active", "vocab_counted"),
    [
        ("kimi-k3", 2.8e12, 104e9, True),
        ("qwen3.8-27b", 27e9, 27e9, True),
        # Its checkpoint's name, 816B-A42B, counts without the embedding and lm_head (the
        # attention output gate included: mkgen/model_specs/muse-spark-1.2.yaml).
        ("muse-spark-1.2", 816e9, 42e9, False),
    ],
)
def test_parameter_counts_of_showcase_models(
    name: str, total: float, active: float, vocab_counted: bool
) -> None:
    spec = load_spec(name)
    vocab = 0 if vocab_counted else 2 * spec.dims.vocab * spec.dims.hidden
    assert params_total(spec) - vocab == pytest.approx(total, rel=0.02)
    assert params_active(spec) - vocab == pytest.approx(active, rel=0.02)


def test_kimi_k3_layer_table() -> None:
    spec = load_spec("kimi-k3")
    mla = [i for i, kind in enumerate(spec.attention_table()) if kind == "mla"]
    assert mla == [*range(3, 92, 4), 92]
    assert len(mla) == 24
    assert spec.ffn_table()[0] == "dense" and set(spec.ffn_table()[1:]) == {"moe"}


def test_qwen38_and_muse_spark_layer_tables() -> None:
    qwen = load_spec("qwen3.8-27b")
    assert [i for i, k in enumerate(qwen.attention_table()) if k == "full"] == list(range(3, 64, 4))
    muse = load_spec("muse-spark-1.2")
    globals_ = [i for i, k in enumerate(muse.attention_table()) if k == "global"]
    assert globals_ == [i for i in range(62) if i % 4 == 1] and len(globals_) == 16


def test_bytes_by_family_follow_formats() -> None:
    spec = load_spec("kimi-k3")
    families = bytes_by_family(spec)
    experts_params = sum(w.numel for w in model_weights(spec) if w.family == "experts")
    # MXFP4: half a byte per weight plus one scale byte per 32.
    assert families["experts"] == pytest.approx(experts_params * (0.5 + 1 / 32), rel=1e-6)
    attention_params = sum(w.numel for w in model_weights(spec) if w.family == "attention")
    assert families["attention"] == 2 * attention_params


@pytest.mark.parametrize(
    ("text", "fan_in", "fan_out", "expected"),
    [
        ("bf16", 128, 64, 128 * 64 * 2),
        ("int8", 128, 64, 128 * 64 + 4 * 64),
        ("int4:32", 128, 64, 128 * 64 // 2 + 2 * 4 * 64),
        ("fp8:128", 256, 128, 256 * 128 + 4 * 2 * 1),
        ("mxfp4", 64, 10, 64 * 10 // 2 + 2 * 10),
        ("nvfp4", 64, 10, 64 * 10 // 2 + 4 * 10 + 4),
    ],
)
def test_format_bytes(text: str, fan_in: int, fan_out: int, expected: int) -> None:
    assert parse_format(text).matrix_bytes(fan_in, fan_out) == expected


def test_cache_figures() -> None:
    k3 = load_spec("kimi-k3")
    # MLA latent (512) + rope key (64) in bf16 on 24 layers; KDA layers add no per-token cache.
    assert cache_bytes_per_token(k3) == {"kv": 0, "mla_latent": 24 * 576 * 2, "total": 24 * 1152}
    # 69 KDA layers: f32 state 96x128x128 plus three bf16 conv tails of 3 taps.
    per_kda = 96 * 128 * 128 * 4 + 3 * 3 * 96 * 128 * 2
    assert state_bytes_per_sequence(k3) == 69 * per_kda
    muse = load_spec("muse-spark-1.2")
    per_layer = 2 * 16 * 64 * 2
    assert cache_bytes_per_token(muse)["kv"] == 62 * per_layer
    # Sliding-window layers stop growing at 2048 tokens.
    assert cache_bytes(muse, 4096) == per_layer * (16 * 4096 + 46 * 2048)


# ------------------------------------------------------------------ mini twins


@pytest.mark.parametrize("name", ["kimi-k3", "qwen3.8-27b", "muse-spark-1.2"])
@pytest.mark.parametrize("shards", [1, 8, 32])
def test_mini_twin_keeps_every_feature(name: str, shards: int) -> None:
    spec = load_spec(name)
    mini = mini_twin(spec, shards)
    assert mini == mini_twin(spec, shards)  # deterministic
    assert mini.dims.hidden <= 512 and mini.dims.vocab <= 1024
    assert params_total(mini) < 50e6
    assert set(mini.layer_table()) == set(spec.layer_table())
    assert mini.layers.count < spec.layers.count
    for kind_name, kind in spec.attention_kinds.items():
        small = mini.attention_kinds[kind_name]
        assert small.type == kind.type
        for flag in ("rope", "qk_norm", "output_gate", "sinks", "qkv_bias", "q_lora_rank"):
            if hasattr(kind, flag):
                assert (getattr(small, flag) is None) == (getattr(kind, flag) is None), flag
        heads = getattr(small, "num_heads", None) or small.num_key_heads
        assert heads % shards == 0
    for kind_name, kind in spec.ffn_kinds.items():
        small = mini.ffn_kinds[kind_name]
        assert small.activation == kind.activation
        if kind.type == "moe":
            assert small.router.model_dump(exclude={"n_group", "topk_group"}) == (
                kind.router.model_dump(exclude={"n_group", "topk_group"})
            )
            assert (small.latent is None) == (kind.latent is None)
            assert (small.shared_experts is None) == (kind.shared_experts is None)
            if kind.num_experts % shards == 0:  # its router can split as the full one does
                assert small.num_experts % shards == 0
    assert (mini.attention_residual is None) == (spec.attention_residual is None)
    assert [
        parse_format(getattr(mini.quantization, f)).kind
        for f in type(mini.quantization).model_fields
    ] == [
        parse_format(getattr(spec.quantization, f)).kind
        for f in type(spec.quantization).model_fields
    ]


def test_kimi_k3_mini_twin_exercises_every_rule() -> None:
    mini = mini_twin(load_spec("kimi-k3"))
    # Dense first layer, MLA at 3 and 7 (every 4th, twice) and the final layer 8.
    assert mini.layers.count == 9
    assert [i for i, k in enumerate(mini.attention_table()) if k == "mla"] == [3, 7, 8]
    assert mini.ffn_table()[0] == "dense"
    assert mini.attention_residual is not None and mini.attention_residual.block_size == 2


# ------------------------------------------------------------------ refused spec files

# A small valid spec in YAML, one key a line, so that each case below changes one line.
TINY_YAML = """\
name: tiny
dims:
  hidden: 64
  vocab: 128
  norm_eps: 1.0e-06
  tie_embeddings: false
attention_kinds:
  full: {type: gqa, num_heads: 4, num_kv_heads: 2, head_dim: 16, rope: {theta: 10000.0}}
  mla:
    type: mla
    num_heads: 4
    q_lora_rank: null
    kv_lora_rank: 32
    qk_nope_head_dim: 16
    qk_rope_head_dim: 8
    v_head_dim: 16
    rope: {theta: 10000.0}
ffn_kinds:
  moe:
    type: moe
    num_experts: 8
    top_k: 2
    expert_width: 32
    activation: silu
    router: {score: softmax}
layers:
  count: 4
  attention: {default: full}
  ffn: {default: moe}
"""


def _tiny(old: str, new: str) -> str:
    assert TINY_YAML.count(old) == 1, old
    return TINY_YAML.replace(old, new)


def _nested(levels: int) -> str:
    return TINY_YAML + "colour: " + "[" * levels + "]" * levels + "\n"


# (case id, spec text, fragments of the one-line error; each names the field or place)
REFUSED_SPEC_FILES = [
    ("duplicate-key", _tiny("    top_k: 2\n", "    top_k: 2\n    top_k: 1\n"),
     ("ffn_kinds.moe: duplicate key 'top_k'",)),
    ("sexagesimal", _tiny("hidden: 64", "hidden: 34:08"),
     ("dims.hidden: '34:08' is a base-60 number in YAML 1.1",)),
    ("yes-for-bool", _tiny("tie_embeddings: false", "tie_embeddings: yes"),
     ("dims.tie_embeddings: 'yes' is a boolean in YAML 1.1",)),
    ("off-for-string", _tiny("attention: {default: full}", "attention: {default: off}"),
     ("layers.attention.default: 'off' is a boolean",)),
    ("leading-zero-octal", _tiny("num_heads: 4, num_kv", "num_heads: 010, num_kv"),
     ("attention_kinds.full.num_heads: '010' is an octal",)),
    ("0o-octal", _tiny("vocab: 128", "vocab: 0o200"), ("dims.vocab: '0o200' is an octal",)),
    ("hexadecimal", _tiny("vocab: 128", "vocab: 0x80"), ("dims.vocab: '0x80'",)),
    ("explicit-int-tag", _tiny("vocab: 128", "vocab: !!int 0x80"),
     ("dims.vocab: '0x80': write integers in decimal",)),
    ("underscores", _tiny("vocab: 128", "vocab: 1_28"),
     ("dims.vocab: '1_28' is a number with underscores",)),
    ("5000-digit-integer", _tiny("hidden: 64", "hidden: " + "9" * 5000),
     ("dims.hidden: an integer of 5000 digits",)),
    ("1e29-experts", _tiny("num_experts: 8", "num_experts: 1" + "0" * 29),
     ("ffn_kinds.moe.num_experts: an integer of 30 digits",)),
    ("1e12-experts", _tiny("num_experts: 8", "num_experts: 1000000000000"),
     ("ffn_kinds.moe.num_experts: Input should be less than or equal to 65536", "#bounds")),
    ("layers-beyond-smem", _tiny("count: 4", "count: 100000"), ("layers.count", "16384")),
    ("vocab-beyond-int32", _tiny("vocab: 128", "vocab: 4294967296"), ("dims.vocab", "2147483648")),
    ("hidden-beyond-vmem", _tiny("hidden: 64", "hidden: 33554432"), ("dims.hidden", "16777216")),
    ("window-beyond-positions", _tiny("head_dim: 16,", "head_dim: 16, sliding_window: 33554432,"),
     ("attention_kinds.full.sliding_window", "16777216")),
    ("inf-norm-eps", _tiny("norm_eps: 1.0e-06", "norm_eps: .inf"),
     ("dims.norm_eps: Input should be a finite number",)),
    ("nan-softcap", _tiny("tie_embeddings: false", "logit_softcap: .nan"),
     ("dims.logit_softcap: Input should be a finite number",)),
    ("inf-rope-theta", _tiny("rope: {theta: 10000.0}}", "rope: {theta: .inf}}"),
     ("attention_kinds.full.rope.theta: Input should be a finite number",)),
    ("odd-head-dim-full-rope", _tiny("head_dim: 16,", "head_dim: 127,"),
     ("attention_kinds.full: rope rotates the whole head_dim 127, which is odd",)),
    ("odd-mla-rope-dim", _tiny("qk_rope_head_dim: 8", "qk_rope_head_dim: 7"),
     ("attention_kinds.mla: qk_rope_head_dim 7 must be even",)),
    ("rule-first-beyond-count",
     _tiny("ffn: {default: moe}", "ffn: {default: moe, rules: [{kind: moe, first: 100}]}"),
     ("layers.ffn.rules[0]: first 100 exceeds the 4 layers",)),
    ("rule-last-beyond-count",
     _tiny("ffn: {default: moe}", "ffn: {default: moe, rules: [{kind: moe, last: 5}]}"),
     ("layers.ffn.rules[0]: last 5 exceeds the 4 layers",)),
    ("rule-every-beyond-count",
     _tiny("ffn: {default: moe}",
           "ffn: {default: moe, rules: [{kind: moe, every: 1000, offset: 500}]}"),
     ("layers.ffn.rules[0]: every 1000 exceeds the 4 layers",)),
    ("nul-byte", _tiny("vocab: 128", "vocab: 1\x0028"),
     (f"character U+0000 at offset {TINY_YAML.index('vocab: 128') + 8} is not allowed in YAML;"
      " remove it",)),
    ("long-description", TINY_YAML + "description: " + "x" * 4097 + "\n",
     ("description: String should have at most 4096 characters", "#bounds")),
    ("huge-file", TINY_YAML + "description: |\n" + ("  " + "x" * 1022 + "\n") * 1100,
     ("over 1 MiB, far more than any spec or config.json",)),
    ("long-kind-name", _tiny("ffn: {default: moe}", "ffn: {default: " + "m" * 1000 + "}"),
     ("layers.ffn.default: String should have at most 64 characters",)),
    ("long-format", TINY_YAML + "quantization: {experts: " + "int4" * 100 + "}\n",
     ("quantization.experts: String should have at most 64 characters",)),
    ("deep-nesting", _nested(3000), ("nested more than 32 levels deep",)),
    ("nesting-just-too-deep", _nested(40), ("nested more than 32 levels deep",)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "fragments"),
    [c[1:] for c in REFUSED_SPEC_FILES],
    ids=[c[0] for c in REFUSED_SPEC_FILES],
)
def test_refused_spec_file_is_one_line_naming_the_field(
    tmp_path: Path, text: str, fragments: tuple[str, ...]
) -> None:
    path = tmp_path / "tiny.yaml"
    path.write_text(text)
    assert_user_error(mkgen_here("show", str(path)), "tiny.yaml: ", *fragments)


def test_tiny_yaml_is_valid_so_each_refusal_is_its_own_change(tmp_path: Path) -> None:
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY_YAML + "description: '34:08, yes, 010'\n")
    spec = load_spec(path)
    assert (spec.dims.hidden, spec.ffn_kinds["moe"].top_k) == (64, 2)
    assert spec.description == "34:08, yes, 010"  # quoted, they are plain strings


@pytest.mark.parametrize(
    ("encoded", "fragment"),
    [
        (TINY_YAML.encode("utf-16"), "byte 0xff at offset 0"),
        (TINY_YAML.replace("tiny", "caf\u00e9", 1).encode("latin-1"), "byte 0xe9 at offset 9"),
    ],
    ids=["utf-16", "latin-1"],
)
def test_a_spec_that_is_not_utf8_is_one_line(tmp_path: Path, encoded: bytes, fragment: str) -> None:
    path = tmp_path / "tiny.yaml"
    path.write_bytes(encoded)
    assert_user_error(mkgen_here("show", str(path)), "tiny.yaml: not UTF-8 text", fragment)


def test_a_path_that_is_not_one_line_is_refused_before_it_reaches_a_message(
    tmp_path: Path,
) -> None:
    path = tmp_path / "tiny\nname: injected.yaml"
    path.write_text(TINY_YAML)
    assert_user_error(mkgen_here("show", str(path)), "the path is not one printable line")


def test_billion_laughs_yaml_is_refused_quickly(tmp_path: Path) -> None:
    # Nine levels of nine aliases each: 9**9 strings if anything expanded them.
    lines = ["description:", "  - &a [" + ", ".join(["lol"] * 9) + "]"]
    for previous, name in zip("abcdefgh", "bcdefghi", strict=True):
        lines.append(f"  - &{name} [" + ", ".join([f"*{previous}"] * 9) + "]")
    path = tmp_path / "laughs.yaml"
    path.write_text(TINY_YAML + "\n".join(lines) + "\n")
    result = mkgen("show", str(path), timeout=30)
    assert_user_error(result, "laughs.yaml: description: Input should be a valid string")


def test_the_smem_bounds_fit_together_on_every_chip() -> None:
    # The kernel's SMEM tables at their bounds: the experts' seen flags, six int32 per
    # layer, a 128-lane int32 row of expert ids per token row.
    from mkgen.hardware import CATALOG
    from mkgen.plan.options import MAX_TOKEN_ROWS
    from mkgen.spec.schema import MAX_EXPERTS, MAX_LAYERS

    tables = 4 * (MAX_EXPERTS + 6 * MAX_LAYERS + 128 * MAX_TOKEN_ROWS)
    assert tables <= min(chip.smem_bytes_per_core for chip in CATALOG.values())
