"""`mkgen serve`: a build's kernel behind an OpenAI-compatible HTTP API.

    app.py      the HTTP layer (FastAPI): requests checked, responses and SSE streams
    engine.py   the continuous-batching engine over the kernel's batch slots
    host_cache.py  finished sequences' caches in host memory, for prompts that extend them
    turns.py    a multi-host job's engines share process 0's turns (jax.distributed)
    chat.py     chat messages to a prompt with the checkpoint's chat template (jinja2)
    metrics.py  Prometheus metrics
    server.py   serve: load the model, start the engine, run uvicorn

The CLI imports HOST_CACHE_MIB below and server.py's `serve`, which sets JAX's device
environment before it imports the engine (which imports JAX).
"""

HOST_CACHE_MIB = 4096  # mkgen serve --host-cache-mib's default: host memory for the host cache
