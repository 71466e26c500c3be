"""Prefill/decode disaggregation and cache offload (mkgen/runtime/disaggregation.py), in TPU
interpret mode on virtual CPU devices.

A child process with twice a build's devices puts the decode mesh on the first half and
the prefill mesh, with its own copy of the weights, on the other. For an MLA + KDA model
(latent caches and recurrent state) and a GQA + Gated DeltaNet one (KV caches and
recurrent state): the caches prefilled on the prefill mesh and handed over are the
colocated prefill's bit for bit, on the decode mesh's devices; offloaded to numpy and
restored they are still (so they decode to the colocated tokens: the kernel is a function
of its inputs). A prompt's first tokens' caches offloaded and the rest of it prefilled
after them on the prefill mesh (the server's host cache) are the whole prefill's caches.
The runner's --disaggregate decodes after such a hand-off and gives a checkpoint's
transformers tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_run import assert_user_error, mkgen
from test_convert import FIXTURES, write_sharded

PROMPT = [3, 17, 42, 99, 5, 64, 127, 23, 88, 11, 70, 36]  # the fixtures' prompt
CACHED = 5  # prompt tokens whose caches are offloaded before the rest is prefilled
FAMILIES = ["kimi_linear", "qwen3_next"]  # MLA + KDA; GQA + Gated DeltaNet


def _child(build_dirs: list[str]) -> dict:
    """Per build: whether the caches of a disaggregated prefill, offloaded and restored,
    matched the colocated prefill's bit for bit at each hand-off, which devices each mesh
    and the handed-over caches used, and the largest relative cache difference of a
    prefill continued after offloaded caches of the prompt's first CACHED tokens."""
    from mkgen.runtime import devices
    from mkgen.runtime.build import runner_build

    builds = [runner_build(Path(directory)) for directory in build_dirs]
    devices.configure(builds[0], True, meshes=2)  # every build here has 2 cores
    import numpy as np

    from mkgen.runtime import disaggregation
    from mkgen.runtime.decode import load_model, prefill_sequence

    results = {}
    for directory, build in zip(build_dirs, builds, strict=True):
        model = load_model(build, None, 0, meshes=2)
        prefiller = disaggregation.prefill_model(model)
        known = PROMPT[:-1]  # the last prompt token is the kernel's first row
        colocated = prefill_sequence(model, known)
        on_prefill_mesh = prefill_sequence(prefiller, known)
        handed = disaggregation.hand_over(on_prefill_mesh, model)
        host = disaggregation.offload(handed)
        restored = disaggregation.restore(host, model)

        def same(ours, theirs):
            return all(
                np.array_equal(np.asarray(a), np.asarray(b))
                for a, b in zip(ours, theirs, strict=True)
            )

        def ids(arrays):
            return sorted({d.id for a in arrays for d in a.sharding.device_set})

        prefix = disaggregation.offload(prefill_sequence(model, known[:CACHED]))
        continued = prefill_sequence(prefiller, known[CACHED:], CACHED, prefix)
        continued = disaggregation.hand_over(continued, model)

        def relative(ours, theirs):
            ours, theirs = np.asarray(ours, np.float32), np.asarray(theirs, np.float32)
            return float(np.abs(ours - theirs).max() / max(np.abs(theirs).max(), 1e-6))

        results[directory] = {
            "continued_worst": max(map(relative, continued, colocated)),
            "handed_equal": same(handed, colocated),
            "restored_equal": same(restored, colocated),
            "host_types": sorted({type(a).__name__ for a in host}),
            "decode_devices": ids([model.placed["stream"]]),
            "prefill_devices": ids([prefiller.placed["stream"]]),
            "prefilled_on": ids(on_prefill_mesh),
            "handed_on": ids(handed),
            "restored_on": ids(restored),
        }
    return results


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_prefill_mesh_hands_the_decode_mesh_the_colocated_caches(shared_build) -> None:
    builds = [str(shared_build(folder)) for folder in FAMILIES]
    child = subprocess.run(
        [sys.executable, __file__, *builds], capture_output=True, text=True, timeout=840,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}, cwd=Path(__file__).parent,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    results = json.loads(child.stdout.strip().splitlines()[-1])
    for build in builds:
        out = results[build]
        assert out["decode_devices"] == [0, 1] and out["prefill_devices"] == [2, 3], out
        assert out["prefilled_on"] == [2, 3] and out["handed_on"] == out["restored_on"] == [0, 1]
        assert out["handed_equal"] and out["restored_equal"], out
        assert out["host_types"] == ["ndarray"]
        assert out["continued_worst"] < 1e-4, out


@pytest.mark.slow
def test_the_runner_disaggregated_gives_the_transformers_tokens(
    shared_build, tmp_path: Path
) -> None:
    """--disaggregate with converted weights: the greedy tokens the colocated runner gives
    on this checkpoint (tests/test_runner.py), transformers' own; --bench reports the
    prefill's tokens/s."""
    import numpy as np

    from mkgen.cli import main

    checkpoint = write_sharded(FIXTURES / "kimi_linear", tmp_path / "ckpt")
    build = shared_build("kimi_linear")
    main(
        [
            "convert",
            "--checkpoint",
            str(checkpoint),
            "-o",
            str(tmp_path / "w"),
            "--build",
            str(build),
        ]
    )
    steps = 4  # of the 8 the colocated runner gives this checkpoint (tests/test_runner.py)
    expected = np.load(FIXTURES / "kimi_linear" / "expected.npz")["greedy_ids"][:steps].tolist()
    result = mkgen(
        "run", str(build), "--interpret", "--disaggregate", "--weights", str(tmp_path / "w"),
        "--prompt-ids", ",".join(map(str, PROMPT)), "--steps", str(steps), "--json", "--bench",
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout)
    assert out["tokens"] == [expected]
    assert out["bench"]["prefill_tokens"] == len(PROMPT) - 1
    assert out["bench"]["prefill_tokens_per_s"] > 0


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--prefill", "kernel"], "--disaggregate: only with --prefill xla"),
        (["--multi-host"], "--disaggregate: not with --multi-host"),
    ],
)
def test_disaggregate_refuses_what_it_cannot_do(
    shared_build, args: list[str], fragment: str
) -> None:
    build = shared_build("qwen3")
    result = mkgen("run", str(build), "--random-weights", "0", "--disaggregate", *args, timeout=120)
    assert_user_error(result, f"mkgen run: error: {fragment}")


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1:])))
