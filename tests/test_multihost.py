"""Multi-host through jax.distributed on CPU: two processes on loopback, each with its own
virtual device (one core of a 2-core build), CPU collectives through gloo.

Each process parses the runner's own options (--multi-host --interpret --coordinator
--num-processes --process-id), places only its own core's weights, receives process 0's
prompt (process 1 is given another one), and runs the XLA prefill across both processes:
each process's share of the kernel caches equals its core's cut of the reference
model's caches. Then process 0 shares mkgen serve's engine turns (mkgen/serve/turns.py)
and process 1 receives exactly them. The interpret-mode kernel cannot run across
processes (its simulated memory is per process): the runner and mkgen serve refuse that
in one line (docs/disaggregation.md); tests/test_prefix_cache.py replays a served run's
turns through a follower engine in one process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from cli_run import assert_user_error, mkgen

PROMPT = [3, 17, 42, 99, 5, 64, 127, 23, 88]  # 8 tokens prefilled: one chunk
OTHER_PROMPT = [1, 2]  # what process 1 is given: process 0's must replace it
CACHE_RTOL = 2e-2  # bf16 caches (tests/test_prefill.py)
PROCESSES = 2


def _turns() -> list:
    """What process 0's engine shares: arrivals (sampling parameters, stop ids), a
    cancellation, an idle turn, a longer prompt (a larger padded broadcast), the stop."""
    from mkgen.serve.engine import Arrival, GenerationParams, Turn

    sampled = GenerationParams(
        5, temperature=0.7, top_k=4, top_p=0.9, seed=3, stop_ids=frozenset({2, 9})
    )
    return [
        Turn((Arrival(0, PROMPT, GenerationParams(4)), Arrival(1, OTHER_PROMPT, sampled))),
        Turn(cancelled=frozenset({1})),
        Turn(),
        Turn((Arrival(2, list(range(300)), GenerationParams(1)),)),
        Turn(stopping=True),
    ]


def _child(directory: str, process: int, port: int) -> dict:
    """One process of the job: the ranks whose weights it read, the prompt it ended with,
    the devices it sees, and the largest relative difference of its cache shares from
    the reference's."""
    from mkgen.runtime import devices
    from mkgen.runtime.arguments import parse_args
    from mkgen.runtime.build import load_build, runner_build

    build = runner_build(Path(directory))
    prompt = PROMPT if process == 0 else OTHER_PROMPT
    argv = [
        "--interpret", "--random-weights", "0", "--prompt-ids", ",".join(map(str, prompt)),
        "--multi-host", "--coordinator", f"127.0.0.1:{port}", "--num-processes",
        str(PROCESSES), "--process-id", str(process),
    ]  # fmt: skip
    args = parse_args(build, argv, "child")
    devices.configure(build, args.interpret, processes=PROCESSES)
    devices.start_distributed(args)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from mkgen.reference import model as reference
    from mkgen.runtime.decode import Model, prefill_sequence
    from mkgen.runtime.weights import RandomWeights, place_weights

    prompts = devices.broadcast_prompts(args.prompts)
    spec, layout, kernel = load_build(build)
    mesh = devices.make_mesh(build, kernel, layout)

    class Counted(RandomWeights):  # which cores' weights this process reads
        def __init__(self, *given) -> None:
            super().__init__(*given)
            self.read: set[int] = set()

        def stream(self, rank: int) -> np.ndarray:
            self.read.add(rank)
            return super().stream(rank)

    weights = Counted(spec, layout, args.random_weights)
    placed = place_weights(build, weights, mesh, kernel)
    model = Model(build, spec, layout, kernel, mesh, weights, placed)
    known = prompts[0][:-1]
    caches = prefill_sequence(model, known)
    _, expected = reference.prefill(
        spec, weights.inventory, np.array([known]), layout.context, jnp.bfloat16
    )
    rank = list(mesh.devices.flat).index(jax.local_devices()[0])
    worst, arrays = 0.0, iter(caches)
    for kind in layout.attention:
        ours = {
            c.name: np.asarray(next(arrays).addressable_data(0), np.float32) for c in kind.caches
        }
        for slot, layer in enumerate(kind.layers):
            theirs = kind.cache_pieces(spec, expected["layers"][layer], rank)
            for name, value in theirs.items():
                value = np.asarray(value, np.float32)
                gap = np.abs(ours[name][0, slot] - value).max() / max(np.abs(value).max(), 1e-6)
                worst = max(worst, float(gap))
    from mkgen.serve.turns import BroadcastTurns

    channel = BroadcastTurns()
    shared = [channel.share(turn if process == 0 else None) for turn in _turns()]
    return {
        "turns_match": shared == _turns(),
        "process": jax.process_index(),
        "devices": jax.device_count(),
        "local": [d.id for d in jax.local_devices()],
        "rank": rank,
        "read": sorted(weights.read),
        "prompt": prompts[0],
        "worst": worst,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(330)
def test_two_processes_load_their_own_weights_prefill_together_and_share_turns(
    shared_build,
) -> None:
    build = shared_build("kimi_linear")  # MLA + KDA, MoE
    port = _free_port()
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    children = [
        subprocess.Popen(
            [sys.executable, __file__, str(build), str(process), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=Path(__file__).parent,
        )  # fmt: skip
        for process in range(PROCESSES)
    ]
    try:
        outputs = [child.communicate(timeout=300) for child in children]
    finally:
        for child in children:
            child.kill()  # only if still running (a timeout): ours, by handle
    results = []
    for child, (stdout, stderr) in zip(children, outputs, strict=True):
        assert child.returncode == 0, stderr[-3000:]
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    assert [r["process"] for r in results] == [0, 1]
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["devices"] == 2 and len(r["local"]) == 1
        assert r["read"] == [r["rank"]]  # its own core's weights only
        assert r["prompt"] == PROMPT  # process 0's, broadcast
        assert r["worst"] <= CACHE_RTOL, r
        assert r["turns_match"]  # process 0's engine turns, as it shared them


def test_the_runner_refuses_to_decode_across_processes_in_interpret_mode(shared_build) -> None:
    """Interpret mode simulates the cores' memory and semaphores per process: across
    processes the kernel's first remote DMA would wait forever, so the runner says so
    before connecting to anyone."""
    build = shared_build("qwen3")
    result = mkgen(
        "run", str(build), "--interpret", "--random-weights", "0", "--multi-host",
        "--coordinator", f"127.0.0.1:{_free_port()}", "--num-processes", "2", "--process-id", "0",
        timeout=120,
    )  # fmt: skip
    assert_user_error(result, "--multi-host --interpret:", "cannot decode across processes")


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--num-processes", "2"], "--multi-host --interpret: give --coordinator, --process-id"),
        (
            ["--coordinator", "127.0.0.1:1", "--num-processes", "3", "--process-id", "0"],
            "--num-processes: must divide the build's 2 devices in interpret mode, got 3",
        ),
    ],
)
def test_multi_host_interpret_flags_are_checked(
    shared_build, args: list[str], fragment: str
) -> None:
    build = shared_build("qwen3")
    result = mkgen(
        "run", str(build), "--interpret", "--random-weights", "0", "--multi-host", *args,
        timeout=120,
    )  # fmt: skip
    assert_user_error(result, f"mkgen run: error: {fragment}")


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
