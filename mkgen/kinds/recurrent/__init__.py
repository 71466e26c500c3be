"""What Gated DeltaNet and KDA share: a causal conv with its tail, then the delta rule on
an f32 state per head, rows in order (macros.py.j2 beside it). Each kind's
module gives its per-core head dims and its layout's own fields."""

from __future__ import annotations

import functools
from typing import Any

from mkgen.kinds.common import no_cache_geometry, no_rotary_dim, no_views
from mkgen.kinds.recurrent.record import RecurrentLayout
from mkgen.plan.kind import BufferInputs, LayoutInputs, StateDims, Step
from mkgen.plan.layout import (
    CacheArray,
    VectorRow,
    check_stream_formats,
    segment_columns,
    unsupported,
)
from mkgen.plan.sharding import CacheShard
from mkgen.plan.stream import part_of
from mkgen.spec.figures import CACHE_BYTES, STATE_BYTES

SLAB_VECTORS = None  # every vector-family tensor takes its rows (conv taps: one per tap)


rotary_dim = no_rotary_dim  # no positions: the recurrence carries order
cache_geometry = no_cache_geometry  # its state replaces a KV cache
views = no_views  # every tensor as stored


def state_cache(
    heads_per_rank: int, state_elements: int, conv_channels: int, conv_width: int, why: str
) -> CacheShard:
    """A recurrent layer's cache on a rank, per sequence: its f32 state and the bf16 tail
    (conv_width - 1 taps) of its conv channels; fixed in size, held by one rank."""
    return CacheShard(
        kind="state",
        bytes_per_token=0,
        fixed_bytes=state_elements * STATE_BYTES + (conv_width - 1) * conv_channels * CACHE_BYTES,
        window=None,
        heads_per_rank=heads_per_rank,
        copies=1.0,
        why=why,
    )


def ops(own: list[str]) -> list[str]:
    """A recurrent layer's ops in the order its kernel function runs them, with the kind's
    `own` (its low-rank projections and gates) after the input projection: the program
    emits them in this order and the template prints them in it (RecurrentLayout.ops).
    The current conv tails and states are started in first ("state_in") and the snapshots'
    copies out waited only after the output projection ("state_out"), so that both travel
    while the core projects."""
    return ["state_in", "in", *own, "state", "output", "o", "state_out", "combine"]


def layout(i: LayoutInputs, dims: dict[str, int], extra: dict[str, Any]) -> RecurrentLayout:
    """The layout of a recurrent kind with per-core head `dims` (key_heads, value_heads,
    group, key_dim, value_dim) and the kind's own fields `extra` (its `ops` among them)."""
    check_stream_formats(f"attention_kinds.{i.name}", i.segments, fused=False)
    kind, shard = i.kind, i.shard
    batch, rows = i.options.batch, i.options.rows
    if shard.latent == "split":
        unsupported(f"attention_kinds.{i.name}: low-rank gate projections split over cores")
    parts = {t.name: part_of(t, i.devices) for t in shard.tensors}
    width = kind.conv_width
    vectors, row = [], 2  # rows 0 and 1 hold the layer's attn_norm and ffn_norm
    for n in ("conv_q", "conv_k", "conv_v"):
        size = parts[f"attn.{n}"].size
        vectors.append(VectorRow(name=n, row=row, part=parts[f"attn.{n}"], length=size, rows=width))
        row += width
    for n in ("A_log", "dt_bias", "o_norm"):
        size = parts[f"attn.{n}"].size
        vectors.append(VectorRow(name=n, row=row, part=parts[f"attn.{n}"], length=size))
        row += 1
    channels = sum(parts[f"attn.{n}"].size for n in ("conv_q", "conv_k", "conv_v"))
    # One snapshot after each row of a step: the runner keeps the one after the last
    # accepted draft row (a rejected draft must not advance the recurrence).
    state = [len(i.layers), batch, rows, dims["value_heads"], dims["key_dim"], dims["value_dim"]]
    return RecurrentLayout(
        type=kind.type,
        name=i.name,
        index=i.index,
        layers=i.layers,
        conv_width=width,
        channels=channels,
        columns=segment_columns(i.segments, "in", "attn."),
        segments=i.segments,
        vectors=vectors,
        caches=[
            CacheArray(
                name="conv",
                shape=[len(i.layers), batch, rows, width - 1, channels],
                dtype="bfloat16",
            ),
            CacheArray(name="state", shape=state, dtype="float32"),
        ],  # fmt: skip
        state_slots=i.state_slots,
        **dims,
        **extra,
    )


def buffers(out: Any, i: BufferInputs, state: StateDims) -> None:
    """The conv tail and state of every sequence after each of its rows, the current ones
    read at the top of the layer, all written back at its end; `state` is the kind's
    (state heads, key dim, value dim, conv channels) per core."""
    heads, dk, dv, conv = state.heads, state.key_dim, state.value_dim, state.channels
    name, b, rows = i.name, i.state_slots or i.dims.batch, i.dims.rows
    which = f"of {b} sequences streamed in turn" if i.state_slots else "of every sequence"
    out.add(f"{name}_conv_vmem", "attention", (b, rows, i.kind.conv_width - 1, conv), "bf16",
            resource=f"{name}.state", slots=i.state_slots or 1,
            why=f"conv tail {which} after each row")  # fmt: skip
    out.add(f"{name}_state_vmem", "attention", (b, rows, heads, dk, dv), "f32",
            resource=f"{name}.state", slots=i.state_slots or 1,
            why=f"recurrent state {which} after each row")  # fmt: skip
    out.sems(f"{name}_cache_sems", (2, b))


def program(b: Any, s: Step, state: StateDims, ops: list[str]) -> int:
    """The layer's `ops`: the current conv tails and states in started, the input
    projection (and KDA's low-rank up-projections), conv and gates, the rows in order (their
    states in waited), the snapshot after every row out, output norm and gate, output
    projection, the snapshots' copies out waited, all-reduce; `state` is the kind's (state
    heads, key dim, value dim, conv channels) per core."""
    layer, name, v = s.layer, s.name, s.vectors
    h = b.dims.hidden
    y = s.x
    writes: list[int] = []
    for op in ops:
        if op == "gates":
            y = b.vec(layer, f"{name}: conv, gates", y, 8 * b.t * h, ((v, None, 0),))
        elif op == "state_in":
            first_read = _state_in(b, layer, name, s.shard)
        elif op == "state":
            y, writes = _state_update(b, layer, name, s.shard, y, state, first_read)
        elif op == "state_out":
            for wr in writes:
                b.wait(wr)
        elif op == "output":
            y = b.vec(layer, f"{name}: output norm, gate", y, 6 * b.t * h, ((v, None, 0),))
        elif op == "combine":
            y = b.collective(layer, s.collectives.get("attn_out"), y)
        else:  # in, KDA's f_b and g_b: stream matmuls
            y = b.segment(layer, name, s.segments[op], s.stream_row, y)
            if op == "in":  # KDA's low-rank gate inputs' all-gather when they are split
                y = b.collective(layer, s.collectives.get("kda_gate_rank"), y)
    return y


def _state_copy(b: Any, layer: int, name: str, a: Any, seq: int | None, out: bool,
                reads: tuple = ()) -> int:  # fmt: skip
    """The copy of conv tails and states in (`out` False: each sequence's current one) or
    of the snapshots after every row out: every sequence's (`seq` None), or sequence
    `seq`'s through its slot when the VMEM plan streams them a sequence at a time."""
    batch, slots = b.dims.batch, b.vmem.state_slots
    nbytes = a.cache.fixed_bytes * (b.dims.rows if out else 1)
    cat = "state_write" if out else "state_read"
    res = None if out else f"{name}.state"
    if seq is None:
        what = "snapshots after each row out" if out else "conv tails and states in"
        sems = b.block_sems(f"{name}_cache_sems", (2, batch))
        return b.dma(cat, f"L{layer} {name}: {what}", layer, res, 0, sems, batch * nbytes,
                     count=len(sems), reads=reads)  # fmt: skip
    what = "snapshots after each row out" if out else "conv tail and state in"
    s = seq % slots
    sems = b.block_sems(f"{name}_cache_sems", (2, slots))
    return b.dma(cat, f"L{layer} {name}: sequence {seq} {what}", layer, res, s,
                 (sems[s], sems[slots + s]), nbytes, count=2, reads=reads)  # fmt: skip


def _state_in(b: Any, layer: int, name: str, a: Any) -> int:
    """The layer's first op: start the conv tails and states in (sequence 0's alone when
    they are streamed a sequence at a time). They need only the positions' slots, so they
    travel while the core projects."""
    rd = _state_copy(b, layer, name, a, 0 if b.vmem.state_slots else None, out=False)
    b.start(rd)
    return rd


def _state_update(b: Any, layer: int, name: str, a: Any, y: int, state: StateDims,
                  rd: int) -> tuple[int, list[int]]:  # fmt: skip
    """The rows in order after the copy in `rd` (_state_in) is waited, the snapshot after
    every row started back to HBM; streamed a sequence at a time when the VMEM plan keeps
    only `state_slots` sequences (_streamed_state_update). Returns the last row's op and
    the copies out still to wait."""
    batch, slots = b.dims.batch, b.vmem.state_slots
    heads, dk, dv = state.heads, state.key_dim, state.value_dim
    res = f"{name}.state"
    if slots:
        return _streamed_state_update(b, layer, name, a, y, state, rd)
    b.wait(rd)
    prev = rd
    for seq in range(batch):  # each sequence updates its own part of the buffers
        prev = b.run(
            "recurrent", f"L{layer} {name}: conv, delta rule, sequence {seq}", layer,
            8 * b.o.rows * heads * dk * dv, ((prev, res, 0), (y, None, 0)),
            writes=(res, 0),
        )  # fmt: skip
    wr = _state_copy(b, layer, name, a, None, out=True, reads=((prev, res, 0),))
    b.start(wr)
    return prev, [wr]


def _streamed_state_update(b: Any, layer: int, name: str, a: Any, y: int,
                           state: StateDims, first: int) -> tuple[int, list[int]]:  # fmt: skip
    """The template's streamed order after sequence 0's conv tail and state in (`first`,
    started by _state_in): for each sequence, the next one's in once the snapshots of the
    one before it in its slot are out, its own in waited, its rows, its snapshots out; the
    copies out still travelling at the end are returned, to be waited after the output
    projection."""
    batch, slots = b.dims.batch, b.vmem.state_slots
    res = f"{name}.state"
    ops = 8 * b.o.rows * state.heads * state.key_dim * state.value_dim
    copy = functools.partial(_state_copy, b, layer, name, a)
    reads, writes = {0: first}, {}
    prev = y
    for seq in range(batch):
        if seq + 1 < batch:
            if seq + 1 - slots in writes:
                b.wait(writes.pop(seq + 1 - slots))
            reads[seq + 1] = copy(seq + 1, False)
            b.start(reads[seq + 1])
        rd = reads.pop(seq)
        b.wait(rd)
        prev = b.run("recurrent", f"L{layer} {name}: conv, delta rule, sequence {seq}", layer,
                     ops, ((rd, res, seq % slots), (y, None, 0)),
                     writes=(res, seq % slots))  # fmt: skip
        writes[seq] = copy(seq, True, reads=((prev, res, seq % slots),))
        b.start(writes[seq])
    return prev, list(writes.values())
