"""Building the kernel layout (mkgen.plan.layout.KernelLayout): the generic parts here,
each layer kind's own through its module (mkgen.kinds.registry)."""

from __future__ import annotations

from mkgen.kinds.common import LayoutInputs
from mkgen.kinds.registry import kind_module
from mkgen.plan.collectives import layer_uses, plan_collectives
from mkgen.plan.layout import (
    CACHE_ALIGN,
    SUBLANES_F32,
    AttentionResidualLayout,
    KernelLayout,
    check_formats,
    kernel_features,
    slab_rows,
    slab_width,
    stream_formats,
    unsupported,
)
from mkgen.plan.options import BuildOptions
from mkgen.plan.sharding import ShardingPlan
from mkgen.plan.stream import CHUNK, StreamPlan, cdiv, part_of, round_up
from mkgen.spec.schema import ModelSpec
from mkgen.spec.topology import Topology


def build_layout(
    spec: ModelSpec,
    topology: Topology,
    sharding: ShardingPlan,
    stream: StreamPlan,
    options: BuildOptions,
    *,
    max_piece_chunks: int,
    expert_slots: int,
    trace_residuals: bool = False,
) -> KernelLayout:
    """The kernel layout of `spec` on `topology`: per-rank pieces as `sharding` decided, the
    stream as planned, `expert_slots` as the VMEM plan chose them."""
    check_formats(spec, stream)
    devices = topology.num_devices
    hidden = spec.dims.hidden
    attention_names = list(spec.attention_kinds)
    ffn_names = list(spec.ffn_kinds)
    attn_table = [attention_names.index(n) for n in spec.attention_table()]
    ffn_table = [ffn_names.index(n) for n in spec.ffn_table()]

    def members(table: list[int], index: int) -> list[int]:
        return [i for i, k in enumerate(table) if k == index]

    def inputs(name, index, layers, kind, shard, segments, *, first_row) -> LayoutInputs:
        return LayoutInputs(
            name=name, index=index, layers=layers, kind=kind, shard=shard, segments=segments,
            devices=devices, options=options, dims=spec.dims, first_row=first_row,
            expert_format=spec.quantization.experts, max_piece_chunks=max_piece_chunks,
            expert_slots=expert_slots,
        )  # fmt: skip

    attention = []
    for i, name in enumerate(attention_names):
        kind = spec.attention_kinds[name]
        attention.append(
            kind_module(kind.type, f"attention_kinds.{name}").layout(
                inputs(
                    name,
                    i,
                    members(attn_table, i),
                    kind,
                    sharding.attention[name],
                    stream.attention[name].segments,
                    first_row=2,
                )  # fmt: skip
            )
        )
    ffn = []
    # Rows 0 and 1 of a layer's slab hold its norms, then the attention kinds' vectors.
    first_ffn_row = 2 + max(sum(v.rows for v in a.vectors) for a in attention)
    for i, name in enumerate(ffn_names):
        kind = spec.ffn_kinds[name]
        ffn.append(
            kind_module(kind.type, f"ffn_kinds.{name}").layout(
                inputs(
                    name,
                    i,
                    members(ffn_table, i),
                    kind,
                    sharding.ffn[name],
                    stream.ffn[name].segments,
                    first_row=first_ffn_row,
                )  # fmt: skip
            )
        )
    if spec.dims.tie_embeddings:
        unsupported("tied embeddings")
    ffn_rows_end = first_ffn_row + max(slab_rows(f) for f in ffn)
    residual = None
    if spec.attention_residual:
        r = spec.attention_residual
        residual = AttentionResidualLayout(
            block_size=r.block_size, max_snapshots=r.max_snapshots, logits_row=ffn_rows_end
        )

    globals_ = {t.name: part_of(t, devices) for t in sharding.globals}
    segments = [s for a in attention for s in a.segments] + [s for f in ffn for s in f.segments]
    segments += stream.tail
    formats = stream_formats(segments)
    tokens = options.batch * options.rows
    collectives = plan_collectives(topology, layer_uses(sharding))
    cache_arrays = sum(len(a.caches) for a in attention)
    expert_arrays = sum(f.experts.arrays for f in ffn if f.type == "moe")
    return KernelLayout(
        model=spec.name,
        topology=topology.name,
        devices=devices,
        batch=options.batch,
        rows=options.rows,
        tokens=tokens,
        tokens_padded=round_up(tokens, SUBLANES_F32),
        context=options.context,
        cache_block=round_up(options.rows + CACHE_ALIGN - 1, CACHE_ALIGN),
        hidden=hidden,
        hidden_chunks=cdiv(hidden, CHUNK),
        vocab=spec.dims.vocab,
        vocab_used=spec.dims.vocab_used or spec.dims.vocab,
        vocab_per_core=stream.tail[0].fan_out,
        norm_eps=spec.dims.norm_eps,
        zero_centered=spec.dims.norm_style == "zero_centered",
        logit_multiplier=spec.dims.logit_multiplier,
        logit_softcap=spec.dims.logit_softcap,
        stream=stream,
        attention=attention,
        ffn=ffn,
        attention_table=attn_table,
        ffn_table=ffn_table,
        attention_slot=[attention[k].layers.index(i) for i, k in enumerate(attn_table)],
        ffn_slot=[ffn[k].layers.index(i) for i, k in enumerate(ffn_table)],
        vector_rows=ffn_rows_end + (1 if residual else 0),
        vector_width=round_up(
            max(
                [hidden]
                + [v.length for a in attention for v in a.vectors]
                + [slab_width(f) for f in ffn]
            ),
            128,
        ),  # fmt: skip
        collectives=collectives,
        attention_residual=residual,
        final_norm=globals_["final_norm"],
        max_k_chunks=max(s.k_chunks for s in segments),
        max_col_blocks=max(s.col_blocks for s in segments),
        trace_residuals=trace_residuals,
        features=kernel_features(attention, ffn, formats, held_refills=devices > 1),
        num_layers=len(attn_table),
        bank_mib=round(stream.bank_bytes / 2**20, 2),
        collective_buffers=len(collectives.buffers),
        cache_arrays=cache_arrays,
        expert_arrays=expert_arrays,
        operands_before_caches=6 + 2 * sum(1 for a in attention if a.rope) + expert_arrays,
        vmem_limit_bytes=topology.chip_info.vmem_limit_bytes,
    )
