"""The step's dataflow graph and the checks that hold before any code is written.

``analyse(schedule, vmem)`` builds the dataflow graph over the schedule's nodes
(mkgen/plan/schedule.py): compute ops with their flops, DMAs (weight banks, vector
slabs, cache blocks and KV tiles, recurrent states, expert slices, collectives) with
their bytes. Edges:

- data: producer -> every node that reads what it wrote (a DMA's destination slot, a
  compute's output value or slot);
- buffer reuse: a write into a slot (a DMA's start, a compute's store) depends on every
  read of the slot's previous occupant, and on that occupant itself.

``StepGraph.graph`` is the networkx DiGraph of it (built on first use: the checks run
on the same edge lists, ten times faster than through networkx on a 100k-edge step;
acyclicity is immediate when every edge runs forward in the schedule's order, else
Kahn's algorithm decides and networkx names the cycle).
``analyse`` replays the schedule's linear order and computes the checks, each a named
boolean (``StepGraph.checks``) with the first offending node (``failures``):

- ``acyclic``: the graph has no cycle (some order can satisfy every dependence);
- ``reads_after_writes``: every read finds its producer's content in the slot it reads,
  already written (a compute has run; a DMA has been waited);
- ``dma_waited_once``: every DMA node is started exactly once and waited exactly once,
  after its start;
- ``no_slot_overwrite``: nothing writes a slot while a DMA into it is in flight or while
  its previous content still has reads to come;
- ``weights_fetched_once``: every stream bank is fetched exactly once per step, every
  layer's vector slab once, every piece of every expert slice the layer picks once (a
  folded expert loop counts its repeats), and the stream's bytes are the banks';
- ``vmem_within_budget``: the VMEM plan fits its budget and limit and every slot the
  schedule uses is allocated;
- ``semaphores_unshared``: no semaphore is used by two DMAs in flight at once, and every
  semaphore exists in the plan (a shared semaphore is a race);
- ``ops_run_once``: every compute op runs exactly once;
- ``deadlock_free``: the ring starts bank g + depth only once bank g is used (and, of
  the refills held for collectives, only once a collective round's copies start), so a
  program that waits for its banks out of stream order hangs at a shallow enough depth;
  every bank wait must find its bank started at the chosen depth and at every depth the
  planner or --ring-depth may pick (MIN_RING_DEPTH..MAX_RING_DEPTH);
- ``collectives_balanced``: across every core of the mesh, each one-shot round's groups
  partition the cores and every copy a core waits for on a slot's semaphore is one a
  member sends there, and the entry barrier's signals balance the same way
  (mkgen.plan.collectives.check_rounds). Every core runs the same program, so the
  rounds, reached by all in the same order with their sends started before their
  waits, cannot deadlock it.

``StepGraph.enforce()`` raises a one-line MkgenError naming the first failed check and
its node; plan_build calls it before anything is generated.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from mkgen.errors import MkgenError
from mkgen.plan.collectives import check_rounds
from mkgen.plan.options import MAX_RING_DEPTH, MIN_RING_DEPTH
from mkgen.plan.schedule import INIT, RUN, START, WAIT, Node, Schedule
from mkgen.plan.stream import RingRefills
from mkgen.plan.vmem import VmemPlan

if TYPE_CHECKING:
    import networkx as nx

CHECKS = (
    "acyclic",
    "reads_after_writes",
    "dma_waited_once",
    "no_slot_overwrite",
    "weights_fetched_once",
    "vmem_within_budget",
    "semaphores_unshared",
    "ops_run_once",
    "deadlock_free",
    "collectives_balanced",
)
_SEM = re.compile(r"^(\w+)\[([0-9,]+)\]$")


class ScheduleCheckError(MkgenError):
    """A schedule check failed: the plan must not be generated."""


class GraphSummary(BaseModel):
    """The graph's size and its checks (what a saved plan records)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    nodes: int
    edges: int
    data_edges: int
    reuse_edges: int
    checks: dict[str, bool]
    failures: dict[str, str]  # first offender of every failed check
    nodes_by_category: dict[str, int]

    @property
    def ok(self) -> bool:
        return all(self.checks.values())


class StepGraph:
    """The dataflow graph of one step, its schedule and the checks' results."""

    def __init__(
        self,
        schedule: Schedule,
        data_edges: set[tuple[int, int]],
        reuse_edges: set[tuple[int, int]],
        checks: dict[str, bool],
        failures: dict[str, str],
    ) -> None:
        self.schedule = schedule
        self.edges_data = data_edges
        self.edges_reuse = reuse_edges  # buffer reuse edges that are not also data edges
        self.checks = checks
        self.failures = failures
        self._graph: nx.DiGraph | None = None

    @property
    def data_edges(self) -> int:
        return len(self.edges_data)

    @property
    def reuse_edges(self) -> int:
        return len(self.edges_reuse)

    @property
    def graph(self) -> nx.DiGraph:
        """The step as a networkx DiGraph (built on first use; the checks ran on the same
        edges). Node i is ``schedule.nodes[i]``; edges carry ``kind`` "data" or "reuse"."""
        if self._graph is None:
            import networkx as nx

            graph = nx.DiGraph()
            graph.add_nodes_from(range(len(self.schedule.nodes)))
            graph.add_edges_from(self.edges_data, kind="data")
            graph.add_edges_from(self.edges_reuse, kind="reuse")
            self._graph = graph
        return self._graph

    @property
    def ok(self) -> bool:
        return all(self.checks.values())

    def node(self, i: int) -> Node:
        """The data of graph node ``i`` (op, category, bytes, flops, slot, semaphores)."""
        return self.schedule.nodes[i]

    def summary(self) -> GraphSummary:
        by_cat: dict[str, int] = {}
        for n in self.schedule.nodes:
            by_cat[n.cat] = by_cat.get(n.cat, 0) + 1
        return GraphSummary(
            nodes=len(self.schedule.nodes),
            edges=self.data_edges + self.reuse_edges,
            data_edges=self.data_edges,
            reuse_edges=self.reuse_edges,
            checks=dict(self.checks),
            failures=dict(self.failures),
            nodes_by_category=by_cat,
        )

    def enforce(self) -> None:
        """Raise a one-line error naming the first failed check and its first offender."""
        for name in CHECKS:
            if not self.checks[name]:
                raise ScheduleCheckError(
                    f"schedule check {name} failed: {self.failures[name]}"
                    + (
                        f" ({len(self.failures) - 1} other check(s) failed too)"
                        if len(self.failures) > 1
                        else ""
                    )
                )

    def describe(self) -> str:
        """One line per node: the node, its issue / run and wait positions, its successors."""
        first, wait = self.schedule.positions()
        lines = [
            f"{len(self.schedule.nodes)} nodes, {self.data_edges + self.reuse_edges} edges "
            f"({self.data_edges} data, {self.reuse_edges} buffer reuse); checks: "
            + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in self.checks.items())
        ]
        succ: dict[int, list[int]] = {}
        for u, v in sorted(self.edges_data | self.edges_reuse):
            succ.setdefault(u, []).append(v)
        for n in self.schedule.nodes:
            at = f"@{first[n.id]}" + (f"..{wait[n.id]}" if n.is_dma else "")
            lines.append(f"{n.describe()} {at} -> {succ.get(n.id, [])[:6]}")
        return "\n".join(lines)


def _label(n: Node) -> str:
    return f"node {n.id} '{n.name}'"


class _Failures:
    def __init__(self) -> None:
        self.first: dict[str, str] = {}

    def add(self, check: str, message: str) -> None:
        self.first.setdefault(check, message)


def analyse(schedule: Schedule, vmem: VmemPlan) -> StepGraph:
    """Build the dataflow graph of ``schedule`` and run every check on it."""
    fail = _Failures()
    first, end = _tally_events(schedule, fail)
    data_edges, slot_readers = _data_edges(schedule.nodes)
    replay = _Replay(schedule, vmem, end, slot_readers, fail)
    replay.run()
    data = set(data_edges)
    reuse = set(replay.reuse_edges) - data
    _check_acyclic(schedule.nodes, first, data, reuse, fail)
    _check_weights(schedule, fail)
    _check_deadlock(schedule, fail)
    unbalanced = check_rounds(vmem.dims.collectives, vmem.dims.devices)
    if unbalanced:
        fail.add("collectives_balanced", unbalanced)
    if vmem.explicit_bytes > vmem.budget_bytes or vmem.total_bytes > vmem.limit_bytes:
        fail.add(
            "vmem_within_budget",
            f"VMEM plan {vmem.explicit_bytes} B explicit (budget {vmem.budget_bytes}) + "
            f"{vmem.internal_bytes} B Mosaic scratch (limit {vmem.limit_bytes})",
        )
    checks = {name: name not in fail.first for name in CHECKS}
    return StepGraph(schedule, data, reuse, checks, dict(fail.first))


def _tally_events(schedule: Schedule, fail: _Failures) -> tuple[list[int], list[int]]:
    """(each node's first position: its run or DMA start; where its reads are over: its
    run or DMA wait), checking that every DMA is started and waited once and every op
    runs once."""
    nodes = schedule.nodes
    n_nodes = len(nodes)
    starts = [0] * n_nodes
    waits = [0] * n_nodes
    runs = [0] * n_nodes
    first = [-1] * n_nodes
    end = [-1] * n_nodes
    for pos, (op, i) in enumerate(schedule.events):
        node = nodes[i]
        if op == RUN:
            runs[i] += 1
            if node.is_dma:
                fail.add("ops_run_once", f"{_label(node)} is a DMA but is run as an op")
            first[i] = pos if first[i] < 0 else first[i]
            end[i] = pos
        elif op == START:
            starts[i] += 1
            first[i] = pos if first[i] < 0 else first[i]
        else:
            waits[i] += 1
            end[i] = pos
    for node in nodes:
        i = node.id
        if node.is_dma:
            if starts[i] != 1 or waits[i] != 1:
                fail.add(
                    "dma_waited_once",
                    f"{_label(node)} is started {starts[i]} and waited {waits[i]} time(s)",
                )
            elif end[i] < first[i]:
                fail.add("dma_waited_once", f"{_label(node)} is waited before it is started")
        elif runs[i] != 1:
            fail.add("ops_run_once", f"{_label(node)} runs {runs[i]} time(s)")
    return first, end


def _data_edges(nodes: list[Node]) -> tuple[list[tuple[int, int]], dict[int, list[int]]]:
    """(producer -> reader edges, the readers of every producer through a slot: the
    reuse rules' input)."""
    slot_readers: dict[int, list[int]] = {}
    data_edges: list[tuple[int, int]] = []
    for node in nodes:
        for p, res, _ in node.reads:
            if p == INIT:
                continue
            data_edges.append((p, node.id))
            if res is not None:
                slot_readers.setdefault(p, []).append(node.id)
    return data_edges, slot_readers


class _Replay:
    """The schedule's linear order replayed: what every slot holds, the DMAs in flight and
    each semaphore's last user, checking every read, write and semaphore use on the way
    and collecting the buffer reuse edges."""

    def __init__(
        self,
        schedule: Schedule,
        vmem: VmemPlan,
        end: list[int],
        slot_readers: dict[int, list[int]],
        fail: _Failures,
    ) -> None:
        self.schedule, self.nodes = schedule, schedule.nodes
        self.end, self.slot_readers, self.fail = end, slot_readers, fail
        self.known_sems = _semaphore_index(vmem)
        self.occupant: dict[tuple[str, int], int] = {}  # (resource, slot) -> producer
        self.in_flight: set[int] = set()  # DMA nodes started and not yet waited
        self.sem_owner: dict[str, int] = {}
        self.reuse_edges: list[tuple[int, int]] = []
        self.done = [False] * len(self.nodes)  # compute run / DMA waited

    def run(self) -> None:
        for pos, (op, i) in enumerate(self.schedule.events):
            node = self.nodes[i]
            if op == START:
                self.check_reads(node)
                self.take_semaphores(node)
                if node.resource is not None:
                    self.write(node, pos)
                self.in_flight.add(i)
            elif op == WAIT:
                self.in_flight.discard(i)
                self.done[i] = True
            else:
                self.check_reads(node)
                if node.resource is not None:
                    self.write(node, pos)
                self.done[i] = True

    def check_reads(self, node: Node) -> None:
        nodes, fail = self.nodes, self.fail
        for p, res, slot in node.reads:
            if res is None:
                if p != INIT and not self.done[p]:
                    fail.add(
                        "reads_after_writes",
                        f"{_label(node)} reads the output of node {p} '{nodes[p].name}' "
                        "before it is written",
                    )
                continue
            held = self.occupant.get((res, slot), INIT)
            if held != p:
                what = "the step's initial content" if p == INIT else f"node {p} '{nodes[p].name}'"
                now = "its initial content" if held == INIT else f"node {held} '{nodes[held].name}'"
                fail.add(
                    "reads_after_writes",
                    f"{_label(node)} reads {res}[{slot}] expecting {what}, but it holds {now}",
                )
            elif p != INIT and not self.done[p]:
                fail.add(
                    "reads_after_writes",
                    f"{_label(node)} reads {res}[{slot}] before node {p} '{nodes[p].name}' "
                    "has landed there (not waited)",
                )

    def take_semaphores(self, node: Node) -> None:
        """A DMA starts on its semaphores: each must exist and be free."""
        for s in node.sems:
            if s not in self.known_sems:
                self.fail.add("semaphores_unshared", f"{_label(node)} uses {s}, not in the plan")
            owner = self.sem_owner.get(s)
            if owner is not None and owner in self.in_flight:
                self.fail.add(
                    "semaphores_unshared",
                    f"{_label(node)} uses {s} while node {owner} '{self.nodes[owner].name}' "
                    "is in flight on it",
                )
            self.sem_owner[s] = node.id

    def write(self, node: Node, pos: int) -> None:
        nodes, fail = self.nodes, self.fail
        key = (node.resource, node.slot)
        if ":" not in node.resource:  # hbm: and smem: resources are not VMEM slots
            slots = self.schedule.resources.get(node.resource, 0)
            if not 0 <= node.slot < slots:
                fail.add(
                    "vmem_within_budget",
                    f"{_label(node)} writes {node.resource}[{node.slot}] but the VMEM plan "
                    f"allocates {slots} slot(s) of {node.resource}",
                )
        prev = self.occupant.get(key, INIT)
        if prev != INIT:
            if prev in self.in_flight and prev != node.id:
                fail.add(
                    "no_slot_overwrite",
                    f"{_label(node)} writes {node.resource}[{node.slot}] while node {prev} "
                    f"'{nodes[prev].name}' is still landing there",
                )
            self.reuse_edges.append((prev, node.id))
            for r in self.slot_readers.get(prev, ()):
                if r == node.id:
                    continue
                self.reuse_edges.append((r, node.id))
                if self.end[r] > pos or self.end[r] < 0:
                    fail.add(
                        "no_slot_overwrite",
                        f"{_label(node)} overwrites {node.resource}[{node.slot}] while node {r} "
                        f"'{nodes[r].name}' still reads node {prev} '{nodes[prev].name}' there",
                    )
        self.occupant[key] = node.id


def _check_acyclic(
    nodes: list[Node], first: list[int], data: set[tuple[int, int]], reuse: set[tuple[int, int]],
    fail: _Failures,
) -> None:  # fmt: skip
    # When every edge runs forward in the schedule's order, that order is a topological
    # order and there is no cycle; only otherwise is the graph searched for one.
    forward = all(first[u] < first[v] for u, v in data) and all(
        first[u] < first[v] for u, v in reuse
    )
    cycle = [] if forward else _cycle(len(nodes), data | reuse)
    if cycle:
        u = nodes[cycle[0]]
        path = " -> ".join(str(a) for a in cycle[:6])
        fail.add("acyclic", f"{_label(u)} is on a dependence cycle ({path} -> ...)")


def _cycle(n: int, edges: set[tuple[int, int]]) -> list[int]:
    """A dependence cycle (its nodes in order), or [] when the graph is acyclic.

    Kahn's algorithm on plain lists (networkx takes ~10x longer on a 100k-edge step);
    on failure networkx names the cycle among the nodes Kahn could not order.
    """
    succ: list[list[int]] = [[] for _ in range(n)]
    indegree = [0] * n
    for u, v in edges:
        succ[u].append(v)
        indegree[v] += 1
    ready = [i for i in range(n) if indegree[i] == 0]
    ordered = 0
    while ready:
        u = ready.pop()
        ordered += 1
        for v in succ[u]:
            indegree[v] -= 1
            if indegree[v] == 0:
                ready.append(v)
    if ordered == n:
        return []
    import networkx as nx

    left = [i for i in range(n) if indegree[i] > 0]
    sub = nx.DiGraph((u, v) for u, v in edges if indegree[u] > 0 and indegree[v] > 0)
    sub.add_nodes_from(left)
    return [u for u, _ in nx.find_cycle(sub)]


def _semaphore_index(vmem: VmemPlan) -> _AnySem:
    """Every semaphore name of the plan, e.g. ``ring_sems[3]``."""
    return _AnySem({s.name: s.shape for s in vmem.semaphores})


class _AnySem:
    """Membership test for ``name[i,j]`` against the plan's semaphore arrays (cached)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        self.shapes = shapes
        self.seen: dict[str, bool] = {}

    def __contains__(self, sem: str) -> bool:
        hit = self.seen.get(sem)
        if hit is None:
            m = _SEM.match(sem)
            hit = self.shapes.get(sem) == ()  # a single semaphore, no index
            if m and m.group(1) in self.shapes:
                idx = [int(x) for x in m.group(2).split(",")]
                shape = self.shapes[m.group(1)]
                hit = len(idx) == len(shape) and all(
                    0 <= i < n for i, n in zip(idx, shape, strict=True)
                )
            self.seen[sem] = hit
        return hit


def _check_deadlock(schedule: Schedule, fail: _Failures) -> None:
    """Replay the program's bank waits against the ring's refill rule at every depth."""
    nodes = schedule.nodes
    # Bank waits in program order, and (None) the starts of collectives' copies.
    uses = [
        (nodes[i].key[1] if op == WAIT else None, i)
        for op, i in schedule.events
        if (op == WAIT and _is_bank(nodes[i])) or (op == START and nodes[i].cat == "collective")
    ]
    user = {}  # bank node -> the op that runs on it first (what the error names)
    for op, i in schedule.events:
        if op == RUN:
            for p, res, _ in nodes[i].reads:
                if res == "ring":
                    user.setdefault(p, nodes[i].name)
    depths = sorted({schedule.ring_depth, *range(MIN_RING_DEPTH, MAX_RING_DEPTH + 1)})
    for depth in depths:
        # The program's holds at its own depth; at another, as many as that depth allows
        # (plan_program's bound).
        held = schedule.held_refills
        ring = RingRefills(
            depth,
            held if depth == schedule.ring_depth else min(held, depth - 2),
            schedule.refills_per_round,
        )
        started = set(range(min(depth, schedule.total_banks)))
        for bank, node in uses:
            if bank is None:  # a collective round's copies started: held refills go
                started.update(ring.release())
                continue
            if bank not in started:
                fail.add(
                    "deadlock_free",
                    f"at ring depth {depth}, '{user.get(node, nodes[node].name)}' waits for "
                    f"bank {bank}, which the ring starts only once bank {bank - depth + 1} is "
                    "reached, later in the program: the kernel would hang",
                )
                return
            if bank > 0 and (refill := ring.reach(bank)) is not None:
                started.add(refill)


def _is_bank(node: Node) -> bool:
    return node.key is not None and node.key[0] == "bank"


def _check_weights(schedule: Schedule, fail: _Failures) -> None:
    """Every bank and vector slab fetched exactly once per step, every piece of every
    expert slice a layer picks once (a folded expert loop counts its repeats)."""
    banks = [0] * schedule.total_banks
    slabs = [0] * schedule.layers
    pieces: dict[tuple[int, int], int] = {}  # (layer, piece) -> expert slices fetched
    seen: set[tuple] = set()
    bank_bytes = 0
    starts: dict[int, int] = {}
    for op, i in schedule.events:
        if op == START:
            starts[i] = starts.get(i, 0) + 1
    for node in schedule.nodes:
        if node.key is None or not node.is_dma:
            continue
        times = starts.get(node.id, 0)
        kind = node.key[0]
        if kind != "expert" and node.repeat != 1:
            fail.add(
                "weights_fetched_once",
                f"{_label(node)} is a weight DMA inside a folded loop (repeat {node.repeat})",
            )
        if kind == "bank":
            g = node.key[1]
            if not 0 <= g < len(banks):
                fail.add("weights_fetched_once", f"{_label(node)} fetches bank {g}: no such bank")
                continue
            banks[g] += times
            bank_bytes += node.nbytes * times
        elif kind == "vector":
            slabs[node.key[1]] += times
        elif kind == "expert":
            layer, i, p = node.key[1:]
            if node.key in seen:
                fail.add(
                    "weights_fetched_once",
                    f"{_label(node)}: piece {p} of expert slice {i} of layer {layer} is "
                    "fetched by two DMAs",
                )
            seen.add(node.key)
            pieces[(layer, p)] = pieces.get((layer, p), 0) + times * node.repeat
    for g, times in enumerate(banks):
        if times != 1:
            fail.add("weights_fetched_once", f"stream bank {g} is fetched {times} time(s)")
            break
    for layer, times in enumerate(slabs):
        if times != 1:
            fail.add("weights_fetched_once", f"vector slab {layer} is fetched {times} time(s)")
            break
    chosen = schedule.experts_per_layer
    for layer, (n, count) in chosen.items():
        for p in range(count):
            got = pieces.get((layer, p), 0)
            if got != n:
                fail.add(
                    "weights_fetched_once",
                    f"layer {layer} fetches piece {p} of {got} expert slices, it picks {n}",
                )
    extra = [k for k in pieces if k[0] not in chosen or k[1] >= chosen[k[0]][1]]
    if extra:
        fail.add("weights_fetched_once", f"expert piece {extra[0]} is not one a layer picks")
    if all(t == 1 for t in banks) and bank_bytes != schedule.stream_bytes:
        fail.add(
            "weights_fetched_once",
            f"the banks move {bank_bytes} B but the stream holds {schedule.stream_bytes} B",
        )
