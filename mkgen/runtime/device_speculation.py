"""Speculative decoding inside the jitted multi-step call (decode.chunk_decoder): the
drafts of speculation.prompt_lookup and the acceptance of speculation.accept (greedy, or
the rejection rule of a point-mass drafter) computed on the device for every sequence at
once, so that several verified steps run per device call. With one row per sequence
(no drafts) the acceptance is plain greedy or sampled decoding.

Imports JAX: imported by decode.py after the device environment is set.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from mkgen.runtime.sampling import draw, draw_key, filtered_logits


def prompt_lookup_on_device(
    history: jax.Array, length: jax.Array, count: int, ngram: int
) -> jax.Array:
    """speculation.prompt_lookup for every sequence: history [BATCH, capacity] holds each
    sequence's tokens, length [BATCH] how many; -> [BATCH, count] drafts: the tokens that
    followed the last earlier occurrence of the longest suffix (up to `ngram` tokens),
    padded with the last token."""
    capacity = history.shape[1]
    starts = jnp.arange(capacity)

    def one(tokens: jax.Array, length: jax.Array) -> jax.Array:
        at = lambda i: tokens[jnp.clip(i, 0, capacity - 1)]  # noqa: E731
        found_start, found_n = jnp.int32(-1), jnp.int32(0)
        for n in range(1, ngram + 1):  # a longer suffix found overrides a shorter one
            match = starts + n < length  # an occurrence that ends before the last token
            for k in range(n):
                match &= at(starts + k) == at(length - n + k)
            last = jnp.max(jnp.where(match, starts, -1))
            found_start = jnp.where(last >= 0, last, found_start)
            found_n = jnp.where(last >= 0, n, found_n)
        follow = found_start + found_n + jnp.arange(count)
        return jnp.where((found_start >= 0) & (follow < length), at(follow), at(length - 1))

    return jax.vmap(one)(history, length)


def _leading(accepted: jax.Array) -> jax.Array:
    """How many leading entries of each row of `accepted` [BATCH, n] are true."""
    return jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=1), axis=1)


def accept_on_device(
    fed: jax.Array,
    greedy: jax.Array,
    logits: jax.Array,
    sampling: Any,
    positions: jax.Array,
    vocab_used: int,
) -> tuple[jax.Array, jax.Array]:
    """What each sequence gains from a step whose rows were `fed` [BATCH, ROWS] (the next
    token, then drafts) at `positions`: (new [BATCH, ROWS], accepted [BATCH]); the first
    accepted + 1 entries of new are its tokens. greedy [BATCH, ROWS]: the kernel's token
    after each row; logits [BATCH * ROWS, vocab]; sampling: decode.SamplingParams.

    Greedy (temperature 0): the drafts that equal the kernel's token before them are
    accepted, then the kernel's token after the last accepted row. Sampled: draft d after
    row j is accepted with probability p_j(d); the first rejection draws from p_j without
    d (renormalised), else one more token is drawn from the last row, so the tokens are
    distributed as sampling without drafts. Row j's draws are keyed by the sequence's seed
    and position + j: with one row this is plain sampling on the device."""
    batch, rows = fed.shape
    drafts = fed[:, 1:]
    greedy_accepted = _leading(drafts == greedy[:, :-1])

    def per_row(values: jax.Array) -> jax.Array:
        return jnp.repeat(values, rows)

    z = filtered_logits(
        logits, per_row(sampling.temperature), per_row(sampling.top_k),
        per_row(sampling.top_p), vocab_used,
    ).reshape(batch, rows, vocab_used)  # fmt: skip
    row_positions = positions[:, None] + jnp.arange(rows)
    seeds = jnp.broadcast_to(sampling.seed[:, None], (batch, rows))
    next_draft = jnp.concatenate([drafts, jnp.full((batch, 1), -1, drafts.dtype)], axis=1)
    p_draft = jnp.take_along_axis(
        jax.nn.softmax(z, axis=-1), jnp.clip(next_draft, 0)[..., None], axis=-1
    )[..., 0]
    uniform = jax.vmap(lambda s, p: jax.random.uniform(jax.random.fold_in(draw_key(s, p), 1)))
    draws_accepted = uniform(seeds.reshape(-1), row_positions.reshape(-1)).reshape(batch, rows)
    sampled_accepted = _leading((draws_accepted < p_draft)[:, :-1])
    residual = jnp.where(jnp.arange(vocab_used) == next_draft[..., None], -jnp.inf, z)
    # A draft of probability 1 is never rejected; its row keeps z.
    residual = jnp.where(jnp.isfinite(residual).any(-1, keepdims=True), residual, z)
    drawn = draw(
        residual.reshape(batch * rows, vocab_used), seeds.reshape(-1), row_positions.reshape(-1)
    ).reshape(batch, rows)
    sampled_new = jnp.where(jnp.arange(rows) < sampled_accepted[:, None], next_draft, drawn)
    is_sampled = sampling.temperature > 0
    new = jnp.where(is_sampled[:, None], sampled_new, greedy)
    return new, jnp.where(is_sampled, sampled_accepted, greedy_accepted)
