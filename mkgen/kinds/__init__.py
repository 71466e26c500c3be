"""One module per layer kind: its sharding rule, layout builder, VMEM buffers and ops.

Each kind's module (gqa, mla, gated_deltanet, kda, dense, moe) satisfies the plan's
`LayerKind` protocol (mkgen/plan/kind.py); `default_registry()` maps each kind's type to
its module, and callers pass that registry into the plan (`plan_build(..., kinds=...)`).
The kinds build on the plan's records; the plan imports none of them. GQA and MLA share
cache_attention, Gated DeltaNet and KDA share recurrent; `common` holds the protocol's
defaults for kinds without rotary positions or recurrent state.
"""

from mkgen.kinds.registry import default_registry

__all__ = ["default_registry"]
