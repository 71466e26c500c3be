"""The toy layer kind `mlp` (a plain MLP, docs/adding-a-layer-kind.md's worked example),
added by touching only the places the guide lists: it plans, builds, its mini twin
matches the reference in TPU interpret mode, a wrong activation is caught, and the
full-size kernel compiles for TPU7x."""

from __future__ import annotations

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
