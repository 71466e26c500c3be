"""`mkgen serve`: a build behind an OpenAI-compatible API (docs/serving.md#serve)."""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path

import click

from mkgen.cli.options import SEED
from mkgen.cli.weights import runner_build
from mkgen.errors import MkgenError
from mkgen.runtime.devices import INTERPRET_ACROSS_PROCESSES, check_multi_host_flags
from mkgen.serve import DRAIN_S, HOST_CACHE_MIB, MAX_BODY_MIB


@click.command("serve", short_help="Serve a build behind an OpenAI-compatible API.")
@click.argument("build", metavar="BUILD")
@click.option(
    "--weights", type=click.Path(path_type=Path), help="Converted weights (mkgen convert)."
)
@click.option(
    "--random-weights", type=SEED, default=None, metavar="SEED",
    help="The reference's random weights instead of --weights (the mini/ build on CPU).",
)  # fmt: skip
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
    help="Port to listen on (0: a free one, printed).",
)  # fmt: skip
@click.option("--interpret", is_flag=True, help="TPU interpret mode on virtual CPU devices.")
@click.option(
    "--steps-per-call", type=click.IntRange(min=1), default=8, show_default=True,
    help="Kernel steps per device call.",
)  # fmt: skip
@click.option(
    "--drafter", type=click.Choice(["build", "ngram"]), default=None,
    help="Draft source when ROWS > 1: build (the drafter the build carries, drafting on the "
    "device in a separate jitted step between kernel steps; the default for a build made "
    "with --draft; with --weights, its weights converted by mkgen convert "
    "--draft-checkpoint) or ngram (prompt lookup, the default otherwise).",
)  # fmt: skip
@click.option(
    "--queue-limit", type=click.IntRange(min=0), default=64, show_default=True,
    help="Requests waiting for a slot before new ones get 429.",
)  # fmt: skip
@click.option("--trust-weights", is_flag=True, help="Skip the sha256 check of the weights.")
@click.option(
    "--disaggregate", is_flag=True,
    help="Prefill on a second set of the build's device count, decode on the first.",
)  # fmt: skip
@click.option(
    "--host-cache-mib", type=click.IntRange(min=0), default=HOST_CACHE_MIB, show_default=True,
    help="Host memory for finished sequences' caches, reused by prompts that start with "
    "them (0: off).",
)  # fmt: skip
@click.option(
    "--multi-host", is_flag=True,
    help="One process of a multi-host job (jax.distributed, one per host): process 0 serves "
    "HTTP, the others follow its engine.",
)  # fmt: skip
@click.option("--coordinator", metavar="HOST:PORT", help="Process 0's address (--multi-host).")
@click.option(
    "--num-processes", type=click.IntRange(min=1), help="Processes in the job (--multi-host)."
)
@click.option(
    "--process-id", type=click.IntRange(min=0), help="This process's index (--multi-host)."
)
@click.option(
    "--served-model-name", metavar="NAME",
    help="The model name clients give (default: the build's spec name, e.g. qwen3-30b-a3b).",
)  # fmt: skip
@click.option(
    "--max-body-mib", type=click.IntRange(min=1), default=MAX_BODY_MIB, show_default=True,
    help="A request body over this many MiB is refused (413) before it is read whole.",
)  # fmt: skip
@click.option(
    "--drain-seconds", type=click.FloatRange(min=0), default=DRAIN_S, show_default=True,
    help="On SIGTERM or Ctrl-C, how long queued and running requests may go on (new ones "
    "get 503); those still running then end with finish_reason abort.",
)  # fmt: skip
def serve_command(
    build: str, weights: Path | None, random_weights: int | None, host: str, port: int,
    interpret: bool, steps_per_call: int, drafter: str | None, queue_limit: int,
    trust_weights: bool,
    disaggregate: bool, host_cache_mib: int, multi_host: bool, coordinator: str | None,
    num_processes: int | None, process_id: int | None, served_model_name: str | None,
    max_body_mib: int, drain_seconds: float,
) -> None:  # fmt: skip
    """Serve a build behind an OpenAI-compatible API (docs/serving.md#serve): BUILD is a
    build directory or a build's name in generated/ (with --rows R > 1, R - 1 drafts
    per step are verified); the `openai` client talks to http://HOST:PORT/v1 with any api
    key. The server compiles first (/health: 503 "warming up", then 200). SIGTERM or
    Ctrl-C drains: new requests get 503 while queued and running ones go on for up to
    --drain-seconds; those still running then end with finish_reason "abort" (a stream
    still gets its last event and [DONE]), and the server exits; a second signal skips
    the rest of the drain."""
    if (weights is None) == (random_weights is None):
        raise MkgenError("give --weights WEIGHTS (mkgen convert) or --random-weights SEED")
    if trust_weights and weights is None:
        raise MkgenError("--trust-weights: only with --weights (converted weights)")
    if served_model_name is not None and not served_model_name.strip():
        raise MkgenError("--served-model-name: give a name (or leave it out: the spec's name)")
    check_multi_host_flags(multi_host, disaggregate, coordinator, num_processes, process_id)
    if multi_host and interpret:
        raise MkgenError(INTERPRET_ACROSS_PROCESSES)
    distributed = {"coordinator": coordinator, "num_processes": num_processes}
    distributed["process_id"] = process_id
    from mkgen.runtime.arguments import check_build_drafter
    from mkgen.serve.server import serve

    built = runner_build(build)
    drafter = drafter or ("build" if built.drafter else "ngram")
    if drafter == "build":
        check_build_drafter(built, None if weights is None else str(weights))
    serve(
        built, draft=drafter == "build", weights=weights, random_weights=random_weights, host=host,
        port=port, interpret=interpret, steps_per_call=steps_per_call,
        queue_limit=queue_limit, trust_weights=trust_weights, disaggregate=disaggregate,
        host_cache_mib=host_cache_mib,
        multi_host=Namespace(**distributed) if multi_host else None,
        served_model_name=served_model_name, max_body_mib=max_body_mib,
        drain_seconds=drain_seconds,
    )  # fmt: skip
