"""Per-phase op counts of one decode step, as the model prices the plan (pure Python).

What `mkgen compile --profile` holds the compiled kernel's LLO against
(mkgen.verify.profile). Each phase is priced by the code path the template emits:

- stream matmul: every stream segment a step reads (each layer's attention and FFN
  segments, the lm_head) is one ring matmul: k_chunks x col_blocks chunk products in
  the segment's format, k_chunks input chunks written as bf16, col_blocks output
  blocks zeroed and read back. The ops of each are measured (below).
- experts: each MoE layer runs the experts the plan expects a core to hold, each a
  gate|up and a down ring matmul in the experts' format, plus its activation and
  weighted sum (elementwise, below).
- attention: per KV tile of each (sequence, kv head) pair over a full cache (the
  plan's tile count), two dots (scores, values) and the online softmax's elementwise
  ops; each dot costs the MXU ops of the 256 x 256 weight tiles it loads.
- routing, vector, collectives: the plan's compute nodes priced by their elementwise
  flops over (8, 128) f32 vregs, the routing's top-k by its argmax loop.
- recurrent: the delta rule's measured ops per row and head.
- DMAs: the schedule's DMAs of each category, per step.

A vector op works on one (8, 128) 32-bit vreg: a [rows, width] f32 elementwise op
costs ceil(rows / 8) x ceil(width / 128) ops. Nothing here is fitted to the compiled
counts; the chunk figures are a measurement of the template's own ring on one chunk.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from typing import Any

from mkgen.hardware import IssueRates
from mkgen.plan.collectives import RoundCall

PHASES = (
    "stream matmul",
    "experts",
    "attention",
    "recurrent",
    "routing",
    "collectives",
    "vector",
)


@dataclass
class OpCounts:
    """Ops of one phase per step, per core."""

    vpu: float = 0.0  # vector ALU ops (one vreg each)
    mxu: float = 0.0  # MXU ops: weight pushes and latches, LHS pushes, result pops
    loads: float = 0.0  # vector loads
    stores: float = 0.0  # vector stores
    dmas: float = 0.0  # DMAs issued

    def add(self, group: str, n: float) -> None:
        setattr(self, group, getattr(self, group) + n)

    def add_all(self, other: OpCounts, times: float = 1.0) -> None:
        for f in fields(self):
            self.add(f.name, getattr(other, f.name) * times)

    def any(self) -> bool:
        return any(getattr(self, f.name) for f in fields(self))


# Measured with scripts/measure_chunk_ops.py (libtpu 0.0.50.1; the template's Ring and
# chunk products compiled alone for one TPU7x core with Mosaic's LLO dump), per format
# as a spec writes it (routed experts; "stream:" the weight stream's quantized banks,
# read through a bitcast of the ring's bf16 rows): ops of one 256 x 256 chunk product
# with its accumulate, of one input chunk (_to_chunks) and of one output block (zeroed,
# read back), for 8 and 16 token rows. Every quantized format multiplies on the MXU in
# its codes' dtype (bf16 x int8 / int4 / fp8 e4m3; mxfp4 and nvfp4 codes turned into
# e4m3 by word ops), with group scales on a block-diagonal dot's partial products
# (docs/quantized-paths.md); dequantizing to bf16 on the VPU first cost 1,221 vector
# ALU ops a chunk for mxfp4 and 245 for int4:128. With the weights passed as an input
# block instead of scratch, bf16 came to 171 vector ALU ops a chunk (an input block gets
# another VMEM tiling than the ring's slots); that is likely why an earlier single-chunk
# compile of a bare dot gave 269 for bf16 and 1,287 for mxfp4 (39 MXU ops, as here).
CHUNK_OPS: dict[tuple[str, int], OpCounts] = {
    ("bf16", 8): OpCounts(vpu=11, mxu=39, loads=35, stores=2),
    ("bf16", 16): OpCounts(vpu=8, mxu=39, loads=38, stores=4),
    ("int8", 8): OpCounts(vpu=50, mxu=39, loads=20, stores=2),
    ("int8", 16): OpCounts(vpu=49, mxu=39, loads=23, stores=4),
    ("int4:128", 8): OpCounts(vpu=80, mxu=23, loads=12, stores=2),
    ("int4:128", 16): OpCounts(vpu=84, mxu=29, loads=15, stores=4),
    ("mxfp4", 8): OpCounts(vpu=218, mxu=41, loads=12, stores=2),
    ("mxfp4", 16): OpCounts(vpu=264, mxu=65, loads=15, stores=4),
    ("nvfp4", 8): OpCounts(vpu=334, mxu=65, loads=14, stores=2),
    ("nvfp4", 16): OpCounts(vpu=438, mxu=113, loads=17, stores=4),
    ("fp8:128", 8): OpCounts(vpu=38, mxu=23, loads=20, stores=2),
    ("fp8:128", 16): OpCounts(vpu=42, mxu=29, loads=23, stores=4),
    ("stream:int8", 8): OpCounts(vpu=65, mxu=39, loads=21, stores=2),
    ("stream:int8", 16): OpCounts(vpu=64, mxu=39, loads=24, stores=4),
    ("stream:fp8:128", 8): OpCounts(vpu=57, mxu=23, loads=21, stores=2),
    ("stream:fp8:128", 16): OpCounts(vpu=61, mxu=29, loads=24, stores=4),
}
INPUT_CHUNK_OPS = {8: OpCounts(vpu=8, stores=1), 16: OpCounts(vpu=2, stores=2)}
OUTPUT_BLOCK_OPS = {8: OpCounts(loads=4, stores=4), 16: OpCounts(loads=8, stores=8)}
MXU_OPS_PER_WEIGHT_TILE = 39  # one 256 x 256 weight tile, up to 16 rows (measured above)

# Elementwise ops per vreg, counted from the template's source (one VPU op per jnp
# elementwise op and per lane reduction), not measured:
SCORE_OPS = 12  # per score vreg of a KV tile: scale, key positions, mask, max, exp, sum, cast
VALUE_OPS = 2  # per output vreg of a KV tile: rescale and add
TILE_STATE_OPS = 6  # per KV tile: the running max and sum ([rows, 1])
SOFTMAX_OPS = 5  # per router score vreg: max, subtract, exp, sum, divide
# per score vreg and pick: the argmax (max, compare, select, index min, the index
# broadcast along lanes as 3 permute ops, compare, three selects) and the weight pick
# (compare, select, sum, select)
TOP_K_OPS = 16
ACTIVATION_OPS = 6  # per vreg of an expert's activation (silu: exp, add, recip, muls)

# One row of the template's _delta_rule_step on 128 x 128 f32 states (16 vregs), compiled
# alone (scripts/measure_chunk_ops.py delta_rule): (ops per head, ops per key head for
# what a key's heads share: Mosaic normalises the query and key once). Gated DeltaNet:
# one head 378 ops, two heads of a key 503; KDA: a key and a decay per key dim for every
# head. The conv and the layout changes around the rule are not priced.
DELTA_RULE_OPS = {"kda": (499, 0), "gated_deltanet": (125, 253)}
DELTA_RULE_STATE_VREGS = 16
COMBINE_OPS = 2  # per vreg of an expert's output: weight x y, + acc
# A bf16 collective round (templates: _to_wire, _from_wire), fitted to the compiled
# qwen3-30b-a3b 2x2x1 kernel (432 VPU ops per all-reduce of 16 f32 vregs over 8 members,
# of which 112 adds): rounding to bf16 and packing pairs per f32 vreg sent, masking and
# shifting the two halves per packed vreg received (every member's, this core's too).
WIRE_PACK_OPS = 12
WIRE_UNPACK_OPS = 2

# A schedule DMA category -> the phase whose code issues it.
DMA_PHASE = {
    "bank": "stream matmul",
    "expert": "experts",
    "ids": "experts",
    "kv_tile": "attention",
    "cache_read": "attention",
    "cache_write": "attention",
    "collective": "collectives",
}
# The schedule's names of an expert's activation and of its weighted sum into the output.
EXPERT_ACTIVATION = re.compile(r": expert [0-9]+ activation$")
EXPERT_COMBINE = "+= weight x expert"
# A schedule compute category -> the phase whose code runs it (the rest: vector).
COMPUTE_PHASE = {"routing": "routing", "collective": "collectives", "recurrent": "recurrent"}


def vregs(rows: int, width: int) -> int:
    return math.ceil(rows / 8) * math.ceil(width / 128)


def _rows_key(tokens_padded: int) -> int:
    # Measured at 8 and 16 rows; more rows are priced as 16 (an assumption).
    return 8 if tokens_padded <= 8 else 16


def ring_matmul_ops(fmt: str, k_chunks: int, col_blocks: int, tokens_padded: int) -> OpCounts:
    """One ring matmul of k_chunks x col_blocks chunks stored in `fmt`."""
    rows = _rows_key(tokens_padded)
    chunk = CHUNK_OPS.get((fmt, rows))
    if chunk is None:
        raise KeyError(fmt)
    out = OpCounts()
    out.add_all(chunk, k_chunks * col_blocks)
    out.add_all(INPUT_CHUNK_OPS[rows], k_chunks)
    out.add_all(OUTPUT_BLOCK_OPS[rows], col_blocks)
    return out


def _weight_tiles(k: int, n: int) -> int:
    return math.ceil(k / 256) * math.ceil(n / 256)


def bound_us(counts: OpCounts, rates: IssueRates) -> dict[str, float]:
    """Microseconds per step `counts` need at each unit's issue rate."""
    cycle_us = 1e6 / rates.clock_hz
    return {
        "vpu": counts.vpu / rates.vpu_ops_per_cycle * cycle_us,
        "mxu": counts.mxu / rates.mxu_ops_per_cycle * cycle_us,
        "load": max(
            counts.loads / rates.vector_loads_per_cycle,
            counts.stores / rates.vector_stores_per_cycle,
        )
        * cycle_us,
    }


def compute_timeline_us(counts: dict[str, OpCounts], rates: IssueRates) -> float:
    """The step's compute timeline: each phase at its slowest unit, phases in turn (the
    units of one phase overlap; the phases of a layer depend on each other)."""
    return sum(max(bound_us(c, rates).values()) for c in counts.values())


def node_op_counts(
    schedule: Any, stream: Any, vmem: Any, sharding: Any, spec: Any
) -> tuple[list[tuple[str, OpCounts]], list[str]]:
    """(phase, the model's ops of one run of the node) for every node of `schedule`, in
    node order, and the formats the model has no measurement for (their chunks count no
    ops): a build's schedule, weight stream, VMEM plan and sharding (the plan's pieces).

    A stream segment's and an expert's ring matmul is spread over its banks or pieces by
    the chunks each holds; a node's ops times its ``repeat`` summed per phase is
    `model_op_counts`. The cost model (mkgen.plan.cost) prices each node from these."""
    from mkgen.kinds.cache_attention import q_rows
    from mkgen.kinds.registry import kind_module

    unpriced: set[str] = set()
    dims = vmem.dims
    tp = dims.tokens_padded

    def ring_matmul(fmt: str, k: int, c: int) -> OpCounts:
        try:
            return ring_matmul_ops(fmt, k, c, tp)
        except KeyError:
            unpriced.add(fmt)
            return OpCounts()

    layer_kinds = [tuple(k.split("/")) for k in schedule.layer_kinds]

    # Each ring matmul node's share of its segment's matmul (by the chunks it reads): the
    # schedule keys it ("matmul", format, k_chunks, col_blocks, chunks, chunks read).
    def segment_share(key: tuple) -> OpCounts:
        _, fmt, k_chunks, col_blocks, chunks, read = key
        # A quantized bank is read through a bitcast of the ring's bf16 rows.
        whole = ring_matmul(fmt if fmt == "bf16" else f"stream:{fmt}", k_chunks, col_blocks)
        share = OpCounts()
        share.add_all(whole, read / chunks)
        return share

    # An expert piece's share of the expert's gate|up or down ring matmul.
    piece_ops: dict[tuple[str, bool], OpCounts] = {}
    for name, e in vmem.experts.items():
        for gate_up, k, c, pieces in (
            (True, e.gate_up_k_chunks, e.gate_up_col_blocks, e.gate_up_pieces),
            (False, e.down_k_chunks, e.down_col_blocks, e.pieces - e.gate_up_pieces),
        ):
            share = OpCounts()
            share.add_all(ring_matmul(e.format, k, c), 1 / max(1, pieces))
            piece_ops[(name, gate_up)] = share

    # One KV tile of each attention kind: two dots and the online softmax.
    tile_ops: dict[str, OpCounts] = {}
    for name, kind in spec.attention_kinds.items():
        a = sharding.attention[name]
        tile = dims.kv_tile
        if kind.type == "gqa":
            rows = q_rows(a.heads_per_rank // a.kv_heads_per_rank, dims.rows)
            key, value = kind.head_dim, kind.head_dim
        elif kind.type == "mla":
            rows = q_rows(a.heads_per_rank, dims.rows)
            key, value = kind.kv_lora_rank + kind.qk_rope_head_dim, kind.kv_lora_rank
        else:
            continue  # recurrent kinds read no KV tiles
        tile_ops[name] = OpCounts(
            vpu=SCORE_OPS * vregs(rows, tile) + VALUE_OPS * vregs(rows, value) + TILE_STATE_OPS,
            mxu=MXU_OPS_PER_WEIGHT_TILE * (_weight_tiles(key, tile) + _weight_tiles(tile, value)),
        )

    tokens = dims.tokens
    nodes = schedule.nodes
    out: list[tuple[str, OpCounts]] = []
    for node in nodes:
        if node.is_dma:
            # A collective's group counts its sends and its receives; a core issues the sends.
            issued = node.count // 2 if node.cat == "collective" else node.count
            out.append((DMA_PHASE.get(node.cat, "vector"), OpCounts(dmas=issued)))
            continue
        attn, ffn = layer_kinds[node.layer] if 0 <= node.layer < len(layer_kinds) else ("", "")
        if node.cat == "matmul":
            out.append(("stream matmul", segment_share(node.key)))
        elif node.cat == "expert_mm":
            piece = next(nodes[p].key[3] for p, res, _ in node.reads if res and p >= 0
                         and nodes[p].key and nodes[p].key[0] == "expert")  # fmt: skip
            out.append(("experts", piece_ops[(ffn, piece < vmem.experts[ffn].gate_up_pieces)]))
        elif node.cat == "attention":
            out.append(("attention", tile_ops[attn]))
        elif node.cat == "vector" and EXPERT_ACTIVATION.search(node.name):
            out.append(
                ("experts", OpCounts(vpu=ACTIVATION_OPS * vregs(tp, vmem.experts[ffn].width)))
            )
        elif node.cat == "vector" and EXPERT_COMBINE in node.name:
            out.append(("experts", OpCounts(vpu=COMBINE_OPS * vregs(tp, vmem.experts[ffn].d))))
        elif node.cat == "scalar":
            out.append(("experts", OpCounts()))  # the scalar unit's expert list: no vector ops
        elif node.cat == "routing":
            kind = spec.ffn_kinds[ffn]
            ops = (SOFTMAX_OPS + TOP_K_OPS * kind.top_k) * vregs(tp, kind.num_experts)
            out.append(("routing", OpCounts(vpu=ops)))
        elif node.cat == "recurrent":  # one sequence's rows, one head after another
            kind = spec.attention_kinds[attn]
            a = sharding.attention[attn]
            heads, dk, dv, _ = kind_module(kind.type, attn).state_dims(kind, a)
            keys = a.kv_heads_per_rank if kind.type == "gated_deltanet" else heads
            per_head, per_key = DELTA_RULE_OPS[kind.type]
            per_row = (heads * per_head + keys * per_key) * vregs(dk, dv) / DELTA_RULE_STATE_VREGS
            out.append((COMPUTE_PHASE.get(node.cat, "vector"), OpCounts(vpu=dims.rows * per_row)))
        elif node.cat == "collective":
            out.append(("collectives", OpCounts(vpu=_round_ops(node.collective, tp))))
        else:
            # flops count tokens x width x ops per element; a vreg holds 8 rows x 128 lanes
            ops = node.flops / tokens / 128 * math.ceil(tp / 8)
            out.append((COMPUTE_PHASE.get(node.cat, "vector"), OpCounts(vpu=ops)))
    return out, sorted(unpriced)


def model_op_counts(
    schedule: Any, stream: Any, vmem: Any, sharding: Any, spec: Any
) -> tuple[dict[str, OpCounts], list[str]]:
    """(phase -> the model's ops per step, formats the model has no measurement for): every
    node's ops (node_op_counts) times its repeat, summed per phase."""
    out = {p: OpCounts() for p in PHASES}
    per_node, unpriced = node_op_counts(schedule, stream, vmem, sharding, spec)
    for node, (phase, ops) in zip(schedule.nodes, per_node, strict=True):
        out[phase].add_all(ops, node.repeat)
    return out, unpriced


def _round_ops(call: RoundCall | None, tp: int) -> float:
    """VPU ops of a collective round's combine: a sum adds the other members' pieces (a
    concatenation only copies); a bf16 round also packs what it sends (a reduce-scatter
    every member's part) and unpacks every member's piece."""
    if call is None:  # the partial's rows written into the buffer
        return 0
    adds = (call.members - 1) * vregs(tp, call.columns) if call.op != "all_gather" else 0
    if call.wire != "bf16":
        return adds
    sent = call.columns * (call.members if call.op == "reduce_scatter" else 1)
    return (
        adds
        + WIRE_PACK_OPS * vregs(tp, sent)
        + WIRE_UNPACK_OPS * call.members * vregs(tp, call.lanes)
    )
