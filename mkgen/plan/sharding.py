"""Sharding: how every weight tensor and cache splits over the topology's D cores.

Tensor parallelism over all cores, as the hand-written kernels do. This module is
the one place per-rank shapes are derived ("rank shapes", DESIGN.md): every tensor
of the weight inventory (mkgen.spec.weights) gets a TensorShard saying its split
axis, its parts, its per-rank shape before and after TPU tile padding, its layout
and its HBM bytes per rank; every attention kind its cache; every layer kind the
collectives it needs. Decisions (docs/cost-model.md has the reasoning):

- attention heads split over D (q heads for GQA/MLA/KDA, value heads for Gated
  DeltaNet); heads that do not divide D are an error (no zero-head padding: it
  would change the checkpoint layout and stream dead weights);
- GQA KV heads (and GDN key heads) split when D divides them, else each core holds
  the KV heads its q heads need (replication counted in bytes);
- low-rank "A" projections (MLA wq_a / wkv_a, KDA wf_a / wg_a) are replicated or
  split along their output with one all-gather, whichever costs less per layer;
- dense MLP and shared-expert width split; routed experts split by expert id over
  G groups and by width over W = D / G (the candidates and their scores are kept); the
  groups may form a ring that shares the last s experts of each block (expert sharing:
  each core also holds the next group's shared part, and the ring splits the active
  shared experts so that its worst-loaded core reads fewer slices);
- latent MoE: latent_in output-split + all-gather; after the experts either a
  reduce-scatter, an input-split latent_out and an all-reduce of hidden, or an
  all-reduce of the latent, an output-split latent_out and an all-gather of
  hidden, whichever is cheaper (the first when shared experts add partial sums);
- the router's columns split over the cores when that costs less per layer than
  replicating them: with a latent, the per-core scores ride in the latent all-gather
  (one collective carries both pieces), then every core routes on all the scores;
- vocabulary (embedding rows, lm_head columns) split; norms, router biases, biases that
  are added after a reduction and small vectors replicated.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from mkgen.errors import SpecError
from mkgen.hardware import vmem_tile
from mkgen.plan.collectives import (
    RoundCall,
    Scheme,
    choose_rounds,
    round_time_s,
    scheme_of,
    wire_error_bound,
)
from mkgen.plan.cost import (
    CostConstants,
    chip_constants,
    matmul_cost,
    pad_rows,
    widest_level,
)
from mkgen.plan.fused import DRAFT_NORMS, MODULE_PREFIX, DraftPasses
from mkgen.plan.kind import KindRegistry
from mkgen.plan.options import EXPERT_SHARING, BuildOptions
from mkgen.spec.quant import QuantFormat, parse_format
from mkgen.spec.schema import (
    ModelSpec,
    MoEFFN,
)
from mkgen.spec.tensors import VECTORS, Tensor
from mkgen.spec.topology import Topology
from mkgen.spec.weights import attention_weights

LANES = 128
CollectiveOp = Literal["all_reduce", "all_gather", "reduce_scatter"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TensorShard(_Frozen):
    """One tensor as every rank holds it."""

    name: str  # inventory name, layer-relative ("attn.wq", "ffn.experts_up") in layer kinds
    family: str  # weight family, or "vectors"
    format: str  # storage format ("bf16" for vectors)
    global_shape: tuple[int, ...]
    split_axis: int | None  # axis split across ranks (None: replicated)
    parts: int  # distinct pieces along split_axis (1: replicated)
    expert_groups: int = 1  # routed experts: groups of experts along axis 0
    rank_shape: tuple[int, ...]  # logical per-rank shape
    # Per-rank shape as stored and DMA'd: tile padded, in `layout` order.
    padded_shape: tuple[int, ...]
    # "kn": [fan_in, fan_out] as the inventory; "nk": the two minor dims transposed
    # (chosen when it pads less, e.g. [7168, 48] -> [48, 7168]); "vector".
    layout: Literal["kn", "nk", "vector"]
    copies: float  # ranks holding each global element (1: split, D: replicated)
    rank_bytes: int  # HBM bytes per rank, padded, scales included
    why: str = ""

    @property
    def replicated(self) -> bool:
        return self.parts == 1 and self.expert_groups == 1

    def describe(self) -> str:
        split = (
            "replicated"
            if self.replicated
            else f"axis {self.split_axis} / {self.parts}"
            + (f", experts / {self.expert_groups}" if self.expert_groups > 1 else "")
        )
        return (
            f"{self.name:<28} {self.format:<9} {str(list(self.global_shape)):<22} {split:<24} "
            f"-> {list(self.padded_shape)} {self.layout} {self.rank_bytes / 2**20:9.2f} MiB"
            + (f" (x{self.copies:g} copies)" if self.copies > 1 else "")
        )


class Collective(_Frozen):
    """One collective of a layer kind (or of the step), with its cost at this build."""

    name: str
    op: CollectiveOp
    after: str  # what produces its input
    width: int  # elements per token row of the full (reduced / gathered) payload
    rows: int  # token rows, padded to sublane blocks
    payload_bytes: int  # full payload (rows x width x 4: f32 in VMEM)
    rounds: tuple[RoundCall, ...]  # one-shot rounds in execution order (mkgen.plan.collectives)
    level: str  # widest topology level crossed: core / chip / host
    bytes_by_level: dict[str, int]  # bytes one device sends at each level
    error_bound: float  # |kernel - exact| / sum |partials| the wire dtypes allow
    time_s: float

    def describe(self) -> str:
        sent = ", ".join(f"{k} {v / 1024:.1f} KiB" for k, v in self.bytes_by_level.items() if v)
        rounds = "; ".join(r.describe() for r in self.rounds) or "none"
        relative = "|value|" if self.op == "all_gather" else "sum|partials|"
        return (
            f"{self.name:<16} {self.op:<14} after {self.after:<18} [{self.rows}, {self.width}] "
            f"{len(self.rounds)} round(s) [{rounds}] up to {self.level}: {sent}; "
            f"error <= {self.error_bound:.1e} x {relative}; {self.time_s * 1e6:.2f} us"
        )


def collective_cost(
    topo: Topology,
    name: str,
    op: CollectiveOp,
    after: str,
    width: int,
    tokens: int,
    mode: str = "auto",
) -> Collective:
    """The kernel's one-shot rounds (mkgen.plan.collectives) for this payload, staged or
    flat as `mode` says (`choose_rounds`), each priced by `round_time_s` (the catalog's
    collective phase plus its copies over the links), one after the other."""
    rows = pad_rows(tokens)
    calls = choose_rounds(topo, name, op, width, tokens, chip_constants(topo.chip_info), mode)
    sent = {"core": 0, "chip": 0, "host": 0}
    for call in calls:
        for level, nbytes in call.bytes_by_level.items():
            sent[level] += nbytes
    return Collective(
        name=name,
        op=op,
        after=after,
        width=width,
        rows=rows,
        payload_bytes=rows * width * 4,
        rounds=tuple(calls),
        level=widest_level(topo),
        bytes_by_level=sent if calls else {},
        error_bound=wire_error_bound(op, calls),
        time_s=sum(round_time_s(call, chip_constants(topo.chip_info)) for call in calls),
    )


def price(*collectives: Collective) -> tuple[float, int]:
    """(seconds, bytes one core sends) of collectives run one after the other."""
    return (
        sum(c.time_s for c in collectives),
        sum(sum(c.bytes_by_level.values()) for c in collectives),
    )


class CacheShard(_Frozen):
    """What one layer of an attention kind keeps per sequence on each rank."""

    kind: Literal["kv", "mla_latent", "state"]
    bytes_per_token: int  # per rank, grows with context (KV / latent)
    fixed_bytes: int  # per rank per sequence (recurrent state f32 + conv taps bf16)
    window: int | None
    heads_per_rank: int  # KV heads (GQA), 1 latent (MLA), state heads (KDA/GDN)
    copies: float  # ranks holding each cache element
    why: str = ""


class AttentionSharding(_Frozen):
    kind: str
    type: str
    heads_per_rank: int  # query heads (value heads for Gated DeltaNet)
    kv_heads_per_rank: int  # GQA KV / GDN key heads held per rank; MLA 0; KDA = heads
    kv_copies: float  # copies of each KV (key) head across ranks
    latent: Literal["split", "replicated", "none"]  # low-rank A projections
    tensors: tuple[TensorShard, ...]
    collectives: tuple[Collective, ...]
    cache: CacheShard
    why: str


class ExpertCandidate(_Frozen):
    """One way to split the routed experts: G groups by id x W parts by width."""

    groups: int
    width_parts: int
    width_per_rank: int
    experts_per_rank: int
    lane_aligned: bool  # width per rank a multiple of 128 lanes
    expected_max_experts: float  # experts read by the worst-loaded rank (expectation)
    expected_rank_bytes: float  # its expert bytes per layer
    worst_case_experts: int  # adversarial routing: all picks in one group
    worst_case_rank_bytes: int
    score_s: float  # expected worst-rank expert time per layer (DMA vs MXU, the larger)
    chosen: bool = False
    rejected: str = ""  # why not eligible ("" when eligible)


class SharingCandidate(_Frozen):
    """Expert sharing around the ring of groups at one shared count (choose_expert_split)."""

    sharing: str  # a key of EXPERT_SHARING
    partner_experts: int  # experts of the next group's block each core also holds
    expected_max_experts: float  # slices the worst-loaded core reads (expectation)
    expected_bounds: float  # bounds the kernel's ring_flows tries (expectation; 0 unshared)
    # The same at one distinct token a sequence: a fused drafter's chained pass, whose rows
    # repeat their sequence's entry and so choose the same experts (None: no such pass).
    chained_expected_max_experts: float | None = None
    score_s: float  # its expert time per layer: the split's slice time x the whole slices
    extra_hbm_bytes: int  # HBM a core adds to hold them, every layer of the kind
    fits: bool  # within the HBM left (always, where the planner was not given it)
    chosen: bool = False


class ExpertSplit(_Frozen):
    groups: int
    width_parts: int
    experts_per_rank: int
    width_per_rank: int
    picks: int  # token rows x top_k
    expected_distinct: float  # distinct experts read per layer (all ranks)
    rows_per_expert: int  # token rows one loaded expert multiplies (MXU LHS)
    expected_max_experts_per_rank: float  # worst-loaded rank, expectation
    worst_case_experts_per_rank: int
    slice_bytes: int  # HBM bytes of one expert's per-rank slice (all its matrices)
    slice_dmas: int  # DMAs per expert slice (one per matrix)
    candidates: tuple[ExpertCandidate, ...]
    why: str
    # Expert sharing around the ring of groups: each core of group g also holds the last
    # `partner_experts` experts of group (g + 1) mod G's block (its partner; its width
    # part) after its own, and the ring splits the active experts of the shared parts
    # (ring_flows, docs/planner.md#expert-sharing). expected_max_experts_per_rank is then
    # the ring's.
    sharing: str = "none"
    partner_experts: int = 0
    partner_bytes_per_layer: int = 0  # HBM a core adds per layer to hold them
    expected_ring_bounds: float = 0.0  # bounds the kernel's ring_flows tries (expectation)
    sharing_candidates: tuple[SharingCandidate, ...] = ()
    # A fused drafter's chained pass (SharingCandidate.chained_expected_max_experts).
    chained_expected_max_experts_per_rank: float | None = None

    @property
    def held_per_rank(self) -> int:
        """Experts each core holds: its group's block, then the next group's shared part."""
        return self.experts_per_rank + self.partner_experts

    def unshared(self) -> ExpertSplit:
        """The same split with no expert sharing (the calibrated regime's)."""
        if not self.partner_experts:
            return self
        none = next(c for c in self.sharing_candidates if not c.partner_experts)
        return self.model_copy(update={
            "sharing": "none", "partner_experts": 0,
            "partner_bytes_per_layer": 0, "expected_ring_bounds": 0.0,
            "expected_max_experts_per_rank": none.expected_max_experts,
            "chained_expected_max_experts_per_rank": none.chained_expected_max_experts,
        })  # fmt: skip


class FFNSharding(_Frozen):
    kind: str
    type: str
    tensors: tuple[TensorShard, ...]
    collectives: tuple[Collective, ...]
    experts: ExpertSplit | None
    latent_design: Literal["rs_ar", "ar_ag", "none"]
    why: str
    router: Literal["split", "replicated", "none"] = "none"  # the router's columns


class ShardingPlan(_Frozen):
    """Per-rank shapes of every tensor and cache, and the collectives of every layer kind."""

    model: str
    topology: str
    devices: int
    tokens: int  # token rows per step (batch x rows)
    quantization: dict[str, str]
    globals: tuple[TensorShard, ...]  # embedding, final_norm, lm_head, attn_res_logits
    layer_vectors: tuple[TensorShard, ...]  # attn_norm, ffn_norm (every layer)
    attention: dict[str, AttentionSharding]
    ffn: dict[str, FFNSharding]
    step_collectives: tuple[Collective, ...]  # embedding broadcast, sampling gather
    layer_table: tuple[tuple[str, str], ...]
    # A fused drafter's passes, the last layers of layer_table (mkgen/plan/fused.py)
    draft_passes: DraftPasses | None = None

    # --- look-ups ---
    def shard_of(self, name: str) -> TensorShard:
        """The shard of any inventory name, e.g. ``layers.7.attn.wq`` or ``lm_head``."""
        for t in self.globals:
            if t.name == name:
                return t
        parts = name.split(".")
        if len(parts) >= 3 and parts[0] == "layers" and parts[1].isdigit():
            layer = int(parts[1])
            if not 0 <= layer < len(self.layer_table):
                raise SpecError(f"tensor {name!r}: layer {layer} outside the model")
            rel = ".".join(parts[2:])
            attn, ffn = self.layer_table[layer]
            pool = self.layer_vectors + self.attention[attn].tensors + self.ffn[ffn].tensors
            for t in pool:
                if t.name == rel:
                    return t
        raise SpecError(f"tensor {name!r}: not in the weight inventory of {self.model}")

    def all_tensors(self) -> list[tuple[str, TensorShard]]:
        """(inventory name, shard) of every tensor, in inventory order."""
        out: list[tuple[str, TensorShard]] = [("embedding", self.globals[0])]
        for i, (attn, ffn) in enumerate(self.layer_table):
            vec = {t.name: t for t in self.layer_vectors}
            out.append((f"layers.{i}.attn_norm", vec["attn_norm"]))
            out += [(f"layers.{i}.{t.name}", t) for t in self.attention[attn].tensors]
            out.append((f"layers.{i}.ffn_norm", vec["ffn_norm"]))
            out += [(f"layers.{i}.{t.name}", t) for t in self.ffn[ffn].tensors]
        out += [(t.name, t) for t in self.globals[1:]]
        return out

    def layer_counts(self) -> dict[tuple[str, str], int]:
        counts: dict[tuple[str, str], int] = {}
        for pair in self.layer_table:
            counts[pair] = counts.get(pair, 0) + 1
        return counts

    def rank_bytes_by_family(self) -> dict[str, int]:
        """HBM bytes per rank of every weight family (vectors included)."""
        out: dict[str, int] = {}
        for _, t in self.all_tensors():
            out[t.family] = out.get(t.family, 0) + t.rank_bytes
        return out

    def without_expert_sharing(self) -> ShardingPlan:
        """This plan with no expert sharing (the calibrated regime's; itself without any)."""
        ffn = {n: f.model_copy(update={"experts": f.experts.unshared()}) if f.experts else f
               for n, f in self.ffn.items()}  # fmt: skip
        return self.model_copy(update={"ffn": ffn}) if ffn != self.ffn else self

    @property
    def expert_sharing(self) -> dict[str, ExpertSplit]:
        """The MoE kinds that share experts around the ring of groups, by name."""
        return {
            n: f.experts for n, f in self.ffn.items() if f.experts and f.experts.sharing != "none"
        }

    def describe(self) -> str:
        """One line per tensor of each kind, then the collectives."""
        lines = [f"sharding of {self.model} on {self.topology} ({self.devices} devices)"]
        lines.append("globals:")
        lines += ["  " + t.describe() for t in self.globals]
        for name, a in self.attention.items():
            lines.append(
                f"attention {name} ({a.type}): {a.heads_per_rank} heads / "
                f"{a.kv_heads_per_rank} kv heads per rank; latent {a.latent}; {a.why}"
            )
            lines += ["  " + t.describe() for t in a.tensors]
            lines += ["  " + c.describe() for c in a.collectives]
        for name, f in self.ffn.items():
            lines.append(f"ffn {name} ({f.type}): {f.why}")
            lines += ["  " + t.describe() for t in f.tensors]
            lines += ["  " + c.describe() for c in f.collectives]
        lines += ["step: " + c.describe() for c in self.step_collectives]
        return "\n".join(lines)


# --------------------------------------------------------------------------- shards


def _padded(shape: tuple[int, ...], bits: int) -> tuple[tuple[int, ...], str]:
    """Tile-padded per-rank shape and the layout ("kn" or "nk") that pads less."""
    sub, lanes = vmem_tile(bits)
    if len(shape) < 2:
        n = shape[0]
        return (-(-n // lanes) * lanes,), "vector"
    *lead, k, n = shape

    def up(x: int, m: int) -> int:
        return -(-x // m) * m

    kn = (up(k, sub), up(n, lanes))
    nk = (up(n, sub), up(k, lanes))
    if nk[0] * nk[1] < kn[0] * kn[1]:
        return (*lead, *nk), "nk"
    return (*lead, *kn), "kn"


MIN_FP8_BLOCK = 16  # the smallest block re-blocking goes down to


def _fp8_reblock(kind: str, block: int, extent: int) -> int:
    """The largest fp8 block below `block` that a core's `extent` holds whole (0: none)."""
    if kind != "fp8":
        return 0
    b = block // 2
    while b >= MIN_FP8_BLOCK and extent % b:
        b //= 2
    return b if b >= MIN_FP8_BLOCK else 0


def make_shard(
    name: str,
    shape: tuple[int, ...],
    family: str,
    fmt_text: str,
    devices: int,
    split_axis: int | None = None,
    parts: int = 1,
    expert_groups: int = 1,
    why: str = "",
    where: str = "",
    rank_extent: int | None = None,
) -> TensorShard:
    """A TensorShard with its per-rank shape, padding, layout and bytes.

    ``rank_extent`` overrides the per-rank size of the split axis (replicated KV heads:
    a rank holds more than global / parts). Raises a SpecError naming ``where`` when a
    split is uneven or breaks the format's quantization groups.
    """
    fmt_text = "bf16" if family == VECTORS else fmt_text
    fmt = parse_format(fmt_text)
    rank = list(shape)
    if expert_groups > 1:
        if shape[0] % expert_groups:
            raise SpecError(
                f"{where}{name}: {shape[0]} experts do not split into {expert_groups} groups"
            )
        rank[0] = shape[0] // expert_groups
    if split_axis is not None:
        axis = split_axis % len(shape)
        if rank_extent is not None:
            rank[axis] = rank_extent
        else:
            if shape[axis] % parts:
                raise SpecError(
                    f"{where}{name}: dimension {shape[axis]} does not split {parts} ways "
                    f"({shape[axis]} % {parts} = {shape[axis] % parts}); use a topology whose "
                    f"device count divides {shape[axis]}"
                )
            rank[axis] = shape[axis] // parts
        reblock = _whole_groups(f"{where}{name}", shape, axis, parts, rank[axis], family, fmt)
        if reblock:
            # Each sub-block keeps its block's scale: a smaller fp8 block stores the same
            # values exactly (only more scales).
            why = f"{why}; {fmt} re-blocked to fp8:{reblock} so each core holds whole blocks"
            fmt_text = f"fp8:{reblock}"
            fmt = parse_format(fmt_text)
    rank_shape = tuple(rank)
    padded, layout, nbytes = _stored_bytes(rank_shape, family, fmt)
    copies = devices * math.prod(rank_shape) / math.prod(shape)
    return TensorShard(
        name=name,
        family=family,
        format=fmt_text,
        global_shape=tuple(shape),
        split_axis=None if split_axis is None else split_axis % len(shape),
        parts=parts if split_axis is not None else 1,
        expert_groups=expert_groups,
        rank_shape=rank_shape,
        padded_shape=padded,
        layout=layout,  # type: ignore[arg-type]
        copies=copies,
        rank_bytes=nbytes,
        why=why,
    )


def _whole_groups(
    what: str,
    shape: tuple[int, ...],
    axis: int,
    parts: int,
    extent: int,
    family: str,
    fmt: QuantFormat,
) -> int:
    """The fp8 block to re-block to (0: none needed) so that a tensor split along `axis`
    to `extent` per rank keeps whole quantization groups on one rank: a split along the
    fan-in axis (or any axis of a 2-D block format) must, as the checkpoint's scales
    cannot straddle. A SpecError when no block does."""
    block = fmt.block
    is_fan_in = len(shape) >= 2 and axis == len(shape) - 2 and family != "embedding"
    is_fan_out = len(shape) >= 2 and axis == len(shape) - 1
    breaks = block and family != VECTORS and (is_fan_in or (fmt.kind == "fp8" and is_fan_out))
    reblock = _fp8_reblock(fmt.kind, block, extent) if breaks and extent % block else 0
    if not reblock and breaks and extent % block:
        divisors = [g for g in (128, 64, 32, 16) if extent % g == 0]
        hint = (
            f"a group dividing {extent} (e.g. {fmt.kind}:{divisors[0]})"
            if (divisors and fmt.kind in ("int4", "fp8"))
            else "bf16 or int8"
        )
        raise SpecError(
            f"{what}: {shape[axis]} split {parts} ways is {extent} per device, "
            f"not a multiple of the {fmt} group {block}; use {hint}"
        )
    return reblock


def _stored_bytes(
    rank_shape: tuple[int, ...], family: str, fmt: QuantFormat
) -> tuple[tuple[int, ...], str, int]:
    """(padded shape, layout, HBM bytes) of one rank's tensor as stored: tile padded,
    scales included."""
    bits = fmt.code_bits if family != VECTORS else 16
    padded, layout = _padded(rank_shape, bits)
    if family == VECTORS or len(rank_shape) < 2:
        return padded, layout, 2 * math.prod(padded)
    lead = math.prod(rank_shape[:-2])
    if layout == "nk":
        fan_out_p, fan_in_p = padded[-2], padded[-1]
    else:
        fan_in_p, fan_out_p = padded[-2], padded[-1]
    if family == "embedding":  # stored [vocab, hidden], quantized per vocabulary row
        fan_in_p, fan_out_p = fan_out_p, fan_in_p
    return padded, layout, lead * fmt.matrix_bytes(fan_in_p, fan_out_p)


# --------------------------------------------------------------------------- context


class _Ctx:
    """What every decision needs: spec, topology, options, constants, formats."""

    def __init__(
        self, spec: ModelSpec, topo: Topology, options: BuildOptions,
        expert_room_bytes: float | None = None, passes: DraftPasses | None = None,
    ) -> None:  # fmt: skip
        self.spec = spec
        # HBM per core left for expert sharing (None: not known, every choice fits);
        # each MoE kind that shares takes its part.
        self.expert_room_bytes = expert_room_bytes
        self.topo = topo
        self.options = options
        self.d = topo.num_devices
        self.c = CostConstants.from_chip(topo.chip_info, options)
        self.quant = options.quantization(spec).model_dump()
        self.tokens = options.tokens
        # Distinct rows a fused drafter's chained pass routes (one a sequence; None: the
        # build has no chained pass).
        self.chained_tokens = options.batch if passes is not None and passes.passes > 1 else None
        self.h = spec.dims.hidden

    def fmt(self, family: str) -> str:
        return "bf16" if family == VECTORS else self.quant[family]

    def shard(self, name: str, shape: tuple[int, ...], family: str, **kw) -> TensorShard:
        return make_shard(name, shape, family, self.fmt(family), self.d, **kw)

    def collective(self, name: str, op: CollectiveOp, after: str, width: int) -> Collective:
        """A collective with its rounds: the full-size build's for a mini twin (it takes
        `<scheme>.<op>.<name>` from BuildOptions.splits), else as --collectives says."""
        mode = self.options.collectives
        if self.options.splits is not None:
            splits = self.options.splits
            mode = next(
                (s for s in ("flat", "scatter") if scheme_key(s, name, op) in splits), "staged"
            )
        return collective_cost(self.topo, name, op, after, width, self.tokens, mode)

    def stream_s(self, nbytes: float) -> float:
        return self.c.dma_s(nbytes)


class KindShards:
    """What a layer kind's sharding rule fills: the per-rank pieces of its tensors (named
    `prefix` + tensor, errors prefixed by `where`) and its collectives."""

    def __init__(self, ctx: _Ctx, prefix: str, where: str) -> None:
        self.ctx = ctx
        self.prefix = prefix
        self.where = where
        self.tensors: list[TensorShard] = []
        self.collectives: list[Collective] = []

    def add(self, name: str, shape: tuple[int, ...], family: str, **kw: Any) -> None:
        self.tensors.append(
            self.ctx.shard(self.prefix + name, shape, family, where=self.where, **kw)
        )

    def add_low_rank(
        self, name: str, shape: tuple[int, ...], family: str, choice: str, why: str
    ) -> None:
        """A low-rank A projection, split along its output or replicated (latent_choice)."""
        split: dict[str, Any] = {"split_axis": 1, "parts": self.ctx.d} if choice == "split" else {}
        self.add(name, shape, family, why=why, **split)

    def gather_low_rank(
        self,
        choice: str,
        specs: list[tuple[str, tuple[int, ...], str]],
        names: list[str],
        what: str,
        after: str,
    ) -> None:
        """The all-gather joining split A projections' outputs (none when replicated)."""
        if choice == "split":
            width = sum(shape[1] for n, shape, _ in specs if n in names)
            self.collectives.append(self.ctx.collective(what, "all_gather", after, width))

    def add_held(
        self,
        name: str,
        shape: tuple[int, ...],
        family: str,
        split_axis: int,
        held: HeldHeads,
        why_split: str,
    ) -> None:
        """A tensor along key (KV) heads: split over the cores, or cut into the groups of
        heads each core holds (held_heads)."""
        if held.copies == 1:
            self.add(name, shape, family, split_axis=split_axis, parts=self.ctx.d, why=why_split)
        else:
            self.add(
                name, shape, family, split_axis=split_axis, parts=held.count // held.per_rank,
                rank_extent=held.per_rank * held.head_dim, why=held.why,
            )  # fmt: skip

    def attention(
        self, kind_name: str, a: Any, cache: CacheShard, **fields: Any
    ) -> AttentionSharding:
        """The attention kind's sharding: its tensors and collectives so far, then the
        all-reduce of its output projection that every attention kind ends with."""
        self.collectives.append(
            self.ctx.collective("attn_out", "all_reduce", "attn.wo", self.ctx.h)
        )
        return AttentionSharding(
            kind=kind_name, type=a.type, tensors=tuple(self.tensors),
            collectives=tuple(self.collectives), cache=cache, **fields,
        )  # fmt: skip


def attention_shards(ctx: _Ctx, kind_name: str, a: Any) -> tuple[KindShards, list[Tensor]]:
    """An attention kind's KindShards (tensors `attn.*`, errors naming the kind) and the
    tensors it fills them with, (name, shape, family) in inventory order."""
    return KindShards(ctx, "attn.", f"attention_kinds.{kind_name}: "), attention_weights(a, ctx.h)


def _suggest_topologies(ctx: _Ctx, count: int) -> str:
    chip = ctx.topo.chip_info
    fits = [
        f"{chip.name}:{'x'.join(map(str, s))} ({math.prod(s) * chip.devices_per_chip})"
        for s in chip.slice_shapes
        if count % (math.prod(s) * chip.devices_per_chip) == 0
    ]
    return ", ".join(fits) if fits else "none of the catalog's slices"


def heads_error(ctx: _Ctx, kind: str, what: str, count: int) -> SpecError:
    return SpecError(
        f"attention_kinds.{kind}: {count} {what} do not split over {ctx.d} devices of "
        f"{ctx.topo.name} ({count} % {ctx.d} = {count % ctx.d}); heads are not padded or "
        f"replicated, so use a topology whose device count divides {count}: "
        f"{_suggest_topologies(ctx, count)}"
    )


def split_heads(ctx: _Ctx, kind: str, what: str, count: int) -> int:
    """Heads per rank of `count` heads split evenly over the devices (heads_error if not)."""
    if count % ctx.d:
        raise heads_error(ctx, kind, what, count)
    return count // ctx.d


@dataclass(frozen=True)
class HeldHeads:
    """The key (KV) heads a rank holds: `per_rank` of the kind's `count` heads of
    `head_dim`, each held by `copies` ranks, and why."""

    count: int
    per_rank: int
    copies: float
    head_dim: int
    why: str


def held_heads(
    ctx: _Ctx,
    readers: int,
    count: int,
    head_dim: int,
    why_split: str,
    why_held: Callable[[int, float], str],
) -> HeldHeads:
    """`count` key heads read by `readers` query (value) heads split over the ranks: split
    too when the devices divide them, else each rank holds those its readers read
    (`why_held` of the heads per rank and copies says so)."""
    if count % ctx.d == 0:
        return HeldHeads(count, count // ctx.d, 1.0, head_dim, why_split)
    per_rank, copies = group_map(ctx, readers, readers // count)
    return HeldHeads(count, per_rank, copies, head_dim, why_held(per_rank, copies))


def group_map(ctx: _Ctx, units: int, per_unit_group: int) -> tuple[int, float]:
    """Rank r holds units [r*u, (r+1)*u); each needs group unit // per_unit_group.

    Returns (groups held per rank, copies of each group) for a uniform per-rank shape.
    """
    per_rank = units // ctx.d
    held = 0
    for r in range(ctx.d):
        first, last = r * per_rank, (r + 1) * per_rank - 1
        held = max(held, last // per_unit_group - first // per_unit_group + 1)
    total_groups = units // per_unit_group
    return held, ctx.d * held / total_groups


# --------------------------------------------------------------------------- attention


def latent_choice(
    ctx: _Ctx,
    kind_name: str,
    specs: list[tuple[str, tuple[int, ...], str]],
    names: list[str],
    what: str,
) -> tuple[Literal["split", "replicated", "none"], str]:
    """Replicate low-rank A projections, or split them along the output + one all-gather.

    Compares the extra bytes a replica streams per layer against the all-gather. The
    kernel gathers each tensor's pieces side by side in one all-gather
    (Collectives.all_gather_parts), so pieces need not be whole 128-lane tiles.
    """
    if not names:
        return "none", ""
    d = ctx.d
    shapes = {n: s for n, s, _ in specs}
    width = sum(shapes[n][1] for n in names)
    if any(shapes[n][1] % d for n in names):
        return "replicated", f"output width {width} does not split {d} ways"
    full = sum(ctx.shard(f"attn.{n}", shapes[n], "attention").rank_bytes for n in names)
    try:
        split = sum(
            ctx.shard(f"attn.{n}", shapes[n], "attention", split_axis=1, parts=d).rank_bytes
            for n in names
        )
    except SpecError as why:  # e.g. block-scaled formats whose blocks a split would cut
        return "replicated", f"a split is not possible ({why})"
    replicated_s = ctx.stream_s(full)
    split_s = ctx.stream_s(split) + ctx.collective(what, "all_gather", "", width).time_s
    costs = (
        f"split + all-gather {split_s * 1e6:.1f} us vs replicated {replicated_s * 1e6:.1f} us "
        "per layer"
    )
    if ctx.options.splits is not None:
        choice = "split" if f"attention.{kind_name}.latent" in ctx.options.splits else "replicated"
        return choice, f"{choice} as in the full-size build ({costs})"
    return ("split" if split_s < replicated_s else "replicated"), costs


# --------------------------------------------------------------------------- experts


@cache
def _log_comb(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def _pmf_binomial(n: int, p: float) -> list[float]:
    if p <= 0:
        return [1.0] + [0.0] * n
    if p >= 1:
        return [0.0] * n + [1.0]
    lp, lq = math.log(p), math.log1p(-p)
    return [math.exp(_log_comb(n, x) + x * lp + (n - x) * lq) for x in range(n + 1)]


def _pmf_hypergeometric(total: int, group: int, draws: int) -> list[float]:
    out = []
    for x in range(group + 1):
        if x > draws or draws - x > total - group:
            out.append(0.0)
            continue
        out.append(
            math.exp(
                _log_comb(group, x) + _log_comb(total - group, draws - x)
                - _log_comb(total, draws)
            )
        )  # fmt: skip
    return out


def _cdf(pmf: list[float]) -> list[float]:
    """The cumulative distribution of `pmf` (on 0..n), at most 1 and 1 at n, summed in
    order in pure Python (the same floats on every host)."""
    cdf, acc = [], 0.0
    for p in pmf:
        acc += p
        cdf.append(min(acc, 1.0))
    cdf[-1] = 1.0
    return cdf


def expected_max(pmf: list[float], count: int) -> float:
    """E[max of ``count`` independent draws] from a distribution on 0..n."""
    cdf = _cdf(pmf)
    return sum(1.0 - cdf[x - 1] ** count for x in range(1, len(pmf)))


def ring_first_bound(private: list[int], tail: list[int]) -> int:
    """The first bound `ring_flows` (and the kernel) tries: no group can read fewer than its
    private experts, nor the ring fewer than its even share."""
    return max(max(private), -(-(sum(private) + sum(tail)) // len(private)))


def ring_flows(private: list[int], tail: list[int]) -> tuple[list[int], int]:
    """The split of a routing's active shared experts around the ring of groups, as the
    kernel's scalar pass computes it (mkgen/kinds/moe/macros.py.j2, `_experts_*`).

    Group g holds its own block and the tail (last s experts) of group g + 1 (mod G);
    `private[g]` and `tail[g]` count the distinct active experts of group g's first
    E_r - s and last s. flows[g] of group g's tail actives run on group g - 1, so group g
    reads load_g = private[g] + tail[g] - flows[g] + flows[g + 1] slices. From the bound
    L = max(max(private), ceil(total / G)) up: two laps of flows[g + 1] =
    clamp(L - private[g] - tail[g] + flows[g], 0, tail[g + 1]) from no flow, until every
    load is at most L (it is once L reaches the largest group's actives). Returns the
    flows and the worst load."""
    groups = len(private)
    bound = ring_first_bound(private, tail)
    while True:
        flows = [0] * groups
        for g in list(range(groups)) * 2:
            after = (g + 1) % groups
            flows[after] = min(max(bound - private[g] - tail[g] + flows[g], 0), tail[after])
        worst = max(
            private[g] + tail[g] - flows[g] + flows[(g + 1) % groups] for g in range(groups)
        )
        if worst <= bound:
            return flows, worst
        bound += 1


# Routings the ring's expected worst load is averaged over, drawn from a fixed seed so that
# a plan prints the same figure on every host (random.Random is the same everywhere).
RING_SAMPLES = 4096
RING_SEED = 0


@cache
def ring_expected_max(per_group: int, shared: int, groups: int, p: float) -> tuple[float, float]:
    """(E[worst core's slices], E[bounds the kernel tries]) with expert sharing around the
    ring (`ring_flows`): each expert active with probability p, a group's private and tail
    counts drawn from their binomials (inverse CDF) for RING_SAMPLES routings. The draws
    come from random.Random and every sample's flows are `ring_flows` in integers
    (`_ring_worst`, all samples at once), so the figures do not depend on the host's SIMD
    path."""
    draws = random.Random(RING_SEED)
    uniforms = np.array([draws.random() for _ in range(RING_SAMPLES * groups * 2)])
    pairs = uniforms.reshape(RING_SAMPLES, groups, 2)
    private = np.searchsorted(_cdf(_pmf_binomial(per_group - shared, p)), pairs[..., 0], "right")
    tail = np.searchsorted(_cdf(_pmf_binomial(shared, p)), pairs[..., 1], "right")
    first = np.maximum(private.max(axis=1), -(-(private.sum(axis=1) + tail.sum(axis=1)) // groups))
    worst = _ring_worst(private, tail, first.copy())
    return int(worst.sum()) / RING_SAMPLES, int((worst - first + 1).sum()) / RING_SAMPLES


def _ring_worst(private: Any, tail: Any, bound: Any) -> Any:
    """`ring_flows`' worst load of every sample (rows of `private` and `tail`), from the
    first bound each tries: the samples still over their bound try the next one."""
    groups = private.shape[1]
    worst = np.zeros_like(bound)
    pending = np.ones(bound.shape, dtype=bool)
    while pending.any():
        a, t, b = private[pending], tail[pending], bound[pending]
        flows = np.zeros_like(a)
        for g in list(range(groups)) * 2:
            after = (g + 1) % groups
            flows[:, after] = np.minimum(
                np.maximum(b - a[:, g] - t[:, g] + flows[:, g], 0), t[:, after]
            )
        load = (a + t - flows + np.roll(flows, -1, axis=1)).max(axis=1)
        done = load <= b
        index = np.flatnonzero(pending)
        worst[index[done]] = load[done]
        bound[index[~done]] += 1
        pending[index[done]] = False
    return worst


def _sharing_counts(
    mode: str, per_group: int, groups: int, binomial: bool
) -> list[tuple[str, int]]:
    """(mode, partner experts) of the sharing candidates: none, then the forced mode (its
    fraction of the block rounded up to whole experts) or every mode whose fraction is
    whole; none alone for one group (no other to share with) or experts forced distinct
    (calibration)."""
    if mode != "auto":
        forced = [(mode, math.ceil(per_group * EXPERT_SHARING[mode]))] if mode != "none" else []
        return [("none", 0), *forced]
    if groups < 2 or not binomial:
        return [("none", 0)]
    whole = [(m, per_group * f) for m, f in EXPERT_SHARING.items()]
    return [(m, int(n)) for m, n in whole if n == int(n)]


def _choose_sharing(
    ctx: _Ctx, f: MoEFFN, best: ExpertCandidate, distinct: float, layers: int,
    slice_bytes: int, slice_s: float,
) -> tuple[SharingCandidate, tuple[SharingCandidate, ...]]:  # fmt: skip
    """Expert sharing around the ring of groups (docs/planner.md#expert-sharing): the forced
    --expert-sharing, or the smallest shared count whose expert time is within 1 % of the
    best one that fits the HBM left (ctx.expert_room_bytes)."""
    mode, g, per_group = ctx.options.expert_sharing, best.groups, best.experts_per_rank
    binomial = ctx.options.distinct_experts_per_layer is None
    counts = _sharing_counts(mode, per_group, g, binomial)
    if counts[-1][1] and g < 2:
        raise SpecError(
            f"--expert-sharing {mode}: the experts split into one group, so no other group "
            "can hold a share of them; use --expert-sharing none or auto"
        )
    room = ctx.expert_room_bytes
    pool, p = [], distinct / f.num_experts
    for name, shared in counts:
        exp_max, bounds = best.expected_max_experts, 0.0  # unshared: the split's own figure
        if shared:
            exp_max, bounds = ring_expected_max(per_group, shared, g, p)
        chained = None
        if ctx.chained_tokens is not None:  # forced distinct experts: the same figure
            chained = (
                _worst_load(f, per_group, shared, g, ctx.chained_tokens) if binomial else exp_max
            )
        extra = shared * slice_bytes * layers
        # Scored at the whole slices the schedule walks (mkgen.kinds.moe._experts).
        pool.append(SharingCandidate(
            sharing=name, partner_experts=shared, expected_max_experts=exp_max,
            expected_bounds=bounds, chained_expected_max_experts=chained,
            score_s=max(1, math.ceil(exp_max)) * slice_s, extra_hbm_bytes=extra,
            fits=room is None or extra <= room,
        ))  # fmt: skip
    fitting = [c for c in pool if c.fits]
    if mode != "auto":
        chosen = pool[-1]
        if not chosen.fits:
            raise SpecError(
                f"--expert-sharing {mode}: holding {chosen.partner_experts} experts of the "
                f"next group's block adds {chosen.extra_hbm_bytes / 1e9:.1f} GB of HBM per "
                f"core but {(room or 0) / 1e9:.1f} GB are left; use a smaller "
                "--expert-sharing, or auto"
            )
    else:
        low = min(c.score_s for c in fitting)
        chosen = min((c for c in fitting if c.score_s <= low * 1.01),
                     key=lambda c: c.partner_experts)  # fmt: skip
    if room is not None:
        ctx.expert_room_bytes = room - chosen.extra_hbm_bytes
    marked = tuple(c.model_copy(update={"chosen": c is chosen}) for c in pool)
    return chosen, marked


def _worst_load(f: MoEFFN, per_group: int, shared: int, groups: int, tokens: int) -> float:
    """The worst core's expected slices when `tokens` distinct rows route (each expert
    active with the binomial chance of choice by one of them), with `shared` experts of
    each group's block shared around the ring."""
    p = 1 - (1 - f.top_k / f.num_experts) ** tokens
    if shared:
        return ring_expected_max(per_group, shared, groups, p)[0]
    return expected_max(_pmf_binomial(per_group, p), groups)


def _sharing_why(
    chosen: SharingCandidate, pool: tuple[SharingCandidate, ...], per_group: int
) -> str:
    """The expert split's `why` about sharing: the choice and every candidate's load."""
    if len(pool) == 1 and not chosen.partner_experts:
        return ""
    loads = ", ".join(
        f"{c.sharing} {c.expected_max_experts:.2f}"
        + ("" if c.fits else f" (+{c.extra_hbm_bytes / 1e9:.1f} GB: does not fit HBM)")
        for c in pool
    )
    if not chosen.partner_experts:
        return f"; no expert sharing (worst core's slices by sharing: {loads})"
    return (
        f"; expert sharing {chosen.sharing}: the groups form a ring, each core also holds "
        f"the last {chosen.partner_experts} of the next group's {per_group} experts "
        f"(+{chosen.extra_hbm_bytes / 1e9:.1f} GB HBM per core) and the ring balances their "
        f"active ones (worst core's slices by sharing: {loads})"
    )


def choose_expert_split(ctx: _Ctx, f: MoEFFN, d_in: int, layers: int) -> ExpertSplit:
    """The split of the routed experts of a kind of `layers` layers: groups x width parts
    (every candidate scored), then the sharing around the ring of groups (_choose_sharing)."""
    e, k, width = f.num_experts, f.top_k, f.expert_width
    fmt_text = ctx.fmt("experts")
    picks = ctx.tokens * k
    forced = ctx.options.distinct_experts_per_layer
    if forced is not None:
        distinct = float(min(forced, e, picks))
    else:
        p = 1 - (1 - k / e) ** ctx.tokens
        distinct = e * p
    rows_per_expert = max(1, math.ceil(picks / max(distinct, 1.0)))
    candidates = [
        _expert_candidate(ctx, f, d_in, g, distinct, rows_per_expert)
        for g in range(1, ctx.d + 1)
        if ctx.d % g == 0
    ]
    eligible = [c for c in candidates if not c.rejected]
    if not eligible:
        first = candidates[0].rejected if candidates else "no divisor"
        raise SpecError(
            f"experts ({e} experts of width {width}, {fmt_text}) cannot split over {ctx.d} "
            f"devices of {ctx.topo.name}: {first}; try another topology or experts format"
        )
    aligned = [c for c in eligible if c.lane_aligned]
    pool = aligned or eligible
    # Ties (within 0.5 %) go to more groups: fewer, larger DMAs per expert slice.
    low = min(c.score_s for c in pool)
    best = max((c for c in pool if c.score_s <= low * 1.005), key=lambda c: c.groups)
    marked = tuple(
        c.model_copy(
            update={
                "chosen": c is best,
                "rejected": c.rejected
                or ("" if c.lane_aligned or not aligned else "width per rank not 128-lane aligned"),
            }
        )
        for c in candidates
    )
    slice_bytes, slice_s = _expert_slice(
        ctx, f, d_in, best.width_per_rank, fmt_text, rows_per_expert
    )
    sharing, sharings = _choose_sharing(ctx, f, best, distinct, layers, slice_bytes, slice_s)
    shared = sharing.partner_experts
    return ExpertSplit(
        groups=best.groups,
        width_parts=best.width_parts,
        experts_per_rank=best.experts_per_rank,
        width_per_rank=best.width_per_rank,
        picks=picks,
        expected_distinct=distinct,
        rows_per_expert=rows_per_expert,
        expected_max_experts_per_rank=sharing.expected_max_experts,
        worst_case_experts_per_rank=best.worst_case_experts,
        slice_bytes=slice_bytes,
        slice_dmas=3,
        candidates=marked,
        why=_expert_split_why(best, pool) + _sharing_why(sharing, sharings, best.experts_per_rank),
        sharing=sharing.sharing,
        partner_experts=shared,
        partner_bytes_per_layer=shared * slice_bytes,
        expected_ring_bounds=sharing.expected_bounds,
        sharing_candidates=sharings,
        chained_expected_max_experts_per_rank=sharing.chained_expected_max_experts,
    )


def _expert_candidate(
    ctx: _Ctx, f: MoEFFN, d_in: int, g: int, distinct: float, rows_per_expert: int
) -> ExpertCandidate:
    """The split of the experts into `g` groups (each of width parts over the rest of the
    devices), scored by the expected slices of its worst-loaded group, or rejected."""
    e, width = f.num_experts, f.expert_width
    fmt_text = ctx.fmt("experts")
    fmt = parse_format(fmt_text)
    picks = ctx.tokens * f.top_k
    forced = ctx.options.distinct_experts_per_layer
    w = ctx.d // g
    reasons = []
    if e % g:
        reasons.append(f"{e} experts % {g} groups != 0")
    if width % w:
        reasons.append(f"width {width} % {w} != 0")
    wpr = width // w if width % w == 0 else 0
    if wpr and fmt.block and wpr % fmt.block:
        reasons.append(f"width {wpr} per rank not a multiple of the {fmt} group")
    per_group = e // g if e % g == 0 else 0
    if reasons:
        return ExpertCandidate(
            groups=g, width_parts=w, width_per_rank=wpr, experts_per_rank=per_group,
            lane_aligned=False, expected_max_experts=0, expected_rank_bytes=0,
            worst_case_experts=0, worst_case_rank_bytes=0, score_s=math.inf,
            rejected="; ".join(reasons),
        )  # fmt: skip
    # Expected distinct experts of the worst-loaded group (the step waits for it).
    if forced is not None:
        pmf = _pmf_hypergeometric(e, per_group, int(distinct))
        worst = min(int(distinct), per_group)
    else:
        pmf = _pmf_binomial(per_group, distinct / e)
        worst = min(picks, per_group)
    exp_max = expected_max(pmf, g)
    slice_bytes, slice_s = _expert_slice(ctx, f, d_in, wpr, fmt_text, rows_per_expert)
    return ExpertCandidate(
        groups=g,
        width_parts=w,
        width_per_rank=wpr,
        experts_per_rank=per_group,
        lane_aligned=wpr % LANES == 0,
        expected_max_experts=exp_max,
        expected_rank_bytes=exp_max * slice_bytes,
        worst_case_experts=worst,
        worst_case_rank_bytes=worst * slice_bytes,
        score_s=exp_max * slice_s,
    )


def _expert_split_why(best: ExpertCandidate, pool: list[ExpertCandidate]) -> str:
    """Why `best` of the candidates in `pool`: its load and the next best's score."""
    runner = sorted((c for c in pool if c is not best), key=lambda c: c.score_s)
    vs = (
        f"; next best {runner[0].groups}x{runner[0].width_parts} at "
        f"{runner[0].score_s * 1e6:.1f} us"
        if runner
        else ""
    )
    return (
        f"{best.groups} groups x {best.width_parts} width parts: worst-loaded rank reads "
        f"{best.expected_max_experts:.1f} expert slices of width {best.width_per_rank} "
        f"({best.score_s * 1e6:.1f} us per layer){vs}; collectives are the same for every split "
        "(routing is replicated, one reduction per layer)"
    )


def _expert_slice(
    ctx: _Ctx, f: MoEFFN, d_in: int, wpr: int, fmt_text: str, rows: int
) -> tuple[int, float]:
    """(HBM bytes, seconds) of one expert's per-rank slice: gate, up [d, w] and down [w, d]."""
    fmt = parse_format(fmt_text)
    nbytes = 2 * fmt.matrix_bytes(d_in, wpr) + fmt.matrix_bytes(wpr, d_in)
    mxu = vpu = 0.0
    for k_dim, n_dim in ((d_in, wpr), (d_in, wpr), (wpr, d_in)):
        m, v = matmul_cost(ctx.c, fmt_text, k_dim, n_dim, rows)
        mxu, vpu = mxu + m, vpu + v
    return nbytes, max(ctx.c.dma_s(nbytes, 3), mxu, vpu)


# --------------------------------------------------------------------------- FFN


# --------------------------------------------------------------------------- entry


def plan_sharding(
    spec: ModelSpec, topo: Topology, options: BuildOptions, *, kinds: KindRegistry,
    expert_room_bytes: float | None = None, passes: DraftPasses | None = None,
) -> ShardingPlan:  # fmt: skip
    """Per-rank shapes, caches and collectives of ``spec`` on ``topo``, each layer kind's
    by its rule in ``kinds``. Expert sharing is chosen within `expert_room_bytes` of HBM
    per core (None: not known, every choice fits; mkgen.plan.memory.plan_fitted gives it).
    A fused drafter's `passes` (``spec`` is then mkgen.plan.fused.fused_model's) add the MTP
    module's eh_proj and norms, replicated.

    Raises a one-line SpecError with the numbers and a fix when a split is impossible.
    """
    ctx = _Ctx(spec, topo, options, expert_room_bytes, passes)
    h, v, d = spec.dims.hidden, spec.dims.vocab, ctx.d
    table = spec.layer_table()
    used_attn = {a for a, _ in table}
    used_ffn = {f for _, f in table}
    attention = {
        name: kinds.rules(kind.type, f"attention_kinds.{name}").shard(ctx, name, kind)
        for name, kind in spec.attention_kinds.items()
        if name in used_attn
    }
    ffn = {name: kinds.rules(kind.type, f"ffn_kinds.{name}").shard(ctx, name, kind)
           for name, kind in spec.ffn_kinds.items() if name in used_ffn}  # fmt: skip
    vocab_pr = -(-v // d)  # rows of the vocabulary per rank (the last rank's are padded)
    glob = [
        make_shard(
            "embedding", (v, h), "embedding", ctx.fmt("embedding"), d, split_axis=0,
            parts=d, rank_extent=vocab_pr, why="vocabulary rows",
        ),
    ]  # fmt: skip
    if spec.attention_residual:
        r = spec.attention_residual
        count = spec.layers.count if passes is None else passes.first_layer  # the target's
        blocks = math.ceil(count / r.block_size)
        glob.append(ctx.shard("attn_res_logits", (blocks, r.max_snapshots), VECTORS,
                              why="replicated"))  # fmt: skip
    glob.append(ctx.shard("final_norm", (h,), VECTORS, why="replicated"))
    if not spec.dims.tie_embeddings:
        glob.append(
            make_shard(
                "lm_head", (h, v), "lm_head", ctx.fmt("lm_head"), d, split_axis=1, parts=d,
                rank_extent=vocab_pr, why="vocabulary columns",
            )
        )  # fmt: skip
    if passes is not None:
        glob += [ctx.shard(MODULE_PREFIX + n, (h,), VECTORS, why="replicated") for n in DRAFT_NORMS]
        if h % d:
            raise SpecError(
                f"--fuse-draft: the MTP module's eh_proj output ({h} columns) does not split "
                f"over {d} cores; leave --fuse-draft out"
            )
        glob.append(ctx.shard(MODULE_PREFIX + "eh_proj", (2 * h, h), "projections",
                              split_axis=1, parts=d, why="output columns, all-gathered"))  # fmt: skip
    layer_vectors = (
        ctx.shard("attn_norm", (h,), VECTORS, why="replicated"),
        ctx.shard("ffn_norm", (h,), VECTORS, why="replicated"),
    )
    step = (
        # The embedding row of each token lives on one rank: broadcast it to all.
        ctx.collective("embedding", "all_reduce", "embedding", h),
        # Greedy sampling: (max, argmax) per rank, gathered (two f32 words per row).
        ctx.collective("sampling", "all_gather", "lm_head", 2 * d),
    )
    if passes is not None:  # each pass's eh_proj output columns, gathered
        step += (ctx.collective("eh_proj", "all_gather", MODULE_PREFIX + "eh_proj", h),)
    return ShardingPlan(
        model=spec.name,
        topology=topo.name,
        devices=d,
        tokens=ctx.tokens,
        quantization=ctx.quant,
        globals=tuple(glob),
        layer_vectors=layer_vectors,
        attention=attention,
        ffn=ffn,
        step_collectives=step,
        layer_table=tuple(table),
        draft_passes=passes,
    )


def full_size_splits(
    full: ModelSpec, topo: Topology, options: BuildOptions, *, kinds: KindRegistry
) -> tuple[str, ...]:
    """What the full-size build of `full` splits rather than replicates, its MoE latent
    designs where they combine by all-gather and the collectives it runs flat or scattered
    (BuildOptions.splits): its mini twin takes
    these choices, since at CPU sizes replicating (and rs_ar) always costs less,
    so that the twin proves the full-size build's kernel. A spec with no full-size build
    on `topo` (its heads do not split over the cores) has no choices to pass on."""
    try:
        plan = plan_sharding(full, topo, options, kinds=kinds)
    except SpecError:
        return ()
    routers = [f"ffn.{name}.router" for name, f in plan.ffn.items() if f.router == "split"]
    designs = [f"ffn.{name}.ar_ag" for name, f in plan.ffn.items() if f.latent_design == "ar_ag"]
    latents = [f"attention.{n}.latent" for n, a in plan.attention.items() if a.latent == "split"]
    sharded = [*plan.attention.values(), *plan.ffn.values()]
    every = [c for k in sharded for c in k.collectives] + list(plan.step_collectives)
    schemes = sorted(
        {
            scheme_key(scheme, c.name, c.op)
            for c in every
            if (scheme := scheme_of(c.rounds)) != "staged"
        }
    )
    return tuple(routers + designs + latents + schemes)


def scheme_key(scheme: Scheme, name: str, op: CollectiveOp) -> str:
    """How BuildOptions.splits names a collective that runs flat (one round of every
    core) or scattered (an all-reduce as reduce-scatter, all-reduce, all-gather): its
    mini twin runs the same collectives so as its full-size build."""
    return f"{scheme}.{op}.{name}"
