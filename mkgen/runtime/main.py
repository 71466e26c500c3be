"""`run`: a build's runner from the command line to the printed tokens."""

from __future__ import annotations

import json
import sys
import time
from argparse import Namespace
from typing import Any

from mkgen.errors import MkgenError
from mkgen.runtime import devices
from mkgen.runtime.arguments import parse_args
from mkgen.runtime.bench import bench_summary, describe, prefill_summary
from mkgen.runtime.build import Build
from mkgen.runtime.speculation import load_drafter

EXIT_USAGE = 2  # bad arguments or weights that do not fit the build (argparse's status)


class Streamer:
    """Prints a sequence's generated text (token ids without a tokenizer) as kernel calls
    return it: only what is settled, since decoding more tokens may still complete a
    multi-byte character at the end."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.shown = tokenizer, ""

    def show(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return " ".join(map(str, ids))
        return self.tokenizer.decode(ids).rstrip("\ufffd")  # an unfinished character

    def __call__(self, ids: list[int]) -> None:
        text = self.show(ids)
        if text.startswith(self.shown) and len(text) > len(self.shown):
            print(text[len(self.shown) :], end="", flush=True)
            self.shown = text


def run(
    build: Build, argv: list[str] | None = None, *, prog: str = "runner.py", usage: str = ""
) -> None:
    """Generate with `build` as its runner.py's command line `argv` asks (default
    sys.argv[1:]). A user's mistake (an option, weights that do not fit the build, too few
    devices) is one line `PROG: error: ...` on stderr and exit status 2. `usage` names
    the command in --help's usage line (default `prog`)."""
    try:
        _generate(build, parse_args(build, argv, usage or prog))
    except MkgenError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def _generate(build: Build, args: Namespace) -> None:
    # A user's module: before the slow work. The build's drafter runs on the device; the
    # host steps around it (the prompt's rest, a last token) draft by prompt lookup.
    drafts_on_device = args.drafter == "build"
    drafter = load_drafter("ngram" if drafts_on_device else args.drafter, args.ngram)
    if args.multi_host and args.interpret:
        raise MkgenError(devices.INTERPRET_ACROSS_PROCESSES)
    meshes = 2 if args.disaggregate else 1  # disaggregation.MESHES (it imports JAX)
    devices.configure(build, args.interpret, meshes, args.num_processes or 1)
    devices.start_distributed(args)
    if args.multi_host:  # (asking JAX for the process count would start its backends here)
        args.prompts = devices.broadcast_prompts(args.prompts)
    import jax

    from mkgen.runtime import disaggregation
    from mkgen.runtime.decode import decode, load_model, prefill

    start = time.perf_counter()
    model = load_model(
        build, args.weights, args.random_weights, verify=not args.trust_weights, meshes=meshes,
        draft=drafts_on_device,
    )  # fmt: skip
    prefiller = disaggregation.prefill_model(model) if args.disaggregate else model
    for _ in range(2 if args.bench and args.prefill == "xla" else 1):
        # --bench times the second prefill, the first having compiled its layer steps.
        prefill_start = time.perf_counter()
        caches, held, states = jax.block_until_ready(prefill(prefiller, args.prompts, args.prefill))
        prefill_seconds = time.perf_counter() - prefill_start
    if prefiller is not model:
        caches = disaggregation.hand_over(caches, model)
    ready = time.perf_counter()
    stream = None
    if build.batch == 1 and not args.json and jax.process_index() == 0:
        stream = Streamer(args.tokenizer)
        print(f"sequence 0: {stream.show(args.prompts[0])} -> ", end="", flush=True)
    result = decode(model, caches, held, args, drafter, stream, states)
    done = time.perf_counter()
    if jax.process_index() != 0:
        return
    bench = None
    if args.bench:
        bench = bench_summary(build, result.seconds, args.warmup, result.acceptance)
        bench |= prefill_summary(build.batch * held, prefill_seconds)
    if args.json:
        out: dict[str, Any] = {"tokens": result.tokens, "calls": result.calls}
        if args.tokenizer is not None:
            out["text"] = [args.tokenizer.decode(tokens) for tokens in result.tokens]
        if build.rows > 1:
            out["acceptance_length"] = result.acceptance
            out["accepted_per_step"] = result.accepted_per_step
        if bench:
            out["bench"] = bench
        print(json.dumps(out))
        return
    if stream is not None:
        print()  # the streamed sequence's line
    else:
        show = Streamer(args.tokenizer).show
        for b, (prompt, tokens) in enumerate(zip(args.prompts, result.tokens, strict=True)):
            print(f"sequence {b}: {show(prompt)} -> {show(tokens)}")
    print(
        f"{build.name}: set-up and prefill {ready - start:.1f} s; {result.calls} kernel "
        f"call(s) in {done - ready:.1f} s{' (TPU interpret mode)' if args.interpret else ''}"
        + (f"; mean tokens accepted per call {result.acceptance:.2f}" if build.rows > 1 else "")
    )
    if bench:
        print(describe(bench))
