"""Building the kernel layout (mkgen.plan.layout.KernelLayout): the generic parts here,
each layer kind's own through its rule in the KindRegistry passed in."""

from __future__ import annotations

from typing import Any

from mkgen.plan.collectives import greedy_scheme, layer_uses, plan_collectives
from mkgen.plan.kind import KindRegistry, LayoutInputs
from mkgen.plan.layout import (
    SUBLANES_F32,
    AttentionResidualLayout,
    KernelLayout,
    check_formats,
    draft_hidden_states,
    kernel_features,
    row_block,
    stream_formats,
    unsupported,
)
from mkgen.plan.options import BuildOptions, cache_block
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
    kinds: KindRegistry,
    max_piece_chunks: int,
    expert_slots: int,
    kv_tiles: dict[str, int],
    trace_residuals: bool = False,
    snapshots_in_hbm: bool = False,
    state_slots: int = 0,
) -> KernelLayout:
    """The kernel layout of `spec` on `topology`: per-rank pieces as `sharding` decided, the
    stream as planned, `expert_slots` and the cache kinds' `kv_tiles` as the VMEM plan
    chose them, each layer kind's record built by its rule in `kinds`."""
    check_formats(spec, stream)
    passes = sharding.draft_passes
    # A later pass uses the first pass's cache and experts: no slot of its own.
    own_slot = [passes is None or passes.source(i) == i for i in range(spec.layers.count)]

    def layouts(
        group: str, by_name: dict[str, Any], layer_names: list[str], shards: dict[str, Any],
        streams: dict[str, Any], first_row: int,
    ) -> tuple[list[Any], list[int]]:  # fmt: skip
        """The layouts of the attention (or FFN) kinds, and the layer table's codes."""
        names = list(by_name)
        table = [names.index(n) for n in layer_names]
        built = []
        for index, name in enumerate(names):
            kind = by_name[name]
            built.append(kinds.rules(kind.type, f"{group}.{name}").layout(LayoutInputs(
                name=name, index=index,
                layers=[i for i, k in enumerate(table) if k == index and own_slot[i]],
                kind=kind, shard=shards[name], segments=streams[name].segments,
                devices=topology.num_devices, options=options, dims=spec.dims,
                first_row=first_row, expert_format=spec.quantization.experts,
                max_piece_chunks=max_piece_chunks, expert_slots=expert_slots,
                kv_tile=kv_tiles.get(name), state_slots=state_slots,
            )))  # fmt: skip
        return built, table

    attention, attn_table = layouts(
        "attention_kinds", spec.attention_kinds, spec.attention_table(), sharding.attention,
        stream.attention, first_row=2,
    )  # fmt: skip
    # Rows 0 and 1 of a layer's slab hold its norms, then the attention kinds' vectors.
    first_ffn_row = 2 + max(sum(v.rows for v in a.vectors) for a in attention)
    ffn, ffn_table = layouts(
        "ffn_kinds", spec.ffn_kinds, spec.ffn_table(), sharding.ffn, stream.ffn,
        first_row=first_ffn_row,
    )  # fmt: skip
    if spec.dims.tie_embeddings:
        unsupported("tied embeddings")
    ffn_rows_end = first_ffn_row + max(f.slab_rows() for f in ffn)
    residual = None
    if spec.attention_residual:
        r = spec.attention_residual
        residual = AttentionResidualLayout(
            block_size=r.block_size,
            max_snapshots=r.max_snapshots,
            logits_row=ffn_rows_end,
            in_hbm=snapshots_in_hbm,
        )
    return _assemble(
        spec, topology, sharding, stream, options, attention, ffn, (attn_table, ffn_table),
        ffn_rows_end, residual, trace_residuals,
    )  # fmt: skip


def _assemble(
    spec: ModelSpec, topology: Topology, sharding: ShardingPlan, stream: StreamPlan,
    options: BuildOptions, attention: list[Any], ffn: list[Any],
    tables: tuple[list[int], list[int]], ffn_rows_end: int,
    residual: AttentionResidualLayout | None, trace_residuals: bool,
) -> KernelLayout:  # fmt: skip
    """The KernelLayout around the kinds' layouts: the generic counts and choices."""
    devices, hidden = topology.num_devices, spec.dims.hidden
    attn_table, ffn_table = tables
    passes = sharding.draft_passes
    source = passes.source if passes is not None else (lambda layer: layer)
    rotary = sum(1 for a in attention if a.rope)
    globals_ = {t.name: part_of(t, devices) for t in sharding.globals}
    segments = [s for a in attention for s in a.segments] + [s for f in ffn for s in f.segments]
    segments += stream.tail + ([stream.draft.eh_proj] if stream.draft is not None else [])
    formats = stream_formats(segments)
    tokens = options.batch * options.rows
    collectives = plan_collectives(topology, layer_uses(sharding), greedy_scheme(sharding))
    cache_arrays = sum(len(a.caches) for a in attention)
    expert_arrays = sum(c.arrays for f in ffn if (c := f.routed_chunks()) is not None)
    return KernelLayout(
        model=spec.name,
        topology=topology.name,
        devices=devices,
        batch=options.batch,
        rows=options.rows,
        tokens=tokens,
        tokens_padded=round_up(tokens, SUBLANES_F32),
        row_block=row_block(round_up(tokens, SUBLANES_F32)),
        context=options.context,
        cache_block=cache_block(options.rows, options.context),
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
        attention_slot=[attention[k].layers.index(source(i)) for i, k in enumerate(attn_table)],
        ffn_slot=[ffn[k].layers.index(source(i)) for i, k in enumerate(ffn_table)],
        vector_rows=ffn_rows_end + (1 if residual else 0),
        vector_width=round_up(
            max(
                [hidden]
                + [v.length for a in attention for v in a.vectors]
                + [f.slab_width() for f in ffn]
            ),
            128,
        ),  # fmt: skip
        collectives=collectives,
        attention_residual=residual,
        final_norm=globals_["final_norm"],
        max_k_chunks=max(s.k_chunks for s in segments),
        max_col_blocks=max(s.col_blocks for s in segments),
        trace_residuals=trace_residuals,
        draft_hidden=draft_hidden_states(spec, options.rows),
        draft_passes=passes,
        features=kernel_features(attention, ffn, formats, held_refills=devices > 1),
        num_layers=len(attn_table),
        bank_mib=round(stream.bank_bytes / 2**20, 2),
        collective_buffers=len(collectives.buffers),
        cache_arrays=cache_arrays,
        expert_arrays=expert_arrays,
        # with a fused drafter: the fed rows' tokens, the MTP norms, RoPE at the next
        # positions and the embedding table too
        operands_before_caches=6
        + 2 * rotary
        + expert_arrays
        + (3 + 2 * rotary if passes is not None else 0),
        vmem_limit_bytes=topology.chip_info.vmem_limit_bytes,
    )
