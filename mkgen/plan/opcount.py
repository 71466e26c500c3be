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
- DMAs: the schedule's DMAs of each category, per step.

A vector op works on one (8, 128) 32-bit vreg: a [rows, width] f32 elementwise op
costs ceil(rows / 8) x ceil(width / 128) ops. Nothing here is fitted to the compiled
counts; the chunk figures are a measurement of the template's own ring on one chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from mkgen.hardware import IssueRates

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
# as a spec writes it: ops of one 256 x 256 chunk product with its accumulate, of
# one input chunk (_to_chunks) and of one output block (zeroed, read back), for 8 and
# 16 token rows. With the weights passed as an input block instead of scratch, bf16
# came to 171 vector ALU ops a chunk (an input block gets another VMEM tiling than the
# ring's slots); that is likely why an earlier single-chunk compile of a bare dot gave
# 269 for bf16 and 1,287 for mxfp4 (39 MXU ops, as here).
CHUNK_OPS: dict[tuple[str, int], OpCounts] = {
    ("bf16", 8): OpCounts(vpu=11, mxu=39, loads=35, stores=2),
    ("bf16", 16): OpCounts(vpu=8, mxu=39, loads=38, stores=4),
    ("mxfp4", 8): OpCounts(vpu=1221, mxu=39, loads=13.3, stores=2),
    ("mxfp4", 16): OpCounts(vpu=1218, mxu=39, loads=16.3, stores=4),
    ("int4:128", 8): OpCounts(vpu=245.3, mxu=78, loads=12, stores=2),
    ("int4:128", 16): OpCounts(vpu=255.3, mxu=78, loads=15, stores=4),
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
COMBINE_OPS = 2  # per vreg of an expert's output: weight x y, + acc

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


def model_op_counts(
    schedule: Any, stream: Any, vmem: Any, sharding: Any, spec: Any
) -> tuple[dict[str, OpCounts], list[str]]:
    """(phase -> the model's ops per step, formats the model has no measurement for), from
    a build's schedule, weight stream, VMEM plan and sharding (the plan's pieces)."""
    from mkgen.kinds.cache_attention import kv_tiles, q_rows

    out = {p: OpCounts() for p in PHASES}
    unpriced: set[str] = set()
    dims = vmem.dims
    tp = dims.tokens_padded

    def matmul(phase: str, fmt: str, k: int, c: int, times: float) -> None:
        try:
            out[phase].add_all(ring_matmul_ops(fmt, k, c, tp), times)
        except KeyError:
            unpriced.add(fmt)

    layer_kinds = [tuple(k.split("/")) for k in schedule.layer_kinds]
    attention_layers = {a: sum(1 for x, _ in layer_kinds if x == a) for a, _ in layer_kinds}
    ffn_layers = {f: sum(1 for _, y in layer_kinds if y == f) for _, f in layer_kinds}

    # ---- stream matmul
    for name, n in attention_layers.items():
        for seg in stream.attention[name].segments:
            matmul("stream matmul", seg.format, seg.k_chunks, seg.col_blocks, n)
    for name, n in ffn_layers.items():
        for seg in stream.ffn[name].segments:
            matmul("stream matmul", seg.format, seg.k_chunks, seg.col_blocks, n)
    for seg in stream.tail:
        matmul("stream matmul", seg.format, seg.k_chunks, seg.col_blocks, 1)

    # ---- experts: the plan's expected experts per core in each MoE layer
    for layer, (n, _pieces) in schedule.experts_per_layer.items():
        e = vmem.experts[layer_kinds[layer][1]]
        matmul("experts", e.format, e.gate_up_k_chunks, e.gate_up_col_blocks, n)
        matmul("experts", e.format, e.down_k_chunks, e.down_col_blocks, n)
        elementwise = ACTIVATION_OPS * vregs(tp, e.width) + COMBINE_OPS * vregs(tp, e.d)
        out["experts"].vpu += n * elementwise

    # ---- attention: KV tiles over a full cache
    for name, n_layers in attention_layers.items():
        kind = spec.attention_kinds[name]
        a = sharding.attention[name]
        tile = dims.kv_tile
        if kind.type == "gqa":
            groups = a.kv_heads_per_rank
            rows = q_rows(a.heads_per_rank // groups, dims.rows)
            key, value = kind.head_dim, kind.head_dim
            window = kind.sliding_window
        elif kind.type == "mla":
            groups = 1
            rows = q_rows(a.heads_per_rank, dims.rows)
            key, value = kind.kv_lora_rank + kind.qk_rope_head_dim, kind.kv_lora_rank
            window = None
        else:
            continue  # recurrent kinds read no KV tiles
        tiles = dims.batch * groups * kv_tiles(dims.context, tile, window, dims.rows)
        per_tile = OpCounts(
            vpu=SCORE_OPS * vregs(rows, tile) + VALUE_OPS * vregs(rows, value) + TILE_STATE_OPS,
            mxu=MXU_OPS_PER_WEIGHT_TILE * (_weight_tiles(key, tile) + _weight_tiles(tile, value)),
        )
        out["attention"].add_all(per_tile, tiles * n_layers)

    # ---- compute nodes priced by their elementwise flops
    tokens = dims.tokens
    stages = dims.collectives.stages
    slots = sum(stage.size for stage in stages)
    for node in schedule.nodes:
        if node.is_dma:
            # A collective's group counts its sends and its receives; a core issues the sends.
            issued = node.count // 2 if node.cat == "collective" else node.count
            out[DMA_PHASE.get(node.cat, "vector")].dmas += issued * node.repeat
            continue
        if node.cat in ("matmul", "expert_mm", "attention") or "expert" in node.name:
            continue  # priced above (an expert's activation and sum with its experts)
        phase = COMPUTE_PHASE.get(node.cat, "vector")
        if node.cat == "routing":
            kind = spec.ffn_kinds[layer_kinds[node.layer][1]]
            ops = (SOFTMAX_OPS + TOP_K_OPS * kind.top_k) * vregs(tp, kind.num_experts)
        elif node.cat == "collective":
            # A sum adds each stage's other members' slots; a concatenation only copies.
            width = node.flops // (slots * tp)  # the schedule's: slots x padded rows x width
            adds = slots - len(stages) if node.name.endswith(": sum") else 0
            ops = adds * vregs(tp, width)
        else:
            # flops count tokens x width x ops per element; a vreg holds 8 rows x 128 lanes
            ops = node.flops / tokens / 128 * math.ceil(tp / 8)
        out[phase].vpu += ops * node.repeat
    return out, sorted(unpriced)
