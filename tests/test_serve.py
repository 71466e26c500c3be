"""`mkgen serve` on loopback, talked to with the official `openai` client.

One server per module (a subprocess, `mkgen serve --interpret --port 0`) over the qwen3
transformers fixture re-published as the hub does, with the word-level tokenizer of
tests/test_runner.py and the hand-written chat template of tests/fixtures/chat, built for
tpu7x:1x1x1 at batch 4 and converted with `mkgen convert --build`; the module's server
caps bodies at 1 MiB and drains for 1 s. Greedy tokens are held to transformers' own
(the fixture's) and to the plain-JAX reference model's; the server warms up before it
reports healthy; requests run concurrently in the kernel's batch slots; bad requests are
400s (404, 405, 413 beyond them), all OpenAI error objects, that leave the server
serving; a text too long for the context is refused while /health answers; a client
that leaves mid-stream frees its slot; a chat's second turn reuses the first turn's
caches from the host cache and gets the tokens of a server without one; a short soak
mixes normal and hostile requests (scripts/serve_soak.py); SIGTERM lets a running stream
finish and ends the rest with abort. The engine's pieces without a server (slots, text
assembly, the host cache) are checked last; tests/test_serve_hardening.py has the
engine's fault isolation and the guard, text bound and drain without a server.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import httpx
import numpy as np
import openai
import pytest
from cli_run import assert_user_error, mkgen
from test_convert import FIXTURES, write_sharded
from test_runner import PROMPT, _build, _convert, _with_tokenizer, _words

CHAT = Path(__file__).parent / "fixtures" / "chat"
BATCH = 4  # the build's slots
EOS = 2  # tokenizer_config.json's eos_token t2: every request stops at it
NAME = "config"  # the served model: the build's spec name (the fixture's config.json)
STARTUP_S = 240  # convert, load and place the weights, first compiles: bounded
MAX_BODY = 1 << 20  # the module server's --max-body-mib 1


@dataclass
class Server:
    """A running `mkgen serve` and what it serves."""

    process: subprocess.Popen
    url: str
    checkpoint: Path
    stderr: list[str] = field(default_factory=list)
    health: list[tuple[int, dict]] = field(default_factory=list)  # /health while starting

    @property
    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="any", max_retries=0, timeout=300)

    def metric(self, name: str) -> float:
        """A metric's value from GET /metrics (0 when it has none yet)."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
        return float(found.group(1)) if found else 0.0


def _start(build: Path, weights: Path, checkpoint: Path, *options: str) -> Server:
    command = [
        sys.executable, "-m", "mkgen.cli", "serve", str(build), "--weights", str(weights),
        "--interpret", "--port", "0", "--queue-limit", "0", *options,
    ]  # fmt: skip
    process = subprocess.Popen(
        command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )  # fmt: skip
    server = Server(process, "", checkpoint)

    def drain() -> None:  # JAX's warnings must not fill the pipe
        assert process.stderr is not None
        for line in process.stderr:
            server.stderr.append(line)

    threading.Thread(target=drain, daemon=True).start()
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline and process.poll() is None:
        found = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", "".join(server.stderr))
        if found:
            server.url = found.group(1)
            try:
                health = httpx.get(f"{server.url}/health", timeout=5)
                server.health.append((health.status_code, health.json()))
                if health.status_code == 200:
                    return server
            except httpx.TransportError:
                pass
        time.sleep(0.2)
    process.kill()
    raise AssertionError("the server did not start:\n" + "".join(server.stderr)[-3000:])


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(build, weights, checkpoint): qwen3 at batch 4, converted with its tokenizer files."""
    tmp = tmp_path_factory.mktemp("serve")
    checkpoint = _with_tokenizer(write_sharded(FIXTURES / "qwen3", tmp / "ckpt"))
    shutil.copy(CHAT / "tokenizer_config.json", checkpoint)
    build = _build(tmp, "qwen3", batch=BATCH)
    return build, _convert(checkpoint, build, tmp / "w"), checkpoint


@pytest.fixture(scope="module")
def servers(prepared: tuple[Path, Path, Path]) -> Iterator[list[Server]]:
    started: list[Server] = []
    yield started
    for server in started:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait(timeout=60)


@pytest.fixture
def server(prepared: tuple[Path, Path, Path], servers: list[Server]) -> Server:
    """The module's server (bodies capped at 1 MiB, a drain of 1 s); started again if a
    test (SIGTERM) stopped it."""
    if not servers or servers[-1].process.poll() is not None:
        servers.append(_start(*prepared, "--max-body-mib", "1", "--drain-seconds", "1"))
    return servers[-1]


@functools.cache
def _checkpoint(checkpoint: Path) -> tuple:
    from mkgen.reference.hf_weights import load_hf_checkpoint

    return load_hf_checkpoint(checkpoint)


def _reference(checkpoint: Path, prompt: list[int], steps: int) -> list[int]:
    """The plain-JAX reference's greedy tokens on the checkpoint, cut after EOS as the
    server stops there (the EOS itself is not returned)."""
    from mkgen.reference import model as reference

    spec, inventory = _checkpoint(checkpoint)
    ids = reference.generate(spec, inventory, np.array(prompt), steps).tolist()
    return ids[: ids.index(EOS)] if EOS in ids else ids


def _script(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """scripts/NAME.py (the soak test and its helpers), imported as the scripts import
    each other: with scripts/ on the path."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "scripts"))
    return importlib.import_module(name)


def _stream_text(stream: openai.Stream) -> tuple[str, list[int], str | None]:
    """The text, token ids and finish reason of a streamed completion or chat completion."""
    text, ids, finish = "", [], None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta.content if hasattr(choice, "delta") else choice.text
            text += delta or ""
            ids += choice.model_extra.get("token_ids") or []
            finish = choice.finish_reason or finish
    return text, ids, finish


def test_completions_from_ids_and_text_are_transformers_greedy_tokens(server: Server) -> None:
    """The fixture's prompt as ids, as text, and streamed, sent at once (one batch): each
    gives transformers' greedy tokens; the streamed text is the non-streamed text."""
    client, name = server.client, NAME
    expected = np.load(FIXTURES / "qwen3" / "expected.npz")["greedy_ids"].tolist()
    asks = {"model": name, "max_tokens": 8, "temperature": 0}
    with ThreadPoolExecutor(3) as pool:
        from_ids = pool.submit(client.completions.create, prompt=PROMPT, **asks)
        from_text = pool.submit(client.completions.create, prompt=_words(PROMPT), **asks)
        streamed = pool.submit(
            lambda: _stream_text(
                client.completions.create(
                    prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **asks
                )
            )
        )
    for result in (from_ids.result(), from_text.result()):
        choice = result.choices[0]
        assert choice.model_extra["token_ids"] == expected
        assert choice.text == _words(expected)
        assert choice.finish_reason == "length"
        assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (12, 8)
    assert streamed.result() == (_words(expected), expected, "length")


def test_stop_strings_and_stop_ids_end_a_completion(server: Server) -> None:
    """The fixture's greedy tokens are t63 t70 t97 t127 t97 ...: a stop string ends the
    text before it (streamed), a stop id ends the tokens before it (it is counted in
    usage, not returned); both finish with "stop"."""
    client = server.client
    # Room for one token past the stop (t127 is the fourth): both end by "stop".
    asks = {"model": NAME, "prompt": PROMPT, "max_tokens": 5, "temperature": 0}
    with ThreadPoolExecutor(2) as pool:
        by_text = pool.submit(lambda: _stream_text(client.completions.create(
            stream=True, stop=["t97 t127"], **asks)))  # fmt: skip
        by_id = pool.submit(client.completions.create, stop=[127], **asks)
    text, _, finish = by_text.result()
    assert (text, finish) == ("t63 t70 ", "stop")
    result = by_id.result()
    assert result.choices[0].model_extra["token_ids"] == [63, 70, 97]
    assert (result.choices[0].text, result.choices[0].finish_reason) == ("t63 t70 t97", "stop")
    assert result.usage.completion_tokens == 4


def test_chat_completions_render_the_checkpoint_chat_template(
    server: Server, prepared: tuple[Path, Path, Path]
) -> None:
    """A chat through tokenizer_config.json's template (which mkgen convert copied beside
    the weights; bos, roles, the generation prompt; tokenized without adding special
    tokens): the reference's greedy tokens for exactly those ids, streamed and not."""
    weights = prepared[1]
    config = (CHAT / "tokenizer_config.json").read_bytes()
    assert (weights / "tokenizer_config.json").read_bytes() == config
    assert "tokenizer_config.json" in json.loads((weights / "layout.json").read_text())["files"]
    client = server.client
    messages = [{"role": "user", "content": "t3 t17 t42 t99 t5"}]
    # t1 bos, t4 t5 t9 t2 the default system turn, t4 t6 ... t2 the user's, t4 t7 the reply's
    rendered = [1, 4, 5, 9, 2, 4, 6, 3, 17, 42, 99, 5, 2, 4, 7]
    expected = _reference(server.checkpoint, rendered, 6)
    asks = {"model": NAME, "messages": messages, "max_tokens": 6, "temperature": 0}
    with ThreadPoolExecutor(2) as pool:
        whole = pool.submit(client.chat.completions.create, **asks)
        streamed = pool.submit(lambda: _stream_text(client.chat.completions.create(
            stream=True, **asks)))  # fmt: skip
    result = whole.result()
    assert result.usage.prompt_tokens == len(rendered)
    assert result.choices[0].model_extra["token_ids"] == expected
    assert result.choices[0].message.content == _words(expected)
    assert result.choices[0].message.role == "assistant"
    assert streamed.result()[:2] == (_words(expected), expected)


def test_concurrent_requests_each_get_their_own_tokens(server: Server) -> None:
    """Four prompts of different lengths and lengths to generate fill the four slots at
    once; each gets the reference's greedy tokens for its own prompt, and a seeded sampled
    request gets the same tokens in a full batch as alone (the draw depends on the seed
    and the sequence's positions only). A fifth request meanwhile finds every slot taken
    (--queue-limit 0): 429 with Retry-After; the server keeps serving."""
    client, name = server.client, NAME
    # Each holds its slot over two device calls of 8 steps (9 or 10 tokens; the first
    # prompt stops at EOS after 9), so all four hold theirs during the call in which the
    # last is admitted, when the fifth request comes (20 tokens each took twice the calls).
    prompts = [PROMPT[:5], PROMPT[3:12], [7, 8, 9]]
    steps = [10, 9, 10]
    sampled_asks = {"model": name, "prompt": PROMPT, "max_tokens": 10, "temperature": 0.9,
                    "top_p": 0.95, "seed": 7,
                    "extra_body": {"top_k": 20, "ignore_eos": True}}  # fmt: skip
    with ThreadPoolExecutor(4) as pool:
        greedy = [
            pool.submit(client.completions.create, model=name, prompt=p, max_tokens=n,
                        temperature=0)
            for p, n in zip(prompts, steps, strict=True)
        ]  # fmt: skip
        in_batch = pool.submit(client.completions.create, **sampled_asks)
        deadline = time.monotonic() + 60
        while server.metric("mkgen_slots_in_use") + server.metric("mkgen_queue_depth") < 4:
            assert time.monotonic() < deadline, "the four requests never held the slots"
            time.sleep(0.05)
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(model=name, prompt=PROMPT, max_tokens=1)
        assert refused.value.response.headers["retry-after"] == "1"
        assert refused.value.body["type"] == "rate_limit_error"
    for future, prompt, n in zip(greedy, prompts, steps, strict=True):
        assert future.result().choices[0].model_extra["token_ids"] == _reference(
            server.checkpoint, prompt, n
        )
    alone = client.completions.create(**sampled_asks).choices[0].model_extra["token_ids"]
    assert in_batch.result().choices[0].model_extra["token_ids"] == alone
    assert len(alone) == 10 and all(0 <= t < 128 for t in alone)


BAD_REQUESTS = [
    # (endpoint, raw body, the param named, a fragment of the message)
    ("completions", b"{not json", None, "not valid JSON"),
    ("completions", b"[1, 2]", None, "a JSON object"),
    ("completions", {"prompt": [1]}, "model", "Field required"),
    ("completions", {"model": NAME, "prompt": [1] * 64}, "prompt", "context of 64"),
    ("completions", {"model": NAME, "prompt": [1] * 60, "max_tokens": 5}, "max_tokens", "at most 4"),
    ("completions", {"model": NAME, "prompt": [1], "max_tokens": 0}, "max_tokens", "at least 1"),
    ("completions", {"model": NAME, "prompt": [1], "max_tokens": -3}, "max_tokens", "at least 1"),
    ("completions", {"model": NAME, "prompt": [1], "temperature": -0.5}, "temperature", "0 (greedy)"),
    ("completions", {"model": NAME, "prompt": [1], "temperature": 1e-30}, "temperature", ">= 1e-05"),
    ("completions", b'{"model": "config", "prompt": [1], "temperature": NaN}', "temperature", "nan"),
    ("completions", {"model": NAME, "prompt": [1], "top_p": 0}, "top_p", "(0, 1]"),
    ("completions", {"model": NAME, "prompt": [1], "top_p": 1.5}, "top_p", "(0, 1]"),
    ("completions", {"model": NAME, "prompt": [1], "top_p": 1e-50}, "top_p", "(0, 1]"),
    ("completions", b'{"model": "config", "prompt": [1], "top_p": NaN}', "top_p", "(0, 1]"),
    ("completions", {"model": NAME, "prompt": [1], "top_k": 129}, "top_k", "[0, 128]"),
    ("completions", {"model": NAME, "prompt": [1], "top_k": 2**31}, "top_k", "[0, 128]"),
    ("completions", {"model": NAME, "prompt": [1], "top_k": -2}, "top_k", "[0, 128]"),
    ("completions", {"model": NAME, "prompt": [1, 128]}, "prompt", "token id 128"),
    ("completions", {"model": NAME, "prompt": [-1]}, "prompt", "token id -1"),
    ("completions", {"model": NAME, "prompt": [1], "stop": [5, 999]}, "stop", "token id 999"),
    ("completions", {"model": NAME, "prompt": [1], "stop": ["a"] * 17}, "stop", "at most 16"),
    ("completions", {"model": NAME, "prompt": [1], "stop": "x" * 257}, "stop", "1 to 256"),
    ("completions", {"model": NAME, "prompt": [1], "stop": ""}, "stop", "1 to 256"),
    ("completions", {"model": NAME, "prompt": [1], "stop_token_ids": [1] * 257},
     "stop_token_ids", "at most 256"),
    ("completions", {"model": NAME, "prompt": []}, "prompt", "empty"),
    ("completions", {"model": NAME, "prompt": [1], "seed": -1}, "seed", "[0, 2^32)"),
    ("completions", {"model": NAME, "prompt": [1], "seed": 2**32}, "seed", "[0, 2^32)"),
    ("completions", {"model": NAME, "prompt": [1], "n": 2}, "n", "only 1"),
    # Strict types: nothing is coerced.
    ("completions", {"model": NAME, "prompt": [1], "max_tokens": "5"}, "max_tokens", "integer"),
    ("completions", {"model": NAME, "prompt": [1], "max_tokens": 5.0}, "max_tokens", "integer"),
    ("completions", {"model": NAME, "prompt": [1], "stream": "yes"}, "stream", "boolean"),
    ("completions", {"model": NAME, "prompt": [1], "seed": True}, "seed", "integer"),
    ("completions", {"model": NAME, "prompt": [True, False]}, "prompt", "a list of token ids"),
    ("completions", {"model": NAME, "prompt": [1], "stop": 7}, "stop", "a string or a list"),
    ("completions", {"model": 5, "prompt": [1]}, "model", "string"),
    ("completions", {"model": NAME, "prompt": [1], "stream_options": {"include_usage": 1}},
     "stream_options.include_usage", "boolean"),
    # JSON no parser should take.
    ("completions", b'{"model": "config", "prompt": "t1 \\ud800"}', None, "surrogate pair"),
    ("completions", b'{"model": "config", "prompt": [1], "x": ' + b"[" * 100_000
     + b"]" * 100_000 + b"}", None, "recursion limit"),
    ("completions", b'{"model": "config", "prompt": "\xff"}', None, "not valid JSON"),
    ("chat/completions", {"model": NAME, "messages": [{"role": "tool", "content": "t1"}]},
     "messages", "roles are system, user and assistant, got tool"),
    ("chat/completions", {"model": NAME, "messages": [{"role": "user"}]}, "messages", "content"),
    ("chat/completions", {"model": NAME, "messages": "t1"}, "messages", "valid array"),
]  # fmt: skip


def test_bad_requests_are_400s_with_an_openai_error_and_the_server_keeps_serving(
    server: Server,
) -> None:
    for endpoint, body, param, fragment in BAD_REQUESTS:
        if isinstance(body, dict):
            body = json.dumps(body).encode()
        response = httpx.post(
            f"{server.url}/v1/{endpoint}", content=body, timeout=30,
            headers={"content-type": "application/json"},
        )  # fmt: skip
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param, error
        assert fragment in error["message"], (body, error)
    with pytest.raises(openai.BadRequestError, match="top_p: must be in"):
        server.client.completions.create(model=NAME, prompt=[1], top_p=2)
    assert httpx.get(f"{server.url}/health", timeout=30).json() == {"status": "ok"}


def test_the_server_warms_up_before_it_reports_healthy(
    server: Server, servers: list[Server]
) -> None:
    """The module's first server answered /health with 503 "warming up" while it compiled
    (the prefill's chunks and the decoding call), then 200 "ok"; it logged one line as the
    warm-up began and one as it ended, with its duration. It serves the spec's name."""
    first = servers[0]
    assert (503, {"status": "warming up"}) in first.health
    assert first.health[-1] == (200, {"status": "ok"})
    log = "".join(first.stderr)
    assert f"serving {NAME} (build config-1x1x1) at http://127.0.0.1:" in log
    assert "mkgen serve: warming up: compiling the prefill and the decoding call" in log
    assert re.search(r"mkgen serve: warm in \d+\.\d s: taking requests", log)
    assert log.index("warming up") < log.index("warm in")


def test_refusals_beyond_400_are_openai_error_objects(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unknown model is 404 model_not_found, an unknown path 404, a wrong method 405;
    a body over the cap (--max-body-mib 1) is 413 before it is read: with a Content-Length
    over it and no body sent, and a chunked body sent to just past the cap and never
    ended (a server that read it whole would never answer)."""
    soak = _script("serve_soak", monkeypatch)

    def error(response: httpx.Response, status: int) -> dict:
        assert response.status_code == status, response.text
        body = response.json()["error"]
        assert set(body) == {"message", "type", "param", "code"}, body
        return body

    unknown = httpx.post(f"{server.url}/v1/completions", json={"model": "gpt-4", "prompt": [1]})
    assert error(unknown, 404)["code"] == "model_not_found"
    assert "serves 'config', not 'gpt-4'" in error(unknown, 404)["message"]
    path = httpx.post(f"{server.url}/v1/chat", json={})
    assert "no such endpoint: POST /v1/chat" in error(path, 404)["message"]
    method = httpx.get(f"{server.url}/v1/completions")
    assert "allowed: POST" in error(method, 405)["message"]
    for what, request in soak.oversized(MAX_BODY):
        status, body = asyncio.run(soak.raw_exchange(server.url, request))
        assert status == 413, (what, body)
        assert json.loads(body)["error"]["code"] == "request_too_large", what
    assert httpx.get(f"{server.url}/health", timeout=30).json() == {"status": "ok"}


def test_a_text_too_long_for_the_context_is_refused_and_health_answers_meanwhile(
    server: Server,
) -> None:
    """Four texts of a million bytes each (a third of a million tokens, under the body
    cap) sent at once: each is refused (context_length_exceeded) after its first slices
    are counted, while /health, asked all along, answers within a second."""
    text = "t5 " * (MAX_BODY // 3 - 20)
    body = json.dumps({"model": NAME, "prompt": text}).encode()
    assert len(body) < MAX_BODY
    latencies: list[float] = []

    def post(_: int) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/completions", content=body, timeout=60)

    with ThreadPoolExecutor(4) as pool:
        answers = pool.map(post, range(4))
        with httpx.Client(timeout=30) as client:
            for _ in range(8):
                start = time.perf_counter()
                assert client.get(f"{server.url}/health").status_code == 200
                latencies.append(time.perf_counter() - start)
                time.sleep(0.05)
        for response in answers:
            assert response.status_code == 400, response.text
            assert response.json()["error"]["code"] == "context_length_exceeded"
    assert max(latencies) < 1.0, latencies


def test_a_client_that_leaves_mid_stream_frees_its_slot(server: Server) -> None:
    cancelled = 'mkgen_requests_total{finish_reason="cancelled"}'
    before = server.metric(cancelled)
    generated = server.metric("mkgen_generation_tokens_total")
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 40, "stream": True,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as stream:
        first = next(line for line in stream.iter_lines() if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["token_ids"]
    deadline = time.monotonic() + 120
    while server.metric(cancelled) == before or server.metric("mkgen_slots_in_use"):
        assert time.monotonic() < deadline, httpx.get(f"{server.url}/metrics").text
        time.sleep(0.1)
    assert server.metric("mkgen_generation_tokens_total") - generated < 40  # not all of it


def test_models_health_and_metrics(server: Server) -> None:
    """/v1/models lists the build; after a request of one prompt token (nothing to
    prefill: its slot's caches are zeroed, and it still gets the reference's tokens) the
    metrics count it and no slot stays taken."""
    client = server.client
    assert [m.id for m in client.models.list()] == [NAME]
    result = client.completions.create(model=NAME, prompt=[5], max_tokens=3, temperature=0)
    assert result.choices[0].model_extra["token_ids"] == _reference(server.checkpoint, [5], 3)
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    for name in ("mkgen_time_to_first_token_seconds_count", "mkgen_generation_tokens_total",
                 "mkgen_inter_token_latency_seconds_count", "mkgen_accepted_length_count",
                 "mkgen_prompt_tokens_total"):  # fmt: skip
        assert server.metric(name) > 0, name
    assert server.metric("mkgen_slots") == BATCH
    assert "mkgen_queue_depth 0.0" in text and "mkgen_slots_in_use 0.0" in text


def test_a_disaggregated_server_gives_the_colocated_tokens(
    prepared: tuple[Path, Path, Path], server: Server
) -> None:
    """--disaggregate prefills on devices of its own (the decode mesh's caches come from
    another mesh): two greedy prompts and a seeded sampled one, sent at once, get what
    the colocated server gives them, and the greedy ones the reference's tokens. Started
    with --host-cache-mib 0, it keeps no finished sequence and counts no lookup."""
    asks = [
        {"prompt": PROMPT, "max_tokens": 6, "temperature": 0},
        {"prompt": PROMPT[2:9], "max_tokens": 5, "temperature": 0},
        {"prompt": PROMPT[4:], "max_tokens": 6, "temperature": 0.8, "seed": 3},
    ]

    def tokens(client: openai.OpenAI) -> list[list[int]]:
        with ThreadPoolExecutor(len(asks)) as pool:
            results = [pool.submit(client.completions.create, model=NAME, **a) for a in asks]
        return [r.result().choices[0].model_extra["token_ids"] for r in results]

    disaggregated = _start(*prepared, "--disaggregate", "--host-cache-mib", "0")
    try:
        started = "".join(disaggregated.stderr)
        assert "prefill on its own devices" in started and "host cache off" in started
        split = tokens(disaggregated.client)
        assert _prefix_cache(disaggregated) == (0, 0, 0)
        assert disaggregated.metric("mkgen_host_cache_bytes") == 0
        assert disaggregated.metric("mkgen_host_cache_sequences") == 0
    finally:
        disaggregated.process.kill()
        disaggregated.process.wait(timeout=60)
    assert split == tokens(server.client)
    assert split[:2] == [
        _reference(server.checkpoint, a["prompt"], a["max_tokens"]) for a in asks[:2]
    ]
    assert len(split[2]) == 6


def test_a_build_with_drafts_serves_the_tokens_of_one_without(
    prepared: tuple[Path, Path, Path], server: Server, tmp_path: Path
) -> None:
    """A rows-4 build of the same model (the same converted weights) verifies three
    prompt-lookup drafts per step on the device: concurrent greedy requests get the
    rows-1 server's tokens, and the repeating start of the fixture's continuation (63 70
    97 127 97 127 97 127) is drafted and accepted (a mean accepted length above 1.2 in
    /metrics); a seeded sampled
    request through the rejection rule gets the same tokens twice; the context left for a
    request is 64 - 3 (the drafts' rows)."""
    _, weights, checkpoint = prepared
    build = _build(tmp_path, "qwen3", batch=BATCH, rows=4)
    drafting = _start(build, weights, checkpoint, "--served-model-name", "qwen3-drafts")
    # The fixture's 8 greedy tokens, whose repeats prompt lookup drafts and the kernel
    # accepts (16 tokens ran the same drafts and acceptance for 8 more kernel steps).
    asks = [
        {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}},
        {"prompt": PROMPT[3:10], "max_tokens": 6, "temperature": 0},
    ]
    sampled = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0.9, "seed": 5}

    def tokens(target: Server, requests: list[dict]) -> list[list[int]]:
        name = "qwen3-drafts" if target is drafting else NAME
        with ThreadPoolExecutor(len(requests)) as pool:
            create = target.client.completions.create
            results = [pool.submit(create, model=name, **a) for a in requests]
        return [r.result().choices[0].model_extra["token_ids"] for r in results]

    try:
        repeating = tokens(drafting, [asks[0]])[0]  # alone
        accepted = (
            drafting.metric("mkgen_accepted_length_sum")
            / drafting.metric("mkgen_accepted_length_count")
        )  # fmt: skip
        with_drafts = tokens(drafting, [*asks, sampled])
        again = tokens(drafting, [sampled])[0]
        models = httpx.get(f"{drafting.url}/v1/models", timeout=30).json()
    finally:
        drafting.process.kill()
        drafting.process.wait(timeout=60)
    assert with_drafts[:2] == tokens(server, asks)
    assert with_drafts[0] == np.load(FIXTURES / "qwen3" / "expected.npz")["greedy_ids"].tolist()
    assert repeating == with_drafts[0]
    assert accepted > 1.2
    assert with_drafts[2] == again and all(0 <= t < 128 for t in again)
    assert models["data"][0]["max_model_len"] == 61
    assert models["data"][0]["id"] == "qwen3-drafts"  # --served-model-name


def _chat_ids(messages: list[dict]) -> list[int]:
    """The ids tests/fixtures/chat's template renders `messages` to (every word a tN)."""
    roles = {"user": [4, 6], "assistant": [4, 7]}
    ids = [1, 4, 5, 9, EOS]  # bos, the default system turn
    for message in messages:
        ids += [*roles[message["role"]], *_ids(message["content"]), EOS]
    return [*ids, 4, 7]  # the generation prompt


def _ids(words: str) -> list[int]:
    return [int(word[1:]) for word in words.split()]


def _prefix_cache(server: Server, since: tuple = (0, 0, 0)) -> tuple[float, float, float]:
    """(hits, misses, tokens reused) of the server's host cache since the counts `since`."""
    names = ("hits", "misses", "tokens_reused")
    return tuple(
        server.metric(f"mkgen_prefix_cache_{name}_total") - before
        for name, before in zip(names, since, strict=True)
    )  # fmt: skip


def test_a_second_chat_turn_reuses_the_first_turns_caches(server: Server) -> None:
    """Turn one of a chat ends; its caches (the rendered prompt and the answer fed to the
    kernel) go to the host cache. Turn two's rendered prompt starts with them: they are
    restored and only the rest is prefilled (one hit, that many tokens reused), and its
    tokens are the reference's for the whole rendered prompt. A prompt that is a cached
    sequence plus one token restores it with nothing to prefill, with the reference's
    tokens too."""
    first = [{"role": "user", "content": "t12 t40 t33 t7 t51"}]
    asks = {"model": NAME, "max_tokens": 3, "temperature": 0}
    client = server.client
    before = _prefix_cache(server)
    answer = client.chat.completions.create(messages=first, **asks).choices[0]
    second = [*first, {"role": "assistant", "content": answer.message.content},
              {"role": "user", "content": "t8 t11 t30"}]  # fmt: skip
    rendered, answered = _chat_ids(second), _chat_ids(first) + answer.model_extra["token_ids"]
    assert rendered[: len(answered)] == answered  # the answer's text renders to its ids
    # The caches hold what the kernel was fed: all but the last token (the answer's last,
    # or the eos that stopped it).
    held = len(answered) - (answer.finish_reason == "length")
    assert _prefix_cache(server, before) == (0, 1, 0)  # turn one found nothing
    after_first = _prefix_cache(server)
    cached = client.chat.completions.create(messages=second, **asks).choices[0]
    assert _prefix_cache(server, after_first) == (1, 0, held)
    assert 0 < server.metric("mkgen_host_cache_bytes") <= 4096 << 20
    assert server.metric("mkgen_host_cache_limit_bytes") == 4096 << 20

    # Turn two's whole sequence as a prompt: its caches are restored, nothing prefilled.
    whole = rendered + cached.model_extra["token_ids"] + [EOS][: cached.finish_reason == "stop"]
    after_second = _prefix_cache(server)
    restored = client.completions.create(prompt=whole, **asks).choices[0]
    assert _prefix_cache(server, after_second) == (1, 0, len(whole) - 1)

    assert cached.model_extra["token_ids"] == _reference(server.checkpoint, rendered, 3)
    assert restored.model_extra["token_ids"] == _reference(server.checkpoint, whole, 3)


def test_a_prompt_that_leaves_a_cached_sequence_before_its_end_is_prefilled_whole(
    server: Server,
) -> None:
    """A cached sequence is reused only as an exact prefix of the prompt: a prompt that
    follows one for a while, then differs, finds nothing (a miss) and gets the
    reference's tokens."""
    asks = {"model": NAME, "max_tokens": 4, "temperature": 0, "extra_body": {"ignore_eos": True}}
    client = server.client
    first = client.completions.create(prompt=PROMPT, **asks).choices[0]
    cached = PROMPT + first.model_extra["token_ids"][:-1]  # what its caches hold
    diverging = [*cached[:9], (cached[9] + 1) % 128, *cached[10:], 5, 6]
    before = _prefix_cache(server)
    result = client.completions.create(prompt=diverging, **asks).choices[0]
    assert _prefix_cache(server, before) == (0, 1, 0)
    assert result.model_extra["token_ids"] == _reference(server.checkpoint, diverging, 4)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_short_soak_hurts_no_innocent_request_nor_the_server(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """scripts/serve_soak.py's soak, bounded to 8 normal requests or 40 s of storm (about
    20 s on an idle machine; the hostile client's requests go on meanwhile): three clients'
    normal requests (ids, text, chat; greedy and seeded sampled; whole and streamed) all
    get the answers they get alone, while every hostile request gets its refusal, /health answers
    within a second throughout, the engine ends no request with an error, and the
    server's resident memory is back within the soak's margin of its baseline."""
    soak = _script("serve_soak", monkeypatch)
    report = soak.soak(
        server.url, NAME, MAX_BODY, lambda: server.process.poll() is None,
        clients=3, requests=8, seconds=40,
    )  # fmt: skip
    assert report.failures == [], report
    assert report.normal >= 6 and report.hostile >= len(soak.hostile(NAME, MAX_BODY)), report


def _events(url: str, body: dict) -> list[str]:
    """A streamed completion's data: payloads, [DONE] included."""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as stream:
        return [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]


def test_sigterm_drains_running_requests_then_ends_the_rest_with_abort_and_exits(
    server: Server,
) -> None:
    """Two long requests (61 tokens: eight device calls) run when a 12-token stream's first
    event arrives and SIGTERM is sent. The drain (--drain-seconds 1): /health says
    "draining" (503) and a new request gets 503; the short stream's last tokens come in
    the device call under way and it finishes ("length", [DONE]); the drain time is then
    over and the long ones end at the end of that call: the stream with a final event
    "abort" and [DONE], the whole completion with a 503 error object. The process exits by
    the signal, with no traceback."""
    url = server.url
    long = {"model": NAME, "prompt": [7, 8, 9], "max_tokens": 61, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    short = {"model": NAME, "prompt": PROMPT, "max_tokens": 12, "stream": True,
             "temperature": 0}  # fmt: skip
    with ThreadPoolExecutor(2) as pool:
        long_stream = pool.submit(_events, url, {**long, "stream": True})
        long_whole = pool.submit(httpx.post, f"{url}/v1/completions", json=long, timeout=300)
        deadline = time.monotonic() + 120
        while server.metric("mkgen_slots_in_use") < 2:
            assert time.monotonic() < deadline, "the long requests never held their slots"
            time.sleep(0.05)
        events: list[str] = []
        with httpx.stream("POST", f"{url}/v1/completions", json=short, timeout=300) as stream:
            for line in stream.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 1:
                    server.process.send_signal(signal.SIGTERM)
                    draining = _until_draining(url)
                    refused = httpx.post(f"{url}/v1/completions", json=short, timeout=30)
        streamed, whole = long_stream.result(), long_whole.result()
    assert draining == (503, {"status": "draining"})
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "server_error"
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    expected = np.load(FIXTURES / "qwen3" / "expected.npz")["greedy_ids"].tolist()
    assert [t for c in chunks for t in c["token_ids"]][:8] == expected
    assert chunks[-1]["finish_reason"] == "length"
    assert streamed[-1] == "[DONE]"
    assert json.loads(streamed[-2])["choices"][0]["finish_reason"] == "abort"
    assert 0 < sum(len(json.loads(e)["choices"][0]["token_ids"]) for e in streamed[:-1]) < 61
    assert whole.status_code == 503 and whole.json()["error"]["type"] == "server_error"
    # uvicorn ends by raising the signal again once it has shut down.
    assert server.process.wait(timeout=120) == -signal.SIGTERM
    log = "".join(server.stderr)
    assert "SIGTERM: draining" in log and "drain time over (1 s)" in log
    assert "Traceback" not in log


def _until_draining(url: str) -> tuple[int, dict]:
    """/health's answer once the server has begun to drain (it notices a signal within
    a tick of 0.1 s)."""
    deadline = time.monotonic() + 10
    while True:
        health = httpx.get(f"{url}/health", timeout=30)
        if health.json()["status"] != "ok" or time.monotonic() > deadline:
            return health.status_code, health.json()
        time.sleep(0.02)


def test_serve_refuses_what_it_cannot_serve_in_one_line(
    prepared: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    build, weights, _ = prepared
    assert_user_error(mkgen("serve", str(build)), "give --weights WEIGHTS", "--random-weights")
    missing = mkgen("serve", str(tmp_path / "nothing"), "--random-weights", "0")
    assert_user_error(missing, "nothing: no runner.py there")
    negative = mkgen("serve", str(build), "--weights", str(weights), "--host-cache-mib", "-1")
    assert_user_error(negative, "--host-cache-mib", "-1")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        busy = mkgen("serve", str(build), "--weights", str(weights), "--port", port)
        assert_user_error(busy, f"--port {port}: cannot listen there")
    served = ("serve", str(build), "--weights", str(weights))
    unnamed = mkgen(*served, "--served-model-name", " ")
    assert_user_error(unnamed, "--served-model-name: give a name")
    assert_user_error(mkgen(*served, "--max-body-mib", "0"), "--max-body-mib", "0")
    assert_user_error(mkgen(*served, "--drain-seconds", "-1"), "--drain-seconds", "-1")
    alone = mkgen(*served, "--coordinator", "127.0.0.1:1")
    assert_user_error(alone, "--coordinator: only with --multi-host")
    interpreted = mkgen(*served, "--interpret", "--multi-host", "--num-processes", "2")
    assert_user_error(interpreted, "--multi-host --interpret:", "cannot decode across processes")
    both = mkgen(*served, "--multi-host", "--disaggregate")
    assert_user_error(both, "--disaggregate: not with --multi-host")
    beyond = mkgen(*served, "--multi-host", "--num-processes", "2", "--process-id", "2")
    assert_user_error(beyond, "--process-id: must be below --num-processes (2), got 2")


# ---------------------------------------------------------------- no server


def test_a_sequence_goes_into_its_slot_and_comes_back_out() -> None:
    import jax.numpy as jnp

    from mkgen.runtime.slots import extract_sequence, insert_sequence

    caches = [jnp.zeros((2, 3, 4, 5), jnp.bfloat16), jnp.ones((2, 3, 4, 2, 6), jnp.float32)]
    sequence = [jnp.full((2, 3, 1, 5), 7, jnp.float32), jnp.full((2, 3, 1, 2, 6), 9.0)]
    caches = insert_sequence(caches, 2, sequence)
    back = extract_sequence(caches, 2)
    assert [b.dtype for b in back] == [jnp.bfloat16, jnp.float32]
    for b, s in zip(back, sequence, strict=True):
        np.testing.assert_array_equal(np.asarray(b, np.float32), np.asarray(s, np.float32))
    np.testing.assert_array_equal(np.asarray(caches[0][:, :, [0, 1, 3]], np.float32), 0)
    np.testing.assert_array_equal(np.asarray(caches[1][:, :, [0, 1, 3]]), 1)


def test_text_is_released_without_stop_strings_or_unfinished_characters() -> None:
    from tokenizers import Tokenizer, decoders, models

    from mkgen.serve.app import TextAssembler

    vocab = {"a": 0, "b": 1, "<0xC3>": 2, "<0xA9>": 3, "S": 4, "T": 5}
    tokenizer = Tokenizer(models.BPE(vocab, [], byte_fallback=True))
    tokenizer.decoder = decoders.ByteFallback()
    text = TextAssembler(tokenizer, ["ST"])
    assert text.add([0, 2]) == "a"  # é is half decoded
    assert text.add([3, 1]) == "éb"
    assert text.add([4]) == ""  # maybe the stop string's start
    assert text.add([0]) == "Sa"  # it was not
    assert not text.stopped
    assert text.add([4, 5, 0]) == "" and text.stopped
    assert text.released == "aébSa"
    held = TextAssembler(tokenizer, ["ST"])
    assert held.add([1, 4]) == "b" and held.add([], final=True) == "S"
    assert held.ids == [1, 4]


def test_the_host_cache_reuses_the_longest_exact_prefix_and_evicts_the_least_recent() -> None:
    """Entries hold a position-indexed array (a KV cache: [devices, layers, batch, heads,
    context 8, head_dim], 4 bytes a position) for their tokens' positions only, given back
    padded to the context, and a whole one (a recurrent state: 40 bytes)."""
    from mkgen.serve.host_cache import HostCache

    def caches(value: int) -> list[np.ndarray]:
        return [np.full((1, 1, 1, 1, 8, 1), value, np.int32), np.full(5, value, np.int64)]

    def size(tokens: int) -> int:
        return 4 * tokens + 40

    cache = HostCache(limit_bytes=160, by_position=[True, False], context=8)
    assert cache.store([1, 2], caches(1)) == 0
    assert cache.store([1, 2, 3, 4], caches(2)) == 0
    assert cache.store([7, 8], caches(3)) == 0
    assert (len(cache), cache.bytes) == (3, size(2) + size(4) + size(2))
    hit = cache.lookup([1, 2, 3, 4, 5])
    assert hit is not None and hit.length == 4  # the longest
    assert hit.caches[0].shape == (1, 1, 1, 1, 8, 1)
    assert hit.caches[0].ravel().tolist() == [2, 2, 2, 2, 0, 0, 0, 0]
    assert hit.caches[1].tolist() == [2] * 5
    # The prompt's last token is fed to the kernel: a sequence as long as it is not used.
    shorter = cache.lookup([1, 2, 3, 4])
    assert shorter is not None and shorter.length == 2
    assert cache.lookup([1, 3, 3, 4, 5]) is None and cache.lookup([7]) is None
    # [1, 2] and [1, 2, 3, 4] were used since [7, 8] was stored: [7, 8] goes first.
    assert cache.store([9, 9, 9], caches(4)) == 1
    assert cache.lookup([7, 8, 9]) is None
    assert (len(cache), cache.bytes) == (3, size(4) + size(2) + size(3))
    assert cache.store(list(range(8)), caches(5)) == 2  # 72 bytes: two more go
    assert (len(cache), cache.bytes) == (2, size(3) + size(8))
    assert cache.bytes <= cache.limit_bytes
    small = HostCache(limit_bytes=60, by_position=[True, False], context=8)
    assert small.store(list(range(6)), caches(6)) == 0  # 64 bytes: not kept
    assert (len(small), small.bytes) == (0, 0)
    assert small.store([5], caches(7)) == 0 and small.store([5], caches(8)) == 0
    assert (len(small), small.bytes) == (1, size(1))  # the same tokens again: replaced
    assert small.lookup([5, 1]).caches[1].tolist() == [8] * 5
