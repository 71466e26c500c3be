"""A bounded load test of `mkgen serve` on loopback (`make bench`; not a timed test).

The tiny qwen3 transformers fixture (tests/fixtures/hf/qwen3) is built for tpu7x:1x1x1 at
batch 8 in a temporary directory, converted with a word-level tokenizer (token tN is id N)
and the chat template of tests/fixtures/chat, and served in TPU interpret mode on the CPU;
CLIENTS concurrent clients then send REQUESTS streamed completions (random prompts of
4-12 token ids, 4-16 tokens each, greedy or sampled). Printed: p50 / p99 time to first
token and inter-token latency as the clients see them (a device call brings up to 8
tokens at once: the latency of a later event is its gap over its tokens), the server's
mean seconds per kernel step (GET /metrics), tokens/s over the run, and the errors, which
must be zero (the exit status is 1 otherwise).

    python scripts/serve_load.py [--clients 32] [--requests 200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "hf" / "qwen3"
CHAT_CONFIG = REPO / "tests" / "fixtures" / "chat" / "tokenizer_config.json"
BATCH = 8
STARTUP_S = 600


def mkgen(*args: str) -> None:
    """`mkgen ARGS` in a fresh process; stops the load test if it fails."""
    result = subprocess.run(
        [sys.executable, "-m", "mkgen.cli", *args], capture_output=True, text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"}, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        raise SystemExit(f"serve_load: mkgen {' '.join(args)} failed:\n{result.stderr}")


def prepare(tmp: Path) -> tuple[Path, Path]:
    """(build, weights) of the fixture in `tmp`: built at batch BATCH, context 64, and
    converted from a copy of the checkpoint given a word-level tokenizer.json (tN is id N:
    text prompts) and tests/fixtures/chat's tokenizer_config.json (chats; eos t2)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    build, checkpoint, weights = tmp / "build", tmp / "checkpoint", tmp / "weights"
    mkgen("build", str(FIXTURE / "config.json"), "--topology", "1x1x1", "--batch",
          str(BATCH), "--context", "64", "-o", str(build))  # fmt: skip
    shutil.copytree(FIXTURE, checkpoint)
    shutil.copy(CHAT_CONFIG, checkpoint)
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(checkpoint / "tokenizer.json"))
    mkgen("convert", "--build", str(build), "--checkpoint", str(checkpoint), "-o", str(weights))
    return build, weights


def start_server(
    build: Path, weights: Path, log: Path, *options: str
) -> tuple[subprocess.Popen, str]:
    """`mkgen serve` with `options` on a free port; its URL once /health answers (once
    the server has warmed up)."""
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "mkgen.cli", "serve", str(build), "--weights", str(weights),
             "--interpret", "--port", "0", *options],
            stdout=subprocess.DEVNULL, stderr=stderr,
        )  # fmt: skip
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline and process.poll() is None:
        found = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", log.read_text())
        if found:
            try:
                if httpx.get(f"{found.group(1)}/health", timeout=5).status_code == 200:
                    return process, found.group(1)
            except httpx.TransportError:
                pass
        time.sleep(0.5)
    process.kill()
    raise SystemExit(f"serve_load: the server did not start:\n{log.read_text()[-3000:]}")


async def one_request(
    client: httpx.AsyncClient, url: str, model: str, rng: random.Random
) -> tuple[float, list[float], int]:
    """One streamed completion: (time to first token, the inter-token latencies of the
    later events: each event's gap since the one before over the tokens it brought,
    tokens). Tokens that arrive together with the first have no gap of their own."""
    body = {
        "model": model, "prompt": [rng.randrange(128) for _ in range(rng.randint(4, 12))],
        "max_tokens": rng.randint(4, 16), "stream": True,
        "temperature": rng.choice([0, 0.8]), "seed": rng.randrange(2**32),
        "ignore_eos": True,  # every request generates its max_tokens
    }  # fmt: skip
    start = time.perf_counter()
    first, last, gaps, tokens = None, start, [], 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {await response.aread()!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ids = json.loads(line[6:])["choices"][0]["token_ids"]
            if not ids:
                continue
            now = time.perf_counter()
            if first is None:
                first = now - start
            else:
                gaps += [(now - last) / len(ids)] * len(ids)
            last, tokens = now, tokens + len(ids)
    if first is None:
        raise RuntimeError("no token came back")
    return first, gaps, tokens


def mean_step_seconds(url: str) -> float:
    """The server's mean inter-token latency: seconds per kernel step of its calls."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    value = {
        name: float(re.search(rf"^mkgen_inter_token_latency_seconds_{name} (\S+)$", text,
                              re.MULTILINE).group(1))
        for name in ("sum", "count")
    }  # fmt: skip
    return value["sum"] / max(value["count"], 1)


async def load(url: str, model: str, clients: int, requests: int) -> dict:
    rng = random.Random(0)
    todo = list(range(requests))
    ttft, gaps, errors = [], [], []
    tokens = 0

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal tokens
        while todo:
            todo.pop()
            try:
                first, more, count = await one_request(client, url, model, rng)
            except (httpx.HTTPError, RuntimeError) as error:
                errors.append(repr(error))
                continue
            ttft.append(first)
            gaps.extend(more)
            tokens += count

    start = time.perf_counter()
    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(timeout=1800, limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
    seconds = time.perf_counter() - start
    return {"ttft": ttft, "gaps": gaps, "tokens": tokens, "seconds": seconds, "errors": errors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mkgen-serve-load-") as tmp:
        build, weights = prepare(Path(tmp))
        process, url = start_server(build, weights, Path(tmp) / "serve.log")
        try:
            model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
            result = asyncio.run(load(url, model, args.clients, args.requests))
            result["step_s"] = mean_step_seconds(url)
        finally:
            process.terminate()
            process.wait(timeout=120)
    ttft, gaps = np.array(result["ttft"]), np.array(result["gaps"])
    print(
        f"mkgen serve load test: {args.requests} streamed completions from {args.clients} "
        f"concurrent clients, qwen3 fixture, tpu7x:1x1x1 batch {BATCH}, TPU interpret mode "
        f"on the CPU; {result['seconds']:.1f} s"
    )
    if len(ttft):
        print(f"  time to first token  p50 {np.percentile(ttft, 50):7.2f} s   "
              f"p99 {np.percentile(ttft, 99):7.2f} s")  # fmt: skip
    if len(gaps):
        print(f"  inter-token latency  p50 {np.percentile(gaps, 50):7.3f} s   "
              f"p99 {np.percentile(gaps, 99):7.3f} s")  # fmt: skip
    print(f"  server: mean {result['step_s']:.3f} s per kernel step (all slots at once)")
    print(f"  tokens/s {result['tokens'] / result['seconds']:.2f} ({result['tokens']} tokens)")
    print(f"  errors {len(result['errors'])}")
    for error in result["errors"][:5]:
        print(f"    {error}")
    if result["errors"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
