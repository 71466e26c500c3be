"""The drafts a kernel that drafts writes (mkgen build --fuse-draft, docs/drafting.md#the-
drafter-in-the-kernel), as the runner's device drafter: the kernel's MTP passes draft inside
the step, so there is nothing to compute between steps, only drafts to carry to the next.

After each step the kernel writes, per sequence, the rows its accept rule (greedy) took and
the R - 1 drafts after the last of them. The runner takes them as the next step's drafts
where it took as many rows itself: always when greedy (the same rule on the same tokens).
The first step after an XLA prefill takes the prefill's drafts, the MTP module's greedy
chain from the prompt's last entry (mkgen.runtime.prefill), observed as a step that took
the prefilled rows. When sampling, the rejection rule may take other rows, and then the
step after drafts by the fallback (prompt lookup), as after a step outside the device
calls or a prompt restored whole from the server's host cache; where it takes as many
rows but samples another last token than
the kernel's greedy one, the kernel's drafts (made after the greedy token) are proposed
anyway. Drafts are only proposals, verified like any other, so the tokens are exact
whatever is proposed; the rejection rule inside the kernel is what would draft after the
sampled token.

Imports JAX: imported by decode.py after the device environment is set.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from mkgen.runtime.drafter_slots import DrafterSlots, per_sequence


@dataclass(frozen=True)
class KernelDrafts(DrafterSlots):
    """The kernel's drafts (DrafterSlots: batch, rows, capacity). Its state: "position"
    [batch] the position whose token the drafts follow (-1: none), "token" [batch] that
    token (a new sequence in the slot has another), "drafts" [batch, rows - 1]. It has no
    weights (the kernel streams the MTP module's)."""

    observes_steps = True  # observe takes each step's drafts (decode.step_reads)
    observed_batch_axis = 0  # of those, [batch, rows]

    def initial_state(self) -> dict[str, Any]:
        return {
            "position": jnp.full((self.batch,), -1, jnp.int32),
            "token": jnp.zeros((self.batch,), jnp.int32),
            "drafts": jnp.zeros((self.batch, self.rows - 1), jnp.int32),
        }

    def catch_up(
        self, weights: Any, state: dict[str, Any], history: jax.Array, positions: jax.Array
    ) -> dict[str, Any]:
        """`state`: drafts are only ever used at the position they follow."""
        del weights, history, positions
        return state

    def observe(
        self,
        weights: Any,
        state: dict[str, Any],
        history: jax.Array,
        start: jax.Array,
        made: jax.Array,
        count: jax.Array,
    ) -> dict[str, Any]:
        """`state` after a step fed at positions start[b]: made [batch, rows] the kernel's
        output (its accepted rows, then its drafts), count[b] the rows the runner took
        (0: sequence b unchanged), history [batch, capacity] every sequence's tokens with
        the new ones. The drafts follow position start + count (its token history's) when
        the kernel took as many rows; else there are none."""
        del weights
        gained = count > 0
        after = jnp.minimum(start + count, history.shape[1] - 1)
        taken = {
            "position": start + count,
            "token": history[jnp.arange(self.batch), after],
            "drafts": made[:, 1:],
        }
        dropped = {**state, "position": jnp.full_like(state["position"], -1)}
        agreed = gained & (made[:, 0] == count)
        return per_sequence(agreed, taken, per_sequence(gained, dropped, state))

    def draft(
        self,
        weights: Any,
        state: dict[str, Any],
        history: jax.Array,
        positions: jax.Array,
        fallback: Callable[[], jax.Array],
    ) -> tuple[jax.Array, dict[str, Any]]:
        """Drafts [batch, rows - 1] after each sequence's next token history[b, positions[b]]:
        the kernel's where they follow that position and token, else fallback()'s."""
        del weights
        token = history[jnp.arange(self.batch), positions]
        usable = (state["position"] == positions) & (state["token"] == token)
        return jnp.where(usable[:, None], state["drafts"], fallback()), state
