"""serve: the model loaded once, its engine and the HTTP API run by uvicorn until SIGINT or
SIGTERM (uvicorn stops taking connections and lets in-flight requests finish for up to
GRACEFUL_SHUTDOWN_S, then the engine cancels what is left).

In a multi-host job (jax.distributed, one process per host) process 0 does all that;
every other process loads its own devices' weights and runs an engine that takes process
0's turns (mkgen/serve/turns.py), until process 0's engine stops."""

from __future__ import annotations

import logging
import socket
import sys
from argparse import Namespace
from pathlib import Path

from mkgen.errors import MkgenError
from mkgen.runtime import devices
from mkgen.runtime.arguments import load_tokenizer
from mkgen.runtime.build import Build

GRACEFUL_SHUTDOWN_S = 30  # how long SIGTERM waits for in-flight requests


def serve(
    build: Build,
    *,
    weights: Path | None,
    random_weights: int | None,
    host: str,
    port: int,
    interpret: bool,
    steps_per_call: int,
    queue_limit: int,
    trust_weights: bool = False,
    disaggregate: bool = False,
    host_cache_mib: int = 0,
    multi_host: Namespace | None = None,
) -> None:
    """Serve `build` on http://HOST:PORT/v1 until stopped; with `disaggregate`, prompts
    are prefilled on a second group of build.devices devices holding their own copy of
    the weights, and their caches handed over to the decode devices. Finished sequences'
    caches are kept in up to `host_cache_mib` MiB of host memory (0: none) for prompts
    that start with them. `multi_host` (coordinator, num_processes, process_id: each None
    on a TPU pod, which tells its processes) makes it one process of a multi-host job.
    Bad inputs (a port taken, weights that do not fit, too few devices, a broken
    tokenizer_config.json, tokenizer files changed since the conversion) are MkgenErrors
    before any request is taken."""
    from mkgen.codegen.convert import TOKENIZER_CONFIG_FILE, tokenizer_file
    from mkgen.serve.chat import load_tokenizer_config

    verify = not trust_weights
    tokenizer = load_tokenizer(None, str(weights) if weights else None, verify=verify)
    config = tokenizer_file(weights, TOKENIZER_CONFIG_FILE, verify=verify) if weights else None
    chat, eos = load_tokenizer_config(config) if config else (None, None)
    eos_id = tokenizer.token_to_id(eos) if tokenizer is not None and eos else None
    # A port taken is an error before the slow work (on process 0, when a flag says which).
    known_leader = multi_host is None or multi_host.process_id == 0
    listening = _bind(host, port) if known_leader else None
    meshes = 2 if disaggregate else 1  # disaggregation.MESHES (it imports JAX)
    processes = (multi_host.num_processes or 1) if multi_host is not None else 1
    devices.configure(build, interpret, meshes, processes)
    if multi_host is not None:
        devices.start_distributed(
            Namespace(multi_host=True, interpret=interpret, **vars(multi_host))
        )
    import jax
    import uvicorn

    from mkgen.runtime import disaggregation
    from mkgen.runtime.decode import load_model
    from mkgen.serve.app import ServedModel, create_app
    from mkgen.serve.engine import Engine
    from mkgen.serve.metrics import Metrics
    from mkgen.serve.turns import BroadcastTurns

    model = load_model(build, weights, random_weights, verify=not trust_weights, meshes=meshes)
    following = jax.process_index() != 0
    engine = Engine(
        model, interpret=interpret, metrics=Metrics(), steps_per_call=steps_per_call,
        queue_limit=queue_limit,
        prefiller=disaggregation.prefill_model(model) if disaggregate else None,
        host_cache_bytes=host_cache_mib << 20,
        turns=BroadcastTurns() if multi_host is not None else None,
        follow=_followed if following else None,
    )  # fmt: skip
    if following:
        print(
            f"process {jax.process_index()} of {jax.process_count()}: serving {build.name} "
            "with process 0 (its engine's turns), until it stops",
            file=sys.stderr, flush=True,
        )  # fmt: skip
        try:
            engine.run()
        except Exception as error:  # a collective failed: process 0 is gone
            first = (str(error).splitlines() or [type(error).__name__])[0]
            raise MkgenError(
                f"process {jax.process_index()}: process 0's turns stopped arriving ({first}); "
                "restart every process of the job"
            ) from None
        return
    if listening is None:  # a TPU pod made this process 0
        listening = _bind(host, port)
    port = listening.getsockname()[1]  # the one the system chose for --port 0
    # A step writes its drafts' rows beyond a sequence's last token: they need room too.
    context = build.context - (build.rows - 1)
    served = ServedModel(
        name=build.name, context=context, vocab_used=build.vocab_used,
        tokenizer=tokenizer, chat=chat,
        eos_ids=frozenset() if eos_id is None else frozenset({eos_id}),
    )  # fmt: skip
    print(
        f"serving {build.name} at http://{host}:{port}/v1 (batch {build.batch}, rows "
        f"{build.rows}, context "
        f"{context}{', prefill on its own devices' if disaggregate else ''}, host cache "
        f"{f'{host_cache_mib} MiB' if host_cache_mib else 'off'}"
        f"{', TPU interpret mode' if interpret else ''})",
        file=sys.stderr, flush=True,
    )  # fmt: skip
    config = uvicorn.Config(
        create_app(engine, served), log_level="warning",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )  # fmt: skip
    uvicorn.Server(config).run(sockets=[listening])


def _followed(request_id: int, update: object) -> None:
    """A follower's updates of process 0's requests: process 0 answers them."""
    logging.getLogger("mkgen.serve").debug("request %d: %s", request_id, update)


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before uvicorn starts so that a taken port is a
    one-line error (and --port 0 gets a free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listening = socket.socket(family, socket.SOCK_STREAM)
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listening.bind((host, port))
    except OSError as error:
        listening.close()
        raise MkgenError(
            f"--host {host} --port {port}: cannot listen there ({error.strerror})"
        ) from None
    return listening
