"""--bench: the kernel calls' step times and the tokens/s they give."""

from __future__ import annotations

from typing import Any

import numpy as np

from mkgen.runtime.build import Build


def bench_summary(build: Build, seconds: list[float], warmup: int, acceptance: float) -> dict:
    """ms per kernel call (median, and the 10th / 90th percentiles) after the warm-up
    calls, and the tokens/s that gives per user (acceptance tokens a call) and in all."""
    timed = np.array(seconds[warmup:] or seconds[-1:]) * 1e3
    median = float(np.median(timed))
    per_user = acceptance * 1e3 / median
    return {
        "calls": len(timed),
        "warmup": min(warmup, len(seconds) - 1),
        "ms_per_step": median,
        "ms_p10": float(np.percentile(timed, 10)),
        "ms_p90": float(np.percentile(timed, 90)),
        "tokens_per_s_per_user": per_user,
        "tokens_per_s": per_user * build.batch,
        "batch": build.batch,
        "rows": build.rows,
    }


def prefill_summary(tokens: int, seconds: float) -> dict:
    """The XLA prefill's tokens (every sequence's), its seconds (a prefill after the
    one that compiled) and their rate."""
    return {
        "prefill_tokens": tokens,
        "prefill_s": seconds,
        "prefill_tokens_per_s": tokens / seconds if tokens else 0.0,
    }


def describe(bench: dict[str, Any]) -> str:
    """The summary as the line the runner prints without --json."""
    return (
        f"bench: {bench['ms_per_step']:.3f} ms/step (median of {bench['calls']} calls, "
        f"p10 {bench['ms_p10']:.3f}, p90 {bench['ms_p90']:.3f}); "
        f"{bench['tokens_per_s_per_user']:.1f} tokens/s per user, "
        f"{bench['tokens_per_s']:.1f} tokens/s in all (batch {bench['batch']}); prefill "
        f"{bench['prefill_tokens']} tokens in {bench['prefill_s']:.2f} s "
        f"({bench['prefill_tokens_per_s']:.1f} tokens/s)"
    )
