"""The delta-rule kinds' record of the kernel layout (Gated DeltaNet's and KDA's: their
layout builders in mkgen.kinds.recurrent, their macros print it)."""

from __future__ import annotations

from typing import ClassVar, Literal

from mkgen.plan.layout import AttentionRecord, CacheArray, Columns, VectorRow
from mkgen.plan.stream import Segment


class RecurrentLayout(AttentionRecord):
    """Delta-rule linear attention (Gated DeltaNet, KDA): heads split over cores.

    Gated DeltaNet: value heads split, each core with the key heads they read; one
    scalar decay per head; output gated by silu(z). KDA: as many key as value heads;
    a per-key-dim decay from a low-rank projection; output gated by a sigmoid gate."""

    type: Literal["gated_deltanet", "kda"]
    # Its cache is a state a rejected draft row must not advance: the runner keeps the
    # snapshot after each sequence's last accepted row (AttentionRecord).
    recurrent: ClassVar[bool] = True
    # KDA's spec names num_heads (as many key as value heads), Gated DeltaNet's both.
    own_heads: ClassVar[dict[str, str]] = {
        "num_heads": "value_heads",
        "num_key_heads": "key_heads",
        "num_value_heads": "value_heads",
    }
    name: str
    index: int
    layers: list[int]
    key_heads: int  # per core
    value_heads: int  # per core; value head j reads key head j // group
    group: int
    key_dim: int
    value_dim: int
    conv_width: int
    channels: int  # conv channels per core: q | k | v
    gate_lower_bound: float | None = None  # KDA's decay bound (None: softplus form, as GDN's)
    output_gate_rank: int | None = None  # KDA: low-rank output gate (None: full rank)
    columns: dict[str, Columns]  # outputs of the "in" segment
    segments: list[Segment]  # in, (f_b, g_b for KDA), o
    ops: list[str]  # the layer's ops in program order (the kind module's ops): the kernel's order
    vectors: list[VectorRow]
    caches: list[CacheArray]  # conv tail (bf16), recurrent state (f32): after each row
    rope: None = None  # no positions: the recurrence carries order

    def softplus(self) -> bool:
        """Gated DeltaNet's decay, or KDA's without a lower bound."""
        return self.gate_lower_bound is None
