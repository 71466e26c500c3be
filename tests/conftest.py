"""Test-wide settings: JAX runs on the CPU (libtpu is installed for compile-only devices),
with one compilation cache for the run. Fixtures shared by several test files."""

import atexit
import compileall
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA's CPU backend compiles the suite's programs without LLVM's optimisations (the flag
# reaches every process the tests start): they are tiny, or calls back into the TPU
# interpreter, so compiling them is most of XLA's time (the sharded prefill test: 95 ->
# 65 CPU seconds) and running them is not. Every check of the suite passes at this level
# (they compare within tolerances, or two results of the same process).
os.environ["XLA_FLAGS"] = (
    f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
)

# One JAX compilation cache for the whole run: xdist's workers and every process they
# start inherit it from the first conftest import, so the kernels, prefills and
# references that many processes compile alike are compiled once. It is new each run and
# removed at its end (a run never reuses another's programs); a compile that must run
# Mosaic itself (mkgen compile --profile reads its dump) turns it off.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _run_cache = tempfile.mkdtemp(prefix="mkgen-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _run_cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    atexit.register(shutil.rmtree, _run_cache, True)

# The planner's store (mkgen/plan/store.py) the same way: one for the run, shared by its
# processes, removed at its end, so that no test reads or writes the user's.
if "MKGEN_CACHE_DIR" not in os.environ:
    _run_store = tempfile.mkdtemp(prefix="mkgen-store-")
    os.environ["MKGEN_CACHE_DIR"] = _run_store
    atexit.register(shutil.rmtree, _run_store, True)

# The package's bytecode, written once: the suite's processes run with
# PYTHONDONTWRITEBYTECODE (so that no build folder gets a __pycache__), which would leave
# every one of them compiling mkgen's modules from source (about 0.6 s a process that
# imports the runner, verify and the reference). The checkout's __pycache__ is ignored by
# git; an installed copy that cannot be written is left as it is.
if not os.environ.get("PYTEST_XDIST_WORKER"):
    compileall.compile_dir(Path(__file__).parents[1] / "mkgen", quiet=2)


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


@pytest.fixture(scope="session")
def run_once_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of the run that every xdist worker shares (for what run_once makes)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's base folder, above every worker's own
    (root / "run-once").mkdir(exist_ok=True)
    return root / "run-once"


@pytest.fixture(scope="session")
def run_once(run_once_dir: Path) -> Callable[[str, Callable[[], Any]], Any]:
    """`run_once(key, compute)`: compute()'s result (JSON), computed once for the whole run,
    whichever xdist worker asks first: it computes holding the key's lock, and a worker
    asking meanwhile waits on that lock and then reads the result. For a compile or a
    child run whose outcome tests of different files (or workers) hold different
    properties of. A compute that raises stores nothing: the next asker computes again."""
    import fcntl
    import json

    def get(key: str, compute: Callable[[], Any]) -> Any:
        path = run_once_dir / f"{key}.json"
        with (run_once_dir / f"{key}.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if path.exists():
                return json.loads(path.read_text())
            value = compute()
            written = path.with_suffix(".tmp")
            written.write_text(json.dumps(value))
            written.replace(path)
            return value

    return get


@pytest.fixture(scope="session")
def checked_in_renders() -> list[tuple[Path, Any, Any]]:
    """(checked-in directory, Topology, RenderedBuild) of every build in generated/BUILDS,
    rendered now with the measurements its directory records, once per worker: test_build
    holds them byte for byte against generated/, test_codegen reads their kernels as text."""
    from mkgen.codegen.build_list import entry_inputs, read_build_list
    from mkgen.codegen.measurements import read_measurements
    from mkgen.codegen.naming import CommandLine, default_build_dir
    from mkgen.codegen.package import render_build

    out = []
    for entry in read_build_list():
        spec, topology, options = entry_inputs(entry)
        checked_in = default_build_dir(spec.name, topology)
        measurements = read_measurements(checked_in)
        line = CommandLine(draft=entry.draft).for_files()  # as `mkgen regen` names it
        rendered = render_build(spec, topology, options, measurements=measurements, line=line)
        out.append((checked_in, topology, rendered))
    return out


# MKGEN_TEST_CPU=FILE appends each test's CPU seconds (its process's threads and the
# subprocesses it waited for, setup and teardown included) to FILE: what the suite's
# budget (15 minutes on 2 cores) is spent on, unaffected by how busy the machine is.
if os.environ.get("MKGEN_TEST_CPU"):
    import resource

    def _cpu_seconds() -> float:
        own, children = (
            resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
        )
        return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
        before = _cpu_seconds()
        yield
        with open(os.environ["MKGEN_TEST_CPU"], "a") as out:
            out.write(f"{_cpu_seconds() - before:.2f} {item.nodeid}\n")
