"""The weight stream: every dense matrix a core reads in a step, in execution order.

Each core streams one HBM array of uniform banks ``[n_banks, bank_rows, LANES]``:
layer 0's attention segments, layer 0's FFN segments, layer 1's, ..., then the
lm_head. A *segment* is a per-rank matrix ``[K, N]`` (tensors that read the same
input fused along N, e.g. q|k|v) stored as chunks of at most CHUNK x LANES,
column-block-major (the chunks of column block 0, then of block 1, ...). A bf16
segment starts on the row where the previous one ends: chunks may straddle two banks
and a bank may hold the end of one layer and the start of the next, so the stream
carries no bank-alignment padding. Its chunks are as narrow as the matrix allows:
``chunk_rows`` (a multiple of BF16_TILE_ROWS) is the fan-in spread evenly over its
CHUNK-row chunks, and a last column block narrower than LANES is stored transposed
(``tail_rows``: its columns as rows, rounded up to a tile, the fan-in along the lanes).
The kernel keeps a ring of ``ring_depth`` banks in VMEM: a chunk that reaches into a
new bank waits for it and then starts the DMA of the bank before it plus ring_depth
(or, among the last ``held_refills`` of them, once a collective round's copies are
under way), so the stream crosses layer boundaries and runs into the lm_head. Routed experts are
not in the stream (they are fetched into expert slots once routing has chosen them).

Segments keep their weights' format in the same bf16 byte stream. A quantized chunk
is its codes' bytes viewed as bf16 rows (8-bit codes: CHUNK / 2 rows) and each bank of
a quantized segment ends with the scales of its chunks (``Segment.scale_row``), so a
quantized segment occupies whole banks, and a layer kind holding one starts on a bank
(``KindStream.aligned``). Tensors in different formats are never fused into one segment.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer

from mkgen.errors import SpecError
from mkgen.plan.fused import MODULE_PREFIX
from mkgen.plan.kind import FusedSegments, KindRegistry
from mkgen.plan.options import MAX_RING_DEPTH, MIN_RING_DEPTH
from mkgen.plan.sharding import ShardingPlan, TensorShard
from mkgen.spec.quant import parse_format

LANES = 256  # column block width: TPU7x's MXU is 256 wide
CHUNK = 256  # rows of one matmul step inside a bank
BF16_BYTES = 2
BF16_TILE_ROWS = 16  # bf16 VMEM tiles are (16, 128): a bank's scale region starts on one


class PlanModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


class TensorView(PlanModel):
    """A view of a head-major matrix [K, heads * stride], taken before a rank's slice.

    Of each head's ``stride`` columns keep ``[start, start + size)``; ``rotary`` (offset,
    dims) reorders those kept columns from interleaved pairs (x0, x1), (x2, x3), ... to
    halves (evens, then odds), so the kernel rotates halves and q.k is unchanged;
    ``transpose`` stacks each head's kept block transposed, giving [heads * size, K].
    """

    stride: int
    start: int = 0
    size: int
    rotary: tuple[int, int] | None = None
    transpose: bool = False

    def shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """The viewed shape of a [K, heads * stride] tensor."""
        k, n = shape
        kept = n // self.stride * self.size
        return (kept, k) if self.transpose else (k, kept)


class Part(PlanModel):
    """A slice of one inventory tensor that a core stores.

    The tensor (named relative to its layer, e.g. ``attn.wq``), seen through ``view`` if
    one is set, is cut along ``axis`` (-1: fan_out / columns, -2: fan_in / rows, None: the
    whole tensor) into pieces of ``size``; rank r takes piece ``r // rank_divisor`` (a
    divisor above 1 replicates a piece over consecutive ranks, as for kv heads shared by
    several cores).
    """

    tensor: str
    axis: int | None
    size: int
    rank_divisor: int = 1
    view: TensorView | None = None


def part_of(shard: TensorShard, devices: int, view: TensorView | None = None) -> Part:
    """A core's piece of a tensor (seen through `view`), as the sharding plan split it.

    A view keeps the split: a head split stays a head split, a transposed view cuts rows."""
    shape = view.shape(shard.global_shape) if view else shard.global_shape
    if shard.split_axis is None:
        return Part(tensor=shard.name, axis=None, size=shape[-1], view=view)
    axis = shard.split_axis - len(shard.global_shape)
    if view and view.transpose:
        axis = -3 - axis  # rows and columns swap
    return Part(
        tensor=shard.name,
        axis=axis,
        size=shape[axis] // shard.parts,
        rank_divisor=devices // shard.parts,
        view=view,
    )


class Segment(PlanModel):
    """One per-rank matrix (or fused group) in the weight stream.

    It occupies stream rows ``[offset, offset + rows)`` after its layer kind's first row.
    bf16: ``col_blocks`` column blocks of LANES columns, each ``k_chunks`` chunks of
    ``chunk_rows`` rows (the fan-in, zero padded), except a transposed tail block
    (``tail_rows`` > 0): its columns as ``tail_rows`` rows, ``k_chunks`` chunks of LANES
    fan-in each. Quantized: whole banks, each holding ``chunks_per_bank`` CHUNK x LANES
    chunks: their codes, ``code_rows`` bf16 rows each, from row 0; then from
    ``scale_row`` on the scales of those chunks, ``scale_rows`` bf16 rows a chunk (int8:
    the chunk's column scales as one f32 row; fp8:B: CHUNK / B f32 rows, each block's
    scale repeated over its B columns)."""

    name: str
    parts: list[Part]  # fused along N in this order
    fan_in: int
    fan_out: int
    k_chunks: int
    col_blocks: int
    offset: int  # first stream row, relative to its kind's first row
    rows: int  # stream rows it occupies
    bytes: int  # HBM bytes streamed
    format: str = "bf16"  # the parts' storage format (one format a segment)
    chunk_rows: int = CHUNK  # rows of one chunk of a (not transposed) column block
    tail_rows: int = 0  # rows of a chunk of the transposed last column block (0: none)
    chunks_per_bank: int = 16
    code_rows: int = CHUNK  # bf16 rows of one chunk's codes
    scale_rows: int = 0  # bf16 rows of one chunk's scales
    scale_row: int = 0  # first row of a bank's scale region

    @property
    def chunks(self) -> int:
        return self.k_chunks * self.col_blocks

    @property
    def blocks(self) -> int:
        """Its column blocks of `chunk_rows`-row chunks (the tail block not counted)."""
        return self.col_blocks - (self.tail_rows > 0)

    def bank_span(self, kind_first: int, bank_rows: int) -> tuple[int, int]:
        """The first and last bank it occupies when its kind starts at row `kind_first`."""
        start = kind_first + self.offset
        return start // bank_rows, (start + self.rows - 1) // bank_rows

    @property
    def weight_bytes(self) -> int:
        """The bytes of the weights it holds, in their format, without padding."""
        return parse_format(self.format).matrix_bytes(self.fan_in, self.fan_out)


class KindStream(PlanModel):
    kind: str
    type: str
    segments: list[Segment]
    rows: int  # stream rows from its first row to the end of its last segment
    aligned: bool  # it holds a quantized segment: it starts on a bank

    def segment(self, name: str) -> Segment:
        return next(s for s in self.segments if s.name == name)

    def group(self, name: str) -> list[Segment]:
        """The segments of a fused group (one, or one per format: name, name.1, ...)."""
        return [s for s in self.segments if s.name == name or s.name.startswith(name + ".")]


class DraftStream(PlanModel):
    """A fused drafter's segments in the stream (mkgen/plan/fused.py): before each pass
    its eh_proj, after it the LM head again."""

    eh_proj: Segment
    eh_proj_rows: list[int]  # first stream row of each pass's eh_proj
    head_rows: list[int]  # of the LM head after each pass


class StreamPlan(PlanModel):
    bank_rows: int
    bank_bytes: int
    ring_depth: int
    # The refills of the last `held_refills` used-up banks wait until a collective round's
    # copies are under way, so that they stream while it travels (plan_program scores it);
    # each round starts the oldest `refills_per_round` of them (the banks its flight covers).
    held_refills: int = 0
    refills_per_round: int = 1
    attention: dict[str, KindStream]
    ffn: dict[str, KindStream]
    tail: list[Segment]  # lm_head
    attention_rows: list[int]  # first stream row of each layer's attention segments
    ffn_rows: list[int]  # first stream row of each layer's FFN segments
    lm_head_row: int
    total_rows: int  # rows that hold segments (the last bank is padded past them)
    total_banks: int
    weight_bytes: int  # the weights the banks hold per step, in their formats, unpadded
    draft: DraftStream | None = None  # a fused drafter's eh_proj and heads (None: none)

    @model_serializer(mode="wrap")
    def _without_draft(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A build that fuses no drafter dumps as before (plan.json unchanged).
        data: dict[str, Any] = handler(self)
        if self.draft is None:
            data.pop("draft", None)
        return data

    @property
    def bytes_per_step(self) -> int:
        return self.total_banks * self.bank_bytes

    @property
    def padding_bytes(self) -> int:
        """Streamed bytes that carry no weight: chunk, column-block and bank padding."""
        return self.bytes_per_step - self.weight_bytes

    @property
    def padding_percent(self) -> float:
        return 100 * self.padding_bytes / self.bytes_per_step

    def describe(self) -> str:
        return (
            f"stream: {self.total_banks} banks of {self.bank_bytes / 2**20:.2f} MiB per core "
            f"per step ({self.bytes_per_step / 2**20:.1f} MiB), padding "
            f"{self.padding_bytes / 2**20:.1f} MiB ({self.padding_percent:.2f} % of the "
            "streamed bytes)"
        )


def chunk_rows(fmt_text: str) -> tuple[int, int]:
    """(code rows, scale rows) of one CHUNK x LANES chunk in bf16 rows of a bank.

    Codes: CHUNK x code bits / 16 rows. Scales, as the format stores them: int8 one f32
    per column; fp8:B one f32 per B x B block, repeated over its B columns; int4:G one
    bf16 per G rows and column; mxfp4 / nvfp4 one byte per 32 / 16 rows and column."""
    fmt = parse_format(fmt_text)
    codes = CHUNK * fmt.code_bits // 16
    scales = {
        "bf16": 0,
        "int8": 2,
        "fp8": 2 * CHUNK // (fmt.group or 1),
        "int4": CHUNK // (fmt.group or 1),
    }.get(fmt.kind, CHUNK // (fmt.block or 1) // 2)
    return codes, max(scales, 1) if fmt.kind != "bf16" else 0


def make_segment(
    name: str,
    parts: list[Part],
    fan_in: int,
    fan_out: int,
    offset: int,
    bank_rows: int,
    fmt: str = "bf16",
) -> Segment:
    """A segment of `fmt` from stream row `offset` on (a quantized one rounds it up to a
    bank: its banks end with their chunks' scales)."""
    k_chunks, col_blocks = cdiv(fan_in, CHUNK), cdiv(fan_out, LANES)
    if fmt == "bf16":
        # As many chunks as CHUNK-row ones would need (as many dots), as few rows as that
        # allows: the fan-in spread evenly over them, or CHUNK-row chunks with a narrow
        # last column block stored transposed (its input chunks are CHUNK wide too).
        def rows_of(chunk: int, tail: int) -> int:
            return (col_blocks - (tail > 0)) * k_chunks * chunk + k_chunks * tail

        edge = round_up(fan_out % LANES, BF16_TILE_ROWS)
        shapes = [(round_up(cdiv(fan_in, k_chunks), BF16_TILE_ROWS), 0)]
        shapes += [(CHUNK, edge)] if edge else []
        chunk, tail = min(shapes, key=lambda shape: rows_of(*shape))
        rows = rows_of(chunk, tail)
        chunking = {"chunk_rows": chunk, "tail_rows": tail}
    else:
        code_rows, scale_rows = chunk_rows(fmt)
        per_bank = bank_rows // code_rows
        while per_bank and per_bank * code_rows + round_up(
            per_bank * scale_rows, BF16_TILE_ROWS
        ) > (bank_rows):
            per_bank -= 1
        if per_bank == 0:
            raise SpecError(f"{name}: a {bank_rows}-row bank cannot hold one {fmt} chunk")
        rows = cdiv(k_chunks * col_blocks, per_bank) * bank_rows
        offset = round_up(offset, bank_rows)
        chunking = {
            "chunks_per_bank": per_bank,
            "code_rows": code_rows,
            "scale_rows": scale_rows,
            "scale_row": per_bank * code_rows if scale_rows else 0,
        }
    return Segment(
        name=name,
        parts=parts,
        fan_in=fan_in,
        fan_out=fan_out,
        k_chunks=k_chunks,
        col_blocks=col_blocks,
        offset=offset,
        rows=rows,
        bytes=rows * LANES * BF16_BYTES,
        format=fmt,
        **chunking,
    )


def _format_runs(present: list[TensorShard]) -> list[list[TensorShard]]:
    """Consecutive fused tensors grouped by format: different formats never share a segment."""
    runs: list[list[TensorShard]] = []
    for shard in present:
        if runs and runs[-1][-1].format == shard.format:
            runs[-1].append(shard)
        else:
            runs.append([shard])
    return runs


def _kind_stream(
    kind: str,
    spec_kind,
    fused: FusedSegments,
    views: dict[tuple[str, str], TensorView],
    shards: tuple[TensorShard, ...],
    devices: int,
    bank_rows: int,
) -> KindStream:
    """A kind's segments: its tensors fused as its rule `fused` says (tensors fused into
    one segment read the same input; the order is the kernel's), each read through its
    view in `views` if it has one."""
    by_name = {s.name: s for s in shards}
    segments: list[Segment] = []
    offset = 0
    for name, members in fused:
        present = [by_name[m] for m in members if m in by_name]
        # A fused group whose tensors differ in format splits into segments "in",
        # "in.1", ... that read the same input (their outputs side by side).
        for i, run in enumerate(_format_runs(present)):
            parts = [part_of(s, devices, views.get((name, s.name))) for s in run]
            shapes = [p.view.shape(s.global_shape) if p.view else s.global_shape
                      for p, s in zip(parts, run, strict=True)]  # fmt: skip
            if parts[0].axis == -2:
                # A row-split matrix (wo, w_down, ...) is a segment of its own: [K / parts, N].
                if len(run) != 1:
                    raise AssertionError(f"{kind}.{name}: a row-split matrix fused with others")
                fan_in, fan_out = parts[0].size, shapes[0][1]
            else:
                fan_in, fan_out = shapes[0][0], sum(p.size for p in parts)
                if any(s[0] != fan_in for s in shapes):
                    raise AssertionError(f"{kind}.{name}: fused tensors disagree on fan-in")
            label = name if i == 0 else f"{name}.{i}"
            segment = make_segment(label, parts, fan_in, fan_out, offset, bank_rows, run[0].format)
            segments.append(segment)
            offset = segment.offset + segment.rows
    aligned = any(s.format != "bf16" for s in segments)
    return KindStream(
        kind=kind, type=spec_kind.type, segments=segments, rows=offset, aligned=aligned
    )


class BankVisit(PlanModel):
    """Chunks of a segment read in a row, from the one that first reaches into `bank`
    (None: chunks in a bank an earlier chunk reached) to the next such chunk; the first
    of them also reads `banks[0]` when it straddles into `bank` from the bank before."""

    bank: int | None
    banks: tuple[int, ...]  # every bank the chunks read, in order
    chunks: int
    macs: int  # multiply-adds per input row: chunk count x CHUNK x LANES (one dot each)


def bank_visits(seg: Segment, first_row: int, bank_rows: int) -> list[BankVisit]:
    """How the kernel reads `seg`, which starts at stream row `first_row`: bf16 chunk by
    chunk (a chunk that reaches into a new bank waits for it), quantized bank by bank."""
    return list(
        _bank_visits(
            seg.format != "bf16", first_row, bank_rows, seg.chunks_per_bank, seg.k_chunks,
            seg.col_blocks, seg.chunk_rows, seg.tail_rows,
        )
    )  # fmt: skip


@lru_cache(maxsize=65536)
def _bank_visits(
    quantized: bool, first_row: int, bank_rows: int, per_bank: int, k_chunks: int,
    col_blocks: int, chunk_rows: int, tail_rows: int,
) -> tuple[BankVisit, ...]:  # fmt: skip
    """bank_visits by the segment fields it reads: every layer of a kind, and every program
    the planner scores, reads the same segments from the same rows."""
    chunks = k_chunks * col_blocks
    if quantized:
        first_bank = first_row // bank_rows
        return tuple(
            BankVisit(
                bank=first_bank + j,
                banks=(first_bank + j,),
                chunks=min(per_bank, chunks - j * per_bank),
                macs=min(per_bank, chunks - j * per_bank) * CHUNK * LANES,
            )
            for j in range(cdiv(chunks, per_bank))
        )
    blocks = col_blocks - (tail_rows > 0)
    sizes = [chunk_rows] * (blocks * k_chunks) + [tail_rows] * (k_chunks if tail_rows else 0)
    # [bank, banks, chunks] of each visit, counted here and made models once.
    counts: list[list] = []
    row = first_row
    for size in sizes:
        lo, hi = row // bank_rows, (row + size - 1) // bank_rows
        reached = hi * bank_rows >= row
        if reached or not counts:
            counts.append([hi if reached else None, tuple(range(lo, hi + 1)), 0])
        counts[-1][2] += 1
        row += size
    return tuple(
        BankVisit(bank=bank, banks=banks, chunks=n, macs=n * CHUNK * LANES)
        for bank, banks, n in counts
    )


class RingRefills:
    """The ring's refill rule, as the kernel's WeightStream runs it: reaching bank b means
    bank b - 1 is used up and its slot takes bank b - 1 + depth, unless that refill is among
    the last `held` ones, which wait for a collective round's copies to be under way; each
    round then starts the oldest `per_round` of them, as many as stream while it travels.
    The program builder and the deadlock check replay the same rule."""

    def __init__(self, depth: int, held: int, per_round: int) -> None:
        self.depth = depth
        self.held = held
        self.per_round = per_round
        self.waiting: list[int] = []  # held refills (their banks), oldest first

    def reach(self, bank: int) -> int | None:
        """Bank `bank` (> 0) reached: the refill that starts now, if any."""
        self.waiting.append(bank - 1 + self.depth)
        return self.waiting.pop(0) if len(self.waiting) > self.held else None

    def release(self) -> list[int]:
        """A collective round's copies are under way: the oldest held refills start."""
        released, self.waiting = self.waiting[: self.per_round], self.waiting[self.per_round :]
        return released


def choose_ring(bank_rows: int, vmem_for_ring: int) -> int:
    """Banks in flight: as many as fit the VMEM set aside for the ring, within the ring's
    bounds (MIN_RING_DEPTH to MAX_RING_DEPTH, the ones --ring-depth has).

    The hand-written Kimi K3 kernel kept 12 banks of 2 MiB (about 24 MiB) in flight;
    more depth buys nothing once the DMA engine is never idle."""
    depth = vmem_for_ring // (bank_rows * LANES * BF16_BYTES)
    if depth < MIN_RING_DEPTH:
        raise SpecError(
            f"the VMEM budget leaves {vmem_for_ring} bytes for the weight ring, less than "
            f"{MIN_RING_DEPTH} {bank_rows * LANES * BF16_BYTES}-byte banks; raise --vmem-budget "
            "or lower the bank size"
        )
    return min(depth, MAX_RING_DEPTH)


def plan_stream(
    spec, sharding: ShardingPlan, *, bank_rows: int, ring_depth: int, kinds: KindRegistry
) -> StreamPlan:
    """The weight stream of `spec` as `sharding` split it, each kind's tensors fused into
    segments as its rule in `kinds` says."""
    devices = sharding.devices

    def kind_stream(name: str, kind, shards: tuple[TensorShard, ...]) -> KindStream:
        rules = kinds.rules(kind.type, name)
        return _kind_stream(name, kind, rules.SEGMENTS, rules.views(kind), shards, devices,
                            bank_rows)  # fmt: skip

    attention = {name: kind_stream(name, spec.attention_kinds[name], s.tensors)
                 for name, s in sharding.attention.items()}  # fmt: skip
    ffn = {name: kind_stream(name, spec.ffn_kinds[name], s.tensors)
           for name, s in sharding.ffn.items()}  # fmt: skip
    attention_rows: list[int] = []
    ffn_rows: list[int] = []
    row, weight_bytes = 0, 0

    def place(kind: KindStream) -> int:
        return round_up(row, bank_rows) if kind.aligned else row

    lm_shard = next((t for t in sharding.globals if t.name == "lm_head"), None)
    if lm_shard is None:
        raise SpecError("tied embeddings are not supported by the weight stream yet")
    lm_part = part_of(lm_shard, devices)
    lm_head = make_segment(
        "lm_head", [lm_part], spec.dims.hidden, lm_part.size, 0, bank_rows, lm_shard.format
    )
    passes = sharding.draft_passes
    eh_proj, eh_proj_rows, head_rows = None, [], []
    if passes is not None:
        eh_shard = sharding.shard_of(MODULE_PREFIX + "eh_proj")
        eh_part = part_of(eh_shard, devices)
        eh_proj = make_segment("eh_proj", [eh_part], 2 * spec.dims.hidden, eh_part.size, 0,
                               bank_rows, eh_shard.format)  # fmt: skip

    def segment_at(seg: Segment) -> int:
        """Place a whole segment (the LM head, eh_proj) after `row`; its first row."""
        nonlocal row, weight_bytes
        first = round_up(row, bank_rows) if seg.format != "bf16" else row
        row, weight_bytes = first + seg.rows, weight_bytes + seg.weight_bytes
        return first

    lm_head_row = -1
    for layer, (attn_name, ffn_name) in enumerate(spec.layer_table()):
        if eh_proj is not None and passes is not None and layer in passes.layers:
            if layer == passes.first_layer:
                lm_head_row = segment_at(lm_head)  # the target's head, then the passes
            eh_proj_rows.append(segment_at(eh_proj))
        for kind, firsts in ((attention[attn_name], attention_rows), (ffn[ffn_name], ffn_rows)):
            firsts.append(place(kind))
            row = firsts[-1] + kind.rows
            weight_bytes += sum(s.weight_bytes for s in kind.segments)
        if eh_proj_rows and len(head_rows) < len(eh_proj_rows):
            head_rows.append(segment_at(lm_head))  # the pass's draft
    if eh_proj is None:
        lm_head_row = segment_at(lm_head)
    draft = None
    if eh_proj is not None:
        draft = DraftStream(eh_proj=eh_proj, eh_proj_rows=eh_proj_rows, head_rows=head_rows)
    total_rows = row
    total_banks = cdiv(total_rows, bank_rows)
    return StreamPlan(
        bank_rows=bank_rows,
        bank_bytes=bank_rows * LANES * BF16_BYTES,
        ring_depth=ring_depth,
        attention=attention,
        ffn=ffn,
        tail=[lm_head],
        attention_rows=attention_rows,
        ffn_rows=ffn_rows,
        lm_head_row=lm_head_row,
        total_rows=total_rows,
        total_banks=total_banks,
        weight_bytes=weight_bytes,
        draft=draft,
    )
