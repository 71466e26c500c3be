"""The cache block a step rewrites around its new rows (mkgen.plan.options.cache_block):
whole 16-row tiles covering the rows from any offset, never more than the context. A
context smaller than that block (16 at rows 3, where the block was 32) once made the
kernel read cache rows at negative positions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mkgen.errors import SpecError
from mkgen.plan.options import CACHE_ALIGN, BuildOptions, cache_block

CONFIG = Path(__file__).parent / "fixtures" / "hf" / "qwen3" / "config.json"


@pytest.mark.parametrize("context", [1, 3, 8, 16, 32, 48, 64, 128, 256])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 16, 17, 32])
def test_the_block_holds_a_steps_rows_at_every_position(rows: int, context: int) -> None:
    """The kernel's rule (cache_attention's _write_cache): the block starts at the
    position's tile, or at context - block when that is earlier; it must start on a tile,
    inside the cache, and hold rows [p, p + rows) for every p a step can write."""
    block = cache_block(rows, context)
    assert 0 < block <= context
    for position in range(context - rows + 1):
        start = min(position // CACHE_ALIGN * CACHE_ALIGN, context - block)
        assert start >= 0 and start % CACHE_ALIGN == 0
        assert start <= position and position + rows <= start + block


def test_a_context_off_the_cache_tiles_is_one_line() -> None:
    with pytest.raises(SpecError, match=r"^--context 40: must be a multiple of 16 \(or at most"):
        BuildOptions.create(context=40)


def test_a_context_of_one_block_generates_the_reference_tokens(tmp_path: Path) -> None:
    """Rows 3 at context 16 (one 16-row block): the runner fills the cache to its last
    position (prompt 8 + steps 6 + drafts 2) and gives the reference's greedy tokens."""
    from mkgen.codegen.package import make_build
    from mkgen.reference.model import generate
    from mkgen.spec.loader import load_spec
    from mkgen.spec.topology import parse_topology
    from mkgen.weights.quantize import stored_random_weights

    spec = load_spec(CONFIG)
    build = tmp_path / "build"
    make_build(spec, parse_topology("1x1x1"), BuildOptions.create(rows=3, context=16), output=build)
    prompt, steps = [3, 17, 42, 99, 5, 64, 127, 23], 6
    result = subprocess.run(
        [sys.executable, "-m", "mkgen.cli", "run", str(build), "--interpret",
         "--random-weights", "0", "--prompt-ids", ",".join(map(str, prompt)),
         "--steps", str(steps), "--json"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    expected = generate(spec, stored_random_weights(spec, 0), np.asarray(prompt), steps)
    assert json.loads(result.stdout)["tokens"] == [expected.tolist()]
