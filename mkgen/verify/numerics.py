"""Interpret-mode numerics: a generated kernel against the reference model, on CPU.

`verify_numerics` runs in a subprocess (`python -m mkgen.verify.numerics`) because
the number of virtual CPU devices (`--xla_force_host_platform_device_count`) must be
set before JAX is imported, and because an unbalanced semaphore hangs forever. A hung
kernel is found by its CPU time: every thread then waits on a semaphore that jax's
interpreter polls ten times a second, so the child uses almost no CPU. A child that stays
under STALL_CPU_SHARE of one core for STALL_SECONDS exits at once with STALL_EXIT (any
running process gets far more than that share, however busy the machine); the parent
still kills a child that outlives the timeout.

The child renders the kernel for the spec's mini twin on a mesh shaped like the
topology, packs the reference's random weights (rounded to bf16, the kernel's
storage) into the per-core layout, and runs decode steps in TPU interpret mode with
race detection, uninitialised memory as NaN and the given DMA execution mode. Each
step is held against the reference fed the same tokens:

- logits: max |kernel - reference| <= LOGIT_ATOL + LOGIT_RTOL * max |reference|
  (the kernel multiplies bf16 activations; the reference stays in f32);
- greedy tokens: equal, unless the reference's top two logits are closer than the
  logit tolerance (a near tie that bf16 rounding may flip);
- caches: every key/value row the step wrote (and every recurrent state), within
  CACHE_RTOL of the reference's largest entry (both store bf16);
- routing: every MoE layer's chosen experts for every token (the verification build
  returns them) against the reference's top-k. Where they differ, the kernel's choice is
  a near tie when it is still a top-k choice once every router choice value may move by
  ROUTE_RTOL of the token's largest (grouped routers: and every group score by ROUTE_RTOL
  of the largest group score): bf16 activations may flip it. A near tie is reported and
  the reference takes the kernel's experts for that token and layer, so that both sides
  go on from the same choice; any other difference fails, naming layer, token and experts;
- the residual stream after every layer, within RESIDUAL_RTOL of its largest value:
  the first layer beyond it is named (the kernel's verification build returns it);
- the hidden states the drafter reads (a spec with a draft section at rows > 1: the
  kernel's draft-hidden output) against the reference's at the same layers and rows
  (mkgen.reference.draft.target_hidden), within RESIDUAL_RTOL of each one's largest value;
- finiteness: a NaN anywhere (uninitialised VMEM reads) fails;
- every core's greedy tokens and residual stream after every layer are identical bit
  for bit (the staged collectives combine in member order; the verification build
  returns them per core).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from mkgen.errors import MkgenError
from mkgen.host_devices import cpu_device_variables

LOGIT_ATOL = 1e-2
LOGIT_RTOL = 2e-2
CACHE_RTOL = 2e-2
RESIDUAL_RTOL = 2e-2
ROUTE_RTOL = 2e-2  # the tie window of router choice values, relative to the token's largest
# A fused drafter's draft differs from the reference's only where the reference's top two
# draft logits are this many times the step's largest verify-row logit difference apart,
# or closer (its passes run the same kernel code as the verify rows; the logits' own
# tolerance, ten times that difference on the twins, let a wrong pass's draft through).
DRAFT_TIE_FACTOR = 4.0
INTERPRET_MODES = ("on_wait", "eager")
STEP_DONE = "mkgen-verify: step done"  # the child's stderr line after each decode step
STALL_SECONDS = 10.0
STALL_CPU_SHARE = 0.01
STALL_EXIT = 3  # the child's exit status when it stalled


@dataclass
class StepCheck:
    step: int
    max_logit_diff: float
    logit_tolerance: float
    tokens_equal: int
    tokens_near_tie: int
    tokens_total: int
    max_cache_diff: float
    cache_tolerance: float
    max_residual_diff: float
    residual_tolerance: float
    first_diverging_layer: int | None  # the first layer whose residual stream is off
    finite: bool
    cores_identical: bool  # every core's tokens, residual stream and routing equal bit for bit
    seconds: float
    # Routing differences inside the tie window (the reference took the kernel's experts),
    # and the first one outside it with its layer.
    route_ties: list[str] = field(default_factory=list)
    route_mismatch: str | None = None
    route_mismatch_layer: int | None = None
    # The drafter's hidden states (none without a drafter): the first beyond its tolerance.
    draft_hidden_states: int = 0
    max_draft_hidden_diff: float = 0.0
    draft_hidden_mismatch: str | None = None
    # A fused drafter (none without one): its drafts equal to the reference drafter's, or
    # after a near tie of the reference's draft logits (a chain goes on from the other
    # choice); its accepted rows against the accept rule on its own greedy tokens.
    drafts_total: int = 0
    drafts_equal: int = 0
    drafts_near_tie: int = 0
    drafts_mismatch: str | None = None  # the first sequence's chain that differs
    # The drafter's cache entries the step wrote at the accepted rows and the drafts both
    # sides made alike, against the reference drafter's.
    max_draft_cache_diff: float = 0.0
    draft_cache_mismatch: str | None = None
    accepted: list[int] = field(default_factory=list)  # a sequence's accepted rows each
    accepted_mismatch: str | None = None

    @property
    def passed(self) -> bool:
        return (
            self.finite
            and self.cores_identical
            and self.route_mismatch is None
            and self.max_logit_diff <= self.logit_tolerance
            and self.tokens_equal + self.tokens_near_tie == self.tokens_total
            and self.max_cache_diff <= self.cache_tolerance
            and self.first_diverging_layer is None
            and self.draft_hidden_mismatch is None
            and self.accepted_mismatch is None
            and self.draft_cache_mismatch is None
            and self.drafts_mismatch is None
            and self.drafts_equal + self.drafts_near_tie == self.drafts_total
        )

    def failure(self) -> str | None:
        if not self.finite:
            return f"step {self.step}: non-finite logits or caches (uninitialised memory read?)"
        if not self.cores_identical:
            return (
                f"step {self.step}: the cores' residual streams, routing or tokens differ bit "
                "for bit"
            )
        # Whichever is first in layer order: a residual stream already off changes the
        # routing of later layers, and a wrong routing the residual stream of its layer.
        diverged = self.first_diverging_layer
        if self.route_mismatch_layer is not None and (
            diverged is None or self.route_mismatch_layer <= diverged
        ):
            return f"step {self.step}: {self.route_mismatch}"
        if diverged is not None:
            return (
                f"step {self.step}: layer {diverged} diverges first: its "
                f"residual stream differs by {self.max_residual_diff:.4g} "
                f"(tolerance {self.residual_tolerance:.4g})"
            )
        if self.max_logit_diff > self.logit_tolerance:
            return (
                f"step {self.step}: logits differ by {self.max_logit_diff:.4g} "
                f"(tolerance {self.logit_tolerance:.4g})"
            )
        if self.tokens_equal + self.tokens_near_tie != self.tokens_total:
            wrong = self.tokens_total - self.tokens_equal - self.tokens_near_tie
            return f"step {self.step}: {wrong} greedy token(s) differ"
        if self.max_cache_diff > self.cache_tolerance:
            return f"step {self.step}: cache rows differ by {self.max_cache_diff:.4g}"
        if self.draft_hidden_mismatch is not None:
            return f"step {self.step}: {self.draft_hidden_mismatch}"
        if self.accepted_mismatch is not None:
            return f"step {self.step}: {self.accepted_mismatch}"
        if self.draft_cache_mismatch is not None:
            return f"step {self.step}: {self.draft_cache_mismatch}"
        if self.drafts_mismatch is not None:
            return f"step {self.step}: {self.drafts_mismatch}"
        return None


@dataclass
class NumericsReport:
    spec: str
    topology: str
    devices: int
    mode: str
    batch: int
    rows: int
    steps: list[StepCheck] = field(default_factory=list)
    error: str | None = None

    @property
    def passed(self) -> bool:
        return self.error is None and all(s.passed for s in self.steps)

    def failure(self) -> str | None:
        if self.error:
            return self.error
        return next((s.failure() for s in self.steps if not s.passed), None)


# ---------------------------------------------------------------- the parent side


def verify_numerics(
    spec_ref: str,
    topology: str,
    *,
    mode: str,
    steps: int = 2,
    batch: int = 1,
    rows: int = 1,
    context: int = 128,
    seed: int = 0,
    timeout: float = 900.0,
    quant: tuple[str, ...] = (),
    knobs: dict[str, Any] | None = None,
    mutations: list[tuple[str, str]] | None = None,
    on_step: Callable[[], None] | None = None,
    draft: str | None = None,
) -> NumericsReport:
    """Run the child process and return its report (a timeout is a failure, not a hang).

    `quant` (FAMILY=FORMAT) are the build's format overrides: the twin is made from the
    spec as built, with its own (smaller) blocks. `knobs` are the kernel knobs of the build
    (ring_depth, expert_slots, collectives, ...): the twin is rendered with them.

    `mutations` (tests only) are (old, new) text replacements applied to the rendered
    kernel, to prove that a broken schedule is caught. `on_step` is called as each decode
    step finishes in the child (a progress bar). With the knob `fuse_draft` the twin drafts
    with the spec's mtp drafter inside the kernel (mkgen/plan/fused.py); its drafts and
    accepted rows are held against the reference drafter's and the accept rule. `draft`
    names the drafter the build carries (`--draft`: mtp, a drafter spec or config.json),
    attached to the spec before its twin is made."""
    from mkgen.spec.topology import parse_topology

    if mode not in INTERPRET_MODES:
        raise MkgenError(f"unknown DMA execution mode {mode!r}; use one of {INTERPRET_MODES}")
    devices = parse_topology(topology).num_devices
    env = {**os.environ, **cpu_device_variables(devices, os.environ)}
    args = [
        sys.executable, "-m", "mkgen.verify.numerics", spec_ref, topology, mode,
        str(steps), str(batch), str(rows), str(context), str(seed),
        json.dumps(list(quant)), json.dumps(knobs or {}), json.dumps(mutations or []),
        json.dumps(draft),
    ]  # fmt: skip
    report = NumericsReport(spec_ref, topology, devices, mode, batch, rows)
    returncode, stdout, stderr = _run_streaming(args, env, timeout, on_step)
    if returncode is None:
        # A hang exits sooner by itself (STALL_EXIT): this child was still computing.
        report.error = (
            f"timed out after {timeout:.0f} s while still computing (a hang would have "
            "stopped as stalled); give it more time with --timeout"
        )
        return report
    if returncode == STALL_EXIT:
        report.error = (
            f"stalled: no progress for {STALL_SECONDS:.0f} s (every thread waits on a "
            "semaphore that is never signalled: deadlock)"
        )
        return report
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if returncode or not lines:
        tail = (stderr.strip().splitlines() or ["no output"])[-1]
        report.error = f"the interpret-mode run failed: {tail}"
        return report
    data = json.loads(lines[-1])
    if "error" in data:
        report.error = f"the interpret-mode run failed: {data['error']}"
        return report
    report.steps = [StepCheck(**s) for s in data["steps"]]
    return report


# ---------------------------------------------------------------- routing near ties


@dataclass(frozen=True)
class RouteDifference:
    """One token of one MoE layer whose kernel experts differ from the reference's."""

    layer: int
    token: int
    kernel: tuple[int, ...]  # the kernel's experts, ascending
    reference: tuple[int, ...]  # the reference's top-k, ascending
    # How far the kernel's choice is from being a top-k one, relative to the token's
    # largest choice value (or group score): its weakest expert's shortfall below the best
    # one it left out. Infinite when no perturbation explains it (ids out of range,
    # repeated, or from more groups than the router keeps).
    gap: float

    @property
    def near_tie(self) -> bool:
        return self.gap <= ROUTE_RTOL

    def describe(self) -> str:
        kernel, reference = list(self.kernel), list(self.reference)
        if self.near_tie:
            return (
                f"layer {self.layer} token {self.token}: near tie, the kernel chose experts "
                f"{kernel} for the reference's {reference} (gap {self.gap:.2%} of the largest "
                f"choice value, window {ROUTE_RTOL:.0%}); the reference took the kernel's"
            )
        gap = "no perturbation explains it" if self.gap == float("inf") else f"gap {self.gap:.2%}"
        return (
            f"layer {self.layer} token {self.token} routes to experts {kernel}, the reference "
            f"to {reference}: not a near tie ({gap} of the largest choice value, window "
            f"{ROUTE_RTOL:.0%})"
        )


def _shortfall(values: Any, picked: Any, eligible: Any) -> float:
    """How far the weakest picked value falls below the best eligible unpicked one,
    relative to the largest |value| (<= 0: the picks are a top set)."""
    import numpy as np

    others = eligible & ~picked
    if not others.any():
        return 0.0
    scale = max(float(np.abs(values).max()), np.finfo(np.float32).tiny)
    return float(values[others].max() - values[picked].min()) / scale


def _route_gap(choice: Any, kernel: Any, top_k: int, n_group: int, topk_group: int) -> float:
    """The relative gap of one token's kernel experts (RouteDifference.gap). Grouped
    routers: the kernel's experts must lie in at most topk_group groups; those groups,
    filled up with the best-scoring others, must be a top set of group scores (a group
    scores the sum of its two best choice values) and the experts a top set among them."""
    import numpy as np

    experts = choice.shape[0]
    if len(set(kernel.tolist())) != top_k or kernel.min() < 0 or kernel.max() >= experts:
        return float("inf")
    picked = np.zeros(experts, bool)
    picked[kernel] = True
    if n_group <= 1:
        return max(_shortfall(choice, picked, np.ones(experts, bool)), 0.0)
    per_group = experts // n_group
    grouped = choice.reshape(n_group, per_group)
    group_scores = np.sort(grouped, axis=1)[:, -min(2, per_group) :].sum(axis=1)
    kept = np.zeros(n_group, bool)
    kept[np.unique(kernel // per_group)] = True
    if kept.sum() > topk_group:
        return float("inf")
    for g in np.argsort(-group_scores, kind="stable"):
        if kept.sum() == topk_group:
            break
        kept[g] = True
    eligible = np.repeat(kept, per_group)
    return max(
        _shortfall(group_scores, kept, np.ones(n_group, bool)),
        _shortfall(choice, picked, eligible),
        0.0,
    )


def resolve_routes(
    layer: int,
    choice: Any,
    reference: Any,
    kernel: Any,
    *,
    n_group: int = 1,
    topk_group: int = 1,
) -> tuple[Any, list[RouteDifference]]:
    """(the experts the reference uses [N, top_k], every token whose kernel experts
    differ): the reference's own top-k, or the kernel's where the two differ inside the
    tie window. choice [N, E] are the router's choice values before group masking,
    reference and kernel [N, top_k] expert ids."""
    import numpy as np

    choice, reference, kernel = np.asarray(choice), np.asarray(reference), np.asarray(kernel)
    top_k = reference.shape[1]
    used = reference.copy()
    differences = []
    for token in range(len(reference)):
        ours, theirs = sorted(kernel[token].tolist()), sorted(reference[token].tolist())
        if ours == theirs:
            continue
        gap = _route_gap(choice[token], kernel[token], top_k, n_group, topk_group)
        difference = RouteDifference(layer, token, tuple(ours), tuple(theirs), gap)
        differences.append(difference)
        if difference.near_tie:
            used[token] = kernel[token]
    return used, differences


def _run_streaming(
    args: list[str], env: dict[str, str], timeout: float, on_step: Callable[[], None] | None
) -> tuple[int | None, str, str]:
    """Run the child; (exit status or None on timeout, stdout, stderr without the step
    lines), calling `on_step` for each STEP_DONE line as it comes. Both pipes are drained
    by threads so that neither can fill up and stall the child."""
    process = subprocess.Popen(
        args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    stdout: list[str] = []
    stderr: list[str] = []

    def drain_stderr() -> None:
        for line in process.stderr:
            if line.startswith(STEP_DONE):
                if on_step is not None:
                    on_step()
            else:
                stderr.append(line)

    readers = [
        threading.Thread(target=lambda: stdout.append(process.stdout.read()), daemon=True),
        threading.Thread(target=drain_stderr, daemon=True),
    ]
    for reader in readers:
        reader.start()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return None, "", ""
    for reader in readers:
        reader.join()
    return process.returncode, "".join(stdout), "".join(stderr)


# ---------------------------------------------------------------- the child side


def _exit_when_stalled() -> None:
    """Watch this process's CPU time from a daemon thread and exit with STALL_EXIT once
    a window of STALL_SECONDS used less than STALL_CPU_SHARE of one core (a deadlock)."""

    def watch() -> None:
        used = time.process_time()
        while True:
            time.sleep(STALL_SECONDS)
            used, before = time.process_time(), used
            if used - before < STALL_CPU_SHARE * STALL_SECONDS:
                os._exit(STALL_EXIT)  # the kernel's threads never return: no clean exit

    threading.Thread(target=watch, daemon=True).start()


_RACE_ACCESS = re.compile(r"(read|write) of \('(\w+)'.*?:(\d+):\d+ \(([^)]*)\)")


def describe_failure(error: BaseException) -> str:
    """One line for an interpret-mode failure; a race names both accesses and their code."""
    text = str(error)
    if "RACE DETECTED" in text:
        block = text[text.index("RACE DETECTED") :]
        accesses = [
            f"{kind} of {space} at line {line} ({where})"
            for kind, space, line, where in _RACE_ACCESS.findall(block)[:2]
        ]
        return "race detected: " + " vs ".join(accesses)
    lines = text.strip().splitlines() or [""]
    return f"{type(error).__name__}: {lines[0]}"


def _run_child(
    spec_ref: str,
    topology_text: str,
    mode: str,
    steps: int,
    batch: int,
    rows: int,
    context: int,
    seed: int,
    quant: list[str],
    knobs: dict[str, Any],
    mutations: list[tuple[str, str]],
    draft: str | None = None,
) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental.pallas import tpu as pltpu

    from mkgen.codegen.step_call import decode_step_arguments
    from mkgen.interpret import interpret_mode
    from mkgen.reference import model as reference
    from mkgen.weights.quantize import stored_random_weights

    topology, spec, layout, kernel = _child_kernel(
        spec_ref, topology_text, batch, rows, context, quant, knobs, mutations, draft
    )
    devices = topology.num_devices
    weights = stored_random_weights(spec, seed)  # the reference reads what the kernel stores
    fused = (
        _FusedDrafter(spec, layout, weights, seed, batch, context) if layout.draft_passes else None
    )
    packed = _packed_weights(layout, kernel, weights, devices)
    mesh, caches = _mesh_and_empty_caches(topology, layout, kernel)
    step_fn = kernel.make_decode_step(mesh)
    tables = jnp.asarray(kernel.LAYER_TABLES, jnp.int32)
    final_norm = jnp.asarray(weights["final_norm"])[None, :]
    ref_cache = reference.init_cache(spec, batch, context, jnp.bfloat16)
    params = pltpu.InterpretParams(
        detect_races=True,
        dma_execution_mode=mode,
        vector_clock_size=max(4 * devices, 8),
        uninitialized_memory="nan",
    )
    moe_layers = [
        i for i in range(spec.layers.count) if layout.ffn[layout.ffn_table[i]].routed_experts
    ]
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, layout.vocab_used, size=(batch, rows)).astype(np.int32)
    checks, positions = [], start_positions(batch)
    for step in range(steps):
        x = np.zeros((layout.tokens_padded, layout.hidden), np.float32)
        x[: layout.tokens] = weights["embedding"][tokens.reshape(-1)]
        drafting = fused.step_inputs(tokens) if fused is not None else None
        arguments = decode_step_arguments(kernel, tables, jnp.asarray(positions, jnp.int32),
                                          jnp.asarray(x), final_norm, *packed, caches, drafting)  # fmt: skip
        start = time.perf_counter()
        with interpret_mode(params):
            out = step_fn(*arguments)
            out = jax.block_until_ready(out)
        seconds = time.perf_counter() - start
        # After the tokens, logits, residuals, routes and the drafter's hidden states.
        caches = list(out[layout.outputs_before_caches :])
        check, ref_cache, expected, ref_residuals = _step_check(
            step, seconds, spec, layout, weights, tokens, positions, ref_cache, out, moe_layers
        )
        checks.append(check)
        if fused:
            tokens, positions = fused.next_rows(check, tokens, out, ref_residuals, ref_cache,
                                                step, positions, last=step + 1 == steps)  # fmt: skip
        else:
            tokens = expected.reshape(batch, rows).astype(np.int32)
            positions = [p + rows for p in positions]
        print(f"{STEP_DONE} {step}", file=sys.stderr, flush=True)
    return {"steps": [asdict(c) for c in checks]}


def _mesh_and_empty_caches(topology: Any, layout: Any, kernel: Any) -> tuple[Any, list[Any]]:
    """The kernel's mesh (stage 1 of the collectives is sibling cores) and its caches, all
    zero, placed as the step returns them: its second call reuses the first's compile."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from mkgen.plan.collectives import arrange_devices

    order = layout.collectives.mesh_order
    mesh = Mesh(np.array(arrange_devices(jax.devices(), topology, order)), (kernel.AXIS,))
    sharded = NamedSharding(mesh, PartitionSpec(kernel.AXIS))
    caches = [
        jax.device_put(jnp.zeros((topology.num_devices, *shape), dtype), sharded)
        for shape, dtype in kernel.cache_shapes()
    ]
    return mesh, caches


def _child_kernel(
    spec_ref: str,
    topology_text: str,
    batch: int,
    rows: int,
    context: int,
    quant: list[str],
    knobs: dict[str, Any],
    mutations: list[tuple[str, str]],
    draft: str | None = None,
) -> tuple[Any, Any, Any, Any]:
    """(topology, the spec's mini twin, its kernel layout, the rendered kernel module with
    `mutations` applied to its source), planned with the full-size build's splits (or the
    `splits` knob's); with `draft`, the spec drafting with that drafter (load_drafter)."""
    from mkgen.codegen.build import load_module, render_kernel
    from mkgen.codegen.package import mini_kernel_args
    from mkgen.kinds import default_registry
    from mkgen.plan import plan_build
    from mkgen.plan.options import BuildOptions
    from mkgen.plan.sharding import full_size_splits
    from mkgen.spec.loader import load_spec
    from mkgen.spec.mini import mini_twin
    from mkgen.spec.topology import parse_topology

    topology = parse_topology(topology_text)
    spec = load_spec(spec_ref)
    if draft is not None:
        from mkgen.spec.draft_import import load_drafter

        spec = load_drafter(draft, spec)
    built = BuildOptions.create(quant=quant).apply(spec)
    spec = mini_twin(built, topology.num_devices)
    options = BuildOptions.create(batch=batch, rows=rows, context=context, **knobs)
    if options.splits is None:  # a caller's own choices stand (a test forcing a design)
        splits = full_size_splits(built, topology, options, kinds=default_registry())
        options = options.model_copy(update={"splits": splits})
    layout = plan_build(
        spec,
        topology,
        options,
        **mini_kernel_args(),
        trace_residuals=True,
        kinds=default_registry(),
    ).kernel
    source = render_kernel(layout, "verify")
    for old, new in mutations:
        if old not in source:
            raise ValueError(f"mutation target not in the kernel: {old!r}")
        source = source.replace(old, new)
    return topology, spec, layout, load_module(source, "megakernel_verify")


def _packed_weights(
    layout: Any, kernel: Any, weights: Any, devices: int
) -> tuple[Any, Any, list[Any]]:
    """(stream, vectors, expert arrays) of `weights` packed for every core, stacked."""
    import jax.numpy as jnp
    import numpy as np

    from mkgen.weights import pack

    stream = jnp.asarray(np.stack([pack.pack_stream(layout, weights, r) for r in range(devices)]))
    vectors = jnp.asarray(np.stack([pack.pack_vectors(layout, weights, r) for r in range(devices)]))
    per_rank = [pack.pack_experts(layout, weights, r) for r in range(devices)]
    experts = [
        jnp.asarray(np.stack([p[i] for p in per_rank])) for i in range(len(kernel.expert_shapes()))
    ]
    return stream, vectors, experts


def _step_check(
    step: int,
    seconds: float,
    spec: Any,
    layout: Any,
    weights: Any,
    tokens: Any,
    positions: list[int],
    ref_cache: Any,
    out: list[Any],
    moe_layers: list[int],
) -> tuple[StepCheck, Any, Any, Any]:
    """(the check of a kernel step's outputs `out` against the reference fed the same
    `tokens` [batch, rows], sequence b at positions[b], the reference's cache after it,
    its greedy tokens, its residual stream after every layer [layers, batch, rows, hidden])."""
    import jax.numpy as jnp
    import numpy as np

    kernel_logits = out[1]
    caches = list(out[layout.outputs_before_caches :])
    identical, (kernel_tokens, residuals, routes, hidden, *_) = _core_outputs(
        layout, out, moe_layers
    )
    residuals = residuals[: spec.layers.count]  # a fused drafter's passes: its drafts say
    kernel_routes = dict(zip(moe_layers, routes, strict=True))
    differences: list[RouteDifference] = []
    ref_logits, ref_cache, ref_residuals = _reference_step(
        spec, weights, tokens, ref_cache, positions, kernel_routes, differences
    )
    mismatches = [d for d in differences if not d.near_tie]
    traced = np.asarray(ref_residuals)
    ref_residuals = traced.reshape(len(residuals), layout.tokens, -1)
    layer_diff, layer_tolerance, first_layer = _compare_residuals(
        np.asarray(residuals), ref_residuals
    )
    hidden_diff, hidden_mismatch = _compare_draft_hidden(
        spec, layout, weights, hidden, ref_residuals
    )
    ref_logits = np.asarray(ref_logits).reshape(layout.tokens, -1)
    got = np.asarray(kernel_logits)[:, : spec.dims.vocab]
    scale = float(np.abs(ref_logits).max())
    tolerance = LOGIT_ATOL + LOGIT_RTOL * scale
    ranked = np.sort(ref_logits[:, : layout.vocab_used], axis=1)
    near_tie = (ranked[:, -1] - ranked[:, -2]) < tolerance
    expected = ref_logits[:, : layout.vocab_used].argmax(axis=1)
    equal = np.asarray(kernel_tokens) == expected
    rows = tokens.shape[1]
    cache_diff, cache_scale = _compare_caches(spec, layout, caches, ref_cache, positions, rows)
    finite = bool(np.isfinite(got).all()) and all(
        bool(jnp.isfinite(c.astype(jnp.float32)).all()) for c in caches
    )
    check = StepCheck(
        step=step,
        max_logit_diff=float(np.abs(got - ref_logits).max()),
        logit_tolerance=tolerance,
        tokens_equal=int(equal.sum()),
        tokens_near_tie=int((~equal & near_tie).sum()),
        tokens_total=int(equal.size),
        max_cache_diff=cache_diff,
        cache_tolerance=CACHE_RTOL * max(cache_scale, 1.0),
        max_residual_diff=layer_diff,
        residual_tolerance=layer_tolerance,
        first_diverging_layer=first_layer,
        finite=finite,
        cores_identical=identical,
        seconds=seconds,
        route_ties=[d.describe() for d in differences if d.near_tie],
        route_mismatch=mismatches[0].describe() if mismatches else None,
        route_mismatch_layer=mismatches[0].layer if mismatches else None,
        draft_hidden_states=len(layout.draft_hidden),
        max_draft_hidden_diff=hidden_diff,
        draft_hidden_mismatch=hidden_mismatch,
    )
    return check, ref_cache, expected, traced


def start_positions(batch: int) -> list[int]:
    """Where each sequence's first verified step writes: sequence b at position b, as after
    prompts of unequal length, so that a batch's sequences run at positions that differ."""
    return list(range(batch))


def _reference_step(
    spec: Any,
    weights: Any,
    tokens: Any,
    cache: Any,
    positions: list[int],
    kernel_routes: dict[int, Any],
    differences: list[RouteDifference],
) -> tuple[Any, Any, Any]:
    """The reference fed `tokens` [batch, rows], sequence b at positions[b] (the reference
    model takes one position a call, so the sequences at each position run as one batch):
    (logits [batch, rows, vocab], the cache after it, the residual stream after every layer
    [layers, batch, rows, hidden]). Routing differences from the kernel's experts (tokens
    numbered over the whole batch) are appended to `differences` in layer order."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    from mkgen.reference import model as reference

    rows = tokens.shape[1]
    layers, logits, residuals, found = cache["layers"], {}, {}, []
    for position in sorted(set(positions)):
        group = np.asarray([b for b, p in enumerate(positions) if p == position])
        token_ids = (group[:, None] * rows + np.arange(rows)).reshape(-1)
        routes = {layer: chosen[token_ids] for layer, chosen in kernel_routes.items()}
        own: list[RouteDifference] = []
        part = {"length": jnp.asarray(position, jnp.int32),
                "layers": jax.tree.map(lambda a, g=group: a[g], layers)}  # fmt: skip
        part_logits, part, traced = reference.forward_traced(
            spec, weights, jnp.asarray(tokens[group]), part, position,
            _following_near_ties(routes, own),
        )  # fmt: skip
        found += [dataclasses.replace(d, token=int(token_ids[d.token])) for d in own]
        layers = jax.tree.map(lambda a, new, g=group: a.at[g].set(new), layers, part["layers"])
        for i, b in enumerate(group):
            logits[b], residuals[b] = part_logits[i], traced[:, i]
    differences += sorted(found, key=lambda d: (d.layer, d.token))
    order = range(len(tokens))
    # verify passes every position explicitly; the length says how far the furthest got
    new_cache = {"length": jnp.asarray(max(positions) + rows, jnp.int32), "layers": layers}
    return (
        jnp.stack([logits[b] for b in order]),
        new_cache,
        jnp.stack([residuals[b] for b in order], axis=1),
    )


class _FusedDrafter:
    """A fused drafter's inputs beside the kernel's (its weights drawn beside the target's,
    as the kernel stores them) and the reference drafter it is held to, one a sequence (its
    committed positions are one number)."""

    def __init__(
        self, spec: Any, layout: Any, weights: Any, seed: int, batch: int, context: int
    ) -> None:
        import jax.numpy as jnp
        import numpy as np

        from mkgen.reference.draft import init_draft_state
        from mkgen.weights import pack
        from mkgen.weights.quantize import stored_draft_weights

        weights |= stored_draft_weights(spec, seed + 1)  # the caller's too: its stream packs them
        self.spec, self.layout, self.weights = spec, layout, weights
        self.norms = jnp.asarray(pack.pack_draft_norms(weights))
        rows = [pack.pack_embedding(layout, weights, r) for r in range(layout.devices)]
        self.embedding_rows = jnp.asarray(np.stack(rows))  # each core's, after the vectors
        empty = init_draft_state(spec, 1, context)
        self.states = [
            {**empty, "length": jnp.asarray(p, jnp.int32)} for p in start_positions(batch)
        ]

    def step_inputs(self, fed: Any) -> tuple[Any, Any, Any]:
        """What the kernel takes for its passes beside the verify step's inputs: the fed
        rows' tokens [BATCH, ROWS] flattened, the module's norms, each core's embedding rows."""
        import jax.numpy as jnp

        return jnp.asarray(fed.reshape(-1)), self.norms, self.embedding_rows

    def next_rows(
        self, check: StepCheck, fed: Any, out: list[Any], residuals: Any, cache: Any,
        step: int, positions: list[int], last: bool,
    ) -> tuple[Any, list[int]]:  # fmt: skip
        """The step's drafts checked into `check`, sequence by sequence; the next step's rows
        (the bonus and the kernel's drafts, or, for sequence b on every other step from
        step b, rows a random drafter never makes: _mostly_accepted; not after the `last`
        step, whose next rows no step reads: the reference's continuation of 32-device
        Kimi K3's twin takes minutes) and positions."""
        import numpy as np

        batch, rows = fed.shape
        kernel_tokens = np.asarray(out[0])[0, : batch * rows].reshape(batch, rows)  # core 0's
        drafts = np.asarray(out[self.layout.outputs_before_caches - 1])[0]
        caches = out[self.layout.outputs_before_caches :]
        next_fed, next_positions = [], []
        for b, position in enumerate(positions):
            sequence = f"sequence {b}: " if batch > 1 else ""
            self.states[b], accepted, agreed = _check_drafts(
                check, sequence, self.spec, self.weights, self.states[b], fed[b : b + 1],
                kernel_tokens[b], drafts[b], residuals[:, b : b + 1],
            )  # fmt: skip
            if agreed is not None:  # entries from the accepted rows and the drafts alike
                written = range(position, position + accepted + min(agreed, rows - 2))
                _check_draft_cache(check, sequence, self.spec, self.layout, caches,
                                   self.states[b], b, written)  # fmt: skip
            bonus, position = kernel_tokens[b, accepted - 1], position + accepted
            if (step + b) % 2 == 0 and rows > 2 and not last:
                sequence_cache = _sequence_cache(cache, b, position)
                row = _mostly_accepted(self.spec, self.weights, sequence_cache, bonus, rows)
            else:
                row = [bonus, *drafts[b, 1:rows]]
            next_fed.append(row)
            next_positions.append(position)
        return np.asarray(next_fed, np.int32), next_positions


def _sequence_cache(cache: Any, b: int, position: int) -> Any:
    """Sequence b's part of the reference's cache (a batch of one) at `position`."""
    import jax
    import jax.numpy as jnp

    layers = jax.tree.map(lambda a: a[b : b + 1], cache["layers"])
    return {"length": jnp.asarray(position, jnp.int32), "layers": layers}


def _mostly_accepted(spec: Any, weights: Any, cache: Any, bonus: int, rows: int) -> list[int]:
    """One sequence's rows whose drafts the target accepts but the last: the bonus, the
    reference's greedy continuation of it from `cache` (a batch of one, at its length), its
    last token changed. A random twin's drafter never drafts what its target chooses, so a
    fused twin's sequence is fed these every other step, and its accept rule and roll-back
    run with rows - 1 accepted."""
    import jax.numpy as jnp
    import numpy as np

    from mkgen.reference import model as reference

    chosen = [int(bonus)]
    vocab = spec.dims.vocab_used or spec.dims.vocab
    for _ in range(rows - 1):
        token = jnp.asarray([[chosen[-1]]], jnp.int32)
        logits, cache = reference.forward(spec, weights, token, cache)[:2]
        chosen.append(int(np.asarray(logits)[0, -1, :vocab].argmax()))
    chosen[-1] = (chosen[-1] + 1) % vocab
    return chosen


def _check_drafts(
    check: StepCheck,
    sequence: str,
    spec: Any,
    weights: Any,
    state: Any,
    fed: Any,
    kernel_tokens: Any,
    drafts: Any,
    residuals: Any,
) -> tuple[Any, int, int | None]:
    """One sequence's fused drafting step into `check`: its accepted rows (`drafts` [1 +
    passes], lane 0) against the accept rule on the kernel's own greedy tokens of its `fed`
    rows [1, rows], and its drafts against the reference drafter's
    (mkgen.reference.draft.draft_step) after the same accepted rows and bonus, a near tie of
    the reference's draft logits (DRAFT_TIE_FACTOR) ending the comparison of that chain.
    `sequence` prefixes what a failure says. Returns (the reference drafter's state, the
    accepted rows, how many leading drafts both made alike: None where the accepted rows
    differ)."""
    import jax.numpy as jnp
    import numpy as np

    from mkgen.reference.draft import accept_greedy, draft_step

    rows = fed.shape[1]
    accepted = int(drafts[0])
    by_rule = int(accept_greedy(fed[:, 1:], kernel_tokens[None, :rows])[0][0]) + 1
    check.accepted.append(accepted)
    check.drafts_total += rows - 1
    if accepted != by_rule:
        check.accepted_mismatch = check.accepted_mismatch or (
            f"{sequence}the kernel accepted {accepted} row(s) where the accept rule on its own "
            f"greedy tokens accepts {by_rule}"
        )
        return state, by_rule, None
    bonus = jnp.asarray(kernel_tokens[accepted - 1 : accepted])
    wanted, logits, state = draft_step(
        spec, weights, state, jnp.asarray(fed[:, :accepted]),
        jnp.asarray(residuals[:, :, :accepted]), bonus, rows,
    )  # fmt: skip
    wanted, logits = np.asarray(wanted)[0], np.asarray(logits)[0]
    agreed = 0
    while agreed < rows - 1 and drafts[1 + agreed] == wanted[agreed]:
        agreed += 1
    check.drafts_equal += agreed
    if agreed < rows - 1:
        ranked = np.sort(logits[agreed])
        if ranked[-1] - ranked[-2] <= DRAFT_TIE_FACTOR * check.max_logit_diff:
            check.drafts_near_tie += rows - 1 - agreed  # the chain goes on from the other choice
        else:
            check.drafts_mismatch = check.drafts_mismatch or (
                f"{sequence}the fused drafter's drafts differ from the reference drafter's "
                f"from draft {agreed + 1} on"
            )
    return state, accepted, agreed


def _core_outputs(layout: Any, out: list[Any], moe_layers: list[int]) -> tuple[bool, list[Any]]:
    """(whether every core's greedy tokens, residual stream, routing after every layer (only
    MoE layers write theirs) and the drafter's hidden states are equal bit for bit, core
    0's of each)."""
    import numpy as np

    per_core = [np.asarray(out[0]), np.asarray(out[2]), np.asarray(out[3])[:, moe_layers]]
    per_core.append(np.asarray(out[4]) if layout.draft_hidden else np.zeros((len(out[0]), 0)))
    if layout.draft_passes is not None:  # the accepted rows and drafts
        per_core.append(np.asarray(out[layout.outputs_before_caches - 1]))
    identical = all(
        np.array_equal(values[0], values[r], equal_nan=True)
        for values in per_core
        for r in range(1, len(values))
    )
    return identical, [values[0] for values in per_core]


def _following_near_ties(
    kernel_routes: dict[int, Any], differences: list[RouteDifference]
) -> Callable[[int, Any, Any, Any], Any]:
    """The reference's choice of experts layer by layer (mkgen.reference.model
    ChooseLayerExperts): resolve_routes against the kernel's experts of that layer
    [tokens, 128], each difference appended to `differences`."""

    def choose(layer: int, kind: Any, choice: Any, chosen: Any) -> Any:
        used, found = resolve_routes(
            layer, choice, chosen, kernel_routes[layer][:, : kind.top_k],
            n_group=kind.router.n_group, topk_group=kind.router.topk_group,
        )  # fmt: skip
        differences.extend(found)
        return used

    return choose


def _compare_residuals(ours: Any, theirs: Any) -> tuple[float, float, int | None]:
    """(largest difference, its tolerance, the first layer beyond its own tolerance)."""
    import numpy as np

    diffs = np.abs(ours - theirs).reshape(len(ours), -1).max(axis=1)
    limits = RESIDUAL_RTOL * np.maximum(np.abs(theirs).reshape(len(theirs), -1).max(axis=1), 1.0)
    bad = np.nonzero(diffs > limits)[0]
    worst = int(np.argmax(diffs / limits))
    return float(diffs[worst]), float(limits[worst]), int(bad[0]) if len(bad) else None


def _compare_draft_hidden(
    spec: Any, layout: Any, weights: Any, ours: Any, residuals: Any
) -> tuple[float, str | None]:
    """(largest difference, the first hidden state beyond its tolerance) of the kernel's
    draft-hidden output `ours` [entries, tokens, hidden] against the reference's states at
    the layers the plan names (`residuals`: forward_traced's [layers, tokens, hidden])."""
    import numpy as np

    from mkgen.reference.draft import target_hidden

    worst, first = 0.0, None
    for entry, wanted in enumerate(layout.draft_hidden):
        theirs = np.asarray(target_hidden(spec, weights, residuals, wanted.layer))
        diff = float(np.abs(ours[entry] - theirs).max())
        limit = RESIDUAL_RTOL * max(float(np.abs(theirs).max()), 1.0)
        worst = max(worst, diff)
        if first is None and not diff <= limit:  # a NaN fails too
            what = "final-normed " if wanted.normed else ""
            first = (
                f"the drafter's hidden state {entry} (the {what}stream after layer "
                f"{wanted.layer}) differs by {diff:.4g} (tolerance {limit:.4g})"
            )
    return worst, first


def _check_draft_cache(
    check: StepCheck,
    sequence: str,
    spec: Any,
    layout: Any,
    caches: list[Any],
    state: Any,
    b: int,
    written: range,
) -> None:
    """Sequence b's entries of the fused drafter's cache (the MTP module's slot, past the
    target's layers, core by core) at the positions `written` against the reference
    drafter's `state` (a batch of one) into `check`, within CACHE_RTOL of its largest."""
    import numpy as np

    arrays = iter(caches)
    diff, scale = 0.0, 0.0
    for a in layout.attention:
        mine = {c.name: next(arrays) for c in a.caches}
        for slot in [s for s, layer in enumerate(a.layers) if layer >= spec.layers.count]:
            for rank in range(layout.devices):
                for name, ref in a.cache_pieces(spec, state["layers"][0], rank).items():
                    if name in ("state", "conv"):  # a recurrent module's: no positions
                        continue
                    ours = np.asarray(mine[name][rank, slot, b], np.float32)[:, written]
                    theirs = np.asarray(ref[0], np.float32)[:, written]
                    diff = max(diff, float(np.abs(ours - theirs).max()))
                    scale = max(scale, float(np.abs(theirs).max()))
    check.max_draft_cache_diff = max(check.max_draft_cache_diff, diff)
    limit = CACHE_RTOL * max(scale, 1.0)
    if check.draft_cache_mismatch is None and not diff <= limit:
        check.draft_cache_mismatch = (
            f"{sequence}the fused drafter's cache entries at positions {written.start} to "
            f"{written.stop - 1} differ by {diff:.4g} (tolerance {limit:.4g})"
        )


def _compare_caches(
    spec: Any, layout: Any, caches: list[Any], ref_cache: Any, positions: list[int], rows: int
):
    """(max difference, largest reference value) over what this step wrote, core by core
    (each kind's record cuts the reference's caches: cache_pieces): the new KV
    rows of GQA layers (sequence b's from positions[b]), the new [latent | k_rope] rows of
    MLA layers and the whole f32 state of Gated DeltaNet and KDA layers (their conv tails
    feed it). A fused drafter's cache (a slot past the target's layers) is not the
    reference model's: its drafts are checked instead."""
    import numpy as np

    arrays = iter(caches)
    diff, scale = 0.0, 0.0
    for a in layout.attention:
        mine = {c.name: np.asarray(next(arrays), np.float32) for c in a.caches}
        for slot, layer in enumerate(a.layers):
            if layer >= spec.layers.count:
                continue
            for rank in range(layout.devices):
                theirs = a.cache_pieces(spec, ref_cache["layers"][layer], rank)
                for name, ref in theirs.items():
                    if name == "conv":
                        continue
                    ours, ref = mine[name][rank, slot], np.asarray(ref, np.float32)
                    if name == "state":  # [B, ROWS, ...]: after the step's last row
                        ours, ref = ours[:, -1], ref[:, -1]
                    else:  # [B, heads, context, width]: this step's rows
                        ours = np.stack([ours[b, :, p : p + rows] for b, p in enumerate(positions)])
                        ref = np.stack([ref[b, :, p : p + rows] for b, p in enumerate(positions)])
                    diff = max(diff, float(np.abs(ours - ref).max()))
                    scale = max(scale, float(np.abs(ref).max()))
    return diff, scale


if __name__ == "__main__":
    spec_arg, topo_arg, mode_arg, *numbers, quant_arg, knobs_arg, mutations_arg, draft_arg = (
        sys.argv[1:]
    )
    steps_n, batch_n, rows_n, context_n, seed_n = map(int, numbers)
    _exit_when_stalled()
    try:
        result = _run_child(
            spec_arg, topo_arg, mode_arg, steps_n, batch_n, rows_n, context_n, seed_n,
            json.loads(quant_arg),
            # JSON has no tuples: a knob's list (a test's forced splits) was one.
            {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(knobs_arg).items()},
            [tuple(m) for m in json.loads(mutations_arg)],
            json.loads(draft_arg),
        )  # fmt: skip
    except Exception as error:  # reported to the parent as one line: race, NaN, lowering...
        result = {"error": describe_failure(error)}
    print(json.dumps(result))
