"""The KV tile of each cache attention kind (mkgen/plan/kvtiles.py): chosen by the cost
model among the candidates within the context and the VMEM budget, recorded in the plan,
and the kernel verified in interpret mode at a tile above 128."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from cli_run import assert_user_error, mkgen_here

from mkgen.errors import SpecError
from mkgen.kinds import default_registry
from mkgen.plan import estimate, plan_build, plan_program, tile_digest
from mkgen.plan.fused import planned_model
from mkgen.plan.kvtiles import TABLE, KvTileChoice, choose_program, rescoring
from mkgen.plan.options import BuildOptions, kv_tile_candidates
from mkgen.plan.tuning import build_spec
from mkgen.spec.loader import load_spec
from mkgen.spec.topology import parse_topology
from mkgen.verify.numerics import verify_numerics

GPT_OSS = str(Path(__file__).parent / "fixtures" / "hf" / "gpt_oss" / "config.json")
_DIGESTS = itertools.count()


def test_kv_tile_candidates_never_exceed_the_context_and_divide_it() -> None:
    assert kv_tile_candidates(64) == [64]
    assert kv_tile_candidates(384) == [128]
    assert kv_tile_candidates(512) == [128, 256, 512]
    assert kv_tile_candidates(4096) == [128, 256, 512, 1024]


class _Vmem(NamedTuple):
    within_budget: bool = True


class _Program(NamedTuple):
    tiles: dict[str, int]
    vmem: _Vmem = _Vmem()
    kv_tiles: Any = None


def _choose(step: Any, refused: tuple[tuple[int, int], ...] = ()) -> Any:
    """choose_program over two kinds "a" and "b" at context 4096, `step(a, b)` the
    predicted step of each pair of tiles, the pairs in `refused` refused by the planner."""

    def program_at(tiles: dict[str, int]) -> _Program:
        if (tiles["a"], tiles["b"]) in refused:
            raise SpecError(f"VMEM: tiles {tiles} over the budget")
        return _Program(dict(tiles))

    # A fresh digest a call: the choice is not one remembered from another test.
    return choose_program(
        program_at, ["a", "b"], 4096, lambda p: step(p.tiles["a"], p.tiles["b"]),
        f"test {next(_DIGESTS)}",
    )  # fmt: skip


def test_each_kind_takes_its_fastest_tile_with_the_kinds_before_it_at_their_choice() -> None:
    best = {"a": 512, "b": 256}
    program = _choose(lambda a, b: abs(a - best["a"]) + abs(b - best["b"]) / 2)
    choice = program.kv_tiles
    assert choice.tiles == program.tiles == best
    # "b" is scored with "a" at its chosen 512, "a" with "b" at the context rule's 128.
    assert choice.scores["a"] == {128: 384 + 64, 256: 256 + 64, 512: 64, 1024: 512 + 64}
    assert choice.scores["b"] == {128: 64, 256: 0, 512: 128, 1024: 384}
    assert choice.refused == {"a": {}, "b": {}}


def test_a_bigger_tile_that_predicts_no_gain_is_not_taken() -> None:
    assert _choose(lambda a, b: 1.0).tiles == {"a": 128, "b": 128}


def test_a_refused_tile_is_out_and_its_reason_recorded() -> None:
    program = _choose(lambda a, b: -a - b, refused=((1024, 128),))
    assert program.tiles == {"a": 512, "b": 1024}
    assert "over the budget" in program.kv_tiles.refused["a"][1024]
    assert 1024 not in program.kv_tiles.scores["a"]


def test_the_context_rules_tiles_refused_is_the_builds_own_error() -> None:
    with pytest.raises(SpecError, match="over the budget"):
        _choose(lambda a, b: 1.0, refused=((128, 128),))


def test_the_planners_scores_are_the_unheld_steps_of_the_programs_at_those_tiles() -> None:
    """qwen3-30b-a3b at batch 8: each candidate's score is the predicted step of the
    program forced to that tile with no refill held, the kernel layout takes the fastest."""
    spec, topo = load_spec("qwen3-30b-a3b"), parse_topology("2x2x1")
    options = BuildOptions.create(batch=8)
    plan = plan_build(spec, topo, options, kinds=default_registry())
    scores = plan.kv_tiles.scores["gqa"]
    assert list(scores) == [128, 256, 512, 1024]
    for tile, step_ms in scores.items():
        forced = plan_program(
            spec, topo, options, kv_tile_tokens=tile, held_refills=0, kinds=default_registry()
        )
        assert estimate(topo, options, forced).step_ms == pytest.approx(step_ms, rel=1e-9)
    fastest = min(scores, key=scores.__getitem__)
    assert plan.kv_tiles.tiles == plan.vmem.dims.kv_tiles == {"gqa": fastest}
    assert plan.kernel.attention[0].kv_tile == fastest
    assert scores[fastest] < scores[128]  # the model predicts a gain over 128 here


def test_a_tile_the_vmem_budget_cannot_hold_is_refused_and_the_next_fastest_taken() -> None:
    """At an 8 MiB budget the 1024-token tiles of qwen3-30b-a3b at batch 8 leave too little
    for two ring banks and an expert slot: 512 is taken."""
    options = BuildOptions.create(batch=8, vmem_budget_bytes=8 * 2**20)
    plan = plan_build(
        load_spec("qwen3-30b-a3b"), parse_topology("2x2x1"), options, kinds=default_registry()
    )
    assert "VMEM" in plan.kv_tiles.refused["gqa"][1024]
    assert plan.kv_tiles.tiles == {"gqa": 512}
    assert plan.vmem.within_budget


def test_every_tuned_kv_tile_entry_is_what_the_scorer_chooses() -> None:
    """kvtiles.json is a cache of the scorer's answers (as holds.json is of the held
    refills'): a stale digest or choice fails here; `python scripts/tune_holds.py`
    rewrites it."""
    entries = json.loads(TABLE.read_text())["entries"]
    assert len(entries) >= 6
    for entry in entries:
        spec = build_spec(entry["spec"], entry.get("draft"))
        topo, options = parse_topology(entry["topology"]), BuildOptions.create(**entry["options"])
        assert tile_digest(spec, topo, options, default_registry()) == entry["digest"], entry[
            "spec"
        ]
        planned, passes = planned_model(spec, options.fuse_draft, options.rows)
        with rescoring():  # held refills forced: only the tiles are scored
            program = plan_program(
                planned, topo, options, held_refills=0, kinds=default_registry(), passes=passes
            )
        assert program.kv_tiles == KvTileChoice.model_validate(entry["choice"]), entry["spec"]


def test_a_forced_kv_tile_is_planned_as_given_with_no_scores() -> None:
    options = BuildOptions.create(kv_tile=256)
    plan = plan_build(
        load_spec("qwen3-30b-a3b"), parse_topology("2x2x1"), options, kinds=default_registry()
    )
    assert plan.kv_tiles is None
    assert plan.vmem.dims.kv_tiles == {"gqa": 256}
    assert plan.to_dict()["kv_tiles"]["tiles"] == {"gqa": 256}


def test_a_kv_tile_outside_the_candidates_is_a_one_line_error_naming_the_flag() -> None:
    result = mkgen_here("plan", "qwen3-30b-a3b", "--topology", "2x2x1", "--kv-tile", "384")
    assert_user_error(result, "--kv-tile 384", "128, 256, 512, 1024")
    result = mkgen_here("plan", "qwen3-30b-a3b", "--topology", "2x2x1", "--context", "256",
                   "--kv-tile", "512")  # fmt: skip
    assert_user_error(result, "--kv-tile 512", "one of 128, 256")


def test_a_mini_twin_at_512_token_tiles_matches_the_reference() -> None:
    """gpt-oss's twin (sliding-window layers with sinks, full layers) on one chip, its
    caches of 512 tokens in one tile: 2 steps of 8 rows reach position 15, past the
    twin's 8-token window, in a tile whose rows past the step's end are masked out."""
    report = verify_numerics(
        GPT_OSS, "1x1x1", mode="eager", steps=2, rows=8, context=512, knobs={"kv_tile": 512},
        timeout=900,
    )  # fmt: skip
    assert report.passed, report.failure()
