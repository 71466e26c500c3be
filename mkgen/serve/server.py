"""serve: the model loaded once, its engine and the HTTP API run by uvicorn until SIGINT or
SIGTERM. The engine warms up (compiles) while uvicorn already answers /health with 503
"warming up". The first SIGINT or SIGTERM drains (DrainingServer): new requests get 503
and /health says "draining" while the requests queued or running go on for up to
--drain-seconds; what is still running then ends with "abort" (a stream gets its final
event and [DONE], a whole completion a 503) and the process exits, by the signal. A
second signal skips the rest of the drain.

In a multi-host job (jax.distributed, one process per host) process 0 does all that;
every other process loads its own devices' weights and runs an engine that takes process
0's turns (mkgen/serve/turns.py), until process 0's engine stops."""

from __future__ import annotations

import logging
import signal
import socket
import sys
import time
from argparse import Namespace
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn

from mkgen.errors import MkgenError, first_line
from mkgen.runtime import devices
from mkgen.runtime.arguments import load_tokenizer
from mkgen.runtime.build import Build
from mkgen.serve import DRAIN_S, MAX_BODY_MIB

if TYPE_CHECKING:
    from mkgen.serve.engine import Engine

# After the drain, how long the responses of aborted requests may take to go out: the
# abort lands when the device call under way ends (milliseconds on a TPU, seconds in
# interpret mode).
ABORT_GRACE_S = 30
log = logging.getLogger("mkgen.serve")


def serve(
    build: Build,
    *,
    weights: Path | None,
    random_weights: int | None,
    draft: bool = False,
    host: str,
    port: int,
    interpret: bool,
    steps_per_call: int,
    queue_limit: int,
    trust_weights: bool = False,
    disaggregate: bool = False,
    host_cache_mib: int = 0,
    multi_host: Namespace | None = None,
    served_model_name: str | None = None,
    max_body_mib: int = MAX_BODY_MIB,
    drain_seconds: float = DRAIN_S,
) -> None:
    """Serve `build` on http://HOST:PORT/v1 until stopped; with `disaggregate`, prompts
    are prefilled on a second group of build.devices devices holding their own copy of
    the weights, and their caches handed over to the decode devices. Finished sequences'
    caches are kept in up to `host_cache_mib` MiB of host memory (0: none) for prompts
    that start with them. `multi_host` (coordinator, num_processes, process_id: each None
    on a TPU pod, which tells its processes) makes it one process of a multi-host job.
    Clients name the model `served_model_name` (default: the build's spec name); request
    bodies over `max_body_mib` MiB are refused (413); SIGTERM drains for `drain_seconds`
    (the module docstring). With `draft` the build's drafter drafts on the device
    (mkgen.runtime.device_drafting), else prompt lookup. Bad inputs (a port taken, weights that do not fit, too few
    devices, a broken tokenizer_config.json, tokenizer files changed since the
    conversion) are MkgenErrors before any request is taken, and so is a failed warm-up
    (nothing could be served)."""
    _log_to_stderr()
    tokenizer, chat, eos_id = _tokenizer_files(weights, verify=not trust_weights)
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
    engine, following = _start_engine(
        build, weights, random_weights, verify=not trust_weights, meshes=meshes, draft=draft,
        interpret=interpret, steps_per_call=steps_per_call, queue_limit=queue_limit,
        disaggregate=disaggregate, host_cache_mib=host_cache_mib,
        multi_host=multi_host is not None,
    )  # fmt: skip
    if following:
        _follow(engine, build)
        return
    from mkgen.serve.app import ServedModel, create_app

    if listening is None:  # a TPU pod made this process 0
        listening = _bind(host, port)
    port = listening.getsockname()[1]  # the one the system chose for --port 0
    # A step writes its drafts' rows beyond a sequence's last token: they need room too.
    context = build.context - (build.rows - 1)
    served = ServedModel(
        name=served_model_name or build.spec, context=context, vocab_used=build.vocab_used,
        tokenizer=tokenizer, chat=chat,
        eos_ids=frozenset() if eos_id is None else frozenset({eos_id}),
    )  # fmt: skip
    print(
        f"serving {served.name} (build {build.name}) at http://{host}:{port}/v1 (batch "
        f"{build.batch}, rows {build.rows}, context "
        f"{context}{', prefill on its own devices' if disaggregate else ''}, host cache "
        f"{f'{host_cache_mib} MiB' if host_cache_mib else 'off'}"
        f"{', TPU interpret mode' if interpret else ''})",
        file=sys.stderr, flush=True,
    )  # fmt: skip
    app = create_app(engine, served, max_body=max_body_mib << 20)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=ABORT_GRACE_S)
    DrainingServer(config, engine, drain_seconds).run(sockets=[listening])
    _check_warm_up(engine)


def _tokenizer_files(weights: Path | None, *, verify: bool) -> tuple[Any, Any, int | None]:
    """(the tokenizer, the chat template, the end-of-sequence id) converted with
    `weights`, each None when there is none (checked against the conversion's sha256 when
    `verify`)."""
    from mkgen.serve.chat import load_tokenizer_config
    from mkgen.weights.convert import TOKENIZER_CONFIG_FILE, tokenizer_file

    tokenizer = load_tokenizer(None, str(weights) if weights else None, verify=verify)
    config = tokenizer_file(weights, TOKENIZER_CONFIG_FILE, verify=verify) if weights else None
    chat, eos = load_tokenizer_config(config) if config else (None, None)
    eos_id = tokenizer.token_to_id(eos) if tokenizer is not None and eos else None
    return tokenizer, chat, eos_id


def _start_engine(
    build: Build,
    weights: Path | None,
    random_weights: int | None,
    *,
    verify: bool,
    meshes: int,
    draft: bool,
    interpret: bool,
    steps_per_call: int,
    queue_limit: int,
    disaggregate: bool,
    host_cache_mib: int,
    multi_host: bool,
) -> tuple[Engine, bool]:
    """(the engine over the loaded model, whether this process follows process 0's
    turns)."""
    import jax

    from mkgen.runtime import disaggregation
    from mkgen.runtime.decode import load_model
    from mkgen.serve.engine import Engine
    from mkgen.serve.metrics import Metrics
    from mkgen.serve.turns import BroadcastTurns

    model = load_model(build, weights, random_weights, verify=verify, meshes=meshes, draft=draft)
    following = jax.process_index() != 0
    engine = Engine(
        model, interpret=interpret, metrics=Metrics(), steps_per_call=steps_per_call,
        queue_limit=queue_limit,
        prefiller=disaggregation.prefill_model(model) if disaggregate else None,
        host_cache_bytes=host_cache_mib << 20,
        turns=BroadcastTurns() if multi_host else None,
        follow=_followed if following else None,
    )  # fmt: skip
    return engine, following


def _follow(engine: Engine, build: Build) -> None:
    """A process other than 0 of a multi-host job: its engine takes process 0's turns
    until process 0's engine stops."""
    import jax

    print(
        f"process {jax.process_index()} of {jax.process_count()}: serving {build.name} "
        "with process 0 (its engine's turns), until it stops",
        file=sys.stderr, flush=True,
    )  # fmt: skip
    try:
        engine.run()
    except Exception as error:  # a collective failed: process 0 is gone
        raise MkgenError(
            f"process {jax.process_index()}: process 0's turns stopped arriving "
            f"({first_line(error)}); "
            "restart every process of the job"
        ) from None
    _check_warm_up(engine)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining on the first SIGINT or SIGTERM: the engine takes no new
    request (503) while those queued or running go on; the server exits once none is
    left, or when `drain_seconds` are over, when the engine ends the rest with "abort".
    A second signal is uvicorn's (exit now; a second SIGINT forces it). The server also
    exits when the engine's warm-up failed."""

    def __init__(self, config: uvicorn.Config, engine: Engine, drain_seconds: float) -> None:
        super().__init__(config)
        self.engine, self.drain_seconds = engine, drain_seconds
        self.drain_started: float | None = None  # monotonic seconds of the first signal
        self.draining = False  # the engine was told (on a tick: not in the signal handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain_started is None:
            self._captured_signals.append(sig)  # uvicorn raises it again once it is done
            self.drain_started = time.monotonic()
        else:
            super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.engine.failure is not None:
            self.should_exit = True
        if self.drain_started is not None and not self.should_exit:
            self._drain()
        if self.should_exit:  # what still runs ends with "abort" after its device call
            self.engine.request_stop()
        return await super().on_tick(counter)

    def _drain(self) -> None:
        assert self.drain_started is not None
        if not self.draining:
            self.engine.drain()
            self.draining = True
            name = signal.Signals(self._captured_signals[0]).name
            log.info("%s: draining (no new requests; those running have %g s to finish)",
                     name, self.drain_seconds)  # fmt: skip
        spent = time.monotonic() - self.drain_started
        if not self.engine.busy and not self.server_state.tasks:
            log.info("drained in %.1f s: stopping", spent)
            self.should_exit = True
        elif spent >= self.drain_seconds:
            log.info("drain time over (%g s): the requests still running end with abort",
                     self.drain_seconds)  # fmt: skip
            self.should_exit = True


def _check_warm_up(engine: Engine) -> None:
    if engine.failure is not None:
        raise MkgenError(f"the engine's warm-up failed ({engine.failure}): nothing was served")


def _log_to_stderr() -> None:
    """The engine's and the server's log lines (warm-up, drain, failures) on stderr."""
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("mkgen serve: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


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
