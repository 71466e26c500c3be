"""Topology-aware collectives: the rounds every in-kernel collective runs, planned once.

The kernel's mesh is one axis of D cores, host by host: position p holds topology
device `mesh_order[p]`, and each host's L cores (sibling cores adjacent, then its chips
in device order) take L consecutive positions, so a position is a two-digit number
(core in its host, host). A staged collective runs at most two *rounds*, one per digit of size
> 1: first the L cores of a host, then the H cores holding the same place in every host.
A round is one-shot: every member writes its piece straight into its own slot of every
other member's landing buffer (one remote DMA per peer, each on its own semaphore) and
combines the group's slots in member order once they have all landed, so a group ends
bit-identical and, after the second round, every core does (all-reduce, greedy) or holds
its exact share (reduce-scatter). 2x2x4 (32 cores, 4 hosts of 8): rounds of 8 and 4, two
dependent rounds instead of the four of a stage per topology axis.

A collective may instead run *flat*: one round of all D cores (`flat_round`, position =
member), 31 copies on 2x2x4 instead of 10 but one phase instead of two. An all-reduce may
also run *scattered*: a reduce-scatter over the host's round (core c of a host sums the
host's part c, 1 / L of the columns), an all-reduce of that part across hosts, and an
all-gather of the parts over the host again (`scatter_calls`): three rounds instead of
two, but each copy 1 / L of the payload, so it wins once the copies are bandwidth-bound
(Kimi K3 on 2x2x4 at 16 or more token rows). The gather lands in slots of its own (the
`host_gather` round: the host's groups, after the other rounds' slots), since a member
may start it before this core has read the parts the member sent it in the scatter.
`choose_rounds` takes whichever the cost model prices lower per collective (`rounds_price`:
each round's phase or wire time plus the DMA issue of its copies), or as `--collectives`
forces.

- all-reduce: each round exchanges the running sum and adds the group's in order;
- all-gather: each round exchanges the pieces gathered so far and places them in member
  order; the host round first, so the result is in mesh order;
- reduce-scatter: the host-crossing round first: it splits the running vector into H
  contiguous parts, sends part j to member j and sums the parts it receives; the host
  round does the same with L parts, so core p ends with columns [p * W / D, (p + 1) *
  W / D) of the sum (latent_out's input rows on that core).

Wire dtype (`wire_dtype`): a round sends bf16 (two values in each 32-bit lane, summed in
f32 on arrival) when its piece is whole 128-lane blocks of at least 256 columns, where
that halves the rows a DMA moves; narrower pieces travel as f32 (a DMA moves whole
128-lane rows, so bf16 would save nothing), and so does the greedy exchange (token ids
are not exact in bf16). `wire_error_bound` is the rounding error this allows.

Pure data (pydantic): the template renders the rounds, never decides them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict

from mkgen.plan.cost import CostConstants, pad_rows
from mkgen.spec.topology import Topology

if TYPE_CHECKING:
    from mkgen.hardware import Chip

Op = Literal["all_reduce", "all_gather", "reduce_scatter"]
Level = Literal["core", "chip", "host"]
RoundName = Literal["host", "hosts", "all", "host_gather"]
WireDtype = Literal["bf16", "f32"]
LANES = 128  # a remote DMA moves whole 128-lane rows of 32-bit words (512-byte runs)
WORD_BYTES = 4  # the landing buffers hold 32-bit words: one f32 or two bf16
_LEVELS: tuple[Level, ...] = ("core", "chip", "host")
# Unit roundoff of bf16 (8 significant bits, round to nearest even) and of f32.
BF16_UNIT_ROUNDOFF = 2.0**-8
F32_UNIT_ROUNDOFF = 2.0**-24


class _Plan(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class CollectiveRound(_Plan):
    """One round: every member of a group writes its piece to every other member."""

    # the cores of one host / one core of every host / every core (flat) / the cores of one
    # host again, in slots of their own (a scattered all-reduce's gather)
    name: RoundName
    level: Level  # widest interconnect level the group spans
    size: int  # members of a group
    stride: int  # mesh distance between consecutive members
    offset: int  # first landing slot of this round in a collective buffer
    peers: dict[str, int]  # the other members by link level (core, chip, host)

    def describe(self) -> str:
        links = ", ".join(f"{n} {k}" for k, n in self.peers.items() if n)
        return f"{self.name}: groups of {self.size}, stride {self.stride} ({links})"


class RoundCall(_Plan):
    """What one round of one collective moves: the program's collective op carries it."""

    collective: str  # the collective's name (attn_out, latent_in, ...)
    op: Op
    # what this round does: the collective's own op, or for a scattered all-reduce its
    # reduce-scatter, all-reduce and all-gather in turn
    phase: Op
    round: RoundName
    index: int  # 0-based position among the collective's rounds, in execution order
    rounds: int  # rounds the collective runs
    level: Level
    members: int
    peers: dict[str, int]  # other members by link level: one copy to each
    columns: int  # values of the piece sent to each peer, per token row
    wire: WireDtype
    lanes: int  # 32-bit lanes of a copy (bf16: two values a lane), whole 128-lane rows
    rows: int  # token rows the core combines: the real ones padded to 8-row sublane blocks
    copy_rows: int  # token rows a copy moves: only the real ones (batch x rows)
    bytes_per_peer: int  # copy_rows x lanes x 4: what one copy moves

    @property
    def bytes_by_level(self) -> dict[str, int]:
        return {k: n * self.bytes_per_peer for k, n in self.peers.items()}

    def describe(self) -> str:
        return f"{self.round} x{self.members} {self.wire} {self.bytes_per_peer / 1024:.1f} KiB/peer"


class CollectiveBuffer(_Plan):
    """The landing buffer of the k-th collective of a layer: [rows, tokens, width] uint32.

    Rows are the rounds' slots (`slots`), plus, for a reduce-scatter, `send_rows`
    staging rows its outgoing parts are copied from."""

    index: int
    uses: list[str]  # "kind.collective op" of every layer kind that runs it
    slots: int  # landing slots: the most any of its uses' rounds reach (offset + size)
    width: int  # 32-bit lanes of a slot: the widest copy any round lands, 128-aligned
    send_rows: int  # reduce-scatter staging rows after the slots (0 when no use scatters)
    # (op, columns of the kernel's argument) -> (round, phase, wire dtype, lanes) of each
    # round it runs, in execution order (round: an index into CollectivePlan.rounds; phase:
    # what the round does, RoundCall.phase): what the kernel's call with that argument does.
    wires: list[tuple[Op, int, list[tuple[int, Op, WireDtype, int]]]]


class CollectivePlan(_Plan):
    """The rounds, the landing buffers and the mesh order of one build."""

    # every round a collective runs: host, hosts, then all and host_gather where used
    rounds: list[CollectiveRound]
    slots: int  # semaphores per buffer (and greedy slots): the most any round reaches
    mesh_order: list[int]  # topology device index at each position of the 1-D mesh
    buffers: list[CollectiveBuffer]
    greedy: list[int]  # the rounds of the greedy exchange (indices into rounds)
    barrier: list[int]  # the rounds whose members the entry barrier signals

    @property
    def copies(self) -> int:
        """Cores one core signals at the entry barrier: every core any round writes to."""
        return sum(self.rounds[i].size - 1 for i in self.barrier)

    def sequences(self) -> list[list[int]]:
        """Every distinct sequence of rounds a collective runs (the greedy's too)."""
        return self._distinct(lambda op, phase: True)

    def schemes(self) -> list[list[int]]:
        """Every distinct sequence of rounds that brings the partials together (the
        greedy's too): a collective's rounds, but for a scattered all-reduce's gather,
        which brings back parts its earlier rounds combined already."""
        return self._distinct(lambda op, phase: op != "all_reduce" or phase != "all_gather")

    def _distinct(self, keeps: Callable[[Op, Op], bool]) -> list[list[int]]:
        """The greedy's rounds, then each collective's rounds whose (op, phase) `keeps`
        holds, every distinct list once."""
        out = [self.greedy] if self.greedy else []
        for b in self.buffers:
            for op, _, ws in b.wires:
                rounds = [i for i, phase, *_ in ws if keeps(op, phase)]
                if rounds not in out:
                    out.append(rounds)
        return out

    def describe(self) -> str:
        if not self.rounds:
            return "collectives: one core, none"
        rounds = "; ".join(r.describe() for r in self.rounds)
        bufs = ", ".join(
            f"{b.index}: [{b.slots + b.send_rows}, T, {b.width}] ({', '.join(b.uses)})"
            for b in self.buffers
        )
        schemes = " or ".join(
            "+".join(self.rounds[i].name for i in scheme) for scheme in self.sequences()
        )
        return (
            f"collectives: {len(self.rounds)} one-shot round(s) [{rounds}], run as {schemes}; "
            f"buffers {bufs}"
        )


def host_order(topology: Topology) -> list[int]:
    """Topology device indices host by host (in device order within a host): the mesh
    order, so a host's cores take consecutive positions. Identity wherever hosts are
    already contiguous in device order (every TPU7x slice up to 2x4x4)."""
    return sorted(range(topology.num_devices), key=lambda d: (topology.devices[d].host, d))


def plan_rounds(topology: Topology) -> list[CollectiveRound]:
    """The rounds of `topology` in mesh order (`host_order`): the cores of one host,
    then one core of every host; a digit of size 1 has no round. 2x2x4 (4 hosts of 8
    cores): [8, 4] with strides [1, 8]."""
    per_host = topology.num_devices // topology.num_hosts
    rounds: list[CollectiveRound] = []
    offset = 0
    for name, size, stride in (("host", per_host, 1), ("hosts", topology.num_hosts, per_host)):
        if size == 1:
            continue
        rounds.append(_round(topology, name, size, stride, offset))
        offset += size
    return rounds


def gather_round(topology: Topology) -> CollectiveRound | None:
    """The cores of one host again, in slots after the staged rounds': where a scattered
    all-reduce gathers its parts (`scatter_calls`); None without a host round of 2 or
    more cores."""
    staged = plan_rounds(topology)
    if not staged or staged[0].name != "host":
        return None
    host = staged[0]
    return _round(topology, "host_gather", host.size, host.stride, sum(r.size for r in staged))


def flat_round(topology: Topology) -> CollectiveRound | None:
    """One round of every core (member = mesh position), its slots from 0: what a flat
    collective runs instead of the staged rounds; None where those are a single round
    already (one host, or one core a host)."""
    if len(plan_rounds(topology)) < 2:
        return None
    return _round(topology, "all", topology.num_devices, 1, 0)


def _round(
    topology: Topology, name: RoundName, size: int, stride: int, offset: int
) -> CollectiveRound:
    """A round of groups of `size` cores `stride` apart, with its peers by link level."""
    order = host_order(topology)
    peers = dict.fromkeys(_LEVELS, 0)
    for m in range(1, size):
        peers[topology.level_between(order[0], order[m * stride])] += 1
    level = max((k for k, n in peers.items() if n), key=_LEVELS.index)
    return CollectiveRound(
        name=name, level=level, size=size, stride=stride, offset=offset, peers=peers
    )


def round_pieces(
    op: Op, width: int, rounds: list[CollectiveRound]
) -> list[tuple[CollectiveRound, int]]:
    """(round, columns of the piece each member sends each peer) in execution order, for
    a payload of `width` columns (the reduced or gathered result): the whole running sum
    for an all-reduce; for an all-gather the pieces gathered so far (host round first);
    for a reduce-scatter one part of the running vector (host-crossing round first)."""
    if op == "all_reduce":
        return [(r, width) for r in rounds]
    if op == "all_gather":
        piece = width // math.prod(r.size for r in rounds)
        out = []
        for r in rounds:
            out.append((r, piece))
            piece *= r.size
        return out
    running, out = width, []
    for r in reversed(rounds):
        running //= r.size
        out.append((r, running))
    return out


def wire_dtype(columns: int) -> WireDtype:
    """bf16 where it halves the 128-lane rows a copy moves: a piece of whole 128-lane
    blocks and at least 256 columns; f32 for narrower pieces (a copy moves at least one
    whole 128-lane row, so bf16 would save nothing)."""
    return "bf16" if columns >= 2 * LANES and columns % LANES == 0 else "f32"


def wire_lanes(columns: int, wire: WireDtype) -> int:
    """32-bit lanes a copy of `columns` values moves: bf16 packs columns c and c + lanes
    into one lane (a zero block pads an odd number of 128-lane blocks)."""
    if wire == "bf16":
        return -(-columns // (2 * LANES)) * LANES
    return max(LANES, -(-columns // LANES) * LANES)


def round_calls(
    name: str, op: Op, width: int, tokens: int, rounds: list[CollectiveRound]
) -> list[RoundCall]:
    """The rounds one collective runs, with what each copy moves, in execution order: the
    `tokens` real token rows (the kernel's landing slots pad them to 8-row sublane blocks,
    but its copies leave the padding behind)."""
    return _calls(
        name, op, tokens, [(op, r, columns) for r, columns in round_pieces(op, width, rounds)]
    )


def scatter_calls(name: str, width: int, tokens: int, topology: Topology) -> list[RoundCall] | None:
    """An all-reduce of `width` columns run scattered: a reduce-scatter over the host's
    round (core c of a host then holds the host's sum of part c, width / L columns), an
    all-reduce of that part over the other staged rounds (across hosts), and an
    all-gather of the parts over the host again, in the gather round's own slots. None
    where the topology has no host round or `width` does not split into its L parts."""
    staged, gather = plan_rounds(topology), gather_round(topology)
    if gather is None or width % gather.size:
        return None
    host, *across = staged
    part = width // host.size
    steps: list[tuple[Op, CollectiveRound, int]] = [("reduce_scatter", host, part)]
    steps += [("all_reduce", r, part) for r in across]
    steps.append(("all_gather", gather, part))
    return _calls(name, "all_reduce", tokens, steps)


def _calls(
    name: str, op: Op, tokens: int, steps: Sequence[tuple[Op, CollectiveRound, int]]
) -> list[RoundCall]:
    """RoundCalls of collective `name` from its (phase, round, columns sent each peer)."""
    calls = []
    for index, (phase, r, columns) in enumerate(steps):
        wire = wire_dtype(columns)
        lanes = wire_lanes(columns, wire)
        calls.append(
            RoundCall(
                collective=name, op=op, phase=phase, round=r.name, index=index,
                rounds=len(steps), level=r.level, members=r.size, peers=r.peers,
                columns=columns, wire=wire, lanes=lanes, rows=pad_rows(tokens),
                copy_rows=tokens, bytes_per_peer=tokens * lanes * WORD_BYTES,
            )
        )  # fmt: skip
    return calls


def wire_error_bound(op: Op, calls: list[RoundCall]) -> float:
    """Bound on |kernel - exact| / sum(|partials|) per element of the result.

    A round rounds each piece it sends to its wire dtype (bf16: 8 significant bits, unit roundoff u = 2^-8)
    and sums the group's n pieces in f32 (gamma(n - 1), with eps = 2^-24); each round's
    error scales with the magnitudes it sums, so over the rounds the bound is
    prod_r (1 + u_r)(1 + gamma(n_r - 1)) - 1: 7.8e-3 for 2x2x4's bf16 rounds of 8 and 4
    (an all-gather sums nothing: prod_r (1 + u_r) - 1, relative to each value; a
    scattered all-reduce's gather rounds the sum once more)."""
    bound = 1.0
    for c in calls:
        fan_in = 1 if c.phase == "all_gather" else c.members
        adds = (fan_in - 1) * F32_UNIT_ROUNDOFF
        u = BF16_UNIT_ROUNDOFF if c.wire == "bf16" else 0.0
        bound *= (1 + u) * (1 + adds / (1 - adds))
    return bound - 1


def round_time_s(call: RoundCall, constants: CostConstants) -> float:
    """One round: its phase latency (within a host the catalog's measured one-shot phase
    over the 8 cores of a TPU7x host at batch 1, its bf16 payload moved included; across
    hosts the catalog's cross-host phase, an assumption), or, once its copies take longer
    over the links, that time. The sibling link works beside the cross-chip links; chip-
    and host-level copies share the chip's links, each level's bytes at its own rate."""
    bandwidth = constants.ici_bandwidth
    sent = call.bytes_by_level
    sibling = sent.get("core", 0) / bandwidth.get("core", bandwidth["chip"])
    off_chip = sum(
        sent.get(level, 0) / bandwidth.get(level, bandwidth["chip"]) for level in ("chip", "host")
    )
    latency = constants.cross_host_phase_s if call.level == "host" else constants.collective_phase_s
    return max(latency, sibling, off_chip)


def rounds_price(calls: Sequence[RoundCall], constants: CostConstants) -> float:
    """Seconds a collective's rounds take one after the other: each round's phase or wire
    time (`round_time_s`) plus the DMA engine's issue of its size - 1 copies (the walk
    charges the same per copy). What `choose_rounds` compares."""
    return sum(
        round_time_s(c, constants) + (c.members - 1) * constants.dma_overhead_s for c in calls
    )


def choose_rounds(
    topology: Topology,
    name: str,
    op: Op,
    width: int,
    tokens: int,
    constants: CostConstants,
    mode: str,
) -> list[RoundCall]:
    """The rounds collective `name` runs: staged (the cores of a host, then across hosts),
    flat (one round of every core) or, for an all-reduce, scattered (`scatter_calls`), as
    `mode` forces ("staged", "flat", "scatter": staged where this collective cannot run
    the forced scheme) or, for "auto", whichever `rounds_price` prices lowest (staged on
    a tie). The flat round saves a phase but sends to every core (31 copies instead of 10
    on 2x2x4, each issued and moved over its link level), so it wins for the small pieces
    of a gather or scatter and loses for a wide all-reduce; the scattered all-reduce adds
    a phase but sends 1 / L of the payload a copy, so it wins where the copies of a wide
    all-reduce outlast the phase."""
    candidates = {"staged": round_calls(name, op, width, tokens, plan_rounds(topology))}
    flat = flat_round(topology)
    if flat is not None:
        candidates["flat"] = round_calls(name, op, width, tokens, [flat])
    scattered = scatter_calls(name, width, tokens, topology) if op == "all_reduce" else None
    if scattered is not None:
        candidates["scatter"] = scattered
    if mode != "auto":
        return candidates.get(mode, candidates["staged"])
    return min(candidates.values(), key=lambda calls: rounds_price(calls, constants))


def collective_time_us(op: Mapping[str, Any], chip: Chip) -> float:
    """Predicted microseconds of one collective round of the kernel program: `op` is the
    program's start entry of the round, whose "collective" field holds its RoundCall
    (rounds, peers by link level, bytes per peer, wire dtype); a collective costs the sum
    of its rounds, which run one after the other."""
    call = RoundCall.model_validate(op["collective"])
    return round_time_s(call, CostConstants.from_chip(chip)) * 1e6


def collective_buffers(
    attention: Sequence[Any], ffn: Sequence[Any], ffn_out: int
) -> dict[str, int]:
    """The landing buffer of each collective of a layer, by name, as the kernel numbers
    them: the attention's output all-reduce (its last) lands in buffer 0; the FFN's last
    all-reduce (its output's, or a latent MoE's all-reduce of the latent before its
    output all-gather) in buffer `ffn_out` (ffn_out_buffer: the same for every layer
    kind, after every other's), so that a dense layer's all-reduce shares the MoE's wide
    buffer instead of widening a narrow all-gather's; the FFN's other collectives, in
    order, in 1, 2, ... An all-gather before the attention's all-reduce (MLA's split
    A-projections) borrows buffer 1: the FFN writes a member's slot of it again only after
    that all-reduce, which needs the member's contribution, sent after it read the slot."""
    buffers = {c.name: 1 + k for k, c in enumerate(attention[:-1])}
    buffers[attention[-1].name] = 0
    last_all_reduce = next((c for c in reversed(ffn) if c.op == "all_reduce"), None)
    others = [c for c in ffn if c is not last_all_reduce]
    buffers |= {c.name: 1 + k for k, c in enumerate(others)}
    return buffers | ({last_all_reduce.name: ffn_out} if last_all_reduce is not None else {})


def ffn_out_buffer(sharding: Any) -> int:
    """The buffer every FFN's last collective lands in: past the other collectives of any
    layer (the attention's before its all-reduce, the FFN's before its last), so that two
    collectives in a row never share a buffer."""
    attention = max(len(a.collectives) for a in sharding.attention.values())
    ffn = max(len(f.collectives) for f in sharding.ffn.values())
    return max(1, attention, ffn)


Scheme = Literal["staged", "flat", "scatter"]
Use = tuple[str, Op, int, Scheme]  # (name, op, width, how it runs) of a collective


def scheme_of(calls: Sequence[RoundCall]) -> Scheme:
    """ "flat" for the one round of every core, "scatter" for a scattered all-reduce,
    "staged" for the host and hosts rounds."""
    if any(c.round == "all" for c in calls):
        return "flat"
    return "scatter" if any(c.phase != c.op for c in calls) else "staged"


def scheme_calls(
    topology: Topology, name: str, op: Op, width: int, tokens: int, scheme: Scheme
) -> list[RoundCall]:
    """The rounds of collective `name` run as `scheme` (one `choose_rounds` chose)."""
    if scheme == "scatter":
        scattered = scatter_calls(name, width, tokens, topology)
        if scattered is None:
            raise ValueError(f"collective {name}: {width} columns do not scatter over a host")
        return scattered
    flat = flat_round(topology)
    return round_calls(
        name, op, width, tokens, [flat] if scheme == "flat" and flat else plan_rounds(topology)
    )


def layer_uses(sharding: Any) -> list[list[Use]]:
    """(name, op, width, scheme) of the collectives landing in buffer k, for every layer
    kind pair of `sharding` (a ShardingPlan), numbered by collective_buffers."""
    uses: list[list[Use]] = []
    ffn_out = ffn_out_buffer(sharding)
    for attn, ffn in sorted(set(sharding.layer_table)):
        a, f = sharding.attention[attn], sharding.ffn[ffn]
        buffers = collective_buffers(a.collectives, f.collectives, ffn_out)
        for kind, c in [(attn, c) for c in a.collectives] + [(ffn, c) for c in f.collectives]:
            k = buffers[c.name]
            while k >= len(uses):
                uses.append([])
            use = (f"{kind}.{c.name}", c.op, c.width, scheme_of(c.rounds))
            if use not in uses[k]:
                uses[k].append(use)
    while len(uses) < 2:  # attention and FFN always have a buffer each
        uses.append([])
    if sharding.draft_passes is not None:
        # A fused drafter's pass gathers its rows' embeddings from the vocabulary shards
        # (an all-reduce) in buffer 0, then eh_proj's columns in the FFN output's buffer:
        # each after the greedy exchange or the other, before the pass layer's attention.
        for k, name in ((0, "embedding"), (ffn_out, "eh_proj")):
            c = next(c for c in sharding.step_collectives if c.name == name)
            use = (f"draft.{name}", c.op, c.width, scheme_of(c.rounds))
            if use not in uses[k]:
                uses[k].append(use)
    return uses


def greedy_scheme(sharding: Any) -> Scheme:
    """How the greedy exchange runs: the plan's sampling all-gather's rounds."""
    sampling = [c for c in sharding.step_collectives if c.name == "sampling"]
    return scheme_of(sampling[0].rounds) if sampling else "staged"


def plan_collectives(
    topology: Topology, uses: list[list[Use]], greedy: Scheme = "staged"
) -> CollectivePlan:
    """Rounds, mesh order and landing buffers for the collectives each layer runs.

    `uses[k]` lists (name, op, width, scheme) of every layer kind whose k-th collective
    of a layer this is (each collective of a layer has its own buffer: a core cannot
    write a buffer again before every member of its groups has read it, since it first
    needs their contributions to the collectives in between; any collective's result
    combines every core's partial, so this holds across staged and flat ones too).
    `greedy`: how the greedy exchange runs."""
    staged, flat, gather = plan_rounds(topology), flat_round(topology), gather_round(topology)
    wanted = {scheme for group in uses for *_, scheme in group} | {greedy}
    rounds = staged + ([flat] if flat is not None and "flat" in wanted else [])
    rounds += [gather] if gather is not None and "scatter" in wanted else []
    index = {r.name: i for i, r in enumerate(rounds)}
    d = topology.num_devices
    buffers = []
    for k, group in enumerate(uses):
        wires: list[tuple[Op, int, list[tuple[int, Op, WireDtype, int]]]] = []
        for name, op, width, scheme in group:
            if width % d and op != "all_reduce":
                raise ValueError(f"collective {name}: {op} of {width} columns over {d} cores")
            argument = width // d if op == "all_gather" else width
            calls = scheme_calls(topology, name, op, width, 1, scheme)
            entry = (op, argument, [(index[c.round], c.phase, c.wire, c.lanes) for c in calls])
            if entry not in wires:
                wires.append(entry)
        landed = [rounds[i] for *_, ws in wires for i, *_ in ws]
        scattered = [
            rounds[i] for *_, ws in wires for i, phase, *_ in ws if phase == "reduce_scatter"
        ]
        buffers.append(
            CollectiveBuffer(
                index=k,
                uses=[f"{name} {op}" for name, op, *_ in group],
                slots=max([r.offset + r.size for r in landed], default=1),
                width=max([lanes for *_, ws in wires for *_, lanes in ws], default=LANES),
                send_rows=max((r.size for r in scattered), default=0),
                wires=wires,
            )
        )
    barrier = [index["all"]] if "all" in index else list(range(len(staged)))
    return CollectivePlan(
        rounds=rounds,
        slots=max([r.offset + r.size for r in rounds], default=1),
        mesh_order=host_order(topology),
        buffers=buffers,
        greedy=[index[r.name] for r in ([flat] if greedy == "flat" and flat else staged)],
        barrier=barrier,
    )


def check_rounds(plan: CollectivePlan, devices: int) -> str | None:
    """The first way the rounds fail to balance, or None.

    For every sequence of rounds a collective runs (`CollectivePlan.schemes`): each
    round's groups must partition the mesh; every member sends one copy to every other
    member of its group, into the slot (and onto the receive semaphore) of its own
    position, and every core waits for one copy in each other slot of the round, so the
    copies a core waits for are exactly those sent to it; and the rounds together bring
    every core's partial to every core; every round (a scattered all-reduce's gather too)
    balances its copies and waits on its own, and no two rounds of one collective land in
    the same slots (a member may start a later round before this core has read what it
    sent in an earlier one). The entry barrier's signals balance the same way and reach
    every core any round writes to. Every core then reaches the rounds in the same order,
    with all its sends started before its waits, so no round can wait forever."""
    for b in plan.buffers:
        for op, _, ws in b.wires:
            used: set[int] = set()
            for i, *_ in ws:
                r = plan.rounds[i]
                last = r.offset + r.size - 1
                if r.offset + r.size > min(b.slots, plan.slots):
                    return f"round {r.name}: slots {r.offset}..{last} past {b.slots}"
                slots = set(range(r.offset, r.offset + r.size))
                if slots & used:
                    return (
                        f"{op}: round {r.name} lands in slots {r.offset}..{last}, which an "
                        "earlier round of the same collective uses"
                    )
                used |= slots
    for scheme in plan.schemes():
        problem = _check_scheme([plan.rounds[i] for i in scheme], plan.slots, devices)
        if problem:
            return problem
    for r in plan.rounds:
        problem = _check_scheme([r], plan.slots, devices, cover=False)
        if problem:
            return problem
    return _check_barrier(plan, devices)


def _members(r: CollectiveRound, me: int) -> list[int]:
    """Core `me`'s group in round `r`, in member order."""
    base = me - ((me // r.stride) % r.size) * r.stride
    return [base + j * r.stride for j in range(r.size)]


def _check_scheme(
    rounds: list[CollectiveRound], slots: int, devices: int, cover: bool = True
) -> str | None:
    """check_rounds for one sequence of rounds: copies against waits, and (`cover`) that
    the rounds reach every core."""
    if cover and math.prod(r.size for r in rounds) != devices:
        return f"rounds of {[r.size for r in rounds]} members do not cover {devices} cores"
    sent: dict[tuple[int, int], int] = {}
    waited: dict[tuple[int, int], int] = {}
    for r in rounds:
        if r.offset + r.size > slots:
            return f"round {r.name}: slots {r.offset}..{r.offset + r.size - 1} past {slots}"
        for me in range(devices):
            pos = (me // r.stride) % r.size
            for j, m in enumerate(_members(r, me)):
                if not 0 <= m < devices:
                    return f"round {r.name}: core {me}'s member {j} is core {m}, not in the mesh"
                if m == me:
                    continue
                sent[m, r.offset + pos] = sent.get((m, r.offset + pos), 0) + 1
                waited[me, r.offset + j] = waited.get((me, r.offset + j), 0) + 1
    for key in sorted(sent.keys() | waited.keys()):
        if sent.get(key, 0) != waited.get(key, 0):
            core, slot = key
            return (
                f"core {core} slot {slot}: {sent.get(key, 0)} copies land on its semaphore, "
                f"it waits for {waited.get(key, 0)}"
            )
    if not cover:
        return None
    # Every core's result must combine every core's partial (once: the sizes multiply to D).
    reach = [{me} for me in range(devices)]
    for r in rounds:
        reach = [set().union(*(reach[m] for m in _members(r, me))) for me in range(devices)]
    for core, cores in enumerate(reach):
        if len(cores) != devices:
            return f"core {core} combines the partials of {len(cores)} of {devices} cores"
    return None


def _check_barrier(plan: CollectivePlan, devices: int) -> str | None:
    """The entry barrier: each core gets as many signals as it waits for, from every core
    that writes to it in any round."""
    signals = dict.fromkeys(range(devices), 0)
    signalled: dict[int, set[int]] = {me: set() for me in range(devices)}
    for r in (plan.rounds[i] for i in plan.barrier):
        for me in range(devices):
            for m in _members(r, me):
                if m != me and 0 <= m < devices:
                    signals[m] += 1
                    signalled[m].add(me)
    for core, n in signals.items():
        if n != plan.copies:
            return f"core {core} gets {n} barrier signals, waits for {plan.copies}"
    for r in plan.rounds:
        for me in range(devices):
            writers = {m for m in _members(r, me) if m != me and 0 <= m < devices}
            if not writers <= signalled[me]:
                return f"round {r.name}: core {me} is written to before its barrier signal"
    return None


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
