"""What kinds without a mechanism of their own provide to the LayerKind protocol."""

from __future__ import annotations

from typing import Any


def no_rotary_dim(kind: Any) -> int:
    """A kind without rotary positions (the FFN kinds)."""
    return 0


def no_state_dims(kind: Any, shard: Any) -> None:
    """A kind that keeps no recurrent state."""
    return None


def no_cache_geometry(kind: Any, shard: Any, rows: int) -> None:
    """A kind that attends over no KV cache."""
    return None


def no_views(kind: Any) -> dict[tuple[str, str], Any]:
    """A kind whose stream reads every tensor as the inventory stores it."""
    return {}
