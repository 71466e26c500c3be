"""`mkgen serve`: a build's kernel behind an OpenAI-compatible HTTP API.

    app.py      the HTTP layer (FastAPI): requests checked, responses and SSE streams
    schema.py   request bodies parsed and type-checked strictly (pydantic)
    tokens.py   text to token ids without tokenizing more than the context can hold
    guard.py    ASGI middleware: request bodies capped, unexpected faults as 500s
    errors.py   the OpenAI error object of every refusal
    engine.py   the continuous-batching engine over the kernel's batch slots
    host_cache.py  finished sequences' caches in host memory, for prompts that extend them
    turns.py    a multi-host job's engines share process 0's turns (jax.distributed)
    chat.py     chat messages to a prompt with the checkpoint's chat template (jinja2)
    metrics.py  Prometheus metrics
    server.py   serve: load the model, start the engine, run uvicorn

The CLI imports the defaults below and server.py's `serve`, which sets JAX's device
environment before it imports the engine (which imports JAX).
"""

HOST_CACHE_MIB = 4096  # mkgen serve --host-cache-mib's default: host memory for the host cache
MAX_BODY_MIB = 8  # --max-body-mib's default: a request body over it is refused (413)
DRAIN_S = 30  # --drain-seconds's default: how long SIGTERM lets queued and running requests go on
