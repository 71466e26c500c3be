"""Cost model: the constants it prices with, its answer (Estimate) and the trace format.

The walk of the schedule that produces the answer is mkgen/plan/timeline.py
(docs/cost-model.md). Everything here is pure Python.
"""

from __future__ import annotations

import math
from functools import cache
from typing import TYPE_CHECKING, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

from mkgen.hardware import ISSUE_RATES, Chip, IssueRates, MiB
from mkgen.spec.quant import QuantFormat, parse_format

if TYPE_CHECKING:
    from mkgen.plan.options import BuildOptions
    from mkgen.spec.topology import Topology

US = 1e-6

# The streaming measurement behind the per-DMA overhead moved 2 MiB banks (Inferact
# musespark/README.md: "12 x 2 MiB ring", 76 MiB of dense weights a layer in 25 us).
MEASURED_STREAM_DMA_BYTES = 2 * MiB
# matmul_cost (the expert split's score in mkgen.plan.sharding): 512-deep K chunks for
# block-diagonal group scales, and an assumed VPU rate (the catalog has none).
BLOCK_DIAG_CHUNK = 512
VPU_OPS_PER_S = 4.0e12

# Token rows are padded to whole sublane groups of f32 vregs (8 rows) in every
# vector op and collective payload (the Muse Spark kernel pads B to 8).
ROW_BLOCK = 8

MxuPath = Literal["bf16", "fp8", "int8"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class CostConstants(_Frozen):
    """Every number the cost model computes with, each traceable to the catalog or a note.

    ``sources`` says where each came from; docs/cost-model.md has the table.
    """

    hbm_bandwidth: float  # bytes/s per core, HBM -> VMEM
    dma_overhead_s: float  # per DMA descriptor
    mxu_dim: int
    peak_flops: dict[str, float]  # per core, by MXU path
    vpu_ops_per_s: float
    # What one core issues per cycle (None: not in the catalog, the core's ops unpriced).
    issue_rates: IssueRates | None
    collective_phase_s: float
    cross_host_phase_s: float
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
            overhead = MEASURED_STREAM_DMA_BYTES * (1 / measured.low - 1 / bw)
            overhead_src = (
                "2 MiB x (1/low - 1/high) of the catalog's measured streaming range "
                f"({measured.low / 1e12:.1f}-{measured.high / 1e12:.1f} TB/s)"
            )
        else:
            overhead = MEASURED_STREAM_DMA_BYTES * (1 / 3.0e12 - 1 / 3.2e12)
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
            mxu_dim=chip.mxu_shape[0],
            peak_flops=peak,
            vpu_ops_per_s=VPU_OPS_PER_S,
            issue_rates=ISSUE_RATES.get(chip.name),
            collective_phase_s=chip.collective_phase_latency.cost_model,
            cross_host_phase_s=chip.cross_host_phase_latency.cost_model,
            ici_bandwidth={lv.name: lv.bandwidth_bytes_per_s for lv in chip.ici_levels},
            dispatch_s=chip.dispatch_s_per_call,
            steps_per_call=steps,
            price_per_chip_hour_usd=price,
            sources={
                "hbm_bandwidth": "catalog cost_model_hbm_bandwidth",
                "dma_overhead_s": overhead_src,
                "mxu, vpu_ops_per_s": "catalog peak_*_flops_per_chip / cores and mxu_shape; "
                "an assumed VPU rate: only the expert split's score (matmul_cost) uses them",
                "issue_rates": "catalog ISSUE_RATES (assumptions, mkgen/hardware.py): the "
                "program's ops per cycle",
                "collective_phase_s": "catalog collective_phase_latency.cost_model",
                "cross_host_phase_s": "catalog cross_host_phase_latency.cost_model "
                "(an assumption: no cross-host measurement); a cross-host round's latency",
                "ici_bandwidth": "catalog ici_levels",
                "dispatch_s": "catalog dispatch_s_per_call, amortised over steps_per_call",
            },
        )

    def with_inputs(self, **inputs: float) -> CostConstants:
        """These constants with some unmeasured inputs set otherwise (the sensitivity
        table, mkgen/plan/confidence.py): `cross_host_phase_s`, `host_bandwidth` (bytes/s
        per core of a cross-host copy), `clock_hz` (with the MXUs a core must have to reach
        the catalog's peak at that clock), `scalar_ops_per_cycle`, `dma_overhead_s`."""
        update: dict[str, object] = {}
        for name, value in inputs.items():
            if name == "host_bandwidth":
                update["ici_bandwidth"] = {**self.ici_bandwidth, "host": value}
            elif name == "clock_hz":
                assert self.issue_rates is not None, "no issue rates to clock"
                update["issue_rates"] = self.issue_rates.at_clock(value)
            elif name == "scalar_ops_per_cycle":
                assert self.issue_rates is not None, "no issue rates to change"
                update["issue_rates"] = self.issue_rates.model_copy(update={name: value})
            else:
                update[name] = value
        return self.model_copy(update=update)

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

    def vpu_s(self, ops: float) -> float:
        return ops / self.vpu_ops_per_s


@cache
def chip_constants(chip: Chip) -> CostConstants:
    """The catalog's constants for `chip` without a build's options (the sharding plan's
    collective prices), derived once per chip."""
    return CostConstants.from_chip(chip)


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
ENGINES = ("dma", "core", "ici")


class TraceEvent(_Frozen):
    """One op of the program on one engine's track of the walked timeline (seconds).

    `name` is the schedule node's, starting with where in the step it is (`L12` for
    layer 12, `prologue`, `epilogue`; a ring bank names the layer that uses it, also when
    the ring fetched it during an earlier one); `args` say what moved or ran: the
    schedule node (`node`), bytes, DMAs and the queue of a DMA, the ring bank, the
    repeats of a folded loop's op."""

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
    # Those bytes at the streaming rate: the time this kernel's own traffic takes. It grows
    # with the kernel's padding and replication, so the bar a step is held against is the
    # ideal floor (mkgen/plan/floor.py), not this.
    hbm_floor_ms: float
    tokens_per_s_per_user: float
    tokens_per_s: float
    tokens_per_dollar: float | None
    chips: int
    price_per_chip_hour_usd: float | None
    acceptance: float
    batch: int
    rows: int
    constants: CostConstants
    # The two engines' busy time over the walk: the HBM DMA engine's, and the core's
    # running the program's ops at the chip's issue rates (None where the catalog has no
    # rates: the core's ops are then not priced). The step is at least the larger.
    dma_timeline_ms: float
    compute_timeline_ms: float | None = None
    # Weight formats and attention geometries the op-count model has no measurement for:
    # their compute is missing from compute_timeline_ms, a lower bound then.
    compute_unpriced_formats: tuple[str, ...] = ()
    # The core's waits on cross-host rounds' flights that no DMA covers (part of the
    # breakdown's collectives): priced by the catalog's cross-host figures, unmeasured.
    cross_host_wait_ms: float = 0.0
    # The walked timeline (only when asked for); not part of saved plans.
    events: tuple[TraceEvent, ...] = Field(default=(), exclude=True)
    # The drafter's passes (mkgen/plan/draft.py), when a plan prices one: the step is then
    # `drafted_step_ms`, verify + draft. Builds draft nothing (no kernel runs a drafter), so
    # no saved estimate holds one; `mkgen plan --json` prints it (estimate.draft_ms).
    draft_ms: float | None = Field(default=None, exclude=True)
    # A kernel that drafts (its mtp drafter's passes are layers of the walked program,
    # mkgen/plan/fused.py): the step is verify and draft; the same build's verify-only
    # kernel's step, walked apart, says what the draft adds.
    fused_verify_ms: float | None = Field(default=None, exclude=True)

    @property
    def compute_bound(self) -> bool:
        """The core is busy longer than the HBM DMA engine."""
        return self.compute_timeline_ms is not None and (
            self.compute_timeline_ms > self.dma_timeline_ms
        )

    @property
    def timelines(self) -> str:
        """One sentence: the two engines' busy time and which one bounds the step."""
        unpriced = (
            f"; without {', '.join(self.compute_unpriced_formats)}, which the op-count model "
            "has no measurement for, a lower bound"
            if self.compute_unpriced_formats
            else ""
        )
        return (
            f"The step walks the program: the core computes {self.compute_timeline_ms:.3f} ms "
            "(the program's op counts at the chip's issue rates, assumptions in "
            f"mkgen/hardware.py{unpriced}) and the HBM DMA engine streams "
            f"{self.dma_timeline_ms:.3f} ms: {'compute' if self.compute_bound else 'DMA'}-bound"
        )

    @property
    def drafted_step_ms(self) -> float:
        """The whole step: the walked verify step, plus the drafter's passes if priced."""
        return self.step_ms + (self.draft_ms or 0.0)

    @property
    def verify_ms(self) -> float:
        """The verify rows' step: the verify-only kernel's when the kernel drafts too."""
        return self.step_ms if self.fused_verify_ms is None else self.fused_verify_ms

    @property
    def step_draft_ms(self) -> float | None:
        """What drafting adds to the step: the priced passes, or what a kernel that drafts
        takes beyond the verify-only kernel (None without a drafter)."""
        if self.fused_verify_ms is not None:
            return self.step_ms - self.fused_verify_ms
        return self.draft_ms

    def with_draft(self, draft_ms: float) -> Estimate:
        """This verify step with a drafter's passes priced at `draft_ms`: the tokens per
        second and per dollar are then of verify + draft."""
        return self.model_copy(update={"draft_ms": draft_ms}).at_acceptance(self.acceptance)

    def at_acceptance(self, acceptance: float) -> Estimate:
        """This step at another mean acceptance: the step does not depend on it (the
        kernel verifies every row), the tokens per second and per dollar scale with it."""
        tps_user = acceptance / (self.drafted_step_ms / 1e3)
        tps = tps_user * self.batch
        price = self.price_per_chip_hour_usd
        return self.model_copy(
            update={
                "acceptance": acceptance,
                "tokens_per_s_per_user": tps_user,
                "tokens_per_s": tps,
                "tokens_per_dollar": tps * 3600 / (self.chips * price) if price else None,
            }
        )

    @property
    def point(self) -> str:
        """Which build the step is of: 'batch 1 x rows 8'."""
        return f"batch {self.batch} x rows {self.rows}"

    @property
    def headline(self) -> str:
        """The step as every output states it: 'predicted 6.967 ms/step at batch 1 x rows 8
        (verify only, no drafting)': with rows > 1 the step verifies drafts it does not
        make, so it is not a step with a drafter's cost in it. With a drafter priced:
        'predicted verify 6.967 + draft 0.747 = 7.714 ms/step at batch 1 x rows 8 (the draft
        priced as fused into the kernel; a build's runner drafts with it in a separate jitted
        JAX step between kernel calls)'; a kernel that drafts (--fuse-draft): 'predicted
        6.074 ms/step at batch 1 x rows 8 (verify and draft in one kernel: ...)'."""
        return self._stated()

    def _stated(self, *more: str) -> str:
        """The headline, `more` added to what its parenthesis says."""
        if self.fused_verify_ms is not None:
            figure = f"predicted {self.step_ms:.3f} ms/step at {self.point}"
            said = [
                "verify and draft in one kernel: the drafter's passes are layers of the step; "
                f"the verify-only kernel {self.fused_verify_ms:.3f}",
                *more,
            ]
        elif self.draft_ms is not None:
            figure = (
                f"predicted verify {self.step_ms:.3f} + draft {self.draft_ms:.3f} = "
                f"{self.drafted_step_ms:.3f} ms/step at {self.point}"
            )
            said = [
                "the draft priced as fused into the kernel",
                "a build's runner drafts with it in a separate jitted JAX step between "
                "kernel calls",
                *more,
            ]
        else:
            figure = f"predicted {self.step_ms:.3f} ms/step at {self.point}"
            said = [*(["verify only, no drafting"] if self.rows > 1 else []), *more]
        return f"{figure} ({'; '.join(said)})" if said else figure

    def describe(self) -> str:
        lines = [
            f"{self._stated("the cost model's prediction")}; {self.tokens_per_s_per_user:.1f} "
            f"tok/s per user, {self.tokens_per_s:.1f} tok/s"
            + (
                f", {self.tokens_per_dollar:,.0f} tokens per $"
                if self.tokens_per_dollar is not None
                else ""
            ),
            f"  HBM traffic {self.hbm_bytes_per_device_per_step / 1e9:.3f} GB per core per step "
            f"({self.hbm_floor_ms:.3f} ms at {self.constants.hbm_bandwidth / 1e12:.1f} TB/s)",
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
