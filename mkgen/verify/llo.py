"""Read Mosaic's final LLO dump of the megakernel: static op counts times trip counts.

libtpu writes the dump when ``LIBTPU_INIT_ARGS`` holds
``--xla_mosaic_dump_to=DIR --xla_mosaic_enable_dump_debug_info=true``: one
``*-post-finalize-llo.txt`` per kernel, in MLIR text. It keeps the ``scf.for`` /
``scf.if`` nesting and, with debug info, a ``loc`` per op whose ``callsite`` chain
names the Python functions of the generated megakernel.py that emitted it
(``_attend_gqa.<locals>.pair``, ``Ring.matmul.<locals>.unit_step``, ...).

An op's count per step is its static count times the trips of the loops around it:

- a loop with constant bounds (``%c = llo.constant``) runs its own trip count; when a
  guard inside it depends on the induction variable (the ring's ``c < chunks``, the
  layer loop's ``layer % RESIDUAL_BLOCK == 0``), every iteration is evaluated with the
  scalar ops that compute the guard;
- a loop with runtime bounds (KV tiles up to the position, the chosen experts) runs
  what the caller's ``trips`` says for it (the plan knows; see mkgen.verify.profile);
- a guard that depends on runtime data (a layer's kind from the layer table, a DMA
  that may be past the end) counts as taken: the kind is fixed afterwards by the
  caller from the layers of each kind.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

Frames = tuple[str, ...]  # function names, innermost first

_LOC_DEF = re.compile(r"^#loc(\d*) = loc\((.*)\)\s*$")
_FILE_LOC = re.compile(r'^"[^"]*":\d+:\d+')
_NAMED = re.compile(r'^"([^"]*)"\(#loc(\d*)\)$')
_CALLSITE = re.compile(r"^callsite\(#loc(\d*) at #loc(\d*)\)$")
_OP_LOC = re.compile(r"loc\(#loc(\d*)\)\s*$")
_OP = re.compile(r'^\s*(?:(%[\w#]+)(?::\d+)? = )?"?(llo\.[\w.]+|scf\.\w+)"?')
_FOR = re.compile(
    r"scf\.for (%\w+) = (%[\w#]+) to (%[\w#]+) step (%[\w#]+)"
)  # a bound may be a loop result (%r#1)
_IF = re.compile(r"scf\.if (%\w+)")
_CONSTANT = re.compile(r"llo\.constant \{value = (-?\d+) : i\d+\}")
_OPERANDS = re.compile(r"%[\w]+")

# Op groups. TPU7x's MXU ops: weight pushes (vmatprep.subr, vlatch*), LHS pushes
# (vmatprep.mubr, vmatmul), result pops (vmatres) and the weight-latch swap (vdwg).
_MXU = re.compile(r"^v(mat|latch|dwg)")
_LOAD = re.compile(r"^vector_load")
_STORE = re.compile(r"^vector_store")
_SYNC = re.compile(r"^v(sync|wait)")
GROUPS = ("vpu", "mxu", "loads", "stores", "dmas")


def op_group(op: str) -> str | None:
    """The profile group of an llo op (without the ``llo.`` prefix); None: scalar or
    bookkeeping (constants, address arithmetic, semaphores), not counted."""
    if op == "enqueue_dma":
        return "dmas"
    if _LOAD.match(op):
        return "loads"
    if _STORE.match(op):
        return "stores"
    if _MXU.match(op):
        return "mxu"
    if op.startswith("v") and not _SYNC.match(op):
        return "vpu"
    return None


@dataclass
class Op:
    group: str
    frames: Frames


@dataclass
class Loop:
    iv: str
    lower: str
    upper: str
    step: str
    body: list = field(default_factory=list)
    loc: str = ""
    frames: Frames = ()


@dataclass
class If:
    cond: str
    then: list = field(default_factory=list)
    other: list = field(default_factory=list)
    loc: str = ""
    frames: Frames = ()


@dataclass
class LloKernel:
    """The kernel function of one dump: its op tree, scalar definitions and call stacks."""

    body: list
    defs: dict[str, tuple[str, tuple[str, ...]]]  # SSA name -> (op, operands)
    constants: dict[str, int]
    locs: dict[str, str]  # loc id -> its text
    ivs: set[str] = field(default_factory=set)  # the loops' induction variables
    _memo: dict[str, Frames] = field(default_factory=dict)

    def frames(self, loc: str) -> Frames:
        return _frames(self.locs, loc, self._memo)


def _frames(locs: dict[str, str], loc: str, memo: dict[str, Frames]) -> Frames:
    if loc in memo:
        return memo[loc]
    text = locs.get(loc, "unknown")
    result: Frames = ()
    if m := _CALLSITE.match(text):
        result = _frames(locs, m.group(1), memo) + _frames(locs, m.group(2), memo)
    elif m := _NAMED.match(text):
        # JAX names a Python frame by its function around a file location; any other
        # name (an op's name stack, "dot_general:") wraps another location.
        child = locs.get(m.group(2), "")
        result = (m.group(1),) if _FILE_LOC.match(child) else _frames(locs, m.group(2), memo)
    memo[loc] = result
    return result


def parse_llo(text: str) -> LloKernel:
    """The first function of a post-finalize LLO dump (the kernel; the others are the
    BlockSpec index maps).

    MLIR reuses SSA names in sibling regions (two ring loops both name their induction
    variable ``%scan3A_3174``), so every name is kept as ``name@region`` of the region
    that defines it and operands resolve through the enclosing regions."""
    locs: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("#loc") and (m := _LOC_DEF.match(line)):
            locs[m.group(1)] = m.group(2)
    parser = _KernelParser(LloKernel(body=[], defs={}, constants={}, locs=locs))
    inside = False
    for line in text.splitlines():
        stripped = line.strip()
        if not inside:
            inside = stripped.startswith("func.func")
            continue
        if line.startswith("  }") and not line.startswith("   "):
            break  # the kernel function ends
        if stripped.startswith("}"):
            parser.close_region(stripped)
        elif (m := _OP.match(line)) is not None:
            parser.add_op(line, stripped, m)
    _add_context(parser.kernel, parser.kernel.body, ())
    return parser.kernel


class _KernelParser:
    """parse_llo inside the kernel function: the regions open (each with the block its
    ops go to), the SSA names each region defines, and the frames of the last op that
    had a location."""

    def __init__(self, kernel: LloKernel) -> None:
        self.kernel = kernel
        self.stack: list[tuple[list, Loop | If | None]] = []
        self.scopes: list[dict[str, str]] = [{}]
        self.current = kernel.body
        self.last: Frames = ()
        self.regions = 0

    def define(self, name: str) -> str:
        self.scopes[-1][name] = f"{name}@{self.regions}"
        return self.scopes[-1][name]

    def resolve(self, name: str) -> str:
        return next((scope[name] for scope in reversed(self.scopes) if name in scope), name)

    def _enter(self, block: list) -> None:
        self.current = block
        self.regions += 1
        self.scopes.append({})

    def close_region(self, stripped: str) -> None:
        """A line ``}``: a region ends (``} else {``: a guard's other region begins)."""
        self.last = ()
        self.scopes.pop()
        if stripped.startswith("} else {"):
            node = self.stack[-1][1]
            assert isinstance(node, If)
            self._enter(node.other)
            return
        if stripped.startswith("} do {"):  # a while loop's condition ends, its body begins
            self._enter([])
            return
        parent, node = self.stack.pop()
        if node is not None and (m := _OP_LOC.search(stripped)):
            node.loc = m.group(1)
        self.current = parent

    def open_region(self, stripped: str) -> None:
        """An op that opens a region: a loop or a guard (anything else, such as a while
        loop of scalar work, is kept out)."""
        node: Loop | If | None = None
        if (f := _FOR.search(stripped)) is not None:
            iv, lower, upper, step = f.groups()
            node = Loop("", self.resolve(lower), self.resolve(upper), self.resolve(step))
        elif (g := _IF.search(stripped)) is not None:
            node = If(self.resolve(g.group(1)))
        if node is not None:
            self.current.append(node)
        self.stack.append((self.current, node))
        self.last = ()
        self._enter(node.body if isinstance(node, Loop) else node.then if node else [])
        if isinstance(node, Loop):
            node.iv = self.define(iv)
            self.kernel.ivs.add(node.iv)

    def add_op(self, line: str, stripped: str, m: re.Match[str]) -> None:
        """An op: its definition (a constant's value, else its operands) and, when it is
        counted, an Op in the current block."""
        result, op = m.group(1), m.group(2)
        if stripped.endswith("{"):
            self.open_region(stripped)
            return
        loc_match = _OP_LOC.search(stripped)
        loc = loc_match.group(1) if loc_match else ""
        kernel = self.kernel
        name = op.removeprefix("llo.")
        if result is not None:
            if name == "constant" and (c := _CONSTANT.search(stripped)):
                kernel.constants[self.define(result)] = int(c.group(1))
            else:
                rest = line[m.end() :].split(" loc(")[0].split(":")[0].split("{")[0]
                operands = tuple(self.resolve(a) for a in _OPERANDS.findall(rest))
                kernel.defs[self.define(result)] = (name, operands)
        group = op_group(name) if op.startswith("llo.") else None
        if group is not None:
            # Some lowerings (select_n) leave no source location: such an op belongs to
            # the code of the op before it in the same block (else to the block's).
            self.last = kernel.frames(loc) or self.last
            self.current.append(Op(group, self.last))


def _add_context(kernel: LloKernel, block: list, context: Frames) -> None:
    """Append the call stack of the enclosing loops and guards to every op's frames:
    the location of an op inside a loop body or a guarded block stops at that body's
    function (``unit_step``), the region op's own location goes on to the callers."""
    for node in block:
        if isinstance(node, Op):
            node.frames = node.frames + context
        elif isinstance(node, Loop):
            node.frames = kernel.frames(node.loc) + context
            _add_context(kernel, node.body, node.frames)
        else:
            node.frames = kernel.frames(node.loc) + context
            _add_context(kernel, node.then, node.frames)
            _add_context(kernel, node.other, node.frames)


_BINARY: dict[str, Callable[[int, int], int]] = {
    "sadd": lambda a, b: a + b,
    "ssub": lambda a, b: a - b,
    "smul": lambda a, b: a * b,
    "sdiv": lambda a, b: int(a / b) if b else 0,
    "srem": lambda a, b: a - b * int(a / b) if b else 0,
    "sfloordiv": lambda a, b: a // b if b else 0,
    "sfloorrem": lambda a, b: a % b if b else 0,
    "smin": min,
    "smax": max,
    "slt": lambda a, b: int(a < b),
    "sle": lambda a, b: int(a <= b),
    "sgt": lambda a, b: int(a > b),
    "sge": lambda a, b: int(a >= b),
    "seq": lambda a, b: int(a == b),
    "sne": lambda a, b: int(a != b),
    "pand": lambda a, b: a & b,
    "sand": lambda a, b: a & b,
    "por": lambda a, b: a | b,
    "sor": lambda a, b: a | b,
}


def block_ops(block: list) -> Iterator[Op]:
    """The ops of `block` in order, loops and guards included."""
    for node in block:
        if isinstance(node, Op):
            yield node
        elif isinstance(node, Loop):
            yield from block_ops(node.body)
        else:
            yield from block_ops(node.then)
            yield from block_ops(node.other)


class StepCounter:
    """Counts a kernel's ops per step, by (frames, group), with the trip counts above.

    `trips(frames)` answers the trip count of a loop with runtime bounds, from the
    frames of the loop's location; None leaves it at one and lists it in `unresolved`.
    `taken(frames)` answers how often a guard on runtime data is taken, from the frames
    of the guard's location; None (or no `taken`) counts it as always taken.
    """

    def __init__(
        self,
        kernel: LloKernel,
        trips: Callable[[Frames], float | None],
        taken: Callable[[Frames], float | None] | None = None,
    ) -> None:
        self.kernel = kernel
        self.trips = trips
        self.taken = taken
        self.unresolved: list[Frames] = []
        self._memo: dict[tuple[int, tuple[int | None, ...]], Counter] = {}
        self._free: dict[int, tuple[str, ...]] = {}

    def count(self) -> Counter:
        """(frames of the op, group) -> executions per step."""
        return self._block(self.kernel.body, {})

    # ------------------------------------------------------------------ evaluation

    def _value(self, name: str, env: dict[str, int]) -> int | None:
        if name in env:
            return env[name]
        if name in self.kernel.constants:
            return self.kernel.constants[name]
        op, args = self.kernel.defs.get(name, ("", ()))
        base = op.split(".")[0]
        if base == "sselect" and len(args) == 3:
            cond = self._value(args[0], env)
            return None if cond is None else self._value(args[1] if cond else args[2], env)
        if base in _BINARY and len(args) == 2:
            a, b = self._value(args[0], env), self._value(args[1], env)
            return None if a is None or b is None else _BINARY[base](a, b)
        return None

    def _uses(self, name: str, seen: set[str]) -> set[str]:
        """The SSA names a scalar value is computed from (transitively)."""
        if name in seen:
            return set()
        seen.add(name)
        out = {name}
        for arg in self.kernel.defs.get(name, ("", ()))[1]:
            out |= self._uses(arg, seen)
        return out

    def _free_ivs(self, block: list) -> tuple[str, ...]:
        """Induction variables of enclosing loops that guards or bounds in `block` use."""
        key = id(block)
        if key not in self._free:
            used: set[str] = set()
            own: set[str] = set()
            for node in block:
                if isinstance(node, Loop):
                    own.add(node.iv)
                    used |= self._uses(node.lower, set()) | self._uses(node.upper, set())
                    used |= set(self._free_ivs(node.body))
                elif isinstance(node, If):
                    used |= self._uses(node.cond, set())
                    used |= set(self._free_ivs(node.then)) | set(self._free_ivs(node.other))
            self._free[key] = tuple(sorted((used - own) & self.kernel.ivs))
        return self._free[key]

    # ------------------------------------------------------------------ counting

    def _block(self, block: list, env: dict[str, int]) -> Counter:
        free = self._free_ivs(block)
        key = (id(block), tuple(env.get(v) for v in free))
        if key in self._memo:
            return self._memo[key]
        total: Counter = Counter()
        for node in block:
            if isinstance(node, Op):
                total[(node.frames, node.group)] += 1
            elif isinstance(node, If):
                cond = self._value(node.cond, env)
                if cond is None and self.taken is not None:
                    share = self.taken(node.frames)
                    if share is not None:
                        for key, n in self._block(node.then, env).items():
                            total[key] += n * share
                        total.update(self._block(node.other, env))
                        continue
                if cond is None or cond:
                    total.update(self._block(node.then, env))
                if cond is None or not cond:
                    total.update(self._block(node.other, env))
            else:
                total.update(self._loop(node, env))
        self._memo[key] = total
        return total

    def _loop(self, loop: Loop, env: dict[str, int]) -> Counter:
        lower, upper = self._value(loop.lower, env), self._value(loop.upper, env)
        step = self._value(loop.step, env) or 1
        if lower is None or upper is None:
            frames = loop.frames
            trips = self.trips(frames)
            if trips is None:
                self.unresolved.append(frames)
                trips = 1
            return _scaled(self._block(loop.body, env), trips)
        iterations = range(lower, upper, step)
        if loop.iv not in self._free_ivs(loop.body):
            return _scaled(self._block(loop.body, env), len(iterations))
        total: Counter = Counter()
        for i in iterations:
            total.update(self._block(loop.body, {**env, loop.iv: i}))
        return total


def _scaled(counts: Counter, factor: float) -> Counter:
    return Counter({k: v * factor for k, v in counts.items()})
