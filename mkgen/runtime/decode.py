"""Generation through the megakernel: the prompt into the kernel's caches (XLA prefill or
the kernel itself), then kernel calls until every sequence has its tokens.

Imports JAX: imported by `run` after the device environment is set.
"""

from __future__ import annotations

import contextlib
import functools
import time
from argparse import Namespace
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mkgen.interpret import interpret_mode
from mkgen.runtime.arguments import NGRAM_DEFAULT
from mkgen.runtime.build import Build, kernel_arguments, kernel_outputs, load_build
from mkgen.runtime.device_drafting import (
    DeviceDrafting,
    device_drafting,
    random_drafter_tensors,
)
from mkgen.runtime.device_speculation import accept_on_device, prompt_lookup_on_device
from mkgen.runtime.devices import host_value, make_mesh
from mkgen.runtime.fused_drafting import KernelDrafts
from mkgen.runtime.prefill import ModuleInputs
from mkgen.runtime.sampling import Sampler
from mkgen.runtime.speculation import Drafter, accept
from mkgen.runtime.weights import embedding_on_devices, progress_bar


@dataclass(frozen=True)
class Model:
    """A build's kernel ready to run: its layout, the megakernel module, the mesh, the
    weights (host side: the embedding), the weights placed on the devices and, when the
    runner drafts with the build's drafter, that drafter on the devices."""

    build: Build
    spec: Any
    layout: Any
    kernel: ModuleType
    mesh: Mesh
    weights: Any
    placed: dict[str, Any]
    drafting: DeviceDrafting | None = None


def load_model(
    build: Build,
    weights: Path | None,
    random_weights: int | None,
    *,
    verify: bool = True,
    meshes: int = 1,
    draft: bool = False,
) -> Model:
    """The build's kernel on its mesh with the converted `weights` (checked against
    layout.json's sha256 when `verify`), or the reference's random weights drawn with
    seed `random_weights` when `weights` is None, placed on the devices. Of `meshes`
    meshes (a disaggregated prefill's and the decode's), the decode takes the first.
    With `draft`, the build's drafter too (device_drafting): its converted weights
    beside `weights`, else its random ones drawn with `random_weights`; a kernel that
    drafts (build.fused_draft) streams its drafter's weights, and the runner carries the
    drafts it writes (KernelDrafts)."""
    from mkgen.runtime.weights import ConvertedWeights, RandomWeights, place_weights

    spec, layout, kernel = load_build(build)
    mesh = make_mesh(build, kernel, layout, meshes=meshes)
    if weights is not None:
        loaded: Any = ConvertedWeights(spec, layout, weights, build, verify)
    else:
        loaded = RandomWeights(spec, layout, random_weights or 0)
    placed = place_weights(build, loaded, mesh, kernel)
    drafting = None
    if draft and build.fused_draft:  # the kernel drafts: the runner carries its drafts
        drafter = KernelDrafts(batch=build.batch, rows=build.rows, capacity=build.context)
        drafting = DeviceDrafting(drafter, None)
    elif draft:
        seed = random_weights or 0
        tensors = (
            (lambda: loaded.drafter(spec))
            if weights is not None
            else (lambda: random_drafter_tensors(spec, seed, loaded.inventory))
        )
        drafting = device_drafting(spec, build.batch, build.rows, build.context, mesh, tensors)
    return Model(build, spec, layout, kernel, mesh, loaded, placed, drafting)


@dataclass(frozen=True)
class Generation:
    """What decode returns: the generated tokens per sequence, the device calls made, the
    mean tokens generated per generating kernel step (the acceptance length), the
    seconds per kernel step of each call, and per sequence the tokens each of its
    generating kernel steps gave (accepted drafts + the bonus; every token comes from a
    kernel step, the prefill holding all but the prompt's last token)."""

    tokens: list[list[int]]
    calls: int
    acceptance: float
    seconds: list[float]
    accepted_per_step: list[list[int]]


def prefill(
    model: Model, prompts: list[list[int]], where: str
) -> tuple[list[jax.Array], int, list[Observed]]:
    """The kernel's caches after the prompts' first tokens, how many tokens they hold and
    what the build's drafter observes of the prefill (DrafterStates.observed: an mtp or
    block drafter's states of the held tokens as the kernel writes them, a kernel's first
    drafts; else []).

    With --prefill xla (the default), all but the last token of the shortest prompt run
    through the model in XLA over the placed per-core weights (mkgen.runtime.prefill: a
    shard_map in which each core unpacks its own banks, the routed experts run where
    they lie) and land in the kernel's cache layout; the rest of every prompt then goes
    through the kernel ROWS tokens per call. With --prefill kernel the caches start
    empty and the whole prompt goes through the kernel (and its hidden states with it)."""
    from mkgen.runtime.prefill import prefill as xla_prefill

    held = min(len(p) for p in prompts) - 1 if where == "xla" else 0
    axis = model.kernel.AXIS
    if held >= 1:
        tokens = np.array([p[:held] for p in prompts], np.int32)
        with progress_bar(len(model.layout.attention_table), "prefill", "layer") as bar:

            def layer_done(output: jax.Array) -> None:
                if not bar.disable:  # a shown bar waits for the layer, so it moves truly
                    jax.block_until_ready(output)
                bar.update()

            states = DrafterStates(model)
            caches = xla_prefill(
                model.spec, model.layout, model.mesh, axis, model.placed,
                model.weights.embedding, tokens, progress=layer_done,
                layer_output=states.keep if states.layers else None,
                module=module_inputs(model, prompts, held),
                drafted=states.drafted if states.wants_drafts else None,
            )  # fmt: skip
        return caches, held, states.observed()
    return empty_caches(model, model.build.batch), 0, []


def module_inputs(model: Model, prompts: list[list[int]], held: int) -> ModuleInputs | None:
    """What the prefill of `held` tokens of `prompts` needs for the MTP module's cache of a
    kernel that drafts (the token after each held one is the prompt's next); else None."""
    if not model.build.fused_draft:
        return None
    w = model.weights
    following = np.array([p[1 : held + 1] for p in prompts], np.int32)
    return ModuleInputs(w.draft_module(), w.final_norm, w.embedding, following)


# What a drafter's observe takes of a prefill: (the first position, the values, how many
# positions from it they commit), DrafterStates.observed.
Observed = tuple[int, jax.Array, int]


class DrafterStates:
    """What the build's drafter observes of an XLA prefill of positions start..: an mtp or
    block drafter the residual stream after the layers it reads (KernelLayout.draft_hidden),
    kept as the prefill goes (keep); a kernel that drafts (KernelDrafts) the drafts of its
    MTP module's chain after the prompt (drafted), which its first step then verifies."""

    def __init__(self, model: Model, start: int = 0) -> None:
        drafting = model.drafting
        reads = drafting is not None and drafting.drafter.observes_steps
        self.model, self.start = model, start
        self.entries = model.layout.draft_hidden if reads else []
        self.layers = {entry.layer for entry in self.entries}
        self.kept: dict[int, jax.Array] = {}
        self.wants_drafts = reads and model.build.fused_draft
        self.drafts: Observed | None = None

    def keep(self, layer: int, stream: list[jax.Array]) -> None:
        if layer in self.layers:
            self.kept[layer] = list(stream)

    def drafted(self, count: int, drafts: jax.Array) -> None:
        """The prefill's drafts [B, rows - 1] after the token that follows its `count`
        positions, as KernelDrafts.observe takes a step's output: the rows taken, then the
        drafts."""
        taken = jnp.full((drafts.shape[0], 1), count, jnp.int32)
        self.drafts = (self.start, jnp.concatenate([taken, drafts], axis=1), count)

    def observed(self) -> list[Observed]:
        """What the drafter observes, in order: a kernel's drafts (drafted), or per prefill
        chunk (prompt_chunks' power-of-two sizes, so a drafter's commit compiles for those
        only) its states [len(draft_hidden), B, size, HIDDEN], the last layer's
        final-normed as the kernel writes it."""
        if self.drafts is not None:
            return [self.drafts]
        if not self.kept:
            return []
        from mkgen.reference.layers import rms_norm

        dims = self.model.spec.dims
        final = jnp.asarray(self.model.weights.final_norm, jnp.float32)
        zero_centered = dims.norm_style == "zero_centered"
        out, offset = [], self.start
        for c, piece in enumerate(self.kept[self.entries[0].layer]):
            states = jnp.stack([
                rms_norm(self.kept[e.layer][c], final, dims.norm_eps, zero_centered)
                if e.normed else self.kept[e.layer][c]
                for e in self.entries
            ])  # fmt: skip
            out.append((offset, states, piece.shape[1]))
            offset += piece.shape[1]
        return out


def commit_states(
    model: Model,
    observe: Callable[..., Any],
    weights: Any,
    state: Any,
    histories: list[list[int]],
    start: list[int],
    hidden: jax.Array,
    count: list[int],
) -> Any:
    """`observe` (a jitted HiddenStateDrafter.observe) of host-side inputs: the drafter's
    state with hidden [len(draft_hidden), BATCH, n, HIDDEN] committed at positions
    start[b].., count[b] of them standing (0: sequence b unchanged)."""
    replicated = NamedSharding(model.mesh, P())  # a disaggregated prefill's states too
    return observe(
        weights, state, history_array(histories, model.build.context),
        jnp.asarray(start, jnp.int32), jax.device_put(hidden, replicated),
        jnp.asarray(count, jnp.int32),
    )  # fmt: skip


def empty_caches(model: Model, batch: int) -> list[jax.Array]:
    """The kernel's cache arrays for `batch` sequences, all zero, sharded as the kernel
    takes them ([devices, layers, batch, ...])."""
    sharded = NamedSharding(model.mesh, P(model.kernel.AXIS))
    zeros = []
    for shape, dtype in model.kernel.cache_shapes():
        layers, _, *rest = shape
        zeros.append(np.zeros((model.build.devices, layers, batch, *rest), np.dtype(dtype)))
    return [jax.make_array_from_callback(c.shape, sharded, lambda i, c=c: c[i]) for c in zeros]


def prefill_sequence(
    model: Model,
    prompt_ids: list[int],
    start: int = 0,
    cached: list[np.ndarray] | None = None,
    layer_output: Callable[[int, list[jax.Array]], None] | None = None,
    next_token: int | None = None,
    drafted: Callable[[int, jax.Array], None] | None = None,
) -> list[jax.Array]:
    """One sequence's kernel cache arrays (batch 1: [devices, layers, 1, ...]) holding
    `prompt_ids` at positions start..start + len - 1, through the XLA prefill, after what
    `cached` holds (the sequence's first `start` tokens: its caches as
    disaggregation.offload left them on the host, restored as they are when nothing
    follows them; None when start is 0). Zeros when there are no tokens;
    mkgen.runtime.slots.insert_sequence puts them in a slot of the decode caches. The
    server's engine prefills every admitted prompt through this one function;
    `layer_output` and `drafted` as mkgen.runtime.prefill.prefill's. A kernel that drafts
    also needs `next_token`, the token after them (its MTP module's entries pair each
    position with the token after it: module_inputs)."""
    from mkgen.runtime.prefill import prefill as xla_prefill

    if not prompt_ids:
        assert cached is None, "cached caches with nothing after them are restored, not prefilled"
        return empty_caches(model, 1)
    module = None
    if model.build.fused_draft:
        assert next_token is not None, "a kernel that drafts pairs the last token with the next"
        module = module_inputs(model, [[*prompt_ids, next_token]], len(prompt_ids))
    return xla_prefill(
        model.spec, model.layout, model.mesh, model.kernel.AXIS, model.placed,
        model.weights.embedding, np.asarray([prompt_ids], np.int32), start=start,
        cached=cached, layer_output=layer_output, module=module, drafted=drafted,
    )  # fmt: skip


def snapshot_keeper(model: Model) -> Callable[..., list[jax.Array]] | None:
    """(caches, rows [BATCH]) -> caches in which snapshot rows[b] of every recurrent cache
    array ([devices, layers, BATCH, ROWS, ...]: the conv tail and state after each row
    of the last call) becomes sequence b's current one (snapshot ROWS - 1), so rejected
    draft rows leave no trace; jitted, the caches donated. None when nothing is
    recurrent or there are no draft rows."""
    build = model.build
    attention = model.layout.attention
    recurrent = [a.name in build.recurrent_kinds for a in attention for _ in a.caches]
    if build.rows == 1 or not any(recurrent):
        return None

    def keep(caches: list[jax.Array], rows: jax.Array) -> list[jax.Array]:
        sequences = jnp.arange(build.batch)
        return [
            c.at[:, :, :, build.rows - 1].set(c[:, :, sequences, rows]) if is_recurrent else c
            for c, is_recurrent in zip(caches, recurrent, strict=True)
        ]

    return jax.jit(keep, donate_argnums=0)


@dataclass(frozen=True)
class SamplingParams:
    """Per-sequence sampling inputs of a device call, each [BATCH]: temperature (0:
    greedy, the kernel's own argmax), top_k (0: all), top_p in (0, 1], seed."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array

    @classmethod
    def create(
        cls, temperature: list[float], top_k: list[int], top_p: list[float], seed: list[int]
    ) -> SamplingParams:
        return cls(
            jnp.asarray(temperature, jnp.float32), jnp.asarray(top_k, jnp.int32),
            jnp.asarray(top_p, jnp.float32), jnp.asarray(seed, jnp.uint32),
        )  # fmt: skip


jax.tree_util.register_dataclass(
    SamplingParams, data_fields=["temperature", "top_k", "top_p", "seed"], meta_fields=[]
)


def chunk_decoder(
    model: Model, step_fn: Callable[..., Any], steps_per_call: int, ngram: int = NGRAM_DEFAULT
) -> Any:
    """A jitted loop of up to `steps_per_call` kernel steps in one device call: (history
    [BATCH, capacity] each sequence's tokens so far, positions [BATCH] (the tokens in its
    cache: its history holds one more, the token to feed), budget [BATCH] tokens each
    sequence may still gain, count, SamplingParams, the embedding on the devices
    (embedding_on_devices), placed weights, caches) -> (tokens [steps_per_call, BATCH,
    ROWS], gained [steps_per_call, BATCH], caches, drafter state): step i gave sequence b
    tokens[i, b, :gained[i, b]].

    Each step feeds every sequence's next token and ROWS - 1 prompt-lookup drafts from its
    history (device_speculation), embedded on the device, at its position; the kernel's
    outputs accept drafts (greedy, or the rejection rule for a sequence with a
    temperature) and the gained tokens extend the history for the next step, so the host
    is visited once per call. A rejected row's recurrent state is dropped (the snapshot
    of the last accepted row is kept). A sequence whose budget is spent repeats its step
    in place.

    With the build's drafter (model.drafting) the drafts are its own, made on the device
    between kernel steps (device_drafting), or, from a kernel that drafts, the ones it wrote
    the step before (KernelDrafts): the call takes the drafter's weights and state after
    the caches, and returns the state after them (else None)."""
    layout, build = model.layout, model.build
    batch, rows = build.batch, build.rows
    tables = jnp.asarray(model.kernel.LAYER_TABLES, jnp.int32)
    keep_snapshots = snapshot_keeper(model)
    drafter = model.drafting.drafter if model.drafting is not None else None
    drafter_reads = step_reads(layout, batch, rows)

    def run(history, positions, budget, count, sampling, embedding, placed, caches,
            draft_weights=None, draft_state=None):  # fmt: skip
        sequences, row = jnp.arange(batch), jnp.arange(rows)
        if drafter is not None:
            draft_state = drafter.catch_up(draft_weights, draft_state, history, positions)

        def step(i, carry):
            history, positions, spent, caches, out, gained, draft_state = carry
            lookup = lambda: prompt_lookup_on_device(history, positions + 1, rows - 1, ngram)  # noqa: E731
            if drafter is None:
                drafts = lookup()
            else:
                drafts, draft_state = drafter.draft(
                    draft_weights, draft_state, history, positions, lookup
                )
            fed = jnp.concatenate([history[sequences, positions][:, None], drafts], axis=1)
            x = jnp.zeros((layout.tokens_padded, layout.hidden), jnp.float32)
            x = x.at[: layout.tokens].set(embedding[fed.reshape(-1)].astype(jnp.float32))
            greedy, logits, read, caches = kernel_outputs(
                layout,
                step_fn(*kernel_arguments(model.kernel, placed, tables, positions, fed, x, caches)),
            )
            new, accepted = accept_on_device(
                fed, greedy.reshape(batch, rows), logits, sampling, positions,
                build.vocab_used,
            )  # fmt: skip
            # Beyond its budget a sequence gains nothing, so its cache never runs past
            # the context the host checked.
            taken = jnp.clip(jnp.minimum(accepted + 1, budget - spent), 0)
            if keep_snapshots is not None:
                caches = keep_snapshots(caches, jnp.where(taken > 0, taken - 1, rows - 1))
            beyond = history.shape[1]  # an index the scatter drops
            written = jnp.where(row < taken[:, None], positions[:, None] + 1 + row, beyond)
            history = history.at[sequences[:, None], written].set(new, mode="drop")
            out, gained = out.at[i].set(new), gained.at[i].set(taken)
            if drafter is not None and drafter.observes_steps:  # what the step wrote for it
                draft_state = drafter.observe(
                    draft_weights, draft_state, history, positions, drafter_reads(read), taken
                )
            return history, positions + taken, spent + taken, caches, out, gained, draft_state

        out = jnp.zeros((steps_per_call, batch, rows), jnp.int32)
        gained = jnp.zeros((steps_per_call, batch), jnp.int32)
        spent = jnp.zeros_like(budget)
        carry = (history, positions, spent, list(caches), out, gained, draft_state)
        _, _, _, caches, out, gained, draft_state = jax.lax.fori_loop(0, count, step, carry)
        return out, gained, caches, draft_state

    return jax.jit(run, donate_argnums=7)


def hidden_rows(layout: Any, batch: int, rows: int, hidden: jax.Array) -> jax.Array:
    """The kernel's draft-hidden output [len(draft_hidden), TOKENS, HIDDEN] per sequence:
    [len(draft_hidden), batch, rows, HIDDEN] (sequence b's rows are b * rows ..)."""
    return hidden[:, : batch * rows].reshape(len(layout.draft_hidden), batch, rows, -1)


def step_reads(layout: Any, batch: int, rows: int) -> Callable[[jax.Array], jax.Array]:
    """What the build's drafter's observe takes of a step's drafter output (kernel_outputs):
    the hidden states per sequence (hidden_rows), or a kernel's drafts as they are."""
    if layout.draft_passes is not None:
        return lambda made: made
    return functools.partial(hidden_rows, layout, batch, rows)


def drafter_inputs(model: Model) -> tuple[Any, Any]:
    """chunk_decoder's last two inputs: the build's drafter's weights and its first state
    (model.drafting), or (None, None) when the drafts come from prompt lookup."""
    if model.drafting is None:
        return None, None
    return model.drafting.weights, model.drafting.drafter.initial_state()


def history_array(histories: list[list[int]], capacity: int) -> jax.Array:
    """chunk_decoder's history input: each sequence's tokens, zero-padded to `capacity`."""
    padded = np.zeros((len(histories), capacity), np.int32)
    for b, tokens in enumerate(histories):
        padded[b, : len(tokens)] = tokens
    return jnp.asarray(padded)


def gained_tokens(out: np.ndarray, gained: np.ndarray, b: int) -> list[int]:
    """Sequence b's tokens from chunk_decoder's outputs (on the host), in order."""
    return [int(t) for step, n in enumerate(gained[:, b]) for t in out[step, b, :n]]


def decode(
    model: Model,
    caches: list[jax.Array],
    held: int,
    args: Namespace,
    drafter: Drafter,
    stream: Callable[[list[int]], None] | None = None,
    prefill_states: list[Observed] | None = None,
) -> Generation:
    """Generation through the megakernel.

    Each call feeds ROWS rows per sequence at its cache position: the tokens known next
    (prompt tokens not yet in the cache, or the last generated token), then drafts. The
    kernel's token after the last known row is generated, and so is its token after every
    further row whose draft is accepted (accept). Once every sequence generates, decoding
    without drafts or with the built-in prompt-lookup drafter runs up to --steps-per-call
    steps per device call, drafted, accepted and sampled on the device (chunk_decoder); a
    MODULE:CALLABLE drafter drafts on the host, one step per call. `stream` (batch 1) gets
    the generated ids after every call. With the build's drafter (--drafter build,
    model.drafting) the device calls draft with it, whatever --steps-per-call; host steps
    (the prompt's rest, a last token) draft by prompt lookup. An mtp or block drafter
    commits the hidden states of the held tokens (`prefill_states`, prefill's) and of
    every kernel step's accepted rows, host steps' too."""
    step_fn = model.kernel.make_decode_step(model.mesh)
    chunked = None
    if model.drafting is not None or (args.steps_per_call > 1 and args.drafter == "ngram"):
        chunked = _ChunkedCalls(model, step_fn, args)
    sequences = _Sequences(args, held, model.build.batch, stream)
    observe = None
    if chunked is not None and model.drafting is not None and model.drafting.drafter.observes_steps:
        observe = chunked.observe
        for offset, values, count in prefill_states or []:
            batch = model.build.batch
            observe(sequences.history, [offset] * batch, values, [count] * batch)
    host_step = _HostSteps(model, step_fn, args, drafter, observe)
    mode = interpret_mode() if args.interpret else contextlib.nullcontext()
    with mode:
        while not all(sequences.finished):
            budget = sequences.budget()
            if chunked is not None and sequences.ready() and max(budget) > 1:
                # Every sequence generates: several steps in one device call.
                caches = chunked(sequences, budget, caches)
            else:
                caches = host_step(sequences, caches)
    acceptance = sequences.produced / max(sequences.generating, 1)
    return Generation(
        sequences.generated, sequences.calls, acceptance, sequences.seconds, sequences.step_counts
    )


class _Sequences:
    """decode's sequences on the host: each one's tokens (prompt, then generated), the
    tokens in its cache, what it generated and whether it is done, and the counts that
    Generation reports."""

    def __init__(
        self, args: Namespace, held: int, batch: int, stream: Callable[[list[int]], None] | None
    ) -> None:
        self.steps, self.stop, self.stream = args.steps, args.stop, stream
        self.history = [list(p) for p in args.prompts]  # prompt, then generated tokens
        self.positions = [held] * batch  # tokens already in each sequence's cache
        self.generated: list[list[int]] = [[] for _ in range(batch)]
        self.step_counts: list[list[int]] = [[] for _ in range(batch)]  # per generating step
        self.finished = [False] * batch
        self.calls = self.produced = self.generating = 0
        self.seconds: list[float] = []

    def budget(self) -> list[int]:
        """The tokens each sequence may still gain (0: finished)."""
        return [
            0 if done else self.steps - len(tokens)
            for done, tokens in zip(self.finished, self.generated, strict=True)
        ]

    def ready(self) -> bool:
        """Whether every sequence generates: its whole history is in its cache but the
        token to feed."""
        return all(p + 1 == len(h) for p, h in zip(self.positions, self.history, strict=True))

    def take_steps(self, b: int, counts: list[int], new: list[int]) -> int:
        """Sequence b gains `new`, the tokens of kernel steps that gave `counts` tokens
        each, cut at --steps and after a stop id; how many it kept."""
        kept = self.take(b, new)
        left = kept
        for count in counts:
            if left > 0:
                self.step_counts[b].append(min(count, left))
            left -= count
        return kept

    def take(self, b: int, new: list[int]) -> int:
        """Sequence b gains `new`, cut at --steps and after a stop id; how many it kept."""
        new = new[: self.steps - len(self.generated[b])]
        stops = [i for i, t in enumerate(new) if t in self.stop]
        if stops:
            new = new[: stops[0] + 1]
        self.generated[b] += new
        self.history[b] += new
        if self.stream is not None:
            self.stream(self.generated[b])
        self.finished[b] = bool(stops) or len(self.generated[b]) >= self.steps
        return len(new)


class _ChunkedCalls:
    """Up to --steps-per-call kernel steps per device call, drafted by prompt lookup,
    accepted and sampled on the device (chunk_decoder)."""

    def __init__(self, model: Model, step_fn: Callable[..., Any], args: Namespace) -> None:
        build, batch = model.build, model.build.batch
        self.model, self.steps_per_call = model, args.steps_per_call
        self.run = chunk_decoder(model, step_fn, args.steps_per_call, args.ngram)
        self.draft_weights, self.draft_state = drafter_inputs(model)
        if model.drafting is not None and model.drafting.drafter.observes_steps:
            self.commit = jax.jit(model.drafting.drafter.observe)
        self.embedding = embedding_on_devices(
            build, model.weights.embedding, model.mesh, model.kernel
        )
        self.sampling = SamplingParams.create(
            [args.temperature] * batch, [args.top_k] * batch, [args.top_p] * batch,
            [args.seed] * batch,
        )  # fmt: skip

    def __call__(
        self, sequences: _Sequences, budget: list[int], caches: list[jax.Array]
    ) -> list[jax.Array]:
        count = min(self.steps_per_call, max(budget))
        start = time.perf_counter()
        out, gained, caches, self.draft_state = self.run(
            history_array(sequences.history, self.model.build.context),
            jnp.asarray(sequences.positions, jnp.int32), jnp.asarray(budget, jnp.int32), count,
            self.sampling, self.embedding, self.model.placed, caches, self.draft_weights,
            self.draft_state,
        )  # fmt: skip
        out, gained = host_value(jax.block_until_ready(out)), host_value(gained)
        sequences.seconds.append((time.perf_counter() - start) / count)
        sequences.calls += 1
        for b in range(self.model.build.batch):
            if not sequences.finished[b]:
                counts = [int(n) for n in gained[:, b] if n > 0]
                kept = sequences.take_steps(b, counts, gained_tokens(out, gained, b))
                sequences.produced += kept
                sequences.generating += int(np.count_nonzero(gained[:, b]))
                sequences.positions[b] += kept
        return caches

    def observe(
        self, histories: list[list[int]], start: list[int], hidden: jax.Array, count: list[int]
    ) -> None:
        """The build's mtp or block drafter commits rows fed outside the device calls (the
        prefill's, a host step's): HiddenStateDrafter.observe."""
        self.draft_state = commit_states(
            self.model, self.commit, self.draft_weights, self.draft_state, histories, start,
            hidden, count,
        )  # fmt: skip


class _HostSteps:
    """One kernel step per device call: each sequence's known tokens and the drafter's
    drafts in, the kernel's tokens accepted on the host (accept)."""

    def __init__(
        self,
        model: Model,
        step_fn: Callable[..., Any],
        args: Namespace,
        drafter: Drafter,
        observe: Callable[..., None] | None = None,
    ) -> None:
        """`observe` (_ChunkedCalls.observe): the build's mtp or block drafter commits the
        states of each step's standing rows."""
        self.model, self.step_fn, self.drafter, self.observe = model, step_fn, drafter, observe
        self.keep_snapshots = snapshot_keeper(model)
        self.drafter_reads = step_reads(model.layout, model.build.batch, model.build.rows)
        self.tables = jnp.asarray(model.kernel.LAYER_TABLES, jnp.int32)
        self.sampler = None
        if args.temperature > 0:
            self.sampler = Sampler(args.temperature, args.top_k, args.top_p, model.build.vocab_used)
        self.rng = np.random.default_rng(args.seed)

    def fed_rows(self, sequences: _Sequences) -> tuple[np.ndarray, list[Any]]:
        """([BATCH, ROWS] the ids fed: each sequence's known tokens, then its drafts; the
        drafter's proposals)."""
        rows_per_call = self.model.build.rows
        rows, proposals = [], []
        for h, pos in zip(sequences.history, sequences.positions, strict=True):
            known = h[pos : pos + rows_per_call]
            short = rows_per_call - len(known)
            proposal = self.drafter(h, short) if short else []
            proposals.append(proposal)
            ids = proposal[0] if isinstance(proposal, tuple) else proposal
            rows.append(known + [int(t) for t in ids])
        return np.array(rows, np.int32), proposals

    def __call__(self, sequences: _Sequences, caches: list[jax.Array]) -> list[jax.Array]:
        layout, placed = self.model.layout, self.model.placed
        batch, rows_per_call = self.model.build.batch, self.model.build.rows
        rows, proposals = self.fed_rows(sequences)
        x = np.zeros((layout.tokens_padded, layout.hidden), np.float32)
        x[: layout.tokens] = self.model.weights.embedding[rows.reshape(-1)].astype(np.float32)
        start = time.perf_counter()
        positions = jnp.asarray(sequences.positions, jnp.int32)
        tokens, logits, read, caches = kernel_outputs(layout, self.step_fn(*kernel_arguments(
            self.model.kernel, placed, self.tables, positions, jnp.asarray(rows), jnp.asarray(x),
            caches,
        )))  # fmt: skip
        tokens = host_value(jax.block_until_ready(tokens)).reshape(batch, rows_per_call)
        sequences.seconds.append(time.perf_counter() - start)
        if self.sampler is not None:
            logits = host_value(logits).reshape(batch, rows_per_call, -1)
        sequences.calls += 1
        # The snapshot of each sequence's recurrent state to keep.
        last_valid = [rows_per_call - 1] * batch
        start, standing = list(sequences.positions), [0] * batch
        for b in range(batch):
            if sequences.finished[b]:
                continue  # done: rerun at the same position until the others finish
            history, position = sequences.history[b], sequences.positions[b]
            known = min(len(history) - position, rows_per_call)
            valid = known  # rows whose keys and values are now right in the cache
            if position + known == len(history):  # the kernel generated
                row_logits = logits[b] if self.sampler is not None else None
                new, valid = accept(
                    rows[b], tokens[b], row_logits, known, proposals[b], self.sampler, self.rng
                )
                sequences.produced += sequences.take_steps(b, [len(new)], new)
                sequences.generating += 1
            sequences.positions[b] += valid
            last_valid[b], standing[b] = valid - 1, valid
        if self.observe is not None:
            self.observe(sequences.history, start, self.drafter_reads(read), standing)
        if self.keep_snapshots is not None and min(last_valid) < rows_per_call - 1:
            caches = self.keep_snapshots(caches, jnp.asarray(last_valid, jnp.int32))
        return caches
