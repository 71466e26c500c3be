"""Finished sequences' caches in host memory, for prompts that start with them (multi-turn
chat): an LRU bounded in bytes, keyed by the exact token ids the caches hold.

A sequence's caches are the kernel's cache arrays of its slot (batch 1, in the kernel's
layout, every core's share: mkgen.runtime.disaggregation.offload), holding its tokens at
positions 0..len - 1. A prompt reuses the entry of the longest such token sequence that
its own ids start with and that leaves at least its last token to feed the kernel. Only
an exact prefix is reused: a recurrent state cannot be rewound to fewer tokens.

Host-side only (the engine offloads and restores), and light to import: the CLI reads
HOST_CACHE_MIB.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

HOST_CACHE_MIB = 4096  # mkgen serve --host-cache-mib's default


@dataclass(frozen=True)
class CachedPrefix:
    """A hit: the cached caches hold the prompt's first `length` tokens."""

    length: int
    caches: list[np.ndarray]


class HostCache:
    """Sequences' caches by their token ids, least recently used evicted first so that
    their bytes stay within `limit_bytes`; a sequence larger than the limit is not kept."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
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
                return CachedPrefix(length, self._entries[key])
        return None

    def store(self, tokens: Sequence[int], caches: list[np.ndarray]) -> int:
        """Keep `caches`, which hold `tokens`, as the most recently used entry (replacing
        one of the same tokens), evicting the least recently used ones beyond the limit;
        how many were evicted."""
        key = tuple(tokens)
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

    def _drop(self, key: tuple[int, ...]) -> None:
        dropped = self._entries.pop(key, None)
        if dropped is not None:
            self.bytes -= sum(a.nbytes for a in dropped)
