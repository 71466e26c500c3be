"""The MoE kind's record of the kernel layout (mkgen.kinds.moe builds it, its macros print
it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Literal

import numpy as np

from mkgen.kinds.common import split_as_mlp
from mkgen.plan.layout import Array, Columns, ExpertChunks, FFNRecord, VectorRow, experts_padded
from mkgen.plan.stream import Segment

# Rows of the kernel's chosen-expert flags buffer: the flags, each group's private and
# tail counts, padding to a VMEM tile's 8 sublanes.
FLAG_ROWS = 8


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
    # Expert sharing (mkgen.plan.sharding.ExpertSplit): the groups form a ring, and a core
    # of group g also holds the last `partner_experts` experts of group (g + 1) mod G's
    # block after its own, `held_per_rank` in all (experts_per_rank when 0: no sharing).
    partner_experts: int
    held_per_rank: int
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
    # The shared experts' activation and down projection run while the expert_out
    # reduce-scatter's copies travel (shared_in_flight), not before it.
    shared_in_flight: bool
    # The shared experts' activation rides in the latent's all-gather and their down
    # projection splits by output columns (a latent combined by all-gather: shared_gathered).
    shared_gathered: bool = False
    columns: dict[str, Columns]  # outputs of the "in" segment: router, latent_in, shared_*
    segments: list[Segment]  # in, latent_out, shared_down
    in_segments: list[str]  # the "in" tensors' segments: one per format, outputs side by side
    ops: list[str]  # the layer's ops in program order (mkgen.kinds.moe.ops): the kernel's order
    vectors: list[VectorRow]
    # Expert biases (gpt-oss), in the layer's vector slab from this row: one row per expert
    # the core holds with its gate | up biases (its width part's columns), then one row per
    # expert with its down biases, which width part 0 adds. None: no biases.
    bias_row: int | None = None

    @property
    def experts_padded(self) -> int:
        return experts_padded(self.num_experts)

    def routed_chunks(self) -> ExpertChunks:
        return self.experts

    def work_in_flight(self) -> bool:
        return self.shared_in_flight

    def slab_rows(self) -> int:
        """Its vector rows, then two rows per expert it holds for the expert biases."""
        biases = 0 if self.bias_row is None else 2 * self.held_per_rank
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

    def shared_outputs_split(self) -> bool:
        """shared_gate, shared_up and shared_down all by output columns (shared_gathered)."""
        parts = self.stream_parts()
        names = ["ffn.shared_gate", "ffn.shared_up", "ffn.shared_down"]
        return self.shared_gathered and all(
            parts[n].axis == -1 and parts[n].rank_divisor == 1 and parts[n].view is None
            for n in names
        )

    def held_experts(self, rank: int) -> tuple[list[int], slice]:
        """The routed experts rank `rank` holds, in the order of its expert arrays, and the
        columns of their width it holds: the block of group g = rank // width_parts, then
        (expert sharing) the last partner_experts of the next group's block, (g + 1) mod G;
        width part rank % width_parts."""
        group, part = rank // self.width_parts, rank % self.width_parts
        width, block = self.experts.width, self.experts_per_rank
        ids = list(range(group * block, (group + 1) * block))
        partner_end = ((group + 1) % self.groups + 1) * block
        if self.partner_experts:
            ids += range(partner_end - self.partner_experts, partner_end)
        return ids, slice(part * width, (part + 1) * width)

    def own_experts(self, arrays: list[Array]) -> list[Array]:
        """A core's expert arrays [held, ...] cut to its own group's block: what the
        prefill runs, so that a shared expert is counted once (by its own group)."""
        return [a[: self.experts_per_rank] for a in arrays] if self.partner_experts else arrays

    def slab_blocks(
        self, tensors: Mapping[str, Array], prefix: str, rank: int
    ) -> list[tuple[int, Array]]:
        """The expert biases from bias_row on: gate | up biases [E_r, 2 * width] of the
        experts and columns `rank` holds, then their down biases [E_r, d]."""
        if self.bias_row is None:
            return []
        ids, cols = self.held_experts(rank)
        gate = np.asarray(tensors[prefix + "ffn.experts_b_gate"])[ids][:, cols]
        up = np.asarray(tensors[prefix + "ffn.experts_b_up"])[ids][:, cols]
        down = np.asarray(tensors[prefix + "ffn.experts_b_down"])[ids]
        gate_up = np.concatenate([gate, up], axis=1)
        return [(self.bias_row, gate_up), (self.bias_row + self.held_per_rank, down)]

    def slab_pieces(self, slab: Array) -> dict[str, Array]:
        """The expert biases slab_blocks put in a core's slab, of its own group's block
        (as own_experts cuts the experts)."""
        if self.bias_row is None:
            return {}
        at, own, width = self.bias_row, self.experts_per_rank, self.experts.width
        down = at + self.held_per_rank
        return {
            "ffn.experts_b_gate": slab[at : at + own, :width],
            "ffn.experts_b_up": slab[at : at + own, width : 2 * width],
            "ffn.experts_b_down": slab[down : down + own, : self.experts.d],
        }
