"""Code generation: rendering is deterministic, the kernels read like hand-written ones,
and full-size kernels compile for TPU7x."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import numpy as np
import pytest
from jax.sharding import Mesh

from mkgen.codegen.build import load_module, render_kernel
from mkgen.hardware import vmem_padded_bytes
from mkgen.kinds import default_registry
from mkgen.plan import plan_build
from mkgen.plan.collectives import arrange_devices
from mkgen.plan.options import BuildOptions
from mkgen.spec.loader import load_spec
from mkgen.spec.topology import parse_topology
from mkgen.verify.inspect import vmem_map
from mkgen.verify.tpu_compile import compile_for_tpu, compile_only_devices
from tests.cli_run import REPORTED, compiled_profile, reported_profile

MiB = 1024 * 1024


def _layout(name: str, topology: str, **options):
    spec, topo = load_spec(name), parse_topology(topology)
    return plan_build(spec, topo, BuildOptions.create(**options), kinds=default_registry()).kernel


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


# ---------------------------------------------------------------- the kernel as text


@pytest.fixture(scope="module")
def kernels(checked_in_renders) -> dict[str, tuple[str, int]]:
    """Every checked-in build's kernel and its mini twin's, as rendered now: name ->
    (source, the VMEM limit of the build's chip in the catalog)."""
    out = {}
    for _, topology, rendered in checked_in_renders:
        limit = topology.chip_info.vmem_limit_bytes
        for path in ("megakernel.py", "mini/megakernel.py"):
            out[f"{rendered.name}/{path}"] = (rendered.files[path], limit)
    return out


def _calls(tree: ast.AST, method: str) -> list[ast.Call]:
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == method
    ]


def _module_constants(tree: ast.Module) -> dict[str, ast.expr]:
    return {
        target.id: node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }


def test_every_matmul_names_its_segment(kernels) -> None:
    """No bare numbers at a matmul: its segment is a module-level `Segment` constant."""
    for name, (source, _) in kernels.items():
        tree = ast.parse(source)
        constants = _module_constants(tree)
        calls = _calls(tree, "matmul")
        assert calls, name
        for call in calls:
            where = f"{name}:{call.lineno}"
            # The input is any expression; the unit it starts from and its segment are named.
            literals = [
                n for arg in call.args[1:] for n in ast.walk(arg) if isinstance(n, ast.Constant)
            ]
            assert not literals, f"{where}: a bare number in {ast.unparse(call)}"
            segment = call.args[-1]
            assert isinstance(segment, ast.Name), where
            value = constants.get(segment.id)
            assert isinstance(value, ast.Call) and ast.unparse(value.func) == "Segment", where


def test_fused_outputs_are_sliced_by_name(kernels) -> None:
    """`y[:, 1283:1667]` style slices of a fused matmul's output are gone: y is indexed
    with a named column range."""
    for name, (source, _) in kernels.items():
        assert not re.search(r"\by\[[^\]]*\d+ *:", source), name
        assert not re.search(r"vec\[\d", source), name


def test_every_private_helper_is_used(kernels) -> None:
    """Helpers are emitted only for kinds the build has: every top-level `_name` function
    is referenced somewhere."""
    for name, (source, _) in kernels.items():
        tree = ast.parse(source)
        defined = {
            node.name
            for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("_")
        }
        used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
        assert defined - {"_kernel"} <= used, f"{name}: unused {sorted(defined - used)}"


def test_only_recurrent_builds_carry_the_delta_rule(kernels) -> None:
    gqa_only = kernels["qwen3-32b-2x2x1/megakernel.py"][0]
    deltanet = kernels["qwen3.8-27b-2x2x1/megakernel.py"][0]
    for helper in ("_softplus", "_conv_step", "_delta_rule_step", "_top_k", "_slot_matmul"):
        assert f"def {helper}(" not in gqa_only, helper
    for helper in ("_softplus", "_conv_step", "_delta_rule_step"):
        assert f"def {helper}(" in deltanet, helper


def test_no_template_leftovers(kernels) -> None:
    for name, (source, _) in kernels.items():
        for leftover in ("* 1.0\n", "choice = scores\n", "xe = h\n", "import functools"):
            assert leftover not in source, f"{name}: {leftover!r}"
        tree = ast.parse(source)
        for fn in tree.body:
            if isinstance(fn, ast.FunctionDef) and fn.name.startswith("_route_"):
                text = ast.get_source_segment(source, fn) or ""
                score = "softmax" if "softmax scores" in text else "sigmoid"
                other = {"softmax": "sigmoid", "sigmoid": "softmax"}[score]
                assert other not in text, f"{name}: a {score} router mentions {other}"


def test_tables_are_one_row_a_line(kernels) -> None:
    for name, (source, _) in kernels.items():
        lone = re.search(r"^\s*-?\d[\d.e+-]*,$", source, re.M)
        assert lone is None, f"{name}: one number a line: {lone and lone.group(0)!r}"
        tables = _module_constants(ast.parse(source))["LAYER_TABLES"]
        assert isinstance(tables, ast.Tuple) and len(tables.elts) == 6, name
        assert all(row.lineno == row.end_lineno for row in tables.elts), name


def _vmem_limit(source: str) -> int:
    [keyword] = [
        k
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        for k in node.keywords
        if k.arg == "vmem_limit_bytes"
    ]
    assert isinstance(keyword.value, ast.Constant)
    return keyword.value.value


def test_vmem_limit_is_the_chips(kernels) -> None:
    for name, (source, limit) in kernels.items():
        assert _vmem_limit(source) == limit, name
    # v6e has 128 MiB of VMEM: its kernels may use more than TPU7x's 64.
    layout = _layout("qwen3-32b", "v6e:2x2", context=4096)
    assert _vmem_limit(render_kernel(layout, "header")) == 128 * MiB


def test_generated_kernels_have_no_undefined_or_unused_names(kernels) -> None:
    for name, (source, _) in kernels.items():
        result = subprocess.run(
            [sys.executable, "-m", "ruff", "check", "--isolated", "--select", "F",
             "--output-format", "concise", "--stdin-filename", "megakernel.py", "-"],
            input=source, capture_output=True, text=True,
        )  # fmt: skip
        assert result.returncode == 0, f"{name}: {result.stdout}"


def test_inspect_pads_one_dimensional_buffers_as_the_vmem_plan_does(kernels) -> None:
    """One padding rule (mkgen.hardware.vmem_padded_bytes): a 1-D buffer takes whole
    512-byte lane rows, as jax's infer_tiling says, not an (8, 128) tile."""
    source, _ = kernels["qwen3-30b-a3b-2x2x1/megakernel.py"]
    found = vmem_map(source)
    assert found is not None
    listed = next(b for b in found.smem if b.name == "moe_listed_smem")
    assert listed.shape == (8,) and listed.padded_bytes == 512  # 8 int32 in one lane row
    for buffer in found.buffers + found.smem:
        bits = 8 * np.dtype(buffer.dtype).itemsize
        assert buffer.padded_bytes == vmem_padded_bytes(buffer.shape, bits), buffer.name


SPECS = Path(__file__).parent / "specs"

# (spec, topology, options): every model and layer kind the generator renders, at full size.
FULL_SIZE = [
    ("qwen3-32b", "2x2x1", {}),
    ("qwen3-30b-a3b", "2x2x1", {}),
    ("mixtral-8x7b", "2x2x1", {}),
    ("muse-spark-1.2", "2x2x1", {}),  # int4:128 experts, as its spec stores them
    # Muse Spark's fastest published configuration: nvfp4 experts, int8 dense and lm_head.
    ("muse-spark-1.2", "2x2x1", {"quant": ["experts=nvfp4", "dense=int8", "lm_head=int8"]}),
    ("qwen3.8-27b", "2x2x1", {}),  # Gated DeltaNet + gated GQA
    ("qwen3-30b-a3b", "1x1x1", {}),
    ("qwen3-30b-a3b", "2x2x2", {}),
    (str(SPECS / "mla-hybrid.yaml"), "2x2x1", {}),  # both MLA forms, attention residual
    (str(SPECS / "formats-int8.yaml"), "2x2x1", {}),  # int8 dense weights
    # gpt-oss's transformers fixture: expert biases, sinks, sliding window, clamped SwiGLU.
    (str(Path(__file__).parent / "fixtures" / "hf" / "gpt_oss" / "config.json"), "1x1x1", {}),
    # The planner's ar_ag on two hosts: the shared experts' activation gathered with the
    # latent, their down projection and latent_out by output columns.
    (str(SPECS / "latent-moe-shared.yaml"), "2x2x2", {}),
    # rs_ar forced (no full-size choices): staged reduce-scatter pieces of 16 f32 lanes
    # still move as whole 128-lane rows, as Mosaic's DMA requires.
    (str(SPECS / "latent-moe-shared.yaml"), "2x2x2", {"splits": ()}),
    # 8 rows per step (1 anchor + 7 drafts): the token rows fill the sublanes exactly.
    ("qwen3-32b", "2x2x1", {"rows": 8}),
    # Kimi K3: KDA + MLA, latent MoE of mxfp4 experts combined by all-reduce of the latent
    # and all-gather of hidden (the hand-written kernel reduce-scatters), the attention
    # residual, 32 cores on 4 hosts.
    ("kimi-k3", "2x2x4", {"rows": 8}),
    # 64 token rows: the latent MoE combined by reduce-scatter (the shared experts in its
    # flight), the compact modes where the plan needs them.
    ("kimi-k3", "2x2x4", {"rows": 8, "batch": 8}),
    ("kimi-k2", "2x2x4", {}),  # MLA with YaRN, fp8 everywhere (MLP re-blocked to fp8:64)
]


# Compiled by tests/test_profile.py's `mkgen compile --profile` too (cli_run.compiled_profile).
PROFILED = [("muse-spark-1.2", "2x2x1", {}), ("kimi-k3", "2x2x4", {"rows": 8})]


def _id(case) -> str:
    name, topology, options = case
    return "-".join(
        [
            Path(name).stem,
            topology,
            *(f"{k}{v}" for k, v in options.items() if k in ("batch", "rows")),
            *options.get("quant", []),
            *(["forced-splits"] if "splits" in options else []),
        ]
    )


@pytest.mark.parametrize(
    ("name", "topology", "options"), FULL_SIZE, ids=[_id(c) for c in FULL_SIZE]
)
def test_full_size_kernel_compiles_for_tpu7x(
    run_once, run_once_dir, name: str, topology: str, options: dict
) -> None:
    """Mosaic compiles the kernel, and the VMEM plan is an honest upper bound of its use."""
    spec, topo = load_spec(name), parse_topology(topology)
    opts = BuildOptions.create(context=4096, **options)
    plan = plan_build(spec, topo, opts, kinds=default_registry())
    layout, vmem = plan.kernel, plan.vmem
    if (name, topology, options) == (*REPORTED, {}):
        # tests/test_profile.py's `mkgen compile --profile --update-report` compiles this
        # kernel (context 4096, its header aside) on the same devices and records it.
        from mkgen.codegen.measurements import read_measurements

        build, result = reported_profile(run_once, run_once_dir)
        assert result["returncode"] == 0, result["stderr"]
        record = (read_measurements(build) or {})["compile"]
        assert record["plan_vmem_bytes"] == vmem.total_bytes  # the plan of this kernel
        seconds, mosaic_bytes = record["seconds"], record["vmem_bytes"]
    elif (name, topology, options) in PROFILED:
        # `mkgen compile --profile` compiles this kernel (context 4096, its docstring's
        # header aside) on the same devices for tests/test_profile.py: once for both.
        result = compiled_profile(run_once, name, topology, str(options.get("rows", 1)))
        assert result["returncode"] == 0, result["stderr"]
        record = json.loads(result["stdout"])["compile"]
        assert record["plan_vmem_bytes"] == vmem.total_bytes  # the plan of this kernel
        seconds, mosaic_bytes = record["seconds"], record["vmem_bytes"]
    else:
        module = f"compile_{layout.model}_{topology}_{layout.batch}x{layout.rows}"
        module = module.replace("-", "_").replace(".", "_")
        kernel = load_module(render_kernel(layout, "test"), module)
        devices = arrange_devices(compile_only_devices(topo), topo, layout.collectives.mesh_order)
        mesh = Mesh(np.array(devices), (kernel.AXIS,))
        report = compile_for_tpu(kernel.make_decode_step(mesh), kernel.argument_shapes(mesh))
        seconds, mosaic_bytes = report.seconds, report.vmem_bytes
    print(
        f"\n{layout.model} {topology} {options}: compiled in {seconds:.1f} s; VMEM plan "
        f"{vmem.total_bytes / MiB:.2f} MiB ({vmem.explicit_bytes / MiB:.2f} explicit), Mosaic "
        f"{mosaic_bytes / MiB:.2f} MiB"
    )
    # With the estimate of Mosaic's own scratch the plan is not below what Mosaic uses, and
    # not far above (the explicit buffers are the kernel's scratch list: test_plan_graph).
    assert mosaic_bytes <= vmem.total_bytes <= 1.25 * mosaic_bytes
    assert mosaic_bytes < 64 * MiB


def test_single_core_kernel_compiles() -> None:
    """One core (v6e:1x1; a TPU7x chip is always two devices): no collectives, no barrier
    semaphore, the whole vocabulary in one lm_head shard. The plan stays an upper bound of
    Mosaic's VMEM (its estimate of Mosaic's own scratch is loose for a 152k-wide shard)."""
    spec, topo = load_spec("qwen3-30b-a3b"), parse_topology("v6e:1x1")
    opts = BuildOptions.create(context=4096, quant=("experts=int4:128",))  # 61.7 GB in bf16
    plan = plan_build(spec, topo, opts, kinds=default_registry())
    kernel = load_module(render_kernel(plan.kernel, "test"), "compile_single_core")
    mesh = Mesh(np.array(compile_only_devices(topo)), (kernel.AXIS,))
    report = compile_for_tpu(kernel.make_decode_step(mesh), kernel.argument_shapes(mesh))
    assert 0 < report.vmem_bytes <= plan.vmem.total_bytes
