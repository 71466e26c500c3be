from mkgen.kinds import default_registry
from mkgen.plan import plan_build
from mkgen.plan.options import BuildOptions
from mkgen.spec.loader import load_spec
from mkgen.spec.topology import parse_topology
spec = load_spec("/tmp/fz/kimi-k2-mtp.yaml"); t = parse_topology("2x2x4"); o = BuildOptions.create(rows=8, acceptance=6)
a = plan_build(spec, t, o, kinds=default_registry(), price_drafter=True)
print("unfused:", a.estimate.headline)
b = plan_build(spec, t, o, kinds=default_registry(), fuse_draft=True)
print("fused:", b.estimate.headline, "| stream MiB/core", round(b.stream.bytes_per_step/2**20,1), "vs", round(a.stream.bytes_per_step/2**20,1), "| eh_proj MiB", round(b.stream.draft.eh_proj.bytes/2**20,1), "| HBM GB", round(b.memory.total_bytes/1e9,2), "vs", round(a.memory.total_bytes/1e9,2))
