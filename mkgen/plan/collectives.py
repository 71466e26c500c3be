"""Topology-aware collectives: the stages every in-kernel collective runs, planned once.

The kernel's mesh is one axis of D cores. Its device order is the topology's
(mkgen.spec.topology): sibling cores adjacent, then chips x fastest, then y, then z,
so a core's flat index is a mixed-radix number whose digits are (core on chip, x, y,
z). A collective runs one *stage* per digit of size > 1, sibling cores first: in a
stage, each core exchanges with the few cores that differ from it in that digit only
(its group: `size` members, `stride` apart in the flat index) and combines what they
sent in member order. Every core of a group then holds the same bits, and by
induction over the stages every core ends bit-identical (all-reduce, greedy) or
with its exact share (reduce-scatter). D - 1 copies per collective become
sum(size - 1) (31 -> 6 on a 2x2x4 slice of 32 cores), and the landing buffers hold
sum(size) slots instead of D.

- all-reduce: each stage exchanges the running sum and adds the group's in order;
- all-gather: each stage exchanges the pieces gathered so far and concatenates them
  in member order; with stages in ascending stride (least significant digit first)
  the result is in device order;
- reduce-scatter: the stages run in descending stride (most significant digit
  first): each stage splits the running vector into `size` contiguous parts, sends
  part j to member j and sums the parts it receives, so core d ends with columns
  [d * W / D, (d + 1) * W / D) of the sum (latent_out's input rows on that core).

Pure data (pydantic): the template renders the stages, never decides them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from mkgen.spec.topology import Topology

Op = Literal["all_reduce", "all_gather", "reduce_scatter"]
Axis = Literal["core", "x", "y", "z"]
LANES = 128
_LEVELS = ("core", "chip", "host")


class _Plan(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class CollectiveStage(_Plan):
    """One stage: the cores that differ only in one topology coordinate exchange."""

    axis: Axis  # the coordinate the members of a group differ in
    level: Literal["core", "chip", "host"]  # widest interconnect level the group spans
    size: int  # members of a group
    stride: int  # flat device distance between consecutive members
    offset: int  # first landing slot of this stage in a collective buffer

    def describe(self) -> str:
        return f"{self.axis}: groups of {self.size}, stride {self.stride} ({self.level})"


class CollectiveBuffer(_Plan):
    """The landing buffer of the k-th collective of a layer: [rows, tokens, width] f32.

    Rows are the stages' slots (`slots`), plus, for a reduce-scatter, `send_rows`
    staging rows its outgoing parts are copied from."""

    index: int
    uses: list[str]  # "kind.collective op" of every layer kind that runs it
    width: int  # f32 lanes of a slot: the widest piece any stage lands, 128-aligned
    send_rows: int  # reduce-scatter staging rows (0 when no use scatters)


class CollectivePlan(_Plan):
    """The stages, the landing buffers and the mesh order of one build."""

    stages: list[CollectiveStage]  # in ascending stride: sibling core first
    slots: int  # landing slots of one buffer: the sum of the group sizes
    max_group: int  # the largest group (reduce-scatter staging rows)
    mesh_order: list[int]  # topology device index at each position of the 1-D mesh
    buffers: list[CollectiveBuffer]

    @property
    def copies(self) -> int:
        """Remote copies one core sends per collective: sum(size - 1)."""
        return sum(s.size - 1 for s in self.stages)

    def describe(self) -> str:
        if not self.stages:
            return "collectives: one core, none"
        stages = "; ".join(s.describe() for s in self.stages)
        bufs = ", ".join(
            f"{b.index}: [{self.slots + b.send_rows}, T, {b.width}] ({', '.join(b.uses)})"
            for b in self.buffers
        )
        return f"collectives: {len(self.stages)} stage(s) [{stages}], {self.copies} copies; buffers {bufs}"


def plan_stages(topology: Topology) -> list[CollectiveStage]:
    """The stages of `topology`, sibling core first, then chip axes x, y, z.

    Sizes and strides follow the device order: a core's flat index is core + C * (x +
    X * (y + Y * z)); axes of size 1 have no stage. 2x2x4 (32 cores): [2, 2, 2, 4]
    with strides [1, 2, 4, 8]."""
    radix = [
        ("core", topology.devices_per_chip),
        *zip(("x", "y", "z"), topology.shape, strict=False),
    ]
    stages, stride, offset = [], 1, 0
    for axis, size in radix:
        if size > 1:
            members = [stride * j for j in range(1, size)]
            level = max((topology.level_between(0, m) for m in members), key=_LEVELS.index)
            stages.append(
                CollectiveStage(axis=axis, level=level, size=size, stride=stride, offset=offset)
            )
            offset += size
        stride *= size
    assert stride == topology.num_devices
    return stages


def slot_width(op: Op, width: int, stages: list[CollectiveStage]) -> int:
    """The widest piece a stage of `op` lands for a payload of `width` columns (the
    reduced or gathered result): a whole sum for an all-reduce; for an all-gather the
    pieces gathered before the last stage; for a reduce-scatter the parts of its
    first stage (the last in stride order)."""
    if not stages or op == "all_reduce":
        return width
    return width // stages[-1].size


def _round_lanes(n: int) -> int:
    return max(LANES, -(-n // LANES) * LANES)


def collective_buffers(attention: Sequence[Any], ffn: Sequence[Any]) -> dict[str, int]:
    """The landing buffer of each collective of a layer, by name, as the kernel numbers
    them: the attention's output all-reduce (its last) lands in buffer 0, the FFN's k-th
    collective in 1 + k. An all-gather before the attention's all-reduce (MLA's split
    A-projections) borrows buffer 1: the FFN writes a member's slot of it again only after
    that all-reduce, which needs the member's contribution, sent after it read the slot."""
    buffers = {c.name: 1 + k for k, c in enumerate(attention[:-1])}
    buffers[attention[-1].name] = 0
    return buffers | {c.name: 1 + k for k, c in enumerate(ffn)}


def layer_uses(sharding: Any) -> list[list[tuple[str, Op, int]]]:
    """(name, op, width) of the collectives landing in buffer k, for every layer kind pair
    of `sharding` (a ShardingPlan), numbered by collective_buffers."""
    uses: list[list[tuple[str, Op, int]]] = []
    for attn, ffn in sorted(set(sharding.layer_table)):
        a, f = sharding.attention[attn], sharding.ffn[ffn]
        buffers = collective_buffers(a.collectives, f.collectives)
        for kind, c in [(attn, c) for c in a.collectives] + [(ffn, c) for c in f.collectives]:
            k = buffers[c.name]
            while k >= len(uses):
                uses.append([])
            use = (f"{kind}.{c.name}", c.op, c.width)
            if use not in uses[k]:
                uses[k].append(use)
    while len(uses) < 2:  # attention and FFN always have a buffer each
        uses.append([])
    return uses


def plan_collectives(topology: Topology, uses: list[list[tuple[str, Op, int]]]) -> CollectivePlan:
    """Stages, mesh order and landing buffers for the collectives each layer runs.

    `uses[k]` lists (name, op, width) of every layer kind whose k-th collective of a
    layer this is (each collective of a layer has its own buffer: a core cannot write
    a buffer again before every member of its groups has read it, since it first
    needs their contributions to the collectives in between)."""
    stages = plan_stages(topology)
    d = topology.num_devices
    buffers = []
    for k, group in enumerate(uses):
        for name, op, width in group:
            if width % d and op != "all_reduce":
                raise ValueError(f"collective {name}: {op} of {width} columns over {d} cores")
        scatter = any(op == "reduce_scatter" for _, op, _ in group)
        buffers.append(
            CollectiveBuffer(
                index=k,
                uses=[f"{name} {op}" for name, op, _ in group],
                width=_round_lanes(
                    max([slot_width(op, w, stages) for _, op, w in group], default=LANES)
                ),
                send_rows=max((s.size for s in stages), default=0) if scatter else 0,
            )
        )
    return CollectivePlan(
        stages=stages,
        slots=max(1, sum(s.size for s in stages)),
        max_group=max((s.size for s in stages), default=1),
        mesh_order=list(range(d)),
        buffers=buffers,
    )


def arrange_devices(devices: list[Any], topology: Topology, order: list[int]) -> list[Any]:
    """JAX devices in mesh order: position i holds topology device `order[i]`.

    Real TPU devices (and libtpu's compile-only ones) carry `coords` and
    `core_on_chip`: their topology index is core + C * chip index, chips x fastest.
    Devices without them (virtual CPU devices) are taken in id order."""
    ordered = sorted(devices, key=lambda dev: dev.id)
    if all(hasattr(dev, "coords") and hasattr(dev, "core_on_chip") for dev in ordered):
        index = {}
        for dev in ordered:
            coords = list(dev.coords)[: len(topology.shape)]
            chip = 0
            for c, n in zip(reversed(coords), reversed(topology.shape), strict=True):
                chip = chip * n + c
            index[chip * topology.devices_per_chip + dev.core_on_chip] = dev
        if len(index) >= len(order) and all(i in index for i in order):
            return [index[i] for i in order]
    if len(ordered) < len(order):
        return ordered
    return [ordered[i] for i in order]


def stage_sum(values: list[Any], stages: list[CollectiveStage]) -> list[Any]:
    """Reference of the staged all-reduce on the host (one value per core, in mesh
    order): what every core holds after the stages, summed in member order."""
    cur = list(values)
    for s in stages:
        nxt = []
        for me in range(len(cur)):
            c = (me // s.stride) % s.size
            base = me - c * s.stride
            total = cur[base]
            for j in range(1, s.size):
                total = total + cur[base + j * s.stride]
            nxt.append(total)
        cur = nxt
    return cur


def flat_sum(values: list[Any]) -> list[Any]:
    """The flat all-reduce (every core sums all D partials in device order)."""
    total = values[0]
    for v in values[1:]:
        total = total + v
    return [total] * len(values)
