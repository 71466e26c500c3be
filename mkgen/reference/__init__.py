"""The plain-JAX reference model: the oracle every generated kernel is checked against."""

from mkgen.reference.ffn import route
from mkgen.reference.model import (
    compile_forward,
    decode_step,
    forward,
    forward_traced,
    generate,
    init_cache,
    init_weights,
    prefill,
    residual_stream,
)

__all__ = [
    "compile_forward",
    "decode_step",
    "forward",
    "forward_traced",
    "generate",
    "init_cache",
    "init_weights",
    "prefill",
    "residual_stream",
    "route",
]
