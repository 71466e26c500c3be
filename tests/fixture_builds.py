"""Builds of the transformers fixtures (tests/fixtures/hf) for tpu7x:1x1x1 (2 cores: the
fixtures' 4 heads split over 2 cores, not 8) at context 64, as the runner, serve,
disaggregation and multi-host tests run them."""

from __future__ import annotations

from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
TOPOLOGY = "1x1x1"


def make_fixture_build(directory: Path, folder: str, **options: int) -> Path:
    """The build of tests/fixtures/hf/FOLDER in `directory` (new or empty)."""
    from mkgen.codegen.package import make_build
    from mkgen.plan.options import BuildOptions
    from mkgen.spec.loader import load_spec
    from mkgen.spec.topology import parse_topology

    spec = load_spec(FIXTURES / folder / "config.json")
    opts = BuildOptions.create(context=64, **options)
    make_build(spec, parse_topology(TOPOLOGY), opts, output=directory)
    return directory
