"""Weight formats: parsing the spec's format strings and the bytes each format stores.

A format string names how one weight family is stored in HBM:

- ``bf16``: 2 bytes a weight.
- ``int8``: symmetric int8 with one f32 scale per output channel.
- ``int4:G``: symmetric int4 with one bf16 scale per G input values.
- ``fp8:B``: fp8 e4m3 with one f32 scale per BxB block (DeepSeek-V3 / Kimi K2 style).
- ``mxfp4``: OCP MX e2m1 codes with one E8M0 scale byte per 32 values.
- ``nvfp4``: e2m1 codes with one e4m3 scale byte per 16 values and one f32 per tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mkgen.errors import SpecError

FORMAT_KINDS = ("bf16", "int8", "int4", "fp8", "mxfp4", "nvfp4")
_GROUPED = {"int4": "group size", "fp8": "block size"}
_FIXED_GROUP = {"mxfp4": 32, "nvfp4": 16}


@dataclass(frozen=True)
class QuantFormat:
    """A parsed weight format: its kind and (for block formats) the group size."""

    kind: str
    group: int | None = None

    def __str__(self) -> str:
        return f"{self.kind}:{self.group}" if self.kind in _GROUPED else self.kind

    @property
    def code_bits(self) -> int:
        """Bits of one stored weight code (scales not included)."""
        return {"bf16": 16, "int8": 8, "fp8": 8, "int4": 4, "mxfp4": 4, "nvfp4": 4}[self.kind]

    @property
    def block(self) -> int | None:
        """Values sharing one scale along the input dimension (None: no groups)."""
        return self.group if self.kind in _GROUPED else _FIXED_GROUP.get(self.kind)

    def matrix_bytes(self, fan_in: int, fan_out: int) -> int:
        """HBM bytes of one [fan_in, fan_out] matrix in this format, scales included."""
        codes = math.ceil(fan_in * fan_out * self.code_bits / 8)
        if self.kind == "bf16":
            return codes
        if self.kind == "int8":
            return codes + 4 * fan_out
        if self.kind == "int4":
            return codes + 2 * math.ceil(fan_in / self.group) * fan_out
        if self.kind == "fp8":
            return codes + 4 * math.ceil(fan_in / self.group) * math.ceil(fan_out / self.group)
        if self.kind == "mxfp4":
            return codes + math.ceil(fan_in / 32) * fan_out
        # nvfp4: e4m3 scale per 16 values plus one f32 global scale.
        return codes + math.ceil(fan_in / 16) * fan_out + 4


def parse_format(text: str, field: str = "quantization") -> QuantFormat:
    """Parse a format string such as ``int4:128``; errors name the field and the valid forms."""
    if not isinstance(text, str):
        raise SpecError(f"{field}: expected a format string, got {text!r}")
    kind, _, group_text = text.strip().partition(":")
    if kind not in FORMAT_KINDS:
        raise SpecError(
            f"{field}: unknown weight format {text!r}; use one of bf16, int8, int4:G, fp8:B, "
            "mxfp4, nvfp4"
        )
    if kind in _GROUPED:
        what = _GROUPED[kind]
        if not group_text:
            raise SpecError(f"{field}: {kind} needs a {what}, e.g. '{kind}:128'")
        if not group_text.isdigit() or int(group_text) <= 0:
            raise SpecError(f"{field}: {what} in {text!r} must be a positive integer")
        group = int(group_text)
        if group & (group - 1):
            raise SpecError(f"{field}: {what} in {text!r} must be a power of two")
        return QuantFormat(kind, group)
    if group_text:
        raise SpecError(f"{field}: {kind} takes no group size ({text!r}); write '{kind}'")
    return QuantFormat(kind)
