"""Code generation: rendering is deterministic, and full-size kernels compile for TPU7x."""

from __future__ import annotations

import tempfile
import traceback
from pathlib import Path

import numpy as np
import pytest
from jax.sharding import Mesh

from mkgen.codegen.build import load_module, render_kernel
from mkgen.plan import plan_build
from mkgen.plan.collectives import arrange_devices
from mkgen.plan.options import BuildOptions
from mkgen.spec.loader import load_spec
from mkgen.spec.topology import parse_topology
from mkgen.verify.tpu_compile import compile_for_tpu, compile_only_devices

MiB = 1024 * 1024


def _layout(name: str, topology: str, **options):
    spec, topo = load_spec(name), parse_topology(topology)
    return plan_build(spec, topo, BuildOptions.create(**options)).kernel


def test_rendering_is_deterministic() -> None:
    first = render_kernel(_layout("qwen3-32b", "2x2x1", context=4096), "header")
    second = render_kernel(_layout("qwen3-32b", "2x2x1", context=4096), "header")
    assert first == second
    assert "def make_decode_step(mesh):" in first
    compile(first, "megakernel.py", "exec")  # it parses


def test_render_and_load_leave_nothing_in_the_temp_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    kernel = load_module(render_kernel(_layout("qwen3-32b", "2x2x1"), "t"), "leak_probe")
    assert callable(kernel.make_decode_step)
    assert list(temp.iterdir()) == []


def test_loaded_module_shows_its_lines_in_tracebacks() -> None:
    probe = load_module("def fail():\n    raise ValueError('from rendered code')\n", "tb_probe")
    with pytest.raises(ValueError) as raised:
        probe.fail()
    assert "raise ValueError('from rendered code')" in "".join(
        traceback.format_tb(raised.value.__traceback__)
    )


SPECS = Path(__file__).parent / "specs"

# (spec, topology, options): every model and layer kind the generator renders, at full size.
FULL_SIZE = [
    ("qwen3-32b", "2x2x1", {}),
    ("qwen3-30b-a3b", "2x2x1", {}),
    ("mixtral-8x7b", "2x2x1", {}),
    ("muse-spark-1.2", "2x2x1", {}),  # int4:128 experts, as its spec stores them
    ("qwen3.8-27b", "2x2x1", {}),  # Gated DeltaNet + gated GQA
    ("qwen3-30b-a3b", "1x1x1", {}),
    ("qwen3-30b-a3b", "2x2x2", {}),
    (str(SPECS / "mla-hybrid.yaml"), "2x2x1", {}),  # both MLA forms, attention residual
    (str(SPECS / "formats-int8.yaml"), "2x2x1", {}),  # int8 dense weights
    # gpt-oss's transformers fixture: expert biases, sinks, sliding window, clamped SwiGLU.
    (str(Path(__file__).parent / "fixtures" / "hf" / "gpt_oss" / "config.json"), "1x1x1", {}),
    # rs_ar on two hosts: staged reduce-scatter pieces of 16 f32 lanes still move as
    # whole 128-lane rows, as Mosaic's DMA requires.
    (str(SPECS / "latent-moe-shared.yaml"), "2x2x2", {}),
    # 8 rows per step (1 anchor + 7 drafts): the token rows fill the sublanes exactly.
    ("qwen3-32b", "2x2x1", {"rows": 8}),
    # Kimi K3 as the hand-written kernel runs it: KDA + MLA, latent MoE of mxfp4 experts
    # combined by reduce-scatter, the attention residual, 32 cores on 4 hosts.
    ("kimi-k3", "2x2x4", {"rows": 8}),
    ("kimi-k2", "2x2x4", {}),  # MLA with YaRN, fp8 everywhere (MLP re-blocked to fp8:64)
]


def _id(case) -> str:
    name, topology, options = case
    return "-".join(
        [Path(name).stem, topology, *(f"{k}{v}" for k, v in options.items() if k == "rows")]
    )


@pytest.mark.parametrize(
    ("name", "topology", "options"), FULL_SIZE, ids=[_id(c) for c in FULL_SIZE]
)
def test_full_size_kernel_compiles_for_tpu7x(name: str, topology: str, options: dict) -> None:
    """Mosaic compiles the kernel, and the VMEM plan is an honest upper bound of its use."""
    spec, topo = load_spec(name), parse_topology(topology)
    opts = BuildOptions.create(context=4096, **options)
    layout = plan_build(spec, topo, opts).kernel
    vmem = plan_build(spec, topo, opts).vmem
    module = f"compile_{layout.model}_{topology}_{layout.rows}".replace("-", "_").replace(".", "_")
    kernel = load_module(render_kernel(layout, "test"), module)
    devices = arrange_devices(compile_only_devices(topo), topo, layout.collectives.mesh_order)
    mesh = Mesh(np.array(devices), (kernel.AXIS,))
    report = compile_for_tpu(kernel.make_decode_step(mesh), kernel.argument_shapes(mesh))
    print(
        f"\n{layout.model} {topology} {options}: compiled in {report.seconds:.1f} s; VMEM plan "
        f"{vmem.total_bytes / MiB:.2f} MiB ({vmem.explicit_bytes / MiB:.2f} explicit), Mosaic "
        f"{report.vmem_bytes / MiB:.2f} MiB"
    )
    # With the estimate of Mosaic's own scratch the plan is not below what Mosaic uses, and
    # not far above (the explicit buffers are the kernel's scratch list: test_plan_graph).
    assert report.vmem_bytes <= vmem.total_bytes <= 1.25 * report.vmem_bytes
    assert report.vmem_bytes < 64 * MiB


def test_single_core_kernel_compiles() -> None:
    """One core (v6e:1x1; a TPU7x chip is always two devices): no collectives, no barrier
    semaphore, the whole vocabulary in one lm_head shard. The plan stays an upper bound of
    Mosaic's VMEM (its estimate of Mosaic's own scratch is loose for a 152k-wide shard)."""
    spec, topo = load_spec("qwen3-30b-a3b"), parse_topology("v6e:1x1")
    opts = BuildOptions.create(context=4096, quant=("experts=int4:128",))  # 61.7 GB in bf16
    layout = plan_build(spec, topo, opts).kernel
    kernel = load_module(render_kernel(layout, "test"), "compile_single_core")
    mesh = Mesh(np.array(compile_only_devices(topo)), (kernel.AXIS,))
    report = compile_for_tpu(kernel.make_decode_step(mesh), kernel.argument_shapes(mesh))
    assert 0 < report.vmem_bytes <= plan_build(spec, topo, opts).vmem.total_bytes
