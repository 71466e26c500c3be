"""The delta-rule kinds' record of the kernel layout (Gated DeltaNet's and KDA's: their
layout builders in mkgen.kinds.recurrent, their macros print it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Literal

from mkgen.plan.layout import Array, AttentionRecord, CacheArray, Columns, Rank, VectorRow
from mkgen.plan.stream import Segment
from mkgen.spec.schema import ModelSpec
from mkgen.spec.weights import attention_weights


class RecurrentLayout(AttentionRecord):
    """Delta-rule linear attention (Gated DeltaNet, KDA): heads split over cores.

    Gated DeltaNet: value heads split, each core with the key heads they read; one
    scalar decay per head; output gated by silu(z). KDA: as many key as value heads;
    a per-key-dim decay from a low-rank projection; output gated by a sigmoid gate."""

    type: Literal["gated_deltanet", "kda"]
    # Its cache is a state a rejected draft row must not advance: the runner keeps the
    # snapshot after each sequence's last accepted row (AttentionRecord).
    recurrent: ClassVar[bool] = True
    heads_split: ClassVar[bool] = True
    own_cache: ClassVar[bool] = True  # its conv channels and its value heads' state
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
    # 0: every sequence's conv tail and states in VMEM at once; else this many sequences',
    # streamed in and out one sequence at a time (the VMEM plan's choice, mkgen.plan.vmem)
    state_slots: int = 0
    rope: None = None  # no positions: the recurrence carries order

    def softplus(self) -> bool:
        """Gated DeltaNet's decay, or KDA's without a lower bound."""
        return self.gate_lower_bound is None

    def snapshot_rows(self) -> int:
        """The snapshots its kernel caches keep per sequence (one a row)."""
        return next(c for c in self.caches if c.name == "state").shape[2]

    def cache_pieces(
        self, spec: ModelSpec, cache: Mapping[str, Array], rank: Rank
    ) -> dict[str, Array]:
        """conv [B, ROWS, W - 1, the core's q | k | v channels] and f32 state [B, ROWS, the
        core's value heads, Dk, Dv], the reference's in snapshot ROWS - 1 (the one a step
        starts from), the others zero."""
        import jax.numpy as jnp

        from mkgen.kinds.common.caches import current_snapshot, piece

        parts = {row.name: row.part for row in self.vectors}
        kind = spec.attention_kinds[self.name]
        widths = {n: shape[-1] for n, shape, _ in attention_weights(kind, 1)}
        conv, start = [], 0
        for name in ("conv_q", "conv_k", "conv_v"):
            channels = cache["conv"][..., start : start + widths[name]]
            part = parts[name]
            if part.axis is not None:
                channels = piece(channels, -1, part.size, rank // part.rank_divisor)
            conv.append(channels)
            start += widths[name]
        state = piece(cache["state"], 1, self.value_heads, rank)
        rows = self.snapshot_rows()
        return {
            "conv": current_snapshot(jnp.concatenate(conv, axis=-1), rows),
            "state": current_snapshot(state, rows),
        }

    def own_cache_pieces(self, cache: Mapping[str, Array]) -> dict[str, Array]:
        """Its conv tail and state in the snapshot a step starts from."""
        from mkgen.kinds.common.caches import current_snapshot

        return {n: current_snapshot(v, self.snapshot_rows()) for n, v in cache.items()}

    def prefill_cache(self, spec: ModelSpec, pieces: Mapping[str, Array]) -> dict[str, Array]:
        """Each core's own conv tail and state: the snapshot a step starts from."""
        return {n: v[:, :, -1] for n, v in pieces.items()}
