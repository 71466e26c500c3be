"""README.md's examples are what the commands print today (scripts/make_docs.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]


def _make_docs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_docs", REPO / "scripts" / "make_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_examples_are_current() -> None:
    make_docs = _make_docs()
    readme = (REPO / "README.md").read_text()
    assert len(make_docs.BLOCK.findall(readme)) >= 3
    assert make_docs.render(readme) == readme, "README.md is stale: run `make docs`"


def test_an_example_block_is_rewritten_with_masked_build_time() -> None:
    make_docs = _make_docs()
    stale = "intro\n<!-- mkgen-example: mkgen --version -->\nold text\n<!-- /mkgen-example -->\n"
    fresh = make_docs.render(stale)
    assert fresh.startswith("intro\n<!-- mkgen-example: mkgen --version -->\n```\n$ mkgen")
    assert "old text" not in fresh and "mkgen, version" in fresh
    assert make_docs.render(fresh) == fresh
    assert make_docs.SECONDS.sub("in ... s:", "wrote b/ in 12.3 s: x") == "wrote b/ in ... s: x"


def test_a_failing_example_stops_the_generator() -> None:
    make_docs = _make_docs()
    with pytest.raises(RuntimeError, match="mkgen show no-such-spec"):
        make_docs.render("<!-- mkgen-example: mkgen show no-such-spec -->\n<!-- /mkgen-example -->")
