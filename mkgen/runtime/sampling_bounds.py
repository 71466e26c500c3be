"""What the device's sampling accepts (docs/serving.md, "Sampling"): one rule for `mkgen
run`'s flags and the server's requests. No JAX here: the runner checks its flags before
JAX starts."""

from __future__ import annotations

import numpy as np

SEED_LIMIT = 2**32  # seeds are uint32 on the device
# The smallest temperature but 0 (greedy): far smaller ones overflow the float32 logits
# (logit / temperature) into NaN draws, and this one is already all but greedy.
MIN_TEMPERATURE = 1e-5
FLOAT32_MAX = float(np.finfo(np.float32).max)

TEMPERATURE_RULE = f"0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}"
TOP_P_RULE = "in (0, 1]"


def temperature_fits(temperature: float) -> bool:
    """0 (greedy), or a temperature the float32 logits can be divided by (nan and inf not)."""
    return temperature == 0 or MIN_TEMPERATURE <= temperature <= FLOAT32_MAX


def top_p_fits(top_p: float) -> bool:
    """A nucleus mass in (0, 1] that stays above 0 in float32 (else it keeps no token)."""
    return 0 < top_p <= 1 and bool(np.float32(top_p) > 0)


def top_k_rule(vocab_used: int) -> str:
    return f"in [0, {vocab_used}] (the vocabulary; 0: every token)"


def sampling_problem(
    temperature: float, top_k: int, top_p: float, seed: int, vocab_used: int
) -> tuple[str, str] | None:
    """The first sampling field the device cannot take as it is, and why (None: every one
    fits)."""
    checks = (
        ("temperature", temperature, temperature_fits(temperature), TEMPERATURE_RULE),
        ("top_p", top_p, top_p_fits(top_p), TOP_P_RULE),
        ("top_k", top_k, 0 <= top_k <= vocab_used, top_k_rule(vocab_used)),
        ("seed", seed, 0 <= seed < SEED_LIMIT, "in [0, 2^32)"),
    )
    return next(
        ((name, f"must be {rule}, got {value}") for name, value, fits, rule in checks if not fits),
        None,
    )
