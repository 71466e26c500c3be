"""The planner (pure Python, no JAX): options, sharding, HBM fit and the cost model.

``plan_build`` runs the stages that exist today in order; the dataflow graph, the
schedule and the VMEM plan build on the same plain pydantic data later.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from mkgen.plan.cost import CostConstants, Estimate, TraceEvent, estimate, to_chrome_trace
from mkgen.plan.memory import MemoryPlan, check_fit, plan_memory
from mkgen.plan.options import BuildOptions
from mkgen.plan.sharding import ShardingPlan, TensorShard, plan_sharding
from mkgen.spec.schema import ModelSpec
from mkgen.spec.topology import Topology


class BuildPlan(BaseModel):
    """What the planner knows about one build so far."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    options: BuildOptions
    sharding: ShardingPlan
    memory: MemoryPlan
    estimate: Estimate


def plan_build(
    spec: ModelSpec, topo: Topology, options: BuildOptions, trace: bool = False
) -> BuildPlan:
    """Shard, check the HBM fit (SpecError if it does not fit) and estimate one step."""
    spec = options.apply(spec)
    sharding = plan_sharding(spec, topo, options)
    memory = plan_memory(spec, topo, options, sharding)
    check_fit(spec, topo, options, memory)
    est = estimate(spec, topo, options, sharding, trace=trace)
    return BuildPlan(options=options, sharding=sharding, memory=memory, estimate=est)


__all__ = [
    "BuildOptions",
    "BuildPlan",
    "CostConstants",
    "Estimate",
    "MemoryPlan",
    "ShardingPlan",
    "TensorShard",
    "TraceEvent",
    "check_fit",
    "estimate",
    "plan_build",
    "plan_memory",
    "plan_sharding",
    "to_chrome_trace",
]
