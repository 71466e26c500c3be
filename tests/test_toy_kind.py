"""The toy layer kind `mlp` (a plain MLP, docs/adding-a-layer-kind.md's worked example),
added by touching only the places the guide lists: it plans, builds, its mini twin
matches the reference in TPU interpret mode, a wrong activation is caught, and the
full-size kernel compiles for TPU7x."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from jax.sharding import Mesh

from mkgen.codegen.build import load_module, render_kernel
from mkgen.codegen.package import make_build
from mkgen.kinds import default_registry
from mkgen.plan import plan_build
from mkgen.plan.collectives import arrange_devices
from mkgen.plan.options import BuildOptions
from mkgen.spec.loader import load_spec
from mkgen.spec.topology import parse_topology
from mkgen.verify.numerics import verify_numerics
from mkgen.verify.tpu_compile import compile_for_tpu, compile_only_devices

SPEC = str(Path(__file__).parent / "specs" / "toy-mlp.yaml")
TOPOLOGY = "1x1x1"  # one TPU7x chip: two cores, so the down projection's all-reduce runs
TIMEOUT = 300
ACTIVATION_LINE = "a = _activation(MLP_ACTIVATION, y, 1.0)"
ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "adding-a-layer-kind.md"
# Where the toy kind's names occur in code: its schema, record and reference function's
# names, and its type where it names the kind (a Literal tag, a spec's `type`, its
# registry entry, its folder as a module or template name). Not the weight family `mlp`.
TOY_NAMES = re.compile(
    r"\bPlainMLP\b|\bMLPLayout\b|\bplain_mlp\b|Literal\[\"mlp\"\]|\"type\": \"mlp\"|\btype: mlp\b"
    r"|\"mlp\": mlp\b|\bkinds[./]mlp\b|from mkgen\.kinds import [^\n]*\bmlp\b"
)
CODE = ("mkgen", "scripts", "tests")  # where a kind's code and its tests live
TEXT_SUFFIXES = {".py", ".j2", ".yaml", ".md"}


def _plan():
    return plan_build(
        load_spec(SPEC), parse_topology(TOPOLOGY), BuildOptions.create(), kinds=default_registry()
    )


def test_the_toy_kind_shards_like_the_dense_kind_without_a_gate() -> None:
    ffn = _plan().sharding.ffn["mlp"]
    splits = {t.name: t.split_axis for t in ffn.tensors}
    assert splits == {"ffn.w_up": 1, "ffn.w_down": 0}  # columns of up, rows of down
    assert [(c.name, c.op) for c in ffn.collectives] == [("ffn_out", "all_reduce")]


def test_the_toy_kind_builds_a_kernel_running_its_ops(tmp_path: Path) -> None:
    spec, topology = load_spec(SPEC), parse_topology(TOPOLOGY)
    make_build(spec, topology, BuildOptions.create(), output=tmp_path / "build")
    kernel = (tmp_path / "build" / "megakernel.py").read_text()
    body = kernel[kernel.index("def _ffn_mlp(") :]
    ops = ["MLP_UP)", ACTIVATION_LINE, "MLP_DOWN)", "all_reduce("]
    assert [body.index(op) for op in ops] == sorted(body.index(op) for op in ops)
    assert (tmp_path / "build" / "mini" / "megakernel.py").is_file()


@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.parametrize("mode", ["on_wait", "eager"])
def test_the_toy_kinds_mini_twin_matches_the_reference(mode: str) -> None:
    report = verify_numerics(SPEC, TOPOLOGY, mode=mode, steps=1, timeout=TIMEOUT)
    assert report.passed, report.failure()
    assert report.steps and all(step.finite for step in report.steps)


@pytest.mark.timeout(TIMEOUT + 60)
def test_a_toy_kernel_without_its_activation_fails_verify() -> None:
    mutations = [(ACTIVATION_LINE, "a = y")]
    report = verify_numerics(
        SPEC, TOPOLOGY, mode="on_wait", steps=1, timeout=TIMEOUT, mutations=mutations
    )
    assert not report.passed
    assert "layer 0 diverges first" in (report.failure() or ""), report.failure()


def test_the_full_size_toy_kernel_compiles_for_tpu7x() -> None:
    plan = _plan()
    kernel = load_module(render_kernel(plan.kernel, "test"), "compile_toy_mlp")
    topology = parse_topology(TOPOLOGY)
    devices = compile_only_devices(topology)
    mesh = Mesh(np.array(arrange_devices(devices, topology, plan.kernel.collectives.mesh_order)),
                (kernel.AXIS,))  # fmt: skip
    report = compile_for_tpu(kernel.make_decode_step(mesh), kernel.argument_shapes(mesh))
    assert 0 < report.vmem_bytes <= plan.vmem.total_bytes


def _guide_places() -> list[str]:
    """The files and folders (ending in /) the guide's table says adding `mlp` touched:
    every backticked path in the first column of the table under its first heading."""
    lines = GUIDE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| place |"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(line.split("|")[1])
    return [path for row in rows for path in re.findall(r"`([^`]+)`", row)]


def _holds_toy_names(path: Path) -> bool:
    return bool(TOY_NAMES.search(path.read_text(encoding="utf-8")))


def _text_files(top: Path) -> list[Path]:
    """The code and text files under `top` (a file: itself)."""
    if top.is_file():
        return [top]
    return sorted(
        path
        for path in top.rglob("*")
        if path.suffix in TEXT_SUFFIXES and path.is_file() and "__pycache__" not in path.parts
    )


def test_the_toy_kind_is_named_only_in_the_places_the_guide_lists() -> None:
    """docs/adding-a-layer-kind.md's table is the whole of what adding `mlp` touched: its
    names occur in no other file of the code, the scripts and the tests, and every place
    the table lists outside the tests names it."""
    places = _guide_places()
    assert "mkgen/kinds/mlp/" in places and "mkgen/spec/schema.py" in places, places

    def listed(relative: str) -> bool:
        return any(relative == p or (p.endswith("/") and relative.startswith(p)) for p in places)

    files = [p.relative_to(ROOT) for top in CODE for p in _text_files(ROOT / top)]
    unlisted = [str(p) for p in files if _holds_toy_names(ROOT / p) and not listed(str(p))]
    assert unlisted == [], f"the toy kind is named outside the guide's table: {unlisted}"
    for place in (p for p in places if not p.startswith("tests/")):
        named = any(_holds_toy_names(p) for p in _text_files(ROOT / place))
        assert named, f"{place}: the guide lists it, but it names no toy kind"
