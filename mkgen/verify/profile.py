"""`mkgen compile --profile`: the compiled kernel's op counts per phase, held against the model.

The full-size kernel is compiled as `mkgen compile` does, in a child process whose
``LIBTPU_INIT_ARGS`` asks Mosaic to dump its LLO with source locations (libtpu reads
the flags once, when it loads). mkgen.verify.llo counts the dump's ops per step; each op
goes to the phase of the generated megakernel.py function that emitted it (its call
stack), and each phase carries the model's figures (mkgen.plan.opcount) beside it.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mkgen.errors import MkgenError
from mkgen.hardware import TPU7X_ISSUE_RATES, IssueRates
from mkgen.plan.opcount import PHASES, OpCounts, bound_us, model_op_counts
from mkgen.plan.options import BuildOptions
from mkgen.spec.schema import ModelSpec
from mkgen.spec.topology import Topology
from mkgen.verify.llo import Frames, If, Loop, StepCounter, block_ops, parse_llo

DUMP_FLAGS = "--xla_mosaic_dump_to={dir} --xla_mosaic_enable_dump_debug_info=true"
LLO_SUFFIX = "post-finalize-llo.txt"

# Generated functions -> phase. The outermost such function on an op's call stack
# decides: the expert loop owns its rings, the weight stream's rings belong to the
# stream wherever a layer calls them from.
_PHASE_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("experts", ("_experts_",)),
    ("stream matmul", ("Ring.", "WeightStream.", "_slot_matmul", "_to_chunks", "_from_blocks")),
    ("attention", ("_attend_", "_write_cache_", "_cache_block_copy_")),
    ("recurrent", ("_delta_rule_step", "_conv_step")),
    ("routing", ("_route_", "_top_k")),
    ("collectives", ("Collectives.", "_round_exchange", "_to_wire", "_from_wire", "_barrier")),
)


def _function(frame: str) -> str:
    return frame.split(".<locals>")[0]


def phase_of(frames: Frames) -> str:
    """The phase of an op emitted under `frames` (innermost first): that of the outermost
    function with a phase. Outermost, because Pallas emits some lowering rules as
    functions it caches by signature, whose ops keep the first caller's inner frames.
    The held refills a collective round starts are the weight stream's all the same, and
    the work a caller runs inside a collective (`_in_flight`, while a round's copies
    travel) is that of the frames inside it."""
    if any(_function(frame) == "WeightStream.release_held" for frame in frames):
        return "stream matmul"
    inside = next((i for i, frame in enumerate(frames) if _function(frame) == "_in_flight"), None)
    if inside is not None:
        frames = frames[:inside]
    for frame in reversed(frames):
        name = _function(frame)
        for phase, prefixes in _PHASE_RULES:
            if name.startswith(prefixes):
                return phase
    return "vector"


def kind_of(frames: Frames, kinds: set[str]) -> str | None:
    """The layer kind whose function (``_attention_mla``, ``_experts_moe``...) emitted
    the op, or None for code every layer runs. The outermost such frame decides: JAX
    reuses a traced body for the same code of another kind (a local and a global
    attention's cache write), so inner frames may name the kind traced first."""
    for frame in reversed(frames):
        name = _function(frame)
        for kind in kinds:
            if name.startswith("_") and name.endswith(f"_{kind}"):
                return kind
    return None


def _attach_kinds(block: list, kinds: set[str]) -> None:
    """Give every op of a guarded block that only one layer kind's code runs in (the
    layer loop's dispatch on the layer table) that kind. A ring loop of one unit is
    inlined, and its ops' locations then stop at the ring's own functions."""
    for node in block:
        if isinstance(node, Loop):
            _attach_kinds(node.body, kinds)
        elif isinstance(node, If):
            for branch in (node.then, node.other):
                found = {kind_of(op.frames, kinds) for op in block_ops(branch)} - {None}
                if len(found) == 1:
                    marker = f"_layer_kind_{found.pop()}"
                    for op in block_ops(branch):
                        op.frames = op.frames + (marker,)
                else:
                    _attach_kinds(branch, kinds)


def compiled_op_counts(llo_text: str, plan: Any, spec: ModelSpec) -> dict[str, OpCounts]:
    """Per-step op counts of each phase from an LLO dump of `plan`'s kernel."""
    from mkgen.plan.options import kv_tiles

    schedule = plan.step_graph.schedule
    dims = plan.vmem.dims
    layers = Counter[str]()
    for layer_kind in schedule.layer_kinds:
        for kind in layer_kind.split("/"):
            layers[kind] += 1
    experts: dict[str, list[int]] = {}
    for layer, (n, _pieces) in schedule.experts_per_layer.items():
        experts.setdefault(schedule.layer_kinds[layer].split("/")[1], []).append(n)

    # A reached bank's refill starts at once unless it is held for the next collective.
    refills = schedule.refills

    def trips(frames: Frames) -> float | None:
        """Runtime-bounded loops: KV tiles of one (sequence, kv head) over a full cache,
        the experts this core runs in a layer, the held refills a collective round starts."""
        kind = kind_of(frames, set(layers))
        names = [_function(f) for f in frames]
        if "WeightStream.release_held" in names:
            return refills["started by releases"] / max(1, refills["releases"])
        if kind is None:
            return None
        if f"_attend_{kind}" in names:
            window = getattr(spec.attention_kinds[kind], "sliding_window", None)
            return kv_tiles(dims.context, dims.kv_tiles[kind], window, dims.rows)
        if f"_experts_{kind}" in names and kind in experts:
            return sum(experts[kind]) / len(experts[kind])
        return None

    # The weight stream's chunks wait for and refill a bank only where a chunk first
    # reaches it, and a bank copies its first rows past the ring only in slot 0: guards on
    # runtime rows, taken as often as the plan reaches banks.
    stream_chunks = sum(
        n.key[5] * n.repeat for n in schedule.nodes if n.cat == "matmul" and n.key[1] == "bf16"
    )
    stream_banks = sum(n.repeat for n in schedule.nodes if n.cat == "bank")

    def taken(frames: Frames) -> float | None:
        where = _function(frames[0]) if frames else ""
        if where in ("WeightStream.start", "WeightStream.wait"):  # the wrap copy: slot 0
            return 1 / plan.vmem.ring_depth
        if where == "WeightStream.release_after" and refills["reached"]:
            return refills["started on reaching"] / refills["reached"]
        if where == "WeightStream._chunk" and stream_chunks:
            return min(1.0, stream_banks / stream_chunks)
        return None

    kernel = parse_llo(llo_text)
    _attach_kinds(kernel.body, set(layers))
    counter = StepCounter(kernel, trips, taken)
    counts = counter.count()
    if counter.unresolved:
        where = ", ".join(sorted({" < ".join(f[:2]) for f in counter.unresolved}))
        raise MkgenError(
            f"the LLO dump has runtime-bounded loops the profile cannot count: {where}"
        )
    total_layers = len(schedule.layer_kinds)
    out = {phase: OpCounts() for phase in PHASES}
    for (frames, group), n in counts.items():
        kind = kind_of(frames, set(layers))
        # A kind's code sits under the layer loop (counted for every layer) behind a
        # guard on the layer table: it runs in the layers of that kind only.
        scale = layers[kind] / total_layers if kind is not None else 1.0
        out[phase_of(frames)].add(group, n * scale)
    return out


# ---------------------------------------------------------------- the compile


def compile_with_dump(
    spec: ModelSpec, topology: Topology, options: BuildOptions, header: str, timeout: float
) -> tuple[dict[str, Any], str]:
    """Compile the full-size kernel in a child process with Mosaic's LLO dump on:
    (the compile record, the kernel's LLO text). Raises CompileError on Mosaic's refusal."""
    from mkgen.verify.tpu_compile import CompileError

    with tempfile.TemporaryDirectory(prefix="mkgen-profile-") as work:
        root = Path(work)
        job = root / "job.pickle"  # written and read by mkgen alone, in its own folder
        job.write_bytes(pickle.dumps((spec, topology, options, header)))
        dump = root / "dump"
        # Mosaic writes the dump only when it compiles: never a cached executable.
        env = {
            **os.environ,
            "LIBTPU_INIT_ARGS": DUMP_FLAGS.format(dir=dump),
            "JAX_ENABLE_COMPILATION_CACHE": "false",
        }
        env.setdefault("JAX_PLATFORMS", "cpu")
        try:
            result = subprocess.run(
                [sys.executable, "-m", "mkgen.verify.profile", str(job)],
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as error:
            raise MkgenError(f"the profile compile took over {timeout:.0f} s") from error
        lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
        if result.returncode or not lines:
            tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise MkgenError(f"the profile compile failed: {tail}")
        record = json.loads(lines[-1])
        if "error" in record:
            raise CompileError(record["error"])
        dumps = sorted(dump.glob(f"*{LLO_SUFFIX}"), key=lambda p: p.stat().st_size)
        if not dumps:
            raise MkgenError(f"libtpu wrote no *{LLO_SUFFIX} (LIBTPU_INIT_ARGS not honoured?)")
        return record, dumps[-1].read_text()


def _child(job_path: str) -> None:
    from mkgen.verify.checks import compile_full_size
    from mkgen.verify.tpu_compile import CompileError

    spec, topology, options, header = pickle.loads(Path(job_path).read_bytes())
    try:
        outcome = compile_full_size(spec, topology, options, header)
    except CompileError as error:
        print(json.dumps({"error": str(error)}))
        return
    print(json.dumps(outcome.record()))


# ---------------------------------------------------------------- the table


@dataclass(frozen=True)
class PhaseProfile:
    name: str
    compiled: OpCounts
    model: OpCounts

    def bound_us(self, rates: IssueRates) -> dict[str, float]:
        """Microseconds per step the compiled ops need at each unit's issue rate."""
        return bound_us(self.compiled, rates)

    def record(self, rates: IssueRates) -> dict[str, Any]:
        c, m = self.compiled, self.model
        return {
            "name": self.name,
            "compiled_vpu_ops": round(c.vpu),
            "model_vpu_ops": round(m.vpu),
            "compiled_mxu_pushes": round(c.mxu),
            "model_mxu_pushes": round(m.mxu),
            "compiled_vector_loads": round(c.loads),
            "model_vector_loads": round(m.loads),
            "compiled_vector_stores": round(c.stores),
            "model_vector_stores": round(m.stores),
            "compiled_dmas": round(c.dmas),
            "model_dmas": round(m.dmas),
            **{f"{unit}_bound_us": round(us, 3) for unit, us in self.bound_us(rates).items()},
        }


@dataclass(frozen=True)
class Profile:
    build: str
    phases: list[PhaseProfile]
    unpriced: list[str]  # weight formats and attention geometries the model has not measured
    dma_timeline_us: float  # the plan's DMA engine busy time (predicted)
    predicted_step_us: float  # the plan's predicted step: the walk's end
    point: str  # the build's batch x rows
    rates: IssueRates

    @property
    def compute_us(self) -> float:
        """The step's compute timeline: each phase at its slowest unit, phases in turn."""
        return sum(max(p.bound_us(self.rates).values()) for p in self.phases)

    @property
    def vpu_ops(self) -> float:
        return sum(p.compiled.vpu for p in self.phases)

    def record(self) -> dict[str, Any]:
        return {
            "build": self.build,
            "phases": [p.record(self.rates) for p in self.phases],
            "unpriced_formats": self.unpriced,
            "compute_us": round(self.compute_us, 3),
            "dma_timeline_us": round(self.dma_timeline_us, 3),
            "predicted_step_us": round(self.predicted_step_us, 3),
            "point": self.point,
            "compute_bound": self.compute_us > self.dma_timeline_us,
            "issue_rates": self.rates.model_dump(exclude={"clock_range_hz", "clock_source"}),
        }

    def lines(self) -> list[str]:
        def ratio(compiled: float, model: float) -> str:
            return f"{model / compiled:6.2f}" if compiled else "     -"

        out = [
            "  profile per step and core (compiled LLO x trip counts; model = the plan priced "
            "per phase; model/compiled):",
            f"  {'phase':<14} {'VPU ops':>12} {'model':>6} {'MXU ops':>11} {'model':>6} "
            f"{'loads':>10} {'stores':>9} {'DMAs':>6} {'model':>6} "
            f"{'VPU us':>8} {'MXU us':>8} {'load us':>8}",
        ]
        total = self.vpu_ops or 1.0
        for p in self.phases:
            c, m, bound = p.compiled, p.model, p.bound_us(self.rates)
            out.append(
                f"  {p.name:<14} {c.vpu:>12,.0f} {ratio(c.vpu, m.vpu)} {c.mxu:>11,.0f} "
                f"{ratio(c.mxu, m.mxu)} {c.loads:>10,.0f} {c.stores:>9,.0f} {c.dmas:>6,.0f} "
                f"{ratio(c.dmas, m.dmas)} {bound['vpu']:>8.1f} {bound['mxu']:>8.1f} "
                f"{bound['load']:>8.1f}  ({100 * c.vpu / total:.1f} % of VPU ops)"
            )
        if self.unpriced:
            out.append(f"  the model has no measurement for: {', '.join(self.unpriced)}")
        bound = "compute-bound" if self.compute_us > self.dma_timeline_us else "DMA-bound"
        out.append(
            f"  compute timeline {self.compute_us:.1f} us vs the plan's DMA timeline "
            f"{self.dma_timeline_us:.1f} us (predicted step {self.predicted_step_us:.1f} us at "
            f"{self.point}): {bound} (at {self.rates.clock_hz / 1e9:.2f} GHz, "
            f"{self.rates.vpu_ops_per_cycle:g} VPU / {self.rates.mxu_ops_per_cycle:g} MXU ops "
            "a cycle: mkgen/hardware.py TPU7X_ISSUE_RATES)"
        )
        return out


def profile_build(llo_text: str, plan: Any, spec: ModelSpec, build: str) -> Profile:
    """The compiled kernel's phases beside the model's."""
    compiled = compiled_op_counts(llo_text, plan, spec)
    model, unpriced = model_op_counts(
        plan.step_graph.schedule, plan.stream, plan.vmem, plan.sharding, spec, plan.kinds
    )
    phases = [
        PhaseProfile(name, compiled[name], model[name])
        for name in PHASES
        if compiled[name].any() or model[name].any()
    ]
    return Profile(
        build=build,
        phases=phases,
        unpriced=unpriced,
        dma_timeline_us=plan.estimate.dma_timeline_ms * 1000,
        predicted_step_us=plan.estimate.step_ms * 1000,
        point=plan.estimate.point,
        rates=TPU7X_ISSUE_RATES,
    )


if __name__ == "__main__":
    _child(sys.argv[1])
