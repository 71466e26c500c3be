"""Which reference function computes a layer kind, by the kind's schema class: tables the
math modules fill beside each function with a decorator, so adding a kind's math is one
place (its function and the line above it):

    @FFN.computes(DenseFFN)
    def dense_ffn(kind: DenseFFN, w: Weights, x: jax.Array) -> jax.Array: ...

A table calls a kind's function with the kind and those of the table's arguments that
the function names (a GQA layer needs no `project`, a recurrent one no `start_pos`), so
every function keeps its own signature. mkgen.reference.model imports the math modules,
which fills the tables, and dispatches through them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

Function = TypeVar("Function", bound=Callable[..., Any])


class KindTable:
    """Schema class -> the function computing `what` for a kind of it."""

    def __init__(self, what: str, arguments: tuple[str, ...]) -> None:
        self.what = what
        self.arguments = arguments  # what a call may pass, by name, after the kind
        self.functions: dict[type, tuple[Callable[..., Any], frozenset[str]]] = {}

    def computes(self, schema: type) -> Callable[[Function], Function]:
        """A decorator: the function computes this table's `what` for kinds of `schema`."""

        def register(function: Function) -> Function:
            parameters = list(inspect.signature(function).parameters.values())[1:]
            needed = {p.name for p in parameters if p.default is inspect.Parameter.empty}
            assert needed <= set(self.arguments), f"{function.__name__} needs {sorted(needed)}"
            names = frozenset(p.name for p in parameters) & set(self.arguments)
            self.functions[schema] = (function, names)
            return function

        return register

    def __call__(self, kind: Any, **arguments: Any) -> Any:
        """The kind's function called with `kind` and the arguments it names."""
        if type(kind) not in self.functions:
            raise TypeError(f"no reference {self.what} for {type(kind).__name__}")
        function, names = self.functions[type(kind)]
        return function(kind, **{n: v for n, v in arguments.items() if n in names})


# An attention kind's layer: (output, updated cache) of x at positions start_pos..
ATTENTION = KindTable("attention", ("w", "x", "cache", "start_pos", "dims", "project"))
# An attention kind's empty cache.
CACHE = KindTable("cache", ("batch", "max_len", "dtype"))
# An FFN kind's output of x.
FFN = KindTable("ffn", ("w", "x", "dims", "routed", "choose"))
