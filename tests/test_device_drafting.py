"""The build's drafter on the device (mkgen.runtime.device_drafting, docs/drafting.md):
`mkgen build --draft` of the qwen3 fixture's spec with itself as its model drafter, run
in interpret mode with random weights. The plumbing proof: a drafter identical to the
target accepts every row on every greedy step, a perturbed copy lands strictly in
between, and the tokens with either are the target's own greedy tokens (a mutated accept
rule breaks the last: it takes a perturbed draft the target did not choose)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mkgen.errors import MkgenError
from mkgen.runtime.arguments import check_build_drafter
from mkgen.runtime.build import Build

CONFIG = Path(__file__).parent / "fixtures" / "hf" / "qwen3" / "config.json"
ROWS, STEPS, PROMPT = 3, 9, [3, 17, 42, 99, 5, 64, 127, 23]
PERTURBATION = 0.3  # relative noise on every drafter tensor (mkgen.reference.draft.perturbed)

# Both runs in one process (JAX imported once): the drafter as built, then perturbed.
RUNS = """
import contextlib, io, json, sys
from pathlib import Path

import mkgen.runtime.device_drafting as drafting
from mkgen.reference.draft import perturbed
from mkgen.runtime.build import runner_build
from mkgen.runtime.main import run

build, args = runner_build(Path(sys.argv[1])), sys.argv[3:]
drawn = drafting.drafter_weights


def generate():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run(build, args)
    return json.loads(out.getvalue())


identical = generate()
drafting.drafter_weights = lambda model, seed: perturbed(drawn(model, seed), float(sys.argv[2]))
print(json.dumps({"identical": identical, "perturbed": generate()}))
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from mkgen.codegen.package import make_build
    from mkgen.plan.options import BuildOptions
    from mkgen.spec.draft_import import load_drafter
    from mkgen.spec.loader import load_spec
    from mkgen.spec.topology import parse_topology

    build = tmp_path_factory.mktemp("drafting") / "build"
    spec = load_drafter(str(CONFIG), load_spec(CONFIG))
    options = BuildOptions.create(rows=ROWS, context=64)
    make_build(spec, parse_topology("1x1x1"), options, output=build)
    args = ["--interpret", "--random-weights", "0", "--prompt-ids", ",".join(map(str, PROMPT)),
            "--steps", str(STEPS), "--steps-per-call", "2", "--json"]  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-c", RUNS, str(build), str(PERTURBATION), *args],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def test_an_identical_drafter_accepts_every_row_on_every_step(runs) -> None:
    identical = runs["identical"]
    assert identical["accepted_per_step"] == [[ROWS] * (STEPS // ROWS)]
    assert identical["acceptance_length"] == ROWS


def test_a_perturbed_drafter_lands_strictly_in_between(runs) -> None:
    (steps,) = runs["perturbed"]["accepted_per_step"]
    assert sum(steps) == STEPS and all(1 <= n <= ROWS for n in steps)
    assert 1 < runs["perturbed"]["acceptance_length"] < ROWS


def test_greedy_tokens_with_any_drafter_are_the_targets_without_drafting(runs) -> None:
    from mkgen.reference.model import generate
    from mkgen.spec.loader import load_spec
    from mkgen.weights.quantize import stored_random_weights

    target = load_spec(CONFIG)
    greedy = generate(target, stored_random_weights(target, 0), np.asarray(PROMPT), STEPS)
    assert runs["identical"]["tokens"] == [greedy.tolist()]
    assert runs["perturbed"]["tokens"] == [greedy.tolist()]


def _build(drafter: str | None) -> Build:
    return Build(
        directory=Path("."), name="b", spec="s", topology="1x1x1", devices=2, batch=1, rows=3,
        context=64, vocab_used=128, recurrent_kinds=(), default_steps=8, drafter=drafter,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("drafter", "converted", "fragment"),
    [
        (None, False, "this build carries no drafter"),
        ("model", True, "holds no weights of the build's model drafter"),
        ("mtp", True, "holds no weights of the build's mtp drafter"),
    ],
)
def test_a_drafter_the_runner_cannot_run_is_one_line_at_start(
    drafter, converted, fragment, tmp_path
) -> None:
    weights = None
    if converted:  # converted weights without --draft-checkpoint: no `draft` in layout.json
        (tmp_path / "layout.json").write_text(json.dumps({"identity": {}, "files": {}}))
        weights = str(tmp_path)
    with pytest.raises(MkgenError, match=fragment) as error:
        check_build_drafter(_build(drafter), weights)
    message = str(error.value)
    assert "\n" not in message and "--drafter ngram" in message
    assert converted is False or "--draft-checkpoint" in message


@pytest.mark.parametrize("drafter", ["model", "mtp", "block"])
def test_every_drafter_kind_runs_with_random_weights(drafter) -> None:
    check_build_drafter(_build(drafter), None)  # mtp and block: tests/test_hidden_drafting.py
