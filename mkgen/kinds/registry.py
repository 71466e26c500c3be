"""Layer kind type -> the module holding its rules (and naming its template macros).

Every kind's module provides the same names: ``TEMPLATE`` (its macros' file under
mkgen/templates/), ``SLAB_VECTORS`` (the vector-family tensors its layers keep in their
vector slab, None: all), ``layout(LayoutInputs)``, ``buffers(out, BufferInputs)``,
``program(builder, Step)``, ``shard(ctx, kind name, kind)`` and ``SEGMENTS`` (its fused
weight-stream segments; both registered into mkgen.plan.sharding and mkgen.plan.stream
below) and, for attention kinds, ``rotary_dim(kind)``.
"""

from __future__ import annotations

from types import ModuleType

from mkgen.errors import SpecError
from mkgen.kinds import dense, gated_deltanet, gqa, kda, mla, moe
from mkgen.plan.sharding import SHARDING_RULES
from mkgen.plan.stream import FUSED_SEGMENTS

# Attention kinds, then FFN kinds.
KINDS: dict[str, ModuleType] = {
    "gqa": gqa,
    "mla": mla,
    "gated_deltanet": gated_deltanet,
    "kda": kda,
    "dense": dense,
    "moe": moe,
}


def kind_module(type_: str, where: str) -> ModuleType:
    """The module of the layer kind of type `type_` (`where` names the kind in the spec)."""
    if type_ not in KINDS:
        raise SpecError(f"{where} ({type_}) is not supported by the code generator yet")
    return KINDS[type_]


# The sharding rules and the stream's fused segments sit below the kinds' modules in the
# plan (the kinds build on their records), so the plan reads them from its own tables.
SHARDING_RULES.update({type_: module.shard for type_, module in KINDS.items()})
FUSED_SEGMENTS.update({type_: module.SEGMENTS for type_, module in KINDS.items()})
