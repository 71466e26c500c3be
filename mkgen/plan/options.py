"""Build options: what a user asks of one build beyond the spec and the topology.

Every field maps to a CLI flag of ``mkgen plan`` / ``mkgen build`` (STYLE habit 11:
no environment knobs) and every error is a one-line SpecError naming the flag and
its value. The options are frozen pydantic data so a saved plan records them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
    model_validator,
)

from mkgen.errors import SpecError
from mkgen.hardware import CATALOG
from mkgen.spec.quant import parse_format
from mkgen.spec.schema import (
    DENSE_GROUP,
    MAX_EXPERTS,
    MAX_POSITIONS,
    WEIGHT_FAMILIES,
    ModelSpec,
    Quantization,
)

# Tuning choice, not a physical limit: the published benchmark runs 16 decode steps
# per jitted device call, so the host dispatch is paid once per 16 steps.
DEFAULT_STEPS_PER_CALL = 16
DEFAULT_CONTEXT = 4096
# The ring's bounds: two banks let one stream while the other is used; past 16 the DMA
# engine is never idle at any bank size the planner uses (stream.choose_ring).
MIN_RING_DEPTH, MAX_RING_DEPTH = 2, 16
# Physical bound: one DMA semaphore per slot and array, and every slot a full piece of
# VMEM; 8 is twice the best measured count (measurements: 4 of 3..8 was best).
EXPERT_SLOTS_LIMIT = 8
# Upper bounds (docs/spec-reference.md#bounds). Token rows per step (batch x rows): the
# kernel keeps a 128-lane int32 row of expert ids per token row in SMEM (512 B); 512
# rows take a quarter of a core's 1 MiB, beside the spec's tables (schema.MAX_EXPERTS).
MAX_TOKEN_ROWS = 512
# Steps per device call run in an int32 loop counter.
MAX_STEPS_PER_CALL = 2**31 - 1
# A VMEM budget above the largest VMEM of any chip in the catalog cannot be met.
MAX_VMEM_BYTES = max(chip.vmem_bytes_per_core for chip in CATALOG.values())
# KV caches stream in tiles of up to 128 tokens (the lane width); a longer context is
# whole tiles. plan, build and verify all apply this one rule (BuildOptions).
KV_TILE_TOKENS = 128
# The KV tiles the planner chooses from for each cache attention kind (never above the
# context, which is whole tiles of each): the cost model scores them
# (mkgen.plan.kvtiles); the op-count model has each measured (opcount.ATTEND_OPS).
KV_TILE_CHOICES = (128, 256, 512, 1024)
# A chip-hour price above this is a slip of the keyboard, not a price: the catalog's and
# the published references' estimates are a few USD (docs/spec-reference.md#bounds).
MAX_CHIP_HOUR_USD = 1000.0


def check_chip_hour_price(given: str, usd: float) -> None:
    """A one-line SpecError naming `given` (the flag and its value) unless `usd` is a
    chip-hour price: finite, above 0 and at most MAX_CHIP_HOUR_USD."""
    if not (math.isfinite(usd) and 0 < usd <= MAX_CHIP_HOUR_USD):
        raise SpecError(
            f"{given}: chip-hour price must be positive and finite, at most "
            f"{MAX_CHIP_HOUR_USD:g} USD"
        )


CACHE_ALIGN = 16  # bf16 rows of an HBM array are tiled by 16: cache blocks start on a multiple


def cache_block(rows: int, context: int) -> int:
    """Cache rows a step reads and rewrites around its `rows` new entries: whole 16-row
    tiles that cover them from any offset in a tile, but never more than the context (a
    smaller cache is rewritten whole, from position 0). Rounded up here, not with
    mkgen.plan.stream.round_up: that module imports this one."""
    return min(-(-(rows + CACHE_ALIGN - 1) // CACHE_ALIGN) * CACHE_ALIGN, context)


def kv_tile(context: int) -> int:
    """Cache tokens per streamed KV tile: the whole context up to 128 tokens, else 128."""
    return min(context, KV_TILE_TOKENS)


def kv_tile_candidates(context: int) -> list[int]:
    """The KV tiles a kind may stream a `context`-token cache in, smallest first: the
    context rule's and the KV_TILE_CHOICES above it up to the context that divide it (the
    kernel's copies read whole tiles)."""
    least = kv_tile(context)
    return [least] + [t for t in KV_TILE_CHOICES if least < t <= context and context % t == 0]


def kv_tiles(context: int, tile: int, window: int | None, rows: int) -> int:
    """Tiles one (sequence, kv head) reads in the worst case (a full cache)."""
    full = -(-context // tile)
    if window is None:
        return full
    return min(full, -(-(window + rows - 1) // tile) + 1)


def q_rows(heads: int, rows: int) -> int:
    """Query rows of one kv head (or latent) in the attention scratch: padded to 8 (f32
    sublanes)."""
    return -(-heads * rows // 8) * 8


_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(b|kib|mib|gib|kb|mb|gb)?\s*$", re.I)
_SIZE_UNITS = {
    None: 1,
    "b": 1,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
}


def parse_size(text: str | int, option: str = "--vmem-budget") -> int:
    """Bytes from ``58MiB``, ``48 MiB``, ``60000000`` or an int; errors name the option."""
    if isinstance(text, bool):
        raise SpecError(f"{option} {text!r}: expected a size such as 58MiB")
    value: float
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE_RE.match(str(text))
        if not match:
            raise SpecError(f"{option} {text!r}: expected a size such as 58MiB, 48MiB or 60000000")
        unit = match.group(2).lower() if match.group(2) else None
        value = float(match.group(1)) * _SIZE_UNITS[unit]
    if value <= 0:
        raise SpecError(f"{option} {text!r}: must be positive")
    if value > MAX_VMEM_BYTES:
        raise SpecError(
            f"{option} {text!r}: more than the {MAX_VMEM_BYTES // 2**20} MiB of VMEM of any chip"
        )
    return int(value)


def parse_quant_overrides(items: Iterable[str]) -> tuple[tuple[str, str], ...]:
    """``["experts=int4:128", "dense=int8"]`` -> ((family, canonical format), ...).

    ``dense`` expands to every family of DENSE_GROUP (schema.DENSE_GROUP); a later
    item overrides an earlier one for the same family (the fit hints add theirs after the
    user's; the command line refuses a repeated family, refuse_repeated_families).
    """
    out: dict[str, str] = {}
    valid = ", ".join((*WEIGHT_FAMILIES, "dense"))
    for item in items:
        if not isinstance(item, str) or "=" not in item:
            raise SpecError(f"--quant {item!r}: write FAMILY=FORMAT, e.g. experts=int4:128")
        family, _, text = item.partition("=")
        family = family.strip()
        if family not in (*WEIGHT_FAMILIES, "dense"):
            raise SpecError(f"--quant {item}: unknown weight family {family!r}; use one of {valid}")
        fmt = str(parse_format(text, f"--quant {family}"))
        for name in DENSE_GROUP if family == "dense" else (family,):
            out[name] = fmt
    return tuple(sorted(out.items()))


def refuse_repeated_families(items: Iterable[str]) -> None:
    """A family given twice on the command line is an error, not a silent last-one-wins."""
    given: dict[str, str] = {}
    for item in items:
        family = item.partition("=")[0].strip()
        if family in given:
            raise SpecError(
                f"--quant {item}: {family} is given twice (also {given[family]}); give it once"
            )
        given[family] = item


# How a build's collectives choose their rounds (BuildOptions.collectives, --collectives).
COLLECTIVE_MODES = ("auto", "staged", "flat", "scatter")
# How much of each expert group's block the group before it in the ring also holds (BuildOptions.
# expert_sharing, --expert-sharing; mkgen.plan.sharding.choose_expert_split): the fraction
# of the block, the shared part its last experts. "auto": the planner chooses.
EXPERT_SHARING = {"none": 0.0, "quarter": 0.25, "half": 0.5, "full": 1.0}
EXPERT_SHARING_MODES = ("auto", *EXPERT_SHARING)


class BuildOptions(BaseModel):
    """Everything about one build that is neither the spec nor the topology.

    Build with ``BuildOptions.create(...)`` (or ``from_cli``) to get SpecErrors
    rather than pydantic ValidationErrors.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    batch: int = 1  # independent sequences per step
    rows: int = 1  # rows verified per sequence per step (1 + draft length)
    acceptance: float = 1.0  # mean tokens accepted per step (1 <= A <= rows)
    context: int = DEFAULT_CONTEXT  # tokens of context per sequence the caches hold
    # (family, format) overrides of the spec's quantization, already parsed.
    quant: tuple[tuple[str, str], ...] = ()
    vmem_budget_bytes: int | None = None  # None: the chip's budget (58 MiB on TPU7x)
    price_per_chip_hour_usd: float | None = None  # None: the catalog's estimate
    # Calibration only: routed experts loaded per layer (the benchmark rows of
    # measurements.md are identical, so only top_k distinct experts are read at any
    # batch). None: the expectation under uniform routing.
    distinct_experts_per_layer: int | None = None
    steps_per_call: int = DEFAULT_STEPS_PER_CALL
    # Kernel knobs (None: the planner chooses under the VMEM budget). A forced value is
    # checked like a chosen one: it must fit VMEM and the schedule must not deadlock.
    ring_depth: int | None = None  # weight banks in flight
    expert_slots: int | None = None  # expert pieces in flight
    # Ring refills held back until a collective round's copies are under way, so that
    # they stream while it travels (at most ring depth - 2).
    held_refills: int | None = None
    # Cache tokens per KV tile of every cache attention kind (None: the planner scores
    # kv_tile_candidates(context) for each kind, mkgen.plan.kvtiles).
    kv_tile: int | None = None
    # How collectives run (mkgen.plan.collectives.choose_rounds): "staged" (a round in each
    # host, then one across hosts), "flat" (one round of every core), "scatter" (an
    # all-reduce as a reduce-scatter in the host, an all-reduce across hosts and an
    # all-gather in the host; other collectives staged) or "auto" (per collective,
    # whichever the cost model prices lowest).
    collectives: str = "auto"
    # Expert sharing around the ring of groups: "none", "quarter", "half", "full" (of each
    # group's experts the group before it also holds) or "auto" (the smallest within 1 % of
    # the best predicted expert time that fits HBM).
    expert_sharing: str = "auto"
    # Where the attention-residual snapshots live (None: VMEM unless it cannot hold them
    # beside the smallest ring, mkgen.plan.vmem)
    residual_snapshots: Literal["vmem", "hbm"] | None = None
    # Whether the recurrent kinds keep every sequence's conv tail and states in VMEM, or
    # stream them a sequence at a time through two slots (None: as residual_snapshots)
    recurrent_states: Literal["vmem", "stream"] | None = None
    # What is split over the cores rather than replicated, as "ffn.<kind>.router" and
    # "attention.<kind>.latent", and "ffn.<kind>.ar_ag" for a latent MoE combined by
    # all-gather (None: the planner scores split against replicated, rs_ar against ar_ag). Set
    # only for a mini twin, which takes its full-size build's choices
    # (mkgen.plan.sharding.full_size_splits) so that it proves that kernel.
    splits: tuple[str, ...] | None = None
    # The build's mtp drafter runs inside the kernel, its passes layers of the step
    # (mkgen/plan/fused.py), rather than between kernel calls.
    fuse_draft: bool = False

    @model_serializer(mode="wrap")
    def _without_unfused(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A build that fuses no drafter dumps as before (plan.json and digests unchanged).
        data: dict[str, Any] = handler(self)
        if not self.fuse_draft:
            data.pop("fuse_draft", None)
        return data

    @model_validator(mode="after")
    def _check(self) -> BuildOptions:
        bounds = [
            ("--batch", self.batch, MAX_TOKEN_ROWS),
            ("--rows", self.rows, MAX_TOKEN_ROWS),
            ("--context", self.context, MAX_POSITIONS),
            ("--steps-per-call", self.steps_per_call, MAX_STEPS_PER_CALL),
            ("--distinct-experts", self.distinct_experts_per_layer, MAX_EXPERTS),
            ("--vmem-budget", self.vmem_budget_bytes, MAX_VMEM_BYTES),
        ]
        for flag, value, largest in bounds:
            if value is not None and not 1 <= value <= largest:
                raise SpecError(
                    f"{flag} {value}: must be a positive integer, at most {largest} "
                    "(docs/spec-reference.md#bounds)"
                )
        if self.tokens > MAX_TOKEN_ROWS:
            raise SpecError(
                f"--batch {self.batch} x --rows {self.rows}: {self.tokens} token rows per step, "
                f"over the {MAX_TOKEN_ROWS} the kernel's SMEM tables hold; lower one of them"
            )
        if self.context % kv_tile(self.context):
            raise SpecError(
                f"--context {self.context} must be a multiple of the "
                f"{kv_tile(self.context)}-token KV tile"
            )
        if self.context > CACHE_ALIGN and self.context % CACHE_ALIGN:
            raise SpecError(
                f"--context {self.context}: must be a multiple of {CACHE_ALIGN} (or at most "
                f"{CACHE_ALIGN}): cache rows are stored in tiles of {CACHE_ALIGN}"
            )
        if self.kv_tile is not None and self.kv_tile not in kv_tile_candidates(self.context):
            raise SpecError(
                f"--kv-tile {self.kv_tile}: must be one of "
                f"{', '.join(map(str, kv_tile_candidates(self.context)))} (tiles of "
                f"{', '.join(map(str, KV_TILE_CHOICES))} tokens up to --context {self.context} "
                "that divide it)"
            )
        if self.ring_depth is not None and not MIN_RING_DEPTH <= self.ring_depth <= MAX_RING_DEPTH:
            raise SpecError(
                f"--ring-depth {self.ring_depth}: must be {MIN_RING_DEPTH} to {MAX_RING_DEPTH} "
                "banks in flight"
            )
        if self.expert_slots is not None and not 1 <= self.expert_slots <= EXPERT_SLOTS_LIMIT:
            raise SpecError(
                f"--expert-slots {self.expert_slots}: must be 1 to {EXPERT_SLOTS_LIMIT} pieces "
                "in flight"
            )
        if self.held_refills is not None and not 0 <= self.held_refills <= MAX_RING_DEPTH - 2:
            raise SpecError(
                f"--held-refills {self.held_refills}: must be 0 to {MAX_RING_DEPTH - 2} refills "
                "(at most the ring depth - 2)"
            )
        if self.collectives not in COLLECTIVE_MODES:
            raise SpecError(
                f"--collectives {self.collectives}: must be one of {', '.join(COLLECTIVE_MODES)} "
                "(auto: the cost model chooses staged or flat rounds per collective)"
            )
        if self.expert_sharing not in EXPERT_SHARING_MODES:
            raise SpecError(
                f"--expert-sharing {self.expert_sharing}: must be one of "
                f"{', '.join(EXPERT_SHARING_MODES)} (auto: the planner chooses)"
            )
        if self.expert_sharing not in ("auto", "none") and self.distinct_experts_per_layer:
            raise SpecError(
                f"--expert-sharing {self.expert_sharing}: the calibration's forced distinct "
                "experts price no sharing; leave --expert-sharing out"
            )
        if not 0 < self.acceptance <= self.rows:
            raise SpecError(
                f"--acceptance {self.acceptance:g}: mean tokens accepted per step must be in "
                f"(0, rows={self.rows}]; raise --rows for speculative decoding"
            )
        price = self.price_per_chip_hour_usd
        if price is not None:
            check_chip_hour_price(f"--price {price:g}", price)
        for family, fmt in self.quant:
            if family not in WEIGHT_FAMILIES:
                raise SpecError(f"--quant {family}={fmt}: unknown weight family {family!r}")
            parse_format(fmt, f"--quant {family}")
        return self

    @classmethod
    def create(cls, **fields: Any) -> BuildOptions:
        """Validate ``fields``; a wrong type becomes a one-line SpecError naming the flag."""
        if "quant" in fields and fields["quant"] is not None:
            quant = fields["quant"]
            if isinstance(quant, dict):
                quant = [f"{k}={v}" for k, v in quant.items()]
            if quant and isinstance(next(iter(quant)), str):
                fields["quant"] = parse_quant_overrides(quant)
            else:
                fields["quant"] = tuple(tuple(pair) for pair in quant)
        if fields.get("vmem_budget_bytes") is not None:
            fields["vmem_budget_bytes"] = parse_size(fields["vmem_budget_bytes"])
        if isinstance(fields.get("acceptance"), int) and not isinstance(
            fields.get("acceptance"), bool
        ):
            fields["acceptance"] = float(fields["acceptance"])
        if isinstance(fields.get("price_per_chip_hour_usd"), int):
            fields["price_per_chip_hour_usd"] = float(fields["price_per_chip_hour_usd"])
        fields = {k: v for k, v in fields.items() if v is not None or k in _NULLABLE}
        try:
            return cls(**fields)
        except ValidationError as error:
            first = error.errors()[0]
            name = str(first["loc"][0]) if first["loc"] else "option"
            flag = "--" + name.replace("_bytes", "").replace("_", "-")
            if first["type"] == "extra_forbidden":
                raise SpecError(f"{flag}: unknown build option") from None
            value = first.get("input")
            raise SpecError(f"{flag} {value!r}: {first['msg'].lower()}") from None

    # --- derived ---
    @property
    def tokens(self) -> int:
        """Token rows per step on every core: batch x rows."""
        return self.batch * self.rows

    def quantization(self, spec: ModelSpec) -> Quantization:
        """The spec's quantization with the overrides applied."""
        data = spec.quantization.model_dump()
        data.update(dict(self.quant))
        return Quantization.model_validate(data)

    def apply(self, spec: ModelSpec) -> ModelSpec:
        """The spec with the quantization overrides applied (a new frozen spec)."""
        if not self.quant:
            return spec
        return spec.model_copy(update={"quantization": self.quantization(spec)})

    def describe(self) -> str:
        quant = ", ".join(f"{f}={v}" for f, v in self.quant) or "spec formats"
        knobs = "".join(
            f", {label} {value}"
            for label, value in (
                ("ring depth", self.ring_depth),
                ("expert slots", self.expert_slots),
                ("held refills", self.held_refills),
                ("KV tile", self.kv_tile),
                ("collectives", None if self.collectives == "auto" else self.collectives),
                ("expert sharing", None if self.expert_sharing == "auto" else self.expert_sharing),
                ("residual snapshots in", self.residual_snapshots),
                ("recurrent states in", self.recurrent_states),
            )
            if value is not None
        )
        return (
            f"batch {self.batch}, rows {self.rows}, acceptance {self.acceptance:g}, "
            f"context {self.context}, quant: {quant}{knobs}"
        )


_NULLABLE = (
    "vmem_budget_bytes",
    "price_per_chip_hour_usd",
    "distinct_experts_per_layer",
    "ring_depth",
    "expert_slots",
    "held_refills",
    "kv_tile",
    "residual_snapshots",
    "recurrent_states",
)
