"""How a generated kernel's decode step is called: its arguments in its order, for the
runner (mkgen/runtime/build.py) and verify's child (mkgen/verify/numerics.py). Standard
library only, so that the runtime imports nothing of code generation with it."""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any


def decode_step_arguments(
    kernel: ModuleType,
    tables: Any,
    positions: Any,
    x: Any,
    final_norm: Any,
    stream: Any,
    vectors: Any,
    experts: Sequence[Any],
    caches: Sequence[Any],
    drafter_inputs: tuple[Any, Any, Any] | None = None,
) -> tuple[Any, ...]:
    """The arguments of a loaded kernel's decode step (its make_decode_step), in its order:
    tables, positions, x, final_norm, stream, vectors, the experts, the caches; a kernel
    that drafts also takes `drafter_inputs` (the fed rows' tokens [TOKENS], the MTP
    module's norms, each core's embedding rows), placed by its fused_step_arguments. The
    runner and verify call this, so the order is written in the kernel and here only."""
    if drafter_inputs is None:
        return (tables, positions, x, final_norm, stream, vectors, *experts, *caches)
    row_tokens, draft_norms, embedding = drafter_inputs
    return kernel.fused_step_arguments(  # type: ignore[no-any-return]
        tables, positions, row_tokens, x, final_norm, draft_norms, stream, vectors, embedding,
        experts, caches,
    )  # fmt: skip
