"""The per-core memory layout a generated kernel reads: weight stream, vectors, caches.

Everything here is plain data (pydantic) that code generation renders and the
generated runner uses to pack weights; no template computes a shape.

Weight stream. Every dense matrix a core reads in a step is a *segment* of one
HBM array of uniform banks ``[n_banks, BANK_ROWS, LANES]`` in execution order:
layer 0's attention segments, layer 0's FFN segments, layer 1's, ..., the
lm_head. A segment holds a per-rank matrix ``[K, N]`` (several inventory tensors
fused along N where they share an input, e.g. q|k|v) padded to
``[k_chunks * CHUNK, col_blocks * LANES]`` and stored column-block-major: the
CHUNK-row chunks of column block 0, then of block 1, ... Each segment starts on
a bank boundary. The kernel keeps a ring of ``ring_depth`` banks in VMEM and,
after consuming bank g, starts the DMA of bank g + ring_depth, wherever it
lies: the stream crosses layer boundaries and runs into the lm_head.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from mkgen.plan.options import BuildOptions
from mkgen.plan.sharding import ShardingPlan, TensorShard
from mkgen.spec.schema import DenseFFN, GQAAttention, ModelSpec
from mkgen.spec.topology import Topology

LANES = 256  # column block width: TPU7x's MXU is 256 wide
CHUNK = 256  # rows of one matmul step within a bank
SUBLANES_F32 = 8
CACHE_ALIGN = 16  # bf16 rows of an HBM array are tiled by 16


class PlanModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


class Part(PlanModel):
    """A slice of one inventory tensor that a core stores.

    The tensor (named relative to its layer, e.g. ``attn.wq``) is cut along
    ``axis`` (-1: fan_out / columns, -2: fan_in / rows, None: the whole tensor)
    into pieces of ``size``; rank r takes piece ``r // rank_divisor`` (a divisor
    above 1 replicates a piece over consecutive ranks, as for KV heads shared by
    several cores).
    """

    tensor: str
    axis: Literal[-1, -2] | None
    size: int
    rank_divisor: int = 1


class Segment(PlanModel):
    """One per-rank matrix (or fused group) in the weight stream."""

    name: str
    parts: list[Part]  # fused along N in this order (one part when split by rows)
    fan_in: int
    fan_out: int
    k_chunks: int
    col_blocks: int
    bank_offset: int  # first bank, relative to the start of its layer (or of the tail)
    banks: int

    @property
    def chunks(self) -> int:
        return self.k_chunks * self.col_blocks


class VectorRow(PlanModel):
    """A small per-layer vector (norm weight, bias, sinks) in the layer's vector slab."""

    name: str
    row: int
    part: Part
    length: int


class Rope(PlanModel):
    """Rotary tables the wrapper builds in XLA: cos/sin of positions x inv_freq."""

    rotary_dim: int
    inv_freq: list[float]
    attention_factor: float  # YaRN's cos/sin multiplier (1.0 without YaRN)
    interleaved: bool


class GQALayout(PlanModel):
    type: Literal["gqa"] = "gqa"
    name: str
    index: int  # position among the model's attention kinds (the layer table's code)
    layers: list[int]  # model layers of this kind, in order (cache slot = position here)
    heads: int  # q heads on each core
    kv_heads: int  # kv heads on each core (replicated when fewer than cores)
    kv_rank_divisor: int  # consecutive cores sharing one kv head (1: not replicated)
    group: int  # q heads per kv head
    head_dim: int
    q_cols: int
    kv_cols: int
    gate: bool
    qk_norm: Literal["none", "rms", "rms_noparam"]
    sinks: bool
    qkv_bias: bool
    o_bias: bool
    window: int | None
    softmax_scale: float
    rope: Rope | None
    segments: list[Segment]  # qkv (q | k | v | gate), o
    vectors: list[VectorRow]
    kv_tile: int  # cache tokens per streamed tile


class DenseLayout(PlanModel):
    type: Literal["dense"] = "dense"
    name: str
    index: int
    layers: list[int]
    width: int  # per core
    gated: bool
    activation: str
    activation_params: dict[str, float]
    bias: bool
    segments: list[Segment]  # gate_up (gate | up), down
    vectors: list[VectorRow]


class KernelLayout(PlanModel):
    """Everything the megakernel template and the packer need for one build."""

    model: str
    topology: str
    devices: int
    batch: int
    rows: int
    tokens: int  # batch * rows
    tokens_padded: int
    context: int  # cache tokens per sequence
    cache_block: int  # cache rows rewritten around a step's new entries (tile-aligned)
    hidden: int
    hidden_chunks: int
    vocab: int
    vocab_used: int
    vocab_per_core: int
    norm_eps: float
    zero_centered: bool
    logit_multiplier: float
    logit_softcap: float | None
    bank_rows: int
    ring_depth: int
    attention: list[GQALayout]
    ffn: list[DenseLayout]
    attention_table: list[int]  # kind index of every layer
    ffn_table: list[int]
    attention_slot: list[int]  # position of every layer among layers of its kind
    ffn_slot: list[int]
    attention_banks: list[int]  # first stream bank of each layer's attention segments
    ffn_banks: list[int]  # first stream bank of each layer's FFN segments
    lm_head_bank: int  # first bank of the tail (lm_head)
    tail_segments: list[Segment]  # lm_head
    total_banks: int
    vector_rows: int
    vector_width: int
    final_norm: Part
    max_k_chunks: int
    max_col_blocks: int


# ---------------------------------------------------------------- building a layout


def _segment(
    name: str, parts: list[Part], fan_in: int, fan_out: int, offset: int, bank_rows: int
) -> Segment:
    k_chunks = cdiv(fan_in, CHUNK)
    col_blocks = cdiv(fan_out, LANES)
    banks = cdiv(k_chunks * col_blocks, bank_rows // CHUNK)
    return Segment(
        name=name,
        parts=parts,
        fan_in=fan_in,
        fan_out=fan_out,
        k_chunks=k_chunks,
        col_blocks=col_blocks,
        bank_offset=offset,
        banks=banks,
    )


class _Rows:
    """Hands out consecutive rows of a vector slab."""

    def __init__(self, first: int) -> None:
        self.next = first

    def take(self, name: str, part: Part, length: int) -> VectorRow:
        row = VectorRow(name=name, row=self.next, part=part, length=length)
        self.next += 1
        return row


def _unsupported(what: str) -> None:
    from mkgen.errors import SpecError

    raise SpecError(f"{what} is not supported by the code generator yet")


def part_of(shard: TensorShard, devices: int) -> Part:
    """A core's piece of a tensor, as the sharding plan split it."""
    if shard.split_axis is None:
        return Part(tensor=shard.name, axis=None, size=shard.global_shape[-1])
    axis = shard.split_axis - len(shard.global_shape)
    return Part(
        tensor=shard.name,
        axis=axis,
        size=shard.global_shape[shard.split_axis] // shard.parts,
        rank_divisor=devices // shard.parts,
    )


def _rope_layout(rope: object, rotary_dim: int) -> Rope:
    from mkgen.spec.rope import rope_frequencies

    inv_freq, factor = rope_frequencies(rope, rotary_dim)
    return Rope(
        rotary_dim=rotary_dim,
        inv_freq=[float(f) for f in inv_freq],
        attention_factor=float(factor),
        interleaved=rope.interleaved,
    )


def _gqa_layout(name, index, layers, kind, shard, devices, hidden, context, bank_rows) -> GQALayout:
    parts = {t.name: part_of(t, devices) for t in shard.tensors}
    heads, kv_heads = shard.heads_per_rank, shard.kv_heads_per_rank
    d = kind.head_dim
    q_cols, kv_cols = heads * d, kv_heads * d
    fused = ["attn.wq", "attn.wk", "attn.wv"] + (
        ["attn.wgate"] if kind.output_gate == "sigmoid" else []
    )
    qkv_parts = [parts[n] for n in fused]
    qkv = _segment("qkv", qkv_parts, hidden, sum(p.size for p in qkv_parts), 0, bank_rows)
    o = _segment("o", [parts["attn.wo"]], q_cols, hidden, qkv.banks, bank_rows)
    rows = _Rows(2)  # rows 0 and 1 hold the layer's attn_norm and ffn_norm
    vectors = [
        rows.take(n.removeprefix("attn."), parts[n], parts[n].size)
        for n in (
            "attn.q_norm",
            "attn.k_norm",
            "attn.bq",
            "attn.bk",
            "attn.bv",
            "attn.bo",
            "attn.sinks",
        )
        if n in parts
    ]
    kv_tile = min(context, 128)
    if context % kv_tile:
        from mkgen.errors import SpecError

        raise SpecError(f"--context {context} must be a multiple of the {kv_tile}-token KV tile")
    return GQALayout(
        name=name,
        index=index,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        kv_rank_divisor=parts["attn.wk"].rank_divisor,
        group=heads // kv_heads,  # q heads per kv head on a core
        head_dim=d,
        q_cols=q_cols,
        kv_cols=kv_cols,
        gate=kind.output_gate == "sigmoid",
        qk_norm=kind.qk_norm,
        sinks=kind.sinks,
        qkv_bias=kind.qkv_bias,
        o_bias=kind.o_bias,
        window=kind.sliding_window,
        softmax_scale=kind.softmax_scale or d**-0.5,
        rope=_rope_layout(kind.rope, kind.rotary_dim) if kind.rope else None,
        segments=[qkv, o],
        vectors=vectors,
        kv_tile=kv_tile,
    )


def _dense_layout(name, index, layers, kind, shard, devices, hidden, bank_rows) -> DenseLayout:
    if kind.bias or not kind.gated:
        _unsupported(f"ffn_kinds.{name}: a dense MLP with bias or without a gate")
    parts = {t.name: part_of(t, devices) for t in shard.tensors}
    width = parts["ffn.w_gate"].size
    gate_up = _segment(
        "gate_up", [parts["ffn.w_gate"], parts["ffn.w_up"]], hidden, 2 * width, 0, bank_rows
    )
    down = _segment("down", [parts["ffn.w_down"]], width, hidden, gate_up.banks, bank_rows)
    act = kind.activation
    return DenseLayout(
        name=name,
        index=index,
        layers=layers,
        width=width,
        gated=kind.gated,
        activation=act.kind,
        activation_params={
            k: v for k, v in act.model_dump().items() if k != "kind" and v is not None
        },
        bias=kind.bias,
        segments=[gate_up, down],
        vectors=[],
    )


def build_layout(
    spec: ModelSpec,
    topology: Topology,
    sharding: ShardingPlan,
    options: BuildOptions,
    *,
    ring_depth: int,
    bank_rows: int,
) -> KernelLayout:
    """The kernel layout of `spec` on `topology`, per-rank pieces as `sharding` decided."""
    devices = topology.num_devices
    hidden = spec.dims.hidden
    attention_names = list(spec.attention_kinds)
    ffn_names = list(spec.ffn_kinds)
    attn_table = [attention_names.index(n) for n in spec.attention_table()]
    ffn_table = [ffn_names.index(n) for n in spec.ffn_table()]

    def members(table: list[int], index: int) -> list[int]:
        return [i for i, k in enumerate(table) if k == index]

    attention = []
    for i, name in enumerate(attention_names):
        kind = spec.attention_kinds[name]
        if not isinstance(kind, GQAAttention):
            _unsupported(f"attention_kinds.{name} ({kind.type})")
        attention.append(
            _gqa_layout(
                name,
                i,
                members(attn_table, i),
                kind,
                sharding.attention[name],
                devices,
                hidden,
                options.context,
                bank_rows,
            )  # fmt: skip
        )
    ffn = []
    for i, name in enumerate(ffn_names):
        kind = spec.ffn_kinds[name]
        if not isinstance(kind, DenseFFN):
            _unsupported(f"ffn_kinds.{name} ({kind.type})")
        ffn.append(
            _dense_layout(
                name, i, members(ffn_table, i), kind, sharding.ffn[name], devices, hidden, bank_rows
            )
        )
    if spec.dims.tie_embeddings:
        _unsupported("tied embeddings")
    if spec.attention_residual:
        _unsupported("the attention residual")

    # Stream order: each layer's attention segments, then its FFN segments.
    attention_banks, ffn_banks, bank = [], [], 0
    for a_index, f_index in zip(attn_table, ffn_table, strict=True):
        attention_banks.append(bank)
        bank += sum(s.banks for s in attention[a_index].segments)
        ffn_banks.append(bank)
        bank += sum(s.banks for s in ffn[f_index].segments)
    globals_ = {t.name: part_of(t, devices) for t in sharding.globals}
    lm_part = globals_["lm_head"]
    lm_head = _segment("lm_head", [lm_part], hidden, lm_part.size, 0, bank_rows)
    segments = [s for a in attention for s in a.segments] + [s for f in ffn for s in f.segments]
    segments.append(lm_head)
    tokens = options.batch * options.rows
    return KernelLayout(
        model=spec.name,
        topology=topology.name,
        devices=devices,
        batch=options.batch,
        rows=options.rows,
        tokens=tokens,
        tokens_padded=round_up(tokens, SUBLANES_F32),
        context=options.context,
        cache_block=round_up(options.rows + CACHE_ALIGN - 1, CACHE_ALIGN),
        hidden=hidden,
        hidden_chunks=cdiv(hidden, CHUNK),
        vocab=spec.dims.vocab,
        vocab_used=spec.dims.vocab_used or spec.dims.vocab,
        vocab_per_core=lm_part.size,
        norm_eps=spec.dims.norm_eps,
        zero_centered=spec.dims.norm_style == "zero_centered",
        logit_multiplier=spec.dims.logit_multiplier,
        logit_softcap=spec.dims.logit_softcap,
        bank_rows=bank_rows,
        ring_depth=ring_depth,
        attention=attention,
        ffn=ffn,
        attention_table=attn_table,
        ffn_table=ffn_table,
        attention_slot=[attention[k].layers.index(i) for i, k in enumerate(attn_table)],
        ffn_slot=[ffn[k].layers.index(i) for i, k in enumerate(ffn_table)],
        attention_banks=attention_banks,
        ffn_banks=ffn_banks,
        lm_head_bank=bank,
        tail_segments=[lm_head],
        total_banks=bank + lm_head.banks,
        vector_rows=2 + max(len(a.vectors) for a in attention),
        vector_width=round_up(
            max([hidden] + [v.length for a in attention for v in a.vectors]), 128
        ),
        final_norm=globals_["final_norm"],
        max_k_chunks=max(s.k_chunks for s in segments),
        max_col_blocks=max(s.col_blocks for s in segments),
    )
