"""The per-core layout a generated kernel reads: stream segments, vectors, caches, tables.

Everything here is plain data (pydantic) that code generation renders and the
generated runner uses to pack weights; no template computes a shape. The weight
stream itself is planned in mkgen/plan/stream.py. Each layer kind's record is defined in
its folder (mkgen/kinds/<kind>/record.py) on the bases here (`AttentionRecord`,
`FFNRecord`), which say what the stages after the plan read of every record.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import (
    SerializeAsAny,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
)

from mkgen.errors import SpecError
from mkgen.plan.collectives import CollectivePlan
from mkgen.plan.fused import DraftPasses
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

if TYPE_CHECKING:  # annotations only: kind.py types its records by this module's bases
    from mkgen.plan.kind import KindRegistry

# A jax or numpy array in a record's hooks (the plan imports neither), and a core's rank
# (an int, or traced inside shard_map).
Array = Any
Rank = Any

SUBLANES_F32 = 8


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


class KindRecord(PlanModel):
    """A layer kind's record of the kernel layout: everything its macros print, as plain
    data. A kind defines its record in its folder (mkgen/kinds/<kind>/record.py) and names
    it as its rules' RECORD (mkgen.plan.kind.LayerKind); KernelLayout holds it by this base,
    and reading a layout back picks the class by the record's `type` tag (KernelLayout.read).

    Facts of the kind, not of one build, are ClassVars (not serialized: the `type` tag
    restores them); the stages after the plan read those and call the record's methods
    instead of testing which kind it is."""

    if TYPE_CHECKING:  # Fields every record declares, each in its own order (plan.json
        # keeps a record's field order, so the records declare them, not this base).
        type: str
        name: str
        index: int  # position among the model's attention (or FFN) kinds: the layer table's code
        layers: list[int]  # model layers of this kind, in order
        segments: list[Segment]
        ops: list[str]  # the layer's ops in program order: the kernel's order
        vectors: list[VectorRow]

    def stream_parts(self) -> dict[str, Part]:
        """Its parts of the weight stream (every segment's) by tensor name."""
        return {p.tensor: p for segment in self.segments for p in segment.parts}


class AttentionRecord(KindRecord):
    """An attention kind's record (GQA's, MLA's, the recurrent kinds' in mkgen/kinds/)."""

    # Its cache is a state a rejected draft row must not advance (the runner keeps the
    # snapshot after each sequence's last accepted row), not rows indexed by position.
    recurrent: ClassVar[bool]
    # The spec's head fields (kind.model_fields) -> this record's per-core counts: a core's
    # share of the kind is the spec's kind with these replaced (the prefill).
    own_heads: ClassVar[dict[str, str]]
    # The XLA prefill (mkgen.runtime.prefill) computes each core's heads from its own
    # pieces (heads_split), and each core keeps the cache of its own heads (own_cache)
    # rather than the whole reference cache every core computes alike.
    heads_split: ClassVar[bool]
    own_cache: ClassVar[bool]

    if TYPE_CHECKING:
        rope: Rope | None
        caches: list[CacheArray]

    def softplus(self) -> bool:
        """Whether its kernel code calls the `_softplus` helper (KernelFeatures.softplus)."""
        return False

    @abstractmethod
    def cache_pieces(
        self, spec: ModelSpec, cache: Mapping[str, Array], rank: Rank
    ) -> dict[str, Array]:
        """What core `rank` holds of a layer's reference cache (mkgen.reference.model's
        init_cache), per cache array of its kernel (`caches`) without the layer axis: what
        the prefill writes and verify compares through."""

    def own_cache_pieces(self, cache: Mapping[str, Array]) -> dict[str, Array]:
        """A core's own reference cache of its heads (own_cache) in its kernel's layout:
        what cache_pieces cuts for that core from the whole reference cache."""
        raise NotImplementedError(f"{self.type} keeps no cache of its own heads (own_cache)")

    @abstractmethod
    def prefill_cache(self, spec: ModelSpec, pieces: Mapping[str, Array]) -> dict[str, Array]:
        """A layer's prefill cache from its kernel cache arrays on the host (numpy, each
        [devices, B, ...]), cache_pieces undone: with own_cache each core's own reference
        cache [devices, B, ...], else the whole reference cache [B, ...]."""


class FFNRecord(KindRecord):
    """An FFN kind's record (the dense, plain MLP and MoE kinds' in mkgen/kinds/)."""

    # It has routed-expert arrays of its own (routed_chunks) to pack and routes to verify.
    routed_experts: ClassVar[bool]

    if TYPE_CHECKING:
        activation: str

    def routed_chunks(self) -> ExpertChunks | None:
        """How its routed experts stream (None: it has none)."""
        return None

    def own_experts(self, arrays: list[Array]) -> list[Array]:
        """A core's routed-expert arrays cut to the experts the prefill runs on it (all of
        them unless its kind holds some for another core too)."""
        return arrays

    def columns_split(self) -> bool:
        """Whether it is an MLP split as tensor parallelism splits it (inputs by columns,
        the output projection by rows, each core its own piece, no biases): the prefill
        then runs it on each core's columns alone and sums the cores' outputs."""
        return False

    def shared_columns_split(self) -> bool:
        """Whether its shared experts are split so (columns_split's rule)."""
        return False

    def shared_outputs_split(self) -> bool:
        """Whether its shared experts' three matrices are all split by output columns, each
        core its own piece (the kernel gathers their activation, then each core computes
        its columns of their output)."""
        return False

    def work_in_flight(self) -> bool:
        """Whether it runs work of its own while a collective's copies travel (the kernel
        then carries _reduce_scatter_in_flight)."""
        return False

    def slab_blocks(
        self, tensors: Mapping[str, Array], prefix: str, rank: int
    ) -> list[tuple[int, Array]]:
        """(first row, rows [n, width]) it puts in core `rank`'s vector slab of a layer
        (tensor names from `prefix` on) besides its VectorRows (none by default)."""
        return []

    def slab_pieces(self, slab: Array) -> dict[str, Array]:
        """slab_blocks undone: its pieces (by unpack.piece_key) from a core's slab."""
        return {}

    def slab_rows(self) -> int:
        """Rows of a layer's vector slab it uses after its first row."""
        return sum(v.rows for v in self.vectors)

    def slab_width(self) -> int:
        """The widest row it puts in a layer's vector slab."""
        return max((v.length for v in self.vectors), default=0)


# Expert array dtypes (the VMEM plan's names) -> jnp names for the template.
INT8_TILE_ROWS = 32  # 8-bit VMEM tiles are (32, 128)


def experts_padded(num_experts: int) -> int:
    """Expert ids in whole 128-lane rows: the width of an MoE kernel's chosen-expert flags."""
    return -(-num_experts // 128) * 128


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
    f32 row of column scales; nvfp4 CHUNK / 2 int8 (two e2m1 codes a byte: rows 2a and
    2a + 1, as int4's) / CHUNK / 16 e4m3 bytes, and after
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


class AttentionResidualLayout(PlanModel):
    """Kimi K3's cross-block residual (mkgen/reference/model.py): snapshots of the stream
    at block starts, mixed by a softmax of the block's logits, which the first layer of
    each block carries in its vector slab."""

    block_size: int
    max_snapshots: int
    logits_row: int  # row of the block's first layer's slab holding its logits
    # The snapshots live in HBM (a kernel output), each read back into one VMEM buffer to be
    # mixed, instead of all in VMEM (the VMEM plan's choice, mkgen.plan.vmem)
    in_hbm: bool = False


# Design choice: the kernel's elementwise work on the residual stream (a layer's add, the
# attention residual's mixing from HBM) runs in blocks of at most 32 token rows (one block
# up to batch 4 x rows 8, where Mosaic's own scratch for the mixing was fit), so the values
# Mosaic keeps live for it are one block, not the whole stream ([128, 7168] f32 is 3.5 MiB
# at batch 16 x rows 8), and so is the snapshots' landing buffer.
ROW_BLOCK_ROWS = 32


def row_block(tokens_padded: int) -> int:
    """Token rows of one block of the kernel's row-blocked work on the residual stream."""
    return min(tokens_padded, ROW_BLOCK_ROWS)


class DraftHidden(PlanModel):
    """One hidden state of the target the build's drafter reads (docs/drafting.md), which
    the kernel writes as one entry of its draft-hidden output."""

    layer: int  # the target layer after which the residual stream is taken
    # Final-normed (the last layer's: transformers' last hidden state, vLLM's MTP input)
    normed: bool


def draft_hidden_states(spec: ModelSpec, rows: int) -> list[DraftHidden]:
    """The hidden states the spec's drafter reads, in the order it reads them: none
    without a draft section or at rows 1 (a step that verifies no draft)."""
    if spec.draft is None or rows <= 1:
        return []
    last = spec.layers.count - 1
    return [DraftHidden(layer=i, normed=i == last) for i in spec.draft.target_layers(last + 1)]


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
    # scaled experts (but nvfp4's, scaled in bf16) or fp8 stream segments: scales on
    # partial products
    block_scales: bool
    e8m0_scales: bool  # mxfp4 / nvfp4 experts: E8M0 scale bytes read as powers of two
    held_refills: bool  # a mesh: ring refills may be held for its collectives' flights
    in_flight: bool  # an FFN kind runs work while a reduce-scatter's copies travel


class KernelLayout(PlanModel):
    """Everything the megakernel template and the packer need for one build."""

    model: str
    topology: str
    devices: int
    batch: int
    rows: int
    tokens: int  # batch * rows
    tokens_padded: int
    row_block: int  # token rows of a block of the row-blocked stream work (row_block())
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
    attention: list[SerializeAsAny[AttentionRecord]]  # each kind's record, as its class dumps it
    ffn: list[SerializeAsAny[FFNRecord]]
    attention_table: list[int]  # kind index of every layer
    ffn_table: list[int]
    attention_slot: list[int]  # position of every layer among layers of its kind
    ffn_slot: list[int]
    vector_rows: int
    vector_width: int
    collectives: CollectivePlan  # stages over the topology, landing buffers, mesh order
    attention_residual: AttentionResidualLayout | None
    trace_residuals: bool = False  # verification builds return the stream after each layer
    # The hidden states the drafter reads, written as one more output (none: no output)
    draft_hidden: list[DraftHidden] = []
    # A fused drafter's passes: the last layers of the tables (mkgen/plan/fused.py)
    draft_passes: DraftPasses | None = None
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

    @model_serializer(mode="wrap")
    def _without_draft_hidden(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A build without a drafter dumps as before drafters existed (plan.json unchanged).
        data: dict[str, Any] = handler(self)
        if not self.draft_hidden:
            data.pop("draft_hidden", None)
        if self.draft_passes is None:
            data.pop("draft_passes", None)
        return data

    @property
    def outputs_before_caches(self) -> int:
        """The pallas_call's outputs before the caches: logits and tokens, the verification
        build's residuals and routes, the drafter's hidden states, a fused drafter's
        accepted rows and drafts."""
        return (
            2
            + 2 * self.trace_residuals
            + (1 if self.draft_hidden else 0)
            + (1 if self.draft_passes else 0)
        )

    @classmethod
    def read(cls, data: Mapping[str, Any], kinds: KindRegistry) -> KernelLayout:
        """A layout read back from its JSON data (plan.json's `kernel`): each kind's record
        as the class `kinds` registers for its `type` tag."""
        return cls.model_validate(data, context={_KINDS: kinds})

    @field_validator("attention", "ffn", mode="before")
    @classmethod
    def _records(cls, value: Any, info: ValidationInfo) -> Any:
        """Records given as data take their kind's class (read); built ones pass as they are."""
        if not isinstance(value, list):
            return value
        kinds = (info.context or {}).get(_KINDS)
        records = []
        for item in value:
            if isinstance(item, dict):
                if kinds is None:
                    raise ValueError("a layout read from data needs its kinds: KernelLayout.read")
                item = kinds.record(str(item.get("type"))).model_validate(item)
            records.append(item)
        return records

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


# The validation context key of the KindRegistry a layout is read with (KernelLayout.read).
_KINDS = "kinds"

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
    attention: list[AttentionRecord],
    ffn: list[FFNRecord],
    stream_formats: list[StreamFormat],
    held_refills: bool,
) -> KernelFeatures:
    """What the kernel's kinds call, so that it carries only those helpers."""
    chunks = [c for f in ffn if (c := f.routed_chunks()) is not None]
    expert_formats = list(dict.fromkeys(c.kind for c in chunks))
    return KernelFeatures(
        rope=any(a.rope for a in attention),
        routing=bool(expert_formats),
        activations=list(dict.fromkeys(f.activation for f in ffn)),
        recurrent=any(a.recurrent for a in attention),
        softplus=any(a.softplus() for a in attention),
        expert_formats=expert_formats,
        stream_formats=stream_formats,
        block_scales=bool(set(expert_formats) - {"bf16", "nvfp4"})
        or any(f.block is not None for f in stream_formats),
        e8m0_scales=bool({"mxfp4", "nvfp4"} & set(expert_formats)),
        held_refills=held_refills,
        in_flight=any(f.work_in_flight() for f in ffn),
    )


FULL_BANK_ROWS = 4096  # 2 MiB bf16 banks, as the hand-written kernels use
