"""The schedule: one decode step as the linear program every core runs.

Every core runs the same program over its own shard (SPMD), so one linear order
describes them all. It is a list of events over nodes:

- ``START d`` / ``WAIT d`` of a DMA node ``d`` (a weight bank, a layer's vector slab,
  a cache block or KV tile, recurrent states, expert ids, an expert piece, a
  collective): its issue point and its wait point; the node carries its destination
  resource and slot, its semaphores, its bytes and how many DMAs it groups (a cache
  block of 2 x B x G copies, a collective's D - 1 sends and receives, an int4 piece's
  codes and scales), each DMA with its own semaphore;
- ``RUN c`` of a compute node (a matmul on one bank or piece, a norm, a KV tile of
  attention, routing, a sequence's delta rule, a collective's sum), with its flops.

Every node lists what it reads: ``(producer, resource, slot)``, the resource ``None``
for values. The policies are the kernel's (templates/megakernel.py.j2: GQA, Gated
DeltaNet, KDA, dense, MoE) and, for what it does not render yet (MLA), the ones its
design implies (docs/planner.md):

- ring: banks 0..depth-1 start with the kernel; bank g lives in slot g % depth (a bank
  in slot 0 also copies its first CHUNK rows past the last slot, for a chunk that wraps
  the ring) and is waited by the first chunk that reaches into it (a chunk may straddle
  two banks and read both); once that chunk is used, bank g - 1 is used up and bank
  g - 1 + depth starts into its slot, whatever layer (or the lm_head) it belongs to,
  unless it is among the last ``held_refills`` such refills: those wait for a collective
  round, whose copies once started (before the round is waited) start the oldest
  ``refills_per_round`` of them, to stream while it travels. The
  schedule runs a bank's chunks as one node and starts the refill after it (the kernel
  starts it after the first chunk: earlier, into another slot);
- vector slabs: slab l in slot l % 2, waited at the top of layer l, slab l + 1 started
  right after;
- KV tiles: per (sequence, kv head) pair, tiles double buffered (tile t in buffer
  t % 2; t + 1 started once t is waited); the new rows are written back first (block
  read, merge, block write, each waited) so the tiles read them;
- recurrent state (Gated DeltaNet, KDA): the current conv tails and states of every
  sequence read at once after the input projection, the rows run in order, the snapshot
  after each row written back;
- experts: after routing the ids go to SMEM and the core lists its chosen experts; their
  slices stream as pieces through S slots: piece q in slot q % S, the first S started at
  once, piece q + S right after piece q is used, across expert boundaries;
- collectives: the k-th collective of a layer lands in gather buffer k (attention 0, the
  FFN's 1..3); its stages (mkgen.plan.collectives) send sum(size - 1) remote DMAs to the
  members of the core's groups, each with its own semaphore, then sum (or concatenate);
  work that does not need the result (a latent MoE's shared experts) may run between the
  first round's start and its wait, while the copies travel.

Runtime loops whose iterations use the same buffers are not unrolled in full: a loop
whose body starts and waits all its own DMAs (the (sequence, kv head) pairs of
attention) is kept once with ``repeat`` = its trip count; a double-buffered loop (KV
tiles) keeps four iterations, the third standing for the steady state (``repeat`` =
n - 3); the expert loop keeps whole periods of its slot pattern (mkgen.kinds.moe.expert_iterations).
The buffer pattern of every iteration is still checked, bytes are counted per step,
and the node count barely grows with batch or context. Banks and vector slabs are
never folded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict

from mkgen.plan.collectives import CollectiveRound, RoundCall, collective_buffers, ffn_out_buffer
from mkgen.plan.kind import KindRegistry, Step
from mkgen.plan.layout import draft_hidden_states, row_block
from mkgen.plan.options import BuildOptions
from mkgen.plan.sharding import AttentionSharding, Collective, FFNSharding, ShardingPlan
from mkgen.plan.stream import KindStream, RingRefills, Segment, StreamPlan, bank_visits
from mkgen.plan.vmem import VmemPlan
from mkgen.spec.schema import (
    ModelSpec,
)

START, WAIT, RUN = 0, 1, 2
EVENT_NAMES = ("start", "wait", "run")
INIT = -1  # the content a buffer slot holds when the step begins (caches, inputs)
UNROLL = 4  # iterations kept of a double-buffered runtime loop

Read = tuple[int, str | None, int]  # (producer node, resource or None for a value, slot)


class Node:
    """One DMA (group) or compute op of the step."""

    __slots__ = (
        "id",
        "op",
        "cat",
        "name",
        "layer",
        "resource",
        "slot",
        "sems",
        "count",
        "nbytes",
        "flops",
        "repeat",
        "reads",
        "key",
        "collective",
    )

    def __init__(
        self,
        id: int,
        op: str,
        cat: str,
        name: str,
        layer: int,
        resource: str | None = None,
        slot: int = 0,
        sems: tuple[str, ...] = (),
        count: int = 1,
        nbytes: int = 0,
        flops: int = 0,
        repeat: int = 1,
        reads: tuple[Read, ...] = (),
        key: tuple | None = None,
        collective: RoundCall | None = None,
    ) -> None:
        self.id = id
        self.op = op  # "dma" or "compute"
        self.cat = cat
        self.name = name
        self.layer = layer  # -1: before the layers; L: after them
        # DMA: its destination; compute: the VMEM slot it writes (None: values only).
        self.resource = resource
        self.slot = slot
        self.sems = sems
        self.count = count  # DMAs this node groups (each with its own semaphore)
        self.nbytes = nbytes  # bytes moved by the whole group, once
        self.flops = flops
        self.repeat = repeat  # times the node runs per step (folded runtime loops)
        self.reads = reads
        # weight DMAs: ("bank", g), ("vector", l), ("expert", l, i, piece); stream matmuls:
        # ("matmul", format, k_chunks, col_blocks, chunks, chunks read) (mkgen.plan.opcount)
        self.key = key
        # A collective round's copies (DMA) or its combine (compute): what it moves.
        self.collective = collective

    @property
    def is_dma(self) -> bool:
        return self.op == "dma"

    def copy(self) -> Node:
        return Node(*(getattr(self, s) for s in self.__slots__))

    def describe(self) -> str:
        where = f"{self.resource}[{self.slot}]" if self.resource else "-"
        sems = ""
        if self.sems:
            sems = self.sems[0] + (f"+{len(self.sems) - 1}" if len(self.sems) > 1 else "")
        reads = ",".join(str(p) for p, _, _ in self.reads)
        size = f"{self.nbytes}B x{self.count}" if self.is_dma else f"{self.flops} flop"
        rep = f" rep {self.repeat}" if self.repeat != 1 else ""
        return (
            f"{self.id:>6} {self.op:<7} {self.cat:<11} {self.name:<44} {where:<22} "
            f"{sems:<24} {size}{rep} <- [{reads}]"
        )


class ScheduleSummary(BaseModel):
    """What the schedule amounts to per core per step."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    events: int
    nodes: int
    dma_nodes: int
    compute_nodes: int
    dmas_per_step: int  # DMAs issued per step (groups and folded loops expanded)
    dmas_by_category: dict[str, int]
    bytes_by_category: dict[str, int]  # HBM / ICI bytes moved per step
    flops_per_step: int
    ring_depth: int
    held_refills: int  # ring refills held back until a collective round's copies start
    refills_per_round: int  # held refills each round's copies start, oldest first
    bank_bytes: int
    banks: int
    expert_slots: int
    max_dmas_in_flight: int
    max_bytes_in_flight: int
    # Layer kind -> its stream segments in program order (the rendered kernel must agree).
    segment_order: dict[str, list[str]]

    def describe(self) -> str:
        moved = ", ".join(
            f"{k} {self.dmas_by_category[k]} DMAs / {v / 2**20:.1f} MiB"
            for k, v in self.bytes_by_category.items()
        )
        slots = f", {self.expert_slots} expert slots" if self.expert_slots else ""
        held = (
            f" ({self.held_refills} refills held for collectives, {self.refills_per_round} "
            "started a round)"
            if self.held_refills
            else ""
        )
        return (
            f"schedule: {self.events} events over {self.nodes} nodes; ring {self.ring_depth} x "
            f"{self.bank_bytes / 2**20:.1f} MiB{held}, {self.banks} banks per step{slots}; "
            f"{self.dmas_per_step} DMAs per step ({moved}); at most {self.max_dmas_in_flight} "
            f"DMAs / {self.max_bytes_in_flight / 2**20:.1f} MiB in flight"
        )


class Schedule:
    """The step's nodes and the linear order of their events (shared by every core)."""

    def __init__(
        self,
        nodes: list[Node],
        events: list[tuple[int, int]],
        *,
        resources: dict[str, int],
        ring_depth: int,
        held_refills: int,
        refills_per_round: int,
        total_banks: int,
        bank_bytes: int,
        expert_slots: int,
        layers: int,
        experts_per_layer: dict[int, tuple[int, int]],
        stream_bytes: int,
        segment_order: dict[str, list[str]],
        layer_kinds: list[str],
        refills: dict[str, int],
        named_layers: dict[int, str] | None = None,
    ) -> None:
        self.nodes = nodes
        self.events = events
        self.resources = resources  # VMEM resource -> slots (from the VMEM plan)
        self.ring_depth = ring_depth
        self.held_refills = held_refills
        self.refills_per_round = refills_per_round
        self.total_banks = total_banks
        self.bank_bytes = bank_bytes
        self.expert_slots = expert_slots
        self.layers = layers
        # MoE layer -> (expert slices it fetches, pieces per slice)
        self.experts_per_layer = experts_per_layer
        self.stream_bytes = stream_bytes
        # Layer kind -> its stream segments in the order the program consumes them (what
        # the rendered kernel is held to: mkgen.codegen.conformance).
        self.segment_order = segment_order
        self.layer_kinds = layer_kinds  # "attention/ffn" kind names of every layer
        self.refills = refills  # how the ring's refills went (_Builder.refills)
        # Layers the program lists under a name of their own: a fused drafter's passes
        self.named_layers = named_layers or {}

    def copy(self) -> Schedule:
        """A deep copy (tests break copies to prove the checks fail)."""
        return Schedule(
            [n.copy() for n in self.nodes],
            list(self.events),
            resources=dict(self.resources),
            ring_depth=self.ring_depth,
            held_refills=self.held_refills,
            refills_per_round=self.refills_per_round,
            total_banks=self.total_banks,
            bank_bytes=self.bank_bytes,
            expert_slots=self.expert_slots,
            layers=self.layers,
            experts_per_layer=dict(self.experts_per_layer),
            stream_bytes=self.stream_bytes,
            segment_order={k: list(v) for k, v in self.segment_order.items()},
            layer_kinds=list(self.layer_kinds),
            refills=dict(self.refills),
            named_layers=dict(self.named_layers),
        )

    def find(self, name: str) -> Node:
        """The first node whose name is ``name`` (tests and debugging)."""
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def positions(self) -> tuple[list[int], list[int]]:
        """(issue or run position, wait position) of every node; -1 where absent."""
        first = [-1] * len(self.nodes)
        wait = [-1] * len(self.nodes)
        for i, (op, n) in enumerate(self.events):
            if op == WAIT:
                wait[n] = i
            elif first[n] < 0:
                first[n] = i
        return first, wait

    def summary(self) -> ScheduleSummary:
        dmas: dict[str, int] = {}
        moved: dict[str, int] = {}
        flops = 0
        n_dma = 0
        for n in self.nodes:
            if n.is_dma:
                n_dma += 1
                dmas[n.cat] = dmas.get(n.cat, 0) + n.count * n.repeat
                moved[n.cat] = moved.get(n.cat, 0) + n.nbytes * n.repeat
            else:
                flops += n.flops * n.repeat
        in_flight = in_bytes = peak = peak_bytes = 0
        nodes = self.nodes
        for op, i in self.events:
            if op == START:
                in_flight += nodes[i].count
                in_bytes += nodes[i].nbytes
                peak, peak_bytes = max(peak, in_flight), max(peak_bytes, in_bytes)
            elif op == WAIT:
                in_flight -= nodes[i].count
                in_bytes -= nodes[i].nbytes
        return ScheduleSummary(
            events=len(self.events),
            nodes=len(self.nodes),
            dma_nodes=n_dma,
            compute_nodes=len(self.nodes) - n_dma,
            dmas_per_step=sum(dmas.values()),
            dmas_by_category=dmas,
            bytes_by_category=moved,
            flops_per_step=flops,
            ring_depth=self.ring_depth,
            held_refills=self.held_refills,
            refills_per_round=self.refills_per_round,
            bank_bytes=self.bank_bytes,
            banks=self.total_banks,
            expert_slots=self.expert_slots,
            max_dmas_in_flight=peak,
            max_bytes_in_flight=peak_bytes,
            segment_order=self.segment_order,
        )

    def program(self) -> dict[str, list[dict]]:
        """The op list of each layer kind (its first layer), the prologue and the epilogue
        (and a fused drafter's first and chained pass), in program order: every start,
        wait and run with the resources it touches."""
        names = {-1: "prologue", self.layers: "epilogue", **self.named_layers}
        seen: dict[str, int] = {}  # program name -> the layer that stands for it
        out: dict[str, list[dict]] = {}
        layer = -1  # the layer whose ops run now: a DMA belongs where it is issued or waited
        for op, i in self.events:
            node = self.nodes[i]
            if op == RUN:
                layer = node.layer
            name = names.get(layer) or self.layer_kinds[layer]
            if seen.setdefault(name, layer) != layer:
                continue
            entry = {
                "event": EVENT_NAMES[op],
                "category": node.cat,
                "op": node.name.removeprefix(f"L{node.layer} "),
            }
            if node.resource is not None:
                entry["resource"], entry["slot"] = node.resource, node.slot
            if op == START:
                entry["bytes"], entry["dmas"] = node.nbytes, node.count
                entry["semaphores"] = list(node.sems)
                if node.collective is not None:  # what collective_time_us prices
                    entry["collective"] = node.collective.model_dump()
            if node.repeat != 1:
                entry["repeat"] = node.repeat
            out.setdefault(name, []).append(entry)
        return out

    def dma_table(self) -> list[dict]:
        """Every DMA with its issue point, slot, semaphores and wait point (plan.json)."""
        first, wait = self.positions()
        return [
            {
                "id": n.id,
                "name": n.name,
                "category": n.cat,
                "layer": n.layer,
                "issue": first[n.id],
                "wait": wait[n.id],
                "resource": n.resource,
                "slot": n.slot,
                "semaphores": list(n.sems),
                "dmas": n.count,
                "bytes": n.nbytes,
                "repeat": n.repeat,
            }
            for n in self.nodes
            if n.is_dma
        ]

    def describe(self, limit: int | None = None) -> str:
        """One line per event: position, start/wait/run and the node."""
        lines = []
        for i, (op, n) in enumerate(self.events[:limit]):
            lines.append(f"{i:>7} {EVENT_NAMES[op]:<5} {self.nodes[n].describe()}")
        if limit is not None and len(self.events) > limit:
            lines.append(f"... {len(self.events) - limit} more events")
        return "\n".join(lines)


# =========================================================================== building


def _round_sems(
    send: str, recv: str, buffer: int | tuple[int, int], r: CollectiveRound
) -> tuple[str, ...]:
    """A round's semaphores from core 0's view: a send and a receive semaphore for each
    other member's slot (`buffer`: the collective buffer, or greedy's send and receive rows)."""
    sb, rb = buffer if isinstance(buffer, tuple) else (buffer, buffer)
    slots = range(r.offset + 1, r.offset + r.size)
    return tuple(f"{send}[{sb},{k}]" for k in slots) + tuple(f"{recv}[{rb},{k}]" for k in slots)


class _Builder:
    """Emits the step's program: prologue, every layer, the lm_head and sampling."""

    def __init__(
        self,
        spec: ModelSpec,
        sharding: ShardingPlan,
        stream: StreamPlan,
        vmem: VmemPlan,
        options: BuildOptions,
        kinds: KindRegistry,
    ) -> None:
        self.spec = spec
        self.kinds = kinds
        self.sh = sharding
        self.stream = stream
        self.vmem = vmem
        self.dims = vmem.dims
        self.o = options
        self.nodes: list[Node] = []
        self.events: list[tuple[int, int]] = []
        self.repeat = 1
        self.depth = stream.ring_depth
        self.held_refills = stream.held_refills
        self.refills_per_round = stream.refills_per_round
        self.ring = RingRefills(self.depth, stream.held_refills, stream.refills_per_round)
        # How the ring's refills went (the compiled profile counts its guards by them):
        # banks reached, refills started there, collective rounds releasing the held ones
        # and the refills they started (also those past the last bank, which start nothing).
        self.refills = dict.fromkeys(
            ("reached", "started on reaching", "releases", "started by releases"), 0
        )
        self.total = stream.total_banks
        self.d = sharding.devices
        self.t = options.tokens
        self.draft_hidden = draft_hidden_states(spec, options.rows)  # the drafter's reads
        self.buffers: dict[str, int] = {}  # the landing buffer of each collective of the layer
        self.res = INIT  # the node that last wrote the residual stream
        self.experts_per_layer: dict[int, tuple[int, int]] = {}
        self.segment_order: dict[str, list[str]] = {}
        self.segment_layer: dict[str, int] = {}  # the layer that records a kind's order
        # Semaphore names of a DMA group, built once per array shape and shared.
        self.sem_cache: dict[tuple[str, tuple[int, ...]], tuple[str, ...]] = {}
        # Core 0's view (position 0 in every group): a round sends to members 1.. and
        # receives from them, each copy on its own slot's semaphore.
        rounds = vmem.dims.collectives.rounds
        self.coll_sems = {
            (w, r.name): _round_sems("send_sems", "recv_sems", w, r)
            for w in range(vmem.dims.collective_buffers)
            for r in rounds
        }
        self.greedy_sems = {
            r.name: _round_sems("greedy_sems", "greedy_sems", (0, 1), r) for r in rounds
        }
        self.banks = self._bank_nodes()
        seen: dict[str, int] = {}
        self.cache_slots = []
        for attn, _ in sharding.layer_table:
            self.cache_slots.append(seen.get(attn, 0))
            seen[attn] = seen.get(attn, 0) + 1

    # --- primitives ---
    def dma(self, cat: str, name: str, layer: int, resource: str | None, slot: int,
            sems: tuple[str, ...], nbytes: int, count: int = 1, reads: tuple = (),
            key: tuple | None = None, repeat: int | None = None) -> int:  # fmt: skip
        """A DMA node (not started): positional construction, ~30k of them per step."""
        n = len(self.nodes)
        self.nodes.append(
            Node(
                n,
                "dma",
                cat,
                name,
                layer,
                resource,
                slot,
                sems,
                count,
                nbytes,
                0,
                self.repeat if repeat is None else repeat,
                reads,
                key,
            )  # fmt: skip
        )
        return n

    def start(self, n: int) -> None:
        self.events.append((START, n))

    def wait(self, n: int) -> None:
        self.events.append((WAIT, n))

    def run(self, cat: str, name: str, layer: int, flops: int = 0, reads: tuple = (),
            writes: tuple[str, int] | None = None, key: tuple | None = None) -> int:  # fmt: skip
        res, slot = writes if writes else (None, 0)
        n = len(self.nodes)
        self.nodes.append(
            Node(
                n,
                "compute",
                cat,
                name,
                layer,
                res,
                slot,
                (),
                1,
                0,
                flops,
                self.repeat,
                tuple(reads),
                key,
            )  # fmt: skip
        )
        self.events.append((RUN, n))
        return n

    def folded(self, count: int, body: Callable[[], None]) -> None:
        """A runtime loop whose body starts and waits its own DMAs: kept once, x count."""
        outer = self.repeat
        self.repeat = outer * count
        body()
        self.repeat = outer

    def loop(self, n: int, body: Callable[[int, bool, Callable[[int], int]], None]) -> None:
        """A double-buffered runtime loop of ``n`` iterations (see the module docstring).

        ``body(i, last, rep)``: iteration i of the kept ones; ``rep(j)`` is the repeat of
        kept iteration j (for DMAs issued one iteration ahead).
        """
        reps = [1] * n if n <= UNROLL else [1, 1, n - 3, 1]
        outer = self.repeat

        def rep(j: int) -> int:
            return outer * reps[j]

        for i in range(len(reps)):
            self.repeat = rep(i)
            body(i, i == len(reps) - 1, rep)
        self.repeat = outer

    # --- the weight ring ---
    def _bank_nodes(self) -> list[int]:
        bank_rows = self.stream.bank_rows
        owners: list[list[str]] = [[] for _ in range(self.total)]

        def own(first: int, seg: Segment, name: str) -> None:
            lo, hi = seg.bank_span(first, bank_rows)
            for g in range(lo, hi + 1):
                owners[g].append(name)

        for layer, (attn, ffn) in enumerate(self.sh.layer_table):
            for first, kind in (
                (self.stream.attention_rows[layer], self.stream.attention[attn]),
                (self.stream.ffn_rows[layer], self.stream.ffn[ffn]),
            ):
                for seg in kind.segments:
                    own(first, seg, f"L{layer} {kind.kind}.{seg.name}")
        for seg in self.stream.tail:
            own(self.stream.lm_head_row, seg, seg.name)
        ids = []
        for g in range(self.total):
            slot = g % self.depth
            # A bank in slot 0 also lands its first CHUNK rows past the last slot (the
            # wrap, on its own semaphore): a second copy of bytes the bank brings.
            wrap = (f"ring_sems[{self.depth}]",) if slot == 0 else ()
            ids.append(
                self.dma(
                    "bank",
                    f"bank {g} ({', '.join(owners[g])})",
                    -1,
                    "ring",
                    slot,
                    (f"ring_sems[{slot}]", *wrap),
                    self.stream.bank_bytes,
                    count=1 + len(wrap),
                    key=("bank", g),
                )  # fmt: skip
            )
        return ids

    def segment(self, layer: int, label: str, seg: Segment, first: int, x: int) -> int:
        """x @ a stream segment, bank by bank as its chunks reach into them; returns its
        last op."""
        order = self.segment_order.setdefault(label, [])
        if self.segment_layer.setdefault(label, layer) == layer:
            order.append(seg.name)
        prev = x
        for visit in bank_visits(seg, first + seg.offset, self.stream.bank_rows):
            if visit.bank is not None:
                self.wait(self.banks[visit.bank])
            reads = tuple((self.banks[g], "ring", g % self.depth) for g in visit.banks)
            where = f"bank {visit.bank}" if visit.bank is not None else f"bank {visit.banks[0]}"
            prev = self.run(
                "matmul", f"L{layer} {label}.{seg.name} {where}", layer,
                2 * self.t * visit.macs, (*reads, (prev, None, 0)),
                key=("matmul", seg.format, seg.k_chunks, seg.col_blocks, seg.chunks, visit.chunks),
            )  # fmt: skip
            # Reaching bank g means bank g - 1 is used up: its slot takes g - 1 + depth,
            # once it is not among the last `held_refills` (held for a collective round).
            if visit.bank:
                self.refills["reached"] += 1
                started = self.ring.reach(visit.bank)
                if started is not None:
                    self.refills["started on reaching"] += 1
                    self.refill(started)
        return prev

    def refill(self, bank: int) -> None:
        if bank < self.total:  # past the lm_head's last bank the ring has nothing to fetch
            self.start(self.banks[bank])

    def release_held(self) -> None:
        """A collective round's copies are under way: the oldest held refills stream while
        they travel."""
        released = self.ring.release()
        self.refills["releases"] += 1
        self.refills["started by releases"] += len(released)
        for bank in released:
            self.refill(bank)

    # --- collectives ---
    def collective(
        self,
        layer: int,
        c: Collective | None,
        src: int,
        in_flight: Callable[[], None] | None = None,
    ) -> int:
        """Per round: this core's piece into its slot of gather buffer k, one remote copy
        to every other member of its group, the group's pieces combined in member order.
        `in_flight` emits work that does not need the result: the core runs it while the
        first round's copies travel (at once where nothing travels)."""
        if c is None or self.d == 1:
            if in_flight is not None:
                in_flight()
            return src
        # The buffer is the kernel's (collective_buffers): a peer cannot still be reading
        # it when it is written again (it needed this core's contributions to the
        # collectives in between first).
        w = self.buffers[c.name]
        x = self.run("collective", f"L{layer} {c.name}: rows -> gather[{w}]", layer, 0,
                     ((src, None, 0),), writes=("gather", w))  # fmt: skip
        for call in c.rounds:
            copies = call.members - 1
            d = self.dma("collective", f"L{layer} {c.op} {c.name} {call.round} round", layer,
                         "gather", w, self.coll_sems[w, call.round], copies * call.bytes_per_peer,
                         count=2 * copies, reads=((x, "gather", w),))  # fmt: skip
            self.nodes[d].collective = call
            self.start(d)
            self.release_held()
            if in_flight is not None and call.index == 0:
                in_flight()
            self.wait(d)
            last = call.index == call.rounds - 1
            what = "concatenate" if call.phase == "all_gather" else "sum"
            x = self.run("collective", f"L{layer} {c.name}: {what} ({call.round})", layer,
                         call.members * call.rows * call.columns, ((d, "gather", w),),
                         writes=None if last else ("gather", w))  # fmt: skip
            self.nodes[x].collective = call
        return x

    def vec(self, layer: int, name: str, x: int, flops: int, extra: tuple = ()) -> int:
        return self.run("vector", f"L{layer} {name}", layer, flops,
                        ((x, None, 0), *extra))  # fmt: skip

    # --- the step ---
    def build(self) -> Schedule:
        dims, layers = self.dims, len(self.sh.layer_table)
        # The input rows copied from HBM straight into the residual stream, on the second
        # vector semaphore (its first copy starts in layer 0, after this one is waited),
        # the ring's first banks and layer 0's vectors: copies into the core's own VMEM,
        # started before the barrier (which waits for the remote cores only).
        x_in = self.dma("vector", "x rows -> residual", -1, None, 0, ("vec_sems[1]",),
                        dims.tokens_padded * dims.hidden * 4, reads=((INIT, "hbm:x", 0),))  # fmt: skip
        self.start(x_in)
        for g in range(min(self.depth, self.total)):
            self.start(self.banks[g])
        slab = dims.vector_rows * dims.vector_width * 4
        vec = [
            self.dma(
                "vector",
                f"vectors of layer {layer}",
                layer,
                "vectors",
                layer % 2,
                (f"vec_sems[{layer % 2}]",),
                slab,
                key=("vector", layer),
            )  # fmt: skip
            for layer in range(layers)
        ]
        self.start(vec[0])
        self.run("sync", "barrier: every core inside the kernel", -1)
        self.wait(x_in)
        self.res = x_in
        ffn_out = ffn_out_buffer(self.sh)
        for layer, (attn, ffn) in enumerate(self.sh.layer_table):
            in_pass = self.pass_entry(layer, layers)
            self.buffers = collective_buffers(
                self.sh.attention[attn].collectives, self.sh.ffn[ffn].collectives, ffn_out
            )
            self.wait(vec[layer])
            if layer + 1 < layers:
                self.start(vec[layer + 1])
            v = self.run("vector", f"L{layer} load vectors", layer, 0,
                         ((vec[layer], "vectors", layer % 2),))  # fmt: skip
            if not in_pass:  # a drafter's pass mixes no attention-residual snapshots
                self.residual_block(layer)
            out = self.attention(layer, attn, v)
            self.res = self.vec(layer, "residual += attention", self.res, self.t * dims.hidden,
                                ((out, None, 0),))  # fmt: skip
            out = self.ffn(layer, ffn, v)
            self.res = self.vec(layer, "residual += ffn", self.res, self.t * dims.hidden,
                                ((out, None, 0),))  # fmt: skip
            if any(d.layer == layer and not d.normed for d in self.draft_hidden):
                self.vec(layer, "residual -> draft hidden", self.res, self.t * dims.hidden)
            if in_pass:
                self.draft_head(layer)
        if self.sh.draft_passes is None:
            self.head(layers, self.stream.lm_head_row, "lm_head")
        self.draft_hidden_out(layers)
        resources = dict(self.vmem.resources)
        return Schedule(
            self.nodes,
            self.events,
            resources=resources,
            ring_depth=self.depth,
            held_refills=self.held_refills,
            refills_per_round=self.refills_per_round,
            total_banks=self.total,
            bank_bytes=self.stream.bank_bytes,
            expert_slots=self.vmem.expert_slots,
            layers=layers,
            experts_per_layer=self.experts_per_layer,
            stream_bytes=self.stream.bytes_per_step,
            segment_order=self.segment_order,
            layer_kinds=[f"{a}/{f}" for a, f in self.sh.layer_table],
            named_layers=self.named_layers(),
            refills=self.refills,
        )

    def head(self, layer: int, row: int, label: str, norm: str = "final_norm_vmem") -> int:
        """The final norm (`norm`), the LM head's shard from stream row `row`, and the
        greedy token across the shards, in rounds; returns the token's node."""
        h = self.dims.hidden
        x = self.vec(layer, "final norm", self.res, 5 * self.t * h, ((INIT, norm, 0),))
        for seg in self.stream.tail:
            x = self.segment(layer, label, seg, row, x)
        vpc = self.dims.vocab_per_core
        g = self.run("vector", "soft-cap, argmax of the shard -> greedy", layer, 4 * self.t * vpc,
                     ((x, None, 0),), writes=("greedy", 0))  # fmt: skip
        # Every round's choice (none on one core, which has no rounds).
        coll = next(c for c in self.sh.step_collectives if c.name == "sampling")
        for call in coll.rounds:
            copies = call.members - 1
            x = self.dma("collective", f"all_gather sampling {call.round} round", layer,
                         "greedy", 0, self.greedy_sems[call.round], copies * call.bytes_per_peer,
                         count=2 * copies, reads=((g, "greedy", 0),))  # fmt: skip
            self.nodes[x].collective = call
            self.start(x)
            self.wait(x)
            g = self.run("vector", f"token: best of the {call.round} group in member order",
                         layer, 2 * call.members * self.t, ((x, "greedy", 0),),
                         writes=("greedy", 0))  # fmt: skip
        return g

    def named_layers(self) -> dict[int, str]:
        """A fused drafter's passes, as the program lists them: the first, then a chained one."""
        passes = self.sh.draft_passes
        if passes is None:
            return {}
        return {layer: "first draft pass" if layer == passes.first_layer else "chained draft pass"
                for layer in passes.layers}  # fmt: skip

    def residual_block(self, layer: int) -> None:
        """At an attention-residual block's start, the stream mixed with its snapshots."""
        r = self.spec.attention_residual
        if r is None or layer % r.block_size:
            return
        if self.vmem.snapshots_in_hbm:
            self.res = self.residual_snapshots_in_hbm(layer, r.block_size, r.max_snapshots)
        else:
            self.res = self.vec(layer, "attention-residual snapshot", self.res,
                                self.t * self.dims.hidden * r.max_snapshots * 2)  # fmt: skip

    # --- a fused drafter's passes (mkgen/plan/fused.py) ---
    def pass_entry(self, layer: int, layers: int) -> bool:
        """Whether `layer` is a drafter's pass; its input rows if so (after the verify
        rows' LM head and the accept rule, before the first)."""
        passes = self.sh.draft_passes
        if passes is None or layer not in passes.layers:
            return False
        if layer == passes.first_layer:
            self.head(layers, self.stream.lm_head_row, "lm_head")  # the verify rows'
            self.accept(layer)
        self.draft_entry(layer, layer - passes.first_layer)
        return True

    def accept(self, layer: int) -> None:
        """The greedy tokens copied to SMEM and each sequence's accepted rows counted there
        (a scalar loop over its rows)."""
        nbytes = self.dims.tokens_padded * 128 * 4
        copy = self.dma("vector", "greedy tokens -> SMEM", layer, None, 0, ("draft_sems[0]",),
                        nbytes, reads=((self.res, None, 0),))  # fmt: skip
        self.start(copy)
        self.wait(copy)
        self.run("sync", "accepted rows of each sequence (scalar)", layer, 0, ((copy, None, 0),))

    def draft_entry(self, layer: int, index: int) -> None:
        """A pass's input rows: each row's token embedding (one DMA a row from this core's
        vocabulary shard, the owner's row summed over the cores), it and the previous
        hidden state RMS-normed (enorm, hnorm) and concatenated, then eh_proj's columns of
        this core from the stream, gathered."""
        h, t = self.dims.hidden, self.t
        steps = {c.name: c for c in self.sh.step_collectives}
        self.buffers = {"embedding": 0, "eh_proj": ffn_out_buffer(self.sh)}
        gather = self.dma("vector", "token embeddings -> VMEM", layer, None, 0,
                          ("draft_sems[1]",), t * h * 2, count=t,
                          reads=((INIT, "hbm:embedding", 0),))  # fmt: skip
        self.start(gather)
        self.wait(gather)
        embedded = self.collective(layer, steps["embedding"], gather)
        if index:  # a chained pass: the previous pass's row that made each draft
            self.res = self.vec(layer, "previous output row of each sequence", self.res, t * h)
        x = self.vec(layer, "enorm, hnorm, concatenate", self.res, 10 * t * h,
                     ((embedded, None, 0),))  # fmt: skip
        draft = self.stream.draft
        assert draft is not None, "a fused drafter's stream holds its eh_proj"
        x = self.segment(layer, "eh_proj", draft.eh_proj, draft.eh_proj_rows[index], x)
        self.res = self.collective(layer, steps["eh_proj"], x)

    def draft_head(self, layer: int) -> None:
        """The pass's final norm and the LM head: each sequence's draft."""
        draft, passes = self.stream.draft, self.sh.draft_passes
        assert draft is not None and passes is not None, "a fused drafter's stream holds its heads"
        row = draft.head_rows[layer - passes.first_layer]
        g = self.head(layer, row, "lm_head", norm="draft_norms_vmem")
        self.run("sync", "the sequence's draft (scalar)", layer, 0, ((g, None, 0),))

    def draft_hidden_out(self, layers: int) -> None:
        """The hidden states the drafter reads: the last layer's final-normed again (the
        lm_head's norm is a value), then the output's copy to HBM after the body (Pallas
        writes a VMEM output back once the kernel ends), a small write."""
        if not self.draft_hidden:
            return
        h = self.dims.hidden
        x = self.res
        if any(d.normed for d in self.draft_hidden):
            x = self.vec(layers, "final norm -> draft hidden", self.res, 5 * self.t * h,
                         ((INIT, "final_norm_vmem", 0),))  # fmt: skip
        nbytes = len(self.draft_hidden) * self.dims.tokens_padded * h * 4
        out = self.dma("output", "draft hidden states -> HBM", layers, None, 0, (), nbytes,
                       reads=((x, None, 0),))  # fmt: skip
        self.start(out)
        self.wait(out)

    # --- the layer kinds (each kind's rule in the registry emits its ops) ---
    def attention(self, layer: int, name: str, v: int) -> int:
        return self.kind_ops(layer, name, v, "attn_norm", self.spec.attention_kinds[name],
                             self.sh.attention[name], self.stream.attention[name],
                             self.stream.attention_rows[layer])  # fmt: skip

    def ffn(self, layer: int, name: str, v: int) -> int:
        return self.kind_ops(layer, name, v, "ffn_norm", self.spec.ffn_kinds[name],
                             self.sh.ffn[name], self.stream.ffn[name],
                             self.stream.ffn_rows[layer])  # fmt: skip

    def kind_ops(
        self,
        layer: int,
        name: str,
        v: int,
        norm: str,
        kind: Any,
        shard: AttentionSharding | FFNSharding,
        stream: KindStream,
        stream_row: int,
    ) -> int:
        """The layer's `norm` of the residual (v: its vector slab's load), then the ops the
        rule of its attention or FFN kind `name` emits."""
        x = self.vec(layer, f"{name}: {norm}", self.res, 5 * self.t * self.dims.hidden,
                     ((v, None, 0),))  # fmt: skip
        return self.kinds.rules(kind.type, name).program(self, Step(
            layer=layer, name=name, kind=kind, shard=shard,
            segments={s.name: s for s in stream.segments}, stream_row=stream_row,
            collectives={c.name: c for c in shard.collectives}, vectors=v, x=x,
        ))  # fmt: skip

    # --- what the kinds' ops share ---
    def cache_slot(self, layer: int) -> int:
        """The layer's position among the layers of its attention kind (its cache slot)."""
        return self.cache_slots[layer]

    def residual_snapshots_in_hbm(self, layer: int, block_size: int, most: int) -> int:
        """A block's start with the snapshots in HBM (the kernel's _attention_residual_hbm):
        a row block of the landing buffer's rows at a time, the stream's rows scaled by
        their weight, then each earlier live snapshot's rows copied into the landing buffer
        and added, in order; then the mixed stream copied out as the block's snapshot."""
        block = layer // block_size
        hidden, padded = self.dims.hidden, self.dims.tokens_padded
        rows = row_block(padded)
        sems = ("snapshot_sems[0]",)
        mixed = self.res
        for first in range(0, padded if block else 0, rows):
            size = min(rows, padded - first)
            mixed = self.vec(layer, f"attention-residual rows {first}+ scaled", mixed,
                             size * hidden)  # fmt: skip
            for j in range(min(block, most - 1)):
                land = self.dma("snapshot", f"L{layer} attention-residual snapshot {j} rows "
                                f"{first}+ in", layer, "snapshot", 0, sems, size * hidden * 4)  # fmt: skip
                self.start(land)
                self.wait(land)
                mixed = self.vec(layer, f"attention-residual snapshot {j} rows {first}+ added",
                                 mixed, 2 * size * hidden, ((land, "snapshot", 0),))  # fmt: skip
        out = self.dma("snapshot", f"L{layer} attention-residual snapshot out", layer, None, 0,
                       sems, padded * hidden * 4, reads=((mixed, None, 0),))  # fmt: skip
        self.start(out)
        self.wait(out)
        return mixed

    def block_sems(self, name: str, shape: tuple[int, ...]) -> tuple[str, ...]:
        """The semaphores of a DMA group over an array of `shape`, one per copy."""
        key = (name, shape)
        cache = self.sem_cache
        if key not in cache:
            idx = [()]
            for n in shape:
                idx = [(*i, j) for i in idx for j in range(n)]
            cache[key] = tuple(f"{name}[{','.join(map(str, i))}]" for i in idx)
        return cache[key]

    def read_block(self, layer: int, name: str, sems: tuple[str, ...], nbytes: int) -> int:
        """Start reading the tile-aligned block around the new rows (write_block waits)."""
        hbm = f"hbm:{name}.cache"
        rd = self.dma("cache_read", f"L{layer} {name}: cache block read", layer, f"{name}.block",
                      0, sems, nbytes, count=len(sems),
                      reads=((INIT, hbm, self.cache_slot(layer)),))  # fmt: skip
        self.start(rd)
        return rd

    def write_block(self, layer: int, name: str, sems: tuple[str, ...], nbytes: int,
                    rd: int, new_rows: int) -> int:  # fmt: skip
        """Wait for the block read_block started (`rd`), merge the new rows, write it back."""
        cslot = self.cache_slot(layer)
        hbm = f"hbm:{name}.cache"
        self.wait(rd)
        m = self.run("vector", f"L{layer} {name}: merge new rows into the block", layer,
                     nbytes // 2, ((rd, f"{name}.block", 0), (new_rows, None, 0)),
                     writes=(f"{name}.block", 0))  # fmt: skip
        wr = self.dma("cache_write", f"L{layer} {name}: cache block write", layer, hbm, cslot,
                      sems, nbytes, count=len(sems), reads=((m, f"{name}.block", 0),))  # fmt: skip
        self.start(wr)
        self.wait(wr)
        return wr


def build_schedule(
    spec: ModelSpec,
    sharding: ShardingPlan,
    stream: StreamPlan,
    vmem: VmemPlan,
    options: BuildOptions,
    *,
    kinds: KindRegistry,
) -> Schedule:
    """The step's program for ``spec`` as sharded, streamed and allocated (spec with the
    options' quantization already applied), each layer kind's ops by its rule in `kinds`."""
    return _Builder(spec, sharding, stream, vmem, options, kinds).build()
