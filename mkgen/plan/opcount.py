"""Per-phase op counts of one decode step, as the model prices the plan's program."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PHASES = (
    "stream matmul",
    "experts",
    "attention",
    "recurrent",
    "routing",
    "collectives",
    "vector",
)


@dataclass
class OpCounts:
    """Ops of one phase per step, per core."""

    vpu: float = 0.0  # vector ALU ops (one vreg each)
    mxu: float = 0.0  # MXU pushes, pops and latches
    loads: float = 0.0  # vector loads
    stores: float = 0.0  # vector stores
    dmas: float = 0.0  # DMAs issued

    def add(self, group: str, n: float) -> None:
        setattr(self, group, getattr(self, group) + n)

    def any(self) -> bool:
        return any((self.vpu, self.mxu, self.loads, self.stores, self.dmas))


def model_op_counts(plan: Any, spec: Any) -> dict[str, OpCounts]:
    return {p: OpCounts() for p in PHASES}
