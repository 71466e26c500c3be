"""The cost model's walk: one decode step on one core, over the schedule's own program.

The plan's schedule (mkgen/plan/schedule.py) lists every START, WAIT and RUN of the step
in program order; the walk runs them on one core's engines (docs/cost-model.md):

- the core runs each RUN op for the time its ops take at the chip's issue rates (the
  op-count model, mkgen/plan/opcount.py: each op priced by the code path the template
  emits, at the slowest of its vector ALU, MXU and load/store units) and blocks at each
  WAIT until that DMA is done;
- the DMA engine moves one DMA at a time at the catalog's ``cost_model_hbm_bandwidth``
  plus a per-DMA overhead. DMAs wait in queues by kind, each first-in first-out, highest
  priority first: cache tiles and states, expert pieces, ring banks, collectives'
  remote copies. Whenever the engine is free it takes the oldest DMA of the
  highest-priority queue that has one started by then (a started DMA is not
  interrupted), except that a collective's copies go before every DMA the core issued
  after them (the ring's held refills: mkgen.plan.schedule);
- the interconnect carries each collective round's remote copies, once the engine has
  issued them, after the rounds before it, at the round's price
  (mkgen.plan.collectives.round_time_s: its phase latency or its copies' wire time).

One walk gives the overlap of DMA and compute and the step. A folded runtime loop's op
(``repeat`` > 1) is priced as its repeats back to back. Pure Python.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from mkgen.plan.collectives import round_time_s
from mkgen.plan.cost import CATEGORIES, US, CostConstants, Estimate, KindTime, TraceEvent
from mkgen.plan.graph import ScheduleCheckError
from mkgen.plan.kind import KindRegistry
from mkgen.plan.kvtiles import KvTileChoice
from mkgen.plan.memory import MemoryPlan
from mkgen.plan.opcount import OpCounts, bound_us, node_op_counts
from mkgen.plan.options import BuildOptions
from mkgen.plan.schedule import START, WAIT, Node, Schedule
from mkgen.plan.sharding import ShardingPlan
from mkgen.plan.stream import Segment, StreamPlan
from mkgen.plan.vmem import VmemPlan
from mkgen.spec.schema import ModelSpec
from mkgen.spec.topology import Topology


class ProgramPlan(NamedTuple):
    """The planner's stages up to the step's program: what the cost model walks."""

    spec: ModelSpec  # with the options' quantization applied
    sharding: ShardingPlan
    memory: MemoryPlan
    stream: StreamPlan
    vmem: VmemPlan
    schedule: Schedule
    kinds: KindRegistry  # the layer kinds' rules it was planned with
    # The same program with no refill held, when this one holds some (the calibrated
    # regime's program, mkgen/plan/confidence.py).
    unheld: ProgramPlan | None = None
    # How the planner chose the cache kinds' KV tiles (None: forced, or one candidate).
    kv_tiles: KvTileChoice | None = None
    # (expert format, CHUNK_OPS product) pairs pricing a format's chunks as another
    # product than the template's (mkgen.plan.opcount.node_op_counts): the calibration's.
    chunk_products: tuple[tuple[str, str], ...] = ()


# The DMA engine's queues, highest priority first, and the queue of each schedule DMA
# category. Cache tiles, states and the small per-layer loads are waited right after they
# start; expert pieces are waited within a few pieces; ring banks are fetched `depth`
# banks ahead. A collective's remote copies come last: the calibrated structural
# assumption (measurements.md: the Muse Spark step is the sum of its phases, the
# collectives do not hide under the weight stream) is that they leave the engine only
# once the HBM DMAs the core issued before them are done; DMAs issued after them wait.
QUEUES = ("cache", "experts", "ring", "collectives")
COLLECTIVES = QUEUES.index("collectives")
DMA_QUEUE = {
    "collective": "collectives",
    "bank": "ring",
    "expert": "experts",
    "ids": "cache",
    "vector": "cache",
    "kv_tile": "cache",
    "cache_read": "cache",
    "cache_write": "cache",
    "state_read": "cache",
    "state_write": "cache",
    "snapshot": "cache",
    "output": "cache",
}
# DMAs that move no HBM bytes: VMEM -> SMEM, and remote copies (ICI).
NOT_HBM = frozenset({"ids", "collective"})
# The breakdown category of the core's time running or waiting for a schedule category.
CATEGORY = {
    "bank": "weights",
    "vector_slab": "weights",
    "matmul": "weights",
    "expert": "experts",
    "ids": "experts",
    "expert_mm": "experts",
    "routing": "experts",
    "chosen": "experts",
    "scalar": "experts",
    "kv_tile": "kv_state",
    "cache_read": "kv_state",
    "cache_write": "kv_state",
    "state_read": "kv_state",
    "state_write": "kv_state",
    "attention": "kv_state",
    "recurrent": "kv_state",
    "collective": "collectives",
    "sync": "fixed",
    "vector": "compute",
    "snapshot": "compute",  # the attention-residual snapshots in HBM, copied in and out
    "output": "compute",  # an output beside logits and tokens written back to HBM
}


class _Walk:
    """One core's timeline over the schedule's events (see the module docstring).

    Per node it holds what the constants make of it: `seconds` the core's time of a RUN
    node, the DMA engine's time of a DMA node (a collective's: issuing its sends), and
    `flight` a collective's time on the interconnect."""

    def __init__(
        self,
        schedule: Schedule,
        priced: PricedProgram,
        seconds: list[float],
        flight: dict[int, float],
        trace: bool,
    ) -> None:
        self.s = schedule
        self.p = priced
        self.seconds = seconds
        self.flight = flight
        self.t = 0.0
        self.trace = trace
        self.events: list[TraceEvent] = []
        self.attr = dict.fromkeys(CATEGORIES, 0.0)
        n = len(schedule.nodes)
        self.issued_at = [0.0] * n
        self.order = [0] * n  # issue order (DMAs issued at one instant are still ordered)
        self.issued = 0
        self.done: list[float | None] = [None] * n
        self.queues: list[deque[int]] = [deque() for _ in QUEUES]  # the DMAs not yet served
        self.engine_free = 0.0
        self.ici_free = 0.0
        self.dma_busy = 0.0
        # The engine's services (start, end, category) in order, and the first one a wait
        # may still overlap.
        self.log: list[tuple[float, float, str]] = []
        self.logged = 0
        self.core_busy = 0.0
        self.hbm_bytes = 0
        # The core's waits on cross-host rounds' flights that no DMA covers.
        self.cross_host_wait = 0.0

    def where(self, layer: int) -> str:
        """The trace's prefix: prologue, L<layer>, epilogue."""
        if layer < 0:
            return "prologue"
        return "epilogue" if layer >= self.s.layers else f"L{layer}"

    def event(self, engine: str, node: Node, start: float, dur: float, args: dict) -> None:
        """Trace one op (callers trace every op of the program when self.trace, also those
        that take no time; the walk alone builds no arguments)."""
        layer, name = self.p.names[node.id]
        self.events.append(
            TraceEvent(
                engine=engine, name=f"{self.where(layer)} {name}", start=start,  # type: ignore[arg-type]
                duration=dur, category=self.p.category[node.id],
                args={**args, "node": node.id},
            )
        )  # fmt: skip

    def start(self, i: int) -> None:
        self.issued_at[i] = self.t
        self.order[i] = self.issued
        self.issued += 1
        self.queues[self.p.queue[i]].append(i)

    def serve_until(self, target: int) -> None:
        """Run the DMA engine until `target` is done: each time it is free it takes the
        first DMA of the highest-priority queue that has one issued by then."""
        queues, issued_at, order, done = self.queues, self.issued_at, self.order, self.done
        seconds, flight, log, priced = self.seconds, self.flight, self.log, self.p
        while done[target] is None:
            heads = [(q, queue[0]) for q, queue in enumerate(queues) if queue]
            if not heads:  # the checks refuse such a program; a forced one cannot be walked
                raise ScheduleCheckError(
                    f"the program waits for {self.s.nodes[target].name!r}, which it never starts"
                )
            at = max(self.engine_free, min([issued_at[i] for _, i in heads]))
            ready = [(q, i) for q, i in heads if issued_at[i] <= at]
            queue, i = ready[0]
            last_queue, last = ready[-1]
            # A collective's copies wait for the HBM DMAs issued before them, not for those
            # the core issues after them (the ring's held refills).
            if last_queue == COLLECTIVES and all(order[j] > order[last] for _, j in ready[:-1]):
                queue, i = last_queue, last
            queues[queue].popleft()
            dur = seconds[i]
            end = self.engine_free = at + dur
            if i in flight:  # the engine issues the sends; the copies travel on the ICI
                begin = max(end, self.ici_free)
                done[i] = self.ici_free = begin + flight[i]
                if self.trace:
                    node = self.s.nodes[i]
                    self.event("ici", node, begin, done[i] - begin, self._dma_args(node, queue))
            else:
                done[i] = end
            self.dma_busy += dur
            log.append((at, end, priced.category[i]))
            self.hbm_bytes += priced.hbm_bytes[i]
            if self.trace:
                self.event("dma", self.s.nodes[i], at, dur, self._dma_args(self.s.nodes[i], queue))

    def _dma_args(self, node: Node, queue: int) -> dict:
        """A traced DMA's arguments: what it moves, from which queue, and its bank or
        expert piece."""
        args = {"bytes": node.nbytes * node.repeat, "dmas": node.count * node.repeat,
                "queue": QUEUES[queue]}  # fmt: skip
        if node.cat == "bank":
            args["bank"] = node.key[1]
            args["tensors"] = self.p.tensors[node.key[1]]
        elif node.cat == "expert":  # numbered in load order: routing picks the ids
            args["expert"], args["piece"] = node.key[2], node.key[3]
        return args

    def drain(self) -> None:
        """Serve what is still queued (every DMA of the program is waited, so nothing
        is, unless the program ends on DMAs nobody waits for)."""
        for queue in self.queues:
            if queue:
                self.serve_until(queue[-1])

    def wait(self, i: int) -> None:
        """The core idles until node `i` is done: the time is credited to what the DMA
        engine moved meanwhile, the rest (the interconnect's flight) to `i`."""
        if self.done[i] is None:
            self.serve_until(i)
        t0, t1 = self.t, self.done[i]
        if t1 <= t0:
            return
        log, attr = self.log, self.attr
        while self.logged < len(log) and log[self.logged][1] <= t0:
            self.logged += 1
        covered = 0.0
        for start, end, category in log[self.logged :]:
            if start >= t1:
                break
            span = min(end, t1) - max(start, t0)
            if span > 0:
                attr[category] += span
                covered += span
        attr[self.p.category[i]] += t1 - t0 - covered
        if self.p.cross_host[i]:
            self.cross_host_wait += t1 - t0 - covered
        self.t = t1

    def run(self, i: int) -> None:
        seconds = self.seconds[i]
        if self.trace:
            node = self.s.nodes[i]
            self.event("core", node, self.t, seconds, {"repeat": node.repeat})
        self.attr[self.p.category[i]] += seconds
        self.core_busy += seconds
        self.t += seconds


def _bank_names(
    stream: StreamPlan, layer_table: list[tuple[str, str]]
) -> list[tuple[int, str, list[str]]]:
    """(the layer that uses it, its name, its segment's tensors) of each ring bank: the ring
    fetches ahead across layers, and a bank's DMA is named as its matmul on the core
    ("gqa.qkv bank 3"); the lm_head's layer is the number of layers (the epilogue)."""
    out: list[tuple[int, str, list[str]]] = [(0, "", [])] * stream.total_banks

    def name(layer: int, first: int, label: str, segments: list[Segment]) -> None:
        # A bank segments share is named by the first of them and holds all their tensors.
        for seg in segments:
            lo, hi = seg.bank_span(first, stream.bank_rows)
            tensors = [p.tensor for p in seg.parts]
            for g in range(lo, hi + 1):
                user, bank, held = out[g]
                if not bank:
                    user, bank = layer, f"{label}.{seg.name} bank {g}"
                out[g] = (user, bank, held + [t for t in tensors if t not in held])

    for layer, (attn, ffn) in enumerate(layer_table):
        name(layer, stream.attention_rows[layer], attn, stream.attention[attn].segments)
        name(layer, stream.ffn_rows[layer], ffn, stream.ffn[ffn].segments)
    name(len(layer_table), stream.lm_head_row, "lm_head", stream.tail)
    return out


class PricedProgram(NamedTuple):
    """What a walk needs of a program besides the constants: every node's op counts (the
    core's time follows from the issue rates) and what the DMA engine does for it, its
    trace name and breakdown category, and each ring bank's tensors. Priced once, walked at
    as many constants as asked for."""

    unpriced: tuple[str, ...]
    names: list[tuple[int, str]]
    category: list[str]
    tensors: list[list[str]]
    # Each node's index into `distinct`, the program's distinct op counts (a walk bounds
    # each once; nodes of one key share theirs: node_op_counts).
    counts_index: list[int]
    distinct: list[OpCounts]
    queue: list[int]  # a DMA node's queue (its index in QUEUES), -1 for a RUN node
    # What the DMA engine does for a DMA node, all its repeats: the bytes it moves and the
    # DMAs it issues (a collective round's: the sends, its copies travel on the ICI).
    moved: list[int]
    issued: list[float]
    hbm_bytes: list[int]  # the HBM bytes a DMA node moves (remote copies move none)
    cross_host: list[bool]  # a cross-host collective round's copies
    collectives: list[int]  # the collective rounds' copies (DMA nodes)
    syncs: list[int]  # the entry barrier


def price_program(program: ProgramPlan) -> PricedProgram:
    """The op counts, names and categories of `program`'s nodes (module docstring)."""
    schedule, stream = program.schedule, program.stream
    nodes, layers = schedule.nodes, schedule.layers
    ops, unpriced = node_op_counts(
        schedule, stream, program.vmem, program.sharding, program.spec, program.kinds,
        dict(program.chunk_products),
    )  # fmt: skip
    banks = _bank_names(stream, program.sharding.layer_table)
    names = [
        banks[node.key[1]][:2] if node.cat == "bank" else
        (node.layer, node.name.removeprefix(f"L{node.layer} "))
        for node in nodes
    ]  # fmt: skip
    category = [
        CATEGORY["vector_slab" if node.op == "dma" and node.cat == "vector" else node.cat]
        for node in nodes
    ]
    for i, (layer, _) in enumerate(names):
        if layer >= layers:
            category[i] = "lm_head" if category[i] == "weights" else "fixed"
        elif layer < 0:
            category[i] = "fixed"
    # Keyed by every field, so the key stays whole whatever bound_us reads.
    keys: dict[tuple[float, ...], int] = {}
    counts_index = [
        keys.setdefault((c.vpu, c.mxu, c.loads, c.stores, c.dmas, c.scalar), len(keys))
        for _, c in ops
    ]
    queue = [QUEUES.index(DMA_QUEUE[n.cat]) if n.op == "dma" else -1 for n in nodes]
    return PricedProgram(
        tuple(unpriced), names, category, [t for _, _, t in banks], counts_index,
        distinct=[OpCounts(*key) for key in keys],
        queue=queue,
        # (read for DMA nodes only: a collective's combine on the core is a RUN node)
        moved=[0 if n.cat == "collective" else n.nbytes * n.repeat for n in nodes],
        # A DMA node's op counts are the DMAs it issues once (node_op_counts: a collective
        # round's sends only).
        issued=[counts.dmas * n.repeat for (_, counts), n in zip(ops, nodes, strict=True)],
        hbm_bytes=[0 if n.cat in NOT_HBM else n.nbytes * n.repeat for n in nodes],
        cross_host=[n.collective is not None and n.collective.level == "host" for n in nodes],
        collectives=[i for i, q in enumerate(queue) if q == COLLECTIVES],
        syncs=[n.id for n in nodes if n.op != "dma" and n.cat == "sync"],
    )  # fmt: skip


class WalkInputs(NamedTuple):
    """What a walk reads of the constants: each node's seconds (the core's for a RUN node,
    the DMA engine's for a DMA node), each collective round's flight on the interconnect,
    and the host's dispatch at the step's start. Two constants with equal inputs walk
    alike (the sensitivity table walks once per distinct inputs)."""

    seconds: list[float]
    flight: dict[int, float]
    dispatch: float


def walk_inputs(
    topo: Topology, c: CostConstants, schedule: Schedule, priced: PricedProgram
) -> WalkInputs:
    """The walk's inputs at constants `c` (WalkInputs)."""
    rates = c.issue_rates
    bound = [
        0.0 if rates is None else max(bound_us(counts, rates).values()) * US
        for counts in priced.distinct
    ]
    bandwidth, per_dma = c.hbm_bandwidth, c.dma_overhead_s
    seconds = [
        nbytes / bandwidth + dmas * per_dma if queue >= 0 else bound[index] * node.repeat
        for node, index, queue, nbytes, dmas in zip(
            schedule.nodes, priced.counts_index, priced.queue, priced.moved, priced.issued,
            strict=True,
        )
    ]  # fmt: skip
    for i in priced.syncs:  # the entry barrier: one latency-bound phase
        seconds[i] = c.collective_phase_s if topo.num_devices > 1 else 0.0
    flight = {
        i: round_time_s(schedule.nodes[i].collective, c) * schedule.nodes[i].repeat
        for i in priced.collectives
    }
    # The host dispatches one device call per steps_per_call steps.
    return WalkInputs(seconds, flight, c.dispatch_s / c.steps_per_call)


def estimate(
    topo: Topology,
    options: BuildOptions,
    program: ProgramPlan,
    trace: bool = False,
    *,
    constants: CostConstants | None = None,
    priced: PricedProgram | None = None,
) -> Estimate:
    """Walk the program's events on one core and summarise the step (module docstring).

    `constants` replaces the catalog's (the sensitivity table walks one program at the ends
    of each unmeasured input); `priced` is `price_program(program)` when already done."""
    schedule = program.schedule
    c = constants or CostConstants.from_chip(topo.chip_info, options)
    priced = priced or price_program(program)
    inputs = walk_inputs(topo, c, schedule, priced)
    walk = _Walk(schedule, priced, inputs.seconds, inputs.flight, trace)
    walk.attr["fixed"] += inputs.dispatch
    walk.t = walk.engine_free = walk.ici_free = inputs.dispatch
    layer_start: dict[int, float] = {}
    layer = [node.layer for node in schedule.nodes]
    start, wait, run = walk.start, walk.wait, walk.run
    for op, i in schedule.events:
        if op == START:
            start(i)
        elif op == WAIT:
            wait(i)
        else:
            if layer[i] not in layer_start:
                layer_start[layer[i]] = walk.t
            run(i)
    walk.drain()
    result = Estimate(
        step_ms=walk.t * 1e3,
        dma_timeline_ms=walk.dma_busy * 1e3,
        compute_timeline_ms=None if c.issue_rates is None else walk.core_busy * 1e3,
        compute_unpriced_formats=priced.unpriced,
        breakdown_ms={k: v * 1e3 for k, v in walk.attr.items()},
        cross_host_wait_ms=walk.cross_host_wait * 1e3,
        by_layer_kind=_by_layer_kind(schedule, layer_start, walk.t),
        hbm_bytes_per_device_per_step=walk.hbm_bytes,
        hbm_floor_ms=walk.hbm_bytes / c.hbm_bandwidth * 1e3,
        tokens_per_s_per_user=0.0,
        tokens_per_s=0.0,
        tokens_per_dollar=None,
        chips=topo.num_chips,
        price_per_chip_hour_usd=c.price_per_chip_hour_usd,
        acceptance=options.acceptance,
        batch=options.batch,
        rows=options.rows,
        constants=c,
        events=tuple(walk.events),
    )
    return result.at_acceptance(options.acceptance)


def _by_layer_kind(
    schedule: Schedule, layer_start: dict[int, float], step: float
) -> dict[str, KindTime]:
    """Each layer kind's time: from its layers' first op to the next layer's."""
    per_kind: dict[str, float] = {}
    ends = [layer_start.get(layer, step) for layer in range(1, schedule.layers + 1)]
    for layer, kind in enumerate(schedule.layer_kinds):
        per_kind[kind] = per_kind.get(kind, 0.0) + ends[layer] - layer_start[layer]
    counts = {kind: schedule.layer_kinds.count(kind) for kind in per_kind}
    return {
        kind: KindTime(
            layers=counts[kind],
            total_ms=per_kind[kind] * 1e3,
            per_layer_us=per_kind[kind] / counts[kind] * 1e6,
        )
        for kind in per_kind
    }
