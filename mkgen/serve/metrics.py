"""The server's Prometheus metrics (GET /metrics), in a registry of its own so that
several servers in one process (the tests) do not share counters."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

# Seconds: interpret mode on a CPU takes seconds per step, a TPU milliseconds.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    """Time to first token, inter-token latency, tokens, queue depth, slots in use,
    accepted length and the host cache of finished sequences (prefix reuse), as the engine
    records them; the process's own (prometheus_client's process_resident_memory_bytes,
    process_cpu_seconds_total, ..., on Linux)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        self.time_to_first_token = Histogram(
            "mkgen_time_to_first_token_seconds", "From a request's arrival to its first token",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.inter_token_latency = Histogram(
            "mkgen_inter_token_latency_seconds",
            "Per generated token after the first: its device call's seconds per kernel step",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "mkgen_prompt_tokens", "Prompt tokens of admitted requests, reused ones included",
            registry=r,
        )  # fmt: skip
        self.generation_tokens = Counter(
            "mkgen_generation_tokens", "Tokens generated (stop ids included)", registry=r
        )
        self.requests = Counter(
            "mkgen_requests",
            "Requests ended, by finish reason (cancelled: given up in the queue or a slot)",
            ["finish_reason"], registry=r,
        )  # fmt: skip
        self.queue_depth = Gauge("mkgen_queue_depth", "Requests waiting for a slot", registry=r)
        self.slots_in_use = Gauge("mkgen_slots_in_use", "Batch slots holding a request", registry=r)
        self.slots = Gauge("mkgen_slots", "Batch slots of the kernel (its batch)", registry=r)
        self.accepted_length = Histogram(
            "mkgen_accepted_length",
            "Tokens a sequence gained per generating kernel step (1 without drafts)",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16), registry=r,
        )  # fmt: skip
        self.prefix_cache_hits = Counter(
            "mkgen_prefix_cache_hits", "Admitted prompts that started with a cached sequence",
            registry=r,
        )  # fmt: skip
        self.prefix_cache_misses = Counter(
            "mkgen_prefix_cache_misses", "Admitted prompts that started with none", registry=r
        )
        self.prefix_cache_tokens_reused = Counter(
            "mkgen_prefix_cache_tokens_reused",
            "Prompt tokens restored from the host cache instead of prefilled", registry=r,
        )  # fmt: skip
        self.host_cache_bytes = Gauge(
            "mkgen_host_cache_bytes", "Host memory held by cached sequences' caches", registry=r
        )
        self.host_cache_limit_bytes = Gauge(
            "mkgen_host_cache_limit_bytes", "The host cache's bound (--host-cache-mib)", registry=r
        )
        self.host_cache_sequences = Gauge(
            "mkgen_host_cache_sequences", "Sequences in the host cache", registry=r
        )
        self.host_cache_evictions = Counter(
            "mkgen_host_cache_evictions", "Sequences evicted from the host cache (LRU)", registry=r
        )

    def exposition(self) -> bytes:
        """The metrics in Prometheus' text format."""
        return generate_latest(self.registry)
