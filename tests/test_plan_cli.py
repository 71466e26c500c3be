"""`mkgen plan` and `mkgen estimate` as a user runs them: output, files, errors, speed."""

from __future__ import annotations

import csv
import itertools
import json
import os
import re
import stat
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from cli_run import assert_user_error, mkgen_here

from mkgen.kinds import default_registry

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def kimi_json() -> dict:
    result = mkgen_here("plan", "kimi-k3", "--topology", "2x2x4", "--rows", "8", "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_plan_json_has_the_issue_keys(kimi_json) -> None:
    data = kimi_json
    assert (data["model"], data["topology"], data["devices"]) == ("kimi-k3", "tpu7x:2x2x4", 32)
    assert (data["batch"], data["rows"], data["context"]) == (1, 8, 4096)
    memory = data["memory"]
    for key in (
        "hbm_bytes_per_device",
        "hbm_usable_bytes_per_device",
        "vmem_bytes",
        "vmem_budget_bytes",
        "vmem_limit_bytes",
    ):
        assert isinstance(memory[key], int), key
    assert set(memory["vmem_by_category"]) >= {"ring", "expert_slots", "collectives"}
    assert isinstance(data["graph"]["nodes"], int) and isinstance(data["graph"]["edges"], int)
    est = data["estimate"]
    for key in ("step_ms", "hbm_floor_ms", "tokens_per_s_per_user", "tokens_per_s"):
        assert isinstance(est[key], float) and est[key] > 0, key
    assert isinstance(est["hbm_bytes_per_device_per_step"], int)
    assert est["tokens_per_dollar"] > 0
    assert sum(est["breakdown_ms"].values()) == pytest.approx(est["step_ms"])


def test_plan_json_states_the_calibrated_regime_the_sensitivity_and_one_floor_ratio(
    kimi_json,
) -> None:
    est = kimi_json["estimate"]
    assert est["point"] == "batch 1 x rows 8"
    assert est["calibrated_step_ms"] > est["step_ms"]  # the build holds refills; none here
    assert {p["what"] for p in est["uncalibrated"]} >= {"cross-host rounds (4 hosts)"}
    assert [s["input"] for s in est["sensitivity"]] == [
        "cross-host round latency (us)", "cross-host link bandwidth (GB/s per core)",
        "core clock (GHz)", "scalar ops a cycle (the expert listing)",
        "DMA issue cost (ns per DMA)",
    ]  # fmt: skip
    for row in est["sensitivity"]:
        assert set(row) == {"input", "low", "high", "step_ms_low", "step_ms_high"}
        assert row["low"] < row["high"] and row["input"] in est["sensitivity_sources"]
    assert "floor_ratio" not in est  # the moved-bytes ratio rewarded padding
    assert est["ideal_floor_ratio"] == pytest.approx(est["ideal_floor_ms"] / est["step_ms"])
    assert "mean error -3.3 %" in est["calibration"]


def test_plan_says_which_point_its_step_is_of() -> None:
    out = mkgen_here(
        "plan", "qwen3-32b", "--topology", "2x2x1", "--batch", "2", "--rows", "4"
    ).stdout
    assert "Estimate: predicted " in out and " ms/step at batch 2 x rows 4 " in out
    assert "Calibrated regime: predicted " in out and "at batch 2 x rows 4 with no refill" in out
    assert "x the ideal floor (floor / step " in out and "HBM floor" not in out


def test_plan_shows_each_collectives_rounds_and_wire_dtype(kimi_json) -> None:
    rounds = kimi_json["collectives"]["rounds"]
    assert [(r["name"], r["size"]) for r in rounds] == [("host", 8), ("hosts", 4), ("all", 32)]
    attn_out = kimi_json["sharding"]["attention"]["kda"]["collectives"][0]
    assert [(r["round"], r["wire"], r["bytes_per_peer"]) for r in attn_out["rounds"]] == [
        ("host", "bf16", 8 * 7168 * 2), ("hosts", "bf16", 8 * 7168 * 2)
    ]  # fmt: skip
    assert 0 < attn_out["error_bound"] < 0.01
    assert kimi_json["graph"]["checks"]["collectives_balanced"]
    text = mkgen_here("plan", "kimi-k3", "--topology", "2x2x4", "--rows", "8")
    assert "collectives: 3 one-shot round(s) [host: groups of 8" in text.stdout
    assert "run as all or host+hosts" in text.stdout
    assert "2 round(s) [host x8 bf16 112.0 KiB/peer; hosts x4 bf16 112.0 KiB/peer]" in text.stdout
    assert "1 round(s) [all x32 f32 8.0 KiB/peer]" in text.stdout  # the MoE's latent gather


def test_kimi_k3_fits_with_every_check_true(kimi_json) -> None:
    memory, graph = kimi_json["memory"], kimi_json["graph"]
    assert memory["hbm_bytes_per_device"] <= memory["hbm_usable_bytes_per_device"]
    assert memory["vmem_bytes"] <= memory["vmem_budget_bytes"]
    assert memory["vmem_total_bytes"] <= memory["vmem_limit_bytes"]
    assert kimi_json["fits"] is True
    assert len(graph["checks"]) >= 6
    assert all(graph["checks"].values()), graph["failures"]


def test_plan_prints_every_section_and_writes_a_trace(tmp_path) -> None:
    trace = tmp_path / "trace.json"
    result = mkgen_here("plan", "qwen3.8-27b", "--topology", "2x2x1", "--trace", str(trace))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for section in (
        "qwen3.8-27b on tpu7x:2x2x1: 8 devices",
        "Sharding over 8 devices",
        "HBM per device",
        "VMEM per core",
        "ring_vmem",
        "schedule:",
        "checks: acyclic ok",
        "Estimate: predicted ",
        " ms/step at batch 1 x rows 1 (the cost model's prediction)",
        "Calibrated regime: predicted ",
        "Sensitivity (the same kernel walked at each end of an unmeasured input):",
        f"wrote {trace}",
    ):
        assert section in out, section
    data = json.loads(trace.read_text())
    tracks = {e["args"]["name"] for e in data["traceEvents"] if e["name"] == "thread_name"}
    assert tracks == {"dma", "core", "ici"}


def test_the_trace_names_layers_and_segments_in_whole_ns_without_overlap(tmp_path) -> None:
    trace = tmp_path / "trace.json"
    result = mkgen_here("plan", "qwen3-30b-a3b", "--topology", "2x2x1", "--trace", str(trace))
    assert result.returncode == 0, result.stderr
    slices = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    names = {e["name"] for e in slices}
    # The schedule's ops, where in the step they run: a segment's banks, an expert piece,
    # the lm_head's banks.
    assert {"L0 gqa.qkv bank 0", "L47 moe: expert 0 gate/up piece 0"} <= names
    assert any(name.startswith("epilogue lm_head.lm_head bank ") for name in names)
    assert {name.split()[0] for name in names} == {"prologue", "epilogue"} | {
        f"L{i}" for i in range(48)
    }
    by_track: dict[int, list[tuple[int, int]]] = {}
    for e in slices:
        start, dur = e["args"]["start_ns"], e["args"]["dur_ns"]
        assert isinstance(start, int) and isinstance(dur, int) and dur >= 0
        assert (e["ts"], e["dur"]) == (start / 1000, dur / 1000)  # the format's microseconds
        by_track.setdefault(e["tid"], []).append((start, start + dur))
    for spans in by_track.values():
        spans.sort()
        assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans)), "overlap"
    # A bank is named by the layer it belongs to, also when the ring fetches it earlier.
    banks: dict[int, set[str]] = {}
    for e in slices:
        if "bank" in e["args"]:
            banks.setdefault(e["args"]["bank"], set()).add(e["name"])
    assert all(len(names) == 1 for names in banks.values())
    first = min(g for g in banks if "L3 " in next(iter(banks[g])))
    weights = [e for e in slices if e["name"] == f"L3 gqa.qkv bank {first}"]
    assert {e["tid"] for e in weights} == {1, 2}  # its DMA and its use on the core
    dma = next(e for e in weights if e["tid"] == 1)
    assert dma["args"]["bytes"] > 0 and dma["args"]["bank"] == first
    assert "attn.wq" in dma["args"]["tensors"]
    experts = [e for e in slices if e["name"].startswith("L3 moe: expert") and e["cat"] == "experts"
               and e["tid"] == 1 and "piece" in e["name"]]  # fmt: skip
    assert {e["args"]["expert"] for e in experts} >= {0, 1}


def test_plan_options_reach_the_plan() -> None:
    result = mkgen_here(
        "plan", "muse-spark-1.2", "--topology", "2x2x1", "--batch", "2", "--context", "8192",
        "--quant", "experts=mxfp4", "--vmem-budget", "40MiB", "--price", "2.5", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert (data["batch"], data["context"]) == (2, 8192)
    assert data["quantization"]["experts"] == "mxfp4"
    assert data["memory"]["vmem_budget_bytes"] == 40 * 2**20
    assert data["memory"]["vmem_bytes"] <= 40 * 2**20
    assert data["estimate"]["price_per_chip_hour_usd"] == 2.5


def test_a_plan_is_the_kernels_plan_so_an_ungenerated_format_is_refused() -> None:
    """The plan describes the kernel mkgen emits: 4-bit dense weights are not generated yet."""
    result = mkgen_here(
        "plan", "muse-spark-1.2", "--topology", "2x2x1", "--quant", "attention=int4:128"
    )
    assert_user_error(result, "int4:128", "not supported by the code generator yet")


def test_estimate_writes_the_table_csv_and_charts_with_the_umask(tmp_path) -> None:
    # Rows 1 and 8 at batches 1, 8 and 32: the plain and speculative points and a point over
    # VMEM (rows 8 at batch 32). Each point is planned and its refills and tiles scored:
    # the default batches (seven) took 62 s of the suite's time, these 16 s alone.
    result = mkgen_here(
        "estimate", "qwen3-32b", "--topology", "2x2x1", "--rows", "1,8", "--acceptance", "3",
        "--batches", "1,8,32", "-o", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "tok/s/user" in result.stdout and "agentic: 3,072 input + 1,024 output" in result.stdout
    name = tmp_path / "qwen3-32b-2x2x1-estimate"
    written = [Path(f"{name}.csv"), Path(f"{name}.svg"), Path(f"{name}.png")]
    assert f"wrote to {tmp_path}/" in result.stdout
    for path in written:
        assert f"  {path}" in result.stdout
    umask = os.umask(0)
    os.umask(umask)
    assert {stat.S_IMODE(p.stat().st_mode) for p in written} == {0o666 & ~umask}
    rows = list(csv.DictReader(written[0].open()))
    assert len(rows) == 3 * 2  # batches x rows
    assert "hbm_floor_ms" not in rows[0] and "floor_ratio" not in rows[0]
    for r in rows:
        if r["step_ms"]:
            assert float(r["ideal_floor_ratio"]) == pytest.approx(
                float(r["ideal_floor_ms"]) / float(r["step_ms"]), rel=1e-4
            )
            assert float(r["calibrated_step_ms"]) >= float(r["step_ms"])
    # One step per build: the sweep's batch-1 rows-1 point is `mkgen plan`'s.
    plan = json.loads(mkgen_here("plan", "qwen3-32b", "--topology", "2x2x1", "--json").stdout)
    assert float(rows[0]["step_ms"]) == pytest.approx(plan["estimate"]["step_ms"], rel=1e-5)
    assert float(rows[0]["calibrated_step_ms"]) == pytest.approx(
        plan["estimate"]["calibrated_step_ms"], rel=1e-5
    )
    assert "each row is the build `mkgen plan qwen3-32b --topology 2x2x1" in result.stdout
    assert {int(r["rows"]) for r in rows} == {1, 8}
    assert {r["scenario"] for r in rows} == {"agentic"}
    assert [int(r["batch"]) for r in rows[:3]] == [1, 8, 32]
    # Prefill makes input tokens cheaper than output ones: more tokens per $ in every priced
    # point; a point whose buffers do not fit VMEM has no program and no step.
    priced = [r for r in rows if r["step_ms"]]
    assert all("VMEM over budget" in r["note"] for r in rows if not r["step_ms"])
    assert len(priced) == len(rows) - 1  # rows 8 at batch 32 does not fit VMEM
    assert all(float(r["total_tokens_per_dollar"]) > float(r["tokens_per_dollar"]) for r in priced)
    svg = written[1].read_text()
    assert ET.fromstring(svg).tag.endswith("svg")
    for text in ("predicted", "$1.21 per chip-hour", "tokens/s per user", "Pareto frontier",
                 "GB300 NVL72 ($2.31/chip-hour)", "Kimi K3 on 16 GB200", "agentic",
                 "Kimi K3 on TPUv7 (InferenceX agentic benchmark,"):  # fmt: skip
        assert text in svg, text
    assert "Muse Spark kernel (" not in svg  # the TPU7x point is Kimi K3's
    assert written[2].read_bytes().startswith(b"\x89PNG")


def test_estimate_sweeps_the_default_batches_unless_told() -> None:
    """`mkgen estimate` without --batches sweeps DEFAULT_BATCHES (the test above names its
    batches to plan fewer points)."""
    from mkgen.cli.planning import estimate_command
    from mkgen.plan.report import DEFAULT_BATCHES

    option = next(p for p in estimate_command.params if p.name == "batches")
    assert tuple(int(b) for b in option.default.split(",")) == DEFAULT_BATCHES


def test_estimate_output_is_deterministic() -> None:
    from mkgen.plan import tco
    from mkgen.plan.options import BuildOptions
    from mkgen.plan.report import sweep, sweep_csv, tco_chart
    from mkgen.spec.loader import load_spec
    from mkgen.spec.topology import parse_topology

    spec, topo = load_spec("qwen3-30b-a3b"), parse_topology("2x2x1")
    options = BuildOptions.create(rows=8, acceptance=3)
    agentic = tco.scenario("agentic")
    first = sweep(
        spec, topo, options, agentic, batches=(1, 8), rows=(1, 8), kinds=default_registry()
    )
    second = sweep(
        spec, topo, options, agentic, batches=(1, 8), rows=(1, 8), kinds=default_registry()
    )
    assert sweep_csv(first) == sweep_csv(second)
    for fmt in ("svg", "png"):
        charts = [
            tco_chart(rows, title="t", notes=["n"], references=tco.REFERENCES, fmt=fmt)
            for rows in (first, second)
        ]
        assert charts[0] == charts[1], fmt
    # Acceptance is capped at each point's rows.
    assert {r.acceptance for r in first if r.rows == 1} == {1.0}
    assert {r.acceptance for r in first if r.rows == 8} == {3.0}


def _row(per_user: float, per_dollar: float, fits: bool = True) -> Any:
    from mkgen.plan.report import SweepRow

    return SweepRow(
        batch=1, rows=1, acceptance=1.0, fits_hbm=fits, fits_vmem=True, hbm_gb_per_device=1.0,
        vmem_mib=1.0, step_ms=1.0, calibrated_step_ms=1.0, ideal_floor_ms=0.5,
        ideal_floor_ratio=0.5, tokens_per_s_per_user=per_user,
        tokens_per_s=per_user, tokens_per_dollar=per_dollar, total_tokens_per_dollar=per_dollar,
        scenario="decode", note="",
    )  # fmt: skip


def test_the_pareto_frontier_keeps_only_undominated_points_that_fit() -> None:
    from mkgen.plan.report import pareto_frontier

    best_fast, best_cheap = _row(400, 2e6), _row(100, 9e6)
    middle = _row(250, 5e6)
    dominated = _row(200, 4e6)  # middle is faster and cheaper
    too_big = _row(500, 8e6, fits=False)
    frontier = pareto_frontier([best_fast, dominated, too_big, best_cheap, middle])
    assert frontier == [best_cheap, middle, best_fast]


def test_decode_scenario_total_is_the_decode_tokens_per_dollar() -> None:
    from mkgen.plan.tco import scenario, total_tokens_per_dollar

    common = dict(active_params=3e9, chips=4, peak_bf16_flops_per_chip=2.3e15)
    decode = total_tokens_per_dollar(
        scenario("decode"), decode_tokens_per_s=1000.0, price_per_chip_hour_usd=1.21, **common
    )
    assert decode == pytest.approx(1000.0 * 3600 / (4 * 1.21))
    agentic = total_tokens_per_dollar(
        scenario("agentic"), decode_tokens_per_s=1000.0, price_per_chip_hour_usd=1.21, **common
    )
    assert agentic > decode  # input tokens cost less slice time than output tokens


def test_reference_points_follow_a_changed_chip_hour_price() -> None:
    from mkgen.plan.tco import REFERENCES, parse_prices, priced

    gb300 = next(curve for curve in REFERENCES if curve.chip == "GB300")
    assert gb300.points == ((25.0, 31e6), (400.0, 2.5e6))
    doubled = priced(gb300, parse_prices(["GB300=4.62"]))
    assert doubled.points == ((25.0, 15.5e6), (400.0, 1.25e6))
    assert doubled.describe() == "Kimi K3 on GB300 NVL72 ($4.62/chip-hour)"


# --------------------------------------------------------------------------- errors


def test_a_spec_that_does_not_fit_is_one_line() -> None:
    result = mkgen_here("plan", "kimi-k3", "--topology", "2x2x4", "--quant", "experts=bf16")
    assert_user_error(result, "kimi-k3 on tpu7x:2x2x4 needs", "GB of HBM per device", "over by")


def test_heads_that_cannot_split_are_one_line() -> None:
    result = mkgen_here("plan", "qwen3.8-27b", "--topology", "2x2x4")
    assert_user_error(result, "48 value heads do not split over 32 devices")


def test_a_vmem_budget_too_small_for_one_bank_is_one_line() -> None:
    result = mkgen_here("plan", "qwen3-32b", "--topology", "2x2x1", "--vmem-budget", "5MiB")
    assert_user_error(result, "--vmem-budget 5.0 MiB is too small for one 2.0 MiB weight bank")


def test_more_held_refills_than_the_ring_allows_is_one_line() -> None:
    result = mkgen_here(
        "plan", "qwen3-30b-a3b", "--topology", "2x2x1", "--ring-depth", "4", "--held-refills", "3"
    )
    assert_user_error(result, "--held-refills 3: a ring of 4 banks holds at most 2", "--ring-depth")
    result = mkgen_here("plan", "qwen3-30b-a3b", "--topology", "2x2x1", "--held-refills", "-1")
    assert_user_error(result, "--held-refills -1: must be 0 to 14")


def test_a_bad_collectives_mode_and_flat_rounds_over_the_vmem_budget_are_one_line() -> None:
    result = mkgen_here("plan", "kimi-k3", "--topology", "2x2x4", "--collectives", "ring")
    assert_user_error(result, "--collectives ring: must be one of auto, staged, flat")
    # Flat rounds land a slot per core: where that does not fit, the refusal names the way out.
    result = mkgen_here(
        "plan", "kimi-k3", "--topology", "2x2x4", "--rows", "8", "--collectives", "flat",
        "--vmem-budget", "12MiB",
    )  # fmt: skip
    assert_user_error(result, "VMEM:", "or run --collectives staged")


def test_a_plan_over_the_vmem_budget_is_one_line() -> None:
    result = mkgen_here("plan", "kimi-k3", "--topology", "2x2x4", "--rows", "8", "--batch", "24")
    assert_user_error(result, "VMEM:", "MiB it may use", "collective0_vmem")


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("--rows", "0"), "--rows 0: must be a positive integer"),
        (("--batch", "-1"), "--batch -1: must be a positive integer"),
        (("--vmem-budget", "lots"), "--vmem-budget 'lots'"),
        (("--acceptance", "3"), "--acceptance 3"),
        (("--quant", "experts=fp5"), "unknown weight format"),
        (("--price", "0"), "--price 0"),
        (("--rows", "many"), "'many' is not a valid integer"),
        (("--price", "nan"), "--price nan: chip-hour price must be positive and finite"),
        (("--price", "inf"), "--price inf: chip-hour price must be positive and finite"),
        (("--price", "-2"), "--price -2: chip-hour price must be positive"),
        (("--context", "4097"), "--context 4097 must be a multiple of the 128-token KV tile"),
        (("--context", str(2**25)), f"--context {2**25}: must be a positive integer, at most"),
        (("--rows", "100000"), "--rows 100000: must be a positive integer, at most 512"),
        (("--batch", "9" * 40), "--batch 9999"),
        (("--batch", "64", "--rows", "16"), "1024 token rows per step, over the 512"),
        (("--vmem-budget", "9" * 400 + "GiB"), "more than the 128 MiB of VMEM of any chip"),
        (
            ("--quant", "experts=mxfp4", "--quant", "experts=int4:128"),
            "--quant experts=int4:128: experts is given twice (also experts=mxfp4)",
        ),
        (("--topology", "2x2x" + "9" * 5000), "a dimension of 5000 digits exceeds"),
    ],
    ids=lambda value: " ".join(value)[:40] if isinstance(value, tuple) else None,
)
def test_bad_option_values_are_one_line(args, fragment) -> None:
    result = mkgen_here("plan", "qwen3-32b", "--topology", "2x2x1", *args)
    assert_user_error(result, fragment)


def test_mosaic_scratch_over_the_vmem_limit_is_said_without_a_negative_budget(tmp_path) -> None:
    # 512 token rows of a 32768-wide residual: Mosaic's scratch alone is 204 MiB (two
    # values and the normed rows, plus a bf16 piece of its all-reduce, scattered over the
    # host at this many rows, packed and unpacked).
    spec = tmp_path / "wide.yaml"
    spec.write_text(
        "name: wide\n"
        "dims: {hidden: 32768, vocab: 1024, norm_eps: 1.0e-06}\n"
        "attention_kinds: {full: {type: gqa, num_heads: 8, num_kv_heads: 8, head_dim: 128}}\n"
        "ffn_kinds: {mlp: {type: dense, width: 4096, activation: silu}}\n"
        "layers: {count: 2, attention: {default: full}, ffn: {default: mlp}}\n"
    )
    result = mkgen_here("plan", str(spec), "--topology", "2x2x1", "--rows", "512")
    assert_user_error(result, "Mosaic's own scratch for 512 token rows (estimated 204.0 MiB)")
    assert not re.search(r"\s-[0-9]", result.stderr)  # no negative budget


@pytest.mark.parametrize(
    ("command", "args", "fragment"),
    [
        ("estimate", ("--batches", "1,100000"), "--batches 1,100000 x --rows 1"),
        ("estimate", ("--price", "nan"), "--price nan"),
        ("verify", ("--steps", "200"), "--steps 200: each step writes --rows 1 token(s)"),
        ("verify", ("--timeout", "nan"), "--timeout nan: give a finite number of seconds"),
        ("verify", ("--seed", "-1"), "'--seed': -1 is not in the range"),
        ("build", ("--context", "4097"), "--context 4097 must be a multiple"),
        ("compile", ("--quant", "dense=int8", "--quant", "dense=fp8:128"), "dense is given twice"),
    ],
)
def test_bad_options_of_other_commands_are_one_line(command, args, fragment) -> None:
    result = mkgen_here(command, "qwen3-32b", "--topology", "2x2x1", *args)
    assert_user_error(result, fragment)


def test_plan_and_build_apply_one_context_rule() -> None:
    plan = mkgen_here("plan", "qwen3-32b", "--topology", "2x2x1", "--context", "4097")
    build = mkgen_here("build", "qwen3-32b", "--topology", "2x2x1", "--context", "4097")
    assert_user_error(plan, "--context 4097")
    assert plan.stderr == build.stderr


def test_estimate_rows_above_one_need_an_acceptance() -> None:
    result = mkgen_here("estimate", "qwen3-32b", "--topology", "2x2x1", "--rows", "1,4")
    assert_user_error(result, "--rows 1,4", "--acceptance")


@pytest.mark.parametrize(
    "args, fragment",
    [
        (("2x2x1", "--reference-price", "H100=2"), "unknown chip 'H100'"),
        (("2x2x1", "--reference-price", "GB300=free"), "positive price"),
        *(
            (
                ("2x2x1", "--reference-price", f"GB300={usd}"),
                f"--reference-price 'GB300={usd}': chip-hour price must be positive and finite, at "
                "most 1000 USD",
            )
            for usd in ("nan", "inf", "-1", "1e308")
        ),
        (
            ("2x2x1", "--price", "1e308"),
            "--price 1e+308: chip-hour price must be positive and finite, at most 1000 USD",
        ),
        (("2x2x1", "--scenario", "batch"), "--scenario 'batch'"),
        (("2x2x1", "--scenario", "agentic", "--context", "2048"), "pass --context"),
        (
            ("2x2x1", "--scenario", "decode", "--context", "1"),
            "--context 1: --scenario decode: 0 "
            "input + 1 output tokens needs a context of 2 (its prompt, at least one token, and its "
            "output); pass --context to raise it",
        ),
        (("v6e:2x4",), "pass --price USD"),
    ],
)
def test_estimate_bad_pricing_inputs_are_one_line(args, fragment) -> None:
    topology, *rest = args
    assert_user_error(mkgen_here("estimate", "qwen3-32b", "--topology", topology, *rest), fragment)


def test_estimate_bad_batches_is_one_line() -> None:
    result = mkgen_here("estimate", "qwen3-32b", "--topology", "2x2x1", "--batches", "1,x")
    assert_user_error(result, "--batches '1,x'")


# --------------------------------------------------------------------------- speed


def test_planning_kimi_k3_from_the_command_line() -> None:
    # The 3 s target is measured by `make bench`; wall times in tests are too noisy here.
    result = mkgen_here("plan", "kimi-k3", "--topology", "2x2x4")
    assert result.returncode == 0, result.stderr
    assert "checks: acyclic ok" in result.stdout
