"""`mkgen inspect`: a generated kernel's outline for a reader, tied back to its plan.

Everything comes from the build directory: the source of megakernel.py, parsed
with `ast` (functions and their line ranges, the phases of each layer kind in
execution order), and plan.json (stream banks, ring depth, cache tiles). The VMEM
map comes from the kernel itself: its `_scratch_shapes()` (what it allocates) next
to the `_kernel` parameters that receive those buffers and their shape comments.

Phases of a layer-kind function (`_attention_<kind>`, `_ffn_<kind>`, `_lm_head`) are
its top-level statements cut at *markers*: a weight-stream matmul
(`ctx.stream.matmul(x, first_row, SEGMENT)`, matched to the plan's segment at the row
offset of the module's `SEGMENT = Segment(offset=...)` constant), a collective
(`ctx.collectives.<op>`) or a call of a helper made for the kind (`_<what>_<kind>`,
labelled by its docstring). Statements between markers belong to the next marker's
phase.
"""

from __future__ import annotations

import ast
import functools
import io
import json
import math
import tokenize
import types
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import ValidationError

from mkgen.errors import MkgenError
from mkgen.hardware import vmem_padded_bytes
from mkgen.kinds import default_registry
from mkgen.plan.layout import AttentionRecord, KernelLayout
from mkgen.plan.stream import Segment

# ---------------------------------------------------------------- source structure


@dataclass(frozen=True)
class Function:
    name: str  # "_attention_gqa" or "Stream.matmul"
    first: int
    last: int
    doc: str  # first line of its docstring
    node: ast.FunctionDef = field(repr=False, compare=False)

    @property
    def lines(self) -> str:
        return f"{self.first}-{self.last}"


def functions(source: str) -> dict[str, Function]:
    """Top-level functions and class methods of a module, by (qualified) name."""
    out: dict[str, Function] = {}

    def add(node: ast.FunctionDef, name: str) -> None:
        doc = (ast.get_docstring(node) or "").strip().splitlines()
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        out[name] = Function(
            name, first, node.end_lineno or node.lineno, doc[0] if doc else "", node
        )

    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef):
            add(node, node.name)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    add(item, f"{node.name}.{item.name}")
    return out


def _call_name(call: ast.Call) -> str:
    """'ctx.stream.matmul', '_attend_gqa', ... for a call node."""
    parts: list[str] = []
    node: ast.AST = call.func
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _segment_argument(call: ast.Call) -> str | None:
    """The name of the stream matmul's segment: SEGMENT of `matmul(x, first, SEGMENT)`."""
    if len(call.args) < 3 or not isinstance(call.args[2], ast.Name):
        return None
    return call.args[2].id


@functools.cache
def segment_offsets(source: str) -> dict[str, int]:
    """Row offsets of the module's `NAME = Segment(offset=N, ...)` constants, by name."""
    out = {}
    for node in ast.parse(source).body:
        if not (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and _call_name(node.value) == "Segment"
        ):
            continue
        offset = next((k.value for k in node.value.keywords if k.arg == "offset"), None)
        for target in node.targets:
            if isinstance(target, ast.Name) and isinstance(offset, ast.Constant):
                out[target.id] = int(offset.value)
    return out


@dataclass
class Phase:
    label: str
    first: int
    last: int
    marker: str  # "stream", "collective", "helper" or "code"
    detail: Any = None  # the segment's constant, the collective op or the helper name
    dmas: list[str] = field(default_factory=list)

    @property
    def lines(self) -> str:
        return f"{self.first}-{self.last}"


def phases(fn: Function, kind: str, helpers: dict[str, Function]) -> list[Phase]:
    """The phases of one layer-kind function, in execution order."""
    out: list[Phase] = []
    start: int | None = None
    body = fn.node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    for statement in body:
        if start is None:
            start = statement.lineno
        marker = None
        for node in ast.walk(statement):
            if not isinstance(node, ast.Call):
                continue
            name = _call_name(node)
            if name.endswith("stream.matmul"):
                marker = Phase("", start, 0, "stream", _segment_argument(node))
            elif ".collectives." in f".{name}":
                marker = Phase("", start, 0, "collective", name.rsplit(".", 1)[-1])
            elif name.startswith("_") and name.endswith(f"_{kind}") and name in helpers:
                marker = Phase("", start, 0, "helper", name)
            if marker:
                break
        if marker:
            marker.last = statement.end_lineno or statement.lineno
            if (
                out
                and out[-1].marker == "helper" == marker.marker
                and out[-1].detail == marker.detail
            ):
                out[-1].last = marker.last  # e.g. RoPE applied to q, then to k
            else:
                out.append(marker)
            start = None
    trailing = [st for st in body if st.lineno >= (start or 10**9)]
    if start is not None and not (len(trailing) == 1 and isinstance(trailing[0], ast.Return)):
        out.append(Phase("", start, body[-1].end_lineno or start, "code", None))
    return out


# ---------------------------------------------------------------- the VMEM map


@dataclass(frozen=True)
class Buffer:
    name: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    padded_bytes: int  # with Mosaic's (sublane, lane) tiling of the last two dims
    comment: str


@dataclass(frozen=True)
class VmemMap:
    buffers: list[Buffer]
    semaphores: list[Buffer]  # bytes 0: semaphores live in their own memory
    smem: list[Buffer] = field(default_factory=list)  # scalar memory scratch

    @property
    def total_bytes(self) -> int:
        return sum(b.bytes for b in self.buffers)

    @property
    def padded_bytes(self) -> int:
        return sum(b.padded_bytes for b in self.buffers)


def _comments(source: str) -> dict[int, str]:
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def vmem_map(source: str) -> VmemMap | None:
    """The kernel's scratch buffers (None if the module has no `_scratch_shapes`/`_kernel`).

    Imports the generated module (jax only) in a fresh namespace; nothing runs but the
    allocation list."""
    fns = functions(source)
    if "_scratch_shapes" not in fns or "_kernel" not in fns:
        return None
    module = types.ModuleType("mkgen_inspected_kernel")
    exec(compile(source, "megakernel.py", "exec"), module.__dict__)  # noqa: S102 (our own output)
    shapes = module._scratch_shapes()
    params = [a for a in fns["_kernel"].node.args.args]
    names = params[len(params) - len(shapes) :]
    comments = _comments(source)
    buffers, semaphores, smem = [], [], []
    for param, ref in zip(names, shapes, strict=True):
        shape = tuple(int(d) for d in ref.shape)
        space = str(getattr(ref, "memory_space", "")).upper()
        comment = comments.get(param.lineno, "")
        if "SEMAPHORE" in space:
            semaphores.append(Buffer(param.arg, shape, "semaphore", 0, 0, comment))
            continue
        itemsize = np.dtype(ref.dtype).itemsize
        size = math.prod(shape) * itemsize
        buffer = Buffer(
            param.arg, shape, str(np.dtype(ref.dtype)), size,
            vmem_padded_bytes(shape, 8 * itemsize),
            comment,
        )  # fmt: skip
        (smem if "SMEM" in space else buffers).append(buffer)
    return VmemMap(buffers, semaphores, smem)


# ---------------------------------------------------------------- a build on disk


@dataclass(frozen=True)
class Build:
    directory: Path
    source: str
    plan: dict[str, Any]
    layout: KernelLayout

    @property
    def kernel_path(self) -> Path:
        return self.directory / "megakernel.py"


def resolve_build(ref: str | Path) -> Path:
    """A build directory, or a build name under generated/ (`qwen3-32b-2x2x1`)."""
    from mkgen.codegen.naming import GENERATED

    path = Path(ref)
    if (path / "megakernel.py").exists():
        return path
    if not path.is_absolute() and (GENERATED / path / "megakernel.py").exists():
        return GENERATED / path
    raise MkgenError(f"{ref}: not a build directory (no megakernel.py); run `mkgen build` first")


def load_build(ref: str | Path) -> Build:
    directory = resolve_build(ref)
    plan_path = directory / "plan.json"
    if not plan_path.exists():
        raise MkgenError(f"{directory}: no plan.json beside megakernel.py")
    plan = json.loads(plan_path.read_text())
    try:
        layout = KernelLayout.read(plan["kernel"], default_registry())
    except (KeyError, ValidationError):
        rebuild = plan.get("build", {}).get("rebuild", "mkgen build ... --force")
        raise MkgenError(
            f"{plan_path} was written by a different mkgen (its kernel layout does not load); "
            f"rebuild it: {rebuild}"
        ) from None
    return Build(directory, (directory / "megakernel.py").read_text(), plan, layout)


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def _ranges(values: list[int]) -> str:
    out: list[list[int]] = []
    for v in values:
        if out and out[-1][1] == v - 1:
            out[-1][1] = v
        else:
            out.append([v, v])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out)


@dataclass(frozen=True)
class _Kind:
    section: str  # "attention" or "ffn"
    name: str
    type: str
    layers: list[int]
    segments: list[Any]
    function: str


def _kinds(layout: KernelLayout) -> list[_Kind]:
    out = [
        _Kind("attention", a.name, a.type, a.layers, a.segments, f"_attention_{a.name}")
        for a in layout.attention
    ]
    out += [
        _Kind("ffn", f.name, f.type, f.layers, f.segments, f"_ffn_{f.name}") for f in layout.ffn
    ]
    return out


def _describe_dmas(build: Build, kind: _Kind | None, phase: Phase, helper: Function | None) -> None:
    """Fill `phase.label` and `phase.dmas` from the plan."""
    if phase.marker == "stream":
        _describe_stream(build, kind, phase)
    elif phase.marker == "collective":
        _describe_collective(build, phase)
    elif phase.marker == "helper" and helper is not None:
        phase.label = f"{helper.name}: {helper.doc}" if helper.doc else helper.name
        phase.dmas = _helper_dmas(build, helper)
        phase.dmas.append(f"weight ring: {build.layout.stream.ring_depth} banks stay in flight")
    else:
        remote = _dma_sites(build, phase.first, phase.last, "these lines")
        phase.label = "vector work" + ("" if remote.startswith("no ") else " and DMAs")
        ring = f"weight ring: {build.layout.stream.ring_depth} banks stay in flight"
        if kind is None:
            phase.label = "logit scaling, greedy token across the vocabulary shards"
            ring = "weight ring: drained (the lm_head was the end of the stream)"
        phase.dmas = [remote, ring]


def _describe_stream(build: Build, kind: _Kind | None, phase: Phase) -> None:
    """A weight-stream matmul: the rows it consumes and how far the ring runs ahead."""
    stream = build.layout.stream
    depth, bank = stream.ring_depth, _mib(stream.bank_bytes)
    segments = kind.segments if kind else stream.tail
    offset = segment_offsets(build.source).get(phase.detail)
    seg = next((s for s in segments if s.offset == offset), None)
    if seg is None:
        phase.label = "weight-stream matmul"
        phase.dmas = [f"weight ring: {depth} banks of {bank} in flight"]
        return
    where = f"the layer's {kind.section}" if kind else "the lm_head"
    after = {
        "attention": "the layer's FFN",
        "ffn": "the next layer's attention (or the lm_head)",
    }
    phase.label = f"matmul {seg.name} [{seg.fan_in} x {seg.fan_out}] from the weight stream"
    reach = "; the ring runs ahead into " + (
        f"{after.get(kind.section, 'what follows')}"
        if kind
        else "nothing (the lm_head ends the stream)"
    )
    tail = f", the last column block transposed ({seg.tail_rows} rows)" if seg.tail_rows else ""
    phase.dmas = [
        f"consumes rows +{seg.offset}..+{seg.offset + seg.rows - 1} of {where} "
        f"({seg.rows} rows of {bank} banks, {seg.k_chunks} x {seg.col_blocks} chunks of "
        f"{seg.chunk_rows} x 256{tail})",
        f"weight ring: the chunk that reaches bank g waits for it, then issues bank "
        f"g - 1 + {depth} into the slot of g - 1 ({depth} banks in flight){reach}",
    ]


def _describe_collective(build: Build, phase: Phase) -> None:
    """A collective: its rounds and remote copies."""
    L = build.layout
    op = str(phase.detail)
    coll = L.collectives
    phase.label = f"{op.replace('_', '-')} across {L.devices} cores"
    ways = []
    for scheme in coll.sequences():
        rounds = [coll.rounds[i] for i in scheme]
        peers = sum(r.size - 1 for r in rounds)
        named = " then ".join(f"{r.name} x{r.size}" for r in rounds)
        ways.append(
            f"{peers} remote DMAs out and {peers} in over {len(rounds)} one-shot round(s) ({named})"
        )
    phase.dmas = (
        [
            f"{' or '.join(ways)}, as the plan gives each call, at most [{L.tokens}, "
            f"{max(b.width for b in coll.buffers)}] 32-bit words each (f32, or bf16 "
            "pairs), one semaphore per copy, combined in member order"
        ]
        if coll.rounds
        else ["none (one core)"]
    )
    phase.dmas.append(f"weight ring: {L.stream.ring_depth} banks stay in flight")


def _helper_dmas(build: Build, helper: Function) -> list[str]:
    """The DMAs of a kernel helper: a kind's cache writes, expert pieces, routing or
    attention tiles as the plan sizes them, else the DMA sites in its source."""
    L = build.layout
    name = helper.name
    attention = next((a for a in L.attention if name.endswith(f"_{a.name}")), None)
    moe = next((f for f in L.ffn if f.routed_experts and name.endswith(f"_{f.name}")), None)
    if name.startswith("_write_cache_") and attention:
        n = 2 * L.batch * attention.kv_heads
        return [
            f"cache: {n} block reads, then {n} block writes of {L.cache_block} rows "
            f"x {attention.head_dim} bf16 (k and v, {L.batch} sequence(s) x "
            f"{attention.kv_heads} kv head(s)), all waited before attention reads tiles"
        ]
    if name.startswith("_experts_") and moe:
        e = moe.experts
        return [
            f"routed experts: the ids go to SMEM (1 DMA); each distinct chosen expert of "
            f"this core's group ({moe.experts_per_rank} experts x width {e.width} per core"
            + (
                f"; with expert sharing also {moe.partner_experts} of the next group's, "
                "whose active ones the ring splits"
                if moe.partner_experts
                else ""
            )
            + ") "
            f"streams in {e.pieces} piece(s) of {e.piece_chunks} chunk(s) ({e.format}) "
            f"through {moe.expert_slots} expert slots, the first issued as soon as the list "
            f"exists, each slot refilled right after its piece is used"
        ]
    if name.startswith("_route_") and moe:
        return [
            f"none: {moe.score} router, top-{moe.top_k} of {moe.num_experts} by argmax "
            f"loops in VMEM"
        ]
    if name.startswith("_attend_") and attention:
        return [
            f"cache: K and V tiles of {attention.kv_tile} tokens x {attention.head_dim}, "
            f"double-buffered (tile t + 1 issued before tile t is used), per "
            f"(sequence, kv head) over positions [0, pos + {L.rows})"
        ]
    return [_dma_sites(build, helper.first, helper.last, "its source")]


def _dma_sites(build: Build, first: int, last: int, where: str) -> str:
    """How many DMA start sites lie in lines first..last of the kernel source."""
    src = build.source.splitlines()[first - 1 : last]
    local = sum("make_async_copy(" in line for line in src)
    remote = sum("make_async_remote_copy(" in line for line in src)
    if not local and not remote:
        return "no DMAs of its own"
    return f"{local} local and {remote} remote (ICI) DMA descriptor(s) created in {where}"


def _kind_phases(build: Build, kind: _Kind | None, fns: dict[str, Function]) -> list[Phase]:
    fn_name = kind.function if kind else "_lm_head"
    fn = fns.get(fn_name)
    if fn is None:
        return []
    suffix = kind.name if kind else "lm_head"
    names = [k.name for k in _kinds(build.layout)]
    helpers = {h.name: h for h in _helpers_of(suffix, fns, fn_name, names)}
    found = phases(fn, suffix, helpers)
    for phase in found:
        helper = helpers.get(phase.detail) if phase.marker == "helper" else None
        _describe_dmas(build, kind, phase, helper)
    return found


def _helpers_of(
    kind_name: str, fns: dict[str, Function], main: str, kinds: Sequence[str] = ()
) -> list[Function]:
    """`_<what>_<kind_name>` functions, unless a longer kind name (`shared_moe` for `moe`)
    claims them."""
    longer = [k for k in kinds if len(k) > len(kind_name) and k.endswith(f"_{kind_name}")]
    return [
        f
        for n, f in fns.items()
        if n.endswith(f"_{kind_name}")
        and n != main
        and not any(n.endswith(f"_{k}") for k in longer)
    ]


def _vmem_lines(build: Build) -> list[str]:
    vm = vmem_map(build.source)
    if vm is None:
        return ["VMEM map: unavailable (no _scratch_shapes / _kernel in this kernel)"]
    lines = [
        f"VMEM map (scratch the kernel allocates; {_mib(vm.total_bytes)}, "
        f"{_mib(vm.padded_bytes)} with Mosaic tile padding):"
    ]
    width = max(len(b.name) for b in vm.buffers)
    for b in sorted(vm.buffers, key=lambda b: -b.padded_bytes):
        shape = "x".join(map(str, b.shape))
        lines.append(
            f"  {b.name:<{width}}  {shape:<22} {b.dtype:<8} {_mib(b.padded_bytes):>11}  {b.comment}"
        )
    if vm.smem:
        smem = ", ".join(f"{b.name}[{'x'.join(map(str, b.shape))}]" for b in vm.smem)
        lines.append(f"  SMEM scratch: {smem}")
    sems = ", ".join(f"{s.name}[{'x'.join(map(str, s.shape))}]" for s in vm.semaphores)
    lines.append(f"  DMA semaphores: {sems}")
    return lines


# What the structural functions do, for those the template leaves without a docstring.
_STRUCTURE = {
    "_kernel": "the kernel body: barrier, prime the weight ring, the runtime layer loop "
    "(kinds chosen by pl.when on the SMEM layer tables), the lm_head",
    "Stream.prime": "start the first RING_DEPTH bank DMAs of the step",
    "Ring.prime": "start the first DMAs of a ring (weight banks or expert pieces)",
    "Collectives.all_reduce": "one-shot rounds (host, then across hosts, or one of every "
    "core): the running sum to every other member of the round's group; summed in f32 in "
    "member order; or scattered: part j of the sum to host member j, that part across "
    "hosts, the parts gathered over the host",
    "Collectives.all_gather": "one-shot rounds: the pieces gathered so far to every other "
    "member of the round's group",
    "Collectives.reduce_scatter": "one-shot rounds (across hosts first, or one of every "
    "core): part j of the running sum to member j",
}


def outline(ref: str | Path) -> str:
    """The whole kernel: each phase of each layer kind with line ranges, DMAs, VMEM map."""
    build = load_build(ref)
    L = build.layout
    fns = functions(build.source)
    stream = L.stream
    n_lines = len(build.source.splitlines())
    out = [
        f"{L.model} on {L.topology}: {build.kernel_path} ({n_lines} lines); {L.devices} core(s), "
        f"batch {L.batch} x rows {L.rows}, context {L.context}",
        f"weight stream: {stream.total_banks} banks of {stream.bank_rows} rows "
        f"({_mib(stream.bank_bytes)}) per core per step, ring of {stream.ring_depth} banks "
        f"({_mib(stream.ring_depth * stream.bank_bytes)}) in VMEM",
        "",
        "kernel structure:",
    ]
    suffixes = [f"_{k.name}" for k in _kinds(L)] + ["_lm_head"]
    for name, fn in sorted(fns.items(), key=lambda kv: kv[1].first):
        if any(name.endswith(sfx) for sfx in suffixes) or name.endswith(".__init__"):
            continue  # the layer kinds' own functions: outlined below
        doc = fn.doc or _STRUCTURE.get(name, "")
        out.append(f"  {name:<24} lines {fn.lines:<10} {doc}")
    for kind in [*_kinds(L), None]:
        if kind is None:
            title = "lm_head (once per step)"
            main = "_lm_head"
        else:
            title = (
                f"{kind.section} {kind.name!r} ({kind.type}): layers {_ranges(kind.layers)} "
                f"({len(kind.layers)})"
            )
            main = kind.function
        out.append("")
        fn = fns.get(main)
        out.append(f"{title}: {main} lines {fn.lines if fn else '(not found)'}")
        for i, phase in enumerate(_kind_phases(build, kind, fns), 1):
            out.append(f"  {i}. {phase.label}  [lines {phase.lines}]")
            out += [f"       DMAs: {d}" for d in phase.dmas]
        names = [k.name for k in _kinds(L)]
        helpers = _helpers_of(kind.name if kind else "lm_head", fns, main, names)
        if helpers:
            out.append("  helpers: " + ", ".join(f"{h.name} {h.lines}" for h in helpers))
    out.append("")
    out += _vmem_lines(build)
    return "\n".join(out)


def _bank_owner(L: KernelLayout) -> list[str]:
    """What every bank of the stream holds, e.g. 'layer 3 attention gqa.qkv'."""
    owners: list[list[str]] = [[] for _ in range(L.stream.total_banks)]

    def own(first: int, seg: Segment, name: str) -> None:
        lo, hi = seg.bank_span(first, L.stream.bank_rows)
        for b in range(lo, hi + 1):
            owners[b].append(name)

    for layer, (a, f) in enumerate(zip(L.attention_table, L.ffn_table, strict=True)):
        for section, kind, first in (
            ("attention", L.attention[a], L.stream.attention_rows[layer]),
            ("ffn", L.ffn[f], L.stream.ffn_rows[layer]),
        ):
            for seg in kind.segments:
                own(first, seg, f"layer {layer} {section} {kind.name}.{seg.name}")
    for seg in L.stream.tail:
        own(L.stream.lm_head_row, seg, f"lm_head.{seg.name}")
    return [" | ".join(names) for names in owners]


def _summarise(owner: list[str], first: int, last: int) -> str:
    runs: list[list[Any]] = []
    for b in range(max(first, 0), min(last, len(owner) - 1) + 1):
        if runs and runs[-1][2] == owner[b]:
            runs[-1][1] = b
        else:
            runs.append([b, b, owner[b]])
    return "; ".join(f"{a}-{b} {what}" if a != b else f"{a} {what}" for a, b, what in runs)


def _cache_lines(a: AttentionRecord, slot: int) -> list[str]:
    """Where a layer's cache lies in its kind's per-core cache arrays (CacheArray: every
    kind's, from its layout), and the tiles it is read in when the kind streams it."""
    arrays = ", ".join(
        f"{a.name}_{c.name}_hbm[0, {slot}] = {c.shape[1:]} {c.dtype}" for c in a.caches
    )
    tile = getattr(a, "kv_tile", None)  # kinds attending over a KV cache stream it in tiles
    tiles = f", tiles of {tile} tokens" if tile else ""
    return [f"  cache slot {slot} of kind {a.name!r}: {arrays} per core{tiles}"]


def layer_view(ref: str | Path, layer: int) -> str:
    """One layer: its kinds, stream banks, cache slot, and the source that runs it."""
    build = load_build(ref)
    L = build.layout
    layers = len(L.attention_table)
    if not 0 <= layer < layers:
        raise MkgenError(f"--layer {layer}: the model has layers 0..{layers - 1}")
    fns = functions(build.source)
    owner = _bank_owner(L)
    depth = L.stream.ring_depth
    a, f = L.attention[L.attention_table[layer]], L.ffn[L.ffn_table[layer]]
    out = [
        f"layer {layer} of {layers} ({L.model} on {L.topology}): attention {a.name!r} "
        f"({a.type}), ffn {f.name!r} ({f.type})",
        f"  layer tables: attention kind {L.attention_table[layer]}, slot "
        f"{L.attention_slot[layer]}; ffn kind {L.ffn_table[layer]}, slot {L.ffn_slot[layer]}",
    ]
    bank_rows = L.stream.bank_rows
    for section, kind, first in (
        ("attention", a, L.stream.attention_rows[layer]),
        ("ffn", f, L.stream.ffn_rows[layer]),
    ):
        out.append(f"  {section} stream: first row {first} (bank {first // bank_rows})")
        for seg in kind.segments:
            lo, hi = seg.bank_span(first, bank_rows)
            out.append(
                f"    {seg.name:<12} rows {first + seg.offset}-{first + seg.offset + seg.rows - 1}"
                f" (banks {lo}-{hi}), [{seg.fan_in} x {seg.fan_out}]"
            )
        entry = first // bank_rows
        out.append(
            f"    in flight on entry (ring of {depth}): {_summarise(owner, entry, entry + depth - 1)}"
        )
    out += _cache_lines(a, L.attention_slot[layer])
    for main in (f"_attention_{a.name}", f"_ffn_{f.name}"):
        fn = fns.get(main)
        if fn is None:
            out.append(f"  {main}: not found in {build.kernel_path}")
            continue
        kind_name = main.split("_", 2)[2]
        helpers = _helpers_of(kind_name, fns, main, [k.name for k in _kinds(L)])
        out.append("")
        out.append(
            f"{main} (lines {fn.lines})"
            + (": calls " + ", ".join(f"{h.name} {h.lines}" for h in helpers) if helpers else "")
        )
        src = build.source.splitlines()
        out += [f"{n:5d}  {src[n - 1]}" for n in range(fn.first, fn.last + 1)]
    return "\n".join(out)
