"""Finished sequences' caches in host memory, for prompts that start with them (multi-turn
chat): an LRU bounded in bytes, keyed by the exact token ids the caches hold.

A sequence's caches are the kernel's cache arrays of its slot (batch 1, in the kernel's
layout, every core's share: mkgen.runtime.disaggregation.offload), holding its tokens at
positions 0..len - 1. Arrays indexed by position (KV and MLA latent caches) are kept for
those positions only, and given back padded with zeros to the context; the others
(recurrent conv tails and states) whole. A prompt reuses the entry of the longest such
token sequence that its own ids start with and that leaves at least its last token to
feed the kernel. Only an exact prefix is reused: a recurrent state cannot be rewound to
fewer tokens.

Host-side only: the engine offloads and restores.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# The position axis of a KV or MLA latent kernel cache array ([devices, layers, batch,
# heads, context, head_dim]: mkgen.plan.layout's CacheArray with the devices first).
POSITION_AXIS = 4


@dataclass(frozen=True)
class CachedPrefix:
    """A hit: the cached caches hold the prompt's first `length` tokens."""

    length: int
    caches: list[np.ndarray]


class HostCache:
    """Sequences' caches by their token ids, least recently used evicted first so that
    their bytes stay within `limit_bytes`; a sequence larger than the limit is not kept.
    `by_position[i]` says whether cache array i is indexed by position (on POSITION_AXIS,
    `context` long): such an array is kept for the sequence's positions only."""

    def __init__(self, limit_bytes: int, by_position: Sequence[bool], context: int) -> None:
        self.limit_bytes, self.by_position, self.context = limit_bytes, list(by_position), context
        self.bytes = 0
        self._entries: collections.OrderedDict[tuple[int, ...], list[np.ndarray]] = (
            collections.OrderedDict()
        )

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: Sequence[int]) -> CachedPrefix | None:
        """The entry of the longest cached sequence that `prompt` starts with, all but its
        last token at most (the one the kernel is fed), now the most recently used; None
        when no cached sequence is such a prefix."""
        lengths = sorted({len(k) for k in self._entries if len(k) < len(prompt)}, reverse=True)
        for length in lengths:
            key = tuple(prompt[:length])
            if key in self._entries:
                self._entries.move_to_end(key)
                return CachedPrefix(length, self._in_context(self._entries[key]))
        return None

    def store(self, tokens: Sequence[int], caches: list[np.ndarray]) -> int:
        """Keep `caches`, which hold `tokens`, as the most recently used entry (replacing
        one of the same tokens), evicting the least recently used ones beyond the limit;
        how many were evicted."""
        key = tuple(tokens)
        caches = [  # copies: a view would keep the whole context alive
            a[(slice(None),) * POSITION_AXIS + (slice(len(key)),)].copy() if positions else a
            for a, positions in zip(caches, self.by_position, strict=True)
        ]
        size = sum(a.nbytes for a in caches)
        if not key or size > self.limit_bytes:
            return 0
        self._drop(key)
        evicted = 0
        while self.bytes + size > self.limit_bytes:
            self._drop(next(iter(self._entries)))
            evicted += 1
        self._entries[key] = caches
        self.bytes += size
        return evicted

    def _in_context(self, caches: list[np.ndarray]) -> list[np.ndarray]:
        """Kept caches as the kernel holds them: position-indexed ones padded with zeros
        to the context."""
        out = []
        for a, positions in zip(caches, self.by_position, strict=True):
            if positions:
                width = [(0, 0)] * a.ndim
                width[POSITION_AXIS] = (0, self.context - a.shape[POSITION_AXIS])
                a = np.pad(a, width)
            out.append(a)
        return out

    def _drop(self, key: tuple[int, ...]) -> None:
        dropped = self._entries.pop(key, None)
        if dropped is not None:
            self.bytes -= sum(a.nbytes for a in dropped)
