"""The per-core layout a generated kernel reads: stream segments, vectors, caches, tables.

Everything here is plain data (pydantic) that code generation renders and the
generated runner uses to pack weights; no template computes a shape. The weight
stream itself is planned in mkgen/plan/stream.py.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from mkgen.errors import SpecError
from mkgen.plan.collectives import CollectivePlan
from mkgen.plan.stream import (
    CHUNK,
    LANES,
    Part,
    PlanModel,
    Segment,
    StreamPlan,
    cdiv,
    round_up,
)
from mkgen.spec.quant import QuantFormat
from mkgen.spec.schema import Activation, ModelSpec
from mkgen.spec.schema import Rope as RopeSpec

SUBLANES_F32 = 8
CACHE_ALIGN = 16  # bf16 rows of an HBM array are tiled by 16


class VectorRow(PlanModel):
    """A small per-layer tensor (norm weight, bias, sinks, conv taps) in the layer's
    vector slab: `rows` rows from `row` on, `length` values each."""

    name: str
    row: int
    part: Part
    length: int
    rows: int = 1

    @property
    def stop(self) -> int:
        """The row after its last."""
        return self.row + self.rows


class CacheArray(PlanModel):
    """One per-core cache array of an attention kind, updated in place by the kernel."""

    name: str  # k, v (GQA); conv, state (Gated DeltaNet)
    shape: list[int]  # per core: [layers of the kind, batch, ...]
    dtype: Literal["bfloat16", "float32"]


class Columns(PlanModel):
    """Where one tensor's output lies in a fused segment's columns."""

    start: int
    size: int

    @property
    def stop(self) -> int:
        return self.start + self.size


class Rope(PlanModel):
    """Rotary tables the wrapper builds in XLA: cos/sin of positions x inv_freq."""

    rotary_dim: int
    half: int  # rotary_dim // 2: the rotated halves' width, the cos/sin tables' columns
    inv_freq: list[float]
    attention_factor: float  # YaRN's cos/sin multiplier (1.0 without YaRN)
    interleaved: bool


class GQALayout(PlanModel):
    type: Literal["gqa"] = "gqa"
    # Facts of the kind, not of one build (ClassVar: plan.json's `type` picks the record
    # class, so reading a plan back restores them). Stages after the plan read these
    # instead of testing a kind's name.
    recurrent: ClassVar[bool] = False  # its cache is rows indexed by position
    # The spec's head fields (kind.model_fields) -> this record's per-core counts: a
    # core's share of the kind is the spec's kind with these replaced (the prefill).
    own_heads: ClassVar[dict[str, str]] = {"num_heads": "heads", "num_kv_heads": "kv_heads"}
    name: str
    index: int  # position among the model's attention kinds (the layer table's code)
    layers: list[int]  # model layers of this kind, in order (cache slot = position here)
    heads: int  # q heads on each core
    kv_heads: int  # kv heads on each core (replicated when fewer than cores)
    kv_rank_divisor: int  # consecutive cores sharing one kv head (1: not replicated)
    group: int  # q heads per kv head
    head_dim: int  # key width of a cache row
    value_dim: int
    values_in_keys: bool = False  # False: separate k and v caches
    q_cols: int
    kv_cols: int
    q_rows: int  # query rows of a kv head in the attention scratch: group x rows, padded to 8
    columns: dict[str, Columns]  # outputs of the qkv segment: wq, wk, wv, (wgate)
    gate: bool
    qk_norm: Literal["none", "rms", "rms_noparam"]
    sinks: bool
    qkv_bias: bool
    o_bias: bool
    window: int | None
    softmax_scale: float
    rope: Rope | None
    segments: list[Segment]  # qkv (q | k | v | gate), o
    ops: list[str]  # the layer's ops in program order (mkgen.kinds.gqa.OPS): the kernel's order
    cache_arrays: int  # k and v
    vectors: list[VectorRow]
    kv_tile: int  # cache tokens per streamed tile
    caches: list[CacheArray]


class MLALayout(PlanModel):
    """Multi-head latent attention, absorbed: q heads split over cores, each core keeps the
    whole latent cache (every head reads it) as one key row [latent | rotated k_rope].

    A head's nope query is turned into latent space by wkv_b's key half (segment uk) and
    its attention output back into values by the value half (uv); the cached latent is
    both key (with k_rope) and value, so attention is GQA with one kv head of width
    `head_dim` whose values are its first `value_dim` columns."""

    type: Literal["mla"] = "mla"
    recurrent: ClassVar[bool] = False  # as GQALayout's
    own_heads: ClassVar[dict[str, str]] = {"num_heads": "heads"}
    name: str
    index: int
    layers: list[int]
    heads: int  # q heads per core
    kv_heads: Literal[1] = 1  # the latent, shared by every head
    group: int  # q heads reading the latent: all of them
    q_rows: int  # query rows of the latent in the attention scratch: heads x rows, padded to 8
    q_lora_rank: int  # 0: q straight from the hidden state (segment down)
    kv_lora_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    head_dim: int  # cache row: kv_lora_rank + rope_dim
    value_dim: int  # kv_lora_rank: values are the cached latent
    values_in_keys: Literal[True] = True
    gate: bool
    latent_eps: float  # eps of the q and kv latent norms
    softmax_scale: float
    window: None = None
    sinks: Literal[False] = False
    rope: Rope | None  # rope columns are stored de-interleaved (TensorView.rotary)
    columns: dict[str, Columns]  # outputs of the down segment: wq_a | wq, wkv_a, wgate
    # wq_a and wkv_a split over the cores: one all-gather joins each one's pieces.
    latent_split: bool
    segments: list[Segment]  # down, (q_b), uk, uv, o
    ops: list[str]  # the layer's ops in program order (mkgen.kinds.mla.ops): the kernel's order
    vectors: list[VectorRow]  # q_norm, kv_norm
    kv_tile: int
    caches: list[CacheArray]  # latent: [layers, batch, 1, context, head_dim] bf16
    cache_arrays: Literal[1] = 1  # the latent row


class RecurrentLayout(PlanModel):
    """Delta-rule linear attention (Gated DeltaNet, KDA): heads split over cores.

    Gated DeltaNet: value heads split, each core with the key heads they read; one
    scalar decay per head; output gated by silu(z). KDA: as many key as value heads;
    a per-key-dim decay from a low-rank projection; output gated by a sigmoid gate."""

    type: Literal["gated_deltanet", "kda"]
    # Its cache is a state a rejected draft row must not advance: the runner keeps the
    # snapshot after each sequence's last accepted row (GQALayout has the facts' rules).
    recurrent: ClassVar[bool] = True
    # KDA's spec names num_heads (as many key as value heads), Gated DeltaNet's both.
    own_heads: ClassVar[dict[str, str]] = {
        "num_heads": "value_heads",
        "num_key_heads": "key_heads",
        "num_value_heads": "value_heads",
    }
    name: str
    index: int
    layers: list[int]
    key_heads: int  # per core
    value_heads: int  # per core; value head j reads key head j // group
    group: int
    key_dim: int
    value_dim: int
    conv_width: int
    channels: int  # conv channels per core: q | k | v
    gate_lower_bound: float | None = None  # KDA's decay bound (None: softplus form, as GDN's)
    output_gate_rank: int | None = None  # KDA: low-rank output gate (None: full rank)
    columns: dict[str, Columns]  # outputs of the "in" segment
    segments: list[Segment]  # in, (f_b, g_b for KDA), o
    ops: list[str]  # the layer's ops in program order (the kind module's ops): the kernel's order
    vectors: list[VectorRow]
    caches: list[CacheArray]  # conv tail (bf16), recurrent state (f32): after each row
    rope: None = None  # no positions: the recurrence carries order


class DenseLayout(PlanModel):
    type: Literal["dense"] = "dense"
    # A fact of the kind (ClassVar, as GQALayout's): no routed-expert arrays to pack.
    routed_experts: ClassVar[bool] = False
    name: str
    index: int
    layers: list[int]
    width: int  # per core
    gated: bool
    activation: str
    activation_params: dict[str, float]
    bias: bool
    segments: list[Segment]  # gate_up (gate | up), down
    ops: list[str]  # the layer's ops in program order (mkgen.kinds.dense.OPS): the kernel's order
    vectors: list[VectorRow]


class MLPLayout(PlanModel):
    """A plain MLP (mkgen.kinds.mlp): act(x W_up) W_down, width split over cores."""

    type: Literal["mlp"] = "mlp"
    routed_experts: ClassVar[bool] = False  # as DenseLayout's
    name: str
    index: int
    layers: list[int]
    width: int  # per core
    activation: str  # a single-input activation: _activation's gated form with up = 1
    activation_params: dict[str, float]  # none (common.activation_constants prints them)
    segments: list[Segment]  # up, down
    ops: list[str]  # the layer's ops in program order (mkgen.kinds.mlp.OPS): the kernel's order
    vectors: list[VectorRow]


# Expert array dtypes (the VMEM plan's names) -> jnp names for the template.
INT8_TILE_ROWS = 32  # 8-bit VMEM tiles are (32, 128)
JNP_DTYPES = {"bf16": "bfloat16", "f32": "float32", "int8": "int8", "fp8": "float8_e4m3fn"}


class ExpertChunks(PlanModel):
    """One routed expert's per-rank slice, in pieces that stream through expert slots.

    gate|up ([d, 2 * width] column-block-major), padded to whole pieces, then down
    ([width, d]); each piece of `piece_chunks` CHUNK x LANES chunks is one DMA per array
    (codes, and scales for scaled formats, except that byte scales of byte codes follow
    the codes in the same array: `inline_scales`, one DMA a piece). The single source of
    the pieces' shapes for the template, the packer and the VMEM plan (mkgen.plan.vmem).

    Per format, a chunk's codes / scales (rows x LANES):
    bf16 CHUNK bf16 / -; int4:G CHUNK / 2 int8 (two codes a byte: rows 2a and 2a + 1,
    Mosaic's int4 packing) / CHUNK / G bf16; mxfp4 CHUNK / 2 int8 (two e2m1 codes a
    byte: rows r and r + CHUNK / 2) / CHUNK / 32 E8M0 bytes (int8); fp8:B CHUNK e4m3 /
    CHUNK / B f32 (each block's scale repeated over its B columns); int8 CHUNK int8 / 1
    f32 row of column scales; nvfp4 codes as mxfp4's / CHUNK / 16 e4m3 bytes, and after
    the piece's block scales (row `tensor_scale_row` on) one row of E8M0 bytes a chunk,
    its columns' tensor scales."""

    d: int  # the dimension experts read and write (latent width or hidden)
    width: int  # intermediate columns per rank
    format: str  # the storage format as the spec writes it
    kind: str  # bf16, int4, mxfp4, fp8, int8, nvfp4
    group: int  # input rows per scale (0: no scales)
    code_dtype: str  # bf16, int8 or fp8 (VMEM plan names)
    code_rows: int  # rows of one piece's codes
    scale_dtype: str  # "" without scales
    scale_rows: int  # rows of one piece's scales
    scale_cols: int
    tensor_scale_row: int = 0  # nvfp4: the first of its tensor-scale rows (0: none)
    # The scales' rows follow the codes' in one int8 array (mxfp4, nvfp4: E8M0 / e4m3
    # scale bytes beside e2m1 code bytes), so a piece is one DMA; the scale rows are
    # padded to whole int8 tiles, so every slot of the array starts on one.
    inline_scales: bool = False
    gate_up_k_chunks: int
    gate_up_col_blocks: int
    down_k_chunks: int
    down_col_blocks: int
    piece_chunks: int
    gate_up_pieces: int
    down_pieces: int

    @property
    def pieces(self) -> int:
        return self.gate_up_pieces + self.down_pieces

    @property
    def arrays(self) -> int:
        """DMAs per piece: codes, and scales when the format has them in an array of their own."""
        return len(self.array_shapes)

    @property
    def array_shapes(self) -> list[tuple[int, str]]:
        """(rows, dtype) of one piece of each array: the codes (and inline scales), then
        the scales when they are an array of their own; every array LANES wide."""
        if self.inline_scales:
            return [(self.code_rows + round_up(self.scale_rows, INT8_TILE_ROWS), self.code_dtype)]
        if not self.scale_dtype:
            return [(self.code_rows, self.code_dtype)]
        return [(self.code_rows, self.code_dtype), (self.scale_rows, self.scale_dtype)]

    @property
    def scale_row(self) -> int:
        """The first scale row in its array: past the codes when inline, else 0."""
        return self.code_rows if self.inline_scales else 0

    @property
    def piece_bytes(self) -> int:
        """HBM bytes of one piece (codes and scales, with inline scales' tile padding)."""
        bits = {"bf16": 16, "f32": 32, "int8": 8, "fp8": 8}
        return sum(rows * LANES * bits[dtype] // 8 for rows, dtype in self.array_shapes)

    @property
    def code_jnp(self) -> str:
        return JNP_DTYPES[self.code_dtype]

    @property
    def scale_jnp(self) -> str:
        return JNP_DTYPES.get(self.scale_dtype, "")


def piece_chunks(gate_up: int, down: int, largest: int) -> int:
    """Chunks per expert piece: the largest size up to `largest` that pads the least."""

    def waste(n: int) -> int:
        return cdiv(gate_up, n) * n - gate_up + cdiv(down, n) * n - down

    return min(range(1, largest + 1), key=lambda n: (waste(n), -n))


def expert_chunks(
    fmt_text: str, d: int, width: int, max_piece_chunks: int, *, inline_scales: bool = True
) -> ExpertChunks:
    """How one expert slice in `fmt_text` streams in pieces: each piece at most the bytes
    of `max_piece_chunks` bf16 chunks (a weight bank's, by default), so a narrow format
    moves as many bytes per DMA as bf16 does, in as few pieces as pad the least. Byte
    scales of byte codes go inline unless `inline_scales` is False."""
    from mkgen.spec.quant import parse_format

    fmt = parse_format(fmt_text)
    gate_up = cdiv(d, CHUNK) * cdiv(2 * width, LANES)
    down = cdiv(width, CHUNK) * cdiv(d, LANES)

    def pieces_of(piece: int) -> ExpertChunks:
        rows = piece * CHUNK
        group = fmt.block or 0
        code_dtype, code_rows, scale_dtype, scale_rows, tensor_scale_row = "int8", rows, "", 0, 0
        if fmt.kind == "bf16":
            code_dtype = "bf16"
        elif fmt.code_bits == 4:
            code_rows = rows // 2  # two codes a byte
            scale_dtype = "bf16" if fmt.kind == "int4" else "int8"  # E8M0 / e4m3 scale bytes
            scale_rows = rows // group
            if fmt.kind == "nvfp4":  # then a row of E8M0 tensor-scale bytes a chunk
                tensor_scale_row, scale_rows = scale_rows, scale_rows + piece
        elif fmt.kind == "int8":
            scale_dtype, scale_rows = "f32", piece  # per-column scales, one row per chunk
        else:  # fp8:B, B x B blocks, each scale repeated over its B columns
            code_dtype, scale_dtype, scale_rows = "fp8", "f32", rows // group
        return ExpertChunks(
            d=d,
            width=width,
            format=fmt_text,
            kind=fmt.kind,
            group=group,
            code_dtype=code_dtype,
            code_rows=code_rows,
            scale_dtype=scale_dtype,
            scale_rows=scale_rows,
            scale_cols=LANES if scale_dtype else 0,
            tensor_scale_row=tensor_scale_row,
            inline_scales=inline_scales and code_dtype == scale_dtype == "int8",
            gate_up_k_chunks=cdiv(d, CHUNK),
            gate_up_col_blocks=cdiv(2 * width, LANES),
            down_k_chunks=cdiv(width, CHUNK),
            down_col_blocks=cdiv(d, LANES),
            piece_chunks=piece,
            gate_up_pieces=cdiv(gate_up, piece),
            down_pieces=cdiv(down, piece),
        )

    bf16_chunk_bytes = CHUNK * LANES * 2
    largest = max_piece_chunks * bf16_chunk_bytes // pieces_of(1).piece_bytes
    return pieces_of(piece_chunks(gate_up, down, largest))


class MoELayout(PlanModel):
    type: Literal["moe"] = "moe"
    # A fact of the kind (ClassVar, as GQALayout's): its experts are HBM arrays of their
    # own (ExpertChunks), packed per core beside the stream.
    routed_experts: ClassVar[bool] = True
    name: str
    index: int
    layers: list[int]
    num_experts: int
    top_k: int
    # Experts split by id over `groups` groups of `width_parts` consecutive cores; rank r
    # holds experts [g * experts_per_rank, (g + 1) * experts_per_rank) of group
    # g = r // width_parts, width part r % width_parts of each.
    groups: int
    width_parts: int
    experts_per_rank: int
    experts: ExpertChunks
    expert_layers: int  # layers of this kind: the expert arrays' first dim
    expert_format_note: str  # how the experts' format stores them
    packed_codes: bool  # two 4-bit codes a byte
    expert_slots: int  # expert pieces in flight: issued as soon as routing names them
    activation: str
    activation_params: dict[str, float]
    score: Literal["softmax", "sigmoid"]
    router_bias: bool
    selection_bias: bool
    renormalize: bool
    routed_scaling: float
    n_group: int
    topk_group: int
    latent_width: int  # 0: experts read the hidden state
    latent_norm: bool
    latent_design: Literal["rs_ar", "ar_ag", "none"]
    latent_per_rank: int
    # The router's columns split over the cores: its scores are all-gathered beside the
    # latent piece (one collective), then every core routes on all of them.
    router_split: bool
    shared_width: int  # shared-expert columns per rank (0: none)
    shared_gate: bool
    columns: dict[str, Columns]  # outputs of the "in" segment: router, latent_in, shared_*
    segments: list[Segment]  # in, latent_out, shared_down
    in_segments: list[str]  # the "in" tensors' segments: one per format, outputs side by side
    ops: list[str]  # the layer's ops in program order (mkgen.kinds.moe.ops): the kernel's order
    vectors: list[VectorRow]
    # Expert biases (gpt-oss), in the layer's vector slab from this row: one row per expert
    # the core holds with its gate | up biases (its width part's columns), then one row per
    # expert with its down biases, which width part 0 adds. None: no biases.
    bias_row: int | None = None


class AttentionResidualLayout(PlanModel):
    """Kimi K3's cross-block residual (mkgen/reference/model.py): snapshots of the stream
    at block starts, mixed by a softmax of the block's logits, which the first layer of
    each block carries in its vector slab."""

    block_size: int
    max_snapshots: int
    logits_row: int  # row of the block's first layer's slab holding its logits


class StreamFormat(PlanModel):
    """How a bank of a quantized weight-stream format is read (mkgen.plan.stream.Segment)."""

    format: str  # as the spec writes it: int8, fp8:B
    code: Literal["int8", "float8_e4m3fn"]  # jnp dtype of its codes
    chunks_per_bank: int
    scale_row: int  # first row of a bank's scale region
    scale_rows: int  # bf16 rows of one chunk's scales
    block: int | None  # fp8:B: rows and columns per scale; None: int8's per-column scales


class KernelFeatures(PlanModel):
    """The optional code a build needs: the template emits a helper only when a kind that
    calls it is present."""

    rope: bool  # kinds with rotary positions: cos/sin tables built before the kernel
    routing: bool  # MoE kinds: top-k selection of experts
    activations: list[str]  # the FFN kinds' gated activations (_activation's branches)
    recurrent: bool  # Gated DeltaNet or KDA kinds: causal conv and delta rule
    softplus: bool  # Gated DeltaNet's decay, or KDA's without a lower bound
    expert_formats: list[str]  # routed-expert storage kinds: bf16, int8, int4, mxfp4, nvfp4, fp8
    stream_formats: list[StreamFormat]  # quantized weight-stream formats, in stream order
    block_scales: bool  # scaled experts or fp8 stream segments: scales on partial products
    e2m1: bool  # mxfp4 / nvfp4 experts: e2m1 codes read as e4m3
    held_refills: bool  # a mesh: ring refills may be held for its collectives' flights


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
    stream: StreamPlan
    attention: list[GQALayout | MLALayout | RecurrentLayout]
    ffn: list[DenseLayout | MLPLayout | MoELayout]
    attention_table: list[int]  # kind index of every layer
    ffn_table: list[int]
    attention_slot: list[int]  # position of every layer among layers of its kind
    ffn_slot: list[int]
    vector_rows: int
    vector_width: int
    collectives: CollectivePlan  # stages over the topology, landing buffers, mesh order
    attention_residual: AttentionResidualLayout | None
    trace_residuals: bool = False  # verification builds return the stream after each layer
    final_norm: Part
    max_k_chunks: int
    max_col_blocks: int
    features: KernelFeatures
    num_layers: int
    bank_mib: float  # MiB of one weight bank
    collective_buffers: int  # landing buffers: one per collective of a layer (at most)
    cache_arrays: int  # the attention kinds' cache arrays, aliased in place
    expert_arrays: int  # the MoE kinds' expert arrays (bf16 pieces, or codes and scales)
    # pallas_call operands before the caches: the 2 scalar tables, x, final norm, the RoPE
    # tables (cos, sin of each kind with rotary positions), stream, vectors, the experts
    operands_before_caches: int
    vmem_limit_bytes: int  # Mosaic's scoped VMEM limit: the chip catalog's (mkgen.hardware)

    @property
    def table_rows(self) -> dict[str, int]:
        """The rows of the kernel's per-layer tables (LAYER_TABLES, in SMEM) by what they
        hold: the kernel and the kinds' macros index the tables through these names."""
        return {name: row for row, name in enumerate(LAYER_TABLE_ROWS)}

    def collective_buffer(self, kind: str, collective: str) -> int:
        """The landing buffer of layer kind `kind`'s collective `collective` (as
        plan_collectives numbered them): what the kind's macros pass its round."""
        use = f"{kind}.{collective}"
        for buffer in self.collectives.buffers:
            if any(u.split(" ")[0] == use for u in buffer.uses):
                return buffer.index
        raise SpecError(f"{use}: no collective buffer holds it (the plan runs no such round)")


# The rows of the kernel's per-layer tables, in LAYER_TABLES' order (megakernel.py.j2).
LAYER_TABLE_ROWS = (
    "attention_kind",  # the layer's attention kind
    "attention_slot",  # its cache slot
    "ffn_kind",  # its FFN kind
    "ffn_slot",  # its slot among the layers of its FFN kind
    "attention_row",  # the first stream row of its attention
    "ffn_row",  # of its FFN
)


# ---------------------------------------------------------------- building a layout


def unsupported(what: str) -> None:
    raise SpecError(f"{what} is not supported by the code generator yet")


def rope_layout(rope: RopeSpec, rotary_dim: int) -> Rope:
    from mkgen.spec.rope import rope_frequencies

    inv_freq, factor = rope_frequencies(rope, rotary_dim)
    return Rope(
        rotary_dim=rotary_dim,
        half=rotary_dim // 2,
        inv_freq=[float(f) for f in inv_freq],
        attention_factor=float(factor),
        interleaved=rope.interleaved,
    )


def activation_params(act: Activation) -> dict[str, float]:
    """A gated activation's caps and slopes (those it sets)."""
    return {k: v for k, v in act.model_dump().items() if k != "kind" and v is not None}


def segment_columns(segments: list[Segment], name: str, prefix: str) -> dict[str, Columns]:
    """Where each fused tensor's output lies in the columns of segment `name` (and of its
    format splits name.1, ..., whose outputs the kernel places side by side)."""
    columns, start = {}, 0
    for segment in (s for s in segments if s.name.split(".")[0] == name):
        for part in segment.parts:
            columns[part.tensor.removeprefix(prefix)] = Columns(start=start, size=part.size)
            start += part.size
    return columns


MAX_PIECE_CHUNKS = 16  # expert pieces of at most 16 bf16 chunks' bytes: a 2 MiB weight bank


# Routed-expert formats the template reads, with the groups it can unpack.
GENERATED_EXPERT_FORMATS = ("bf16", "int8", "int4", "mxfp4", "nvfp4", "fp8")
# Dense (weight-stream) formats the template reads.
GENERATED_STREAM_FORMATS = ("bf16", "int8", "fp8")


def _group(fmt: QuantFormat) -> int:
    """A grouped format's group size (parse_format sets it for int4 and fp8)."""
    assert fmt.group is not None, fmt
    return fmt.group


def check_expert_format(text: str, name: str, width: int) -> None:
    from mkgen.spec.quant import parse_format

    fmt = parse_format(text)
    if fmt.kind not in GENERATED_EXPERT_FORMATS or (
        fmt.kind in ("int4", "fp8") and CHUNK % _group(fmt)
    ):
        unsupported(
            f"ffn_kinds.{name}: routed experts in {text} (bf16, int8, int4:G and fp8:B with "
            "G, B | 256, mxfp4 and nvfp4 are)"
        )
    if fmt.block and width % fmt.block:
        raise SpecError(
            f"ffn_kinds.{name}: the {width} expert columns per core are not whole {fmt} groups "
            f"of {fmt.block}; choose a topology or format whose group divides them"
        )


def check_stream_formats(where: str, segments: list[Segment], fused: bool = True) -> None:
    """Every segment in a format the template reads, its fp8 blocks whole in each part."""
    from mkgen.spec.quant import parse_format

    for seg in segments:
        fmt = parse_format(seg.format)
        if fmt.kind not in GENERATED_STREAM_FORMATS or (fmt.kind == "fp8" and CHUNK % _group(fmt)):
            tensors = ", ".join(p.tensor for p in seg.parts)
            unsupported(
                f"{where}: dense weights ({tensors}) in {seg.format} (bf16, int8 and fp8:B "
                "with B | 256 are)"
            )
        if fmt.kind == "fp8" and any(p.size % _group(fmt) for p in seg.parts[:-1]):
            unsupported(f"{where}.{seg.name}: fp8 blocks of {fmt.group} straddling fused tensors")
        if not fused and "." in seg.name:
            unsupported(f"{where}: fused tensors of {seg.name.split('.')[0]} in different formats")


def check_formats(spec: ModelSpec, stream: StreamPlan) -> None:
    """Weight formats the template does not read are an error, never a bf16 fallback: the
    embedding's and the lm_head's here, each layer kind's in its layout builder (MoE's
    "in" group may mix formats, the others' fused groups may not)."""
    from mkgen.spec.quant import parse_format

    if parse_format(spec.quantization.embedding).kind != "bf16":
        unsupported(f"an embedding in {spec.quantization.embedding}")
    check_stream_formats("lm_head", stream.tail)


def slab_rows(kind: DenseLayout | MLPLayout | MoELayout) -> int:
    """Rows of a layer's vector slab an FFN kind uses after its first row."""
    rows = sum(v.rows for v in kind.vectors)
    if isinstance(kind, MoELayout) and kind.bias_row is not None:
        rows += 2 * kind.experts_per_rank
    return rows


def slab_width(kind: DenseLayout | MLPLayout | MoELayout) -> int:
    """The widest row an FFN kind puts in a layer's vector slab."""
    widths = [v.length for v in kind.vectors]
    if isinstance(kind, MoELayout) and kind.bias_row is not None:
        widths += [2 * kind.experts.width, kind.experts.d]
    return max(widths, default=0)


def stream_formats(segments: list[Segment]) -> list[StreamFormat]:
    """The quantized formats of the weight stream, each read as its first segment stores it."""
    from mkgen.spec.quant import parse_format

    out: dict[str, StreamFormat] = {}
    for seg in segments:
        if seg.format == "bf16" or seg.format in out:
            continue
        fmt = parse_format(seg.format)
        out[seg.format] = StreamFormat(
            format=seg.format,
            code="int8" if fmt.kind == "int8" else "float8_e4m3fn",
            chunks_per_bank=seg.chunks_per_bank,
            scale_row=seg.scale_row,
            scale_rows=seg.scale_rows,
            block=fmt.group if fmt.kind == "fp8" else None,
        )
    return list(out.values())


def kernel_features(
    attention: list[GQALayout | MLALayout | RecurrentLayout],
    ffn: list[DenseLayout | MLPLayout | MoELayout],
    stream_formats: list[StreamFormat],
    held_refills: bool,
) -> KernelFeatures:
    """What the kernel's kinds call, so that it carries only those helpers."""
    recurrent = [a for a in attention if isinstance(a, RecurrentLayout)]
    expert_formats = list(dict.fromkeys(f.experts.kind for f in ffn if isinstance(f, MoELayout)))
    return KernelFeatures(
        rope=any(a.rope for a in attention),
        routing=bool(expert_formats),
        activations=list(dict.fromkeys(f.activation for f in ffn)),
        recurrent=bool(recurrent),
        softplus=any(a.gate_lower_bound is None for a in recurrent),
        expert_formats=expert_formats,
        stream_formats=stream_formats,
        block_scales=bool(set(expert_formats) - {"bf16"})
        or any(f.block is not None for f in stream_formats),
        e2m1=bool({"mxfp4", "nvfp4"} & set(expert_formats)),
        held_refills=held_refills,
    )


FULL_BANK_ROWS = 4096  # 2 MiB bf16 banks, as the hand-written kernels use
