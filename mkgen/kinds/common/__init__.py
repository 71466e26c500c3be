"""What kinds without a mechanism of their own provide to the LayerKind protocol, and the
rules several kinds' records share."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mkgen.plan.kind import BufferInputs
from mkgen.plan.stream import Part


def no_rotary_dim(kind: Any) -> int:
    """A kind without rotary positions (the FFN kinds)."""
    return 0


def no_state_dims(kind: Any, shard: Any) -> None:
    """A kind that keeps no recurrent state."""
    return None


def no_cache_geometry(kind: Any, shard: Any, rows: int) -> None:
    """A kind that attends over no KV cache."""
    return None


def no_buffers(out: Any, i: BufferInputs) -> None:
    """A kind with no scratch beyond the stream's: its matmuls use the ring's staging
    buffers."""


def no_views(kind: Any) -> dict[tuple[str, str], Any]:
    """A kind whose stream reads every tensor as the inventory stores it."""
    return {}


def split_as_mlp(parts: Mapping[str, Part], inputs: Sequence[str], down: str) -> bool:
    """Whether the `inputs` tensors are all split by columns and `down` by rows, in pieces
    of one size, one per core, without views (a record's columns_split rule)."""
    if down not in parts or not inputs or any(n not in parts for n in inputs):
        return False
    return all(
        p.view is None and p.rank_divisor == 1 and p.size == parts[down].size and p.axis == axis
        for p, axis in [(parts[down], -2), *((parts[n], -1) for n in inputs)]
    )
