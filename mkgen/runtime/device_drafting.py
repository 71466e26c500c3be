"""The build's own drafter (`mkgen build --draft`, docs/drafting.md) on the device: every
sequence's drafts made inside the jitted multi-step call (decode.chunk_decoder), as a
separate JAX computation between kernel steps. It is not fused into the pallas_call, so
the plan's draft_ms (the cost model's price of a fused draft) is not this path's time.

The draft math is the reference's (mkgen.reference.draft): a `model` drafter commits the
tokens the target accepted, then drafts its greedy continuation of the next token
(model_drafts). Shapes stay static on the device: each step commits ROWS tokens of the
history from what the drafter holds (at most ROWS were gained since), and only those
before the sequence's position count as committed; the rest, like the drafts, sit past
the committed length and are written again next step (the roll-back of
mkgen.reference.draft's docstring). `mtp` and `block` drafters read the target's hidden
states: mkgen.runtime.hidden_drafting drafts with them.

Imports JAX: imported by decode.py after the device environment is set.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mkgen.errors import MkgenError
from mkgen.kinds import default_registry
from mkgen.reference.draft import model_drafts
from mkgen.reference.model import forward, init_cache
from mkgen.runtime.drafter_slots import DrafterSlots, holds_history, per_sequence
from mkgen.runtime.hidden_drafting import HiddenStateDrafter, hidden_drafter_weights
from mkgen.spec.schema import ModelDraft, ModelSpec, MtpDraft


@dataclass(frozen=True)
class DeviceDrafter(DrafterSlots):
    """A `model` drafter (DrafterSlots: batch, rows, capacity). Its state (a pytree):
    "length" [batch] the positions committed in its cache (-1: nothing yet), "tokens"
    [batch, capacity] the histories they came from, "layers" the small model's caches."""

    model: ModelSpec

    observes_steps = False  # it drafts from the tokens alone

    def initial_state(self) -> dict[str, Any]:
        return {
            **self.slots(-1),
            "layers": init_cache(self.model, self.batch, self.cache_len)["layers"],
        }

    def catch_up(
        self, weights: Any, state: dict[str, Any], history: jax.Array, positions: jax.Array
    ) -> dict[str, Any]:
        """`state` with every sequence whose cache does not hold a prefix of its history
        within ROWS tokens of its position (a new sequence in the slot, or the first
        call) committed afresh: the whole history through the small model from 0."""
        length = state["length"]
        stale = (
            ~holds_history(state, history)
            | (length < 0)
            | (positions - length > self.rows)
            | (positions < length)
        )

        def afresh(state: dict[str, Any]) -> dict[str, Any]:
            cache = init_cache(self.model, self.batch, self.cache_len)
            layers = forward(self.model, weights, history, cache, 0)[1]["layers"]
            return {
                "length": jnp.where(stale, positions, length),
                **per_sequence(
                    stale,
                    {"tokens": history, "layers": layers},
                    {"tokens": state["tokens"], "layers": state["layers"]},
                ),
            }

        return jax.lax.cond(jnp.any(stale), afresh, lambda state: state, state)

    def draft(
        self,
        weights: Any,
        state: dict[str, Any],
        history: jax.Array,
        positions: jax.Array,
        fallback: Callable[[], jax.Array],
    ) -> tuple[jax.Array, dict[str, Any]]:
        """Drafts [batch, rows - 1] after each sequence's next token history[b,
        positions[b]], and the state with history[:positions] committed. catch_up has
        caught every sequence up, so none takes fallback()'s drafts (HiddenStateDrafter's
        may)."""
        del fallback  # every sequence was caught up
        padded = jnp.pad(history, ((0, 0), (0, self.rows)))

        def one(layers: Any, length: jax.Array, tokens: jax.Array, position: jax.Array) -> Any:
            cache = {"length": length, "layers": jax.tree.map(lambda a: a[None], layers)}
            block = jax.lax.dynamic_slice(tokens, (length,), (self.rows,))
            committed = forward(self.model, weights, block[None], cache, length)[1]
            committed = {"length": position, "layers": committed["layers"]}
            drafts, _ = model_drafts(
                self.model, weights, committed, tokens[position][None], self.rows
            )
            return drafts[0], jax.tree.map(lambda a: a[0], committed["layers"])

        drafts, layers = jax.vmap(one)(state["layers"], state["length"], padded, positions)
        return drafts, {"length": positions, "tokens": history, "layers": layers}


def drafter_weights(model: ModelSpec, seed: int) -> dict[str, Any]:
    """A model drafter's random weights: init_draft_weights' (the reference's init_weights
    of the drafter model) as a kernel stores them (rounded to bf16, fake-quantized), so a
    drafter identical to the target gets the target's very weights."""
    from mkgen.weights.quantize import stored_random_weights

    return stored_random_weights(model, seed)


def random_drafter_tensors(spec: ModelSpec, seed: int, target: Mapping[str, Any]) -> dict[str, Any]:
    """The build's drafter's random weights drawn with `seed`: a model drafter's
    (drafter_weights), an mtp or block drafter's beside the embedding and LM head of
    `target`, the runner's stored target weights (hidden_drafter_weights)."""
    draft = spec.draft
    if isinstance(draft, ModelDraft):
        return drafter_weights(draft.model, seed)
    return hidden_drafter_weights(spec, target, seed)


@dataclass(frozen=True)
class DeviceDrafting:
    """A build's drafter ready on the devices: the drafter and its weights (replicated)."""

    drafter: DeviceDrafter | HiddenStateDrafter
    weights: Any


def device_drafting(
    spec: ModelSpec,
    batch: int,
    rows: int,
    capacity: int,
    mesh: Mesh,
    tensors: Callable[[], Mapping[str, Any]],
) -> DeviceDrafting:
    """The build's drafter (its spec's draft section) with the weights `tensors()` gives
    (random_drafter_tensors, or converted ones: mkgen.runtime.weights.ConvertedWeights
    .drafter), replicated on `mesh`. A drafter model with recurrent layers, or an mtp
    drafter of several modules, is one line (MkgenError), before the weights are made."""
    replicated = NamedSharding(mesh, P())
    draft = spec.draft
    if isinstance(draft, MtpDraft) and draft.layers != 1:
        raise MkgenError(
            f"--drafter build: the mtp drafter has {draft.layers} modules; the runner drafts "
            "with one, as the reference does; pass --drafter ngram (prompt lookup)"
        )
    if not isinstance(draft, ModelDraft):
        weights = jax.device_put(dict(tensors()), replicated)
        return DeviceDrafting(
            HiddenStateDrafter(spec, batch=batch, rows=rows, capacity=capacity), weights
        )
    model = draft.model
    kinds = default_registry()
    if any(kinds.record(k.type).recurrent for k in model.attention_kinds.values()):
        raise MkgenError(
            f"--drafter build: the drafter {model.name} has recurrent layers, whose state the "
            "device step cannot roll back yet; pass --drafter ngram (prompt lookup)"
        )
    weights = jax.device_put(dict(tensors()), replicated)
    return DeviceDrafting(DeviceDrafter(model, batch=batch, rows=rows, capacity=capacity), weights)
