"""Code generation: rendering is deterministic, and full-size kernels compile for TPU7x."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from jax.sharding import Mesh

from mkgen.codegen.build import load_module, render_kernel
from mkgen.plan.collectives import arrange_devices
from mkgen.plan.layout import plan_kernel
from mkgen.plan.options import BuildOptions
from mkgen.spec.loader import load_spec
from mkgen.spec.topology import parse_topology
from mkgen.verify.tpu_compile import compile_for_tpu, compile_only_devices

MiB = 1024 * 1024


def _layout(name: str, topology: str, **options):
    spec, topo = load_spec(name), parse_topology(topology)
    return plan_kernel(spec, topo, BuildOptions.create(**options))


def test_rendering_is_deterministic() -> None:
    first = render_kernel(_layout("qwen3-32b", "2x2x1", context=4096), "header")
    second = render_kernel(_layout("qwen3-32b", "2x2x1", context=4096), "header")
    assert first == second
    assert "def make_decode_step(mesh):" in first
    compile(first, "megakernel.py", "exec")  # it parses


FULL_SIZE = [
    ("qwen3-32b", "2x2x1"),
    ("qwen3-30b-a3b", "2x2x1"),
    ("mixtral-8x7b", "2x2x1"),
    ("muse-spark-1.2", "2x2x1"),  # int4:128 experts, as its spec stores them
    ("qwen3.8-27b", "2x2x1"),  # Gated DeltaNet + gated GQA
    ("qwen3-30b-a3b", "1x1x1"),
    ("qwen3-30b-a3b", "2x2x2"),
    (str(Path(__file__).parent / "specs" / "mla-hybrid.yaml"), "2x2x1"),  # both MLA forms
]


SPECS = Path(__file__).parent / "specs"


@pytest.mark.parametrize(
    ("name", "topology"), FULL_SIZE, ids=[f"{Path(n).stem}-{t}" for n, t in FULL_SIZE]
)
def test_full_size_kernel_compiles_for_tpu7x(name: str, topology: str) -> None:
    _compile(_layout(name, topology, context=4096), topology)


@pytest.mark.parametrize("topology", ["2x2x2", "2x2x4"])
def test_reduce_scatter_latent_moe_compiles_for_tpu7x(topology: str) -> None:
    """rs_ar on two and four hosts: staged reduce-scatter pieces of 16 f32 lanes still
    move as whole 128-lane rows, as Mosaic's DMA requires."""
    layout = _layout(str(SPECS / "latent-moe-shared.yaml"), topology, context=4096)
    assert next(f for f in layout.ffn if f.type == "moe").latent_design == "rs_ar"
    _compile(layout, topology)


@pytest.mark.parametrize(
    ("name", "topology"),
    [("qwen3-32b", "2x2x1"), (str(SPECS / "kda-k3-sizes.yaml"), "2x2x4")],
    ids=["qwen3-32b-2x2x1", "kda-k3-sizes-2x2x4"],
)
def test_verification_rows_compile(name: str, topology: str) -> None:
    """8 rows per step (1 anchor + 7 drafts): the token rows fill the sublanes exactly."""
    _compile(_layout(name, topology, context=4096, rows=8), topology)


# Weight formats (tests/specs/formats-*.yaml): mxfp4 experts; fp8:128 attention, MLP,
# shared and routed experts; int8 dense weights.
FORMAT_SPECS = ["formats-mxfp4", "formats-fp8", "formats-int8"]


@pytest.mark.parametrize("name", FORMAT_SPECS)
def test_weight_formats_compile_for_tpu7x(name: str) -> None:
    _compile(_layout(str(SPECS / f"{name}.yaml"), "2x2x1", context=4096), "2x2x1")


def _compile(layout, topology: str) -> None:
    module = f"compile_{layout.model}_{topology}_{layout.rows}".replace("-", "_").replace(".", "_")
    kernel = load_module(render_kernel(layout, "test"), module)
    topo = parse_topology(topology)
    devices = arrange_devices(compile_only_devices(topo), topo, layout.collectives.mesh_order)
    mesh = Mesh(np.array(devices), (kernel.AXIS,))
    report = compile_for_tpu(kernel.make_decode_step(mesh), kernel.argument_shapes(mesh))
    ring = layout.stream.ring_depth * layout.stream.bank_rows * 256 * 2
    assert ring < report.vmem_bytes < 64 * MiB
