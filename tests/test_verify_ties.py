"""verify tells a routing near tie from a bug (mkgen/verify/numerics.py, resolve_routes).

The kernel routes on bf16 activations, the reference in f32: where a token's k-th and
(k+1)-th router choice values are closer than the error that makes, either side may win.
verify compares every MoE layer's experts: a difference inside the tie window is
reported and the reference takes the kernel's experts (both sides go on from the same
choice); any other difference fails, naming layer, token and experts.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import mkgen
from mkgen.verify.numerics import (
    ROUTE_RTOL,
    NumericsReport,
    StepCheck,
    resolve_routes,
    verify_numerics,
)

TIMEOUT = 600
FIXTURES = Path(__file__).parent / "fixtures"
PUBLISHED = FIXTURES / "published"

# Layer 6 of the Qwen3-Next twin, seed 0, step 0 (the reference's softmax scores): expert
# 0 scores 0.18842 and expert 3 0.18737, 0.3 % of the token's largest (expert 4) apart.
NEAR_TIE = np.array([[0.18842, 0.0412, 0.0301, 0.18737, 0.3556, 0.0903, 0.0520, 0.0551]])


def test_a_near_tie_is_reported_and_the_reference_takes_the_kernels_experts() -> None:
    used, differences = resolve_routes(6, NEAR_TIE, np.array([[4, 0]]), np.array([[3, 4]]))
    assert used.tolist() == [[3, 4]]
    [tie] = differences
    assert tie.near_tie and (tie.layer, tie.token, tie.kernel, tie.reference) == (
        6,
        0,
        (3, 4),
        (0, 4),
    )
    assert tie.gap == pytest.approx((0.18842 - 0.18737) / 0.3556)
    assert tie.describe().startswith(
        "layer 6 token 0: near tie, the kernel chose experts [3, 4] for the reference's [0, 4]"
    )


def test_a_routing_difference_outside_the_window_fails_naming_layer_token_and_experts() -> None:
    choice = np.concatenate([NEAR_TIE, NEAR_TIE])
    reference = np.array([[4, 0], [4, 0]])
    kernel = np.array([[0, 4], [4, 5]])  # token 0 agrees (another order); 5 scores 0.0903
    used, differences = resolve_routes(2, choice, reference, kernel)
    assert used.tolist() == reference.tolist()  # the reference keeps its own experts
    [wrong] = differences
    assert not wrong.near_tie
    assert wrong.describe() == (
        "layer 2 token 1 routes to experts [4, 5], the reference to [0, 4]: not a near tie "
        f"(gap {(0.18842 - 0.0903) / 0.3556:.2%} of the largest choice value, window 2%)"
    )


@pytest.mark.parametrize(("beyond", "tie"), [(0.99, True), (1.01, False)])
def test_the_window_is_route_rtol_of_the_largest_choice_value(beyond: float, tie: bool) -> None:
    left_out = 0.5 + beyond * ROUTE_RTOL * 2.0  # the largest choice value is 2.0
    choice = np.array([[2.0, left_out, 0.5, 0.1]])
    [difference] = resolve_routes(0, choice, np.array([[0, 1]]), np.array([[0, 2]]))[1]
    assert difference.near_tie is tie


@pytest.mark.parametrize(
    "kernel", [[[4, 4]], [[4, 8]], [[-1, 4]]], ids=["repeated", "past-the-end", "negative"]
)
def test_impossible_kernel_experts_are_never_a_tie(kernel: list[list[int]]) -> None:
    [difference] = resolve_routes(1, NEAR_TIE, np.array([[4, 0]]), np.array(kernel))[1]
    assert not difference.near_tie
    assert "no perturbation explains it" in difference.describe()


# Grouped routing, 4 groups of 2 experts, 2 groups kept: group scores 1.0, 0.89, 0.888,
# 0.2. The reference keeps groups 0 and 1 and picks experts 0 and 2.
GROUPED = np.array([[0.6, 0.4, 0.45, 0.44, 0.448, 0.44, 0.1, 0.1]])


@pytest.mark.parametrize(
    ("kernel", "tie"),
    [
        ([[0, 4]], True),  # group 2 for group 1: 0.2 % below, and expert 4 its group's best
        ([[0, 5]], True),  # expert 5 for expert 4 within group 2: 1.3 % below
        ([[0, 6]], False),  # group 3 is far behind
        ([[2, 4]], False),  # groups 1 and 2 without group 0: 11 % below
    ],
)
def test_grouped_routing_ties_cover_groups_and_experts(kernel: list[list[int]], tie: bool) -> None:
    used, [difference] = resolve_routes(
        3, GROUPED, np.array([[0, 2]]), np.array(kernel), n_group=4, topk_group=2
    )
    assert difference.near_tie is tie
    assert used.tolist() == (kernel if tie else [[0, 2]])


def test_experts_from_more_groups_than_the_router_keeps_are_never_a_tie() -> None:
    [difference] = resolve_routes(
        3, GROUPED, np.array([[0, 1]]), np.array([[0, 2]]), n_group=4, topk_group=1
    )[1]
    assert difference.gap == float("inf")


def _step(**routing: object) -> StepCheck:
    return StepCheck(
        step=0, max_logit_diff=0.01, logit_tolerance=0.08, tokens_equal=1, tokens_near_tie=0,
        tokens_total=1, max_cache_diff=0.01, cache_tolerance=0.06, max_residual_diff=0.01,
        residual_tolerance=0.06, first_diverging_layer=None, finite=True, cores_identical=True,
        seconds=1.0, **routing,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("routing", "last_line", "status"),
    [
        (
            {"route_ties": ["layer 6 token 0: near tie, ..."]},
            "verify: passed (1 mode(s) x 1 step(s))",
            0,
        ),
        (
            {
                "route_mismatch": "layer 2 token 1 routes to experts [4, 5], the reference to "
                "[0, 4]",
                "route_mismatch_layer": 2,
            },
            "verify: FAILED: on_wait: step 0: layer 2 token 1 routes to experts [4, 5], the "
            "reference to [0, 4]",
            1,
        ),
    ],
    ids=["near-tie-passes", "mismatch-fails"],
)
def test_verify_prints_ties_and_fails_on_a_routing_mismatch(
    monkeypatch: pytest.MonkeyPatch, routing: dict[str, object], last_line: str, status: int
) -> None:
    from mkgen import cli
    from mkgen.verify import checks

    def run(spec_ref, topology, *, modes, batch, rows, **options):  # checks.run_verify
        report = NumericsReport(spec_ref, topology, 8, modes[0], batch, rows)
        report.steps = [_step(**routing)]
        return [report]

    monkeypatch.setattr(checks, "run_verify", run)
    result = CliRunner().invoke(
        cli.cli, ["verify", "qwen3-30b-a3b", "--topology", "2x2x1", "--mode", "on_wait",
                  "--steps", "1"],
    )  # fmt: skip
    assert result.exit_code == status, result.output
    assert result.output.strip().splitlines()[-1] == last_line
    assert ("routing: layer 6 token 0: near tie" in result.output) is (status == 0)


@pytest.mark.parametrize(
    ("diverged", "named"),
    [(None, "routing"), (2, "routing"), (1, "residual")],
    ids=["routing-only", "same-layer", "residual-earlier"],
)
def test_the_failure_names_what_goes_wrong_first_in_layer_order(
    diverged: int | None, named: str
) -> None:
    step = _step(route_mismatch="layer 2 token 0 routes to ...", route_mismatch_layer=2)
    step.first_diverging_layer = diverged
    assert not step.passed
    failure = step.failure() or ""
    expected = "step 0: layer 2 token 0 routes" if named == "routing" else "step 0: layer 1 div"
    assert failure.startswith(expected), failure


# ---------------------------------------------------------------- the reference's hook


def test_the_reference_weighs_the_experts_a_choice_callback_returns() -> None:
    import jax
    import jax.numpy as jnp

    from mkgen.reference.ffn import route, router_scores
    from mkgen.reference.model import init_weights, layer_weights
    from mkgen.spec.loader import load_spec
    from mkgen.spec.mini import mini_twin

    spec = mini_twin(load_spec("qwen3-30b-a3b"))
    kind = spec.ffn_of(0)
    w = layer_weights(init_weights(spec, 0), "layers.0.ffn.")
    x = jax.random.normal(jax.random.key(1), (3, spec.dims.hidden))
    own, _ = route(kind, w, x)
    seen = {}

    def last_two(kind, choice, chosen):  # the two weakest experts instead
        seen["choice"], seen["chosen"] = np.asarray(choice), np.asarray(chosen)
        return jnp.argsort(choice, axis=1)[:, : kind.top_k]

    ids, weights = route(kind, w, x, last_two)
    scores = np.asarray(router_scores(kind, w, x))
    np.testing.assert_array_equal(seen["chosen"], own)
    np.testing.assert_array_equal(ids, np.argsort(scores, axis=1)[:, : kind.top_k])
    picked = np.take_along_axis(scores, np.asarray(ids), axis=1)
    expected = picked / picked.sum(axis=1, keepdims=True) * kind.router.routed_scaling
    np.testing.assert_allclose(weights, expected, rtol=1e-6)


# ---------------------------------------------------------------- the kernel


def test_a_kernel_routing_to_the_weakest_experts_fails_naming_them() -> None:
    report = verify_numerics(
        "qwen3-30b-a3b", "1x1x1", mode="on_wait", steps=1, timeout=TIMEOUT,
        mutations=[("_top_k(scores, MOE_TOP_K)", "_top_k(-scores, MOE_TOP_K)")],
    )  # fmt: skip
    assert not report.passed
    failure = report.failure() or ""
    assert failure.startswith("step 0: layer 0 token 0 routes to experts ["), failure
    assert "not a near tie" in failure


# ---------------------------------------------------------------- the seeded sweep

# Every model spec and every fixture config, 3 seeds, 2 steps, on one TPU7x chip (2 cores,
# collectives included: the smallest mesh, on which every twin plans). The whole sweep
# (MKGEN_VERIFY_SWEEP=all: 51 runs of 8 to 26 s) took 12 minutes on this machine's 2
# shared cores, too long for every run; the suite runs IN_SUITE, one seed each (2 runs,
# about 40 s): the published Qwen3-Next (softmax router, near ties) and DeepSeek-V3's
# fixture (sigmoid router, selection bias, expert groups). Qwen3-Next's seed 0 on 2x2x1,
# step 0, failed before the tie rule (layer 6's residual off by 0.25 against 0.067,
# through a near tie of the reference's scores 0.18737 and 0.18842); its twin has changed
# since (the router keeps whole columns per core) and no longer meets that tie, so its run
# here on the smallest mesh holds the same: whatever routes differ are reported as near
# ties within the window (the rule's cases are held above; 2x2x1's collectives run in
# tests/test_codegen_numerics.py).
SWEEP_SEEDS = (0, 1, 2)
SMALLEST_MESH = "1x1x1"
MODEL_SPECS = sorted(p.stem for p in (Path(mkgen.__file__).parent / "model_specs").glob("*.yaml"))
FIXTURE_CONFIGS = sorted(
    str(p.relative_to(FIXTURES))
    for p in [*PUBLISHED.glob("*.json"), *FIXTURES.glob("hf/*/config.json")]
)
IN_SUITE = {"published/qwen3-next-80b-a3b.json": 1, "hf/deepseek_v3/config.json": 2}
SWEEP = [
    (config, seed)
    for config in MODEL_SPECS + FIXTURE_CONFIGS
    for seed in SWEEP_SEEDS
    if os.environ.get("MKGEN_VERIFY_SWEEP") == "all" or IN_SUITE.get(config) == seed
]


@pytest.mark.slow
@pytest.mark.parametrize(("config", "seed"), SWEEP, ids=[f"{c}-seed{s}" for c, s in SWEEP])
def test_seeded_sweep_verifies_on_the_smallest_mesh(config: str, seed: int) -> None:
    spec = config if config in MODEL_SPECS else str(FIXTURES / config)
    report = verify_numerics(
        spec, SMALLEST_MESH, mode="on_wait", steps=2, seed=seed, timeout=TIMEOUT
    )
    assert report.passed, report.failure()
    for step in report.steps:
        for tie in step.route_ties:
            assert ": near tie, the kernel chose experts " in tie and "window 2%" in tie, tie
