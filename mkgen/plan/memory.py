"""HBM fit: weights, caches and workspace per core against the chip's usable HBM.

Everything is per rank and comes from the sharding plan (the rank shapes are the
single source of truth), so replication and tile padding are counted:

- weights: every tensor's ``rank_bytes`` at its format, scales included; with expert
  sharing a core's experts grow by (E_r + s) / E_r (the next group's shared part);
- caches: KV / MLA latent in bf16 per token, for min(context, window) + rows - 1
  tokens per sequence (a sliding-window layer keeps its window, verification rows
  need their slots), times the batch; recurrent state in f32 plus bf16 conv taps
  per sequence, kept once per verified row when rows > 1 so a rejected draft can
  roll back to the accepted row's state;
- workspace (an estimate, documented in docs/cost-model.md): the step's f32 hidden
  rows and logits, the attention-residual snapshots, one layer of experts
  dequantized to bf16 for the XLA prefill that shares the HBM, and a fixed 256 MiB
  for XLA glue temporaries.

``plan_fitted`` chooses the expert sharing within the HBM a build leaves without it;
``check_fit`` raises a one-line SpecError saying by how much it does not fit and
which expert formats or which larger slice would.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict

from mkgen.errors import SpecError
from mkgen.hardware import MiB
from mkgen.plan.cost import pad_rows
from mkgen.plan.fused import MODULE_PREFIX, DraftPasses
from mkgen.plan.kind import KindRegistry
from mkgen.plan.options import BuildOptions
from mkgen.plan.sharding import ShardingPlan, plan_sharding
from mkgen.spec.schema import ModelSpec
from mkgen.spec.topology import Topology

XLA_GLUE_BYTES = 256 * MiB  # estimate: embedding lookup, RoPE table, prefill activations
GB = 1e9


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class MemoryPlan(_Frozen):
    """HBM per device, by what it holds."""

    model: str
    topology: str
    devices: int
    usable_bytes: int
    weights_by_family: dict[str, int]
    weights_bytes: int
    cache_by_kind: dict[str, int]  # kv, mla_latent, state
    cache_bytes: int
    workspace_by_use: dict[str, int]
    workspace_bytes: int
    total_bytes: int

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.usable_bytes

    @property
    def headroom_bytes(self) -> int:
        return self.usable_bytes - self.total_bytes

    def describe(self) -> str:
        lines = [
            f"HBM per device ({self.topology}): {self.total_bytes / GB:.2f} GB of "
            f"{self.usable_bytes / GB:.2f} GB usable ({'fits' if self.fits else 'DOES NOT FIT'}, "
            f"headroom {self.headroom_bytes / GB:.2f} GB)"
        ]
        for title, table in (
            ("weights", self.weights_by_family),
            ("caches", self.cache_by_kind),
            ("workspace", self.workspace_by_use),
        ):
            lines.append(f"  {title}: {sum(table.values()) / GB:.3f} GB")
            for key, value in sorted(table.items(), key=lambda kv: -kv[1]):
                if value:
                    lines.append(f"    {key:<16} {value / GB:10.3f} GB")
        return "\n".join(lines)


def plan_memory(
    spec: ModelSpec, topo: Topology, options: BuildOptions, sharding: ShardingPlan
) -> MemoryPlan:
    """HBM per device of this build (does not raise; see check_fit)."""
    weights = sharding.rank_bytes_by_family()
    for name, split in sharding.expert_sharing.items():  # the partner's shared parts
        layers = sum(1 for _, ffn in sharding.layer_table if ffn == name)
        weights["experts"] += split.partner_bytes_per_layer * layers
    passes = sharding.draft_passes
    if passes is not None:  # the stream's copies of the head and eh_proj (one per pass)
        for name in ("lm_head", MODULE_PREFIX + "eh_proj"):
            shard = sharding.shard_of(name)
            copies = passes.passes - (name != "lm_head")
            weights[shard.family] = weights.get(shard.family, 0) + copies * shard.rank_bytes
    cache = {"kv": 0, "mla_latent": 0, "state": 0}
    for layer, (attn_name, _) in enumerate(sharding.layer_table):
        if passes is not None and passes.source(layer) != layer:
            continue  # a later pass writes the first pass's cache
        c = sharding.attention[attn_name].cache
        if c.bytes_per_token:
            kept = min(options.context, c.window) if c.window else options.context
            cache[c.kind] += c.bytes_per_token * (kept + options.rows - 1) * options.batch
        cache[c.kind] += c.fixed_bytes * options.batch * options.rows
    rows = pad_rows(options.tokens)
    h = spec.dims.hidden
    vocab_pr = math.ceil(spec.dims.vocab / sharding.devices)
    work = {
        "hidden_f32": 4 * rows * h * 4,  # residual, branch, norm output, collective landing
        "logits_f32": rows * vocab_pr * 4,
        "xla_glue": XLA_GLUE_BYTES,
    }
    if spec.attention_residual:
        work["attn_res_snapshots"] = spec.attention_residual.max_snapshots * rows * h * 4
    deq = 0
    for name, f in sharding.ffn.items():
        kind = spec.ffn_kinds[name]
        if f.experts and sharding.quantization["experts"] != "bf16":  # routed experts
            d_in = kind.latent.width if kind.latent else h
            deq = max(deq, f.experts.experts_per_rank * 3 * d_in * f.experts.width_per_rank * 2)
    work["prefill_expert_dequant"] = deq
    total = sum(weights.values()) + sum(cache.values()) + sum(work.values())
    return MemoryPlan(
        model=spec.name,
        topology=topo.name,
        devices=topo.num_devices,
        usable_bytes=topo.chip_info.hbm_usable_bytes_per_core,
        weights_by_family=weights,
        weights_bytes=sum(weights.values()),
        cache_by_kind=cache,
        cache_bytes=sum(cache.values()),
        workspace_by_use=work,
        workspace_bytes=sum(work.values()),
        total_bytes=total,
    )


def plan_fitted(
    spec: ModelSpec, topo: Topology, options: BuildOptions, *, kinds: KindRegistry,
    passes: DraftPasses | None = None,
) -> tuple[ShardingPlan, MemoryPlan]:  # fmt: skip
    """The sharding and its HBM, the expert sharing chosen (or a forced one checked) within
    the HBM the build leaves without any: planned once without sharing, then again with
    that headroom where an MoE kind's groups pair."""
    unshared = options.model_copy(update={"expert_sharing": "none"})
    sharding = plan_sharding(spec, topo, unshared, kinds=kinds, passes=passes)
    memory = plan_memory(spec, topo, unshared, sharding)
    pairs = any(f.experts and f.experts.groups % 2 == 0 for f in sharding.ffn.values())
    if options.expert_sharing == "none" or not (pairs or options.expert_sharing != "auto"):
        return sharding, memory
    room = max(0, memory.headroom_bytes)
    sharing = plan_sharding(spec, topo, options, kinds=kinds, expert_room_bytes=room, passes=passes)
    return sharing, plan_memory(spec, topo, options, sharing)


def _try(
    spec: ModelSpec, topo: Topology, options: BuildOptions, kinds: KindRegistry
) -> MemoryPlan | None:
    try:
        return plan_fitted(spec, topo, options, kinds=kinds)[1]
    except SpecError:
        return None


def check_fit(
    spec: ModelSpec, topo: Topology, options: BuildOptions, memory: MemoryPlan, *,
    kinds: KindRegistry,
) -> None:  # fmt: skip
    """Raise a one-line SpecError when ``memory`` exceeds the usable HBM, with fixes (the
    formats and slices it tries are sharded by the rules in `kinds`)."""
    if memory.fits:
        return
    over = memory.total_bytes - memory.usable_bytes
    parts = (
        f"weights {memory.weights_bytes / GB:.1f}, caches {memory.cache_bytes / GB:.1f}, "
        f"workspace {memory.workspace_bytes / GB:.1f}"
    )
    hints: list[str] = []
    has_experts = memory.weights_by_family.get("experts", 0) > 0
    current = dict(options.quant)
    tries = (
        [("experts", "mxfp4"), ("experts", "int4:128"), ("experts", "nvfp4")] if has_experts else []
    ) + [("dense", "int8")]
    for family, fmt in tries:
        if current.get(family) == fmt or options.quantization(spec).model_dump().get(family) == fmt:
            continue
        quant = [f"{k}={v}" for k, v in options.quant] + [f"{family}={fmt}"]
        alt = options.model_copy(update={"quant": ()})
        alt = BuildOptions.create(**{**alt.model_dump(), "quant": quant})
        plan = _try(spec, topo, alt, kinds)
        if plan is not None and plan.fits:
            hints.append(f"--quant {family}={fmt} ({plan.total_bytes / GB:.1f} GB)")
    chip = topo.chip_info
    for shape in chip.slice_shapes:
        if math.prod(shape) <= topo.num_chips:
            continue
        bigger = Topology(chip=chip.name, shape=shape)
        plan = _try(spec, bigger, options, kinds)
        if plan is not None and plan.fits:
            hints.append(f"topology {bigger.name} ({plan.total_bytes / GB:.1f} GB per device)")
            break
    fix = "; fits with " + " or ".join(hints) if hints else "; no listed format or slice fits"
    raise SpecError(
        f"{spec.name} on {topo.name} needs {memory.total_bytes / GB:.1f} GB of HBM per device "
        f"but {memory.usable_bytes / GB:.1f} GB are usable: over by {over / GB:.1f} GB "
        f"({parts} GB){fix}"
    )
