"""Generation through the megakernel: the prompt into the kernel's caches (XLA prefill or
the kernel itself), then kernel calls until every sequence has its tokens.

Imports JAX: imported by `run` after the device environment is set.
"""

from __future__ import annotations

import contextlib
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
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mkgen.runtime.build import Build, load_build
from mkgen.runtime.devices import host_value, make_mesh
from mkgen.runtime.sampling import Sampler, sample_on_device
from mkgen.runtime.speculation import Drafter, accept
from mkgen.runtime.weights import embedding_on_devices, progress_bar


@dataclass(frozen=True)
class Model:
    """A build's kernel ready to run: its layout, the megakernel module, the mesh, the
    weights (host side: the embedding) and the weights placed on the devices."""

    build: Build
    spec: Any
    layout: Any
    kernel: ModuleType
    mesh: Mesh
    weights: Any
    placed: dict[str, Any]


def load_model(
    build: Build,
    weights: Path | None,
    random_weights: int | None,
    *,
    verify: bool = True,
    meshes: int = 1,
) -> Model:
    """The build's kernel on its mesh with the converted `weights` (checked against
    layout.json's sha256 when `verify`), or the reference's random weights drawn with
    seed `random_weights` when `weights` is None, placed on the devices. Of `meshes`
    meshes (a disaggregated prefill's and the decode's), the decode takes the first."""
    from mkgen.runtime.weights import ConvertedWeights, RandomWeights, place_weights

    spec, layout, kernel = load_build(build)
    mesh = make_mesh(build, kernel, layout, meshes=meshes)
    if weights is not None:
        loaded: Any = ConvertedWeights(spec, layout, weights, build, verify)
    else:
        loaded = RandomWeights(spec, layout, random_weights or 0)
    placed = place_weights(build, loaded, mesh, kernel)
    return Model(build, spec, layout, kernel, mesh, loaded, placed)


@dataclass(frozen=True)
class Generation:
    """What decode returns: the generated tokens per sequence, the device calls made, the
    mean tokens generated per generating kernel step (the acceptance length) and the
    seconds per kernel step of each call."""

    tokens: list[list[int]]
    calls: int
    acceptance: float
    seconds: list[float]


def prefill(model: Model, prompts: list[list[int]], where: str) -> tuple[list[jax.Array], int]:
    """The kernel's caches after the prompts' first tokens, and how many tokens they hold.

    With --prefill xla (the default), all but the last token of the shortest prompt run
    through the model in XLA over the placed per-core weights (mkgen.codegen.prefill: a
    shard_map in which each core unpacks its own banks, the routed experts run where
    they lie) and land in the kernel's cache layout; the rest of every prompt then goes
    through the kernel ROWS tokens per call. With --prefill kernel the caches start
    empty and the whole prompt goes through the kernel."""
    from mkgen.codegen.prefill import prefill as xla_prefill

    held = min(len(p) for p in prompts) - 1 if where == "xla" else 0
    axis = model.kernel.AXIS
    if held >= 1:
        tokens = np.array([p[:held] for p in prompts], np.int32)
        with progress_bar(len(model.layout.attention_table), "prefill", "layer") as bar:

            def layer_done(output: jax.Array) -> None:
                if not bar.disable:  # a shown bar waits for the layer, so it moves truly
                    jax.block_until_ready(output)
                bar.update()

            caches = xla_prefill(
                model.spec, model.layout, model.mesh, axis, model.placed,
                model.weights.embedding, tokens, progress=layer_done,
            )  # fmt: skip
        return caches, held
    return empty_caches(model, model.build.batch), 0


def empty_caches(model: Model, batch: int) -> list[jax.Array]:
    """The kernel's cache arrays for `batch` sequences, all zero, sharded as the kernel
    takes them ([devices, layers, batch, ...])."""
    sharded = NamedSharding(model.mesh, P(model.kernel.AXIS))
    zeros = []
    for shape, dtype in model.kernel.cache_shapes():
        layers, _, *rest = shape
        zeros.append(np.zeros((model.build.devices, layers, batch, *rest), np.dtype(dtype)))
    return [jax.make_array_from_callback(c.shape, sharded, lambda i, c=c: c[i]) for c in zeros]


def prefill_sequence(model: Model, prompt_ids: list[int]) -> list[jax.Array]:
    """One sequence's kernel cache arrays (batch 1: [devices, layers, 1, ...]) holding
    `prompt_ids` at positions 0..len - 1, through the XLA prefill (zeros when there are
    none); mkgen.runtime.slots.insert_sequence puts them in a slot of the decode caches.
    The server's engine prefills every admitted prompt through this one function."""
    from mkgen.codegen.prefill import prefill as xla_prefill

    if not prompt_ids:
        return empty_caches(model, 1)
    return xla_prefill(
        model.spec, model.layout, model.mesh, model.kernel.AXIS, model.placed,
        model.weights.embedding, np.asarray([prompt_ids], np.int32),
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


def chunk_decoder(model: Model, step_fn: Callable[..., Any], steps_per_call: int) -> Any:
    """A jitted loop of up to `steps_per_call` kernel steps in one device call (ROWS 1):
    (feed [BATCH] tokens, positions, budget [BATCH] steps each sequence may still take,
    count, SamplingParams, the embedding on the devices (embedding_on_devices), placed
    weights, caches) -> (tokens [steps_per_call, BATCH], caches). Step i feeds each
    sequence's token from step i - 1, embedded on the device, at the next position; a
    sequence whose budget is spent repeats its last step in place. A sequence with a
    temperature samples its token on the device (sample_on_device), the others keep the
    kernel's greedy one, so the host is visited once per call either way."""
    layout = model.layout
    tables = jnp.asarray(model.kernel.LAYER_TABLES, jnp.int32)
    vocab_used = model.build.vocab_used

    def run(feed, positions, budget, count, sampling, embedding, placed, caches):
        def step(i, carry):
            feed, positions, caches, out = carry
            x = jnp.zeros((layout.tokens_padded, layout.hidden), jnp.float32)
            x = x.at[: layout.tokens].set(embedding[feed].astype(jnp.float32))
            greedy, logits, *caches = step_fn(
                tables, positions, x, placed["final_norm"], placed["stream"],
                placed["vectors"], *placed["experts"], *caches,
            )  # fmt: skip
            sampled = sample_on_device(
                logits, sampling.temperature, sampling.top_k, sampling.top_p, sampling.seed,
                positions, vocab_used,
            )  # fmt: skip
            tokens = jnp.where(sampling.temperature > 0, sampled, greedy)
            active = i < budget
            feed = jnp.where(active, tokens, feed)
            return feed, positions + active, caches, out.at[i].set(tokens)

        out = jnp.zeros((steps_per_call, model.build.batch), jnp.int32)
        carry = (feed, positions, list(caches), out)
        _, _, caches, out = jax.lax.fori_loop(0, count, step, carry)
        return out, caches

    return jax.jit(run, donate_argnums=7)


def decode(
    model: Model,
    caches: list[jax.Array],
    held: int,
    args: Namespace,
    drafter: Drafter,
    stream: Callable[[list[int]], None] | None = None,
) -> Generation:
    """Generation through the megakernel.

    Each call feeds ROWS rows per sequence at its cache position: the tokens known next
    (prompt tokens not yet in the cache, or the last generated token), then drafts. The
    kernel's token after the last known row is generated, and so is its token after every
    further row whose draft is accepted (accept). Decoding without drafts (greedy, or
    sampled on the device) runs up to --steps-per-call steps per device call once every
    sequence generates (chunk_decoder). `stream` (batch 1) gets the generated ids after
    every call."""
    build, layout, kernel, placed = model.build, model.layout, model.kernel, model.placed
    batch, rows_per_call = build.batch, build.rows
    step_fn = kernel.make_decode_step(model.mesh)
    chunked = None
    if rows_per_call == 1 and args.steps_per_call > 1:
        chunked = chunk_decoder(model, step_fn, args.steps_per_call)
        embedding_placed = embedding_on_devices(build, model.weights.embedding, model.mesh, kernel)
        sampling = SamplingParams.create(
            [args.temperature] * batch, [args.top_k] * batch, [args.top_p] * batch,
            [args.seed] * batch,
        )  # fmt: skip
    keep_snapshots = snapshot_keeper(model)
    tables = jnp.asarray(kernel.LAYER_TABLES, jnp.int32)
    embedding = model.weights.embedding
    sampler = None
    if args.temperature > 0:
        sampler = Sampler(args.temperature, args.top_k, args.top_p, build.vocab_used)
    rng = np.random.default_rng(args.seed)
    history = [list(p) for p in args.prompts]  # prompt, then generated tokens
    positions = [held] * batch  # tokens already in each sequence's cache
    generated: list[list[int]] = [[] for _ in range(batch)]
    finished = [False] * batch
    calls = produced = generating = 0
    seconds = []

    def take(b: int, new: list[int]) -> int:
        """Sequence b gains `new`, cut at --steps and after a stop id; how many it kept."""
        new = new[: args.steps - len(generated[b])]
        stops = [i for i, t in enumerate(new) if t in args.stop]
        if stops:
            new = new[: stops[0] + 1]
        generated[b] += new
        history[b] += new
        if stream is not None:
            stream(generated[b])
        finished[b] = bool(stops) or len(generated[b]) >= args.steps
        return len(new)

    mode = (
        pltpu.force_tpu_interpret_mode(pltpu.InterpretParams())
        if args.interpret
        else contextlib.nullcontext()
    )
    with mode:
        while not all(finished):
            budget = [0 if finished[b] else args.steps - len(generated[b]) for b in range(batch)]
            ready = all(p + 1 == len(h) for p, h in zip(positions, history, strict=True))
            if chunked is not None and ready and max(budget) > 1:
                # Every sequence generates: several steps in one device call.
                count = min(args.steps_per_call, max(budget))
                feed = [h[p] for h, p in zip(history, positions, strict=True)]
                start = time.perf_counter()
                out, caches = chunked(
                    jnp.asarray(feed, jnp.int32), jnp.asarray(positions, jnp.int32),
                    jnp.asarray(budget, jnp.int32), count, sampling, embedding_placed, placed,
                    caches,
                )  # fmt: skip
                out = host_value(jax.block_until_ready(out))
                seconds.append((time.perf_counter() - start) / count)
                calls += 1
                for b in range(batch):
                    if not finished[b]:
                        gained = take(b, [int(t) for t in out[:count, b]])
                        produced, generating = produced + gained, generating + gained
                        positions[b] += gained
                continue
            rows, proposals = [], []
            for h, pos in zip(history, positions, strict=True):
                known = h[pos : pos + rows_per_call]
                short = rows_per_call - len(known)
                proposal = drafter(h, short) if short else []
                proposals.append(proposal)
                ids = proposal[0] if isinstance(proposal, tuple) else proposal
                rows.append(known + [int(t) for t in ids])
            rows = np.array(rows, np.int32)  # [BATCH, ROWS]
            x = np.zeros((layout.tokens_padded, layout.hidden), np.float32)
            x[: layout.tokens] = embedding[rows.reshape(-1)].astype(np.float32)
            start = time.perf_counter()
            tokens, logits, *caches = step_fn(
                tables, jnp.asarray(positions, jnp.int32), jnp.asarray(x), placed["final_norm"],
                placed["stream"], placed["vectors"], *placed["experts"], *caches,
            )  # fmt: skip
            tokens = host_value(jax.block_until_ready(tokens)).reshape(batch, rows_per_call)
            seconds.append(time.perf_counter() - start)
            if sampler is not None:
                logits = host_value(logits).reshape(batch, rows_per_call, -1)
            calls += 1
            # The snapshot of each sequence's recurrent state to keep.
            last_valid = [rows_per_call - 1] * batch
            for b in range(batch):
                if finished[b]:
                    continue  # done: rerun at the same position until the others finish
                known = min(len(history[b]) - positions[b], rows_per_call)
                valid = known  # rows whose keys and values are now right in the cache
                if positions[b] + known == len(history[b]):  # the kernel generated
                    row_logits = logits[b] if sampler is not None else None
                    new, valid = accept(
                        rows[b], tokens[b], row_logits, known, proposals[b], sampler, rng
                    )
                    produced, generating = produced + take(b, new), generating + 1
                positions[b] += valid
                last_valid[b] = valid - 1
            if keep_snapshots is not None and min(last_valid) < rows_per_call - 1:
                caches = keep_snapshots(caches, jnp.asarray(last_valid, jnp.int32))
    return Generation(generated, calls, produced / max(generating, 1), seconds)
