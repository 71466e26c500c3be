"""Per-phase op counts of one decode step, as the model prices the plan (pure Python).

What `mkgen compile --profile` holds the compiled kernel's LLO against
(mkgen.verify.profile). Each phase is priced by the code path the template emits:

- stream matmul: every stream segment a step reads (each layer's attention and FFN
  segments, the lm_head) is one ring matmul: k_chunks x col_blocks chunk products in
  the segment's format, k_chunks input chunks written as bf16, col_blocks output
  blocks zeroed and read back. The ops of each are measured (below).
- experts: each MoE layer runs the experts the plan expects a core to hold, each a
  gate|up and a down ring matmul in the experts' format, plus its activation and
  weighted sum (elementwise, below); before them the chosen experts' flags (vector
  ops) and the listing's scalar ops, counted in compiled kernels (below).
- attention: the template's `_attend_<kind>` and `_write_cache_<kind>` compiled alone
  (measured, below): per KV tile of each (sequence, kv head) pair over a full cache (the
  plan's tile count), per pair, and per pair and cache array for the cache write.
- vector: the norms (hidden rows, latents) and GQA's heads op (q/k norm and RoPE of
  each head) by the template's code compiled alone (measured, below); the other vector
  nodes (residual adds, heads -> rows, the greedy pick) by their elementwise flops.
- routing, collectives: the plan's compute nodes priced by their elementwise flops
  over (8, 128) f32 vregs, the routing's top-k by its argmax loop.
- recurrent: the delta rule's measured ops per row and head.
- DMAs: the schedule's DMAs of each category, per step.

A vector op works on one (8, 128) 32-bit vreg: a [rows, width] f32 elementwise op
costs ceil(rows / 8) x ceil(width / 128) ops. Nothing here is fitted to the compiled
counts; the chunk figures are a measurement of the template's own ring on one chunk.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from mkgen.hardware import IssueRates
from mkgen.plan.collectives import RoundCall
from mkgen.plan.kind import KindRegistry
from mkgen.plan.layout import experts_padded
from mkgen.plan.options import kv_tiles

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
    scalar: float = 0.0  # scalar ALU and SMEM ops (the compiled profile does not count them)

    def add(self, group: str, n: float) -> None:
        setattr(self, group, getattr(self, group) + n)

    def add_all(self, other: OpCounts, times: float = 1.0) -> None:
        # Field by field, not through dataclasses.fields(): the walk prices every node.
        self.vpu += other.vpu * times
        self.mxu += other.mxu * times
        self.loads += other.loads * times
        self.stores += other.stores * times
        self.dmas += other.dmas * times
        self.scalar += other.scalar * times

    def any(self) -> bool:
        return any(getattr(self, f.name) for f in fields(self))


# Measured with scripts/measure_chunk_ops.py (libtpu 0.0.50.1; the template's Ring and
# chunk products compiled alone for one TPU7x core with Mosaic's LLO dump), per format
# as a spec writes it (routed experts; "stream:" the weight stream's quantized banks,
# read through a bitcast of the ring's bf16 rows): ops of one 256 x 256 chunk product
# with its accumulate, of one input chunk (_to_chunks) and of one output block (zeroed,
# read back), for 8 and 16 token rows. Every quantized format but nvfp4 multiplies on the
# MXU in its codes' dtype (bf16 x int8 / int4 / fp8 e4m3; mxfp4 codes turned into e4m3 by
# word ops), with group scales on a block-diagonal dot's partial products
# (docs/quantized-paths.md); dequantizing to bf16 on the VPU first cost 1,221 vector
# ALU ops a chunk for mxfp4 (selects, f32) and 245 for int4:128. nvfp4 dequantizes in
# bf16 (codes e2m1 -> e4m3 -> bf16 by the VPU's converts, times each 16-row block's
# scale) and runs one bf16 dot: 204 / 203 vector ALU ops and 39 MXU ops at 8 / 16 rows.
# "nvfp4:block-diagonal" is the block-diagonal dot (16 groups) it ran before, measured by
# the same script (the table had 334 / 438 from an earlier harness): no build runs it; the
# calibration prices the measured Muse Spark kernel's nvfp4 rows below batch 8 with it,
# the product that kernel runs there (mkgen.plan.calibration.MEASURED_NVFP4_PRODUCT).
# With the weights passed as an input block instead of scratch, bf16 came to 171 vector
# ALU ops a chunk (an input block gets another VMEM tiling than the ring's slots); that
# is likely why an earlier single-chunk compile of a bare dot gave 269 for bf16 and 1,287
# for mxfp4 (39 MXU ops, as here).
CHUNK_OPS: dict[tuple[str, int], OpCounts] = {
    ("bf16", 8): OpCounts(vpu=11, mxu=39, loads=35, stores=2),
    ("bf16", 16): OpCounts(vpu=8, mxu=39, loads=38, stores=4),
    ("int8", 8): OpCounts(vpu=50, mxu=39, loads=20, stores=2),
    ("int8", 16): OpCounts(vpu=49, mxu=39, loads=23, stores=4),
    ("int4:128", 8): OpCounts(vpu=80, mxu=23, loads=12, stores=2),
    ("int4:128", 16): OpCounts(vpu=84, mxu=29, loads=15, stores=4),
    ("mxfp4", 8): OpCounts(vpu=218, mxu=41, loads=12, stores=2),
    ("mxfp4", 16): OpCounts(vpu=264, mxu=65, loads=15, stores=4),
    ("nvfp4", 8): OpCounts(vpu=204, mxu=39, loads=15, stores=2),
    ("nvfp4", 16): OpCounts(vpu=203, mxu=39, loads=18, stores=4),
    ("nvfp4:block-diagonal", 8): OpCounts(vpu=327, mxu=65, loads=15, stores=2),
    ("nvfp4:block-diagonal", 16): OpCounts(vpu=431, mxu=113, loads=18, stores=4),
    ("fp8:128", 8): OpCounts(vpu=38, mxu=23, loads=20, stores=2),
    ("fp8:128", 16): OpCounts(vpu=42, mxu=29, loads=23, stores=4),
    ("stream:int8", 8): OpCounts(vpu=65, mxu=39, loads=21, stores=2),
    ("stream:int8", 16): OpCounts(vpu=64, mxu=39, loads=24, stores=4),
    ("stream:fp8:128", 8): OpCounts(vpu=57, mxu=23, loads=21, stores=2),
    ("stream:fp8:128", 16): OpCounts(vpu=61, mxu=29, loads=24, stores=4),
}
INPUT_CHUNK_OPS = {8: OpCounts(vpu=8, stores=1), 16: OpCounts(vpu=2, stores=2)}

# Counted in the final LLO (libtpu 0.0.50.1, with debug info) of the template's expert
# listing (`_chosen_<kind>`, `_experts_<kind>`) of Mixtral 8x7B on 2x2x1 (no sharing, 8
# experts, top-2), Qwen3-30B-A3B on 2x2x1 (a ring of 4 groups, 128 experts, top-8) and Kimi
# K3 on 2x2x4 rows 8 (a ring of 8, 896 experts, top-16). The flags' vector ALU ops: 22,
# 148 and 1,424, which a base, 8 ops per top-k choice and vreg of [token rows, expert
# ids] (Mixtral's, one vreg) and with sharing per group 12 plus 7.6 per vreg of one row
# of expert ids (its two counts' reductions) give exactly. The listing's scalar ALU and
# SMEM ops, every guard taken (Kimi K3's where they differ, the most): per expert id it
# visits (its group's block, and with sharing the next group's tail), and with sharing
# per group the totals, per group and bound tried the flows' two laps, their clearing
# and the worst load.
CHOSEN_BASE_OPS = 6
CHOSEN_PICK_OPS = 8
CHOSEN_GROUP_OPS, CHOSEN_GROUP_VREG_OPS = 12, 7.6
LIST_VISIT_OPS = {False: 6, True: 17}  # by expert sharing
RING_GROUP_OPS = 12
RING_BOUND_GROUP_OPS = 96
OUTPUT_BLOCK_OPS = {8: OpCounts(loads=4, stores=4), 16: OpCounts(loads=8, stores=8)}

# Measured with `scripts/measure_chunk_ops.py attend` (libtpu 0.0.50.1): the template's
# _write_cache_<kind> and _attend_<kind> of each shipped cache attention geometry compiled
# alone for one TPU7x core with Mosaic's LLO dump, the KV-tile loop counted at 1 and 2
# tiles, at 8 and 24 query rows (24: Kimi K3's MLA at 8 rows on 2x2x4), 1 and 8 rows, and
# every KV tile the planner chooses from (options.KV_TILE_CHOICES: 128 to 1024 tokens;
# 256 is also the calibrated kernel's).
# Key: (kind, key width, value width, windowed, rows, tile tokens); value: (vpu, mxu, loads, stores) of
# one KV tile at 8 query rows, more per further 8 query rows; the same per (sequence, kv
# head) pair outside the tile loop; the cache write per pair and cache array. 2 to 7 rows
# and more than 8 are priced as 8 (an assumption; the cache write's block grows with the
# rows). A 64-wide head costs twice a 128-wide one per tile: Mosaic's bitcasts and selects
# for half-lane rows.
# fmt: off
ATTEND_OPS: dict[tuple[str, int, int, bool, int, int], tuple[tuple[float, ...], ...]] = {
    ("gqa", 128, 128, False, 1, 128): ((22, 78, 16, 0), (18.5, 6, 0, 0), (6, 0, 1, 1), (6, 0, 1, 1), (26, 0, 2, 1)),
    ("gqa", 128, 128, False, 1, 256): ((35, 78, 32, 0), (28, 6, 0, 0), (6, 0, 1, 1), (6, 0, 1, 1), (26, 0, 2, 1)),
    ("gqa", 128, 128, False, 1, 512): ((62, 156, 64, 0), (48, 12, 0, 0), (6, 0, 1, 1), (6, 0, 1, 1), (26, 0, 2, 1)),
    ("gqa", 128, 128, False, 1, 1024): ((116, 312, 128, 0), (88, 24, 0, 0), (6, 0, 1, 1), (6, 0, 1, 1), (26, 0, 2, 1)),
    ("gqa", 128, 128, False, 8, 128): ((22, 78, 16, 0), (19.5, 6, 0, 0), (13, 0, 1, 1), (12.5, 0, 1, 1), (43.5, 0, 3, 2)),
    ("gqa", 128, 128, False, 8, 256): ((35, 78, 32, 0), (30, 6, 0, 0), (13, 0, 1, 1), (12.5, 0, 1, 1), (43.5, 0, 3, 2)),
    ("gqa", 128, 128, False, 8, 512): ((62, 156, 64, 0), (52, 12, 0, 0), (13, 0, 1, 1), (12.5, 0, 1, 1), (43.5, 0, 3, 2)),
    ("gqa", 128, 128, False, 8, 1024): ((116, 312, 128, 0), (96, 24, 0, 0), (13, 0, 1, 1), (12.5, 0, 1, 1), (43.5, 0, 3, 2)),
    ("gqa", 64, 64, True, 1, 128): ((53, 78, 16, 0), (21, 6, 0, 0), (6, 0, 1, 1), (6, 0, 1, 1), (20.75, 0, 2, 1)),
    ("gqa", 64, 64, True, 1, 256): ((92, 78, 32, 0), (31.5, 6, 0, 0), (6, 0, 1, 1), (6, 0, 1, 1), (20.75, 0, 2, 1)),
    ("gqa", 64, 64, True, 1, 512): ((171, 156, 64, 0), (53.5, 12, 0, 0), (6, 0, 1, 1), (6, 0, 1, 1), (20.75, 0, 2, 1)),
    ("gqa", 64, 64, True, 1, 1024): ((329, 312, 128, 0), (97.5, 24, 0, 0), (6, 0, 1, 1), (6, 0, 1, 1), (20.75, 0, 2, 1)),
    ("gqa", 64, 64, True, 8, 128): ((53, 78, 16, 0), (24, 6, 0, 0), (13, 0, 1, 1), (12.5, 0, 1, 1), (34, 0, 3, 2)),
    ("gqa", 64, 64, True, 8, 256): ((92, 78, 32, 0), (36.5, 6, 0, 0), (13, 0, 1, 1), (12.5, 0, 1, 1), (34, 0, 3, 2)),
    ("gqa", 64, 64, True, 8, 512): ((171, 156, 64, 0), (62.5, 12, 0, 0), (13, 0, 1, 1), (12.5, 0, 1, 1), (34, 0, 3, 2)),
    ("gqa", 64, 64, True, 8, 1024): ((329, 312, 128, 0), (114.5, 24, 0, 0), (13, 0, 1, 1), (12.5, 0, 1, 1), (34, 0, 3, 2)),
    ("gqa", 64, 64, False, 1, 128): ((50, 78, 16, 0), (20, 6, 0, 0), (6, 0, 1, 1), (6, 0, 1, 1), (20.75, 0, 2, 1)),
    ("gqa", 64, 64, False, 1, 256): ((87, 78, 32, 0), (29.5, 6, 0, 0), (6, 0, 1, 1), (6, 0, 1, 1), (20.75, 0, 2, 1)),
    ("gqa", 64, 64, False, 1, 512): ((162, 156, 64, 0), (49.5, 12, 0, 0), (6, 0, 1, 1), (6, 0, 1, 1), (20.75, 0, 2, 1)),
    ("gqa", 64, 64, False, 1, 1024): ((312, 312, 128, 0), (89.5, 24, 0, 0), (6, 0, 1, 1), (6, 0, 1, 1), (20.75, 0, 2, 1)),
    ("gqa", 64, 64, False, 8, 128): ((50, 78, 16, 0), (21, 6, 0, 0), (13, 0, 1, 1), (12.5, 0, 1, 1), (34, 0, 3, 2)),
    ("gqa", 64, 64, False, 8, 256): ((87, 78, 32, 0), (31.5, 6, 0, 0), (13, 0, 1, 1), (12.5, 0, 1, 1), (34, 0, 3, 2)),
    ("gqa", 64, 64, False, 8, 512): ((162, 156, 64, 0), (53.5, 12, 0, 0), (13, 0, 1, 1), (12.5, 0, 1, 1), (34, 0, 3, 2)),
    ("gqa", 64, 64, False, 8, 1024): ((312, 312, 128, 0), (97.5, 24, 0, 0), (13, 0, 1, 1), (12.5, 0, 1, 1), (34, 0, 3, 2)),
    ("gqa", 256, 256, False, 1, 128): ((25, 78, 32, 0), (21.5, 6, 0, 0), (8, 0, 2, 2), (7.5, 0, 2, 2), (45, 0, 3, 2)),
    ("gqa", 256, 256, False, 1, 256): ((38, 78, 64, 0), (31, 6, 0, 0), (8, 0, 2, 2), (7.5, 0, 2, 2), (45, 0, 3, 2)),
    ("gqa", 256, 256, False, 1, 512): ((66, 156, 128, 0), (52, 12, 0, 0), (8, 0, 2, 2), (7.5, 0, 2, 2), (45, 0, 3, 2)),
    ("gqa", 256, 256, False, 1, 1024): ((122, 312, 256, 0), (94, 24, 0, 0), (8, 0, 2, 2), (7.5, 0, 2, 2), (45, 0, 3, 2)),
    ("gqa", 256, 256, False, 8, 128): ((25, 78, 32, 0), (22.5, 6, 0, 0), (15, 0, 2, 2), (14, 0, 2, 2), (67.5, 0, 5, 4)),
    ("gqa", 256, 256, False, 8, 256): ((38, 78, 64, 0), (33, 6, 0, 0), (15, 0, 2, 2), (14, 0, 2, 2), (67.5, 0, 5, 4)),
    ("gqa", 256, 256, False, 8, 512): ((66, 156, 128, 0), (56, 12, 0, 0), (15, 0, 2, 2), (14, 0, 2, 2), (67.5, 0, 5, 4)),
    ("gqa", 256, 256, False, 8, 1024): ((122, 312, 256, 0), (102, 24, 0, 0), (15, 0, 2, 2), (14, 0, 2, 2), (67.5, 0, 5, 4)),
    ("mla", 576, 512, False, 1, 128): ((61, 195, 40, 0), (31, 15, 0, 0), (13, 0, 5, 4), (11, 0, 5, 4), (98, 0, 6, 5)),
    ("mla", 576, 512, False, 1, 256): ((100, 195, 80, 0), (42.5, 15, 0, 0), (13, 0, 5, 4), (11, 0, 5, 4), (98, 0, 6, 5)),
    ("mla", 576, 512, False, 1, 512): ((182, 390, 160, 0), (69.5, 30, 0, 0), (13, 0, 5, 4), (11, 0, 5, 4), (98, 0, 6, 5)),
    ("mla", 576, 512, False, 1, 1024): ((346, 780, 320, 0), (123.5, 60, 0, 0), (13, 0, 5, 4), (11, 0, 5, 4), (98, 0, 6, 5)),
    ("mla", 576, 512, False, 8, 128): ((61, 195, 40, 0), (32, 15, 0, 0), (20, 0, 5, 4), (17.5, 0, 5, 4), (143, 0, 13, 10)),
    ("mla", 576, 512, False, 8, 256): ((100, 195, 80, 0), (44.5, 15, 0, 0), (20, 0, 5, 4), (17.5, 0, 5, 4), (143, 0, 13, 10)),
    ("mla", 576, 512, False, 8, 512): ((182, 390, 160, 0), (73.5, 30, 0, 0), (20, 0, 5, 4), (17.5, 0, 5, 4), (143, 0, 13, 10)),
    ("mla", 576, 512, False, 8, 1024): ((346, 780, 320, 0), (131.5, 60, 0, 0), (20, 0, 5, 4), (17.5, 0, 5, 4), (143, 0, 13, 10)),
}
# fmt: on
# Measured with `scripts/measure_chunk_ops.py vector` (libtpu 0.0.50.1): the template's
# _rms_norm of [rows, width] by a row of the layer's vectors slab (the slab loaded in a
# layer loop as the kernel loads it: the weight row is replicated across sublanes),
# compiled alone for one TPU7x core at widths 1024 and 2048 (8192 lies on the line):
# token rows -> (ops per 128 lanes of width, ops once). More than 16 rows are priced as 16.
NORM_OPS = {8: (8, 5), 16: (12, 9)}
# GQA's heads op, the same way: each q and kv head's q/k norm and RoPE as
# _attention_<kind> runs them, compiled alone at 2 and 4 heads (the new rows' bf16 copies
# are stores). (head width, qk_norm, rotated half (0: no RoPE), token rows) -> (ops per
# head, ops once). A geometry not measured is priced by its elementwise flops.
# fmt: off
HEADS_OPS: dict[tuple[int, str, int, int], tuple[float, float]] = {
    (128, "rms", 64, 8): (21, 10),  # qwen3-30b-a3b
    (128, "rms", 64, 16): (42, 16),
    (64, "rms_noparam", 32, 8): (27, 17),  # muse-spark-1.2 local
    (64, "rms_noparam", 32, 16): (54, 31),
    (64, "rms_noparam", 0, 8): (9.5, 2),  # muse-spark-1.2 global (no RoPE)
    (64, "rms_noparam", 0, 16): (19, 2),
    (256, "rms", 32, 8): (26, 13),  # qwen3.8-27b full attention (RoPE on 64 of 256 dims)
    (256, "rms", 32, 16): (52, 19),
}
# fmt: on
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


def measured_tables() -> str:
    """Every op-count figure the model prices with, as one deterministic text: part of the
    digest a tuned choice is keyed by (mkgen/plan/holds.py), so a new measurement makes the
    planner score again."""
    return repr(
        (CHUNK_OPS, INPUT_CHUNK_OPS, OUTPUT_BLOCK_OPS, ATTEND_OPS, NORM_OPS, HEADS_OPS,
         SOFTMAX_OPS, TOP_K_OPS, ACTIVATION_OPS, DELTA_RULE_OPS, DELTA_RULE_STATE_VREGS,
         COMBINE_OPS, WIRE_PACK_OPS, WIRE_UNPACK_OPS)
    )  # fmt: skip


# A schedule DMA category -> the phase whose code issues it (any other: "vector", the layer
# functions' own code, which starts the cache blocks' reads and the recurrent states' copies).
DMA_PHASE = {
    "bank": "stream matmul",
    "expert": "experts",
    "ids": "experts",
    "kv_tile": "attention",
    "cache_write": "attention",
    "collective": "collectives",
}
# The schedule's names of an expert's activation and of its weighted sum into the output.
EXPERT_ACTIVATION = re.compile(r": expert [0-9]+ activation$")
EXPERT_COMBINE = "+= weight x expert"
# The schedule's name of a cache write's merge of the new rows (the attention's code).
CACHE_MERGE = "merge new rows into the block"
# The schedule's names of the vector phase's nodes priced by measured template code: the
# norms of the hidden rows, MoE's expert-input latent norm, MLA's q and kv latent norms
# and GQA's heads op.
HIDDEN_NORM = re.compile(r"(: attn_norm|: ffn_norm| final norm)$")
MOE_LATENT_NORM = ": latent norm"
MLA_LATENT_NORMS = ": latent norms"
GQA_HEADS = ": q/k norm, rope, new rows"
# A schedule compute category -> the phase whose code runs it (the rest: vector).
COMPUTE_PHASE = {"routing": "routing", "collective": "collectives", "recurrent": "recurrent"}


def vregs(rows: int, width: int) -> int:
    return math.ceil(rows / 8) * math.ceil(width / 128)


def _rows_key(tokens_padded: int) -> int:
    # Measured at 8 and 16 rows; more rows are priced as 16 (an assumption).
    return 8 if tokens_padded <= 8 else 16


def norm_ops(width: int, tokens_padded: int) -> OpCounts:
    """One _rms_norm of [tokens_padded, width] (measured, NORM_OPS)."""
    per_lanes, once = NORM_OPS[_rows_key(tokens_padded)]
    return OpCounts(vpu=per_lanes * math.ceil(width / 128) + once)


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
        "scalar": counts.scalar / rates.scalar_ops_per_cycle * cycle_us,
    }


def compute_timeline_us(counts: dict[str, OpCounts], rates: IssueRates) -> float:
    """The step's compute timeline: each phase at its slowest unit, phases in turn (the
    units of one phase overlap; the phases of a layer depend on each other)."""
    return sum(max(bound_us(c, rates).values()) for c in counts.values())


def _measured_heads_op(kind: Any, shard: Any, tokens_padded: int) -> OpCounts | None:
    """GQA's heads op of a core's q and kv heads (HEADS_OPS), None if not measured."""
    key = (kind.head_dim, kind.qk_norm, kind.rotary_dim // 2, _rows_key(tokens_padded))
    if key not in HEADS_OPS:
        return None
    per_head, once = HEADS_OPS[key]
    return OpCounts(vpu=per_head * (shard.heads_per_rank + shard.kv_heads_per_rank) + once)


def node_op_counts(
    schedule: Any,
    stream: Any,
    vmem: Any,
    sharding: Any,
    spec: Any,
    kinds: KindRegistry,
    chunk_products: Mapping[str, str] | None = None,
) -> tuple[list[tuple[str, OpCounts]], list[str]]:
    """(phase, the model's ops of one run of the node) for every node of `schedule`, in
    node order, and the formats and attention geometries the model has no measurement
    for (their chunks and tiles count no ops): a build's schedule, weight stream, VMEM
    plan and sharding (the plan's pieces), each kind's geometry by its rule in `kinds`;
    `chunk_products` prices an expert format's chunks as another product of CHUNK_OPS
    (the calibration's measured kernel, ProgramPlan.chunk_products).

    A stream segment's and an expert's ring matmul is spread over its banks or pieces by
    the chunks each holds; a node's ops times its ``repeat`` summed per phase is
    `model_op_counts`. The cost model (mkgen.plan.cost) prices each node from these."""
    counter = _NodeCounter(spec, sharding, vmem, kinds, chunk_products or {})
    layer_kinds = [tuple(k.split("/")) for k in schedule.layer_kinds]
    out: list[tuple[str, OpCounts]] = []
    for node in schedule.nodes:
        if node.is_dma:
            # A collective's group counts its sends and its receives; a core issues the sends.
            issued = node.count // 2 if node.cat == "collective" else node.count
            out.append((DMA_PHASE.get(node.cat, "vector"), OpCounts(dmas=issued)))
            continue
        attn, ffn = layer_kinds[node.layer] if 0 <= node.layer < len(layer_kinds) else ("", "")
        out.append(counter.compute(schedule.nodes, node, attn, ffn))
    return out, sorted(counter.unpriced)


class _NodeCounter:
    """The op counts of a build's compute nodes (node_op_counts), with what they share
    (segment and expert-piece matmuls, KV tiles) counted once."""

    def __init__(
        self,
        spec: Any,
        sharding: Any,
        vmem: Any,
        kinds: KindRegistry,
        chunk_products: Mapping[str, str],
    ) -> None:
        self.spec, self.sharding, self.vmem, self.kinds = spec, sharding, vmem, kinds
        self.chunk_products = chunk_products
        self.dims = vmem.dims
        self.tp = self.dims.tokens_padded
        self.unpriced: set[str] = set()
        # Each ring matmul node's share of its segment's matmul (by the chunks it reads):
        # the schedule keys it ("matmul", format, k_chunks, col_blocks, chunks, chunks read).
        self.shares: dict[tuple, OpCounts] = {}  # nodes of one key share their counts
        self.piece_ops = self._piece_ops()
        self.tile_ops: dict[str, OpCounts] = {}
        self.write_ops: dict[str, OpCounts] = {}
        for name, kind in spec.attention_kinds.items():
            self._attention_ops(name, kind)

    def ring_matmul(self, fmt: str, k: int, c: int) -> OpCounts:
        try:
            return ring_matmul_ops(fmt, k, c, self.tp)
        except KeyError:
            self.unpriced.add(fmt)
            return OpCounts()

    def segment_share(self, key: tuple) -> OpCounts:
        if key not in self.shares:
            _, fmt, k_chunks, col_blocks, chunks, read = key
            # A quantized bank is read through a bitcast of the ring's bf16 rows.
            whole = self.ring_matmul(fmt if fmt == "bf16" else f"stream:{fmt}", k_chunks,
                                     col_blocks)  # fmt: skip
            self.shares[key] = OpCounts()
            self.shares[key].add_all(whole, read / chunks)
        return self.shares[key]

    def _piece_ops(self) -> dict[tuple[str, bool], OpCounts]:
        """An expert piece's share of the expert's gate|up or down ring matmul."""
        piece_ops: dict[tuple[str, bool], OpCounts] = {}
        for name, e in self.vmem.experts.items():
            product = self.chunk_products.get(e.format, e.format)
            for gate_up, k, c, pieces in (
                (True, e.gate_up_k_chunks, e.gate_up_col_blocks, e.gate_up_pieces),
                (False, e.down_k_chunks, e.down_col_blocks, e.pieces - e.gate_up_pieces),
            ):
                share = OpCounts()
                share.add_all(self.ring_matmul(product, k, c), 1 / max(1, pieces))
                piece_ops[(name, gate_up)] = share
        return piece_ops

    def _attention_ops(self, name: str, kind: Any) -> None:
        """A cache attention kind's KV tile (with its pair's share of the per-pair ops)
        and its cache write (the block merge of every pair and cache array), as measured."""
        dims = self.dims
        rule = self.kinds.rules(kind.type, f"attention_kinds.{name}")
        g = rule.cache_geometry(kind, self.sharding.attention[name], dims.rows)
        if g is None:
            return  # recurrent kinds read no KV tiles
        rows_key = 1 if dims.rows == 1 else 8
        tokens = dims.kv_tiles[name]
        key = (kind.type, g.key, g.value, bool(g.window), rows_key, tokens)
        measured = ATTEND_OPS.get(key)
        self.tile_ops[name], self.write_ops[name] = OpCounts(), OpCounts()
        if measured is None or g.sinks:
            self.unpriced.add(f"attention {name} ({kind.type}, keys {g.key}, values {g.value}"
                              f"{', window' if g.window else ''}{', sinks' if g.sinks else ''}, "
                              f"{dims.rows} rows, {tokens}-token tiles)")  # fmt: skip
            return
        tile, tile_more, pair, pair_more, write = (OpCounts(*ops) for ops in measured)
        more = g.q_rows / 8 - 1  # query rows beyond the measured 8, in 8-row groups
        tiles = kv_tiles(dims.context, tokens, g.window, dims.rows)
        self.tile_ops[name].add_all(tile)
        self.tile_ops[name].add_all(tile_more, more)
        self.tile_ops[name].add_all(pair, 1 / tiles)
        self.tile_ops[name].add_all(pair_more, more / tiles)
        self.write_ops[name].add_all(write, g.caches * dims.batch * g.kv_heads)

    def elementwise(self, node: Any) -> OpCounts:
        # flops count tokens x width x ops per element; a vreg holds 8 rows x 128 lanes
        return OpCounts(vpu=node.flops / self.dims.tokens / 128 * math.ceil(self.tp / 8))

    def compute(self, nodes: list[Any], node: Any, attn: str, ffn: str) -> tuple[str, OpCounts]:
        """(phase, ops) of a compute node of a layer of kinds `attn` and `ffn`."""
        spec, tp, vmem = self.spec, self.tp, self.vmem
        if node.cat == "matmul":
            return "stream matmul", self.segment_share(node.key)
        if node.cat == "expert_mm":
            piece = next(nodes[p].key[3] for p, res, _ in node.reads if res and p >= 0
                         and nodes[p].key and nodes[p].key[0] == "expert")  # fmt: skip
            return "experts", self.piece_ops[(ffn, piece < vmem.experts[ffn].gate_up_pieces)]
        if node.cat == "attention":
            return "attention", self.tile_ops[attn]
        if node.cat == "vector":
            return self._vector(node, attn, ffn)
        if node.cat == "chosen":
            return "experts", self._chosen_ops(ffn)  # _chosen_<kind> runs in _experts_<kind>
        if node.cat == "scalar":
            return "experts", OpCounts(scalar=self._listing_ops(ffn))
        if node.cat == "routing":
            kind = spec.ffn_kinds[ffn]
            ops = (SOFTMAX_OPS + TOP_K_OPS * kind.top_k) * vregs(tp, kind.num_experts)
            return "routing", OpCounts(vpu=ops)
        if node.cat == "recurrent":  # one sequence's rows, one head after another
            kind = spec.attention_kinds[attn]
            a = self.sharding.attention[attn]
            state = self.kinds.rules(kind.type, attn).state_dims(kind, a)
            assert state is not None, attn  # a recurrent node is a recurrent kind's
            per_head, per_key = DELTA_RULE_OPS[kind.type]
            per_row = ((state.heads * per_head + state.key_heads * per_key)
                       * vregs(state.key_dim, state.value_dim) / DELTA_RULE_STATE_VREGS)  # fmt: skip
            return COMPUTE_PHASE.get(node.cat, "vector"), OpCounts(vpu=self.dims.rows * per_row)
        if node.cat == "collective":
            return "collectives", OpCounts(vpu=_round_ops(node.collective, tp))
        return COMPUTE_PHASE.get(node.cat, "vector"), self.elementwise(node)

    def _chosen_ops(self, ffn: str) -> OpCounts:
        """Vector ops of one layer's chosen-expert flags of MoE kind `ffn` (CHOSEN_*)."""
        kind, split = self.spec.ffn_kinds[ffn], self.sharding.ffn[ffn].experts
        width = experts_padded(kind.num_experts)
        ops = CHOSEN_BASE_OPS + kind.top_k * CHOSEN_PICK_OPS * vregs(self.tp, width)
        if split.partner_experts:
            ops += split.groups * (CHOSEN_GROUP_OPS + CHOSEN_GROUP_VREG_OPS * vregs(1, width))
        return OpCounts(vpu=ops)

    def _listing_ops(self, ffn: str) -> float:
        """Scalar ops of one layer's expert listing of MoE kind `ffn` (LIST_VISIT_OPS ...):
        with expert sharing, the ring's bounds tried as the planner expects them."""
        split = self.sharding.ffn[ffn].experts
        shared = bool(split.partner_experts)
        visited = split.experts_per_rank + split.partner_experts
        ops = visited * LIST_VISIT_OPS[shared]
        if shared:
            groups = split.groups
            ops += groups * (RING_GROUP_OPS + split.expected_ring_bounds * RING_BOUND_GROUP_OPS)
        return ops

    def _vector(self, node: Any, attn: str, ffn: str) -> tuple[str, OpCounts]:
        """(phase, ops) of a vector node: measured template code where there is some."""
        spec, tp, vmem, name = self.spec, self.tp, self.vmem, node.name
        if name.endswith(CACHE_MERGE):
            return "attention", self.write_ops[attn]
        if EXPERT_ACTIVATION.search(name):
            return "experts", OpCounts(vpu=ACTIVATION_OPS * vregs(tp, vmem.experts[ffn].width))
        if EXPERT_COMBINE in name:
            return "experts", OpCounts(vpu=COMBINE_OPS * vregs(tp, vmem.experts[ffn].d))
        if HIDDEN_NORM.search(name):
            return "vector", norm_ops(self.dims.hidden, tp)
        if name.endswith(MOE_LATENT_NORM):
            latent = spec.ffn_kinds[ffn].latent  # the template norms the latent if it has one
            return "vector", norm_ops(latent.width, tp) if latent.norm else OpCounts()
        if name.endswith(MLA_LATENT_NORMS):
            kind = spec.attention_kinds[attn]
            ops = norm_ops(kind.kv_lora_rank, tp)
            if kind.q_lora_rank:
                ops.add_all(norm_ops(kind.q_lora_rank, tp))
            return "vector", ops
        if name.endswith(GQA_HEADS):
            heads_op = _measured_heads_op(spec.attention_kinds[attn], self.sharding.attention[attn],
                                          tp)  # fmt: skip
            return "vector", heads_op or self.elementwise(node)
        return "vector", self.elementwise(node)


def model_op_counts(
    schedule: Any, stream: Any, vmem: Any, sharding: Any, spec: Any, kinds: KindRegistry
) -> tuple[dict[str, OpCounts], list[str]]:
    """(phase -> the model's ops per step, formats the model has no measurement for): every
    node's ops (node_op_counts) times its repeat, summed per phase."""
    out = {p: OpCounts() for p in PHASES}
    per_node, unpriced = node_op_counts(schedule, stream, vmem, sharding, spec, kinds)
    for node, (phase, ops) in zip(schedule.nodes, per_node, strict=True):
        out[phase].add_all(ops, node.repeat)
    return out, unpriced


def _round_ops(call: RoundCall | None, tp: int) -> float:
    """VPU ops of a collective round's combine: a sum adds the other members' pieces (a
    concatenation only copies); a bf16 round also packs what it sends (a reduce-scatter
    every member's part) and unpacks every member's piece."""
    if call is None:  # the partial's rows written into the buffer
        return 0
    adds = (call.members - 1) * vregs(tp, call.columns) if call.phase != "all_gather" else 0
    if call.wire != "bf16":
        return adds
    sent = call.columns * (call.members if call.phase == "reduce_scatter" else 1)
    return (
        adds
        + WIRE_PACK_OPS * vregs(tp, sent)
        + WIRE_UNPACK_OPS * call.members * vregs(tp, call.lanes)
    )
