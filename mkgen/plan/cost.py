"""Cost model: a timeline simulation of one decode step on one core.

Three engines per core, simulated in program order (docs/cost-model.md):

- the DMA engine streams HBM -> VMEM at the catalog's ``cost_model_hbm_bandwidth``
  plus a per-DMA overhead, in issue order (one queue);
- the core (MXU and VPU together) consumes what the DMAs brought: at decode the
  MXU is weight-push bound, so a 256x256 weight tile costs one full pass at the
  catalog's peak rate for its MXU dtype plus one row time per LHS row; VPU work
  (group scales, softmax, norms, routing) overlaps the MXU and is modelled
  simply (an assumed element rate and a fixed latency per dependent stage);
- the interconnect runs the collectives: one latency-bound phase per flat
  collective (catalog ``collective_phase_latency``) plus bytes over the slowest
  link level crossed (catalog ICI levels).

Dense weights go through a ring of fixed-size banks that streams across layer
boundaries (a bank is refilled right after it is consumed); expert DMAs are issued
after routing into a few slots; KV / state tiles at layer start. The calibrated
structural assumption (measurements.md: the Muse Spark step is the sum of its
phases): a collective's remote DMAs queue behind the in-flight HBM DMAs of the
same core, so collectives do not hide under the weight stream.

Everything here is pure Python (no JAX).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

from mkgen.hardware import Chip, MiB
from mkgen.spec.quant import QuantFormat, parse_format

if TYPE_CHECKING:
    from mkgen.plan.options import BuildOptions
    from mkgen.spec.topology import Topology

US = 1e-6

# Tuning choices of the hand-written Muse Spark kernel (Inferact musespark/README.md),
# used until the schedule (a later stage) chooses its own: a ring of 12 banks of 2 MiB,
# four expert slots, 256-token KV tiles, 512-deep K chunks for block-diagonal group scales.
REFERENCE_BANK_BYTES = 2 * MiB
REFERENCE_RING_BANKS = 12
REFERENCE_EXPERT_SLOTS = 4
REFERENCE_KV_TILE_TOKENS = 256
BLOCK_DIAG_CHUNK = 512

# Assumptions: the catalog has no VPU figures. 8 sublanes x 128 lanes x 2 VALU slots at
# ~2 GHz, order of magnitude only; the calibration is insensitive to a 2x change
# (docs/cost-model.md, "sensitivity").
VPU_OPS_PER_S = 4.0e12
# Pipeline drain / cross-lane reduction of one dependent vector stage (a norm, a
# softmax, an activation): order of magnitude only.
VECTOR_STAGE_S = 0.1 * US

# Token rows are padded to whole sublane groups of f32 vregs (8 rows) in every
# vector op and collective payload (the Muse Spark kernel pads B to 8).
ROW_BLOCK = 8
WIRE_BYTES = 2  # collectives ship bf16 partials and sum in f32 (Muse Spark "bf16 wire")

MxuPath = Literal["bf16", "fp8", "int8"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class CostConstants(_Frozen):
    """Every number the cost model computes with, each traceable to the catalog or a note.

    ``sources`` says where each came from; docs/cost-model.md has the table.
    """

    hbm_bandwidth: float  # bytes/s per core, HBM -> VMEM
    dma_overhead_s: float  # per DMA descriptor
    bank_bytes: int
    ring_banks: int
    expert_slots: int
    kv_tile_tokens: int
    mxu_dim: int
    peak_flops: dict[str, float]  # per core, by MXU path
    vpu_ops_per_s: float
    vector_stage_s: float
    collective_phase_s: float
    ici_bandwidth: dict[str, float]  # per core, one direction, by level
    dispatch_s: float
    steps_per_call: int
    price_per_chip_hour_usd: float | None
    sources: dict[str, str]

    @classmethod
    def from_chip(cls, chip: Chip, options: BuildOptions | None = None) -> CostConstants:
        """Derive the constants from the catalog entry (and the options' overrides)."""
        bw = chip.cost_model_hbm_bandwidth
        measured = chip.hbm_stream_bandwidth_measured
        if measured is not None and measured.low < bw:
            # The kernel streamed 2 MiB banks at the low end of the measured range while
            # the catalog's rate is the high end: the difference per bank is the
            # per-descriptor cost (~44 ns on TPU7x).
            overhead = REFERENCE_BANK_BYTES * (1 / measured.low - 1 / bw)
            overhead_src = (
                "2 MiB x (1/low - 1/high) of the catalog's measured streaming range "
                f"({measured.low / 1e12:.1f}-{measured.high / 1e12:.1f} TB/s)"
            )
        else:
            overhead = REFERENCE_BANK_BYTES * (1 / 3.0e12 - 1 / 3.2e12)
            overhead_src = "TPU7x figure reused (no streaming measurement for this chip)"
        peak = {}
        for path in ("bf16", "fp8", "int8"):
            value = chip.peak_flops_per_core(path)
            if value is not None:
                peak[path] = value
        price = chip.price_per_chip_hour_usd
        if options is not None and options.price_per_chip_hour_usd is not None:
            price = options.price_per_chip_hour_usd
        steps = options.steps_per_call if options is not None else 16
        return cls(
            hbm_bandwidth=bw,
            dma_overhead_s=overhead,
            bank_bytes=REFERENCE_BANK_BYTES,
            ring_banks=REFERENCE_RING_BANKS,
            expert_slots=REFERENCE_EXPERT_SLOTS,
            kv_tile_tokens=REFERENCE_KV_TILE_TOKENS,
            mxu_dim=chip.mxu_shape[0],
            peak_flops=peak,
            vpu_ops_per_s=VPU_OPS_PER_S,
            vector_stage_s=VECTOR_STAGE_S,
            collective_phase_s=chip.collective_phase_latency.cost_model,
            ici_bandwidth={lv.name: lv.bandwidth_bytes_per_s for lv in chip.ici_levels},
            dispatch_s=chip.dispatch_s_per_call,
            steps_per_call=steps,
            price_per_chip_hour_usd=price,
            sources={
                "hbm_bandwidth": "catalog cost_model_hbm_bandwidth",
                "dma_overhead_s": overhead_src,
                "bank_bytes, ring_banks, expert_slots, kv_tile_tokens": (
                    "tuning choices of the Muse Spark kernel (12 x 2 MiB ring, 4 slots, "
                    "256-token tiles) until the schedule chooses its own"
                ),
                "mxu": "catalog peak_*_flops_per_chip / cores and mxu_shape: a weight tile "
                "costs one full mxu_dim-row pass (weight-push bound) plus one row per LHS row",
                "vpu_ops_per_s, vector_stage_s": "assumption (not in the catalog)",
                "collective_phase_s": "catalog collective_phase_latency.cost_model",
                "ici_bandwidth": "catalog ici_levels",
                "dispatch_s": "catalog dispatch_s_per_call, amortised over steps_per_call",
            },
        )

    # --- primitives ---
    def dma_s(self, nbytes: float, count: int = 1) -> float:
        """Engine time of ``count`` DMAs moving ``nbytes`` in total."""
        return nbytes / self.hbm_bandwidth + count * self.dma_overhead_s

    def row_s(self, path: str) -> float:
        """Time one LHS row takes through one mxu_dim x mxu_dim weight tile."""
        return 2 * self.mxu_dim * self.mxu_dim / self.peak_flops[path]

    def tile_s(self, path: str, lhs_rows: int) -> float:
        """One weight tile: a full push (mxu_dim rows' worth) plus the LHS rows."""
        return (self.mxu_dim + lhs_rows) * self.row_s(path)

    def vpu_s(self, ops: float, stages: int = 0) -> float:
        return ops / self.vpu_ops_per_s + stages * self.vector_stage_s


def pad_rows(n: int) -> int:
    """Token rows as the kernel holds them: whole 8-row sublane blocks."""
    return -(-n // ROW_BLOCK) * ROW_BLOCK


def mxu_path(fmt: QuantFormat, chip_paths: dict[str, float]) -> MxuPath:
    """Which MXU rate a weight format runs at.

    bf16 and int8 (int8 is not exact in e4m3) go through the bf16 path (int8 where the
    chip has an int8 MXU); int4 (-8..7), e2m1 and fp8 codes are exact in e4m3 and use
    the fp8 path where the chip has one.
    """
    if fmt.kind == "int8" and "int8" in chip_paths:
        return "int8"
    if fmt.kind in ("int4", "mxfp4", "nvfp4", "fp8") and "fp8" in chip_paths:
        return "fp8"
    return "bf16"


def matmul_cost(
    c: CostConstants, fmt_text: str, fan_in: int, fan_out: int, rows: int
) -> tuple[float, float]:
    """(MXU seconds, VPU seconds) of ``[rows, fan_in] @ [fan_in, fan_out]`` in a format.

    Group-scaled formats (int4:G, mxfp4, nvfp4, fp8:B) apply their scales with a
    block-diagonal LHS: each K chunk of BLOCK_DIAG_CHUNK is split into its groups,
    so the MXU sees (chunk / group) x rows LHS rows and the VPU multiplies and sums
    each group's partial product; or the weights are dequantized to bf16 on the VPU
    and pushed at the bf16 rate. The cheaper of the two is taken.
    """
    fmt = parse_format(fmt_text)
    tiles = math.ceil(fan_in / c.mxu_dim) * math.ceil(fan_out / c.mxu_dim)
    rows_p = pad_rows(rows)
    path = mxu_path(fmt, c.peak_flops)
    block = fmt.block
    if block is None:
        mxu = tiles * c.tile_s(path, rows_p)
        # per-output-channel scales (int8) are one multiply per output after the K sweep
        vpu = c.vpu_s(2 * rows_p * fan_out) if fmt.kind == "int8" else 0.0
        return mxu, vpu
    chunk = min(BLOCK_DIAG_CHUNK, fan_in)
    groups_per_chunk = max(1, chunk // block)
    lhs = pad_rows(groups_per_chunk * rows)
    diag_mxu = tiles * c.tile_s(path, lhs)
    diag_vpu = c.vpu_s(2 * lhs * fan_out * math.ceil(fan_in / chunk))
    deq_mxu = tiles * c.tile_s("bf16" if "bf16" in c.peak_flops else path, rows_p)
    deq_vpu = c.vpu_s(4 * fan_in * fan_out)
    if max(diag_mxu, diag_vpu) <= max(deq_mxu, deq_vpu):
        return diag_mxu, diag_vpu
    return deq_mxu, deq_vpu


def level_peers(topo: Topology) -> dict[str, int]:
    """Peers of device 0 at each interconnect level (the slice is symmetric)."""
    out = {"core": 0, "chip": 0, "host": 0}
    for d in range(1, topo.num_devices):
        out[topo.level_between(0, d)] += 1
    return out


def widest_level(topo: Topology) -> str:
    peers = level_peers(topo)
    for name in ("host", "chip", "core"):
        if peers[name]:
            return name
    return "core"


# =========================================================================== simulation

Category = Literal["weights", "experts", "kv_state", "collectives", "lm_head", "compute", "fixed"]
CATEGORIES: tuple[str, ...] = get_args(Category)
# The breakdown category of a compute-bound step's time beyond its DMA timeline.
COMPUTE_BOUND = "compute-bound excess"
ENGINES = ("dma", "core", "ici")


class TraceEvent(_Frozen):
    """One interval on one engine's track of the simulated timeline (seconds).

    `name` starts with where in the step it is (`L12` for layer 12, `prologue`,
    `epilogue`); `args` say what moved or ran: bytes, the ring bank, the tensors of its
    segment, the expert (numbered in load order: routing picks the ids at run time)."""

    engine: Literal["dma", "core", "ici"]
    name: str
    start: float
    duration: float
    category: str = ""
    args: dict[str, int | str | list[str]] = {}


class KindTime(_Frozen):
    layers: int
    total_ms: float
    per_layer_us: float


class Estimate(_Frozen):
    """The cost model's answer for one build."""

    step_ms: float
    breakdown_ms: dict[str, float]  # by category; sums to step_ms
    by_layer_kind: dict[str, KindTime]  # "attn/ffn" -> time
    hbm_bytes_per_device_per_step: int
    hbm_floor_ms: float
    floor_ratio: float  # hbm_floor / step (1.0 = at the streaming floor); see times_floor
    tokens_per_s_per_user: float
    tokens_per_s: float
    tokens_per_dollar: float | None
    chips: int
    price_per_chip_hour_usd: float | None
    acceptance: float
    batch: int
    constants: CostConstants
    # The simulated DMA/ring timeline, and the program's compute timeline (the model's op
    # counts at the chip's issue rates; None where the catalog has no rates): the step is
    # the larger (compute_bound).
    dma_timeline_ms: float
    compute_timeline_ms: float | None = None
    # Weight formats the op-count model has no measurement for: their compute is missing
    # from compute_timeline_ms, a lower bound then.
    compute_unpriced_formats: tuple[str, ...] = ()
    # The simulated timeline (only when asked for); not part of saved plans.
    events: tuple[TraceEvent, ...] = Field(default=(), exclude=True)

    @property
    def compute_bound(self) -> bool:
        return self.step_ms > self.dma_timeline_ms

    @property
    def timelines(self) -> str:
        """One sentence: the two timelines and which one the step is."""
        unpriced = (
            f"; without {', '.join(self.compute_unpriced_formats)}, which the op-count model "
            "has no measurement for, a lower bound"
            if self.compute_unpriced_formats
            else ""
        )
        return (
            f"The step is the larger of the DMA timeline ({self.dma_timeline_ms:.3f} ms, "
            f"simulated) and the compute timeline ({self.compute_timeline_ms:.3f} ms: the "
            "program's op counts at the chip's issue rates, assumptions in mkgen/hardware.py"
            f"{unpriced}): {'compute' if self.compute_bound else 'DMA'}-bound"
        )

    def with_compute_timeline(
        self, compute_ms: float | None, unpriced: tuple[str, ...] = ()
    ) -> Estimate:
        """This estimate with the step the larger of its DMA timeline and `compute_ms`; a
        compute-bound step's extra time is its own breakdown category, and the rates per
        user, per batch and per dollar follow the step."""
        known = {"compute_timeline_ms": compute_ms, "compute_unpriced_formats": unpriced}
        if compute_ms is None or compute_ms <= self.dma_timeline_ms:
            return self.model_copy(update=known)
        slower = self.dma_timeline_ms / compute_ms
        return self.model_copy(
            update={
                **known,
                "step_ms": compute_ms,
                "breakdown_ms": {**self.breakdown_ms, COMPUTE_BOUND: compute_ms - self.step_ms},
                "floor_ratio": self.hbm_floor_ms / compute_ms,
                "tokens_per_s_per_user": self.tokens_per_s_per_user * slower,
                "tokens_per_s": self.tokens_per_s * slower,
                "tokens_per_dollar": None
                if self.tokens_per_dollar is None
                else self.tokens_per_dollar * slower,
            }
        )

    @property
    def times_floor(self) -> str:
        """The step as a multiple of the HBM floor, e.g. '2.3x the HBM floor' (a share such
        as '40 % of the floor' would read as faster than the floor)."""
        return f"{self.step_ms / self.hbm_floor_ms:.1f}x the HBM floor"

    def describe(self) -> str:
        lines = [
            f"step {self.step_ms:.3f} ms ({self.times_floor} of {self.hbm_floor_ms:.3f} ms); "
            f"{self.tokens_per_s_per_user:.1f} tok/s per user, {self.tokens_per_s:.1f} tok/s"
            + (
                f", {self.tokens_per_dollar:,.0f} tokens per $"
                if self.tokens_per_dollar is not None
                else ""
            )
        ]
        if self.compute_timeline_ms is not None:
            lines.append("  " + self.timelines)
        lines.append(
            "  by category: "
            + ", ".join(f"{k} {v:.3f}" for k, v in self.breakdown_ms.items() if v)
            + " ms"
        )
        for kind, kt in self.by_layer_kind.items():
            lines.append(
                f"  {kind:<24} x{kt.layers:<3} {kt.per_layer_us:8.1f} us/layer "
                f"{kt.total_ms:8.3f} ms"
            )
        return "\n".join(lines)


def to_chrome_trace(events: list[TraceEvent] | tuple[TraceEvent, ...]) -> dict:
    """Chrome / Perfetto trace JSON (``{"traceEvents": [...]}``), one track per engine.

    Complete events ("ph": "X"); thread-name metadata names the tracks. Both ends of a
    slice are rounded to whole nanoseconds first and the duration is their difference,
    so a slice that starts where its neighbour ends never overlaps it. The format counts
    microseconds, so `ts` and `dur` are those nanoseconds / 1000 (three decimals, exact
    in the text); `args` repeat them as integers (`start_ns`, `dur_ns`).
    """
    tids = {name: i + 1 for i, name in enumerate(ENGINES)}
    out: list[dict] = [
        {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "mkgen core 0"}}
    ]
    for name, tid in tids.items():
        out.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": name}})
        out.append(
            {"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": tid,
             "args": {"sort_index": tid}}
        )  # fmt: skip
    for e in events:
        start_ns = round(e.start * 1e9)
        dur_ns = round((e.start + e.duration) * 1e9) - start_ns
        out.append(
            {
                "name": e.name,
                "cat": e.category or e.engine,
                "ph": "X",
                "pid": 1,
                "tid": tids[e.engine],
                "ts": start_ns / 1000,
                "dur": dur_ns / 1000,
                "args": {**e.args, "start_ns": start_ns, "dur_ns": dur_ns},
            }
        )
    return {"traceEvents": out, "displayTimeUnit": "ns"}


class _Bank:
    __slots__ = ("nbytes", "compute_s", "category", "name", "tensors")

    def __init__(
        self, nbytes: int, compute_s: float, category: str, name: str, tensors: list[str]
    ) -> None:
        self.nbytes = nbytes
        self.compute_s = compute_s
        self.category = category
        self.name = name
        self.tensors = tensors  # the segment's tensors (trace args)


class _Sim:
    """One core's timeline: an in-order core, one FIFO DMA engine, the ICI."""

    def __init__(
        self, c: CostConstants, banks: list[_Bank], bank_where: list[str], trace: bool
    ) -> None:
        self.c = c
        self.t = 0.0
        self.engine_free = 0.0
        self.banks = banks
        # Which layer each ring bank belongs to: the ring fetches ahead across layers.
        self.bank_where = bank_where
        self.ready = [0.0] * len(banks)
        self.issued = 0
        self.consumed = 0
        self.dma_log: list[tuple[float, float, str]] = []
        self._p = 0
        self.attr = dict.fromkeys(CATEGORIES, 0.0)
        self.hbm_bytes = 0
        self.trace = trace
        self.events: list[TraceEvent] = []
        self.override: str | None = None  # attribute everything to this category
        self.where = "prologue"  # the trace's name prefix: prologue, L<layer>, epilogue

    def _event(
        self, engine: str, name: str, start: float, dur: float, cat: str, args: dict | None
    ) -> None:
        if self.trace and dur > 0:
            args = args or {}
            where = self.bank_where[args["bank"]] if "bank" in args else self.where
            self.events.append(
                TraceEvent(
                    engine=engine, name=f"{where} {name}", start=start, duration=dur,  # type: ignore[arg-type]
                    category=cat, args=args,
                )
            )  # fmt: skip

    def dma(
        self, issue_t: float, nbytes: float, count: int, category: str, name: str,
        args: dict | None = None,
    ) -> float:  # fmt: skip
        start = max(issue_t, self.engine_free)
        end = start + self.c.dma_s(nbytes, count)
        self.engine_free = end
        self.hbm_bytes += int(nbytes)
        self.dma_log.append((start, end, category))
        self._event("dma", name, start, end - start, category,
                    {"bytes": int(nbytes), "dmas": count, **(args or {})})  # fmt: skip
        return end

    def _bank_args(self, j: int) -> dict:
        return {"bank": j, "bytes": self.banks[j].nbytes, "tensors": self.banks[j].tensors}

    def refill(self) -> None:
        depth = self.c.ring_banks
        while self.issued < len(self.banks) and self.issued < self.consumed + depth:
            b = self.banks[self.issued]
            self.ready[self.issued] = self.dma(
                self.t, b.nbytes, 1, b.category, b.name, self._bank_args(self.issued)
            )
            self.issued += 1

    def _credit(self, category: str, dur: float) -> None:
        self.attr[self.override or category] += dur

    def wait(self, until: float, fallback: str) -> None:
        """Core idles until ``until``: credit the engine's work in that window."""
        if until <= self.t:
            return
        t0, t1 = self.t, until
        log = self.dma_log
        while self._p < len(log) and log[self._p][1] <= t0:
            self._p += 1
        covered = 0.0
        i = self._p
        while i < len(log) and log[i][0] < t1:
            s, e, cat = log[i]
            span = min(e, t1) - max(s, t0)
            if span > 0:
                self._credit(cat, span)
                covered += span
            i += 1
        self._credit(fallback, (t1 - t0) - covered)
        self.t = t1

    def compute(self, dur: float, category: str, name: str, args: dict | None = None) -> None:
        self._event("core", name, self.t, dur, category, args)
        self._credit(category, dur)
        self.t += dur

    def consume(self, first: int, count: int) -> None:
        """Consume ring banks [first, first + count): wait for each, compute, refill."""
        for j in range(first, first + count):
            b = self.banks[j]
            self.wait(self.ready[j], b.category)
            self.compute(b.compute_s, b.category, b.name, self._bank_args(j))
            self.consumed += 1
            self.refill()

    def collective(self, seconds: float, name: str) -> None:
        # The remote DMAs queue behind the HBM DMAs already issued (one queue per core).
        self.wait(self.engine_free, "collectives")
        self._event("ici", name, self.t, seconds, "collectives", None)
        self._credit("collectives", seconds)
        self.t += seconds


# =========================================================================== programs
# A layer program is a list of ops the core runs in order. Ring ops consume the next
# banks of the global ring (built in the same order), so dense weights stream across
# layer boundaries.

_Op = tuple  # ("ring", n) | ("vec", s, cat, name) | ("coll", s, name) | ("cache", ...)


class _Builder:
    def __init__(self, c: CostConstants, spec, sharding, options: BuildOptions) -> None:
        self.c = c
        self.spec = spec
        self.sh = sharding
        self.o = options
        self.rows = options.tokens
        self.rows_p = pad_rows(options.tokens)

    # --- pieces ---
    def ring(self, ops: list, banks: list[_Bank], tensors, category: str, name: str) -> None:
        nbytes = sum(t.rank_bytes for t in tensors)
        if not nbytes:
            return
        comp = 0.0
        for t in tensors:
            if t.family == "vectors" or len(t.rank_shape) < 2:
                continue
            k, n = t.rank_shape[-2], t.rank_shape[-1]
            if t.family == "embedding":
                k, n = n, k
            lead = math.prod(t.rank_shape[:-2])
            mxu, vpu = matmul_cost(self.c, t.format, k, n, self.rows)
            comp += lead * max(mxu, vpu)
        count = max(1, math.ceil(nbytes / self.c.bank_bytes))
        names = [t.name for t in tensors]
        for i in range(count):
            part = min(self.c.bank_bytes, nbytes - i * self.c.bank_bytes)
            banks.append(_Bank(part, comp * part / nbytes, category, name, names))
        ops.append(("ring", count))

    def vec(self, ops: list, elements: float, ops_per: float, stages: int, name: str,
            category: str = "compute") -> None:  # fmt: skip
        ops.append(("vec", self.c.vpu_s(elements * ops_per, stages), category, name))

    def coll(self, ops: list, collectives, name: str) -> None:
        for coll in collectives:
            if coll.name == name:
                ops.append(("coll", coll.time_s, f"{coll.op} {coll.name}"))

    # --- attention ---
    def attention(self, name: str, ops: list, banks: list[_Bank]) -> None:
        a = self.sh.attention[name]
        kind = self.spec.attention_kinds[name]
        h, b, r = self.spec.dims.hidden, self.o.batch, self.o.rows
        tensors = {t.name.removeprefix("attn."): t for t in a.tensors}
        cache = a.cache
        # Cache tiles are issued at layer start (KV prefetch), behind the ring in flight.
        tiles: list[tuple[float, int]] = []
        compute_s = 0.0
        write = 0
        if cache.kind in ("kv", "mla_latent"):
            tokens = min(self.o.context, cache.window) if cache.window else self.o.context
            per_tile = self.c.kv_tile_tokens * cache.bytes_per_token
            n_tiles = math.ceil(tokens / self.c.kv_tile_tokens)
            for _ in range(b):
                for i in range(n_tiles):
                    span = min(self.c.kv_tile_tokens, tokens - i * self.c.kv_tile_tokens)
                    share = span * cache.bytes_per_token
                    tiles.append((share if share < per_tile else per_tile, 2))
            tok_tiles = math.ceil(tokens / self.c.mxu_dim)
            if cache.kind == "kv":
                kvd = cache.heads_per_rank * kind.head_dim
                qk = pv = tok_tiles * math.ceil(kvd / self.c.mxu_dim)
            else:
                qk = tok_tiles * math.ceil(
                    (kind.kv_lora_rank + kind.qk_rope_head_dim) / self.c.mxu_dim
                )
                pv = tok_tiles * math.ceil(kind.kv_lora_rank / self.c.mxu_dim)
            lhs = pad_rows(r * a.heads_per_rank)
            compute_s = b * (qk + pv) * self.c.tile_s("bf16", lhs)
            compute_s = (
                max(compute_s, self.c.vpu_s(b * r * a.heads_per_rank * tokens * 6))
                + 3 * self.c.vector_stage_s
            )
            write = b * r * cache.bytes_per_token
        else:
            tiles = [(cache.fixed_bytes, 1) for _ in range(b)]
            dk = getattr(kind, "head_dim", None) or kind.key_head_dim
            dv = getattr(kind, "head_dim", None) or kind.value_head_dim
            compute_s = self.c.vpu_s(b * r * a.heads_per_rank * dk * dv * 8, 4 * r)
            write = b * cache.fixed_bytes * r
        ops.append(("cache_issue", tiles, f"{name} cache"))
        self.vec(ops, self.rows_p * h, 5, 2, "attn_norm")
        wo = tensors.pop("wo")
        latent_names = ("wq_a", "wkv_a") if a.latent == "split" else ()
        first = [t for n, t in tensors.items() if n in latent_names]
        rest = [t for n, t in tensors.items() if n not in latent_names]
        if first:
            self.ring(ops, banks, first, "weights", f"{name} latent A")
            self.coll(ops, a.collectives, "mla_latent")
            self.vec(ops, self.rows_p * 2112, 5, 2, "latent norms")
        self.ring(ops, banks, rest, "weights", f"{name} projections")
        if a.latent == "split" and not first:
            self.coll(ops, a.collectives, "kda_gate_rank")
        self.vec(ops, self.rows_p * h, 4, 2, "q/k norm, rope, conv")
        ops.append(("cache_consume", compute_s, f"{name} core"))
        if write:
            ops.append(("write", write, f"{name} cache write"))
        self.ring(ops, banks, [wo], "weights", f"{name} wo")
        self.coll(ops, a.collectives, "attn_out")
        self.vec(ops, self.rows_p * h, 8, 2, "residual + ffn_norm")

    # --- FFN ---
    def ffn(self, name: str, ops: list, banks: list[_Bank]) -> None:
        f = self.sh.ffn[name]
        kind = self.spec.ffn_kinds[name]
        t = {x.name.removeprefix("ffn."): x for x in f.tensors}
        h = self.spec.dims.hidden
        if f.experts is None:
            self.ring(ops, banks, [t["w_gate"], t["w_up"]] if "w_gate" in t else [t["w_up"]],
                      "weights", f"{name} gate/up")  # fmt: skip
            self.vec(ops, self.rows_p * t["w_up"].rank_shape[1], 8, 1, "activation")
            self.ring(ops, banks, [t["w_down"]], "weights", f"{name} down")
            self.coll(ops, f.collectives, "ffn_out")
            self.vec(ops, self.rows_p * h, 3, 1, "residual")
            return
        x = f.experts
        first = [t[n] for n in ("router", "latent_in") if n in t] + [
            v for n, v in t.items() if v.family == "vectors" and not n.startswith("experts")
        ]
        self.ring(ops, banks, first, "weights", f"{name} router/latent_in")
        if kind.latent:
            self.coll(ops, f.collectives, "latent_in")
            self.vec(ops, self.rows_p * kind.latent.width, 5, 2, "latent norm")
        e = kind.num_experts
        self.vec(ops, self.rows_p * e * e, 2, 3, "routing", "experts")
        d_in = kind.latent.width if kind.latent else h
        fmt = self.sh.quantization["experts"]
        mxu = vpu = 0.0
        for k_dim, n_dim in ((d_in, x.width_per_rank),) * 2 + ((x.width_per_rank, d_in),):
            m, v = matmul_cost(self.c, fmt, k_dim, n_dim, x.rows_per_expert)
            mxu, vpu = mxu + m, vpu + v
        act = self.c.vpu_s(pad_rows(x.rows_per_expert) * x.width_per_rank * 8)
        n_exp = x.expected_max_experts_per_rank
        ops.append(("experts_issue", n_exp, x.slice_bytes, x.slice_dmas, f"{name} experts"))
        shared = [t[n] for n in ("shared_gate", "shared_up") if n in t]
        if shared:
            self.ring(ops, banks, shared, "weights", f"{name} shared gate/up")
            self.vec(ops, self.rows_p * shared[0].rank_shape[1], 8, 1, "shared activation")
            self.ring(ops, banks, [t["shared_down"]], "weights", f"{name} shared down")
        ops.append(("experts_consume", max(mxu, vpu) + act, f"{name} experts"))
        if kind.latent:
            self.coll(ops, f.collectives, "expert_out")
            self.ring(ops, banks, [t["latent_out"]], "weights", f"{name} latent_out")
        self.coll(ops, f.collectives, "ffn_out")
        self.vec(ops, self.rows_p * h, 3, 1, "residual")


def estimate(
    spec, topo: Topology, options: BuildOptions, sharding, trace: bool = False
) -> Estimate:
    """Simulate one decode step per core of `sharding` (plan_sharding's split of `spec`
    under `options`) and summarise it (see the module docstring)."""
    spec = options.apply(spec)
    sh = sharding
    chip = topo.chip_info
    c = CostConstants.from_chip(chip, options)
    bld = _Builder(c, spec, sh, options)
    templates: dict[tuple[str, str], tuple[list, list[_Bank]]] = {}
    for pair in sh.layer_counts():
        ops: list = []
        banks: list[_Bank] = []
        bld.attention(pair[0], ops, banks)
        bld.ffn(pair[1], ops, banks)
        templates[pair] = (ops, banks)
    head = next((t for t in sh.globals if t.name == "lm_head"), sh.globals[0])
    epi_ops: list = []
    epi_banks: list[_Bank] = []
    bld.vec(epi_ops, bld.rows_p * spec.dims.hidden, 5, 2, "final_norm")
    bld.ring(epi_ops, epi_banks, [head], "lm_head", "lm_head")
    vocab_pr = head.rank_shape[0] if head.name == "embedding" else head.rank_shape[1]
    bld.vec(epi_ops, bld.rows_p * vocab_pr, 4, 2, "softcap + argmax")
    bld.coll(epi_ops, sh.step_collectives, "sampling")

    all_banks: list[_Bank] = []
    bank_where: list[str] = []
    for layer, pair in enumerate(sh.layer_table):
        all_banks += templates[pair][1]
        bank_where += [f"L{layer}"] * len(templates[pair][1])
    all_banks += epi_banks
    bank_where += ["epilogue"] * len(epi_banks)
    sim = _Sim(c, all_banks, bank_where, trace)

    # Prologue: dispatch (amortised), entry barrier, ring priming, embedding.
    sim.override = "fixed"
    sim.compute(c.dispatch_s / c.steps_per_call, "fixed", "dispatch (amortised)")
    sim.refill()
    sim.collective(c.collective_phase_s, "barrier")
    emb = sim.dma(sim.t, options.tokens * spec.dims.hidden * 2, options.tokens, "fixed",
                  "embedding rows")  # fmt: skip
    sim.wait(emb, "fixed")
    for coll in sh.step_collectives:
        if coll.name == "embedding":
            sim.collective(coll.time_s, "all_reduce embedding")
    sim.override = None

    per_kind: dict[tuple[str, str], float] = {}
    bank = 0
    for layer, pair in enumerate(sh.layer_table):
        sim.where = f"L{layer}"
        start = sim.t
        bank = _run(sim, templates[pair][0], bank)
        per_kind[pair] = per_kind.get(pair, 0.0) + sim.t - start
    # Epilogue: the lm_head streams through the same ring; the rest is fixed cost.
    sim.where = "epilogue"
    for op in epi_ops:
        sim.override = None if op[0] == "ring" else "fixed"
        bank = _run(sim, [op], bank)
    sim.override = None
    step = sim.t
    counts = sh.layer_counts()
    by_kind = {
        f"{a}/{f}": KindTime(
            layers=counts[(a, f)],
            total_ms=per_kind[(a, f)] * 1e3,
            per_layer_us=per_kind[(a, f)] / counts[(a, f)] * 1e6,
        )
        for (a, f) in counts
    }
    price = c.price_per_chip_hour_usd
    tps_user = options.acceptance / step
    tps = tps_user * options.batch
    per_dollar = tps * 3600 / (topo.num_chips * price) if price else None
    floor = sim.hbm_bytes / c.hbm_bandwidth
    return Estimate(
        step_ms=step * 1e3,
        dma_timeline_ms=step * 1e3,
        breakdown_ms={k: v * 1e3 for k, v in sim.attr.items()},
        by_layer_kind=by_kind,
        hbm_bytes_per_device_per_step=sim.hbm_bytes,
        hbm_floor_ms=floor * 1e3,
        floor_ratio=floor / step,
        tokens_per_s_per_user=tps_user,
        tokens_per_s=tps,
        tokens_per_dollar=per_dollar,
        chips=topo.num_chips,
        price_per_chip_hour_usd=price,
        acceptance=options.acceptance,
        batch=options.batch,
        constants=c,
        events=tuple(sim.events),
    )


def _run(sim: _Sim, ops: list, bank: int) -> int:
    """Run one program; returns the index of the next ring bank."""
    cache_ready: list[float] = []
    experts: list[float] = []
    exp_plan: tuple = ()
    for op in ops:
        kind = op[0]
        if kind == "ring":
            sim.consume(bank, op[1])
            bank += op[1]
        elif kind == "vec":
            sim.compute(op[1], op[2], op[3])
        elif kind == "coll":
            sim.collective(op[1], op[2])
        elif kind == "cache_issue":
            cache_ready = [
                sim.dma(sim.t, nb, cnt, "kv_state", op[2], {"tile": k})
                for k, (nb, cnt) in enumerate(op[1])
            ]
        elif kind == "cache_consume":
            share = op[1] / max(1, len(cache_ready))
            for k, ready in enumerate(cache_ready):
                sim.wait(ready, "kv_state")
                sim.compute(share, "kv_state", op[2], {"tile": k})
            if not cache_ready:
                sim.compute(op[1], "kv_state", op[2])
        elif kind == "write":
            sim.dma(sim.t, op[1], 1, "kv_state", op[2])
        elif kind == "experts_issue":
            n, nbytes, dmas, name = op[1], op[2], op[3], op[4]
            whole, frac = int(n), n - int(n)
            sizes = [1.0] * whole + ([frac] if frac > 1e-9 else [])
            exp_plan = (sizes, nbytes, dmas, name)
            experts = []
            for k, s in enumerate(sizes[: sim.c.expert_slots]):
                experts.append(sim.dma(sim.t, nbytes * s, dmas, "experts", name, {"expert": k}))
        elif kind == "experts_consume":
            sizes, nbytes, dmas, name = exp_plan
            for i, s in enumerate(sizes):
                sim.wait(experts[i], "experts")
                sim.compute(op[1] * s, "experts", op[2], {"expert": i})
                nxt = i + sim.c.expert_slots
                if nxt < len(sizes):
                    experts.append(
                        sim.dma(sim.t, nbytes * sizes[nxt], dmas, "experts", name, {"expert": nxt})
                    )
    return bank
