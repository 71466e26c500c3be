"""What the build's drafters on the device share (mkgen.runtime.device_drafting's model
drafter, mkgen.runtime.hidden_drafting's mtp and block drafters): per sequence, the
committed length and the history it came from, and caches with room for a commit past
the committed length.

Imports JAX: imported by decode.py after the device environment is set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp


@dataclass(frozen=True, kw_only=True)
class DrafterSlots:
    """A drafter for `batch` sequences verified `rows` rows a step, whose histories hold up
    to `capacity` tokens."""

    batch: int
    rows: int
    capacity: int

    @property
    def cache_len(self) -> int:
        # A commit writes ROWS entries from the committed length, at most the position.
        return self.capacity + 2 * self.rows

    def slots(self, length: int) -> dict[str, jax.Array]:
        """The state's per-sequence part: "length" [batch] the positions committed (all
        `length` at first), "tokens" [batch, capacity] the history they came from."""
        return {
            "length": jnp.full((self.batch,), length, jnp.int32),
            "tokens": jnp.zeros((self.batch, self.capacity), jnp.int32),
        }


def holds_history(state: dict[str, Any], history: jax.Array) -> jax.Array:
    """[batch] whether each sequence's committed tokens (state["tokens"] before
    state["length"]) are a prefix of its history: the same sequence, not a new one in
    the slot."""
    held = jnp.arange(history.shape[1]) < state["length"][:, None]
    return jnp.all((state["tokens"] == history) | ~held, axis=1)


def per_sequence(mask: jax.Array, new: Any, old: Any) -> Any:
    """The pytree `new` for the sequences where `mask` [batch] holds, `old` elsewhere
    (every leaf's leading axis is the sequence)."""

    def pick(a: jax.Array, b: jax.Array) -> jax.Array:
        return jnp.where(mask.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)

    return jax.tree.map(pick, new, old)
