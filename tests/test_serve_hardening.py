"""What keeps one request of `mkgen serve` from hurting the others, below the HTTP layer
(tests/test_serve.py holds the HTTP side, over a running server).

The engine runs in a child process over the qwen3 fixture's build at batch 4 with random
weights, in TPU interpret mode, its device call wrapped to fail whenever a request with a
poisoned top_k is in it: that request ends with an error alone and the three decoded in
the same call get the tokens they get without it; a request whose top_k is past int32
(which the HTTP layer refuses) is refused at admission alone; a request cancelled while
queued is counted. Without a process of their own: the text-to-ids bound, the warm-up's
prefill lengths, the guard (body cap, a fault as a 500) around a small app, and the
drain's decisions of DrainingServer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

WAIT_S = 300  # for a request's answer, the warm-up's compiles included
POISON = 13  # the top_k whose device call the child makes fail


def _child(build_dir: str) -> dict:
    """The engine's answers to the requests the module docstring describes, twice for the
    innocent ones: in the poisoned batch and again alone in a batch of their own."""
    from mkgen.runtime import devices
    from mkgen.runtime.build import runner_build

    build = runner_build(Path(build_dir))
    devices.configure(build, True)
    import threading

    import numpy as np

    from mkgen.runtime.decode import load_model
    from mkgen.serve.engine import Engine, GenerationParams, Request, Update
    from mkgen.serve.metrics import Metrics

    metrics = Metrics()
    engine = Engine(load_model(build, None, 0), interpret=True, metrics=metrics,
                    host_cache_bytes=0)  # fmt: skip
    device_call, calls = engine._decoder, []

    def faulty(history, positions, budget, count, sampling, *rest):
        top_k = np.asarray(sampling.top_k).tolist()
        calls.append({"count": int(count), "top_k": top_k})
        if POISON in top_k:
            raise RuntimeError("injected fault")
        return device_call(history, positions, budget, count, sampling, *rest)

    engine._decoder = faulty
    answers: list[dict] = []

    def submit(prompt: list[int], **params: float) -> dict:
        out: dict = {"tokens": [], "finish": None, "done": threading.Event()}

        def deliver(update: Update) -> None:
            out["tokens"] += update.tokens
            if update.finish_reason:
                out["finish"] = update.finish_reason
                out["done"].set()

        out["request"] = Request(prompt, GenerationParams(5, **params), deliver)
        engine.submit(out["request"])
        answers.append(out)
        return out

    innocent = [[3, 17, 42, 99], [5, 64, 127], [23, 88, 11, 70, 36]]
    # Queued before the engine starts: admitted in this order, decoded in one call.
    submit([7, 8, 9], top_k=2**31)
    first = [submit(prompt) for prompt in innocent]
    submit([3, 17, 42, 99], temperature=0.7, top_k=POISON, seed=1)
    engine.cancel(submit([1, 2, 3])["request"])
    calls_before = len(calls)
    engine.start()
    for out in answers[:-1]:
        assert out["done"].wait(WAIT_S), "no answer"
    warm_up_calls = calls_before + 1
    again = [submit(prompt) for prompt in innocent]
    for out in again:
        assert out["done"].wait(WAIT_S), "no answer"
    engine.stop()

    def shown(outs: list[dict]) -> list[dict]:
        return [{"tokens": o["tokens"], "finish": o["finish"]} for o in outs]

    counted = {
        reason: metrics.registry.get_sample_value("mkgen_requests_total", {"finish_reason": reason})
        for reason in ("error", "cancelled", "length")
    }
    return {"answers": shown(answers[:6]), "first": shown(first), "again": shown(again),
            "calls": calls[warm_up_calls:], "counted": counted}  # fmt: skip


@pytest.mark.timeout(900)
def test_a_request_whose_device_call_fails_ends_alone_and_the_batch_goes_on(
    shared_build: Callable[..., Path],
) -> None:
    build = shared_build("qwen3", batch=4)
    child = subprocess.run(
        [sys.executable, __file__, str(build)], capture_output=True, text=True, timeout=840,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}, cwd=Path(__file__).parent,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    out = json.loads(child.stdout.strip().splitlines()[-1])
    too_large, *innocent, poisoned, cancelled = out["answers"]
    # Refused at admission: it never reached a device call.
    assert too_large == {"tokens": [], "finish": "error"}
    assert poisoned == {"tokens": [], "finish": "error"}
    assert cancelled == {"tokens": [], "finish": None}
    # The three decoded beside the poisoned request got their tokens, the same as alone.
    assert innocent == out["first"] == out["again"]
    assert all(len(a["tokens"]) == 5 and a["finish"] == "length" for a in innocent)
    # The batch's call failed; a dry run (count 0) of each request alone found the poisoned
    # one; the call was made again without it.
    calls = out["calls"]
    assert POISON in calls[0]["top_k"] and calls[0]["count"] == 5
    dry_runs = calls[1:5]
    assert [c["count"] for c in dry_runs] == [0] * 4
    assert sum(POISON in c["top_k"] for c in dry_runs) == 1
    assert calls[5]["count"] == 5 and POISON not in calls[5]["top_k"]
    assert out["counted"] == {"error": 2, "cancelled": 1, "length": 6}
    assert "injected fault" in child.stderr and "Traceback" not in child.stderr


# ---------------------------------------------------------------- no process of its own


def _word_tokenizer(vocab: int = 128):
    """The tests' word-level tokenizer: tN is id N, whitespace dropped, unknown words t0."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer


class _Counting:
    """A tokenizer that counts the characters it is given to encode."""

    def __init__(self, tokenizer: object) -> None:
        self.tokenizer, self.characters = tokenizer, 0

    def encode_batch(self, texts: list[str], **options: bool) -> list:
        self.characters += sum(map(len, texts))
        return self.tokenizer.encode_batch(texts, **options)


def test_a_text_is_refused_after_its_first_slices_and_one_that_fits_gets_its_exact_ids() -> None:
    from mkgen.serve import tokens
    from mkgen.serve.tokens import encode_within

    tokenizer = _word_tokenizer()
    counting = _Counting(tokenizer)
    huge = "t5 " * 1_000_000  # 3 MB, a million tokens
    assert encode_within(counting, huge, True, 63) is None
    one_batch = tokens.SLICES_PER_BATCH * (tokens.SLICE_CHARS + tokens.CUT_SEARCH_CHARS)
    assert 0 < counting.characters <= one_batch
    # Mostly whitespace, which this tokenizer drops: 63 tokens in 200 kB. A bound from the
    # text's bytes alone would refuse it.
    spaced = "      ".join(f"t{i}" for i in range(63)) + " " * 200_000
    assert encode_within(tokenizer, spaced, True, 63) == list(range(63))
    assert encode_within(tokenizer, spaced + " t1", True, 63) is None
    # Unknown words of any length are one token each (t0).
    assert encode_within(tokenizer, "x" * 100_000 + " t7", True, 63) == [0, 7]


def test_the_warm_up_prefills_use_every_prompt_chunk() -> None:
    from mkgen.serve.engine import warm_up_prefills

    for longest in [*range(1, 70), 4094, 4095]:
        lengths = warm_up_prefills(longest)
        assert all(1 <= n <= longest for n in lengths), (longest, lengths)
        chunks = {1 << bit for n in lengths for bit in range(n.bit_length()) if n >> bit & 1}
        assert chunks == {1 << bit for bit in range(longest.bit_length())}, (longest, lengths)
    assert warm_up_prefills(62) == [32, 31] and warm_up_prefills(63) == [63]
    assert warm_up_prefills(0) == []


def test_the_guard_caps_bodies_and_turns_a_fault_into_a_500_error_object_and_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """mkgen/serve/guard.py around a FastAPI app of two routes, one that fails and one
    that reads its body: the fault is a 500 OpenAI error object and one log line without
    a traceback; bodies pass up to the cap and are 413 past it, declared or chunked."""
    from fastapi import FastAPI
    from starlette.responses import JSONResponse
    from starlette.testclient import TestClient

    from mkgen.serve.guard import Guard

    app = FastAPI()
    app.add_middleware(Guard, max_body=16)

    @app.post("/fails")
    async def fails() -> None:
        raise RuntimeError("a bug\nand its second line")

    async def reads(request) -> JSONResponse:
        return JSONResponse({"read": len(await request.body())})

    app.add_route("/reads", reads, methods=["POST"])

    client = TestClient(app)
    with caplog.at_level(logging.ERROR, logger="mkgen.serve"):
        failed = client.post("/fails")
    assert failed.status_code == 500
    assert failed.json()["error"] == {
        "message": "the server failed on this request (its log says why)",
        "type": "server_error", "param": None, "code": None,
    }  # fmt: skip
    assert caplog.messages == ["POST /fails: unexpected RuntimeError: a bug"]
    assert [r.exc_info for r in caplog.records] == [None]
    assert client.post("/reads", content=b"x" * 16).json() == {"read": 16}
    declared = client.post("/reads", content=b"x" * 17)
    chunked = client.post("/reads", content=iter([b"x" * 10, b"x" * 7]))
    for response in (declared, chunked):
        assert response.status_code == 413, response.text
        assert response.json()["error"]["code"] == "request_too_large"


class _Engine:
    """What DrainingServer asks of the engine, with the answers a test sets."""

    def __init__(self) -> None:
        self.busy, self.failure = True, None
        self.drained = self.stopped = False

    def drain(self) -> None:
        self.drained = True

    def request_stop(self) -> None:
        self.stopped = True


def _draining(drain_seconds: float) -> tuple:
    import uvicorn

    from mkgen.serve.server import DrainingServer

    engine = _Engine()
    server = DrainingServer(uvicorn.Config(lambda *_: None), engine, drain_seconds)
    return server, engine


def _tick(server) -> bool:
    return asyncio.run(server.on_tick(1))


def test_the_drain_waits_for_running_requests_then_stops_the_engine() -> None:
    server, engine = _draining(30)
    assert not _tick(server) and not engine.drained  # no signal yet
    server.handle_exit(signal.SIGTERM, None)
    assert not _tick(server) and engine.drained and not engine.stopped  # requests run on
    engine.busy = False  # they finished: the server stops before the 30 s
    assert _tick(server) and engine.stopped
    assert server._captured_signals == [signal.SIGTERM]  # re-raised at exit


def test_the_drain_ends_what_still_runs_when_its_time_is_over_or_on_a_second_signal() -> None:
    server, engine = _draining(0)
    server.handle_exit(signal.SIGTERM, None)
    assert _tick(server) and engine.stopped  # busy, but the drain time is over
    server, engine = _draining(30)
    server.handle_exit(signal.SIGTERM, None)
    assert not _tick(server)
    server.handle_exit(signal.SIGINT, None)  # a second signal: stop now
    assert _tick(server) and engine.stopped
    server, engine = _draining(30)
    engine.failure = "the warm-up failed"
    assert _tick(server) and engine.stopped  # no signal: nothing could be served


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1])))
