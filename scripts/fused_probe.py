import os
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
"""Prototype check: the fused MTP kernel vs the reference (draft-mtp, 1x1x1, batch 1)."""
import sys, time
import numpy as np
import jax, jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh

from mkgen.codegen import build as _build
load_module = _build.load_module
render_kernel = lambda *a: _build.render_kernel(*a)
from mkgen.codegen.package import mini_kernel_args
from mkgen.interpret import interpret_mode
from mkgen.kinds import default_registry
from mkgen.plan import plan_build
from mkgen.plan.collectives import arrange_devices
from mkgen.plan.options import BuildOptions
from mkgen.reference import model as reference
from mkgen.reference import draft as rdraft
from mkgen.spec.loader import load_spec
from mkgen.spec.mini import mini_twin
from mkgen.spec.topology import parse_topology
from mkgen.weights import pack
from mkgen.weights.quantize import stored_random_weights

rows = int(sys.argv[1]) if len(sys.argv) > 1 else 3
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 2
mode = sys.argv[3] if len(sys.argv) > 3 else "on_wait"
topology = parse_topology("1x1x1")
spec = mini_twin(load_spec("tests/specs/draft-mtp.yaml"), 1)
context = 64
options = BuildOptions.create(batch=1, rows=rows, context=context)
plan = plan_build(spec, topology, options, **mini_kernel_args(), kinds=default_registry(), fuse_draft=True)
layout = plan.kernel
source = render_kernel(layout, "proto")
open("/tmp/fz/kernel.py", "w").write(source)
kernel = load_module(source, "fused_proto")
print(plan.estimate.headline)
import ml_dtypes
weights = stored_random_weights(spec, 0)
weights.update({k: np.asarray(v, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
                for k, v in rdraft.init_draft_weights(spec, 1).items()})
D = topology.num_devices
stream = jnp.asarray(np.stack([pack.pack_stream(layout, weights, r) for r in range(D)]))
vectors = jnp.asarray(np.stack([pack.pack_vectors(layout, weights, r) for r in range(D)]))
norms, embedding = pack.pack_draft_inputs(layout, weights)
caches = [jnp.zeros((D, *shape), dtype) for shape, dtype in kernel.cache_shapes()]
mesh = Mesh(np.array(arrange_devices(jax.devices(), topology, layout.collectives.mesh_order)), (kernel.AXIS,))
step_fn = kernel.make_decode_step(mesh)
tables = jnp.asarray(kernel.LAYER_TABLES, jnp.int32)
final_norm = jnp.asarray(weights["final_norm"])[None, :]
params = pltpu.InterpretParams(detect_races=True, dma_execution_mode=mode, uninitialized_memory="nan", vector_clock_size=max(4 * D, 8))
ref_cache = reference.init_cache(spec, 1, context + 4 * rows, jnp.bfloat16)
state = rdraft.init_draft_state(spec, 1, context + 4 * rows)
rng = np.random.default_rng(0)
fed = rng.integers(0, layout.vocab_used, size=(1, rows)).astype(np.int32)
position = 0
for step in range(steps):
    x = np.zeros((layout.tokens_padded, layout.hidden), np.float32)
    x[: layout.tokens] = weights["embedding"][fed.reshape(-1)]
    t0 = time.perf_counter()
    with interpret_mode(params):
        out = step_fn(tables, jnp.full((1,), position, jnp.int32), jnp.asarray(fed.reshape(-1)),
                      jnp.asarray(x), final_norm, jnp.asarray(norms), jnp.asarray(embedding),
                      stream, vectors, *caches)
        out = jax.block_until_ready(out)
    secs = time.perf_counter() - t0
    tokens_k, logits_k = np.asarray(out[0]), np.asarray(out[1])
    drafts_k = np.asarray(out[layout.outputs_before_caches - 1])
    caches = list(out[layout.outputs_before_caches:])
    # reference
    ref_logits, ref_cache, hidden = reference.forward_traced(spec, weights, jnp.asarray(fed), ref_cache, position)
    verified = np.asarray(ref_logits)[..., : layout.vocab_used].argmax(-1).astype(np.int32)
    accepted, bonus = rdraft.accept_greedy(fed[:, 1:], verified)
    n = int(accepted[0]) + 1
    hidden = np.asarray(hidden)[:, :, :n]
    drafts_r, _, state = rdraft.draft_step(spec, weights, state, jnp.asarray(fed[:, :n]), jnp.asarray(hidden), jnp.asarray(bonus), rows)
    drafts_r = np.asarray(drafts_r)
    print(f"step {step} pos {position} ({secs:.1f}s): kernel tokens {tokens_k.tolist()} ref {verified.tolist()}; "
          f"kernel accepted/drafts {drafts_k.tolist()} ref n {n} bonus {bonus.tolist()} drafts {drafts_r.tolist()}")
    fed = np.concatenate([bonus[:, None], drafts_r], axis=1).astype(np.int32)
    position += n
    if step % 2 == 0:  # feed the target's own greedy continuation: the first draft right, the rest too
        probe_cache = jax.tree.map(lambda a: a, ref_cache)
        seq = [int(bonus[0])]
        for _ in range(rows - 1):
            lg, probe_cache, _ = reference.forward_traced(spec, weights, jnp.asarray([[seq[-1]]], jnp.int32), probe_cache, position + len(seq) - 1)
            seq.append(int(np.asarray(lg)[0, -1, : layout.vocab_used].argmax()))
        if rows > 2:
            seq[-1] = (seq[-1] + 1) % layout.vocab_used  # the last draft wrong: accepted rows - 1
        fed = np.asarray([seq], np.int32)
        print("  feeding", fed.tolist())
