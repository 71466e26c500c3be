"""The VMEM plan: every buffer one core keeps in VMEM, padded as Mosaic pads it.

For the kinds the code generator renders (GQA, MLA, Gated DeltaNet and KDA attention, dense
and MoE FFNs with bf16, int4, mxfp4 or fp8 experts) the scratch list is exactly ``_scratch_shapes()`` of
``templates/megakernel.py.j2``, in the same order (SMEM arrays and semaphores
included), followed by the kernel's VMEM-resident inputs and outputs (final norm,
RoPE tables, logits, tokens; the embedded rows stay in HBM, copied into the residual
stream). For the other kinds the plan lists
the buffers the kernel design implies (docs/planner.md):

- MoE with experts in formats the template does not read yet (nvfp4, int8): the
  same piece slots, codes and scales in their own dtypes (mkgen.plan.layout's
  ExpertChunks, the single source of the pieces' shapes).

Mosaic pads the two minor dims of every buffer to its native tile ((8,128) 32-bit,
(16,128) bf16, (32,128) 8-bit; ``mkgen.hardware.vmem_padded_bytes``). Large values
live in Mosaic's own scratch, which the plan estimates (category ``internal``) so
that the planned figure is not below what the compiled kernel really uses
(tests/test_plan_graph.py holds it against a real TPU7x compile).

The explicit buffers must fit the budget (BuildOptions.vmem_budget_bytes or the
chip's default, 58 of TPU7x's 64 MiB); the estimate of Mosaic's scratch must fit
in the rest of the limit, less the 64 KiB Mosaic keeps of it (Chip.vmem_usable_bytes).
The ring depth and the expert slot count are chosen here, under the budget.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict

from mkgen.errors import SpecError
from mkgen.hardware import MiB, vmem_padded_bytes
from mkgen.plan.collectives import CollectivePlan, greedy_scheme, layer_uses, plan_collectives
from mkgen.plan.fused import DRAFT_NORMS
from mkgen.plan.kind import BufferInputs, KindRegistry
from mkgen.plan.layout import MAX_PIECE_CHUNKS, ExpertChunks, draft_hidden_states, row_block
from mkgen.plan.options import BuildOptions, cache_block, kv_tile
from mkgen.plan.sharding import ShardingPlan, TensorShard
from mkgen.plan.stream import CHUNK, LANES, StreamPlan, choose_ring, round_up
from mkgen.spec.schema import (
    ModelSpec,
)
from mkgen.spec.topology import Topology, parse_topology

# Tuning choice (measurements.md): 3/4/5/6/8 expert slots measured 668/653/685/690/824 us
# over 8 Muse Spark layers; 4 was best, so 4 is the most the plan asks for.
MAX_EXPERT_SLOTS = 4
# Tuning choice: VMEM set aside for banks in flight, 16 x 2 MiB (the most the ring has).
# The hand-written Kimi K3 kernel kept 12; with ring refills held for the collectives'
# flights every held refill takes a slot, and 16 was predicted faster than 12 for every
# checked-in build that holds any (none slower).
RING_VMEM_BYTES = 32 * 1024 * 1024
# Tuning choice: the ring is worth more than a fourth expert slot only while it is
# shallow; below half the design depth slots give way first.
RING_COMFORT_FRACTION = 0.5
# Design choice: a recurrent kind that streams its sequences' conv tails and states keeps
# two in VMEM, the one it updates and the next one's copy in (the template's order).
STATE_SLOTS = 2
# Fit to compiles (_buffers): 675,840 B at 32 token rows (21,120 B a row) alone, and at 64
# rows with the snapshots in HBM too, 57,344 B more than 64 rows of 5,376 lanes and the
# snapshots' estimate: 22,528 B a row (5,632 f32 lanes) holds both.
STREAMED_STATES_LANES = 5632
SUBLANES_F32 = 8
GREEDY_LANES = 128  # (max, argmax) per row, padded to one lane row
# The ring's slots are followed by a copy of the first CHUNK rows of slot 0 (the wrap).
RING_WRAP_BYTES = CHUNK * LANES * 2

Category = Literal[
    "ring",
    "expert_slots",
    "collectives",
    "attention",
    "vectors",
    "logits",
    "activations",
    "internal",
]
CATEGORIES: tuple[str, ...] = get_args(Category)
DTYPE_BITS = {"f32": 32, "int32": 32, "uint32": 32, "bf16": 16, "int8": 8, "fp8": 8}


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class VmemBuffer(_Frozen):
    """One VMEM array of the kernel."""

    name: str  # the kernel's ref name (memory-space suffix included)
    category: str
    role: Literal["scratch", "input", "output", "internal"]
    shape: tuple[int, ...]
    dtype: str  # f32, bf16, int32, int8, fp8 (e4m3)
    bytes: int  # after Mosaic's tile padding
    # The schedule resource this buffer backs ("" when the schedule does not track it);
    # its leading dim is the resource's slot count.
    resource: str = ""
    why: str = ""

    def describe(self) -> str:
        return (
            f"{self.name:<34} {self.category:<12} {self.role:<8} {str(list(self.shape)):<26} "
            f"{self.dtype:<5} {self.bytes / MiB:9.3f} MiB" + (f"  {self.why}" if self.why else "")
        )


class SemaphoreArray(_Frozen):
    """DMA semaphores of the kernel (semaphore memory, not VMEM)."""

    name: str
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)


class SmemArray(_Frozen):
    """A scalar-memory scratch array of the kernel (expert ids and lists)."""

    name: str
    shape: tuple[int, ...]
    dtype: str


class KernelDims(_Frozen):
    """The kernel constants every VMEM buffer and the schedule derive from."""

    devices: int
    batch: int
    rows: int
    tokens: int
    tokens_padded: int  # token rows rounded up to 8 f32 sublanes
    hidden: int
    context: int
    # Cache tokens per streamed KV tile of each cache attention kind (mkgen.plan.kvtiles)
    kv_tiles: dict[str, int]
    cache_block: int  # cache rows rewritten around a step's new entries
    max_k_chunks: int  # largest stream segment fan-in, in CHUNK rows
    max_col_blocks: int  # largest stream segment fan-out, in LANES columns
    vector_rows: int  # rows of one layer's vector slab
    vector_width: int
    vocab_per_core: int
    bank_rows: int
    max_piece_chunks: int  # an expert piece's 256 x 256 chunks at most
    # mxfp4 / nvfp4 scales inline after their codes (the template's); False: apart, as the
    # measured Muse Spark kernel moves them (mkgen.plan.calibration)
    inline_scales: bool
    bank_bytes: int
    layers: int
    # Each collective of a layer has its own landing buffer (the kernel's rule): the most
    # collectives one layer runs, at least 2; rows per stage slot (mkgen.plan.collectives).
    collective_buffers: int
    collectives: CollectivePlan


class VmemPlan(_Frozen):
    """Every VMEM buffer of one core, the chosen ring depth and expert slots, the budget."""

    dims: KernelDims
    buffers: tuple[VmemBuffer, ...]
    semaphores: tuple[SemaphoreArray, ...]
    smem: tuple[SmemArray, ...]
    experts: dict[str, ExpertChunks]  # MoE kind -> how its experts stream
    resources: dict[str, int]  # schedule resource -> slots
    # Scratch buffers, SMEM arrays and semaphore arrays in the pallas_call's order (for the
    # kinds the template renders: exactly its _scratch_shapes()).
    scratch_order: tuple[str, ...]
    ring_depth: int
    expert_slots: int  # 0 without routed experts
    expert_slot_bytes: int  # one slot of every MoE kind together
    # The attention-residual snapshots live in HBM (a kernel output), read back one at a
    # time, rather than in VMEM (_kernel_modes)
    snapshots_in_hbm: bool = False
    # The recurrent kinds' sequences in VMEM at once, streamed in turn (0: every sequence)
    state_slots: int = 0
    budget_bytes: int
    limit_bytes: int
    explicit_bytes: int  # scratch + VMEM-resident inputs and outputs
    internal_bytes: int  # estimate of Mosaic's own scratch for large values
    why: str

    @property
    def total_bytes(self) -> int:
        """What Mosaic should report for the kernel: explicit + its own scratch."""
        return self.explicit_bytes + self.internal_bytes

    @property
    def by_category(self) -> dict[str, int]:
        out = dict.fromkeys(CATEGORIES, 0)
        for b in self.buffers:
            out[b.category] += b.bytes
        return out

    @property
    def within_budget(self) -> bool:
        return self.explicit_bytes <= self.budget_bytes and self.total_bytes <= self.limit_bytes

    def scratch_shapes(self) -> list[tuple[str, tuple[int, ...], str]]:
        """(name, shape, dtype) of the call's scratch in order; dtype "dma_sem" for
        semaphores, "smem:<dtype>" for SMEM arrays."""
        buffers = {b.name: b for b in self.buffers}
        sems = {s.name: s for s in self.semaphores}
        smem = {s.name: s for s in self.smem}
        out = []
        for name in self.scratch_order:
            if name in buffers:
                out.append((name, buffers[name].shape, buffers[name].dtype))
            elif name in smem:
                out.append((name, smem[name].shape, f"smem:{smem[name].dtype}"))
            else:
                out.append((name, sems[name].shape, "dma_sem"))
        return out

    def buffer(self, name: str) -> VmemBuffer:
        for b in self.buffers:
            if b.name == name:
                return b
        raise KeyError(name)

    def describe(self) -> str:
        lines = [
            f"VMEM per core: {self.total_bytes / MiB:.2f} MiB ({self.explicit_bytes / MiB:.2f} "
            f"explicit, budget {self.budget_bytes / MiB:.1f}; {self.internal_bytes / MiB:.2f} "
            f"Mosaic scratch (estimate), limit {self.limit_bytes / MiB:.1f}); {self.why}"
        ]
        for cat, nbytes in self.by_category.items():
            if nbytes:
                lines.append(f"  {cat:<13} {nbytes / MiB:9.3f} MiB")
        lines += ["  " + b.describe() for b in self.buffers]
        return "\n".join(lines)


# --------------------------------------------------------------------------- dims


def _vector_rows(
    shards: tuple[TensorShard, ...], kept: tuple[str, ...] | None
) -> tuple[int, list[int]]:
    """(rows in the layer's vector slab, lengths) of one kind's small vectors.

    A kind keeps the rows its module's SLAB_VECTORS names (GQA: q_norm, k_norm, biases,
    sinks) or, None, one row per vector-family tensor row (a conv kernel [width, dim]
    takes width rows).
    """
    rows, lengths = 0, []
    for t in shards:
        if t.family != "vectors":
            continue
        name = t.name.split(".", 1)[1]
        if kept is not None and name not in kept:
            continue
        rows += math.prod(t.rank_shape[:-1]) if len(t.rank_shape) > 1 else 1
        lengths.append(t.rank_shape[-1])
    return rows, lengths


def cache_kinds(
    spec: ModelSpec, sharding: ShardingPlan, kinds: KindRegistry, rows: int
) -> list[str]:
    """The attention kinds that stream a KV cache in tiles (not the recurrent ones), in
    the spec's order."""
    return [
        name for name, kind in spec.attention_kinds.items()
        if kinds.rules(kind.type, f"attention_kinds.{name}").cache_geometry(
            kind, sharding.attention[name], rows) is not None
    ]  # fmt: skip


def kernel_dims(
    spec: ModelSpec,
    sharding: ShardingPlan,
    stream: StreamPlan,
    options: BuildOptions,
    kinds: KindRegistry,
    max_piece_chunks: int = MAX_PIECE_CHUNKS,
    kv_tiles: Mapping[str, int] | None = None,
    inline_scales: bool = True,
) -> KernelDims:
    """The kernel's constants, derived as mkgen.plan.layout derives them (`kv_tiles`: the
    KV tile of each cache attention kind; None: every one at the context rule's,
    options.kv_tile)."""
    h = spec.dims.hidden
    segments = [s for k in stream.attention.values() for s in k.segments]
    segments += [s for k in stream.ffn.values() for s in k.segments] + list(stream.tail)
    attn_rows, lengths = 0, []
    for name, a in sharding.attention.items():
        kind = spec.attention_kinds[name]
        slab = kinds.rules(kind.type, f"attention_kinds.{name}").SLAB_VECTORS
        r, ls = _vector_rows(a.tensors, slab)
        attn_rows, lengths = max(attn_rows, r), lengths + ls
    ffn_rows = 0
    for f in sharding.ffn.values():
        r, ls = _vector_rows(f.tensors, None)
        ffn_rows, lengths = max(ffn_rows, r), lengths + ls
    collectives = plan_collectives(
        parse_topology(sharding.topology), layer_uses(sharding), greedy_scheme(sharding)
    )
    tokens = options.tokens
    return KernelDims(
        devices=sharding.devices,
        batch=options.batch,
        rows=options.rows,
        tokens=tokens,
        tokens_padded=round_up(tokens, SUBLANES_F32),
        hidden=h,
        context=options.context,
        kv_tiles=dict(
            kv_tiles
            or dict.fromkeys(
                cache_kinds(spec, sharding, kinds, options.rows), kv_tile(options.context)
            )
        ),  # fmt: skip
        cache_block=cache_block(options.rows, options.context),
        max_k_chunks=max(s.k_chunks for s in segments),
        max_col_blocks=max(s.col_blocks for s in segments),
        # rows 0 and 1: attn_norm, ffn_norm; the last: a block's attention-residual logits
        vector_rows=2 + attn_rows + ffn_rows + (1 if spec.attention_residual else 0),
        vector_width=round_up(max([h, *lengths]), 128),
        vocab_per_core=stream.tail[0].fan_out,
        bank_rows=stream.bank_rows,
        bank_bytes=stream.bank_bytes,
        max_piece_chunks=max_piece_chunks,
        inline_scales=inline_scales,
        layers=len(sharding.layer_table),
        collective_buffers=len(collectives.buffers),
        collectives=collectives,
    )


# --------------------------------------------------------------------------- buffers


class _List:
    def __init__(self) -> None:
        self.buffers: list[VmemBuffer] = []
        self.semaphores: list[SemaphoreArray] = []
        self.smem: list[SmemArray] = []
        self.resources: dict[str, int] = {}
        self.order: list[str] = []  # scratch, SMEM and semaphores, in the call's order
        self.experts: dict[str, ExpertChunks] = {}

    def add(
        self,
        name: str,
        category: str,
        shape: tuple[int, ...],
        dtype: str,
        role: str = "scratch",
        resource: str = "",
        why: str = "",
        slots: int = 1,
    ) -> None:
        nbytes = vmem_padded_bytes(tuple(shape), DTYPE_BITS[dtype])
        if role != "scratch" and len(shape) == 2 and shape[0] == 1:
            # XLA lays one-row operands out with (1, 128) tiles (T(1,128) in the HLO).
            nbytes = round_up(shape[1], 128) * DTYPE_BITS[dtype] // 8
        if resource:
            self.resources[resource] = slots
        if role == "scratch":
            self.order.append(name)
        self.buffers.append(
            VmemBuffer(
                name=name,
                category=category,
                role=role,
                shape=tuple(shape),
                dtype=dtype,
                bytes=nbytes,
                resource=resource,
                why=why,
            )  # fmt: skip
        )

    def sems(self, name: str, shape: tuple[int, ...]) -> None:
        self.semaphores.append(SemaphoreArray(name=name, shape=tuple(shape)))
        self.order.append(name)

    def scalar(self, name: str, shape: tuple[int, ...], dtype: str = "int32") -> None:
        self.smem.append(SmemArray(name=name, shape=tuple(shape), dtype=dtype))
        self.order.append(name)


def _slot_bytes(e: ExpertChunks) -> int:
    """VMEM bytes of one expert piece slot (codes, and scales when the format has them)."""
    return sum(
        vmem_padded_bytes((rows, LANES), DTYPE_BITS[dtype]) for rows, dtype in e.array_shapes
    )


def _base(out: _List, dims: KernelDims, depth: int) -> None:
    """The template's kind-independent scratch, in its order."""
    tp, h, cb = dims.tokens_padded, dims.hidden, dims.collective_buffers
    coll = dims.collectives
    # The slots as one run of rows, then the first CHUNK rows of the bank in slot 0 again:
    # a chunk that reaches from the last slot into the first reads on past the last slot.
    out.add("ring_vmem", "ring", (depth * dims.bank_rows + CHUNK, LANES), "bf16",
            resource="ring", slots=depth,
            why=f"{depth} weight banks in flight, then the wrap")  # fmt: skip
    out.sems("ring_sems", (depth + 1,))
    if dims.devices > 1:  # the refills held for collectives (WeightStream.release_held)
        out.scalar("ring_held_smem", (2,))
    out.add("xk_vmem", "activations", (dims.max_k_chunks, tp, CHUNK), "bf16",
            why="a matmul's input, chunked")  # fmt: skip
    out.add("acc_vmem", "activations", (dims.max_col_blocks, tp, LANES), "f32",
            why="a matmul's output, by column block")  # fmt: skip
    out.add("vec_vmem", "vectors", (2, dims.vector_rows, dims.vector_width), "f32",
            resource="vectors", slots=2, why="this layer's and the next layer's vectors")  # fmt: skip
    out.sems("vec_sems", (2,))
    out.add("x_res_vmem", "activations", (tp, h), "f32", why="the residual stream")
    # One landing buffer per collective of a layer (the schedule's resource "gather",
    # slot k), each with a slot per round member (the sum of the staged group sizes, or D
    # where a flat round lands in it); 32-bit words: an f32 or two bf16 values each.
    for b in coll.buffers:
        out.add(f"collective{b.index}_vmem", "collectives", (b.slots + b.send_rows, tp, b.width),
                "uint32", why=f"landing slots of every round for {', '.join(b.uses) or 'nothing'}"
                + (f", {b.send_rows} reduce-scatter staging rows" if b.send_rows else ""))  # fmt: skip
    out.resources["gather"] = cb
    out.sems("send_sems", (cb, coll.slots))
    out.sems("recv_sems", (cb, coll.slots))
    out.add("greedy_vmem", "logits", (coll.slots, tp, GREEDY_LANES), "f32", resource="greedy",
            why="(max, argmax) of the round members' vocabulary shards")  # fmt: skip
    out.sems("greedy_sems", (2, coll.slots))


def _buffers(
    spec: ModelSpec,
    sharding: ShardingPlan,
    stream: StreamPlan,
    kinds: KindRegistry,
    dims: KernelDims,
    depth: int,
    slots: int,
    modes: tuple[bool, int] = (False, 0),
) -> tuple[_List, int]:
    """The buffers with a ring of `depth` banks, `slots` expert slots and the kernel
    `modes` (attention-residual snapshots in HBM, recurrent state slots: _kernel_modes)."""
    snapshots_in_hbm, state_slots = modes
    out = _List()
    _base(out, dims, depth)
    used = [(n, spec.attention_kinds[n], a) for n, a in sharding.attention.items()]
    used += [(n, spec.ffn_kinds[n], f) for n, f in sharding.ffn.items()]
    for name, kind, shard in used:  # used kinds, in spec order: attention, then FFN
        inputs = BufferInputs(
            name=name, kind=kind, shard=shard, dims=dims, stream=stream,
            expert_slots=max(slots, 1), expert_format=sharding.quantization["experts"],
            state_slots=state_slots,
        )  # fmt: skip
        kinds.rules(kind.type, name).buffers(out, inputs)
    slot_bytes = sum(_slot_bytes(e) for e in out.experts.values())
    tp, h = dims.tokens_padded, dims.hidden
    if spec.attention_residual and snapshots_in_hbm:
        out.add("snapshot_vmem", "activations", (row_block(tp), h), "f32", resource="snapshot",
                why="a row block of an attention-residual snapshot read back from HBM")  # fmt: skip
        out.sems("snapshot_sems", (1,))
    elif spec.attention_residual:
        r = spec.attention_residual
        out.add("snapshots_vmem", "activations", (r.max_snapshots, tp, h), "f32",
                why="attention-residual snapshots")  # fmt: skip
    passes = sharding.draft_passes
    if passes is not None:  # a fused drafter (mkgen/plan/fused.py)
        out.add("embed_vmem", "activations", (tp, 1, h), "bf16",
                why="the embedding row of each pass row's token")  # fmt: skip
        out.add("pass_tokens_vmem", "logits", (tp, GREEDY_LANES), "int32",
                why="a pass's greedy tokens, copied to SMEM")  # fmt: skip
        out.sems("draft_sems", (2,))
        out.scalar("greedy_smem", (tp, GREEDY_LANES))
        out.scalar("draft_smem", (1 + passes.passes, dims.batch))
        out.scalar("pass_positions_smem", (dims.batch,))
    # VMEM-resident inputs and outputs of the pallas_call (in call order).
    out.add("final_norm_vmem", "vectors", (1, h), "f32", "input")
    rotary = [(name, rot) for name in sharding.attention
              if (rot := kinds.rules(spec.attention_kinds[name].type, name).rotary_dim(
                  spec.attention_kinds[name]))]  # fmt: skip
    for name, rot in rotary:
        out.add(f"{name}_cos_vmem", "attention", (tp, rot // 2), "f32", "input")
        out.add(f"{name}_sin_vmem", "attention", (tp, rot // 2), "f32", "input")
    fused = sharding.draft_passes is not None
    if fused:  # the MTP module's norms; RoPE at each sequence's next 2 x rows positions
        out.add("draft_norms_vmem", "vectors", (len(DRAFT_NORMS), h), "f32", "input")
        for name, rot in rotary:
            for table in ("cos", "sin"):
                out.add(f"{name}_draft_{table}_vmem", "attention",
                        (dims.batch, 2 * dims.rows, rot // 2), "f32", "input")  # fmt: skip
    out.add("logits_vmem", "logits", (tp, dims.vocab_per_core), "f32", "output")
    out.add("tokens_vmem", "logits", (tp, GREEDY_LANES), "int32", "output")
    if fused:
        out.add("drafts_vmem", "logits", (round_up(dims.batch, SUBLANES_F32), GREEDY_LANES),
                "int32", "output", why="each sequence's accepted rows and drafts")  # fmt: skip
    needed = len(draft_hidden_states(spec, dims.rows))
    if needed:
        out.add("draft_hidden_vmem", "activations", (needed, tp, h), "f32", "output",
                why="the target's hidden states the drafter reads")  # fmt: skip
    _mosaic_scratch(out, spec, sharding, kinds, dims, modes)
    return out, slot_bytes


def _mosaic_scratch(
    out: _List, spec: ModelSpec, sharding: ShardingPlan, kinds: KindRegistry,
    dims: KernelDims, modes: tuple[bool, int],
) -> None:  # fmt: skip
    """The estimate of Mosaic's own scratch (category internal), checked against compiles."""
    snapshots_in_hbm, state_slots = modes
    tp, h = dims.tokens_padded, dims.hidden
    # Mosaic keeps large values (a matmul's concatenated output, the residual rows and
    # their normed copy) in its own scratch: an estimate, checked against compiles.
    widest = max(dims.max_col_blocks * LANES, h)
    out.add("mosaic_values", "internal", (2, tp, widest), "f32", "internal",
            why="estimate: two live matmul outputs")  # fmt: skip
    states = []  # the recurrent kinds' (state heads, key dim, value dim, channels)
    for name, shard in sharding.attention.items():
        kind = spec.attention_kinds[name]
        state = kinds.rules(kind.type, name).state_dims(kind, shard)
        if state is not None:
            states.append(state)
    if states:  # the delta rule keeps one sequence's head states as values
        largest = max(states, key=lambda s: s.heads * s.key_dim * s.value_dim)
        heads, dk, dv = largest.heads, largest.key_dim, largest.value_dim
        out.add("mosaic_states", "internal", (heads, dk, dv), "f32", "internal",
                why="estimate: one sequence's recurrent states")  # fmt: skip
    # The layer's add reads the stream a row block at a time (kernellib/residual.py
    # _add_to_stream), so only the normed rows stay whole: with the stream held across the
    # layer too, Kimi K3 at batch 8 x rows 8 compiled to 1.75 MiB ([64, 7168] f32) more.
    out.add("mosaic_hidden", "internal", (1, tp, h), "f32", "internal",
            why="estimate: the normed rows")  # fmt: skip
    # The compact modes' own scratch, fit to compiles of Kimi K3 at batch 4 x rows 8 on 2x2x4
    # (32 token rows), each mode alone: Mosaic used 229,376 B more than the plan without
    # these with the snapshots in HBM, 675,840 B more with the states streamed
    # (docs/planner.md#5-the-vmem-plan); the states' grows with the token rows, the
    # snapshots' with the rows of the mixing's row block (32 rows in the fit).
    if spec.attention_residual and snapshots_in_hbm:
        out.add("mosaic_snapshot_mix", "internal", (row_block(tp), h // 4), "f32",
                "internal", why="estimate (fit to compiles): mixing a row block of snapshots "
                "read back from HBM")  # fmt: skip
    if state_slots:
        out.add("mosaic_streamed_states", "internal", (tp, STREAMED_STATES_LANES), "f32",
                "internal", why="estimate (fit to compiles): states streamed a sequence at a time")  # fmt: skip
    wires = [w for b in dims.collectives.buffers for *_, ws in b.wires for w in ws]
    bf16_lanes = [lanes for *_, wire, lanes in wires if wire == "bf16"]
    if bf16_lanes:  # a bf16 piece unpacked: its high and low halves side by side, and
        # the packed words they come from (without those, kimi-k2 on 2x2x4 compiled to
        # 35,568,128 B of VMEM against 35,553,280 B planned: tests/test_codegen.py)
        out.add("mosaic_wire", "internal", (1, tp, 3 * max(bf16_lanes)), "f32", "internal",
                why="estimate: a bf16 wire piece, packed and unpacked to f32")  # fmt: skip


# --------------------------------------------------------------------------- the plan


def _mib(n: float) -> str:
    return f"{n / MiB:.1f} MiB"


def _largest(buffers: list[VmemBuffer], n: int = 3) -> str:
    top = sorted(buffers, key=lambda b: -b.bytes)[:n]
    return ", ".join(f"{b.name} {list(b.shape)} {_mib(b.bytes)}" for b in top)


def comfort_depth(bank: int, target: int = RING_VMEM_BYTES) -> int:
    """The ring depth the plan gives every byte to before a second expert slot."""
    return max(2, int(target * RING_COMFORT_FRACTION) // bank)


def _expert_slots(
    options: BuildOptions,
    ring_depth: int | None,
    where: str,
    left: int,
    bank: int,
    slot_bytes: int,
    target: int,
) -> int:
    """Expert piece slots: the forced count, or as many as leave the ring its comfort depth
    (half the design depth, or all but one slot's worth if less), up to MAX_EXPERT_SLOTS."""
    forced = options.expert_slots
    if not slot_bytes:
        if forced is not None:
            raise SpecError(f"--expert-slots {forced}: {where} has no routed experts")
        return 0
    if left < 2 * bank + (forced or 1) * slot_bytes:
        raise SpecError(
            f"VMEM: {where} leaves {_mib(left)} for the weight ring and expert slots, less "
            f"than two {_mib(bank)} banks and {forced or 1} {_mib(slot_bytes)} expert slot(s); "
            "raise --vmem-budget or lower --batch/--rows" + (" or --expert-slots" if forced else "")
        )
    if forced is not None:
        return forced
    comfort = comfort_depth(bank, target) * bank
    if ring_depth is not None:
        comfort = ring_depth * bank
    ring_floor = min(comfort, left - slot_bytes)
    return max(1, min(MAX_EXPERT_SLOTS, (left - ring_floor) // slot_bytes))


def plan_vmem(
    spec: ModelSpec,
    topo: Topology,
    options: BuildOptions,
    sharding: ShardingPlan,
    stream: StreamPlan,
    *,
    kinds: KindRegistry,
    ring_target_bytes: int | None = None,
    max_piece_chunks: int = MAX_PIECE_CHUNKS,
    ring_depth: int | None = None,
    kv_tiles: Mapping[str, int] | None = None,
    inline_scales: bool = True,
) -> VmemPlan:
    """Every VMEM buffer, each layer kind's as its rule in `kinds` declares them, with the
    ring depth and expert slots chosen under the budget (`kv_tiles`: as kernel_dims').

    Raises a one-line SpecError with the numbers when the fixed buffers exceed the budget,
    when the budget cannot hold one weight bank, or when it cannot hold two banks and
    one expert slot.
    """
    chip = topo.chip_info
    limit = chip.vmem_usable_bytes
    budget = options.vmem_budget_bytes or chip.vmem_budget_bytes
    if budget > limit:
        raise SpecError(
            f"--vmem-budget {_mib(budget)}: exceeds the {_mib(limit)} of VMEM a {chip.name} kernel "
            "may use (its VMEM limit less the 64 KiB Mosaic keeps; the budget is the explicit "
            "VMEM the plan may allocate)"
        )
    target = ring_target_bytes or RING_VMEM_BYTES
    dims = kernel_dims(
        spec, sharding, stream, options, kinds, max_piece_chunks, kv_tiles, inline_scales
    )
    where = f"{spec.name} on {topo.name} (batch {options.batch} x rows {options.rows})"
    try:
        modes = _kernel_modes(spec, sharding, stream, kinds, dims, options, budget, limit)
        # Everything but the ring and the expert slots is fixed by the build.
        probe, slot_bytes = _buffers(spec, sharding, stream, kinds, dims, 1, 1, modes)
        left = _left_for_ring(probe, chip.name, options, budget, limit, where, dims.bank_bytes,
                              slot_bytes)  # fmt: skip
        depth, slots = _ring_and_slots(
            options, ring_depth, where, left, dims, slot_bytes, target, budget
        )
        out, _ = _buffers(spec, sharding, stream, kinds, dims, depth, slots, modes)
        explicit = sum(b.bytes for b in out.buffers if b.role != "internal")
        internal = sum(b.bytes for b in out.buffers if b.role == "internal")
        if explicit + internal > limit:
            raise SpecError(
                f"VMEM: {where} needs {_mib(explicit)} explicit + {_mib(internal)} of Mosaic "
                f"scratch (estimate) per core, over the {_mib(limit)} limit; lower "
                "--vmem-budget, --batch or --rows"
            )
    except SpecError as refusal:
        if any(r.name == "all" for r in dims.collectives.rounds):
            # A flat round lands a slot per core in its buffer: the staged rounds need fewer.
            raise SpecError(f"{refusal}, or run --collectives staged") from None
        raise
    why = f"ring {depth} x {_mib(dims.bank_bytes)}" + (
        f", {slots} expert piece slot(s) of {_mib(slot_bytes)}" if slots else ""
    )
    return VmemPlan(
        dims=dims,
        buffers=tuple(out.buffers),
        semaphores=tuple(out.semaphores),
        smem=tuple(out.smem),
        experts=dict(out.experts),
        resources=dict(out.resources),
        scratch_order=tuple(out.order),
        ring_depth=depth,
        expert_slots=slots,
        expert_slot_bytes=slot_bytes,
        snapshots_in_hbm=modes[0],
        state_slots=modes[1],
        budget_bytes=budget,
        limit_bytes=limit,
        explicit_bytes=explicit,
        internal_bytes=internal,
        why=why,
    )


def _kernel_modes(
    spec: ModelSpec, sharding: ShardingPlan, stream: StreamPlan, kinds: KindRegistry,
    dims: KernelDims, options: BuildOptions, budget: int, limit: int,
) -> tuple[bool, int]:  # fmt: skip
    """(attention-residual snapshots in HBM, recurrent state slots): as --residual-snapshots
    and --recurrent-states say, else the first of: everything in VMEM; the snapshots in HBM
    (their copies cost microseconds a step); the recurrent states also streamed a sequence
    at a time through STATE_SLOTS (a copy's wait a sequence), that leaves the ring two
    banks and one expert slot, or the last (whose refusal names what is still over)."""
    recurrent = any(
        kinds.rules(spec.attention_kinds[n].type, n).state_dims(spec.attention_kinds[n], a)
        for n, a in sharding.attention.items()
    )
    snapshots = (False, True) if spec.attention_residual else (False,)
    if options.residual_snapshots is not None:
        snapshots = (options.residual_snapshots == "hbm",)
    states = (0, STATE_SLOTS) if recurrent and dims.batch > STATE_SLOTS else (0,)
    if options.recurrent_states is not None:
        states = (STATE_SLOTS if options.recurrent_states == "stream" and recurrent else 0,)
    candidates = [(s, n) for n in states for s in snapshots]
    for modes in candidates:
        probe, slot_bytes = _buffers(spec, sharding, stream, kinds, dims, 1, 1, modes)
        total = sum(b.bytes for b in probe.buffers if b.category not in {"ring", "expert_slots"})
        internal = sum(b.bytes for b in probe.buffers if b.role == "internal")
        ring = 2 * dims.bank_bytes + RING_WRAP_BYTES
        if total + ring + slot_bytes <= min(budget + internal, limit):
            return modes
    return candidates[-1]


def _left_for_ring(
    probe: _List, chip: str, options: BuildOptions, budget: int, limit: int, where: str,
    bank: int, slot_bytes: int,
) -> int:  # fmt: skip
    """The VMEM the ring and the expert slots may share: the budget less the fixed buffers
    of `probe` (the buffers with one bank and one slot); refuses a budget that cannot hold
    them and one bank."""
    variable = {"ring", "expert_slots"}
    fixed_list = [b for b in probe.buffers if b.category not in variable and b.role != "internal"]
    fixed = sum(b.bytes for b in fixed_list)
    internal = sum(b.bytes for b in probe.buffers if b.role == "internal")
    # The chip's budget leaves the rest of the limit to Mosaic's own scratch; when the
    # estimate of that scratch needs more, the explicit buffers give way.
    usable = min(budget, limit - internal)
    if usable <= 0:
        raise SpecError(
            f"VMEM: {where}: Mosaic's own scratch for {options.tokens} token rows (estimated "
            f"{_mib(internal)}) alone exceeds {chip}'s {_mib(limit)} VMEM limit; lower "
            "--batch or --rows"
        )
    if fixed > usable:
        scratch = f" and {_mib(internal)} of Mosaic scratch" if usable < budget else ""
        raise SpecError(
            f"VMEM: {where} needs {_mib(fixed)} per core before the weight ring and expert "
            f"slots{scratch}, over the {_mib(usable)} it may use (largest: "
            f"{_largest(fixed_list)}); lower --batch or --rows (token rows size the collective "
            "and attention buffers)"
        )
    left = usable - fixed
    if left < bank:
        raise SpecError(
            f"--vmem-budget {_mib(budget)} is too small for one {_mib(bank)} weight bank: the "
            f"other buffers take {_mib(fixed)}, leaving {_mib(left)}; the ring needs at least "
            f"two banks ({_mib(fixed + 2 * bank + slot_bytes)}"
            + (" with one expert slot)" if slot_bytes else ")")
        )
    return left


def _ring_and_slots(
    options: BuildOptions, ring_depth: int | None, where: str, left: int, dims: KernelDims,
    slot_bytes: int, target: int, budget: int,
) -> tuple[int, int]:  # fmt: skip
    """The ring depth and expert slots sharing `left` bytes (forced or chosen)."""
    bank = dims.bank_bytes
    forced_depth = options.ring_depth or ring_depth
    slots = _expert_slots(options, forced_depth, where, left, bank, slot_bytes, target)
    if left - slots * slot_bytes < 2 * bank:
        raise SpecError(
            f"--vmem-budget {_mib(budget)} leaves {_mib(left - slots * slot_bytes)} for the "
            f"weight ring, less than two {_mib(bank)} banks; raise --vmem-budget"
        )
    ring_bytes = left - slots * slot_bytes - RING_WRAP_BYTES
    depth = forced_depth or choose_ring(dims.bank_rows, min(target, ring_bytes))
    if depth * bank > ring_bytes:
        raise SpecError(
            f"--ring-depth {depth}: {depth} banks of {_mib(bank)} need {_mib(depth * bank)}, but "
            f"{where} leaves {_mib(ring_bytes)} for the ring; lower --ring-depth"
        )
    return depth, slots
