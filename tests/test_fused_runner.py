"""The server's engine over a build whose kernel drafts (mkgen build --fuse-draft,
docs/drafting.md); it decodes with the runner's chunked decoder.

draft-mtp's mini twin (hidden 256) at rows 3, batch 1, on one chip's cores, in TPU
interpret mode: the engine's XLA prefill fills the MTP module's cache and drafts after
the prompt with the module's chain, the first device step feeds those drafts and every
later one the kernel's drafts of the step before (carried by KernelDrafts), the greedy
tokens are the target's, a second request in the slot the first left gets the same
tokens and drafts, and a third, the next turn, continues the first's caches from the
host cache and starts from its own prefill's drafts. The prefill's drafts and the
kernel's first are the reference drafter's (its draft_step over the same committed
rows): they rest on the prefilled MTP cache, which a prefill that skipped it, or paired
the wrong tokens, would not give. `mkgen run` with converted weights:
tests/test_draft_convert.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cli_run import assert_user_error, mkgen_here

from mkgen.reference.draft import compile_traced, draft_step, init_draft_state
from mkgen.reference.model import generate, init_cache
from mkgen.spec.loader import load_spec
from mkgen.spec.schema import ModelSpec

SPECS = Path(__file__).parent / "specs"
ROWS, CONTEXT, STEPS = 3, 32, 6
PROMPT = [3, 17, 42, 99, 5, 64, 127]  # held 6: two prefill chunks
TURN = [9, 250, 31]  # the next turn's new tokens, after the first answer
# A reference draft may differ from the kernel's only where its logits nearly tie: within
# this fraction of the logits' spread (the kernel multiplies in bf16, the reference in f32).
TIE = 0.02

# The server's engine over the build in argv[1] (as `mkgen serve --random-weights 0
# --host-cache-mib 0` makes it): the request argv[2] (prompt ids, JSON) for argv[3] tokens,
# twice, one after the other in the same slot; each with every device step's drafts (and
# whether they were the kernel's) and every kernel output the drafter observed.
RUN = """
import json, sys, threading
from pathlib import Path

import jax
import numpy as np

from mkgen.runtime import devices
from mkgen.runtime.build import runner_build
from mkgen.runtime.fused_drafting import KernelDrafts
from mkgen.serve.engine import QUEUE_LIMIT, STEPS_PER_CALL, GenerationParams, Request
from mkgen.serve.server import _start_engine

fed, made = [], []
draft, observe = KernelDrafts.draft, KernelDrafts.observe


def record(into):
    return lambda *values: into.append([np.asarray(v).tolist() for v in values])


def recording_draft(self, weights, state, history, positions, fallback):
    drafts, state = draft(self, weights, state, history, positions, fallback)
    token = history[jax.numpy.arange(positions.shape[0]), positions]
    usable = (state["position"] == positions) & (state["token"] == token)
    jax.debug.callback(record(fed), positions, usable, drafts)
    return drafts, state


def recording_observe(self, weights, state, history, start, out, count):
    jax.debug.callback(record(made), start, out, count)
    return observe(self, weights, state, history, start, out, count)


KernelDrafts.draft, KernelDrafts.observe = recording_draft, recording_observe
# In step order (the positions only grow): [drafts usable, drafts] and [kernel out, taken].
in_order = lambda log: [entry[1:] for entry in sorted(log)]
build = runner_build(Path(sys.argv[1]))
devices.configure(build, True)
engine, _ = _start_engine(
    build, None, 0, verify=False, meshes=1, draft=True, interpret=True,
    steps_per_call=STEPS_PER_CALL, queue_limit=QUEUE_LIMIT, disaggregate=False,
    host_cache_mib=64, multi_host=False,
)
engine.start()
assert engine.warm.wait(600), engine.failure
reused = lambda: engine.metrics.registry.get_sample_value("mkgen_prefix_cache_tokens_reused_total")
first, answers = json.loads(sys.argv[2]), []
for request in range(3):
    # The prompt twice, then the next turn: the first answer and TURN after it.
    prompt = first if request < 2 else first + answers[0]["tokens"] + json.loads(sys.argv[4])
    fed.clear(), made.clear()
    tokens, done, before = [], threading.Event(), reused()

    def deliver(update):
        tokens.extend(update.tokens)
        if update.finish_reason:
            done.set()

    engine.submit(Request(prompt, GenerationParams(int(sys.argv[3])), deliver))
    assert done.wait(600), "no answer"
    answers.append({"prompt": prompt, "tokens": tokens, "fed": in_order(fed),
                    "made": in_order(made), "reused": reused() - before})
engine.stop()
print(json.dumps(answers))
"""


def _fused_twin(output: Path) -> None:
    from mkgen.codegen.package import make_build
    from mkgen.plan.options import BuildOptions
    from mkgen.spec.draft_import import load_drafter
    from mkgen.spec.topology import parse_topology

    options = BuildOptions.create(rows=ROWS, context=CONTEXT, fuse_draft=True)
    spec = load_drafter("mtp", load_spec(SPECS / "draft-mtp.yaml"))
    make_build(spec, parse_topology("1x1x1"), options, output=output)


def _answers(mini: Path) -> list[dict]:
    """RUN's three answers for STEPS tokens from `mini`'s server engine: to PROMPT twice,
    then to the next turn (PROMPT, the first answer, TURN)."""
    result = subprocess.run(
        [sys.executable, "-c", RUN, str(mini), json.dumps(PROMPT), str(STEPS), json.dumps(TURN)],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def _reference_drafts(spec: ModelSpec, committed: list[int], bonus: int) -> tuple[list, list]:
    """The reference MTP drafter's drafts after `bonus` with `committed` (every token before
    it) and their logits [rows - 1, vocab], from the runner's random weights."""
    from mkgen.weights.quantize import stored_draft_weights, stored_random_weights

    weights = stored_random_weights(spec, 0) | stored_draft_weights(spec, 0)
    tokens = np.asarray([committed], np.int32)
    _, _, hidden = compile_traced(spec)(weights, tokens, init_cache(spec, 1, CONTEXT))
    state = init_draft_state(spec, 1, CONTEXT)
    drafts, logits, _ = draft_step(spec, weights, state, tokens, hidden, np.asarray([bonus]), ROWS)
    return np.asarray(drafts)[0].tolist(), np.asarray(logits)[0]


@pytest.fixture(scope="module")
def fused_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fused build of draft-mtp at 1x1x1 (its mini twin is what runs)."""
    output = tmp_path_factory.mktemp("fused") / "build"
    _fused_twin(output)
    return output


def test_the_server_feeds_the_kernels_drafts_and_keeps_the_greedy_tokens(fused_build) -> None:
    mini = fused_build / "mini"
    answer, again, turn = _answers(mini)
    twin = ModelSpec.model_validate(json.loads((mini / "plan.json").read_text())["spec"])
    target = twin.model_copy(update={"draft": None})
    from mkgen.weights.quantize import stored_random_weights

    greedy = generate(target, stored_random_weights(target, 0), np.asarray(PROMPT), STEPS)
    assert answer["tokens"] == greedy.tolist()
    # The second request, in the slot the first left, starts from its own prefill again
    # (no cached sequence is a prefix of its prompt).
    assert again == answer and answer["reused"] == 0
    # The prefill's drafts come first (made[0]: it took the 6 prefilled rows), then each
    # step's: the tokens it gave (accepted + bonus), then its drafts.
    prefilled, *made = answer["made"]
    assert prefilled[1] == [len(PROMPT) - 1] and prefilled[0][0][0] == len(PROMPT) - 1
    steps = [count[0] for _, count in made]
    assert sum(steps) == STEPS and len(answer["fed"]) == len(steps)
    # Every step feeds the drafts written before it: the first the prefill's (the MTP
    # module's chain after the prompt), every later one the kernel's of the step before.
    assert [ok for ok, _ in answer["fed"]] == [[True]] * len(steps)
    for (out, count), (_, drafts) in zip(answer["made"], answer["fed"], strict=False):
        assert out[0][0] == count[0] and drafts == [out[0][1:]]
    # The prefill's drafts are the reference drafter's after the prompt.
    _assert_drafts(prefilled[0][0][1:], *_reference_drafts(twin, PROMPT[:-1], PROMPT[-1]))
    # The kernel's first drafts follow the bonus of step 0, after the prompt and the rows
    # it accepted: the reference drafter's from the same committed tokens.
    (accepted, *kernel_drafts), taken = made[0][0][0], steps[0]
    assert accepted == taken
    fed_rows = [PROMPT[-1], *answer["fed"][0][1][0]]
    committed = PROMPT[:-1] + fed_rows[:taken]
    _assert_drafts(kernel_drafts, *_reference_drafts(twin, committed, greedy[taken - 1]))
    # The next turn continues the first sequence's caches from the host cache (its MTP
    # module's among them) and prefills the rest: its first step feeds the prefill's drafts,
    # the reference drafter's after its whole prompt.
    history = turn["prompt"]
    assert turn["reused"] == len(PROMPT) + STEPS - 1
    assert turn["fed"][0][0] == [True] and turn["made"][0][1] == [len(history) - 1 - turn["reused"]]
    _assert_drafts(turn["fed"][0][1][0], *_reference_drafts(twin, history[:-1], history[-1]))


def _assert_drafts(drafts: list[int], expected: list[int], logits: np.ndarray) -> None:
    """`drafts` are the reference's `expected` (logits [rows - 1, vocab]) up to the first
    near tie, after which the chain drafts from another token."""
    for j, (mine, theirs) in enumerate(zip(drafts, expected, strict=True)):
        if mine != theirs:
            gap = logits[j][theirs] - logits[j][mine]
            assert gap <= TIE * np.ptp(logits[j]), (j, drafts, expected)
            break


def test_what_a_kernel_that_drafts_needs_is_asked_for_in_one_line(fused_build, tmp_path) -> None:
    """Its MTP module's checkpoint to convert; a verify recorded into it must verify it."""
    convert = ["convert", "--build", str(fused_build), "--checkpoint", str(tmp_path),
               "-o", str(tmp_path / "w")]  # fmt: skip
    assert_user_error(mkgen_here(*convert), "--fuse-draft", "--draft-checkpoint")
    verify = ["verify", str(SPECS / "draft-mtp.yaml"), "--topology", "1x1x1", "--rows", str(ROWS),
              "--draft", "mtp", "-o", str(fused_build), "--update-report"]  # fmt: skip
    assert_user_error(mkgen_here(*verify), "built with --fuse-draft; verify with --fuse-draft")
    assert not list(tmp_path.iterdir())  # nothing written


def test_the_printed_commands_of_a_kernel_that_drafts_run_as_printed() -> None:
    """A build's verify and compile commands carry --fuse-draft, at batch 1 and above
    (verify holds a fused drafter's sequences each at its own positions)."""
    from mkgen.codegen.naming import build_commands
    from mkgen.plan.options import BuildOptions
    from mkgen.spec.topology import parse_topology

    topology = parse_topology("1x1x1")
    one = build_commands("draft-mtp", topology, BuildOptions.create(rows=3, fuse_draft=True))
    assert one["verify"].endswith("--fuse-draft --update-report")
    assert "--fuse-draft" in one["compile"]
    two = build_commands(
        "draft-mtp", topology, BuildOptions.create(batch=2, rows=3, fuse_draft=True)
    )
    assert two["verify"].endswith("--batch 2 --rows 3 --fuse-draft --update-report")
    assert "--fuse-draft" in two["compile"]
