"""MoE: a router, routed experts streamed in pieces through expert slots, shared experts,
latent pre/post projections (macros.py.j2 beside it)."""

from __future__ import annotations

import math
from typing import Any, Literal

from mkgen.errors import SpecError
from mkgen.kinds.common import no_cache_geometry, no_rotary_dim, no_state_dims, no_views
from mkgen.kinds.moe.record import FLAG_ROWS, MoELayout
from mkgen.plan.kind import BufferInputs, LayoutInputs, Step
from mkgen.plan.layout import (
    VectorRow,
    activation_params,
    check_expert_format,
    check_stream_formats,
    expert_chunks,
    experts_padded,
    segment_columns,
    unsupported,
)
from mkgen.plan.sharding import FFNSharding, KindShards, choose_expert_split, price
from mkgen.plan.stream import CHUNK, LANES, part_of
from mkgen.spec.weights import ffn_weights

TEMPLATE = "kinds/moe.py.j2"
RECORD = MoELayout
# Its weight-stream segments, in the order its ops consume them (the shared experts'
# down projection right after the routed experts, then the latent back to hidden):
# tensors fused into one segment read the same input.
SEGMENTS = [
    (
        "in",
        ["ffn.router", "ffn.latent_in", "ffn.shared_gate", "ffn.shared_up", "ffn.shared_gate_proj"],
    ),
    ("shared_down", ["ffn.shared_down"]),
    ("latent_out", ["ffn.latent_out"]),
]
SLAB_VECTORS = None
rotary_dim = no_rotary_dim  # LayerKind: none
state_dims = no_state_dims  # LayerKind: none
views = no_views  # LayerKind: none
cache_geometry = no_cache_geometry  # LayerKind: none
# How each expert format the template reads stores a chunk (the EXPERT_FORMAT comment).
FORMAT_NOTES = {
    "bf16": "",
    "int4": "symmetric, one bf16 scale per {group} input rows",
    "int8": "symmetric, one f32 scale per 256 input rows and column",
    "mxfp4": "e2m1 codes, one E8M0 scale byte per 32 input rows",
    "nvfp4": "e2m1 codes, one e4m3 scale per 16 input rows and an E8M0 tensor scale",
    "fp8": "e4m3 codes, one f32 scale per {group} x {group} block",
}


def shard(ctx: Any, kind_name: str, f: Any) -> FFNSharding:
    """How the kind's tensors split over the cores (mkgen.plan.sharding's context `ctx`):
    experts split in groups x width parts (choose_expert_split); the latent design (rs_ar
    or ar_ag) priced; the router's columns split or replicated (_router_choice); norms
    and biases replicated."""
    h, d = ctx.h, ctx.d
    s = KindShards(ctx, "ffn.", f"ffn_kinds.{kind_name}: ")
    d_in = f.latent.width if f.latent else h
    layers = sum(1 for _, ffn in ctx.spec.layer_table() if ffn == kind_name)
    split = choose_expert_split(ctx, f, d_in, layers)
    designs = _latent_designs(ctx, f, d_in)
    design: Literal["rs_ar", "ar_ag", "none"] = "none"
    if designs:
        # Time, then the bytes sent (latency-bound rounds cost the same phase either way).
        cheaper = price(*designs["ar_ag"]) < price(*designs["rs_ar"])
        if ctx.options.splits is not None:  # a mini twin: the full-size build's design
            cheaper = f"ffn.{kind_name}.ar_ag" in ctx.options.splits
        design = "ar_ag" if cheaper else "rs_ar"
    router, why_router = _router_choice(ctx, kind_name, f, d_in)
    rules = _tensor_rules(d, split, design, router, why_router)
    for w in ffn_weights(f, h):
        if w.name not in rules:  # pragma: no cover - the inventory has no other MoE tensors
            raise SpecError(f"{s.where}tensor {w.name!r}: no sharding rule")
        s.add(w.name, w.shape, w.family, **rules[w.name])
    if f.latent:
        latent_in, *combine = designs[design]
        if router == "split":  # the scores ride along
            latent_in = ctx.collective("latent_in", "all_gather", "ffn.latent_in",
                                       latent_in.width + f.num_experts)  # fmt: skip
        s.collectives.extend([latent_in, *combine])
    else:
        s.collectives.append(ctx.collective("ffn_out", "all_reduce", "ffn.experts_down", h))
    why = split.why + (f"; latent design {design}" if f.latent else "") + f"; {why_router}"
    return FFNSharding(
        kind=kind_name, type=f.type, tensors=tuple(s.tensors), collectives=tuple(s.collectives),
        experts=split, latent_design=design, why=why, router=router,
    )  # fmt: skip


def _latent_designs(ctx: Any, f: Any, d_in: int) -> dict[str, tuple[Any, Any, Any]]:
    """A latent MoE's two ways to combine (the experts' outputs, then hidden), each after
    the latent's all-gather: reduce-scatter + all-reduce, or all-reduce + all-gather (none
    without a latent). With ar_ag the shared experts' activation rides in the latent's
    all-gather, so that every core holds all of it and their down projection splits by
    output columns like latent_out's (their partial sums of hidden would otherwise need
    an all-reduce of their own)."""
    if not f.latent:
        return {}
    shared = f.shared_experts.width if f.shared_experts else 0
    return {
        "rs_ar": (
            ctx.collective("latent_in", "all_gather", "ffn.latent_in", d_in),
            ctx.collective("expert_out", "reduce_scatter", "ffn.experts_down", d_in),
            ctx.collective("ffn_out", "all_reduce", "ffn.latent_out", ctx.h),
        ),
        "ar_ag": (
            ctx.collective("latent_in", "all_gather", "ffn.latent_in", d_in + shared),
            ctx.collective("expert_out", "all_reduce", "ffn.experts_down", d_in),
            ctx.collective("ffn_out", "all_gather", "ffn.latent_out", ctx.h),
        ),
    }


def _tensor_rules(
    d: int, split: Any, design: str, router: str, why_router: str
) -> dict[str, dict[str, Any]]:
    """How each MoE tensor splits over the `d` cores, by name (KindShards.add's arguments):
    the experts as `split` chose, the latent projections as `design` needs, the router as
    chosen, the rest replicated."""
    routing = {"why": "replicated (routing is computed redundantly on every rank)"}
    experts = {"parts": split.width_parts, "expert_groups": split.groups}
    columns = {"split_axis": 1, "parts": d}
    latent_out = (
        {**columns, "why": "output split + all-gather of hidden"}
        if design == "ar_ag"
        else {"split_axis": 0, "parts": d, "why": "input rows (the reduce-scattered latent)"}
    )
    return {
        "router": {**columns, "why": why_router} if router == "split" else {"why": why_router},
        "router_bias": routing,
        "selection_bias": routing,
        "latent_norm": routing,
        "shared_gate_proj": routing,
        "latent_in": {**columns, "why": "output split + all-gather of the latent"},
        "latent_out": latent_out,
        "experts_gate": {"split_axis": 2, **experts, "why": split.why},
        "experts_up": {"split_axis": 2, **experts, "why": split.why},
        "experts_down": {"split_axis": 1, **experts, "why": split.why},
        "experts_b_gate": {"split_axis": 1, **experts, "why": "per expert width"},
        "experts_b_up": {"split_axis": 1, **experts, "why": "per expert width"},
        "experts_b_down": {
            "expert_groups": split.groups,
            "why": "per expert group, added by width part 0",
        },
        "shared_gate": {**columns, "why": "shared width"},
        "shared_up": {**columns, "why": "shared width"},
        "shared_down": (
            {**columns, "why": "output split (its activation gathered with the latent)"}
            if design == "ar_ag"
            else {"split_axis": 0, "parts": d, "why": "input rows by shared width"}
        ),
    }


def _router_choice(
    ctx: Any, kind_name: str, f: Any, d_in: int
) -> tuple[Literal["split", "replicated"], str]:
    """Replicate the router, or split its columns over the cores and gather the scores.

    Compares the router bytes a replica streams per layer against a split's bytes plus
    what gathering the scores adds: with a latent only the wider latent all-gather (the
    scores ride in it), without one a collective of its own."""
    d, experts = ctx.d, f.num_experts
    if d == 1:
        return "replicated", "router replicated (one core)"
    if experts % d:
        return "replicated", f"router replicated ({experts} experts do not split {d} ways)"
    shape = (ctx.h, experts)
    try:
        split = ctx.shard("ffn.router", shape, "router", split_axis=1, parts=d)
    except SpecError as why:  # e.g. block-scaled formats whose blocks a split would cut
        return "replicated", f"router replicated (a split is not possible: {why})"
    full = ctx.shard("ffn.router", shape, "router")
    if f.latent:
        wider = ctx.collective("latent_in", "all_gather", "", d_in + experts).time_s
        gather_s = wider - ctx.collective("latent_in", "all_gather", "", d_in).time_s
        how = "scores inside the latent all-gather"
    else:
        gather_s = ctx.collective("router", "all_gather", "", experts).time_s
        how = "scores all-gathered"
    split_s = ctx.stream_s(split.rank_bytes) + gather_s
    replicated_s = ctx.stream_s(full.rank_bytes)
    costs = (
        f"split + {how} {split_s * 1e6:.2f} us vs replicated {replicated_s * 1e6:.2f} us per layer"
    )
    forced = ctx.options.splits
    if forced is not None:
        choice = "split" if f"ffn.{kind_name}.router" in forced else "replicated"
        return choice, f"router {choice} as in the full-size build ({costs})"
    choice = "split" if split_s < replicated_s else "replicated"
    return choice, f"router {choice}: {costs}"


def layout(i: LayoutInputs) -> MoELayout:
    kind, shard, name = i.kind, i.shard, i.name
    if kind.activation.kind == "gelu":
        unsupported(f"ffn_kinds.{name}: exact gelu (use gelu_tanh)")
    if shard.router == "split" and not kind.latent:
        unsupported(f"ffn_kinds.{name}: a router split over cores without a latent all-gather")
    parts = {t.name: part_of(t, i.devices) for t in shard.tensors}
    split = shard.experts
    gate = next(t for t in shard.tensors if t.name == "ffn.experts_gate")
    d = gate.global_shape[1]
    width = split.width_per_rank
    check_expert_format(i.expert_format, name, width)
    check_stream_formats(f"ffn_kinds.{name}", i.segments)
    chunks = expert_chunks(i.expert_format, d, width, i.max_piece_chunks)
    columns = segment_columns(i.segments, "in", "ffn.")
    names = [n for n in ("router_bias", "selection_bias", "latent_norm") if f"ffn.{n}" in parts]
    vectors = [
        VectorRow(
            name=n, row=i.first_row + j, part=parts[f"ffn.{n}"], length=parts[f"ffn.{n}"].size
        )
        for j, n in enumerate(names)
    ]
    r = kind.router
    return MoELayout(
        name=name,
        index=i.index,
        layers=i.layers,
        num_experts=kind.num_experts,
        top_k=kind.top_k,
        groups=split.groups,
        width_parts=split.width_parts,
        experts_per_rank=split.experts_per_rank,
        partner_experts=split.partner_experts,
        held_per_rank=split.held_per_rank,
        experts=chunks,
        expert_layers=len(i.layers),
        expert_format_note=FORMAT_NOTES[chunks.kind].format(group=chunks.group),
        packed_codes=chunks.code_rows < chunks.piece_chunks * CHUNK,
        expert_slots=i.expert_slots,
        activation=kind.activation.kind,
        activation_params=activation_params(kind.activation),
        score=r.score,
        router_bias=r.bias,
        selection_bias=r.selection_bias,
        renormalize=r.renormalize,
        routed_scaling=r.routed_scaling,
        n_group=r.n_group,
        topk_group=r.topk_group,
        latent_width=kind.latent.width if kind.latent else 0,
        latent_norm=bool(kind.latent and kind.latent.norm),
        latent_design=shard.latent_design,
        latent_per_rank=columns["latent_in"].size if "latent_in" in columns else 0,
        router_split=shard.router == "split",
        shared_width=columns["shared_gate"].size if "shared_gate" in columns else 0,
        shared_gate="shared_gate_proj" in columns,
        shared_in_flight=shared_in_flight(kind, shard.latent_design),
        shared_gathered=shared_gathered(kind, shard.latent_design),
        columns=columns,
        segments=i.segments,
        in_segments=[s.name for s in i.segments if s.name.split(".")[0] == "in"],
        ops=ops(kind),
        vectors=vectors,
        bias_row=i.first_row + len(vectors) if kind.expert_bias else None,
    )


def buffers(out: Any, i: BufferInputs) -> None:
    """Expert ids, the chosen experts' flags (VMEM, then SMEM for the scalar listing), the
    piece slots, the expert matmuls' staging; the pieces' shapes (ExpertChunks) go to
    `out.experts`."""
    name, kind, dims, slots, fmt = i.name, i.kind, i.dims, i.expert_slots, i.expert_format
    tp = dims.tokens_padded
    gate = next(t for t in i.shard.tensors if t.name == "ffn.experts_gate")
    e = expert_chunks(fmt, gate.global_shape[1], i.shard.experts.width_per_rank,
                      dims.max_piece_chunks, inline_scales=dims.inline_scales)  # fmt: skip
    out.experts[name] = e
    out.add(f"{name}_ids_vmem", "activations", (tp, 128), "int32", why="chosen experts")
    flags = (FLAG_ROWS, experts_padded(kind.num_experts))
    out.add(f"{name}_chosen_vmem", "activations", flags, "int32",
            why="the chosen experts' flags (and each group's counts)")  # fmt: skip
    out.scalar(f"{name}_chosen_smem", flags)
    out.sems(f"{name}_chosen_sem", ())
    out.scalar(f"{name}_listed_smem", (dims.tokens * kind.top_k,))
    if i.shard.experts.partner_experts:  # expert sharing: the ring's flows
        out.scalar(f"{name}_flows_smem", (i.shard.experts.groups,))
    res, why = f"{name}.experts", f"{slots} expert piece slot(s), {fmt}"
    names = (
        [f"{name}_slots_vmem"]
        if e.arrays == 1
        else [f"{name}_code_slots_vmem", f"{name}_scale_slots_vmem"]
    )
    for slot_name, (rows, dtype) in zip(names, e.array_shapes, strict=True):
        out.add(
            slot_name,
            "expert_slots",
            (slots, rows, LANES),
            dtype,
            resource=res,
            slots=slots,
            why=why,
        )
    out.sems(f"{name}_slot_sems", (2, slots))
    out.add(f"{name}_in_vmem", "activations", (e.gate_up_k_chunks, tp, CHUNK), "bf16",
            why="expert input, chunked")  # fmt: skip
    out.add(f"{name}_mid_vmem", "activations", (e.down_k_chunks, tp, CHUNK), "bf16",
            why="expert activation, chunked")  # fmt: skip
    out.add(f"{name}_acc_vmem", "activations",
            (max(e.gate_up_col_blocks, e.down_col_blocks), tp, LANES), "f32",
            why="expert matmul output blocks")  # fmt: skip
    if shared_in_flight(kind, i.shard.latent_design):
        # Fit to compiles: Kimi K3 at batch 8 x rows 8 on 2x2x4 used 36,864 B more of
        # Mosaic's scratch than the plan without this once its shared experts ran in the
        # reduce-scatter's flight (tests/test_codegen.py).
        out.add(f"mosaic_{name}_in_flight", "internal", (tp, _shared_width(i.shard)), "f32",
                "internal", why="estimate: the shared experts' activation, live in a round")  # fmt: skip
    if shared_gathered(kind, i.shard.latent_design):
        # Fit to compiles: Kimi K3 at rows 8 on 2x2x4 used 40 KiB more of Mosaic's scratch
        # than the plan without this once the whole activation came with the latent.
        width = kind.shared_experts.width
        out.add(f"mosaic_{name}_shared_gathered", "internal", (tp, width), "f32", "internal",
                why="estimate: the gathered shared activation, live through the routed experts")  # fmt: skip


def ops(kind: Any) -> list[str]:
    """The MoE layer's ops in the order its kernel function runs them: `program` emits
    them in this order and the template prints them in it (MoELayout.ops)."""
    latent, shared = ["latent_in"] if kind.latent else [], ["shared"] if kind.shared_experts else []
    tail = ["latent_out"] if kind.latent else []
    return ["in", "route", *latent, "experts", *shared, *tail, "combine"]


def _shared_width(shard: FFNSharding) -> int:
    """The shared experts' intermediate columns on each rank (their activation's width)."""
    return next(t.rank_shape[-1] for t in shard.tensors if t.name == "ffn.shared_up")


def shared_gathered(kind: Any, latent_design: str) -> bool:
    """Whether the shared experts' activation rides in the latent's all-gather and their
    down projection is split by output columns (a latent combined by all-gather, ar_ag)."""
    return bool(kind.shared_experts) and latent_design == "ar_ag"


def shared_in_flight(kind: Any, latent_design: str) -> bool:
    """Whether the shared experts' activation and down projection run while the expert_out
    reduce-scatter's copies travel: they need only the layer's input, so with a latent
    combined by reduce-scatter (rs_ar) and their op before latent_out's (`ops`) the core
    runs them in that round's flight instead of before it. Without a latent no collective
    precedes their sum (ffn_out adds them)."""
    if not kind.shared_experts or latent_design != "rs_ar":
        return False
    order = ops(kind)
    return order.index("shared") < order.index("latent_out")


def program(b: Any, s: Step) -> int:
    """The layer's ops (`ops`): the "in" segments (router, latent_in, shared gate|up),
    routing, the latent's all-gather and norm, the chosen experts, the shared experts'
    down projection (in the expert_out reduce-scatter's flight where shared_in_flight), the
    latent's way back to hidden, the combine. A split router's scores ride in the latent's
    all-gather, which routing then waits for."""
    layer, name, kind, segs, first = s.layer, s.name, s.kind, s.segments, s.stream_row
    v, colls = s.vectors, s.collectives
    y = route = lat = out = s.x
    shared: int | None = None
    gathered = None

    def activation() -> int:
        return b.vec(layer, f"{name}: shared activation", y, 8 * b.t * _shared_width(s.shard))

    def shared_experts() -> None:
        nonlocal shared
        # Gathered: the whole activation came with the latent (every core's columns).
        act = gathered_act if gathers_shared else activation()
        shared = b.segment(layer, name, segs["shared_down"], first, act)

    in_flight = shared_in_flight(kind, s.shard.latent_design)
    gathers_shared = shared_gathered(kind, s.shard.latent_design)
    gathered_act = None
    for op in ops(kind):
        if op == "in":
            for seg in (seg for n, seg in segs.items() if n.split(".")[0] == "in"):
                y = b.segment(layer, name, seg, first, y)  # one segment per format of "in"
            if gathers_shared:  # its columns of the activation join the latent's all-gather
                y = activation()
        elif op == "route":
            if s.shard.router == "split":
                gathered = b.collective(layer, colls["latent_in"], y)
            scores = y if gathered is None else gathered
            route = b.run("routing", f"L{layer} {name}: router scores, top-{kind.top_k}", layer,
                          4 * b.t * kind.num_experts * kind.top_k, ((scores, None, 0), (v, None, 0)))  # fmt: skip
        elif op == "latent_in":
            lat = (
                gathered if gathered is not None else b.collective(layer, colls.get("latent_in"), y)
            )
            gathered_act = lat
            lat = b.vec(layer, f"{name}: latent norm", lat, 5 * b.t * kind.latent.width,
                        ((v, None, 0),))  # fmt: skip
        elif op == "experts":
            out = _experts(b, layer, name, kind, s.shard, route, lat)
        elif op == "shared":
            if not in_flight:  # else the expert_out reduce-scatter runs them in its flight
                shared_experts()
        elif op == "latent_out":
            out = b.collective(layer, colls.get("expert_out"), out,
                               in_flight=shared_experts if in_flight else None)  # fmt: skip
            out = b.segment(layer, name, segs["latent_out"], first, out)
        else:  # combine
            if shared is not None:
                out = b.vec(layer, f"{name}: experts + shared experts", out, b.t * b.dims.hidden,
                            ((shared, None, 0),))  # fmt: skip
            out = b.collective(layer, colls.get("ffn_out"), out)
    return out


def _experts(b: Any, layer: int, name: str, kind: Any, f: Any, route: int, x: int) -> int:
    """The chosen experts' flags (VPU) to SMEM, the list of this core's chosen experts,
    then their pieces through the slots: piece q (of expert q // P) in slot q % S, the
    first S issued at once, piece q + S right after piece q is used (the template's
    expert ring)."""
    split = f.experts
    e = b.vmem.experts[name]
    expected = split.expected_max_experts_per_rank
    passes = b.sh.draft_passes
    if passes is not None and layer in passes.layers and layer != passes.first_layer:
        # A chained pass: a sequence's rows repeat its one entry, so choose one token's experts.
        assert split.chained_expected_max_experts_per_rank is not None
        expected = split.chained_expected_max_experts_per_rank
    n = max(1, min(split.experts_per_rank, math.ceil(expected)))
    pieces = e.pieces
    b.experts_per_layer[layer] = (n, pieces)
    slots = b.vmem.expert_slots
    res = f"{name}.experts"
    chosen = b.run("chosen", f"L{layer} {name}: flag the chosen experts", layer, 0,
                   ((route, None, 0),))  # fmt: skip
    flags = b.dma("ids", f"L{layer} {name}: chosen experts' flags -> SMEM", layer,
                  f"smem:{name}.chosen", 0, (f"{name}_chosen_sem",),
                  FLAG_ROWS * experts_padded(kind.num_experts) * 4, reads=((chosen, None, 0),))  # fmt: skip
    b.start(flags)
    b.wait(flags)
    listing = b.run("scalar", f"L{layer} {name}: list this core's chosen experts", layer, 0,
                    ((flags, f"smem:{name}.chosen", 0),))  # fmt: skip
    kept = expert_iterations(n, pieces, slots)
    units = len(kept) * pieces  # over the kept iterations (see expert_iterations)
    sems = [tuple(f"{name}_slot_sems[{k},{s}]" for k in range(e.arrays)) for s in range(slots)]
    nodes: dict[int, int] = {}
    outer = b.repeat
    piece_bytes = e.piece_bytes  # a property: computed once, not per DMA

    def fetch(q: int) -> None:
        if q >= units:
            return
        (i, rep), p = kept[q // pieces], q % pieces
        nodes[q] = b.dma("expert", f"L{layer} {name}: expert {i} piece {p}", layer, res,
                         q % slots, sems[q % slots], piece_bytes, count=e.arrays,
                         reads=((listing, None, 0),), key=("expert", layer, i, p),
                         repeat=outer * rep)  # fmt: skip
        b.start(nodes[q])

    for q in range(slots):
        fetch(q)
    flops = 2 * split.rows_per_expert * e.piece_chunks * CHUNK * LANES
    acc = x
    for k, (i, rep) in enumerate(kept):
        b.repeat = outer * rep
        prev = x
        for p in range(pieces):
            q = k * pieces + p
            b.wait(nodes[q])
            part = "gate/up" if p < e.gate_up_pieces else "down"
            prev = b.run(
                "expert_mm", f"L{layer} {name}: expert {i} {part} piece {p}", layer, flops,
                ((nodes[q], res, q % slots), (prev, None, 0), (route, None, 0)),
            )  # fmt: skip
            fetch(q + slots)
            if p == e.gate_up_pieces - 1:
                prev = b.vec(layer, f"{name}: expert {i} activation", prev,
                             8 * b.t * e.width)  # fmt: skip
        acc = b.vec(layer, f"{name}: += weight x expert {i}", acc, 2 * b.t * e.d,
                    ((prev, None, 0),))  # fmt: skip
    b.repeat = outer
    return acc


def expert_iterations(n: int, pieces: int, slots: int) -> list[tuple[int, int]]:
    """(expert index, repeat) of the expert loop's iterations the schedule keeps.

    Piece q of the loop lives in slot q % slots, so iteration i meets the slots in phase
    i x pieces mod slots, which repeats every ``period`` iterations. Kept: the first
    period (the ring fills), one period standing for the steady state (repeat = the
    middle periods), and the last iterations where prefetching stops (the ring drains).
    Consecutive kept iterations stay in phase, so every slot pattern is checked.
    """
    period = slots // math.gcd(pieces, slots)
    drain = max(period, -(-slots // pieces))
    if n <= 2 * period + drain:
        return [(i, 1) for i in range(n)]
    tail = drain + (n - period - drain) % period
    middle = n - period - tail  # a whole number of periods, at least one
    kept = [(i, 1) for i in range(period)]
    kept += [(i, middle // period) for i in range(period, 2 * period)]
    kept += [(i, 1) for i in range(n - tail, n)]
    return kept
