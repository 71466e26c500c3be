"""The XLA prefill over per-core layouts (mkgen/runtime/prefill.py, mkgen/weights/unpack.py).

Unpacking what the packer wrote gives back every tensor the kernel stores (every
attention and FFN kind, the stream's int8 / fp8 segments, int4 / int8 / mxfp4 / nvfp4 /
fp8 experts, MLA's transposed and de-interleaved views). The sharded prefill on 8 virtual devices
leaves in the kernel's cache arrays exactly what the reference model's prefill caches
hold, core by core, and a different prompt does not; prompts go in power-of-two chunks,
whose layer steps compile once per chunk size. A kernel that drafts gets, after the
prompt, the reference MTP drafter's chain. The runner's generation through
the XLA prefill and then the kernel is in tests/test_runner.py.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mkgen.host_devices import cpu_device_variables
from mkgen.kinds import default_registry

SPECS = Path(__file__).parent / "specs"
TOPOLOGY = "2x2x1"  # 8 cores: heads, kv heads, experts and columns all split
CONTEXT, BATCH = 128, 2
# 13 tokens: chunks of 8, 4 and 1.
PROMPTS = [
    [3, 17, 42, 99, 5, 64, 1, 2, 9, 30, 4, 8, 21],
    [7, 7, 8, 9, 10, 11, 12, 13, 1, 6, 2, 2, 5],
]


# Cases other than a spec's mini twin splitting what the full-size build splits: by name,
# (spec, the splits forced on its mini twin or None: the full-size build's, its options).
MLA_HYBRID = str(SPECS / "mla-hybrid.yaml")
GPT_OSS = str(Path(__file__).parent / "fixtures" / "hf" / "gpt_oss" / "config.json")
SPECIAL_CASES = {
    # Split though the full-size build does not: wkv_a's interleaved rotary columns, stored
    # as halves, in pieces.
    "mla-hybrid, latents split": (
        MLA_HYBRID, ("attention.mla_rope.latent", "attention.mla_nope.latent"), {},
    ),
    # Expert sharing (4 groups of 2 experts, 2 width parts): each core also holds the last
    # expert of its paired group's block, with its biases; the prefill runs its own block.
    "gpt-oss, experts shared": (GPT_OSS, None, {"expert_sharing": "half"}),
}  # fmt: skip


@functools.cache
def _setup(spec_ref: str):
    """(mini spec, layout, the weights the kernel stores) of a spec on TOPOLOGY, its
    twin splitting what the full-size build splits (the router, MLA's latent
    projections), as a build's mini twin does; or of a case of SPECIAL_CASES. Made once
    per process (the tests read them, never change them): the unpacking, heads and
    dense-MLP tests share a spec's, and so do a child's modes."""
    from mkgen.codegen.package import mini_kernel_args
    from mkgen.plan import plan_build
    from mkgen.plan.options import BuildOptions
    from mkgen.plan.sharding import full_size_splits
    from mkgen.spec.loader import load_spec
    from mkgen.spec.mini import mini_twin
    from mkgen.spec.topology import parse_topology
    from mkgen.weights.quantize import stored_random_weights

    topology = parse_topology(TOPOLOGY)
    spec_ref, splits, knobs = SPECIAL_CASES.get(spec_ref, (spec_ref, None, {}))
    options = BuildOptions.create(context=CONTEXT, batch=BATCH, **knobs)
    if splits is None:
        splits = full_size_splits(load_spec(spec_ref), topology, options, kinds=default_registry())
    spec = mini_twin(load_spec(spec_ref), topology.num_devices)
    options = options.model_copy(update={"splits": splits})
    layout = plan_build(
        spec, topology, options, **mini_kernel_args(), kinds=default_registry()
    ).kernel
    return spec, layout, stored_random_weights(spec, 0)


def _relative(ours, theirs) -> float:
    ours, theirs = np.asarray(ours, np.float32), np.asarray(theirs, np.float32)
    return float(np.abs(ours - theirs).max() / max(np.abs(theirs).max(), 1e-6))


QWEN3_NEXT = str(Path(__file__).parent / "fixtures" / "hf" / "qwen3_next" / "config.json")
UNPACK_CASES = [
    GPT_OSS,  # expert biases, sinks, q/k/v/o biases
    "qwen3.8-27b",  # Gated DeltaNet + gated GQA
    "muse-spark-1.2",  # int4 experts, latent MoE
    str(SPECS / "kda-hybrid.yaml"),
    MLA_HYBRID,  # both MLA forms, interleaved rope, attention residual
    str(SPECS / "formats-int8.yaml"),
    str(SPECS / "formats-fp8.yaml"),
    str(SPECS / "formats-mxfp4.yaml"),
    str(SPECS / "formats-nvfp4.yaml"),  # and int8 dense weights and lm_head
    str(SPECS / "formats-int8-experts.yaml"),
    "gpt-oss, experts shared",
]


def _kind_rows(layout, layer: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A layer's stream rows (pack.pack_stream_layer) cut into its attention kind's and
    its FFN kind's rows, as the prefill slices them from the stream."""
    s = layout.stream
    attention = s.attention[layout.attention[layout.attention_table[layer]].name]
    ffn = s.ffn[layout.ffn[layout.ffn_table[layer]].name]
    at = s.ffn_rows[layer] - s.attention_rows[layer]
    return rows[: attention.rows], rows[at : at + ffn.rows]


@pytest.mark.parametrize(
    "spec_ref",
    UNPACK_CASES,
    ids=["gpt_oss", *(Path(s).stem if s.endswith(".yaml") else s for s in UNPACK_CASES[1:])],
)
def test_unpacking_gives_back_the_stored_tensors(spec_ref: str) -> None:
    """Every core's pieces of every layer, gathered and assembled, equal the weights the
    kernel stores (fake_quantize: the spec's formats); each core's routed-expert pieces
    equal its experts' column slices."""
    import jax.numpy as jnp

    from mkgen.reference.model import layer_weights
    from mkgen.spec.weights import model_weights
    from mkgen.weights import pack, unpack

    spec, layout, weights = _setup(spec_ref)
    shared = [f.partner_experts for f in layout.ffn if f.routed_experts and f.partner_experts]
    assert bool(shared) == (spec_ref == "gpt-oss, experts shared"), shared
    shapes = {w.name: w.shape for w in model_weights(spec)}
    ranks = layout.devices
    for layer in range(spec.layers.count):
        prefix = f"layers.{layer}."
        layer_shapes = layer_weights(shapes, prefix)
        pieces = [
            unpack.layer_pieces(
                layout, layer, _kind_rows(layout, layer, pack.pack_stream_layer(layout, weights, rank, layer)),
                pack.pack_vectors_layer(layout, weights, rank, layer),
                pack.pack_experts_layer(layout, weights, rank, layer), layer_shapes,
            )
            for rank in range(ranks)
        ]  # fmt: skip
        routed = set(f"ffn.{n}" for n in unpack.EXPERT_TENSORS)
        gathered = {
            k: np.stack([np.asarray(p[k]) for p in pieces]) for k in pieces[0] if k not in routed
        }
        tensors = unpack.assemble(layout, layer, gathered, layer_shapes)
        expected = {k[len(prefix) :] for k in weights if k.startswith(prefix)}
        assert set(tensors) | (routed & expected) == expected
        for name, value in tensors.items():
            assert _relative(value, weights[prefix + name]) == 0.0, (layer, name)
        ffn = layout.ffn[layout.ffn_table[layer]]
        if ffn.type != "moe":
            continue
        for rank in range(ranks):
            held, cols = ffn.held_experts(rank)
            ids = held[: ffn.experts_per_rank]  # the pieces: its own group's block
            for name, index in (
                ("experts_gate", (ids, slice(None), cols)),
                ("experts_up", (ids, slice(None), cols)),
                ("experts_down", (ids, cols, slice(None))),
                ("experts_b_gate", (ids, cols)),
                ("experts_b_up", (ids, cols)),
                ("experts_b_down", (ids,)),
            ):
                if f"{prefix}ffn.{name}" not in weights:
                    continue  # no expert biases
                stored = weights[f"{prefix}ffn.{name}"][index]
                assert _relative(pieces[rank][f"ffn.{name}"], stored) == 0.0, (layer, name, rank)
            # Every expert it holds as packed (with expert sharing, its partner's shared part
            # after its own block).
            arrays = [jnp.asarray(a) for a in pack.pack_experts_layer(layout, weights, rank, layer)]
            chunks = unpack.expert_values(ffn.experts, arrays)
            for name, value in unpack.expert_matrices(ffn.experts, chunks).items():
                index = (
                    (held, cols, slice(None))
                    if name == "experts_down"
                    else (held, slice(None), cols)
                )
                stored = weights[f"{prefix}ffn.{name}"][index]
                assert _relative(value, stored) == 0.0, (layer, name, rank)


# Builds that split the router, the MoE latent projections or MLA's latent projections
# (the first two as their full-size builds do): per case, the split tensors.
SPLIT_CASES = {
    "kimi-k3": {"ffn.router", "ffn.latent_in", "ffn.latent_out", "attn.wq_a", "attn.wkv_a"},
    # GQA; its full-size latent design ar_ag: latent_out split by columns, the hidden
    # all-gathered
    "muse-spark-1.2": {"ffn.router", "ffn.latent_in", "ffn.latent_out"},
    "mla-hybrid, latents split": {"attn.wq_a", "attn.wkv_a"},
}

PREFILL_CASES = [
    GPT_OSS,
    "qwen3.8-27b",
    str(SPECS / "kda-hybrid.yaml"),
    MLA_HYBRID,
    str(SPECS / "latent-moe-shared.yaml"),
    QWEN3_NEXT,  # gated shared experts
    *SPLIT_CASES,  # split routers, MoE latent and MLA latent projections
    "gpt-oss, experts shared",
]
CACHE_RTOL = 2e-2  # bf16 caches; the same f32 computation summed in another order
# The MTP module's outputs over bf16 caches (the reference's are f32): 8.3e-4 measured; a
# chained entry one position late gives 0.041.
MODULE_RTOL = 5e-3


def _placed(layout, weights, mesh) -> dict:
    """Every core's stream, vectors and experts as the runner places them on `mesh`."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from mkgen.weights import pack

    ranks, sharded = layout.devices, NamedSharding(mesh, P("cores"))
    per_rank = [pack.pack_experts(layout, weights, r) for r in range(ranks)]
    placed = {
        "stream": np.stack([pack.pack_stream(layout, weights, r) for r in range(ranks)]),
        "vectors": np.stack([pack.pack_vectors(layout, weights, r) for r in range(ranks)]),
        "experts": [np.stack([p[i] for p in per_rank]) for i in range(len(per_rank[0]))],
    }
    return jax.tree.map(lambda a: jax.device_put(a, sharded), placed)


def _prefill_child(spec_refs: list[str]) -> dict:
    """Per spec: the largest relative difference between the sharded prefill's kernel
    caches and the reference prefill's, cut per core; the same against the caches of the
    prompts reversed (must differ); and the compilations of each layer step after
    prompts of 13 and 3 tokens (the first spec: every chunk size) or of 9 tokens (the
    others: a chunk of 8, then one continuing it)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    from mkgen.reference import model as reference
    from mkgen.runtime.prefill import prefill, prefill_steps

    results = {}
    for spec_ref in spec_refs:
        spec, layout, weights = _setup(spec_ref)
        ranks = layout.devices
        mesh = Mesh(np.array(jax.devices()[:ranks]), ("cores",))
        placed = _placed(layout, weights, mesh)
        bucketed = spec_ref == spec_refs[0]
        tokens = np.array(PROMPTS, np.int32)[:, : None if bucketed else 9]
        caches = prefill(spec, layout, mesh, "cores", placed, weights["embedding"], tokens)
        if bucketed:
            # A prompt of 3 tokens (chunks 2 and 1) compiles the steps for 2 only: those
            # for 1 were compiled for 13 (8, 4 and 1).
            prefill(spec, layout, mesh, "cores", placed, weights["embedding"], tokens[:, :3])
        steps = prefill_steps(spec, layout, mesh, "cores").steps.values()
        out = {"compiles": sorted({step._cache_size() for step in steps})}
        for label, prompt in (("same", tokens), ("reversed", tokens[:, ::-1])):
            _, ref = reference.prefill(spec, weights, prompt, CONTEXT, jnp.bfloat16)
            worst, arrays = 0.0, iter(caches)
            for kind in layout.attention:
                ours = {c.name: np.asarray(next(arrays), np.float32) for c in kind.caches}
                for slot, layer in enumerate(kind.layers):
                    for rank in range(ranks):
                        theirs = kind.cache_pieces(spec, ref["layers"][layer], rank)
                        for name, value in theirs.items():
                            worst = max(worst, _relative(ours[name][rank, slot], value))
            out[label] = worst
        results[spec_ref] = out
    return results


def _core_ops(jaxpr) -> tuple[list[list[int]], list[str]]:
    """(the right-hand operand shapes of every dot, what produced each all-gathered value:
    an op's name, "input" for an argument) in a jaxpr and the jaxprs inside it (shard_map's
    body, scans, conditionals): inside shard_map, one core's work."""
    dots, gathered, producers = [], [], {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            dots.append(list(eqn.invars[1].aval.shape))
        if eqn.primitive.name == "all_gather":
            gathered.append(producers.get(eqn.invars[0], "input"))
        producers |= {out: eqn.primitive.name for out in eqn.outvars}
        for value in eqn.params.values():
            for inner in value if isinstance(value, list | tuple) else [value]:
                inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's jaxpr
                if hasattr(inner, "eqns"):
                    inner_dots, inner_gathered = _core_ops(inner)
                    dots, gathered = dots + inner_dots, gathered + inner_gathered
    return dots, gathered


def _dots_child(spec_refs: list[str]) -> dict:
    """Per spec and layer kind pair: the full and per-core shapes of the layer's tensors
    the plan splits among the router, MoE latent and MLA latent projections (those of
    SPLIT_CASES); the
    right-hand shapes of every dot one core's layer step (a chunk of 8 tokens) runs and
    what produced every value it all-gathers (_core_ops)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    from mkgen.runtime.prefill import _expert_arrays, _start_cache, prefill_steps
    from mkgen.spec.weights import model_weights
    from mkgen.weights.unpack import piece_shape

    projections = set().union(*SPLIT_CASES.values())
    results = {}
    for spec_ref in spec_refs:
        spec, layout, weights = _setup(spec_ref)
        mesh = Mesh(np.array(jax.devices()[: layout.devices]), ("cores",))
        placed, steps = _placed(layout, weights, mesh), prefill_steps(spec, layout, mesh, "cores")
        shapes = {w.name: w.shape for w in model_weights(spec)}
        pairs = {}
        for layer, pair in enumerate(zip(layout.attention_table, layout.ffn_table, strict=True)):
            if pair in pairs.values():
                continue
            kinds = (layout.attention[pair[0]], layout.ffn[pair[1]])
            split = {
                part.tensor: {
                    "full": list(shapes[f"layers.{layer}.{part.tensor}"]),
                    "piece": list(piece_shape(part, shapes[f"layers.{layer}.{part.tensor}"])),
                }
                for kind in kinds
                for segment in kind.segments
                for part in segment.parts
                if part.tensor in projections and part.axis is not None
            }
            stream = layout.stream
            args = (
                placed["stream"], placed["vectors"],
                tuple(placed["experts"][i] for i in _expert_arrays(layout, layer)),
                jnp.zeros((BATCH, 8, spec.dims.hidden), jnp.float32),
                _start_cache(spec, layout, mesh, "cores", layer, BATCH, None), jnp.int32(0),
                (jnp.int32(stream.attention_rows[layer]), jnp.int32(stream.ffn_rows[layer])),
                jnp.int32(layer), jnp.int32(layout.ffn_slot[layer]),
            )  # fmt: skip
            jaxpr = jax.make_jaxpr(steps._step(layer))(*args)
            pairs[layer] = pair
            dots, gathered = _core_ops(jaxpr.jaxpr)
            results[f"{spec_ref} layer {layer}"] = {
                "split": split,
                "dots": dots,
                "gathered": gathered,
            }
    return results


FUSED_ROWS = 4  # three passes: a draft from the module's last prompt entry, two chained
DRAFT_MTP = str(SPECS / "draft-mtp.yaml")
# Kernels that draft, by name: (spec with an mtp drafter, its quantization overrides). An
# int8 LM head is unpacked from whole banks of its stream rows, a bf16 one from its rows.
MODULE_CASES = {"draft-mtp": (DRAFT_MTP, {}), "int8 LM head": (DRAFT_MTP, {"lm_head": "int8"})}


def _module_child(cases: list[str]) -> dict:
    """A kernel that drafts (--fuse-draft at FUSED_ROWS rows) of each of MODULE_CASES:
    after PROMPTS' first 12 tokens, the largest relative difference between
    what the prefill's draft chain feeds its LM head (the MTP module's output at the
    prompt's last entry, then at each chained entry) and the reference chain's
    (mtp_layer, mtp_head), and its drafts beside the reference's."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    import mkgen.runtime.prefill as prefill_module
    from mkgen.codegen.package import mini_kernel_args
    from mkgen.plan import plan_build
    from mkgen.plan.options import BuildOptions
    from mkgen.reference.draft import (
        compile_traced,
        init_draft_state,
        mtp_head,
        mtp_layer,
        target_hidden,
    )
    from mkgen.reference.model import greedy_token, init_cache
    from mkgen.spec.draft_import import load_drafter
    from mkgen.spec.loader import load_spec
    from mkgen.spec.mini import mini_twin
    from mkgen.spec.topology import parse_topology
    from mkgen.weights.quantize import stored_draft_weights, stored_random_weights

    fed: list[np.ndarray] = []
    head_step = prefill_module._head_step

    def recording_head(*args):
        head = head_step(*args)

        def recorded(stream, final_norm, out):
            fed.append(np.asarray(out))
            return head(stream, final_norm, out)

        return recorded

    prefill_module._head_step = recording_head
    results = {}
    for case in cases:
        spec_ref, quantization = MODULE_CASES[case]
        topology = parse_topology(TOPOLOGY)
        spec = mini_twin(load_drafter("mtp", load_spec(spec_ref)), topology.num_devices)
        data = spec.model_dump(mode="json")
        data["quantization"] |= quantization
        spec = type(spec).model_validate(data)
        options = BuildOptions.create(
            context=CONTEXT, batch=BATCH, rows=FUSED_ROWS, fuse_draft=True
        )
        layout = plan_build(
            spec, topology, options, **mini_kernel_args(), kinds=default_registry()
        ).kernel
        weights = stored_random_weights(spec, 0) | stored_draft_weights(spec, 0)
        mesh = Mesh(np.array(jax.devices()[: layout.devices]), ("cores",))
        prompts = np.array(PROMPTS, np.int32)
        tokens, following = prompts[:, :-1], prompts[:, 1:]
        module = prefill_module.ModuleInputs(
            {n: v for n, v in weights.items() if n.startswith("draft.")},
            weights["final_norm"], weights["embedding"], following,
        )  # fmt: skip
        drafted: list[tuple[int, jax.Array]] = []
        fed.clear()
        prefill_module.prefill(
            spec, layout, mesh, "cores", _placed(layout, weights, mesh), weights["embedding"],
            tokens, module=module, drafted=lambda *made: drafted.append(made),  # noqa: B023
        )  # fmt: skip
        ((count, drafts),) = drafted
        # The reference: the module over the prompt's entries, then its greedy chain.
        w = {n: jnp.asarray(v) for n, v in weights.items()}
        _, _, hidden = compile_traced(spec)(w, tokens, init_cache(spec, BATCH, CONTEXT))
        last = target_hidden(spec, w, hidden, spec.layers.count - 1)
        cache = init_draft_state(spec, BATCH, CONTEXT)["layers"][0]
        out, cache = mtp_layer(spec, w, cache, following, last, 0)
        outs, theirs = [out[:, -1:]], []
        for j in range(FUSED_ROWS - 1):
            logits, chained = mtp_head(spec, w, outs[-1])
            theirs.append(greedy_token(spec, logits))
            if j + 1 < FUSED_ROWS - 1:
                at = tokens.shape[1] + j
                out, cache = mtp_layer(spec, w, cache, theirs[-1][:, None], chained, at)
                outs.append(out)
        results[case] = {
            "count": count,
            "fed": max(_relative(a, b) for a, b in zip(fed, outs, strict=True)),
            "drafts": np.asarray(drafts).tolist(),
            "reference": np.stack(theirs, axis=1).tolist(),
        }
    return results


def _run_child(modes: list[str], spec_refs: list[str]) -> dict:
    """The results of this file run as a script in each of `modes` over `spec_refs`, one
    after the other in one process of its own with 8 virtual CPU devices, by mode."""
    env = {**os.environ, **cpu_device_variables(8, os.environ), "PYTHONDONTWRITEBYTECODE": "1"}
    child = subprocess.run(
        [sys.executable, __file__, ",".join(modes), *spec_refs], capture_output=True, text=True,
        timeout=840, env=env, cwd=Path(__file__).parent,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


def _children(run_once) -> dict:
    """The caches and the dots children's results over PREFILL_CASES, from one process run
    once for the whole run (conftest's run_once): each spec's set-up (its mini twin,
    layout and random weights) is made once for both tests instead of once in each."""
    return run_once("prefill-children", lambda: _run_child(["caches", "dots"], PREFILL_CASES))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sharded_prefill_writes_the_reference_caches(run_once) -> None:
    results = _children(run_once)["caches"]
    for spec_ref in PREFILL_CASES:
        assert results[spec_ref]["same"] <= CACHE_RTOL, (spec_ref, results[spec_ref])
        assert results[spec_ref]["reversed"] > 10 * CACHE_RTOL, (spec_ref, results[spec_ref])
    # Chunks of 8, 4, 2 and 1 for the first spec, of 8 and 1 for the others.
    compiles = [[4 if spec_ref == PREFILL_CASES[0] else 2] for spec_ref in PREFILL_CASES]
    assert [results[spec_ref]["compiles"] for spec_ref in PREFILL_CASES] == compiles, results


@pytest.mark.timeout(900)
def test_a_kernel_that_drafts_prefills_the_reference_drafts_after_the_prompt() -> None:
    """The prefill of a kernel that drafts ends with its first drafts: the MTP module's
    greedy chain from the prompt's last entry, each chained entry at the position after
    the one before, as the reference drafter makes them (the LM head's inputs within the
    bf16 caches' rounding), with a bf16 or an int8 LM head; they follow the token after the
    12 prompt tokens prefilled."""
    results = _run_child(["module"], list(MODULE_CASES))["module"]
    for name, case in results.items():
        assert case["count"] == len(PROMPTS[0]) - 1, name
        assert case["fed"] <= MODULE_RTOL, (name, case)
        assert case["drafts"] == case["reference"], (name, case)


@pytest.mark.timeout(900)
def test_split_projections_are_multiplied_in_pieces(run_once) -> None:
    """Where the plan splits the MoE router, the MoE latent projections or MLA's latent
    projections over the cores, each core's layer step multiplies by its own piece
    ([.., fan_in] x [fan_in, fan_out / cores], or the row piece [fan_in / cores, fan_out]).
    In every layer step of these specs a core all-gathers products only, never a weight:
    no core assembles, and so multiplies by, the whole of a split tensor, and a
    replicated one is its own copy (the cache test above checks the results)."""
    results = _children(run_once)["dots"]
    for where, result in results.items():
        assert set(result["gathered"]) <= {"dot_general"}, (where, result["gathered"])
    for spec_ref, split in SPLIT_CASES.items():
        layers = {k: v for k, v in results.items() if k.startswith(f"{spec_ref} layer ")}
        assert set().union(*(v["split"] for v in layers.values())) == split, layers.keys()
        for where, result in layers.items():
            for name, shapes in result["split"].items():
                assert shapes["piece"] in result["dots"], (where, name, result["dots"])
                if shapes["piece"][-1] < shapes["full"][-1]:  # a column split: gathered
                    assert result["gathered"], where


def test_dense_mlps_split_by_columns_are_computed_in_pieces() -> None:
    """The dense MLPs of these specs are split as tensor parallelism splits them, so the
    prefill computes each core's columns alone (the cache test above checks the result);
    a MoE kind is not."""
    for spec_ref in ("qwen3.8-27b", MLA_HYBRID):
        _, layout, _ = _setup(spec_ref)
        assert [f.columns_split() for f in layout.ffn if f.type == "dense"] == [True]
        assert not any(f.columns_split() for f in layout.ffn if f.type == "moe")


def _core_pieces(layout, weights, rank: int, layer: int, layer_shapes) -> dict:
    """Core `rank`'s pieces of layer `layer` (unpack.layer_pieces of what the packer wrote
    for it)."""
    from mkgen.weights import pack, unpack

    return unpack.layer_pieces(
        layout, layer, _kind_rows(layout, layer, pack.pack_stream_layer(layout, weights, rank, layer)),
        pack.pack_vectors_layer(layout, weights, rank, layer),
        pack.pack_experts_layer(layout, weights, rank, layer), layer_shapes,
    )  # fmt: skip


HEADS_CASES = [
    GPT_OSS,
    "qwen3.8-27b",
    MLA_HYBRID,
    str(SPECS / "kda-hybrid.yaml"),
]


@pytest.mark.parametrize(
    "spec_ref", HEADS_CASES, ids=["gpt_oss", "qwen3.8-27b", "mla-hybrid", "kda-hybrid"]
)
def test_attention_heads_are_computed_by_their_own_cores(spec_ref: str) -> None:
    """Per attention kind (GQA, MLA, Gated DeltaNet, KDA), each core computes attention
    from its own pieces alone: its heads' columns and its rows of wo (GQA / Gated
    DeltaNet: the kv / key heads its heads read; MLA: the latent projections, replicated).
    The cores' outputs summed, plus bo, are the layer's attention; each core's cache, in
    the kernel's layout, is its cut of the reference cache (MLA: the whole latent cache)."""
    from mkgen.reference import model as reference
    from mkgen.runtime.prefill import _own_heads_kind, core_attention
    from mkgen.spec.weights import model_weights
    from mkgen.weights import unpack

    spec, layout, weights = _setup(spec_ref)
    shapes = {w.name: w.shape for w in model_weights(spec)}
    x = np.random.default_rng(0).standard_normal((BATCH, 5, spec.dims.hidden), np.float32)
    for attention in layout.attention:
        layer = attention.layers[0]
        kind = spec.attention_of(layer)
        prefix = f"layers.{layer}."
        layer_shapes = reference.layer_weights(shapes, prefix)
        full = reference.layer_weights(weights, prefix + "attn.")
        empty = reference.init_layer_cache(spec, layer, BATCH, CONTEXT)
        expected, expected_cache = reference.attention(spec, layer, full, x, empty, 2)
        total = full["bo"] if kind.type == "gqa" and kind.o_bias else 0.0
        for rank in range(layout.devices):
            pieces = _core_pieces(layout, weights, rank, layer, layer_shapes)
            own = {n: v for n, v in pieces.items() if n.startswith("attn.")}
            tensors = unpack.own_tensors(layout, layer, own, layer_shapes)
            assert tensors["wo"].shape[0] * layout.devices == full["wo"].shape[0]
            # A GQA / Gated DeltaNet core keeps its own heads' cache, MLA the whole latent.
            own_kind = _own_heads_kind(spec, layer, attention)
            cache = reference.init_kind_cache(own_kind, BATCH, CONTEXT)
            out, cache = core_attention(
                spec, layout, layer, own, layer_shapes, x, cache, 2, "cores"
            )
            total = total + out
            if not attention.own_cache:  # MLA: the whole latent cache on every core
                ours, theirs = cache, expected_cache
            else:
                ours = attention.own_cache_pieces(cache)
                theirs = attention.cache_pieces(spec, expected_cache, rank)
            for name, value in ours.items():
                assert _relative(value, theirs[name]) < 1e-5, (layer, rank, name)
        assert _relative(total, expected) < 1e-4, layer


@pytest.mark.parametrize(
    "spec_ref",
    [str(SPECS / "latent-moe-shared.yaml"), "kimi-k3", QWEN3_NEXT],
    ids=["latent-moe-shared", "kimi-k3", "qwen3_next"],
)
def test_shared_experts_split_by_columns_are_computed_in_pieces(spec_ref: str) -> None:
    """These MoE kinds' shared experts are split over the cores, so each core runs them on
    its own pieces alone. Split as an MLP (gate and up by columns, down by rows): the
    cores' outputs, summed, are the whole shared MLP's. Split by output columns (a latent
    MoE combined by all-gather, as Kimi K3's and latent-moe-shared's full-size builds at
    batch 1): the cores' gate and up columns side by side give the whole activation, and
    each core's down columns of it, side by side, the whole output."""
    from mkgen.reference import model as reference
    from mkgen.reference.ffn import shared_mlp
    from mkgen.reference.layers import gated_activation, mm
    from mkgen.spec.weights import model_weights

    spec, layout, weights = _setup(spec_ref)
    shapes = {w.name: w.shape for w in model_weights(spec)}
    x = np.random.default_rng(0).standard_normal((BATCH, 3, spec.dims.hidden), np.float32)
    moe = next(f for f in layout.ffn if f.type == "moe")
    by_rows = moe.shared_columns_split()
    assert by_rows != moe.shared_outputs_split()  # one of the two splits, never both
    layer = next(i for i in range(spec.layers.count) if spec.ffn_of(i).type == "moe")
    kind, prefix = spec.ffn_of(layer), f"layers.{layer}."
    layer_shapes = reference.layer_weights(shapes, prefix)
    owns = [
        {n.removeprefix("ffn."): v for n, v in pieces.items() if "shared_" in n}
        for pieces in (_core_pieces(layout, weights, r, layer, layer_shapes)
                       for r in range(layout.devices))
    ]  # fmt: skip
    if by_rows:
        assert owns[0]["shared_down"].shape[0] * layout.devices == kind.shared_experts.width
        total = sum(shared_mlp(kind, own, x) for own in owns)
    else:
        assert owns[0]["shared_down"].shape[0] == kind.shared_experts.width
        gate, up = (np.concatenate([mm(x, own[n]) for own in owns], -1)
                    for n in ("shared_gate", "shared_up"))  # fmt: skip
        hidden = gated_activation(kind.activation, gate, up)
        total = np.concatenate([mm(hidden, own["shared_down"]) for own in owns], -1)
    expected = shared_mlp(kind, reference.layer_weights(weights, prefix + "ffn."), x)
    assert _relative(total, expected) < 1e-4


def test_prompts_go_in_power_of_two_chunks() -> None:
    """Any prompt length is covered, in order and largest first, by chunks whose sizes
    are distinct powers of two, so a context of 64 compiles at most 7 chunk sizes."""
    from mkgen.runtime.prefill import prompt_chunks

    assert prompt_chunks(11) == [(0, 8), (8, 2), (10, 1)]
    sizes = set()
    for length in range(1, 65):
        chunks = prompt_chunks(length)
        starts = np.cumsum([0] + [n for _, n in chunks])
        assert [start for start, _ in chunks] == starts[:-1].tolist()
        assert starts[-1] == length
        assert [n for _, n in chunks] == sorted({n for _, n in chunks}, reverse=True)
        sizes |= {n for _, n in chunks}
    assert sizes == {1, 2, 4, 8, 16, 32, 64}


if __name__ == "__main__":
    children = {"caches": _prefill_child, "dots": _dots_child, "module": _module_child}
    print(json.dumps({mode: children[mode](sys.argv[2:]) for mode in sys.argv[1].split(",")}))
