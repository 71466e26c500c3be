"""Speculative decoding on the host: where drafts come from, and which the kernel's
outputs accept."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import numpy as np

from mkgen.errors import MkgenError

# A drafter: (history, count) -> count token ids, or (ids, distributions) for a sampling
# drafter (one distribution over the vocabulary per draft).
Drafter = Callable[[list[int], int], Any]


def prompt_lookup(history: list[int], count: int, ngram: int) -> list[int]:
    """The built-in drafter: find the longest suffix of `history` (up to `ngram` tokens)
    that occurred before, and propose the tokens that followed its last occurrence; pad
    with the last token."""
    if count == 0:
        return []
    for n in range(min(ngram, len(history) - 1), 0, -1):
        suffix = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start : start + n] == suffix:
                found = history[start + n : start + n + count]
                return found + [history[-1]] * (count - len(found))
    return [history[-1]] * count


def load_drafter(name: str, ngram: int) -> Drafter:
    """The draft source: `ngram` (prompt_lookup) or MODULE:CALLABLE."""
    if name == "ngram":
        return functools.partial(prompt_lookup, ngram=ngram)
    module, _, attr = name.partition(":")
    if not module or not attr:
        raise MkgenError(f"--drafter: expected ngram or MODULE:CALLABLE, got {name!r}")
    try:
        drafter = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as error:
        raise MkgenError(f"--drafter {name}: {error}") from None
    if not callable(drafter):
        raise MkgenError(f"--drafter {name}: not callable")
    return drafter


def accept(
    rows: np.ndarray,
    tokens: np.ndarray | None,
    logits: np.ndarray | None,
    known: int,
    proposal: Any,
    sampler: Callable[[np.ndarray], np.ndarray] | None,
    rng: np.random.Generator,
) -> tuple[list[int], int]:
    """The tokens one sequence gains from a call, and the rows now valid in its cache.

    rows [ROWS]: the call's inputs (`known` known tokens, then drafts); tokens [ROWS]: the
    kernel's greedy token after each row; logits (sampling only) [ROWS, vocab]. Greedy
    (`sampler` None): the token after the last known row, then while the next draft
    equals the token just taken, the token after that draft (the longest matching prefix).
    Sampling: each draft d is accepted with probability min(1, p(d) / q(d)) (q: the
    drafter's distribution, a point mass when it gives none); the first rejection draws
    from max(p - q, 0) renormalised and ends the call; when every draft is accepted, one
    more token is drawn from the last row. The result is distributed as sampling without
    drafts."""
    count, valid = len(rows), known
    if sampler is None:
        assert tokens is not None
        new = [int(tokens[known - 1])]
        while valid < count and rows[valid] == new[-1]:
            new.append(int(tokens[valid]))
            valid += 1
        return new, valid
    assert logits is not None
    new, dists = [], (proposal[1] if isinstance(proposal, tuple) else None)
    p = sampler(logits[known - 1])
    while valid < count:
        d = int(rows[valid])
        q = dists[valid - known] if dists is not None else None
        ratio = p[d] if q is None else (p[d] / q[d] if q[d] > 0 else 1.0)
        if rng.random() < ratio:
            new.append(d)
            p = sampler(logits[valid])
            valid += 1
            continue
        residual = p.copy()
        if q is None:
            residual[d] = 0.0
        else:
            residual = np.maximum(p - q[: len(p)], 0.0)
        if residual.sum() <= 0:
            residual = p
        new.append(int(rng.choice(len(p), p=residual / residual.sum())))
        return new, valid
    new.append(int(rng.choice(len(p), p=p)))
    return new, valid
