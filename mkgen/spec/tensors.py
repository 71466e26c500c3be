"""One tensor of the weight inventory (mkgen.spec.weights): its name, shape and family.

Each layer kind's schema class (mkgen.spec.schema) lists its tensors in these terms
(its `tensors` method), so this module sits below the schema.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mkgen.spec.quant import parse_format

VECTORS = "vectors"  # norms, biases, conv taps, gate constants: always bf16

# (name, shape, family) of one tensor of a layer kind, before its layer's prefix.
Tensor = tuple[str, tuple[int, ...], str]


@dataclass(frozen=True)
class WeightSpec:
    """One tensor of the model."""

    name: str
    shape: tuple[int, ...]
    family: str
    # Number of routed experts stacked on axis 0 (0: not an expert tensor).
    experts: int = 0
    # Fraction of the tensor one token reads (top_k / num_experts for routed experts).
    active_fraction: float = 1.0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_matrix(self) -> bool:
        return self.family != VECTORS

    @property
    def fan_in_out(self) -> tuple[int, int]:
        """(fan_in, fan_out) of one matrix (per expert for expert tensors).

        The embedding table is stored [vocab, hidden] but quantized per vocabulary row,
        like an lm_head: hidden is its fan-in."""
        if self.family == "embedding":
            return self.shape[1], self.shape[0]
        return self.shape[-2], self.shape[-1]

    def nbytes(self, fmt_text: str) -> int:
        """HBM bytes of this tensor stored in the given format (vectors: bf16)."""
        if not self.is_matrix:
            return 2 * self.numel
        fan_in, fan_out = self.fan_in_out
        count = self.numel // (fan_in * fan_out)
        return count * parse_format(fmt_text).matrix_bytes(fan_in, fan_out)


def gated_mlp(
    prefix: str, fan_in: int, width: int, family: str, gated: bool = True
) -> list[Tensor]:
    """An MLP's matrices: (gate,) up [fan_in, width] and down [width, fan_in]."""
    out = [(f"{prefix}gate", (fan_in, width), family)] if gated else []
    return out + [
        (f"{prefix}up", (fan_in, width), family),
        (f"{prefix}down", (width, fan_in), family),
    ]
