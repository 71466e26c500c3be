"""The runner's options, parsed and checked before any expensive work.

Every mistake is one line naming the flag (`--temperature: must be a finite number >= 0,
got nan`): the parser raises MkgenError instead of printing argparse's usage block, and
`run` prints it with exit status 2.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from mkgen.errors import MkgenError, first_line
from mkgen.runtime.build import Build
from mkgen.runtime.devices import check_multi_host_flags
from mkgen.runtime.sampling_bounds import (
    MIN_TEMPERATURE,
    SEED_LIMIT,
    TEMPERATURE_RULE,
    TOP_P_RULE,
    temperature_fits,
    top_p_fits,
)

# Seeds numpy's default_rng (sampling) and jax.random.key (--random-weights) both take.
DEFAULT_PROMPT = "1,2,3,4"
NGRAM_DEFAULT = 3  # longest suffix the prompt-lookup drafter matches
STEPS_PER_CALL_DEFAULT = 8
WARMUP_DEFAULT = 2
TOKENIZER_FILE = "tokenizer.json"  # what mkgen convert copies beside the weights


class OptionParser(argparse.ArgumentParser):
    """argparse whose errors are one line: an MkgenError naming the flag."""

    def error(self, message: str) -> NoReturn:
        raise MkgenError(message.removeprefix("argument "))


def integer(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be an integer {bounds}, got {text}")
        return value

    return parse


def number(requirement: str, accept: Callable[[float], bool]) -> Callable[[str], float]:
    """An argparse type: a float for which `accept` holds (it judges nan and inf too)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not accept(value):
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {text}")
        return value

    return parse


def option_parser(build: Build, prog: str) -> OptionParser:
    """The runner's options for `build`, grouped by concern (the order --help lists them)."""
    parser = OptionParser(
        prog=prog,
        description=f"Generation with the {build.spec} megakernel on {build.topology} "
        f"({build.name}).",
        epilog="Weights: --weights loads a `mkgen convert` directory made for this build "
        "(mkgen convert --build BUILD_DIR --checkpoint HF_DIR -o WEIGHTS); --random-weights "
        "draws the reference's random weights on the host in f32 (use the mini/ build on CPU). "
        "Text prompts need a tokenizer.json (--tokenizer, or converted with the weights).",
    )
    for add_options in (
        _add_weight_options,
        _add_prompt_options,
        _add_sampling_options,
        _add_drafting_options,
        _add_bench_and_process_options,
    ):
        add_options(parser, build)
    return parser


def _add_weight_options(parser: OptionParser, build: Build) -> None:
    """Where the kernel runs and the weights it runs with."""
    parser.add_argument(
        "--interpret",
        action="store_true",
        help=f"run on CPU in TPU interpret mode on {build.devices} virtual devices",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--weights",
        metavar="DIR",
        help="converted weights (mkgen convert), checked against this build's layout",
    )
    source.add_argument(
        "--random-weights",
        type=integer(0, SEED_LIMIT - 1),
        metavar="SEED",
        help="the reference model's random weights (mkgen.reference.model.init_weights)",
    )
    parser.add_argument(
        "--trust-weights",
        action="store_true",
        help="skip the sha256 check of the converted weight and tokenizer files (faster "
        "start-up on weights you trust)",
    )


def _add_prompt_options(parser: OptionParser, build: Build) -> None:
    """The prompts, their tokenizer, and how they are prefilled."""
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument(
        "--prompt-ids",
        action="append",
        metavar="IDS",
        help=f"comma-separated token ids of one prompt; give it once (used for all "
        f"{build.batch} sequences) or {build.batch} times (default {DEFAULT_PROMPT})",
    )
    prompt.add_argument(
        "--prompt",
        action="append",
        metavar="TEXT",
        help=f"one prompt as text (once, or {build.batch} times), tokenized with --tokenizer",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="FILE",
        help=f"a Hugging Face {TOKENIZER_FILE} (default: the one converted with --weights); "
        "generated text is decoded with it",
    )
    parser.add_argument(
        "--prefill",
        choices=("xla", "kernel"),
        default="xla",
        help="xla (default): the prompt runs through the model in XLA over the placed "
        "weights, the kernel continues from its caches; kernel: the whole prompt goes "
        "through the kernel, ROWS tokens per call",
    )
    parser.add_argument(
        "--disaggregate",
        action="store_true",
        help=f"prefill on a mesh of its own: {build.devices} more devices (with --interpret, "
        f"{2 * build.devices} virtual ones), holding their own copy of the weights; the caches "
        "then move to the decoding devices",
    )


def _add_sampling_options(parser: OptionParser, build: Build) -> None:
    """How many tokens each sequence gets, where it stops and how each is drawn."""
    parser.add_argument(
        "--steps",
        type=integer(1),
        default=build.default_steps,
        metavar="N",
        help=f"tokens to generate per sequence (default {build.default_steps})",
    )
    parser.add_argument(
        "--stop-ids", metavar="IDS", default="", help="comma-separated ids that end a sequence"
    )
    parser.add_argument(
        "--temperature",
        type=number(TEMPERATURE_RULE, temperature_fits),
        default=0.0,
        metavar="T",
        help=f"0 (default): greedy; else sample at temperature T (finite, >= {MIN_TEMPERATURE:g})",
    )
    parser.add_argument(
        "--top-k",
        type=integer(0, build.vocab_used),
        default=0,
        metavar="K",
        help=f"sample from the K likeliest (0: all; at most the vocabulary, {build.vocab_used})",
    )
    parser.add_argument(
        "--top-p",
        type=number(TOP_P_RULE, top_p_fits),
        default=1.0,
        metavar="P",
        help="sample from the smallest set of mass >= P (0 < P <= 1)",
    )
    parser.add_argument(
        "--seed", type=integer(0, SEED_LIMIT - 1), default=0, metavar="SEED", help="sampling seed"
    )


def _add_drafting_options(parser: OptionParser, build: Build) -> None:
    """Steps per device call and the drafts each step verifies."""
    parser.add_argument(
        "--steps-per-call",
        type=integer(1, build.context),
        metavar="N",
        help="up to N kernel steps in one device call, each step's tokens drafted (build or "
        "ngram drafter), accepted (greedy or sampled) and embedded on the device for the next (1: "
        f"a host round trip per step; default {STEPS_PER_CALL_DEFAULT}, at most the context, "
        f"{build.context})",
    )
    parser.add_argument(
        "--drafter",
        metavar="NAME",
        help="draft source when ROWS > 1: build (the drafter the build carries, drafting on "
        "the device in a separate jitted step between kernel steps: the default for a build "
        "made with --draft; with --weights, its weights converted by mkgen convert "
        "--draft-checkpoint), ngram (prompt lookup, the default otherwise) or "
        "MODULE:CALLABLE, a callable (history, count) -> count token ids, or (ids, "
        "distributions) for a sampling drafter",
    )
    parser.add_argument(
        "--ngram",
        type=integer(1, build.context),
        metavar="N",
        help=f"longest suffix the prompt-lookup drafter matches (default {NGRAM_DEFAULT}, at "
        f"most the context, {build.context})",
    )


def _add_bench_and_process_options(parser: OptionParser, build: Build) -> None:
    """Timing, the multi-host job and the output format."""
    parser.add_argument(
        "--bench",
        action="store_true",
        help="time the kernel calls: medians after --warmup calls; ms/step, tokens/s",
    )
    parser.add_argument(
        "--warmup",
        type=integer(0),
        metavar="N",
        help=f"calls left out of --bench (default {WARMUP_DEFAULT})",
    )
    parser.add_argument(
        "--multi-host",
        action="store_true",
        help="jax.distributed.initialize first (one process per host; TPU pods find their "
        "peers on their own, elsewhere give --coordinator, --num-processes, --process-id)",
    )
    parser.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address")
    parser.add_argument(
        "--num-processes", type=integer(1), metavar="N", help="processes in the job"
    )
    parser.add_argument("--process-id", type=integer(0), metavar="I", help="this process's index")
    parser.add_argument(
        "--json",
        action="store_true",
        help='print one object: {"tokens": [[...], ...], "calls": device calls} (+ text, '
        "acceptance_length and accepted_per_step (per sequence, the tokens each kernel step "
        "gave) when ROWS > 1, bench)",
    )


def token_ids(text: str, flag: str, vocab: int) -> list[int]:
    """Comma-separated token ids, each in [0, vocab)."""
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise MkgenError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    for t in ids:
        if not 0 <= t < vocab:
            raise MkgenError(f"{flag}: token id {t} is outside the vocabulary [0, {vocab})")
    return ids


def load_tokenizer(path: str | None, weights: str | None, *, verify: bool = True) -> Any:
    """The tokenizer of --tokenizer, else the one converted beside --weights (with
    `verify`, the file mkgen convert copied: convert.tokenizer_file), else None."""
    if path is None and weights is not None:
        from mkgen.weights.convert import tokenizer_file

        converted = tokenizer_file(Path(weights), TOKENIZER_FILE, verify=verify)
        path = None if converted is None else str(converted)
    if path is None:
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path)
    except Exception as error:  # a missing or malformed file: one line
        reason = first_line(error)
        raise MkgenError(f"--tokenizer {path}: not a {TOKENIZER_FILE} ({reason})") from None


def _check_text(flag: str, text: str) -> None:
    """A one-line MkgenError unless `text` is Unicode text (UTF-8 encodable): Python turns
    argument bytes that are not UTF-8 into lone surrogates (U+DC80 to U+DCFF)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        code = ord(text[error.start])
        what = (
            f"byte 0x{code - 0xDC00:02x}, which is not UTF-8"
            if 0xDC80 <= code <= 0xDCFF
            else f"a lone surrogate U+{code:04X}"
        )
        raise MkgenError(
            f"{flag}: character {error.start} is {what}; give the text in UTF-8"
        ) from None


def _prompts(args: argparse.Namespace, build: Build) -> list[list[int]]:
    """Every sequence's prompt token ids, checked against the vocabulary and the batch."""
    if args.prompt:
        for text in args.prompt:
            _check_text("--prompt", text)
        if args.tokenizer is None:
            raise MkgenError("--prompt needs --tokenizer FILE (or --weights converted with one)")
        prompts = [args.tokenizer.encode(t, add_special_tokens=False).ids for t in args.prompt]
        flag = "--prompt"
        outside = [t for p in prompts for t in p if not 0 <= t < build.vocab_used]
        if outside:
            raise MkgenError(
                f"--prompt: the tokenizer gives id {outside[0]}, outside this build's "
                f"vocabulary [0, {build.vocab_used}) (a tokenizer of another model?)"
            )
    else:
        flag = "--prompt-ids"
        texts = args.prompt_ids or [DEFAULT_PROMPT]
        prompts = [token_ids(text, flag, build.vocab_used) for text in texts]
    if len(prompts) == 1:
        prompts = prompts * build.batch
    if len(prompts) != build.batch:
        raise MkgenError(f"{flag}: give one prompt or {build.batch}, got {len(prompts)}")
    if not all(prompts):
        raise MkgenError(f"{flag}: prompts must be non-empty")
    return prompts


def _check_drafting(args: argparse.Namespace, build: Build) -> None:
    """Drafter flags only where drafts are verified, --ngram only for the ngram drafter,
    several steps per call only where drafts come from the device (the build's drafter or
    the ngram one); the build's drafter only where the runner can run it."""
    for flag, value in (("--drafter", args.drafter), ("--ngram", args.ngram)):
        if value is not None and build.rows == 1:
            raise MkgenError(
                f"{flag}: this build verifies no drafts (rows 1); a build made with "
                "--rows R > 1 does"
            )
    if args.ngram is not None and args.drafter not in (None, "ngram"):
        raise MkgenError(f"--ngram: only the ngram drafter uses it, not {args.drafter}")
    args.drafter = args.drafter or ("build" if build.drafter else "ngram")
    args.ngram = args.ngram or NGRAM_DEFAULT
    if args.drafter == "build":
        check_build_drafter(build, args.weights)
    if args.steps_per_call is not None and args.drafter not in ("ngram", "build"):
        raise MkgenError(
            f"--steps-per-call: the {args.drafter} drafter runs on the host, one step per "
            "call; the build and ngram drafters run several steps per call"
        )
    args.steps_per_call = args.steps_per_call or STEPS_PER_CALL_DEFAULT


def check_build_drafter(build: Build, weights: str | None) -> None:
    """One line when `--drafter build` (the default of a build with a drafter) cannot run:
    no drafter, or converted weights without the drafter's (mkgen convert
    --draft-checkpoint writes them; which drafter they are is checked as they are read)."""
    from mkgen.weights.convert import read_manifest
    from mkgen.weights.draft import without_drafter

    if build.drafter is None:
        raise MkgenError(
            "--drafter build: this build carries no drafter (mkgen build --draft DRAFT); "
            "pass --drafter ngram (prompt lookup)"
        )
    if weights is not None and "draft" not in read_manifest(Path(weights)):
        raise MkgenError(without_drafter(weights, build.drafter))


def _check_companions(args: argparse.Namespace, build: Build) -> None:
    """Flags that mean something only beside another one."""
    if args.trust_weights and args.weights is None:
        raise MkgenError("--trust-weights: only with --weights (converted weights)")
    if args.disaggregate and args.prefill != "xla":
        raise MkgenError("--disaggregate: only with --prefill xla (the kernel prefills in place)")
    if args.warmup is not None and not args.bench:
        raise MkgenError("--warmup: only with --bench")
    args.warmup = WARMUP_DEFAULT if args.warmup is None else args.warmup
    check_multi_host_flags(
        args.multi_host, args.disaggregate, args.coordinator, args.num_processes, args.process_id
    )
    if args.multi_host and args.interpret:
        given = {"--coordinator": args.coordinator, "--num-processes": args.num_processes}
        given["--process-id"] = args.process_id
        missing = [flag for flag, value in given.items() if value is None]
        if missing:
            raise MkgenError(
                f"--multi-host --interpret: give {', '.join(missing)} (only a TPU pod tells "
                "its processes their peers)"
            )
        if build.devices % args.num_processes:
            raise MkgenError(
                f"--num-processes: must divide the build's {build.devices} devices in "
                f"interpret mode, got {args.num_processes}"
            )


def parse_args(build: Build, argv: list[str] | None, prog: str) -> argparse.Namespace:
    """The options, every one checked; adds `prompts` (token ids per sequence), `stop`
    (a set of ids) and the loaded `tokenizer` (or None)."""
    args = option_parser(build, prog).parse_args(argv)
    _check_drafting(args, build)
    _check_companions(args, build)
    args.tokenizer = load_tokenizer(args.tokenizer, args.weights, verify=not args.trust_weights)
    args.prompts = _prompts(args, build)
    args.stop = set(token_ids(args.stop_ids, "--stop-ids", build.vocab_used))
    longest = max(len(p) for p in args.prompts)
    if longest + args.steps + build.rows - 1 > build.context:
        raise MkgenError(
            f"--steps: prompt ({longest}) + steps ({args.steps}) + drafts ({build.rows - 1}) "
            f"exceed the build's context of {build.context}"
        )
    return args
