"""Reading a Hugging Face config.json: typed getters that name the key in errors, and
the allow-lists that make every key of a config either read or explicitly ignored."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from mkgen.errors import SpecError
from mkgen.spec.schema import MAX_LAYERS, MAX_VOCAB

_MISSING: Any = object()

# Keys that never change what a decode step computes, accepted for every architecture:
# serialisation metadata, token ids (tokenizer / generation), runtime switches and
# training-only settings. max_position_embeddings is a context limit; YaRN reads it
# as transformers does when rope parameters leave original_max_position_embeddings out.
METADATA_KEYS = (
    "architectures",  # read by resolve_architecture
    "model_type",  # read by resolve_architecture
    "transformers_version",
    "torch_dtype",  # checkpoint storage dtype; weight formats come from quantization_config
    "dtype",
    "_name_or_path",
    "auto_map",  # remote-code class names; the architecture is mapped here instead
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "use_cache",
    "initializer_range",
    "attention_dropout",
    "max_position_embeddings",
)
# Training-only keys of the MoE architectures (auxiliary losses, router logit outputs).
MOE_TRAINING_KEYS = ("output_router_logits", "router_aux_loss_coef")


class Config:
    """A config mapping read key by key; remembers which keys were consumed."""

    def __init__(self, data: dict[str, Any], source: str, arch: str, prefix: str = "") -> None:
        self.data = data
        self.source = source
        self.arch = arch
        self.prefix = prefix
        self.used: set[str] = set()
        self.notes: list[str] = []
        self.keep_mtp = False  # import_hf_dict(keep_mtp=True)
        self.mtp_layers = 0

    def error(self, key: str, message: str) -> SpecError:
        return SpecError(f"{self.source}: {self.prefix}{key}: {message}")

    def has(self, key: str) -> bool:
        return key in self.data

    def allow(self, *keys: str) -> None:
        """Accept keys without mapping them (the allow-list)."""
        self.used.update(keys)

    def raw(self, keys: str | Sequence[str], default: Any = _MISSING) -> tuple[str, Any]:
        """(the key found, its value); aliases must agree when several are present."""
        names = (keys,) if isinstance(keys, str) else tuple(keys)
        self.used.update(names)
        found = [k for k in names if k in self.data]
        if not found:
            if default is _MISSING:
                also = f" (or {', '.join(names[1:])})" if len(names) > 1 else ""
                raise self.error(names[0], f"missing{also}; a {self.arch} config needs it")
            return names[0], default
        first = found[0]
        for other in found[1:]:
            if self.data[other] != self.data[first]:
                raise self.error(
                    other,
                    f"{self.data[other]!r} disagrees with its alias {first} "
                    f"{self.data[first]!r}; give one of them",
                )
        return first, self.data[first]

    def _typed(
        self,
        keys: str | Sequence[str],
        default: Any,
        nullable: bool,
        check: Callable[[Any], bool],
        expected: str,
    ) -> Any:
        """The value, type-checked; null counts as absent when nullable or the default is None."""
        key, value = self.raw(keys, default)
        if value is None and (nullable or default is None):
            return None
        if value is default and default is not _MISSING:
            return value
        if value is None or not check(value):
            raise self.error(key, f"expected {expected}, got {value!r}")
        return value

    def get_int(
        self,
        keys: str | Sequence[str],
        default: Any = _MISSING,
        *,
        minimum: int = 1,
        maximum: int = MAX_VOCAB,
        nullable: bool = False,
    ) -> Any:
        """An integer in minimum..maximum. The default maximum is the largest bound of any
        spec integer (int32 token ids); the spec's own bounds apply after the mapping."""
        value = self._typed(
            keys,
            default,
            nullable,
            lambda v: isinstance(v, int) and not isinstance(v, bool),
            "an integer",
        )
        names = (keys,) if isinstance(keys, str) else keys
        key = next((k for k in names if k in self.data), names[0])  # the alias given
        if isinstance(value, int) and value < minimum:
            raise self.error(key, f"{value} must be at least {minimum}")
        if isinstance(value, int) and value > maximum:
            raise self.error(
                key, f"{value} exceeds {maximum} (the bounds: docs/spec-reference.md#bounds)"
            )
        return value

    def get_float(
        self, keys: str | Sequence[str], default: Any = _MISSING, *, nullable: bool = False
    ) -> Any:
        value = self._typed(
            keys,
            default,
            nullable,
            lambda v: isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v),
            "a finite number",
        )
        return None if value is None else float(value)

    def get_layer_count(self) -> int:
        """num_hidden_layers, bounded before any per-layer table is built from it."""
        return self.get_int("num_hidden_layers", maximum=MAX_LAYERS)

    def get_bool(self, keys: str | Sequence[str], default: Any = _MISSING) -> Any:
        return self._typed(keys, default, False, lambda v: isinstance(v, bool), "true or false")

    def get_str(
        self, keys: str | Sequence[str], default: Any = _MISSING, *, nullable: bool = False
    ) -> Any:
        return self._typed(keys, default, nullable, lambda v: isinstance(v, str), "a string")

    def get_list(
        self, keys: str | Sequence[str], default: Any = _MISSING, *, item: type = int
    ) -> Any:
        def check(v: Any) -> bool:
            return isinstance(v, list) and all(
                isinstance(x, item) and not (item is int and isinstance(x, bool)) for x in v
            )

        return self._typed(keys, default, True, check, f"a list of {item.__name__}")

    def section(self, key: str) -> Config | None:
        """A nested mapping (rope_scaling, quantization_config, ...) or None when null/absent."""
        _, value = self.raw(key, None)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self.error(key, f"expected a mapping, got {value!r}")
        return Config(value, self.source, self.arch, f"{self.prefix}{key}.")

    def finish(self) -> None:
        """Every key must have been mapped or allow-listed."""
        unknown = sorted(k for k in self.data if k not in self.used)
        if unknown:
            raise self.error(
                unknown[0],
                f"unknown key for {self.arch} (not mapped and not on the allow-list of keys "
                "that do not affect inference); mkgen will not guess what it means: remove it "
                "if it has no effect, or teach mkgen/spec/hf_import.py to map it",
            )
