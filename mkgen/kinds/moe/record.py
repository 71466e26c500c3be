"""The MoE kind's record of the kernel layout (mkgen.kinds.moe builds it, its macros print
it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Literal

import numpy as np

from mkgen.kinds.common import split_as_mlp
from mkgen.plan.layout import Array, Columns, ExpertChunks, FFNRecord, VectorRow
from mkgen.plan.stream import Segment


class MoELayout(FFNRecord):
    type: Literal["moe"] = "moe"
    # A fact of the kind (FFNRecord): its experts are HBM arrays of their
    # own (ExpertChunks), packed per core beside the stream.
    routed_experts: ClassVar[bool] = True
    name: str
    index: int
    layers: list[int]
    num_experts: int
    top_k: int
    # Experts split by id over `groups` groups of `width_parts` consecutive cores; rank r
    # holds experts [g * experts_per_rank, (g + 1) * experts_per_rank) of group
    # g = r // width_parts, width part r % width_parts of each.
    groups: int
    width_parts: int
    experts_per_rank: int
    experts: ExpertChunks
    expert_layers: int  # layers of this kind: the expert arrays' first dim
    expert_format_note: str  # how the experts' format stores them
    packed_codes: bool  # two 4-bit codes a byte
    expert_slots: int  # expert pieces in flight: issued as soon as routing names them
    activation: str
    activation_params: dict[str, float]
    score: Literal["softmax", "sigmoid"]
    router_bias: bool
    selection_bias: bool
    renormalize: bool
    routed_scaling: float
    n_group: int
    topk_group: int
    latent_width: int  # 0: experts read the hidden state
    latent_norm: bool
    latent_design: Literal["rs_ar", "ar_ag", "none"]
    latent_per_rank: int
    # The router's columns split over the cores: its scores are all-gathered beside the
    # latent piece (one collective), then every core routes on all of them.
    router_split: bool
    shared_width: int  # shared-expert columns per rank (0: none)
    shared_gate: bool
    columns: dict[str, Columns]  # outputs of the "in" segment: router, latent_in, shared_*
    segments: list[Segment]  # in, latent_out, shared_down
    in_segments: list[str]  # the "in" tensors' segments: one per format, outputs side by side
    ops: list[str]  # the layer's ops in program order (mkgen.kinds.moe.ops): the kernel's order
    vectors: list[VectorRow]
    # Expert biases (gpt-oss), in the layer's vector slab from this row: one row per expert
    # the core holds with its gate | up biases (its width part's columns), then one row per
    # expert with its down biases, which width part 0 adds. None: no biases.
    bias_row: int | None = None

    def routed_chunks(self) -> ExpertChunks:
        return self.experts

    def slab_rows(self) -> int:
        """Its vector rows, then two rows per expert it holds for the expert biases."""
        biases = 0 if self.bias_row is None else 2 * self.experts_per_rank
        return super().slab_rows() + biases

    def slab_width(self) -> int:
        """Its widest vector row, or an expert's gate | up or down biases."""
        if self.bias_row is None:
            return super().slab_width()
        return max(super().slab_width(), 2 * self.experts.width, self.experts.d)

    def shared_columns_split(self) -> bool:
        """shared_gate and shared_up by columns, shared_down by rows, each core its own piece."""
        if not self.shared_width:
            return False
        inputs = ["ffn.shared_gate", "ffn.shared_up"]
        return split_as_mlp(self.stream_parts(), inputs, "ffn.shared_down")

    def held_experts(self, rank: int) -> tuple[range, slice]:
        """The routed experts rank `rank` holds and the columns of their width it holds:
        group rank // width_parts, width part rank % width_parts."""
        group, part = rank // self.width_parts, rank % self.width_parts
        width = self.experts.width
        ids = range(group * self.experts_per_rank, (group + 1) * self.experts_per_rank)
        return ids, slice(part * width, (part + 1) * width)

    def slab_blocks(
        self, tensors: Mapping[str, Array], prefix: str, rank: int
    ) -> list[tuple[int, Array]]:
        """The expert biases from bias_row on: gate | up biases [E_r, 2 * width] of the
        experts and columns `rank` holds, then their down biases [E_r, d]."""
        if self.bias_row is None:
            return []
        ids, cols = self.held_experts(rank)
        held = slice(ids.start, ids.stop)
        gate = np.asarray(tensors[prefix + "ffn.experts_b_gate"])[held, cols]
        up = np.asarray(tensors[prefix + "ffn.experts_b_up"])[held, cols]
        down = np.asarray(tensors[prefix + "ffn.experts_b_down"])[held]
        gate_up = np.concatenate([gate, up], axis=1)
        return [(self.bias_row, gate_up), (self.bias_row + self.experts_per_rank, down)]

    def slab_pieces(self, slab: Array) -> dict[str, Array]:
        """The expert biases slab_blocks put in a core's slab."""
        if self.bias_row is None:
            return {}
        at, held, width = self.bias_row, self.experts_per_rank, self.experts.width
        return {
            "ffn.experts_b_gate": slab[at : at + held, :width],
            "ffn.experts_b_up": slab[at : at + held, width : 2 * width],
            "ffn.experts_b_down": slab[at + held : at + 2 * held, : self.experts.d],
        }
