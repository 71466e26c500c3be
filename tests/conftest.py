"""Test-wide settings: JAX runs on the CPU (libtpu is installed for compile-only devices).
Fixtures shared by several test files."""

import os
from collections.abc import Callable
from pathlib import Path

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")


@pytest.fixture(scope="session")
def shared_build(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`shared_build(folder, **options)`: a transformers fixture's build
    (fixture_builds.make_fixture_build), made once per worker for every test that asks
    for the same folder and options: several files run the same few builds. Tests only
    read it (convert for it, run it); a test that changes a build makes its own."""
    from fixture_builds import make_fixture_build

    made: dict[tuple, Path] = {}

    def build(folder: str, **options: int) -> Path:
        key = (folder, *sorted(options.items()))
        if key not in made:
            directory = tmp_path_factory.mktemp(f"{folder}-build")
            made[key] = make_fixture_build(directory, folder, **options)
        return made[key]

    return build
