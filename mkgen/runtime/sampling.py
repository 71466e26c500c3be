"""Sampling on the host from the kernel's logits: temperature, top-k, top-p."""

from __future__ import annotations

from dataclasses import dataclass

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
