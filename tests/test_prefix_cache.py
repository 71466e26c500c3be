"""The serve engine's host cache on a model with recurrent layers (mkgen/serve/engine.py,
mkgen/serve/host_cache.py), in TPU interpret mode on virtual CPU devices.

A child process runs the engine over the qwen3_next fixture's architecture cut to two
Gated DeltaNet layers and a GQA one (each layer costs about 12 CPU s of interpret mode
here; with one recurrent layer the bound below would hold two sequences) at batch 2
with random weights, its host cache bounded to one sequence of the whole context. A recurrent state holds every token the kernel was fed,
so a sequence is kept only when that is exactly its tokens: of two sequences decoded in
one call, the one that ended first (its slot repeated its step in place) is not kept,
and neither is one cut at a stop id before the call's last token. A prompt extending the
kept sequence restores it and prefills only the rest; one that is the kept sequence plus
one token restores it with nothing to prefill; each gets the tokens the same prompt gets
without a hit.

The engine records the turns it took, as a multi-host job's process 0 shares them
(mkgen/serve/turns.py); a second engine then takes the same turns as a follower process
does, with its own caches and host cache, and gives every request the same tokens and
finish. The server's tests over HTTP are in tests/test_serve.py.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_convert import FIXTURES

PROMPT = [3, 17, 42, 99, 5, 64, 127, 23, 88, 11, 70, 36]  # the fixtures' prompt
WAIT_S = 300  # for one request's tokens, compiles included


def _child(build_dir: str) -> dict:
    """The engine's tokens and host cache counts along the requests the test describes."""
    from mkgen.runtime import devices
    from mkgen.runtime.build import runner_build

    build = runner_build(Path(build_dir))
    devices.configure(build, True)
    import threading

    import numpy as np

    from mkgen.runtime.decode import load_model
    from mkgen.serve.engine import Engine, GenerationParams, Request, Turn, Update
    from mkgen.serve.metrics import Metrics

    class Recorded:  # the turns taken, as process 0 would share them
        def __init__(self) -> None:
            self.turns: list[str] = []

        def share(self, turn: Turn | None) -> Turn:
            self.turns.append(turn.to_json())
            return Turn.from_json(self.turns[-1])

    class Replayed:  # process 0's turns, as a follower receives them
        def __init__(self, turns: list[str]) -> None:
            self.turns = iter(turns)

        def share(self, turn: Turn | None) -> Turn:
            assert turn is None
            return Turn.from_json(next(self.turns))

    model = load_model(build, None, 0)
    by_position = [
        a.name not in build.recurrent_kinds for a in model.layout.attention for _ in a.caches
    ]
    context = model.layout.context
    whole = per_position = 0  # a sequence's bytes: recurrent arrays, and a position's
    for (shape, dtype), positions in zip(model.kernel.cache_shapes(), by_position, strict=True):
        nbytes = build.devices * math.prod(shape) // build.batch * np.dtype(dtype).itemsize
        if positions:
            per_position += nbytes // context
        else:
            whole += nbytes
    limit = whole + per_position * context  # one sequence fits, whatever its length

    metrics, recorded = Metrics(), Recorded()
    engine = Engine(model, interpret=True, metrics=metrics, host_cache_bytes=limit, turns=recorded)
    answered: list[dict] = []

    def submit(prompt: list[int], max_tokens: int, stop: frozenset[int] = frozenset()):
        out: dict = {"tokens": [], "done": threading.Event(), "some": threading.Event()}
        answered.append(out)

        def deliver(update: Update) -> None:
            out["tokens"] += update.tokens
            out["some"].set()
            if update.finish_reason:
                out["finish"] = update.finish_reason
                out["done"].set()

        out["request"] = Request(prompt, GenerationParams(max_tokens, stop_ids=stop), deliver)
        engine.submit(out["request"])
        return out

    def tokens(asked: dict) -> list[int]:
        assert asked["done"].wait(WAIT_S), "no answer"
        return asked["tokens"]

    def counts() -> dict:
        names = {
            "sequences": "mkgen_host_cache_sequences",
            "hits": "mkgen_prefix_cache_hits_total",
            "misses": "mkgen_prefix_cache_misses_total",
            "reused": "mkgen_prefix_cache_tokens_reused_total",
            "evictions": "mkgen_host_cache_evictions_total",
            "bytes": "mkgen_host_cache_bytes",
        }
        return {k: metrics.registry.get_sample_value(n) for k, n in names.items()}

    short_prompt, long_prompt = PROMPT[:6], PROMPT[6:]
    # Both queued before the engine starts: admitted together, decoded in one call.
    short, long = submit(short_prompt, 2), submit(long_prompt, 6)
    engine.start()
    out = {"short": tokens(short), "long": tokens(long)}
    out["after_pair"] = counts()
    stop = out["long"][1]
    cut = submit(long_prompt, 6, frozenset({stop}))
    out["cut"], out["cut_finish"], out["after_cut"] = tokens(cut), cut["finish"], counts()
    extending = long_prompt + out["long"] + [5, 6]
    out["extending"] = tokens(submit(extending, 4))
    out["after_extending"] = counts()
    # Its own sequence, now cached in place of the long one, is longer than the prompt.
    out["extending_uncached"] = tokens(submit(extending, 4))
    one_more = extending + out["extending"]
    out["one_more"] = tokens(submit(one_more, 3))
    out["after_one_more"] = counts()
    out["one_more_uncached"] = tokens(submit(one_more, 3))
    out["end"] = counts()
    # Given up after its first tokens: it ends at a turn, here and on a follower alike.
    given_up = submit(PROMPT, 40)
    assert given_up["some"].wait(WAIT_S), "no tokens"
    engine.cancel(given_up["request"])
    out["limit"], out["sequence_bytes"] = limit, whole + per_position * len(extending)
    engine.stop()

    followed: dict[int, dict] = {}

    def follow(request_id: int, update: Update) -> None:
        got = followed.setdefault(request_id, {"tokens": [], "finish": None})
        got["tokens"] += update.tokens
        if update.finish_reason:
            got["finish"] = update.finish_reason

    follower = Engine(
        model, interpret=True, metrics=Metrics(), host_cache_bytes=limit,
        turns=Replayed(recorded.turns), follow=follow,
    )  # fmt: skip
    follower.run()
    out["answered"] = [{"tokens": a["tokens"], "finish": a.get("finish")} for a in answered]
    out["followed"] = [followed.get(i) for i in range(len(answered))]
    out["turns"] = len(recorded.turns)
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_recurrent_caches_are_reused_only_when_their_state_holds_exactly_the_kept_tokens(
    tmp_path: Path,
) -> None:
    from mkgen.codegen.package import make_build
    from mkgen.plan.options import BuildOptions
    from mkgen.spec.loader import load_spec
    from mkgen.spec.topology import parse_topology

    build = tmp_path / "qwen3_next-build"
    config = json.loads((FIXTURES / "qwen3_next" / "config.json").read_text())
    config.update(num_hidden_layers=3, layer_types=["linear_attention"] * 2 + ["full_attention"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = load_spec(tmp_path / "config.json")
    assert spec.layers.attention.expand(3, "attention") == ["linear", "linear", "full"]
    options = BuildOptions.create(context=64, batch=2)
    make_build(spec, parse_topology("1x1x1"), options, output=build)
    child = subprocess.run(
        [sys.executable, __file__, str(build)], capture_output=True, text=True, timeout=840,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}, cwd=Path(__file__).parent,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    out = json.loads(child.stdout.strip().splitlines()[-1])
    assert 2 * out["sequence_bytes"] > out["limit"], out  # the bound holds one sequence
    # A follower taking the same turns answers every request as process 0 did.
    assert out["followed"] == out["answered"], out
    assert len(out["answered"]) == 8 and out["turns"] >= 8
    given_up = out["answered"][-1]
    assert given_up["finish"] is None and 0 < len(given_up["tokens"]) < 40
    assert (len(out["short"]), len(out["long"])) == (2, 6)
    # The short sequence ended after 2 of the call's 6 steps: only the long one is kept
    # (had both been, the second would have evicted the first).
    assert out["after_pair"]["misses"] == 2
    assert (out["after_pair"]["sequences"], out["after_pair"]["evictions"]) == (1, 0)
    # Cut at a stop id within the call: not kept either.
    before_stop = out["long"][: out["long"].index(out["long"][1])]
    assert out["cut_finish"] == "stop" and out["cut"] == before_stop
    assert (out["after_cut"]["sequences"], out["after_cut"]["evictions"]) == (1, 0)
    # The long sequence's caches (prompt and 5 generated tokens) are restored; its entry
    # makes way for the extending prompt's own.
    assert out["after_extending"]["hits"] == 1
    assert out["after_extending"]["reused"] == len(PROMPT[6:]) + 5
    assert out["after_extending"]["evictions"] == 1
    assert out["extending"] == out["extending_uncached"] and len(out["extending"]) == 4
    # The extending prompt's whole sequence plus nothing to prefill: restored as it is.
    assert out["after_one_more"]["hits"] == 2
    extending = len(PROMPT[6:]) + 6 + 2
    assert out["after_one_more"]["reused"] - out["after_extending"]["reused"] == extending + 3
    assert out["one_more"] == out["one_more_uncached"] and len(out["one_more"]) == 3
    assert out["end"]["sequences"] == 1 and 0 < out["end"]["bytes"] <= out["limit"]


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1])))
