"""The build's mtp and block drafters (mkgen.runtime.hidden_drafting) when sampling and
behind a disaggregated prefill (docs/drafting.md), in TPU interpret mode on virtual CPU
devices with random weights.

One child process with four devices (a decode mesh and a prefill mesh of two cores)
takes the mini twins (hidden 256, vocabulary 512) of draft-mtp and draft-block built at
rows 3 for 1x1x1 through:
- `mkgen run`'s runner (mkgen.runtime.main.run) with --temperature 1 --top-k 2 --seed 5,
  colocated;
- the server's engine (mkgen.serve.engine) prefilling on the prefill mesh, as `mkgen
  serve --disaggregate` makes it: a greedy request, then in the same slot (its drafter
  begun afresh) the runner's sampled request.
Every device step's drafts are recorded with the position they follow and whether the
drafter made them (its committed length at the sequence's position) or the fallback
(prompt lookup) did.

The proofs: every device step drafted with the drafter, in both paths (leaving the
disaggregated prefill's states uncommitted fails it: the slot then drafts by the
fallback); the sampled request gets the runner's tokens through the other path and the
other mesh's prefill (the same seed, the same tokens) and the runner's drafts at every
position both drafted (so the states handed over from the prefill mesh are the colocated
prefill's, as far as the drafts tell); every sampled token lies in the reference
model's top 2 after its prefix, as top-k 2 allows (a rule that took drafts without
the target's say fails it); the accepted counts are in range; the greedy request gets
the reference's greedy tokens. The drafters' random weights accepted nothing in these
runs (every step gave one token): the rejection rule's distribution is held on
accept_on_device itself (tests/test_runner.py), and commits after accepted drafts in
tests/test_hidden_drafting.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

SPECS = Path(__file__).parent / "specs"
KINDS = ["draft-mtp", "draft-block"]
# Two steps: the second drafts from the first's commit. Context 32: fewer prefill chunks
# for the server to warm up.
ROWS, STEPS, CONTEXT = 3, 2, 32
PROMPT = [3, 17, 42, 99, 5, 64, 127]  # held 6: two prefill chunks (4 and 2)
SAMPLING = {"temperature": 1.0, "top_k": 2, "seed": 5}
TIE_MARGIN = 0.05  # a logit this close to the reference's 2nd may be among the kernel's top 2


def _child(build_dirs: list[str]) -> dict:
    """Per build: the runner's sampled run and the disaggregated engine's answers, each
    with the drafts of its device steps (the warm-up's dropped)."""
    from mkgen.runtime import devices
    from mkgen.runtime.build import runner_build

    builds = [runner_build(Path(directory)) for directory in build_dirs]
    devices.configure(builds[0], True, meshes=2)  # both builds have 2 cores
    import contextlib
    import io
    import threading

    import jax

    jax.devices()  # the backend starts with both meshes' devices, whatever run() sets later
    from mkgen.runtime import hidden_drafting
    from mkgen.runtime.main import run
    from mkgen.serve.engine import (
        QUEUE_LIMIT,
        STEPS_PER_CALL,
        Engine,
        GenerationParams,
        Request,
        Update,
    )
    from mkgen.serve.server import _start_engine as start_engine

    steps: list[dict] = []
    drafted = hidden_drafting.HiddenStateDrafter.draft

    def recording(self, weights, state, history, positions, fallback):
        drafts, state_after = drafted(self, weights, state, history, positions, fallback)
        jax.debug.callback(
            lambda usable, at, made: steps.append(
                {"usable": bool(usable[0]), "position": int(at[0]), "drafts": made[0].tolist()}
            ),
            state["length"] == positions, positions, drafts,
        )  # fmt: skip
        return drafts, state_after

    def answer(engine: Engine, prompt: list[int], **params) -> dict:
        """The engine's tokens for one request, and the drafts of its device steps."""
        steps.clear()
        tokens, done = [], threading.Event()

        def deliver(update: Update) -> None:
            tokens.extend(update.tokens)
            if update.finish_reason:
                done.set()

        engine.submit(Request(prompt, GenerationParams(STEPS, **params), deliver))
        assert done.wait(600), "no answer"
        return {"tokens": tokens, "steps": list(steps)}

    hidden_drafting.HiddenStateDrafter.draft = recording
    sampled_args = [f"--{name.replace('_', '-')}={value}" for name, value in SAMPLING.items()]
    results = {}
    for directory, build in zip(build_dirs, builds, strict=True):
        steps.clear()
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            run(build, ["--interpret", "--random-weights", "0", "--json", "--steps", str(STEPS),
                        "--steps-per-call", "2", "--prompt-ids", ",".join(map(str, PROMPT)),
                        *sampled_args])  # fmt: skip
        runner = {**json.loads(out.getvalue()), "steps": list(steps)}

        engine, _ = start_engine(  # as `mkgen serve --disaggregate --host-cache-mib 0` does
            build, None, 0, verify=False, meshes=2, draft=True, interpret=True,
            steps_per_call=STEPS_PER_CALL, queue_limit=QUEUE_LIMIT, disaggregate=True,
            host_cache_mib=0, multi_host=False,
        )  # fmt: skip
        engine.start()
        assert engine.warm.wait(600), engine.failure

        greedy = answer(engine, PROMPT)
        sampled = answer(engine, PROMPT, **SAMPLING)  # after the greedy one: begun afresh
        engine.stop()
        results[directory] = {"runner": runner, "greedy": greedy, "sampled": sampled}
    return results


def _target(build: Path):
    """The target of a build's mini twin (its spec without the drafter) and its random
    weights as the runner stores them."""
    from mkgen.spec.schema import ModelSpec
    from mkgen.weights.quantize import stored_random_weights

    twin = ModelSpec.model_validate(json.loads((build / "plan.json").read_text())["spec"])
    spec = twin.model_copy(update={"draft": None})
    return spec, stored_random_weights(spec, 0)


def _runs(tmp: Path) -> dict[str, dict]:
    """Per kind, the child's results for the mini twin of its build made in `tmp`."""
    from mkgen.codegen.package import make_build
    from mkgen.plan.options import BuildOptions
    from mkgen.spec.loader import load_spec
    from mkgen.spec.topology import parse_topology

    options = BuildOptions.create(rows=ROWS, context=CONTEXT)
    for name in KINDS:
        make_build(load_spec(SPECS / f"{name}.yaml"), parse_topology("1x1x1"), options,
                   output=tmp / name)  # fmt: skip
    child = subprocess.run(
        [sys.executable, __file__, *(str(tmp / name / "mini") for name in KINDS)],
        capture_output=True, text=True, timeout=840,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}, cwd=Path(__file__).parent,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    results = json.loads(child.stdout.strip().splitlines()[-1])
    return {name: results[str(tmp / name / "mini")] for name in KINDS}


def _check_every_device_step_drafted_with_the_drafter(out: dict) -> None:
    for name in ("runner", "greedy", "sampled"):
        answer = out[name]
        assert answer["steps"] and all(s["usable"] for s in answer["steps"]), (name, answer)


def _check_the_same_seed_gives_the_runners_tokens_and_drafts(out: dict) -> None:
    runner, sampled = out["runner"], out["sampled"]
    assert sampled["tokens"] == runner["tokens"][0]
    served = {s["position"]: s["drafts"] for s in sampled["steps"]}
    ran = {s["position"]: s["drafts"] for s in runner["steps"]}
    assert ran.keys() <= served.keys()
    assert all(served[p] == drafts for p, drafts in ran.items()), (ran, served)


def _check_sampled_tokens_in_the_references_top_two(out: dict, spec, weights) -> None:
    from mkgen.reference.model import forward, init_cache

    (tokens,) = out["runner"]["tokens"]
    (accepted,) = out["runner"]["accepted_per_step"]
    assert len(tokens) == STEPS == sum(accepted) and all(1 <= n <= ROWS for n in accepted)
    sequence = np.asarray([PROMPT + tokens])
    logits, _ = forward(spec, weights, sequence, init_cache(spec, 1, sequence.shape[1]), 0)
    for i, token in enumerate(tokens):
        row = np.asarray(logits[0, len(PROMPT) - 1 + i, : spec.dims.vocab], np.float32)
        allowed = row >= np.sort(row)[-2] - TIE_MARGIN  # the top 2, and any tied with them
        assert allowed[token], (i, token, int(allowed.sum()))


def test_mtp_and_block_drafters_sample_and_serve_behind_a_disaggregated_prefill(
    tmp_path: Path,
) -> None:
    """The module docstring's checks, per kind, over one child run for both (one test:
    the child is most of its cost, about 50 CPU s, and is run once)."""
    from mkgen.reference.model import generate

    for kind, out in _runs(tmp_path).items():
        spec, weights = _target(tmp_path / kind / "mini")
        try:
            _check_every_device_step_drafted_with_the_drafter(out)
            _check_the_same_seed_gives_the_runners_tokens_and_drafts(out)
            _check_sampled_tokens_in_the_references_top_two(out, spec, weights)
            greedy = generate(spec, weights, np.asarray(PROMPT), STEPS).tolist()
            assert out["greedy"]["tokens"] == greedy, "the disaggregated server's greedy tokens"
        except AssertionError as failure:
            raise AssertionError(f"{kind}: {failure}") from failure


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1:])))
