"""Sampling from the kernel's logits: temperature, top-k, top-p, on the host (Sampler: the
rejection rule of speculative decoding with a custom drafter) or inside a jitted step
(filtered_logits, draw: device_speculation).

Imports JAX: imported by decode.py after the device environment is set."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class Sampler:
    """The sampling flags of a run; called on one row's logits, it gives the sampling
    probabilities (float64, [vocab_used]: the padding ids beyond are left out)."""

    temperature: float
    top_k: int
    top_p: float
    vocab_used: int

    def __call__(self, logits: np.ndarray) -> np.ndarray:
        z = np.asarray(logits[: self.vocab_used], np.float64) / self.temperature
        if 0 < self.top_k < self.vocab_used:
            kth = np.partition(z, -self.top_k)[-self.top_k]
            z = np.where(z < kth, -np.inf, z)
        p = np.exp(z - z.max())
        p /= p.sum()
        if self.top_p < 1.0:
            order = np.argsort(-p, kind="stable")
            before = np.cumsum(p[order]) - p[order]  # mass of the likelier tokens
            keep = np.zeros_like(p, bool)
            keep[order[before < self.top_p]] = True
            p = np.where(keep, p, 0.0)
            p /= p.sum()
        return p


def filtered_logits(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    vocab_used: int,
) -> jax.Array:
    """Each row of `logits` [N, vocab] tempered and cut to what it may draw ([N,
    vocab_used]: the padding ids beyond are left out; -inf where a token is cut), each row
    with its own temperature (> 0), top_k (0: all) and top_p in (0, 1]. The same rules as
    Sampler: top-k on the tempered logits, then the smallest set of likeliest tokens whose
    mass reaches top_p (tokens tied with the last one kept are kept too). Rows with
    temperature 0 are tempered by 1: the caller keeps their greedy token."""

    def one(row, temperature, top_k, top_p):
        z = row[:vocab_used] / jnp.where(temperature > 0, temperature, 1.0)
        ordered = jnp.sort(z)[::-1]
        kth = ordered[jnp.clip(top_k, 1, vocab_used) - 1]
        z = jnp.where((top_k > 0) & (z < kth), -jnp.inf, z)
        p = jax.nn.softmax(z)
        ordered_p = jnp.sort(p)[::-1]
        before = jnp.cumsum(ordered_p) - ordered_p  # mass of the likelier tokens
        # The least probability kept: the last sorted token whose predecessors miss top_p.
        least = jnp.min(jnp.where(before < top_p, ordered_p, jnp.inf))
        return jnp.where(p >= least, z, -jnp.inf)

    return jax.vmap(one)(logits.astype(jnp.float32), temperature, top_k, top_p)


def draw_key(seed: jax.Array, position: jax.Array) -> jax.Array:
    """The key of a sampled draw: the sequence's seed folded with the cache position of
    the row drawn from, so a sequence's tokens depend on its seed and its own positions
    only, not on the batch it shares a call with."""
    return jax.random.fold_in(jax.random.key(seed), position)


def draw(z: jax.Array, seed: jax.Array, position: jax.Array) -> jax.Array:
    """One token per row of filtered logits `z` [N, vocab_used] (filtered_logits), each
    row's draw keyed by its `seed` and `position` (draw_key)."""

    def one(z, seed, position):
        return jax.random.categorical(draw_key(seed, position), z).astype(jnp.int32)

    return jax.vmap(one)(z, seed, position)
