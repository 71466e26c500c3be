"""Layer kind type -> the module holding its rules: the default KindRegistry.

Every kind's module satisfies mkgen.plan.kind.LayerKind (``TEMPLATE``, ``RECORD``,
``SLAB_VECTORS``, ``SEGMENTS``, ``shard``, ``layout``, ``buffers``, ``program``,
``rotary_dim``, ``state_dims``, ...). The plan does not import this module: its callers build the registry
here and pass it in.
"""

from __future__ import annotations

from functools import cache

from mkgen.kinds import dense, gated_deltanet, gqa, kda, mla, mlp, moe
from mkgen.plan.kind import KindRegistry, LayerKind


@cache
def default_registry() -> KindRegistry:
    """Every kind mkgen generates code for: attention kinds, then FFN kinds."""
    kinds: dict[str, LayerKind] = {
        "gqa": gqa,
        "mla": mla,
        "gated_deltanet": gated_deltanet,
        "kda": kda,
        "dense": dense,
        "mlp": mlp,
        "moe": moe,
    }
    return KindRegistry(kinds)
