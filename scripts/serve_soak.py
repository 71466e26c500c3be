"""A bounded soak test of `mkgen serve` on loopback: normal traffic mixed with every kind of
hostile request (`make bench`; tests/test_serve.py runs a short one).

The fixture server of scripts/serve_load.py (the tiny qwen3 model in TPU interpret mode,
batch 8, a word-level tokenizer and a chat template) is started with --max-body-mib 1.
Each normal request (ids, text and chat; greedy and seeded sampled; whole and streamed)
is first sent once, all at once, for its expected answer (these give the same tokens
alone and in any batch; the fixture prompt's greedy tokens are transformers' own), and
the server's resident memory is read (process_resident_memory_bytes, GET /metrics): the
baseline. Then CLIENTS clients send normal requests while one hostile client cycles
through HOSTILE (bodies over the cap with and without a Content-Length, a top_k past
int32, fields of the wrong type, 100,000-deep JSON, a lone surrogate, an unknown model, a
wrong path and method, a text too long for the context, clients that leave mid-stream or
before their answer), until REQUESTS normal requests were answered or SECONDS passed; a
thread asks /health every 0.25 s.

It fails (exit status 1) when: the server exits; a normal request does not get its
expected answer (a 429, the documented backpressure, is retried after its Retry-After);
a hostile request does not get its refusal (its status and an OpenAI error object); the
engine ends a request with an error; /health is not 200 or takes over HEALTH_LIMIT_S; or,
once idle again, the server holds more than RSS_MARGIN_MIB MiB over the baseline and what
its host cache of finished sequences (bounded by --host-cache-mib) gained.

    python scripts/serve_soak.py [--seconds 240] [--requests 400] [--clients 6]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import re
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from serve_load import FIXTURE, prepare, start_server

HEALTH_LIMIT_S = 1.0  # the slowest /health answer allowed
HEALTH_EVERY_S = 0.25
# Resident memory the server may hold over its baseline and its host cache's growth once
# idle again: CPython and glibc keep some of what was freed. Measured on the fixture
# server: +23 MiB after a 120 s storm, +41 MiB after 240 s; four 90 s storms in a row on
# one server +18, +10, +2 and +3 MiB (628 to 661 MiB: it settles), the host cache +0.01.
RSS_MARGIN_MIB = 64
IDLE_WAIT_S = 120  # for the server to finish what the storm left (slow device calls)
PROMPT = [3, 17, 42, 99, 5, 64, 127, 23, 88, 11, 70, 36]  # the fixture's prompt

# (endpoint, body without "model"): answered alike alone and in any batch.
NORMALS = [
    ("completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}),
    ("completions", {"prompt": PROMPT[3:9], "max_tokens": 4, "temperature": 0.8, "seed": 7,
                     "stream": True}),
    ("completions", {"prompt": "t3 t17 t42 t99", "max_tokens": 3, "temperature": 0,
                     "stream": True}),
    ("chat/completions", {"messages": [{"role": "user", "content": "t12 t40 t33"}],
                          "max_tokens": 3, "temperature": 0}),
]  # fmt: skip


@dataclass
class Report:
    """What went wrong, and what was counted."""

    failures: list[str] = field(default_factory=list)
    normal: int = 0  # normal requests answered as expected
    hostile: int = 0  # hostile requests refused as they should be
    retried: int = 0  # 429s retried
    slowest_health_s: float = 0.0
    rss_baseline_mib: float = 0.0
    rss_after_mib: float = 0.0
    host_cache_mib: float = 0.0  # what the host cache holds after the storm (by design)


def metric(url: str, name: str) -> float:
    """A metric's value from GET /metrics (0 when it has none yet)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


async def answer(client: httpx.AsyncClient, url: str, endpoint: str, body: dict) -> tuple:
    """(token ids, text, finish reason) of a normal request, streamed or whole; raises
    Retry after a 429 and RuntimeError for any other refusal."""
    async with client.stream("POST", f"{url}/v1/{endpoint}", json=body) as response:
        if response.status_code == 429:
            raise Retry(float(response.headers.get("retry-after", "1")))
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        if not body.get("stream"):
            choice = json.loads(await response.aread())["choices"][0]
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            return choice["token_ids"], text, choice["finish_reason"]
        ids, text, finish, done = [], "", None, False
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                for choice in json.loads(line[6:])["choices"]:
                    text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                    ids += choice["token_ids"]
                    finish = choice["finish_reason"] or finish
        if not done:
            raise RuntimeError("the stream ended without data: [DONE]")
        return ids, text, finish


class Retry(Exception):
    """A 429: send again after `seconds`."""

    def __init__(self, seconds: float) -> None:
        super().__init__(seconds)
        self.seconds = seconds


async def answer_retried(
    client: httpx.AsyncClient, url: str, endpoint: str, body: dict, report: Report
) -> tuple | str:
    """answer(), sent again after each 429 (counted in `report`); what went wrong, as a
    string, when it was refused otherwise."""
    while True:
        try:
            return await answer(client, url, endpoint, body)
        except Retry as retry:
            report.retried += 1
            await asyncio.sleep(retry.seconds)
        except (httpx.HTTPError, RuntimeError) as error:
            return repr(error)


async def expected_answers(url: str, model: str, report: Report) -> list[tuple]:
    """Each normal request's answer, all sent at once; the first must be transformers'
    greedy tokens for the fixture's prompt."""
    import numpy as np

    async with httpx.AsyncClient(timeout=600) as client:
        answers = await asyncio.gather(*(
            answer_retried(client, url, endpoint, {**body, "model": model}, report)
            for endpoint, body in NORMALS
        ))  # fmt: skip
    refused = [a for a in answers if isinstance(a, str)]
    if refused:
        raise SystemExit(f"serve_soak: a normal request was refused: {refused[0]}")
    greedy = np.load(FIXTURE / "expected.npz")["greedy_ids"].tolist()
    if answers[0][0] != greedy[:4]:
        raise SystemExit(f"serve_soak: the fixture prompt gave {answers[0]}, not {greedy[:4]}")
    return list(answers)


def _error_object(raw: bytes) -> bool:
    """Whether `raw` is an OpenAI error object."""
    try:
        error = json.loads(raw)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and {"message", "type", "param", "code"} <= error.keys()


async def raw_exchange(url: str, request: bytes) -> tuple[int, bytes]:
    """Send `request` as it is on a new connection, without ending a chunked body, and
    read the answer (status, body) up to the server's close."""
    where = urlsplit(url)
    reader, writer = await asyncio.open_connection(where.hostname, where.port)
    try:
        writer.write(request)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def oversized(max_body: int) -> list[tuple[str, bytes]]:
    """Requests over the cap: a Content-Length over it (no body sent), and a chunked body
    of one byte more than the cap, never ended, so only a server that refuses it while
    reading answers at all. Nothing is sent past the byte that passes the cap: the
    server reads all that was sent, and its close is no reset that could lose the answer."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
    declared = head + b"Content-Length: %d\r\n\r\n" % (max_body + 1)
    sizes = [65_536] * (max_body // 65_536) + [max_body % 65_536, 1]
    chunks = b"".join(b"%x\r\n%s\r\n" % (n, b"x" * n) for n in sizes if n)
    return [
        ("a Content-Length over the cap", declared),
        ("a chunked body past the cap", head + b"Transfer-Encoding: chunked\r\n\r\n" + chunks),
    ]


def refused(model: str, max_body: int) -> list[tuple[str, str, str, bytes, int]]:
    """(what, method, path, body, the status it must get) of the hostile requests that
    the server must refuse at once."""

    def body(**fields: object) -> bytes:
        return json.dumps({"model": model, "prompt": [1], **fields}).encode()

    deep = body()[:-1] + b', "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    surrogate = body()[:-1] + b', "stop": ["\\ud800"]}'
    post = "POST", "/v1/completions"
    return [
        ("a top_k past int32", *post, body(top_k=2**31), 400),
        ("a top_k past int64", *post, body(top_k=2**70), 400),
        ('max_tokens "5"', *post, body(max_tokens="5"), 400),
        ('stream "yes"', *post, body(stream="yes"), 400),
        ("booleans as token ids", *post, body(prompt=[True, False]), 400),
        ("100,000-deep JSON", *post, deep, 400),
        ("a lone surrogate", *post, surrogate, 400),
        ("not JSON", *post, b"{not json", 400),
        ("a text too long for the context", *post, body(prompt="t5 " * (max_body // 4)), 400),
        ("an unknown model", *post, json.dumps({"model": "gpt-4", "prompt": [1]}).encode(), 404),
        ("a wrong path", "POST", "/v1/nothing", body(), 404),
        ("a wrong method", "GET", "/v1/completions", b"", 405),
    ]


async def leave_mid_stream(client: httpx.AsyncClient, url: str, model: str) -> str | None:
    """A stream left after its first event (its slot must be freed)."""
    body = {"model": model, "prompt": PROMPT[:5], "max_tokens": 40, "stream": True,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code not in (200, 429):
            return f"HTTP {response.status_code}"
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                break
    return None


async def leave_before_the_answer(client: httpx.AsyncClient, url: str, model: str) -> str | None:
    """A whole completion given up after a second (queued, or in a slot)."""
    body = {"model": model, "prompt": PROMPT[2:8], "max_tokens": 30, "ignore_eos": True}
    try:
        response = await client.post(f"{url}/v1/completions", json=body, timeout=1.0)
    except httpx.TimeoutException:
        return None
    return None if response.status_code in (200, 429) else f"HTTP {response.status_code}"


def hostile(model: str, max_body: int) -> list[tuple[str, Callable[..., Awaitable[str | None]]]]:
    """(what, check(client, url) -> what went wrong or None) of every hostile request."""

    def answered(request: bytes) -> Callable[..., Awaitable[str | None]]:
        async def check(_client: httpx.AsyncClient, url: str) -> str | None:
            status, body = await raw_exchange(url, request)
            return None if status == 413 and _error_object(body) else f"HTTP {status}: {body!r}"

        return check

    def refusal(method: str, path: str, body: bytes, status: int) -> Callable[..., Awaitable]:
        async def check(client: httpx.AsyncClient, url: str) -> str | None:
            response = await client.request(method, f"{url}{path}", content=body)
            if response.status_code == status and _error_object(response.content):
                return None
            return f"HTTP {response.status_code} (not {status}): {response.content[:200]!r}"

        return check

    checks = [(what, answered(request)) for what, request in oversized(max_body)]
    checks += [(what, refusal(*rest)) for what, *rest in refused(model, max_body)]
    checks += [
        ("a client leaving mid-stream", lambda c, url: leave_mid_stream(c, url, model)),
        ("a client leaving before its answer", lambda c, url: leave_before_the_answer(c, url, model)),
    ]  # fmt: skip
    return checks


def watch_health(url: str, stop: threading.Event, report: Report) -> None:
    """Ask /health every HEALTH_EVERY_S until `stop`; a slow or failed answer fails."""
    with httpx.Client(timeout=30) as client:
        while not stop.wait(HEALTH_EVERY_S):
            start = time.perf_counter()
            try:
                status = client.get(f"{url}/health").status_code
            except httpx.HTTPError as error:
                report.failures.append(f"/health: {error!r}")
                continue
            took = time.perf_counter() - start
            report.slowest_health_s = max(report.slowest_health_s, took)
            if status != 200 or took > HEALTH_LIMIT_S:
                report.failures.append(f"/health: HTTP {status} in {took:.2f} s")


async def storm(url: str, model: str, max_body: int, expected: list[tuple], report: Report,
                *, clients: int, requests: int, seconds: float) -> None:  # fmt: skip
    """`clients` clients send normal requests (each answer held to `expected`) while one
    hostile client cycles through every hostile request, until `requests` normal ones
    were sent or `seconds` passed."""
    deadline, rng = time.monotonic() + seconds, random.Random(0)
    budget, done = [requests], asyncio.Event()

    async def normal(client: httpx.AsyncClient) -> None:
        while budget[0] > 0 and time.monotonic() < deadline:
            budget[0] -= 1
            which = rng.randrange(len(NORMALS))
            endpoint, body = NORMALS[which]
            got = await answer_retried(client, url, endpoint, {**body, "model": model}, report)
            if got == expected[which]:
                report.normal += 1
            else:
                report.failures.append(f"normal request {which}: {got}, not {expected[which]}")

    async def attacker(client: httpx.AsyncClient) -> None:
        for turn, (what, check) in enumerate(itertools.cycle(hostile(model, max_body))):
            if done.is_set():
                return
            try:
                problem = await check(client, url)
            except (httpx.HTTPError, OSError, TimeoutError) as error:
                problem = repr(error)
            if problem is None:
                report.hostile += 1
            else:
                report.failures.append(f"hostile request {turn} ({what}): {problem}")

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as client:
        attack = asyncio.create_task(attacker(client))
        await asyncio.gather(*(normal(client) for _ in range(clients)))
        done.set()
        await attack


def soak(url: str, model: str, max_body: int, alive: Callable[[], bool], *, clients: int,
         requests: int, seconds: float) -> Report:  # fmt: skip
    """The soak against the server at `url` (serving `model`, bodies capped at
    `max_body` bytes; `alive()` says whether its process still runs): the module
    docstring's checks, in a Report."""
    report = Report()
    expected = asyncio.run(expected_answers(url, model, report))
    report.rss_baseline_mib = metric(url, "process_resident_memory_bytes") / (1 << 20)
    cached = metric(url, "mkgen_host_cache_bytes")
    errors = 'mkgen_requests_total{finish_reason="error"}'
    errors_before = metric(url, errors)
    stop = threading.Event()
    watcher = threading.Thread(target=watch_health, args=(url, stop, report), daemon=True)
    watcher.start()
    try:
        asyncio.run(storm(url, model, max_body, expected, report, clients=clients,
                          requests=requests, seconds=seconds))  # fmt: skip
    finally:
        stop.set()
        watcher.join()
    if not alive():
        report.failures.append("the server exited")
        return report
    deadline = time.monotonic() + IDLE_WAIT_S
    while metric(url, "mkgen_slots_in_use") or metric(url, "mkgen_queue_depth"):
        if time.monotonic() > deadline:
            report.failures.append(f"the server was not idle {IDLE_WAIT_S} s after the storm")
            break
        time.sleep(0.5)
    report.rss_after_mib = metric(url, "process_resident_memory_bytes") / (1 << 20)
    report.host_cache_mib = (metric(url, "mkgen_host_cache_bytes") - cached) / (1 << 20)
    allowed = report.rss_baseline_mib + report.host_cache_mib + RSS_MARGIN_MIB
    if report.rss_after_mib > allowed:
        report.failures.append(
            f"resident memory {report.rss_after_mib:.0f} MiB, over the baseline "
            f"{report.rss_baseline_mib:.0f} MiB + the host cache's growth "
            f"{report.host_cache_mib:.1f} MiB + {RSS_MARGIN_MIB}"
        )
    if metric(url, errors) > errors_before:
        report.failures.append(f"the engine ended {metric(url, errors) - errors_before:.0f} "
                               "requests with an error")  # fmt: skip
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=240, help="the storm's bound")
    parser.add_argument("--requests", type=int, default=400, help="normal requests at most")
    parser.add_argument("--clients", type=int, default=6, help="concurrent normal clients")
    args = parser.parse_args()
    max_body = 1 << 20
    with tempfile.TemporaryDirectory(prefix="mkgen-serve-soak-") as tmp:
        build, weights = prepare(Path(tmp))
        process, url = start_server(build, weights, Path(tmp) / "serve.log", "--max-body-mib", "1")
        try:
            model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
            start = time.perf_counter()
            report = soak(url, model, max_body, lambda: process.poll() is None,
                          clients=args.clients, requests=args.requests, seconds=args.seconds)  # fmt: skip
            seconds = time.perf_counter() - start
        finally:
            process.terminate()
            process.wait(timeout=300)
    print(
        f"mkgen serve soak test: {report.normal} normal requests answered as expected "
        f"({report.retried} 429s retried), {report.hostile} hostile ones refused as they "
        f"should be, in {seconds:.0f} s; /health at worst {report.slowest_health_s:.2f} s; "
        f"resident memory {report.rss_baseline_mib:.0f} MiB before, "
        f"{report.rss_after_mib:.0f} MiB after (the host cache grew by "
        f"{report.host_cache_mib:.1f} MiB)"
    )
    print(f"  failures {len(report.failures)}")
    for failure in report.failures[:10]:
        print(f"    {failure}")
    if report.failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
