"""The build's mtp and block drafters on the device (mkgen.runtime.hidden_drafting,
docs/drafting.md), from the target's hidden states.

The bookkeeping proof: fed the hidden states a kernel writes (the reference's, taken as
the kernel's draft-hidden output: target_hidden at the plan's layers), every rejected row's
state replaced by noise and every token past the accepted ones by zero, the device
drafter's drafts equal the reference's draft_step given only the accepted rows, step
after step, per sequence, at different acceptance counts (a drafter committing the
rejected rows, or reading another layer or row, drafts otherwise). Then the runner: the
greedy tokens of the mini twins of draft-mtp and draft-block builds at rows 3 drafting
with their own drafter are the target's without drafting, every device step drafted with
the drafter (never the fallback) and accepted_per_step is recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mkgen.plan.layout import draft_hidden_states
from mkgen.reference.draft import draft_step, init_draft_state, init_draft_weights, target_hidden
from mkgen.reference.model import forward_traced, generate, init_cache, init_weights
from mkgen.runtime.hidden_drafting import HiddenStateDrafter
from mkgen.spec.loader import load_spec

SPECS = Path(__file__).parent / "specs"
ROWS, PROMPT_LENGTH, CAPACITY = 3, 3, 24  # a prompt of ROWS: one compiled observe
# Per step, the rows each of the two sequences accepted (bonus included).
TAKEN = [(1, 3), (3, 1), (1, 3)]  # counts of 1 and ROWS only: one compiled reference entry less


def _device_drafts(spec, weights, stream, kernel_states) -> list[np.ndarray]:
    """The device drafter's drafts [2, ROWS - 1] at every step of TAKEN."""
    drafter = HiddenStateDrafter(spec, batch=2, rows=ROWS, capacity=CAPACITY)
    observe, draft = jax.jit(drafter.observe), jax.jit(drafter.draft, static_argnums=4)
    noise = jax.random.normal(
        jax.random.key(7), kernel_states.shape[:1] + (2, ROWS, spec.dims.hidden)
    )
    position = np.full(2, PROMPT_LENGTH)
    known = lambda: jnp.where(jnp.arange(CAPACITY) <= position[:, None], stream, 0)  # noqa: E731
    state = observe(
        weights, drafter.initial_state(), known(), jnp.zeros(2, jnp.int32),
        kernel_states[:, :, :PROMPT_LENGTH], jnp.full(2, PROMPT_LENGTH),
    )  # fmt: skip
    out, fallback = [], lambda: jnp.full((2, ROWS - 1), -1, jnp.int32)  # noqa: E731
    for taken in TAKEN:
        drafts, state = draft(weights, state, known(), jnp.asarray(position), fallback)
        out.append(np.asarray(drafts))
        rows = jnp.stack([
            jax.lax.dynamic_slice_in_dim(kernel_states[:, b], int(position[b]), ROWS, axis=1)
            for b in range(2)
        ], axis=1)  # fmt: skip
        standing = np.arange(ROWS)[None, :] < np.asarray(taken)[:, None]
        rows = jnp.where(standing[None, :, :, None], rows, noise)  # rejected rows: other states
        start = position.copy()
        position = position + np.asarray(taken)
        state = observe(weights, state, known(), jnp.asarray(start), rows, jnp.asarray(taken))
    return out


def _reference_drafts(spec, weights, stream, traced, b: int) -> list[np.ndarray]:
    """The reference's drafts [ROWS - 1] for sequence b given the accepted rows only."""
    state = init_draft_state(spec, 1, CAPACITY + ROWS)
    start, n, out = 0, PROMPT_LENGTH, []
    for taken in TAKEN:
        tokens = stream[b : b + 1, start : start + n]
        drafts, _, state = draft_step(
            spec, weights, state, tokens, traced[:, b : b + 1, start : start + n],
            stream[b : b + 1, start + n], ROWS,
        )  # fmt: skip
        out.append(np.asarray(drafts[0]))
        start, n = start + n, taken[b]
    return out


@pytest.fixture(scope="module")
def target_run() -> tuple:
    """Both specs' target (the same dims, kinds and layers), its weights, a token stream
    of two sequences and the residual stream after every layer along it."""
    target = load_spec(SPECS / "draft-mtp.yaml").model_copy(update={"draft": None})
    weights = init_weights(target)
    stream = jax.random.randint(jax.random.key(1), (2, CAPACITY), 0, target.dims.vocab - 1)
    _, _, traced = forward_traced(target, weights, stream, init_cache(target, 2, CAPACITY))
    return weights, stream, traced


@pytest.mark.parametrize("name", ["draft-mtp", "draft-block"])
def test_device_drafts_are_the_references_given_the_accepted_rows(name: str, target_run) -> None:
    spec = load_spec(SPECS / f"{name}.yaml")
    target_weights, stream, traced = target_run
    weights = target_weights | init_draft_weights(spec, seed=3)
    kernel_states = jnp.stack([
        target_hidden(spec, weights, traced, entry.layer)
        for entry in draft_hidden_states(spec, ROWS)
    ])  # fmt: skip
    device = _device_drafts(spec, weights, stream, kernel_states)
    for b in range(2):
        reference = _reference_drafts(spec, weights, stream, traced, b)
        assert [d[b].tolist() for d in device] == [r.tolist() for r in reference], f"sequence {b}"


# The builds' runs (comma-separated) in one process (JAX imported once), recording whether each device
# step drafted with the drafter (its committed length at the sequence's position).
RUNS = """
import contextlib, io, json, sys
from pathlib import Path

import jax
import numpy as np

from mkgen.runtime import hidden_drafting
from mkgen.runtime.build import runner_build
from mkgen.runtime.main import run

usable, drafted = [], hidden_drafting.HiddenStateDrafter.draft


def recording(self, weights, state, history, positions, fallback):
    jax.debug.callback(lambda ok: usable.append(np.asarray(ok).tolist()),
                       state["length"] == positions)
    return drafted(self, weights, state, history, positions, fallback)


hidden_drafting.HiddenStateDrafter.draft = recording
runs = {}
for directory in sys.argv[1].split(","):
    usable.clear()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run(runner_build(Path(directory)), sys.argv[2:])
    runs[directory] = {**json.loads(out.getvalue()), "usable": list(usable)}
print(json.dumps(runs))
"""
STEPS, PROMPT = 2, [3, 17, 42, 99, 5, 64, 127]  # held 6: two prefill chunks
# The builds' mini twins (hidden 256, vocabulary 512) run: the drafter's bookkeeping in the
# runner is the same at any size, and a quarter of the hidden width is a fraction of the
# interpret-mode time. Context 32, as tests/test_draft_sampling.py builds them.
CONTEXT = 32


def _build_twin(name: str, topology: str, output: Path) -> Path:
    """The mini twin of the build of tests/specs/NAME.yaml at rows ROWS for `topology`."""
    from mkgen.codegen.package import make_build
    from mkgen.plan.options import BuildOptions
    from mkgen.spec.topology import parse_topology

    options = BuildOptions.create(rows=ROWS, context=CONTEXT)
    make_build(load_spec(SPECS / f"{name}.yaml"), parse_topology(topology), options, output=output)
    return output / "mini"


def _runs(builds: list[Path], steps: int) -> dict[str, dict]:
    """RUNS' greedy runs of `builds` for `steps` tokens, two steps per device call."""
    args = ["--interpret", "--random-weights", "0", "--prompt-ids", ",".join(map(str, PROMPT)),
            "--steps", str(steps), "--steps-per-call", "2", "--json"]  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-c", RUNS, ",".join(map(str, builds)), *args], capture_output=True,
        text=True, timeout=600, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def _target_greedy(mini: Path, kind: str, steps: int) -> list[int]:
    """The greedy tokens of the mini twin's target (its spec without the drafter, with the
    runner's random weights), after checking the twin drafts with `kind`."""
    from mkgen.spec.schema import ModelSpec
    from mkgen.weights.quantize import stored_random_weights

    twin = ModelSpec.model_validate(json.loads((mini / "plan.json").read_text())["spec"])
    assert twin.draft is not None and twin.draft.kind == kind
    target = twin.model_copy(update={"draft": None})
    return generate(target, stored_random_weights(target, 0), np.asarray(PROMPT), steps).tolist()


def test_the_runner_drafts_with_its_mtp_and_block_drafters(tmp_path) -> None:
    builds = {
        kind: _build_twin(f"draft-{kind}", "1x1x1", tmp_path / kind) for kind in ("mtp", "block")
    }
    runs = _runs(list(builds.values()), STEPS)
    for kind, mini in builds.items():
        run = runs[str(mini)]
        assert run["tokens"] == [_target_greedy(mini, kind, STEPS)], kind
        (steps,) = run["accepted_per_step"]
        assert sum(steps) == STEPS and all(1 <= n <= ROWS for n in steps), kind
        # Every device step drafted from caches caught up through the prefill's states.
        assert run["usable"] and all(all(ok) for ok in run["usable"]), (kind, run["usable"])


# 8 cores: 8 virtual CPU devices. Two steps in one device call, the second drafted from the
# first's commit, as on one chip above (4 steps repeated that for one more call).
MESH_TOPOLOGY, MESH_STEPS = "2x2x1", 2


def test_the_block_drafter_on_an_eight_device_mesh_keeps_the_greedy_tokens(tmp_path) -> None:
    """draft-block's mini twin (hidden 256) at 2x2x1: the target's weights sharded over 8
    devices, the drafter's replicated, its hidden states from the sharded kernel: the
    greedy tokens are the target's, and every device step drafted with the drafter."""
    mini = _build_twin("draft-block", MESH_TOPOLOGY, tmp_path / "block")
    (run,) = _runs([mini], MESH_STEPS).values()
    greedy = _target_greedy(mini, "block", MESH_STEPS)
    assert run["tokens"] == [greedy]
    assert run["usable"] and all(all(ok) for ok in run["usable"]), run["usable"]
