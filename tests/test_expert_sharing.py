"""Expert sharing between paired groups (docs/planner.md#expert-sharing): the cost model's
pair distribution, the planner's choice, and the kernel against the reference."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from mkgen.errors import SpecError
from mkgen.kinds import default_registry
from mkgen.plan import plan_build, plan_sharding
from mkgen.plan.memory import plan_fitted
from mkgen.plan.options import BuildOptions
from mkgen.plan.sharding import _pmf_binomial, expected_max, pair_max_pmf
from mkgen.spec.loader import load_spec
from mkgen.spec.mini import mini_twin
from mkgen.spec.topology import parse_topology
from mkgen.verify.numerics import verify_numerics

SPECS = Path(__file__).parent / "specs"
KIMI_P = 1 - (1 - 16 / 896) ** 8  # Kimi K3 at 8 token rows: an expert's chance to be active


def _kimi_pair(shared: int) -> float:
    """E[slices of the worst core] over Kimi K3's 4 pairs of 112-expert groups."""
    pmf = pair_max_pmf(_pmf_binomial(112 - shared, KIMI_P), _pmf_binomial(2 * shared, KIMI_P))
    return expected_max(pmf, 4)


@pytest.mark.parametrize("shared", [0, 1, 28, 56, 112])
def test_the_pair_distribution_sums_to_one(shared: int) -> None:
    pmf = pair_max_pmf(_pmf_binomial(112 - shared, KIMI_P), _pmf_binomial(2 * shared, KIMI_P))
    assert len(pmf) == 113  # a pair's worst core reads at most its 112 held slices' worth
    assert math.isclose(sum(pmf), 1.0, abs_tol=1e-12)
    assert min(pmf) >= 0


def test_no_sharing_is_the_unshared_worst_group() -> None:
    """s = 0: the max over 4 pairs of the max of 2 groups is the max over 8 groups."""
    unshared = expected_max(_pmf_binomial(112, KIMI_P), 8)
    assert math.isclose(_kimi_pair(0), unshared, rel_tol=1e-12)
    assert round(unshared, 2) == 20.32


def test_kimi_figures() -> None:
    assert (round(_kimi_pair(56), 2), round(_kimi_pair(112), 2)) == (17.94, 17.94)
    assert round(_kimi_pair(28), 2) == 18.07


def test_a_shared_count_is_exact_on_a_small_case() -> None:
    """Two groups of 2 experts, one shared each, every expert active with probability 1/2:
    the worst core's slices enumerated over the 16 outcomes."""
    counts: dict[int, float] = {}
    for bits in range(16):
        n_a, n_b = bits & 1, bits >> 1 & 1  # the private experts
        n_s = (bits >> 2 & 1) + (bits >> 3 & 1)  # the shared ones
        worst = max(n_a, n_b, -(-(n_a + n_b + n_s) // 2))
        counts[worst] = counts.get(worst, 0.0) + 1 / 16
    pmf = pair_max_pmf(_pmf_binomial(1, 0.5), _pmf_binomial(2, 0.5))
    assert pmf == pytest.approx([counts.get(m, 0.0) for m in range(3)], abs=1e-15)


KIMI = ("kimi-k3", "2x2x4", 8)


def _kimi_split(sharing: str):
    spec, topo = load_spec(KIMI[0]), parse_topology(KIMI[1])
    options = BuildOptions.create(rows=KIMI[2], expert_sharing=sharing)
    sharding, memory = plan_fitted(spec, topo, options, kinds=default_registry())
    return sharding.ffn["moe"].experts, memory


def test_kimi_shares_half_under_auto() -> None:
    """Half and full read the fewest whole slices (18 against 21 unshared); full does not
    fit HBM, so auto takes half; its HBM grows by the partner's 56 experts a layer."""
    split, memory = _kimi_split("auto")
    assert (split.sharing, split.partner_experts, split.held_per_rank) == ("half", 56, 168)
    assert split.group_pairs == ((0, 1), (2, 3), (4, 5), (6, 7))
    by_name = {c.sharing: c for c in split.sharing_candidates}
    assert not by_name["full"].fits and by_name["half"].fits and by_name["half"].chosen
    assert math.ceil(split.expected_max_experts_per_rank) == 18
    none, _ = _kimi_split("none")
    layers = sum(1 for _, f in load_spec("kimi-k3").layer_table() if f == "moe")
    grown = (
        memory.weights_by_family["experts"] - _kimi_split("none")[1].weights_by_family["experts"]
    )
    assert grown == 56 * none.slice_bytes * layers
    assert round(grown / 1e9, 1) == 22.6


def test_none_is_todays_split() -> None:
    split, _ = _kimi_split("none")
    assert (split.sharing, split.partner_experts, split.group_pairs) == ("none", 0, ())
    assert split.expected_max_experts_per_rank == expected_max(_pmf_binomial(112, KIMI_P), 8)


def test_none_is_todays_plan_and_auto_is_faster() -> None:
    """--expert-sharing none plans the unshared kernel (no partner experts, 21 slices a
    layer); auto's calibrated regime is that plan's (no sharing, no refill held)."""
    spec, topo = load_spec(KIMI[0]), parse_topology(KIMI[1])
    plans = {
        mode: plan_build(spec, topo, BuildOptions.create(rows=KIMI[2], expert_sharing=mode),
                         kinds=default_registry())
        for mode in ("none", "auto")
    }  # fmt: skip
    moe = {m: next(f for f in p.kernel.ffn if f.routed_experts) for m, p in plans.items()}
    assert (moe["none"].partner_experts, moe["none"].held_per_rank) == (0, 112)
    assert (moe["auto"].partner_experts, moe["auto"].held_per_rank) == (56, 168)
    none, auto = plans["none"], plans["auto"]
    assert none.estimate is not None and auto.estimate is not None
    assert auto.estimate.step_ms < none.estimate.step_ms
    assert none.confidence is not None and auto.confidence is not None
    assert auto.confidence.calibrated_step_ms == pytest.approx(none.confidence.calibrated_step_ms)


def test_a_forced_sharing_that_does_not_fit_or_pair_is_one_line() -> None:
    with pytest.raises(SpecError, match=r"^--expert-sharing full: .* GB are left; use a smaller"):
        _kimi_split("full")
    mixtral = load_spec("mixtral-8x7b")  # one group of 8 experts on 2x2x1
    options = BuildOptions.create(expert_sharing="half")
    with pytest.raises(
        SpecError, match=r"^--expert-sharing half: .* 1 group\(s\), which do not pair"
    ):
        plan_sharding(mixtral, parse_topology("2x2x1"), options, kinds=default_registry())
    with pytest.raises(SpecError, match="--expert-sharing sometimes: must be one of"):
        BuildOptions.create(expert_sharing="sometimes")


def test_the_calibrated_regime_leaves_the_sharing_out() -> None:
    """The sharing's gain is an uncalibrated part: the calibrated step walks the same build
    with no refill held and no sharing."""
    twin = mini_twin(load_spec(str(SPECS / "latent-moe.yaml")), 2)
    topo = parse_topology("1x1x1")
    shared = plan_build(twin, topo, BuildOptions.create(rows=4, expert_sharing="half"),
                        kinds=default_registry())  # fmt: skip
    unshared = plan_build(twin, topo, BuildOptions.create(rows=4, expert_sharing="none"),
                          kinds=default_registry())  # fmt: skip
    conf = shared.confidence
    assert conf is not None and unshared.confidence is not None
    parts = {p.what.split(" (")[0]: p.ms for p in conf.uncalibrated}
    assert "expert sharing half" in parts
    assert conf.calibrated_step_ms == pytest.approx(unshared.confidence.calibrated_step_ms)


# The mini twin of latent-moe on one chip (2 cores): 8 experts in 2 groups of 4, top-2;
# 8 token rows choose 16 experts, so both cores of the pair run shared ones. Each sharing
# and each DMA mode runs once: the other two pairings pass too, run by hand with `mkgen
# verify tests/specs/latent-moe.yaml --topology 1x1x1 --rows 8 --steps 1 --mode M
# --expert-sharing S`.
@pytest.mark.parametrize(("mode", "sharing"), [("on_wait", "half"), ("eager", "full")])
def test_shared_experts_match_the_reference(mode: str, sharing: str) -> None:
    report = verify_numerics(
        str(SPECS / "latent-moe.yaml"), "1x1x1", mode=mode, steps=1, rows=8,
        knobs={"expert_sharing": sharing}, timeout=600,
    )  # fmt: skip
    assert report.passed, report.failure()
