"""Sharding, HBM fit and build options: per-rank shapes of the showcase models, clear errors."""

from __future__ import annotations

import math
import re

import pytest

from mkgen.errors import SpecError
from mkgen.kinds import default_registry
from mkgen.plan import BuildOptions, plan_build
from mkgen.plan.collectives import collective_buffers, ffn_out_buffer, layer_uses
from mkgen.plan.memory import check_fit, plan_fitted
from mkgen.plan.options import parse_quant_overrides, parse_size
from mkgen.plan.sharding import expected_max, full_size_splits, plan_sharding
from mkgen.spec.loader import load_spec
from mkgen.spec.mini import mini_twin
from mkgen.spec.topology import parse_topology
from mkgen.spec.weights import model_weights


def _plan(model: str, topology: str, **options):
    spec = load_spec(model)
    opts = BuildOptions.create(**options)
    return spec, plan_sharding(
        opts.apply(spec), parse_topology(topology), opts, kinds=default_registry()
    )


def _rel(plan, kind: str, section: str = "attention"):
    table = plan.attention if section == "attention" else plan.ffn
    return _rel_of(table[kind])


def _rel_of(kind_sharding):
    return {t.name.split(".", 1)[1]: t for t in kind_sharding.tensors}


# --------------------------------------------------------------------------- Kimi K3


def test_kimi_k3_heads_split_three_per_core():
    _, plan = _plan("kimi-k3", "2x2x4", rows=8)
    assert plan.devices == 32
    assert plan.attention["mla"].heads_per_rank == 3
    assert plan.attention["kda"].heads_per_rank == 3
    kda = _rel(plan, "kda")
    assert kda["wq"].rank_shape == (7168, 384)
    assert kda["wo"].rank_shape == (384, 7168)
    assert kda["conv_q"].rank_shape == (4, 384)
    # The 128-rank decay-gate projection is cheaper to replicate than to gather.
    assert kda["wf_a"].replicated and kda["wf_a"].copies == 32
    # KDA state: 3 heads x 128 x 128 f32 + 3 conv taps of q, k, v in bf16, per sequence.
    assert plan.attention["kda"].cache.fixed_bytes == 3 * 128 * 128 * 4 + 3 * 3 * 384 * 2


def test_kimi_k3_mla_latent_projections_split_into_unaligned_pieces_and_gathered():
    _, plan = _plan("kimi-k3", "2x2x4", rows=8)
    mla = plan.attention["mla"]
    # Split 32 ways, wq_a and wkv_a give 48- and 18-column pieces; one all-gather joins
    # each tensor's pieces on its own, so they need not be whole 128-lane tiles.
    assert mla.latent == "split"
    t = _rel(plan, "mla")
    assert t["wq_a"].rank_shape == (7168, 48) and t["wkv_a"].rank_shape == (7168, 18)
    # Per core and MLA layer: 28.9 MiB replicated, 1.1 MiB split (HBM tiles of 16 rows).
    replicated = 7168 * (1536 + 576) * 2
    assert round(replicated / 2**20, 1) == 28.9
    assert t["wq_a"].rank_bytes + t["wkv_a"].rank_bytes == 7168 * (48 + 32) * 2
    split_us, replicated_us = (float(x) for x in re.findall(r"([\d.]+) us", t["wq_a"].why))
    assert split_us < replicated_us and t["wq_a"].why in mla.why
    assert [(c.name, c.op, c.width) for c in mla.collectives] == [
        ("mla_latent", "all_gather", 1536 + 576),
        ("attn_out", "all_reduce", 7168),
    ]
    assert t["wq_b"].rank_shape == (1536, 3 * 192)
    assert t["wkv_b"].rank_shape == (512, 3 * 256)
    # Every head reads the whole latent: the MLA cache is replicated, bf16 per token.
    assert mla.cache.kind == "mla_latent" and mla.cache.bytes_per_token == 576 * 2
    assert mla.cache.copies == 32


def test_mla_gather_borrows_the_ffn_buffer_the_attention_all_reduce_protects():
    _, plan = _plan("kimi-k3", "2x2x4", rows=8)
    mla, moe = plan.attention["mla"], plan.ffn["moe"]
    assert collective_buffers(mla.collectives, moe.collectives, ffn_out_buffer(plan)) == {
        "mla_latent": 1, "attn_out": 0, "latent_in": 1, "ffn_out": 2, "expert_out": 3,
    }  # fmt: skip
    uses = layer_uses(plan)
    assert len(uses) == 4
    assert ("mla.mla_latent", "all_gather", 2112, "flat") in uses[1]
    # The router's scores and the shared experts' activation ride in the latent's gather.
    assert ("moe.latent_in", "all_gather", 3584 + 896 + 6144, "flat") in uses[1]
    # The MoE's all-reduce of the latent shares the dense layer's output buffer.
    assert [name for name, *_ in uses[3]] == ["dense.ffn_out", "moe.expert_out"]


def test_fp8_blocks_a_split_would_cut_are_reblocked_losslessly():
    # Kimi K2's fp8:128 MLP split 32 ways is 576 columns per core (4.5 blocks): each core
    # stores fp8:64 blocks, every one inside a 128-block whose scale it keeps.
    _, plan = _plan("kimi-k2", "2x2x4")
    t = _rel(plan, "dense", "ffn")
    assert t["w_gate"].rank_shape == (7168, 576) and t["w_gate"].format == "fp8:64"
    assert "fp8:128 re-blocked to fp8:64" in t["w_gate"].why
    assert _rel(plan, "moe", "ffn")["shared_gate"].format == "fp8:64"  # 64 columns per core
    assert _rel(plan, "mla")["wq_b"].format == "fp8:128"  # 2 heads x 192: whole blocks


def test_kimi_k3_experts_split_and_candidates_recorded():
    _, plan = _plan("kimi-k3", "2x2x4", rows=8)
    moe = plan.ffn["moe"]
    x = moe.experts
    assert x.groups * x.width_parts == 32
    assert (x.groups, x.width_parts) == (8, 4)  # the hand-written kernel's choice, here by score
    assert x.experts_per_rank == 112 and x.width_per_rank == 768
    t = _rel(plan, "moe", "ffn")
    assert t["experts_gate"].rank_shape == (112, 3584, 768)
    assert t["experts_up"].rank_shape == (112, 3584, 768)
    assert t["experts_down"].rank_shape == (112, 768, 3584)
    assert t["experts_gate"].format == "mxfp4"
    assert t["latent_in"].rank_shape == (7168, 112)
    assert t["shared_gate"].rank_shape == (7168, 192)
    by_split = {(c.groups, c.width_parts): c for c in x.candidates}
    assert set(by_split) == {(1, 32), (2, 16), (4, 8), (8, 4), (16, 2), (32, 1)}
    # Widths 96 and 192 are not lane aligned while aligned splits exist.
    assert by_split[(1, 32)].rejected and by_split[(2, 16)].rejected
    # 4x8 reads fewer expected bytes but its 384-wide slices fill 1.5 MXU tiles, and the
    # mxfp4 expert phase is MXU-bound at 8 rows: 8x4 scores better.
    assert by_split[(4, 8)].expected_rank_bytes < by_split[(8, 4)].expected_rank_bytes
    assert by_split[(8, 4)].score_s < by_split[(4, 8)].score_s
    assert by_split[(8, 4)].chosen and sum(c.chosen for c in x.candidates) == 1
    # Worst case: every one of the 8 x 16 picks lands in one group of 112.
    assert by_split[(8, 4)].worst_case_experts == 112
    assert by_split[(4, 8)].worst_case_experts == 128
    # At 8 token rows the latent MoE all-reduces the latent and all-gathers hidden (the
    # shared experts' activation rides in the latent's all-gather, their down projection
    # split by output columns): cheaper than reduce-scatter + all-reduce of hidden.
    assert moe.latent_design == "ar_ag"
    assert [c.op for c in moe.collectives] == ["all_gather", "all_reduce", "all_gather"]
    assert t["shared_down"].rank_shape == (6144, 224) and t["latent_out"].rank_shape == (3584, 224)
    # At batch 8 (64 token rows) the rounds carry more and reduce-scatter + all-reduce wins.
    _, wide = _plan("kimi-k3", "2x2x4", rows=8, batch=8)
    assert wide.ffn["moe"].latent_design == "rs_ar"
    assert [c.op for c in wide.ffn["moe"].collectives] == [
        "all_gather",
        "reduce_scatter",
        "all_reduce",
    ]


def test_kimi_k3_router_split_with_its_scores_inside_the_latent_all_gather():
    _, plan = _plan("kimi-k3", "2x2x4", rows=8)
    moe = plan.ffn["moe"]
    router = _rel(plan, "moe", "ffn")["router"]
    assert moe.router == "split"
    assert router.rank_shape == (7168, 896 // 32)
    # Per core the router drops from the whole [7168, 896] bf16 (12.25 MiB) to 28 columns
    # (stored transposed, [N, K], in HBM tiles of 32 rows).
    assert router.padded_shape == (32, 7168)
    assert router.rank_bytes == 7168 * 32 * 2
    replicated = 7168 * 896 * 2
    assert replicated == 12.25 * 2**20
    assert plan.rank_bytes_by_family()["router"] == 92 * router.rank_bytes
    # No collective of its own: the latent all-gather carries the scores too.
    assert [(c.name, c.op, c.width) for c in moe.collectives] == [
        ("latent_in", "all_gather", 3584 + 896 + 6144),
        ("expert_out", "all_reduce", 3584),
        ("ffn_out", "all_gather", 7168),
    ]
    # The reason, with both costs, is in the sharding plan the table prints.
    assert router.why.startswith("router split: split + scores inside the latent all-gather")
    assert "replicated 4.06 us per layer" in router.why and router.why in moe.why


def test_router_of_a_moe_without_latent_stays_replicated_where_a_gather_costs_more():
    _, plan = _plan("qwen3-30b-a3b", "2x2x1")
    moe = plan.ffn["moe"]
    router = _rel(plan, "moe", "ffn")["router"]
    assert moe.router == "replicated" and router.replicated
    assert router.why.startswith("router replicated: split + scores all-gathered")
    split_us, replicated_us = (float(x) for x in re.findall(r"([\d.]+) us", router.why))
    assert replicated_us <= split_us
    assert [c.name for c in moe.collectives] == ["ffn_out"]


def test_a_mini_twin_takes_its_full_size_builds_latent_design():
    """Muse Spark on 2x2x2 combines its latent MoE by all-gather (ar_ag); at CPU sizes its
    twin would pick rs_ar, so it takes the full-size build's design, whose kernel it proves."""
    spec, topo, options = (
        load_spec("muse-spark-1.2"),
        parse_topology("2x2x2"),
        BuildOptions.create(),
    )
    splits = full_size_splits(spec, topo, options, kinds=default_registry())
    assert "ffn.moe.ar_ag" in splits
    mini = mini_twin(spec, topo.num_devices)
    assert (
        plan_sharding(mini, topo, options, kinds=default_registry()).ffn["moe"].latent_design
        == "rs_ar"
    )
    twin = plan_sharding(
        mini, topo, options.model_copy(update={"splits": splits}), kinds=default_registry()
    )
    assert twin.ffn["moe"].latent_design == "ar_ag"


def test_a_mini_twin_takes_its_full_size_builds_split_choices():
    spec = BuildOptions.create().apply(load_spec("kimi-k3"))
    topo = parse_topology("2x2x4")
    options = BuildOptions.create(rows=8)
    flats = (
        "flat.all_gather.ffn_out", "flat.all_gather.latent_in", "flat.all_gather.mla_latent",
        "flat.all_gather.sampling",
    )  # fmt: skip
    splits = ("ffn.moe.router", "ffn.moe.ar_ag", "attention.mla.latent", *flats)
    assert full_size_splits(spec, topo, options, kinds=default_registry()) == splits
    mini = mini_twin(spec, topo.num_devices)
    # At CPU sizes the planner would replicate the twin's A-projections (its router's
    # scores ride in the latent all-gather's latency-bound rounds, so that it splits)...
    planned = plan_sharding(mini, topo, options, kinds=default_registry())
    assert planned.attention["mla"].latent == "replicated"
    # ...so the twin is planned with the full-size build's choices, whose kernel it proves.
    forced = plan_sharding(
        mini, topo, options.model_copy(update={"splits": splits}), kinds=default_registry()
    )
    moe, mla = forced.ffn["moe"], forced.attention["mla"]
    assert moe.router == "split" and mla.latent == "split"
    assert "as in the full-size build" in moe.why and "as in the full-size build" in mla.why
    assert _rel_of(moe)["router"].rank_shape == (256, 1)
    assert _rel_of(mla)["wkv_a"].rank_shape == (256, 3)
    # Its collectives run as the full-size build's: its latent design (at CPU sizes the
    # twin would reduce-scatter the latent), the gathers flat, the all-reduces staged (at
    # CPU sizes the cost model would flatten those too).
    assert planned.ffn["moe"].latent_design == "rs_ar" and moe.latent_design == "ar_ag"
    assert [c.name for c in planned.ffn["moe"].collectives if len(c.rounds) == 1] == [
        "latent_in", "expert_out", "ffn_out"
    ]  # fmt: skip
    rounds = {c.name: [r.round for r in c.rounds] for c in moe.collectives + mla.collectives}
    assert rounds == {
        "latent_in": ["all"], "expert_out": ["host", "hosts"], "ffn_out": ["all"],
        "mla_latent": ["all"], "attn_out": ["host", "hosts"],
    }  # fmt: skip


def test_kimi_k3_vocabulary_split():
    _, plan = _plan("kimi-k3", "2x2x4")
    head = plan.shard_of("lm_head")
    assert head.rank_shape == (7168, 163840 // 32)
    assert plan.shard_of("embedding").rank_shape == (163840 // 32, 7168)
    assert plan.shard_of("layers.0.ffn.w_gate").rank_shape == (7168, 1056)
    assert plan.shard_of("layers.5.attn.wq").rank_shape == (7168, 384)
    assert plan.shard_of("layers.7.attn.wq_b").rank_shape == (1536, 576)
    with pytest.raises(SpecError, match="not in the weight inventory"):
        plan.shard_of("layers.7.attn.nope")


def test_collectives_cross_hosts_on_2x2x4():
    # At its build's 8 rows (at 1 row the copies move an eighth of the bytes and the cost
    # model runs this all-reduce flat, one round of all 32 cores).
    _, plan = _plan("kimi-k3", "2x2x4", rows=8)
    ar = plan.attention["kda"].collectives[-1]
    assert ar.op == "all_reduce" and ar.level == "host"
    # One-shot: the 8 cores of a host (one sibling, six on the host's other chips), then
    # the 4 hosts; each round sends the whole running sum, bf16 (half the f32 payload),
    # to every other member, and costs at least one collective phase.
    assert [(r.round, r.members, r.wire) for r in ar.rounds] == [
        ("host", 8, "bf16"), ("hosts", 4, "bf16")
    ]  # fmt: skip
    wire = ar.payload_bytes // 2
    assert ar.bytes_by_level == {"core": wire, "chip": 6 * wire, "host": 3 * wire}
    assert ar.time_s > 2 * 3.5e-6
    assert 0 < ar.error_bound < 2 * 2.0**-8 * 1.01


# --------------------------------------------------------------------------- Qwen, Muse


def test_qwen_on_2x2x1_gqa_kv_replicated_and_gdn_split():
    _, plan = _plan("qwen3.8-27b", "2x2x1")
    full = plan.attention["full"]
    assert full.heads_per_rank == 3
    # 4 KV heads over 8 cores: each core holds the one KV head its 3 q heads use.
    assert full.kv_heads_per_rank == 1 and full.kv_copies == 2
    t = _rel(plan, "full")
    assert t["wk"].rank_shape == (5120, 256) and t["wk"].copies == 2
    assert t["wgate"].rank_shape == (5120, 768)
    assert full.cache.bytes_per_token == 2 * 256 * 2
    gdn = plan.attention["linear"]
    assert (gdn.heads_per_rank, gdn.kv_heads_per_rank, gdn.kv_copies) == (6, 2, 1.0)
    g = _rel(plan, "linear")
    assert g["wq"].rank_shape == (5120, 256) and g["wv"].rank_shape == (5120, 768)
    assert gdn.cache.fixed_bytes == 6 * 128 * 128 * 4 + 3 * (2 * 256 + 768) * 2
    mlp = _rel(plan, "mlp", "ffn")
    assert mlp["w_gate"].rank_shape == (5120, 2176) and mlp["w_down"].rank_shape == (2176, 5120)


def test_muse_spark_on_2x2x1_matches_the_hand_written_layout():
    _, plan = _plan("muse-spark-1.2", "2x2x1")
    for kind in ("local", "global"):
        a = plan.attention[kind]
        assert (a.heads_per_rank, a.kv_heads_per_rank, a.kv_copies) == (16, 2, 1.0)
    x = plan.ffn["moe"].experts
    assert (x.groups, x.width_parts, x.width_per_rank) == (1, 8, 512)
    t = _rel(plan, "moe", "ffn")
    assert t["experts_gate"].rank_shape == (256, 4096, 512)
    assert t["experts_down"].rank_shape == (256, 512, 4096)
    # Without shared experts the measured kernel's design is cheaper: all-reduce of the
    # latent, output-split post projection, all-gather of hidden.
    assert plan.ffn["moe"].latent_design == "ar_ag"
    assert t["latent_out"].rank_shape == (4096, 1024)


def test_every_tensor_of_the_inventory_has_one_shard():
    for model, topology in (("kimi-k3", "2x2x4"), ("muse-spark-1.2", "2x2x1")):
        spec, plan = _plan(model, topology)
        names = [w.name for w in model_weights(spec)]
        sharded = plan.all_tensors()
        assert [n for n, _ in sharded] == names
        for (name, shard), w in zip(sharded, model_weights(spec), strict=True):
            assert shard.global_shape == w.shape, name
            # A split keeps the global bytes: per-rank elements x ranks / copies = global.
            assert math.prod(shard.rank_shape) * plan.devices == pytest.approx(
                w.numel * shard.copies
            )


@pytest.mark.parametrize(
    ("model", "topology", "options"),
    [
        ("kimi-k3", "2x2x4", {"rows": 8}),
        ("kimi-k3", "2x2x4", {}),
        ("muse-spark-1.2", "2x2x1", {}),
        ("muse-spark-1.2", "2x2x1", {"batch": 8}),
        ("qwen3.8-27b", "2x2x1", {}),
        ("qwen3.8-27b", "1x1x1", {"batch": 4}),
    ],
)
def test_every_spec_plans_on_a_topology_that_fits(model, topology, options):
    plan = plan_build(
        load_spec(model),
        parse_topology(topology),
        BuildOptions.create(**options),
        kinds=default_registry(),
    )
    assert plan.memory.fits
    assert plan.estimate.step_ms > 0
    assert sum(plan.estimate.breakdown_ms.values()) == pytest.approx(plan.estimate.step_ms)


# --------------------------------------------------------------------------- errors


def test_heads_that_cannot_split_are_a_clear_error():
    with pytest.raises(SpecError) as info:
        _plan("qwen3.8-27b", "2x2x4")
    message = str(info.value)
    assert "\n" not in message
    assert "48 value heads do not split over 32 devices" in message
    assert "tpu7x:2x2x1 (8)" in message


def test_a_split_that_breaks_quantization_groups_is_an_error():
    with pytest.raises(SpecError, match=r"1056 per device, not a multiple of the int4:128"):
        _plan("kimi-k3", "2x2x4", quant=["mlp=int4:128"])
    _plan("kimi-k3", "2x2x4", quant=["mlp=int4:32"])  # 1056 = 33 x 32 is fine


def test_expected_max_of_groups():
    assert expected_max([0.0, 1.0], 4) == pytest.approx(1.0)
    assert expected_max([0.5, 0.5], 1) == pytest.approx(0.5)
    assert expected_max([0.5, 0.5], 2) == pytest.approx(0.75)


# --------------------------------------------------------------------------- memory


def _memory(model, topology, **options):
    spec = load_spec(model)
    opts = BuildOptions.create(**options)
    spec = opts.apply(spec)
    topo = parse_topology(topology)
    return spec, topo, opts, plan_fitted(spec, topo, opts, kinds=default_registry())[1]


def test_kimi_k3_fits_only_with_quantized_experts():
    *_, mem = _memory("kimi-k3", "2x2x4", rows=8, expert_sharing="none")
    assert mem.fits
    assert 40e9 < mem.weights_by_family["experts"] < 50e9  # ~1.45 TB of mxfp4 over 32 cores
    *_, shared = _memory("kimi-k3", "2x2x4", rows=8)  # half of each group's experts twice
    assert shared.fits
    assert shared.weights_by_family["experts"] / mem.weights_by_family["experts"] == pytest.approx(
        1.5
    )
    spec, topo, opts, mem = _memory("kimi-k3", "2x2x4", rows=8, quant=["experts=bf16"])
    assert not mem.fits
    with pytest.raises(SpecError) as info:
        check_fit(spec, topo, opts, mem, kinds=default_registry())
    message = str(info.value)
    assert "\n" not in message
    assert "needs 174.4 GB of HBM per device but 94.7 GB are usable: over by 79.7 GB" in message
    assert "--quant experts=mxfp4" in message and "--quant experts=int4:128" in message


def test_no_fit_suggests_a_larger_topology():
    spec, topo, opts, mem = _memory("muse-spark-1.2", "1x1x1")
    with pytest.raises(SpecError, match=r"over by .* topology tpu7x:2x2x1"):
        check_fit(spec, topo, opts, mem, kinds=default_registry())


def test_caches_scale_with_context_batch_and_rows():
    *_, small = _memory("muse-spark-1.2", "2x2x1", context=4096)
    *_, big = _memory("muse-spark-1.2", "2x2x1", context=8192, batch=2)
    # Global layers keep the whole context, sliding layers their 2048-token window.
    per_token = 512  # 2 KV heads x 64 x (K, V) x bf16 per layer per rank
    want = per_token * (16 * 4096 + 46 * 2048)
    assert small.cache_by_kind["kv"] == want
    assert big.cache_by_kind["kv"] == 2 * per_token * (16 * 8192 + 46 * 2048)
    *_, q = _memory("qwen3.8-27b", "2x2x1", rows=4)
    *_, q1 = _memory("qwen3.8-27b", "2x2x1")
    assert q.cache_by_kind["state"] == 4 * q1.cache_by_kind["state"]  # per-row checkpoints


# --------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"batch": 0}, "--batch 0: must be a positive integer"),
        ({"rows": 2, "acceptance": 3.0}, "--acceptance 3: mean tokens accepted"),
        ({"batch": "two"}, "--batch 'two'"),
        ({"quant": ["experts=int5"]}, "--quant experts: unknown weight format 'int5'"),
        ({"quant": ["expert=int4:128"]}, "unknown weight family 'expert'"),
        ({"quant": ["experts"]}, "write FAMILY=FORMAT"),
        ({"vmem_budget_bytes": "lots"}, "--vmem-budget 'lots'"),
        ({"price_per_chip_hour_usd": -1.0}, "--price -1: chip-hour price must be positive"),
    ],
)
def test_bad_options_are_one_line_errors(fields, message):
    with pytest.raises(SpecError) as info:
        BuildOptions.create(**fields)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_option_parsing():
    assert parse_size("58MiB") == 58 * 2**20
    assert parse_size("48 MiB") == 48 * 2**20
    assert parse_size(1000) == 1000
    assert dict(parse_quant_overrides(["dense=int8", "attention=bf16"])) == {
        "attention": "bf16",
        "mlp": "int8",
        "projections": "int8",
        "shared_experts": "int8",
    }
    opts = BuildOptions.create(batch=2, rows=8, acceptance=3, quant=["experts=int4:128"])
    assert opts.tokens == 16
    spec = opts.apply(load_spec("kimi-k3"))
    assert spec.quantization.experts == "int4:128"
    assert BuildOptions.create(vmem_budget_bytes="48MiB").vmem_budget_bytes == 48 * 2**20
