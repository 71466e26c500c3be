"""A build's `mtp` or `block` drafter on the device (docs/drafting.md): drafts from the
target's hidden states the kernel writes (KernelLayout.draft_hidden), inside the jitted
multi-step call (decode.chunk_decoder) as a separate JAX computation between kernel
steps, not fused into the pallas_call.

The math is the reference's (mkgen.reference.draft: mtp_layer and mtp_head, block_context
and block_drafts); what differs is the bookkeeping, which keeps shapes static and counts
per sequence. After each kernel step, `observe` commits the fed rows' hidden states into
the drafter's caches (MTP's KV of its layer and its last entry's output, DFlash's context
K/V) from the sequence's committed length, all rows written but only the accepted ones
counted: what sits past the committed length is written again next step, which is the
roll-back. `draft` then drafts after the sequence's next token from what is committed.

A drafter needs the hidden states of every position before the one it drafts after. The
runner and the server hand it the XLA prefill's states at the drafter's layers (a commit
from position 0 begins a sequence afresh) and every kernel step's; a sequence whose
history the drafter has not seen whole (a prompt restored from the server's host cache)
cannot be caught up without them, so its drafts come from the fallback (prompt lookup)
rather than from caches with holes.

Imports JAX: imported by decode.py after the device environment is set.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from mkgen.reference.draft import (
    block_context,
    block_drafts,
    init_draft_state,
    init_draft_weights,
    mtp_head,
    mtp_layer,
)
from mkgen.reference.model import greedy_token
from mkgen.runtime.drafter_slots import DrafterSlots, holds_history, per_sequence
from mkgen.spec.schema import BlockDraft, ModelSpec, MtpDraft


def _one(tree: Any) -> Any:
    """A pytree of per-sequence slices as a batch of one."""
    return jax.tree.map(lambda a: a[None], tree)


def _unbatched(tree: Any) -> Any:
    return jax.tree.map(lambda a: a[0], tree)


@dataclass(frozen=True)
class HiddenStateDrafter(DrafterSlots):
    """The `mtp` or `block` drafter of `spec` (the target's spec with its draft section)
    (DrafterSlots: batch, rows, capacity). Its state (a pytree): "length" [batch] the
    positions committed (-1: lost, the sequence drafts by the fallback), "tokens" [batch,
    capacity] the history they came from, "layers" the drafter's caches and, for mtp,
    "last" [batch, 1, hidden] the layer's output for the last committed entry (draft 1
    comes from it)."""

    spec: ModelSpec

    observes_steps = True  # observe takes each step's hidden states (decode.step_reads)
    observed_batch_axis = 1  # of those states, [len(draft_hidden), batch, n, HIDDEN]

    @property
    def mtp(self) -> bool:
        return isinstance(self.spec.draft, MtpDraft)

    def initial_state(self) -> dict[str, Any]:
        state = {
            **self.slots(0),
            "layers": init_draft_state(self.spec, self.batch, self.cache_len)["layers"],
        }
        if self.mtp:
            state["last"] = jnp.zeros((self.batch, 1, self.spec.dims.hidden), jnp.float32)
        return state

    def catch_up(
        self, weights: Any, state: dict[str, Any], history: jax.Array, positions: jax.Array
    ) -> dict[str, Any]:
        """`state` with every sequence that is not the one its caches hold marked lost
        (without the hidden states of its history there is nothing to commit it from)."""
        del weights, positions  # only hidden states could catch a sequence up
        return {**state, "length": jnp.where(holds_history(state, history), state["length"], -1)}

    def observe(
        self,
        weights: Any,
        state: dict[str, Any],
        history: jax.Array,
        start: jax.Array,
        hidden: jax.Array,
        count: jax.Array,
    ) -> dict[str, Any]:
        """`state` with rows fed at positions start[b].. committed: hidden [len(draft_hidden),
        batch, n, HIDDEN] their target states (the kernel's draft-hidden output, in the
        plan's order), count[b] how many of them stand (accepted, or known prompt rows),
        history [batch, capacity] every sequence's tokens with the new ones. A sequence
        whose committed length is not `start` is lost (-1), unless `start` is 0 (a commit
        from the first position begins the sequence afresh); one with count 0 is
        unchanged."""
        n = hidden.shape[2]
        padded = jnp.pad(history, ((0, 0), (0, n + 1)))
        rows = jnp.moveaxis(hidden, 1, 0)  # [batch, len(draft_hidden), n, HIDDEN]
        if self.mtp:
            commit = jax.vmap(lambda *a: self._commit_mtp(weights, *a))
            layers, last = commit(state["layers"], padded, start, rows, count)
        else:
            commit = jax.vmap(lambda *a: self._commit_block(weights, *a))
            layers, last = commit(state["layers"], padded, start, rows), None
        gained = count > 0
        kept = gained & ((state["length"] == start) | (start == 0))
        out = {
            "length": jnp.where(gained, jnp.where(kept, start + count, -1), state["length"]),
            # The layers with all the fed rows, accepted or not: those past the committed
            # length are written again next step.
            **per_sequence(
                gained,
                {"tokens": history, "layers": layers},
                {"tokens": state["tokens"], "layers": state["layers"]},
            ),
        }
        if last is not None:
            out["last"] = jnp.where(kept[:, None, None], last, state["last"])
        return out

    def _commit_mtp(
        self, weights: Any, layers: Any, tokens: jax.Array, start: jax.Array,
        hidden: jax.Array, count: jax.Array,
    ) -> tuple[Any, jax.Array]:  # fmt: skip
        # Entry p pairs the target's state at p with token p + 1.
        n = hidden.shape[1]
        following = jax.lax.dynamic_slice(tokens, (start + 1,), (n,))
        out, cache = mtp_layer(
            self.spec, weights, _one(layers[0]), following[None], hidden[0][None], start
        )
        last = jax.lax.dynamic_slice_in_dim(out[0], jnp.maximum(count - 1, 0), 1)
        return [_unbatched(cache)], last

    def _commit_block(
        self, weights: Any, layers: Any, tokens: jax.Array, start: jax.Array, hidden: jax.Array
    ) -> Any:
        del tokens  # the context is the target's states alone
        draft = self.spec.draft
        assert isinstance(draft, BlockDraft)
        features = jnp.concatenate(list(hidden), axis=-1)[None]  # the feature layers' order
        return _unbatched(block_context(draft, weights, _one(layers), features, start))

    def draft(
        self,
        weights: Any,
        state: dict[str, Any],
        history: jax.Array,
        positions: jax.Array,
        fallback: Callable[[], jax.Array],
    ) -> tuple[jax.Array, dict[str, Any]]:
        """Drafts [batch, rows - 1] after each sequence's next token history[b,
        positions[b]], from what is committed before it; a sequence whose committed
        length is not its position takes fallback()'s. The state is unchanged (what the
        MTP chain writes past the committed length is not kept)."""
        if self.mtp:
            made = jax.vmap(lambda *a: self._draft_mtp(weights, *a))(
                state["layers"], state["last"], positions
            )
        else:
            tokens = history[jnp.arange(self.batch), positions]
            made = jax.vmap(lambda *a: self._draft_block(weights, *a))(
                state["layers"], tokens, positions
            )
        usable = state["length"] == positions
        return jnp.where(usable[:, None], made, fallback()), state

    def _draft_mtp(
        self, weights: Any, layers: Any, last: jax.Array, position: jax.Array
    ) -> jax.Array:
        # Draft 1 from the last committed entry (it paired the state before the position
        # with the token at it); draft j + 1 from an entry pairing draft j with the chain.
        cache = _one(layers[0])
        logits, chained = mtp_head(self.spec, weights, last[None])
        drafts = []
        for j in range(self.rows - 1):
            drafts.append(greedy_token(self.spec, logits))
            if j + 1 < self.rows - 1:
                out, cache = mtp_layer(
                    self.spec, weights, cache, drafts[-1][:, None], chained, position + j
                )
                logits, chained = mtp_head(self.spec, weights, out)
        return jnp.concatenate(drafts)

    def _draft_block(
        self, weights: Any, layers: Any, token: jax.Array, position: jax.Array
    ) -> jax.Array:
        draft = self.spec.draft
        assert isinstance(draft, BlockDraft)
        drafts, _ = block_drafts(
            self.spec, draft, weights, _one(layers), token[None], position, self.rows
        )
        return drafts[0]


def hidden_drafter_weights(spec: ModelSpec, target: Mapping[str, Any], seed: int) -> dict[str, Any]:
    """An mtp or block drafter's random weights (the reference's init_draft_weights drawn
    with `seed`) beside the target tensors it reads: the embedding and, untied, the LM
    head, as `target` (the runner's stored target weights) holds them."""
    shared = ["embedding"] + ([] if spec.dims.tie_embeddings else ["lm_head"])
    return {**init_draft_weights(spec, seed), **{name: target[name] for name in shared}}
