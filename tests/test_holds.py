"""The refills a build holds for its collectives: scored by the cost model, or read from the
tuned table checked in beside mkgen/plan/holds.py."""

from __future__ import annotations

import json
from functools import cache

import pytest

from mkgen.hardware import CATALOG, US, get_chip
from mkgen.kinds import default_registry
from mkgen.plan import (
    BuildOptions,
    build_digest,
    plan_build,
    plan_program,
    score_held_refills,
)
from mkgen.plan import holds as holds_module
from mkgen.plan.holds import TABLE, HoldChoice, hold_digest
from mkgen.plan.timeline import estimate, price_program
from mkgen.plan.tuning import build_spec
from mkgen.spec.loader import load_spec
from mkgen.spec.topology import parse_topology

ENTRIES = json.loads(TABLE.read_text())["entries"]


@cache
def _scored(spec: str, topology: str, fields: str, draft: str | None = None) -> tuple:
    """score_held_refills of a build (fields as JSON; drafting with `draft` if named), once
    per test session."""
    return score_held_refills(
        build_spec(spec, draft),
        parse_topology(topology),
        BuildOptions.create(**json.loads(fields)),
        default_registry(),
    )


def _entry_key(entry: dict) -> tuple[str, str, str, str | None]:
    options = json.dumps(entry["options"], sort_keys=True)
    return entry["spec"], entry["topology"], options, entry.get("draft")


def test_every_tuned_entry_is_what_the_scorer_chooses() -> None:
    """The table is a cache of the scorer's answers: an entry whose build now has another
    digest (a constant changed) or another choice (the schedule or the walk changed) fails
    here; `python scripts/tune_holds.py` rewrites the table."""
    assert len(ENTRIES) >= 6
    for entry in ENTRIES:
        digest, choice, _ = _scored(*_entry_key(entry))
        assert digest == entry["digest"], f"{entry['spec']} {entry['options']}: stale digest"
        assert choice == (entry["held_refills"], entry["refills_per_round"]), entry


def test_every_checked_in_build_has_a_tuned_entry() -> None:
    from mkgen.codegen.build_list import entry_inputs, read_build_list

    known = {e["digest"] for e in ENTRIES}
    for line in read_build_list():
        assert build_digest(*entry_inputs(line), default_registry()) in known, line.line


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: " ".join(map(str, _entry_key(e))))
def test_every_tuned_build_is_planned_without_scoring(monkeypatch, entry) -> None:
    """Each tuned build (the checked-in ones, `make build`'s that drafts in its kernel, the
    benchmarked plans) finds its held refills and KV tiles in the tables as plan_build
    looks them up: a table keyed by another program than the one the build plans (the
    fused drafter's passes left out, as its entry once was) is scored on every plan and
    fails here."""

    def refuse(*_args, **_kwargs):
        raise AssertionError("scored a build the table knows")

    monkeypatch.setattr("mkgen.plan.program.score_holds", refuse)
    monkeypatch.setattr("mkgen.plan.kvtiles._score", refuse)
    monkeypatch.setattr(holds_module, "_SCORED", {})
    monkeypatch.setattr("mkgen.plan.kvtiles._CHOSEN", {})
    plan = plan_build(
        build_spec(entry["spec"], entry.get("draft")),
        parse_topology(entry["topology"]),
        BuildOptions.create(**entry["options"]),
        kinds=default_registry(),
    )
    assert (plan.stream.held_refills, plan.stream.refills_per_round) == (
        entry["held_refills"], entry["refills_per_round"]
    )  # fmt: skip


def test_an_unknown_build_is_scored_once_a_process(monkeypatch) -> None:
    calls = []
    real = holds_module.score_holds

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr("mkgen.plan.program.score_holds", counting)
    monkeypatch.setattr(holds_module, "_SCORED", {})
    spec, topo = load_spec("qwen3-30b-a3b"), parse_topology("2x2x1")
    options = BuildOptions.create(batch=2)  # not in the table
    first = plan_program(spec, topo, options, kinds=default_registry())
    again = plan_program(
        spec, topo, options.model_copy(update={"acceptance": 1.0}), kinds=default_registry()
    )
    assert len(calls) == 1
    assert first.stream.held_refills == again.stream.held_refills


def test_the_digest_follows_the_cost_models_constants_not_the_price(monkeypatch) -> None:
    """A table entry answers only for the constants it was scored with: the catalog's in- or
    cross-host phase latency enters the digest, the price does not."""
    spec, topo = load_spec("qwen3-32b"), parse_topology("2x2x1")
    shape = {"bank_rows": 4096, "ring_depth": 16}
    base = hold_digest(spec, topo, BuildOptions.create(), shape)
    priced = BuildOptions.create(price_per_chip_hour_usd=9.0)
    assert hold_digest(spec, topo, priced, shape) == base
    chip = get_chip("tpu7x")
    for field in ("collective_phase_latency", "cross_host_phase_latency"):
        latency = getattr(chip, field).model_copy(update={"cost_model": 4.0 * US})
        monkeypatch.setitem(CATALOG, "tpu7x", chip.model_copy(update={field: latency}))
        assert hold_digest(spec, topo, BuildOptions.create(), shape) != base, field
    monkeypatch.setitem(CATALOG, "tpu7x", chip)
    assert hold_digest(spec, topo, BuildOptions.create(), shape) == base


def test_the_planner_scores_held_refills_and_keeps_the_fastest() -> None:
    """Holding refills pays where collectives are waited on: the walk prices what the ring
    streams under their flight."""
    _, choice, scores = _scored("qwen3-30b-a3b", "2x2x1", "{}")
    fastest = min(scores, key=lambda r: min(scores[r].values()))
    assert choice.per_round == fastest
    by_held = scores[fastest]
    assert 0 in by_held and len(by_held) > 1
    assert choice.held == min(by_held, key=by_held.__getitem__)
    assert min(by_held.values()) < by_held[0]
    plan = plan_build(
        load_spec("qwen3-30b-a3b"),
        parse_topology("2x2x1"),
        BuildOptions.create(),
        kinds=default_registry(),
    )
    assert plan.estimate.step_ms == pytest.approx(min(by_held.values()))


def test_a_round_starts_the_held_refills_its_flight_covers_or_all_of_them() -> None:
    """Rounds that start the 2 MiB banks the DMA engine streams in the catalog's 3.5 us phase
    (about 0.7 us each: 5) against rounds that start every held refill: Kimi K3's two-round
    collectives take the first, Qwen3.8-27B's one-round ones the second."""
    for spec, topology, fields, per_round in (
        ("kimi-k3", "2x2x4", '{"rows": 8}', 5),
        ("qwen3.8-27b", "2x2x1", '{"rows": 8}', 14),
    ):
        _, choice, scores = _scored(spec, topology, fields)
        assert set(scores) == {5, 14}  # ring depth 16: at most 14 held
        assert choice.per_round == per_round
        assert min(scores[per_round].values()) == min(min(s.values()) for s in scores.values())
    assert _scored("kimi-k3", "2x2x4", '{"rows": 8}')[1].held > 5


def test_held_variants_differ_only_in_when_banks_start() -> None:
    """The scorer walks every variant with the unheld program's pricing: the nodes are the
    same, so its walk equals the variant's own."""
    from mkgen.plan import with_held_refills

    spec, topo, options = load_spec("qwen3-32b"), parse_topology("2x2x1"), BuildOptions.create()
    base = plan_program(spec, topo, options, held_refills=0, kinds=default_registry())
    variant = with_held_refills(base, options, HoldChoice(10, 14))
    fields = ("id", "cat", "name", "key", "repeat", "count", "nbytes", "layer")
    assert [tuple(getattr(n, f) for f in fields) for n in base.schedule.nodes] == [
        tuple(getattr(n, f) for f in fields) for n in variant.schedule.nodes
    ]
    assert variant.schedule.events != base.schedule.events
    shared = estimate(topo, options, variant, priced=price_program(base))
    assert shared == estimate(topo, options, variant)
    assert variant.unheld is base
