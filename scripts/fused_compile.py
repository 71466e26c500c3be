"""Compile the fused kernel for TPU7x with compile-only libtpu."""
import sys
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from mkgen.codegen.build import load_module, render_kernel
from mkgen.kinds import default_registry
from mkgen.plan import plan_build
from mkgen.plan.options import BuildOptions
from mkgen.spec.loader import load_spec
from mkgen.spec.mini import mini_twin
from mkgen.spec.topology import parse_topology
from mkgen.plan.collectives import arrange_devices
from mkgen.verify.tpu_compile import compile_only_devices, compile_for_tpu

spec_ref, topo_text, rows = sys.argv[1], sys.argv[2], int(sys.argv[3])
topology = parse_topology(topo_text)
spec = load_spec(spec_ref)
plan = plan_build(spec, topology, BuildOptions.create(rows=rows), kinds=default_registry(), fuse_draft=True)
layout = plan.kernel
print(plan.estimate.headline, "VMEM plan", plan.vmem.total_bytes if hasattr(plan.vmem, "total_bytes") else "")
kernel = load_module(render_kernel(layout, "compile"), "fused_compile")
devices = compile_only_devices(topology)
mesh = Mesh(np.array(arrange_devices(devices, topology, layout.collectives.mesh_order)), (kernel.AXIS,))
base = kernel.argument_shapes(mesh)
rep = NamedSharding(mesh, P())
extra_scalar = jax.ShapeDtypeStruct((kernel.TOKENS,), jnp.int32, sharding=rep)
norms = jax.ShapeDtypeStruct((3, kernel.HIDDEN), jnp.float32, sharding=rep)
emb = jax.ShapeDtypeStruct((layout.vocab, 1, kernel.HIDDEN), jnp.bfloat16, sharding=rep)
args = base[:2] + [extra_scalar] + base[2:4] + [norms, emb] + base[4:]
report = compile_for_tpu(kernel.make_decode_step(mesh), args)
print("compiled in", round(report.seconds, 1), "s; Mosaic VMEM", report.vmem_bytes)
