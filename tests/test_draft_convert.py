"""A build's drafter converted from its checkpoint (`mkgen convert --draft-checkpoint`,
mkgen.weights.draft, docs/drafting.md) and run by the runner with --weights.

The checkpoints are scripts/make_draft_checkpoints.py's, in each kind's published tensor
names: mtp DeepSeek-V3's own MTP layer in the target's checkpoint (converted with
--draft-checkpoint the target's directory), block a DFlash drafter and model a copy of
the qwen3 fixture, both for the qwen3 fixture. Proof that the weights reached the
drafter: the converted tensors are the reference loader's; with them the runner's greedy
tokens are the target's; the model drafter identical to its target accepts every row of
every step; the mtp and block drafters' drafts in the runner are the reference's
(mkgen.reference.draft.draft_step) given the converted weights, wherever the reference's
choice leads its runner-up by TIE_MARGIN (the runner's hidden states come from the
kernel and the XLA prefill, not bit for bit the reference's). A misfit drafter checkpoint
is one line, exit 2, with nothing written."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from cli_run import REPO
from safetensors.numpy import load_file, save_file

from mkgen.cli import main

FIXTURES = REPO / "tests" / "fixtures" / "hf"
ROWS = 3
PROMPT = [3, 17, 42, 99, 5, 64, 127, 23]
# The mtp drafter again, in a build whose kernel drafts (mkgen build --fuse-draft): its MTP
# module's weights converted beside the target's, its passes packed from them as read.
FUSED = "mtp-fused"
STEPS = {"mtp": 4, "block": 4, "model": 6, FUSED: 4}
# A reference draft whose logits lead the runner-up by less may differ in the runner.
TIE_MARGIN = 0.05


@functools.cache
def _maker() -> ModuleType:
    path = REPO / "scripts" / "make_draft_checkpoints.py"
    spec = importlib.util.spec_from_file_location("make_draft_checkpoints", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _checkpoint_kind(kind: str) -> str:
    """The drafter kind whose checkpoint a kind's build converts (FUSED: mtp's)."""
    return "mtp" if kind == FUSED else kind


def _target_spec(kind: str, checkpoints: dict[str, Path]):
    """The build's spec: the target with the kind's drafter (mkgen build --draft)."""
    from mkgen.spec.draft_import import load_drafter
    from mkgen.spec.hf_import import import_hf_config

    kind = _checkpoint_kind(kind)
    if kind == "mtp":
        return load_drafter("mtp", import_hf_config(checkpoints["mtp"], keep_mtp=True))
    return load_drafter(str(checkpoints[kind]), import_hf_config(FIXTURES / "qwen3"))


def _target_checkpoint(kind: str, checkpoints: dict[str, Path]) -> Path:
    return checkpoints["mtp"] if _checkpoint_kind(kind) == "mtp" else FIXTURES / "qwen3"


def _convert(*args: str, capsys) -> tuple[int, str]:
    try:
        main(["convert", *args])
        code = 0
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict:
    """Per kind: (spec, build directory, converted weights directory)."""
    from mkgen.codegen.package import make_build
    from mkgen.plan.options import BuildOptions
    from mkgen.spec.topology import parse_topology

    tmp = tmp_path_factory.mktemp("draft-convert")
    checkpoints = _maker().write(tmp / "checkpoints")
    out = {"checkpoints": checkpoints}
    for kind in [*_maker().KINDS, FUSED]:
        spec = _target_spec(kind, checkpoints)
        build = tmp / f"build-{kind}"
        options = BuildOptions.create(rows=ROWS, context=64, fuse_draft=kind == FUSED)
        make_build(spec, parse_topology("1x1x1"), options, output=build)
        weights = tmp / f"weights-{kind}"
        main(["convert", "--build", str(build), "--checkpoint",
              str(_target_checkpoint(kind, checkpoints)), "--draft-checkpoint",
              str(checkpoints[_checkpoint_kind(kind)]), "-o", str(weights)])  # fmt: skip
        out[kind] = (spec, build, weights)
    return out


@pytest.mark.parametrize("kind", ["mtp", "block", "model"])
def test_the_converted_drafter_is_the_reference_loaders(kind: str, converted) -> None:
    from mkgen.reference.draft import load_draft_weights
    from mkgen.reference.hf_weights import read_safetensors
    from mkgen.weights.convert import read_manifest
    from mkgen.weights.draft import read_drafter

    spec, _, weights = converted[kind]
    checkpoint = converted["checkpoints"][kind]
    arch = json.loads((checkpoint / "config.json").read_text())["architectures"][0]
    expected = load_draft_weights(spec, arch, read_safetensors(checkpoint))
    got = read_drafter(weights, read_manifest(weights), spec)
    # The fixtures are bf16-exact: stored in bf16 (matrices) or f32, nothing changes.
    assert sorted(got) == sorted(expected) + (["lm_head"] if kind != "model" else [])
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, name)


# One runner process per kind, recording for an mtp or block drafter every device draft:
# the position it drafts after, its drafts and whether the drafter (not the fallback) made
# them.
RUN = """
import contextlib, io, json, sys
from pathlib import Path

import jax
import numpy as np

from mkgen.runtime import fused_drafting, hidden_drafting
from mkgen.runtime.build import runner_build
from mkgen.runtime.main import run

calls = []


def recording(drafter, made_them):
    drafted = drafter.draft

    def draft(self, weights, state, history, positions, fallback):
        drafts, state = drafted(self, weights, state, history, positions, fallback)
        jax.debug.callback(
            lambda *a: calls.append([np.asarray(x).tolist() for x in a]),
            positions, drafts, made_them(state, history, positions),
        )
        return drafts, state

    drafter.draft = draft


recording(hidden_drafting.HiddenStateDrafter, lambda state, _, at: state["length"] == at)
# A kernel that drafts: its drafts of the step before, where they follow the same token.
recording(fused_drafting.KernelDrafts, lambda state, history, at: (state["position"] == at)
          & (state["token"] == history[jax.numpy.arange(at.shape[0]), at]))
out = io.StringIO()
with contextlib.redirect_stdout(out):
    run(runner_build(Path(sys.argv[1])), sys.argv[2:])
print(json.dumps({**json.loads(out.getvalue()), "calls": calls}))
"""


def _run(build: Path, weights: Path, steps: int) -> dict:
    args = ["--interpret", "--weights", str(weights), "--prompt-ids", ",".join(map(str, PROMPT)),
            "--steps", str(steps), "--steps-per-call", "2", "--json"]  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-c", RUN, str(build), *args], capture_output=True, text=True,
        timeout=600, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def _reference_weights(kind: str, spec, converted) -> dict:
    """The target's weights from its checkpoint and the drafter's as converted."""
    from mkgen.reference.hf_weights import load_hf_checkpoint
    from mkgen.weights.convert import read_manifest
    from mkgen.weights.draft import read_drafter

    _, _, weights = converted[kind]
    _, target = load_hf_checkpoint(_target_checkpoint(kind, converted["checkpoints"]))
    drafter = read_drafter(weights, read_manifest(weights), spec)
    if "lm_head" in drafter:  # the target's head, unpacked: the checkpoint's own
        np.testing.assert_array_equal(drafter.pop("lm_head"), target["lm_head"])
    return target | drafter


def _reference_drafts(spec, weights: dict, tokens: list[int], positions: list[int]) -> list:
    """Per position (ascending), the reference's drafts after tokens[position] from
    everything before it, and how far each draft's logit leads the runner-up: one
    draft_step per position, its caches carried from the one before (jitted, as
    tests/test_reference_draft.py replays the torch runs)."""
    import jax.numpy as jnp

    from mkgen.reference.draft import compile_draft_step, compile_traced, init_draft_state
    from mkgen.reference.model import init_cache

    target = spec.model_copy(update={"draft": None})
    run, draft = compile_traced(target), compile_draft_step(spec, ROWS)
    cache = init_cache(target, 1, len(tokens))
    state = init_draft_state(spec, 1, len(tokens) + ROWS)
    out, start = [], 0
    for position in positions:
        seen = jnp.asarray(tokens[start:position])[None]
        _, cache, hidden = run(weights, seen, cache)
        next_token = jnp.asarray(tokens[position : position + 1])
        drafts, logits, state = draft(weights, state, seen, hidden, next_token)
        top = np.sort(np.asarray(logits[0], np.float32), axis=-1)
        out.append((np.asarray(drafts[0]).tolist(), (top[:, -1] - top[:, -2]).tolist()))
        start = position
    return out


@pytest.mark.parametrize("kind", ["mtp", "block", "model", FUSED])
def test_the_runner_drafts_with_the_converted_drafter(kind: str, converted) -> None:
    import jax.numpy as jnp

    from mkgen.reference.model import generate

    spec, build, weights = converted[kind]
    run = _run(build, weights, STEPS[kind])
    reference = {k: jnp.asarray(v) for k, v in _reference_weights(kind, spec, converted).items()}
    target = spec.model_copy(update={"draft": None})
    greedy = generate(target, reference, np.asarray(PROMPT), STEPS[kind]).tolist()
    assert run["tokens"] == [greedy]
    (steps,) = run["accepted_per_step"]
    if kind == "model":  # a copy of the target: every row of every step accepted
        assert steps == [ROWS] * (STEPS[kind] // ROWS)
        return
    calls = sorted(run["calls"])  # [[position], drafts, usable] per device draft
    # Every step's drafts are the drafter's, the first after the prefill too (a kernel that
    # drafts: its prefill's, the MTP module's chain after the prompt).
    assert calls and all(usable == [True] for _, _, usable in calls), calls
    positions = [position for (position,), _, _ in calls]
    expected = _reference_drafts(spec, reference, PROMPT + greedy, positions)
    for (_, drafts, _), (want_drafts, leads) in zip(calls, expected, strict=True):
        for got, want, lead in zip(drafts[0], want_drafts, leads, strict=True):
            assert got == want or lead < TIE_MARGIN, (positions, drafts, want_drafts, leads)
            if got != want:
                break  # later drafts follow a different one


# ---------------------------------------------------------------- misfits, one line each


def _misfit(source: Path, where: Path, tensors=None, config=None) -> Path:
    """A copy of the drafter checkpoint `source` with its tensors and config changed."""
    shutil.copytree(source, where)
    if tensors is not None:
        save_file(tensors(load_file(where / "model.safetensors")), str(where / "model.safetensors"))
    if config is not None:
        data = json.loads((where / "config.json").read_text())
        (where / "config.json").write_text(json.dumps(config(data)))
    return where


def _without(name: str):
    return lambda tensors: {k: v for k, v in tensors.items() if k != name}


MISFITS = {
    "missing": (dict(tensors=_without("fc.weight")), "fc.weight: missing from the checkpoint"),
    "shape": (
        dict(tensors=lambda t: t | {"hidden_norm.weight": np.ones(32, np.float32)}),
        "hidden_norm.weight",
    ),
    "vocab": (dict(config=lambda c: c | {"vocab_size": 256}), "vocab_size is 256"),
    "layers": (
        dict(
            config=lambda c: c | {"dflash_config": {**c["dflash_config"], "target_layer_ids": [1]}}
        ),
        "draft.feature_layers",
    ),
}


@pytest.mark.parametrize("misfit", sorted(MISFITS))
def test_a_misfit_drafter_checkpoint_is_one_line_and_writes_nothing(
    misfit: str, converted, tmp_path, capsys
) -> None:
    change, fragment = MISFITS[misfit]
    _, build, _ = converted["block"]
    drafter = _misfit(converted["checkpoints"]["block"], tmp_path / "drafter", **change)
    code, err = _convert(
        "--build", str(build), "--checkpoint", str(FIXTURES / "qwen3"), "--draft-checkpoint",
        str(drafter), "-o", str(tmp_path / "w"), capsys=capsys,
    )  # fmt: skip
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert fragment in err and "Traceback" not in err
    assert not (tmp_path / "w").exists()


def test_a_build_without_a_drafter_refuses_a_drafter_checkpoint(converted, tmp_path, capsys):
    from mkgen.codegen.package import make_build
    from mkgen.plan.options import BuildOptions
    from mkgen.spec.hf_import import import_hf_config
    from mkgen.spec.topology import parse_topology

    build = tmp_path / "plain"
    options = BuildOptions.create(rows=ROWS, context=64)
    make_build(import_hf_config(FIXTURES / "qwen3"), parse_topology("1x1x1"), options, output=build)
    code, err = _convert(
        "--build", str(build), "--checkpoint", str(FIXTURES / "qwen3"), "--draft-checkpoint",
        str(converted["checkpoints"]["block"]), "-o", str(tmp_path / "w"), capsys=capsys,
    )  # fmt: skip
    assert code == 2 and "carries no drafter" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "w").exists()


def test_run_and_serve_refuse_weights_converted_without_the_drafter(converted, tmp_path):
    from cli_run import assert_user_error, mkgen

    _, build, _ = converted["block"]
    weights = tmp_path / "w"
    main(["convert", "--build", str(build), "--checkpoint", str(FIXTURES / "qwen3"),
          "-o", str(weights)])  # fmt: skip
    for command in ("run", "serve"):
        extra = ["--prompt-ids", "1,2"] if command == "run" else []
        result = mkgen(command, str(build), "--weights", str(weights), "--interpret", *extra)
        assert_user_error(
            result, "holds no weights of the build's block drafter", "--draft-checkpoint DRAFT",
            "--drafter ngram",
        )  # fmt: skip


def test_the_runner_refuses_another_drafters_weights(converted) -> None:
    from cli_run import assert_user_error, mkgen

    _, model_build, _ = converted["model"]
    _, _, block_weights = converted["block"]  # the same target, another drafter
    result = mkgen("run", str(model_build), "--weights", str(block_weights), "--interpret",
                   "--prompt-ids", "1,2")  # fmt: skip
    assert_user_error(result, "drafter weights are of another drafter (block)", "--drafter ngram")
