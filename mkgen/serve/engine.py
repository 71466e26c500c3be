"""The continuous-batching engine: one thread owns the model and the kernel's BATCH cache
slots; requests join free slots between device calls and leave when done.

Each loop turn: drop cancelled requests (their slots free at once), admit queued prompts
into free slots (each prompt's tokens but the last prefilled in XLA through
decode.prefill_sequence, on the prefill mesh when disaggregated and then handed over, and
written into its slot with slots.insert_sequence; while other
sequences are running, only PREFILL_TOKENS_PER_TURN prompt tokens per turn, so they keep
streaming), then one device call of up to STEPS_PER_CALL kernel steps for every running
sequence (decode.chunk_decoder), each at its own position with its own sampling
parameters; with ROWS > 1 each step verifies ROWS - 1 prompt-lookup drafts per sequence,
drafted, accepted (greedy, or the rejection rule) and sampled on the device. Results go back to each request's `deliver` callback (called on
the engine thread) at call boundaries only.

Every turn starts from a Turn: the requests that arrived, those given up, whether the
engine stops. In a multi-host job (mkgen/serve/turns.py) process 0's engine takes
requests over HTTP and shares each turn with the other processes' engines, which take
the same turns in the same order: every process then makes the same device calls with
the same inputs, as jax.distributed requires, and only process 0 answers requests.

Before its first turn the engine warms up: it compiles the prefill of every prompt chunk
size and the decoding call on a dummy sequence, so the first request does not wait for
compilation (the server reports healthy only then). Every request's inputs are checked
against what the device call takes when it is admitted (params_problem and the prompt's
ids and length), so no request's values can make a call fail; a call that fails anyway
before it consumed the caches is run dry (no step) once per request alone, and only the
requests whose dry run fails end with an error, the others going on.

A sequence that ends leaves its slot's caches in the host cache (host_cache.HostCache,
offloaded with disaggregation.offload), keyed by the tokens they hold; a prompt that starts
with such a sequence has its caches restored into its slot and only the rest of it
prefilled, after them (multi-turn chat).

Imports JAX: imported after the device environment is set.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from mkgen.interpret import interpret_mode
from mkgen.runtime.decode import (
    DrafterStates,
    Model,
    Observed,
    SamplingParams,
    chunk_decoder,
    commit_states,
    drafter_inputs,
    empty_caches,
    gained_tokens,
    history_array,
    prefill_sequence,
)
from mkgen.runtime.devices import host_value
from mkgen.runtime.disaggregation import hand_over, offload, restore
from mkgen.runtime.sampling_bounds import sampling_problem
from mkgen.runtime.slots import extract_sequence, insert_sequence
from mkgen.runtime.weights import embedding_on_devices
from mkgen.serve import HOST_CACHE_MIB
from mkgen.serve.errors import one_line
from mkgen.serve.host_cache import CachedPrefix, HostCache
from mkgen.serve.metrics import Metrics

STEPS_PER_CALL = 8  # kernel steps per device call: the host round trip is paid once per call
QUEUE_LIMIT = 64  # requests waiting beyond the free slots; more are answered 429
# Prompt tokens prefilled between two device calls while sequences run: what a running
# sequence waits for at most (beyond one prompt) before its next tokens.
PREFILL_TOKENS_PER_TURN = 256
RETRY_AFTER_S = 1  # what a 429 or 503 tells the client to wait
# An idle multi-host leader still shares a turn this often: the other processes wait for
# it inside a collective, which must not sit long enough to time out.
IDLE_TURN_S = 1.0

log = logging.getLogger("mkgen.serve")


@dataclass(frozen=True)
class GenerationParams:
    """What a request asks of the decoding: at most max_tokens tokens; temperature 0 is
    greedy (the kernel's argmax); top_k 0 keeps every token; stop ids end the sequence
    (the stop id is counted but not returned)."""

    max_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_ids: frozenset[int] = frozenset()


def params_problem(params: GenerationParams, vocab_used: int) -> tuple[str, str] | None:
    """The first field of `params` the device call cannot take as it is, and why (None:
    every one fits): max_tokens >= 1, then the sampling rule `mkgen run` applies too
    (mkgen.runtime.sampling_bounds). The HTTP layer refuses such a request (400); the engine
    ends one that gets past it alone, before it joins a device call."""
    if params.max_tokens < 1:
        return "max_tokens", f"must be at least 1, got {params.max_tokens}"
    return sampling_problem(params.temperature, params.top_k, params.top_p, params.seed, vocab_used)


@dataclass(frozen=True)
class Update:
    """What one device call gave a request: its new tokens, and why it ended (None while
    it runs; "stop": a stop id, "length": max_tokens, "abort": the server stopped,
    "error": the device call failed)."""

    tokens: list[int]
    finish_reason: str | None = None


@dataclass(eq=False)
class Request:
    """A prompt waiting for or holding a slot. `deliver` is called on the engine thread
    after every device call that gave it tokens, and once with a finish_reason."""

    prompt: list[int]
    params: GenerationParams
    deliver: Callable[[Update], None]
    arrival: float = field(default_factory=time.perf_counter)
    generated: int = 0  # tokens the kernel produced for it, a stop id included
    cancelled: bool = False  # given up: the next turn drops it
    id: int = -1  # the engine's number for it (a turn names it by this)


@dataclass(frozen=True)
class Arrival:
    """A request as a turn carries it to the other processes of a multi-host job."""

    id: int
    prompt: list[int]
    params: GenerationParams


@dataclass(frozen=True)
class Turn:
    """What the engine took in before one loop turn: the requests that arrived (queued in
    this order), the ids of those given up (dropped from the queue or their slot), and
    whether it stops."""

    arrivals: tuple[Arrival, ...] = ()
    cancelled: frozenset[int] = frozenset()
    stopping: bool = False

    def to_json(self) -> str:
        arrivals = [
            {**asdict(a), "params": {**asdict(a.params), "stop_ids": sorted(a.params.stop_ids)}}
            for a in self.arrivals
        ]
        return json.dumps(
            {"arrivals": arrivals, "cancelled": sorted(self.cancelled), "stopping": self.stopping}
        )

    @classmethod
    def from_json(cls, text: str) -> Turn:
        data = json.loads(text)
        arrivals = tuple(
            Arrival(
                a["id"],
                a["prompt"],
                GenerationParams(**{**a["params"], "stop_ids": frozenset(a["params"]["stop_ids"])}),
            )
            for a in data["arrivals"]
        )
        return cls(arrivals, frozenset(data["cancelled"]), data["stopping"])


class TurnChannel(Protocol):
    """How the engines of a multi-host job share turns: process 0's engine passes its
    turn and the others None; every one gets process 0's turn back."""

    def share(self, turn: Turn | None) -> Turn: ...


@dataclass(eq=False)
class _Running:
    """A request in a slot: its prompt and generated tokens, all in its cache but the last
    (the token to feed next), which the drafts are looked up in."""

    request: Request
    history: list[int]
    first_token_at: float | None = None
    # Whether its slot's caches hold exactly its history but the last token (host cache).
    reusable: bool = True


class QueueFull(Exception):
    """Every slot is taken and QUEUE_LIMIT requests wait: try again later (HTTP 429)."""


class EngineStopped(Exception):
    """The engine is stopping (SIGTERM) and takes no new requests (HTTP 503)."""


class Engine:
    """The long-lived decoding engine over `model`. Prompts are
    prefilled on `prefiller` (default `model` itself: colocated), a model of the same
    build on its own devices (disaggregation.prefill_model), whose caches are handed over
    to `model`'s mesh before they go into their slot. Finished sequences' caches are kept
    in up to `host_cache_bytes` of host memory (0: none) for prompts that start with them.

    With `turns`, the engine is one of a multi-host job's: process 0's (`follow` None)
    takes requests and shares its turns; any other process's takes process 0's turns
    (run it with `run`) and passes each of its requests' updates to `follow` with the
    request's id, for nobody answers them there."""

    def __init__(
        self,
        model: Model,
        *,
        interpret: bool,
        metrics: Metrics,
        steps_per_call: int = STEPS_PER_CALL,
        queue_limit: int = QUEUE_LIMIT,
        prefiller: Model | None = None,
        host_cache_bytes: int = HOST_CACHE_MIB << 20,
        turns: TurnChannel | None = None,
        follow: Callable[[int, Update], None] | None = None,
    ) -> None:
        build = model.build
        self.turns, self.follow = turns, follow
        self._ids = itertools.count()
        self._arrived: list[Request] = []  # submitted since the last turn
        self.model, self.metrics, self.interpret = model, metrics, interpret
        self.prefiller = prefiller or model
        self.steps_per_call, self.queue_limit = steps_per_call, queue_limit
        step_fn = model.kernel.make_decode_step(model.mesh)
        self._decoder = chunk_decoder(model, step_fn, steps_per_call)
        # The build's drafter when it drafts (--drafter build), kept across calls.
        self._draft_weights, self._draft_state = drafter_inputs(model)
        drafter = model.drafting.drafter if model.drafting is not None else None
        # An mtp or block drafter commits each admitted prompt's prefill states.
        self._observe = jax.jit(drafter.observe) if drafter and drafter.observes_steps else None
        self._embedding = embedding_on_devices(
            build, model.weights.embedding, model.mesh, model.kernel
        )
        self._caches = empty_caches(model, build.batch)
        self._slots: list[_Running | None] = [None] * build.batch
        self._queue: collections.deque[Request] = collections.deque()
        self._wake = threading.Condition()
        self._stopping = self._draining = False
        self.warm = threading.Event()  # set once the warm-up compiled what requests run
        self.failure: str | None = None  # why the warm-up failed
        self._thread = threading.Thread(target=self._loop, name="mkgen-engine", daemon=True)
        # Per kernel cache array: whether it is a recurrent one (else indexed by position).
        recurrent = [
            a.name in build.recurrent_kinds for a in model.layout.attention for _ in a.caches
        ]
        self._recurrent = any(recurrent)
        self._host_cache = None
        if host_cache_bytes:
            by_position = [not r for r in recurrent]
            self._host_cache = HostCache(host_cache_bytes, by_position, model.layout.context)
        metrics.slots.set(build.batch)
        metrics.host_cache_limit_bytes.set(host_cache_bytes)

    # ------------------------------------------------------------ the HTTP side

    def start(self) -> None:
        """Start the engine thread: it warms up, then takes turns."""
        self._thread.start()

    def run(self) -> None:
        """The engine loop on this thread, until a turn stops it (a follower's)."""
        self._loop()

    def submit(self, request: Request) -> None:
        """Queue `request` (it joins the queue at the next turn; while the engine warms
        up, it waits for that); QueueFull when queue_limit requests already wait beyond
        the free slots, EngineStopped once drain() or stop() was called."""
        with self._wake:
            if self._draining or self._stopping:
                raise EngineStopped
            free = sum(running is None for running in self._slots)
            waiting = len(self._queue) + len(self._arrived)
            if waiting >= self.queue_limit + free:
                raise QueueFull
            request.id = next(self._ids)
            self._arrived.append(request)
            self.metrics.queue_depth.set(waiting + 1)
            self._wake.notify()

    def cancel(self, request: Request) -> None:
        """Give up `request` (its client left, or a stop string ended it): the next turn
        frees its slot, before the next device call, or drops it from the queue; it gets
        no more updates."""
        with self._wake:
            request.cancelled = True
            self._wake.notify()

    def drain(self) -> None:
        """Take no new request (EngineStopped); those queued or running go on."""
        with self._wake:
            self._draining = True

    def request_stop(self) -> None:
        """Make the next turn the last: whatever is still queued or running then gets an
        "abort" update (at the end of the device call under way, if any), and new
        requests get EngineStopped."""
        with self._wake:
            self._stopping = True
            self._wake.notify()

    def stop(self) -> None:
        """request_stop(), then wait for the engine thread to end."""
        self.request_stop()
        if self._thread.is_alive():
            self._thread.join()

    @property
    def busy(self) -> bool:
        """Whether a request is queued or holds a slot."""
        with self._wake:
            return bool(self._queue or self._arrived or any(self._slots))

    @property
    def state(self) -> str:
        """ "warming up", "ok" (taking requests), "draining", "stopping", or "failed" (the
        warm-up failed: `failure` says why)."""
        if self.failure is not None:
            return "failed"
        if self._stopping or (self.warm.is_set() and not self._thread.is_alive()):
            return "stopping"
        if self._draining:
            return "draining"
        return "ok" if self.warm.is_set() else "warming up"

    # ------------------------------------------------------------ the engine thread

    def _loop(self) -> None:
        mode = interpret_mode() if self.interpret else contextlib.nullcontext()
        with mode:
            if self._warmed_up():
                self._collect(freeze=True)
                while self._next_turn():
                    try:
                        self._admit()
                        if any(self._slots):
                            self._decode_call()
                            self._collect()
                    except Exception as error:  # a failed call must not take the server down
                        log.error("device call failed (%s); the running requests end with an "
                                  "error, their caches start afresh", one_line(error))  # fmt: skip
                        self._end_running("error")
                        # The failed call may have consumed the donated caches.
                        self._caches = empty_caches(self.model, len(self._slots))
        self._end_running("abort")
        self._end_queued("error" if self.failure is not None else "abort")

    def _collect(self, freeze: bool = False) -> None:
        """In interpret mode, collect the garbage of the last device call: the TPU
        interpreter leaves reference cycles holding its buffers (about 60 MB a call on
        the tests' tiny model), which Python's own full collections free too rarely. After
        the warm-up (`freeze`) what lives on (model, programs) is frozen out of every later
        collection, so that each takes milliseconds."""
        if self.interpret:
            gc.collect()
            if freeze:
                gc.freeze()

    def _warmed_up(self) -> bool:
        """Compile what requests run, on a dummy sequence in slot 0 (which the first
        request admitted there overwrites whole): the prefill of every prompt chunk size
        (warm_up_prefills), the device call and, with a host cache, a slot's copy out. True
        when done; False (`failure` says why) when it failed: nothing could be served."""
        start = time.perf_counter()
        log.info("warming up: compiling the prefill and the decoding call")
        try:
            build = self.model.build
            # The longest prompt leaves a token of room (and the drafts' rows); its last
            # token is fed to the kernel, not prefilled.
            for length in warm_up_prefills(build.context - build.rows - 1):
                sequence, _ = self._prefilled([0] * (length + 1), None)
                self._caches = insert_sequence(self._caches, 0, sequence)
            # count 0: the device call's program is compiled (the step count is one of
            # its inputs) and run for no step, so no kernel step is spent on the dummy.
            self._call({0: _SlotInputs([0, 0], 1, GenerationParams(1))}, count=0)
            if self._host_cache is not None:
                offload(extract_sequence(self._caches, 0))
        except Exception as error:
            self.failure = one_line(error)
            log.error("warm-up failed: %s", self.failure)
            return False
        log.info("warm in %.1f s: taking requests", time.perf_counter() - start)
        self.warm.set()
        return True

    def _next_turn(self) -> bool:
        """Wait for work and take the turn: process 0's (or this process's own), shared
        with the other processes of a multi-host job, or process 0's on another process.
        False once the engine is stopping."""
        if self.follow is not None:
            assert self.turns is not None
            return self._take(self.turns.share(None), [])
        with self._wake:
            while not (self._stopping or self._queue or self._arrived or any(self._slots)):
                if not self._wake.wait(IDLE_TURN_S if self.turns is not None else None):
                    break  # an idle turn, shared so that the other processes hear from us
            arrived, self._arrived = self._arrived, []
            waiting = [*self._queue, *arrived, *(s.request for s in self._slots if s)]
            turn = Turn(
                tuple(Arrival(r.id, r.prompt, r.params) for r in arrived),
                frozenset(r.id for r in waiting if r.cancelled),
                self._stopping,
            )
        return self._take(self.turns.share(turn) if self.turns is not None else turn, arrived)

    def _take(self, turn: Turn, arrived: list[Request]) -> bool:
        """Queue the turn's arrivals (`arrived`: their requests, on the process that took
        them) and drop the requests it gave up, those in slots keeping their caches.
        False if it stops the engine."""
        requests = {r.id: r for r in arrived}
        for a in turn.arrivals:
            if a.id not in requests:  # process 0's request on a follower: its updates go
                assert self.follow is not None  # to `follow` (only process 0 answers)
                deliver = functools.partial(self.follow, a.id)
                requests[a.id] = Request(a.prompt, a.params, deliver, id=a.id)
            self._queue.append(requests[a.id])
        with self._wake:
            dropped = sum(r.id in turn.cancelled for r in self._queue)
            self._queue = collections.deque(r for r in self._queue if r.id not in turn.cancelled)
            self.metrics.queue_depth.set(len(self._queue) + len(self._arrived))
        self.metrics.requests.labels("cancelled").inc(dropped)  # given up while queued
        for slot, running in enumerate(self._slots):
            if running is not None and running.request.id in turn.cancelled:
                self._finish(slot, None, keep=True)
        return not turn.stopping

    def _admit(self) -> None:
        """Prefill queued prompts into free slots: as many as fit while nothing runs,
        else up to PREFILL_TOKENS_PER_TURN prompt tokens (at least one prompt) between
        two device calls, so that running sequences keep streaming. A request that
        cannot be admitted (_request_problem, a failed prefill) ends with an error and
        leaves its slot to the next."""
        busy = any(self._slots)
        prefilled = 0
        free = [slot for slot, running in enumerate(self._slots) if running is None]
        while free:
            with self._wake:
                if not self._queue:
                    return
                request = self._queue.popleft()
                self.metrics.queue_depth.set(len(self._queue))
            prompt = request.prompt
            problem = self._request_problem(request)
            if problem is not None:  # it cannot join a device call: it alone fails
                self._refuse(request, f"request {request.id} refused ({problem})")
                continue
            hit = self._host_cache.lookup(prompt) if self._host_cache is not None else None
            try:
                sequence, states = self._prefilled(prompt, hit)
            except Exception as error:  # this request fails; the others are untouched
                self._refuse(request, f"prefill of request {request.id} failed ({one_line(error)})")
                continue
            slot = free.pop(0)
            self._caches = insert_sequence(self._caches, slot, sequence)
            self._commit_prompt(slot, prompt, states)
            self._slots[slot] = _Running(request, list(prompt))
            self.metrics.prompt_tokens.inc(len(prompt))
            self.metrics.slots_in_use.set(sum(s is not None for s in self._slots))
            reused = hit.length if hit is not None else 0
            if self._host_cache is not None:
                (self.metrics.prefix_cache_hits if hit else self.metrics.prefix_cache_misses).inc()
                self.metrics.prefix_cache_tokens_reused.inc(reused)
            prefilled += len(prompt) - reused
            if busy and prefilled >= PREFILL_TOKENS_PER_TURN:
                return

    def _request_problem(self, request: Request) -> str | None:
        """Why `request`'s inputs cannot go into a device call (None: they can): a
        params_problem, an empty prompt, an id outside the vocabulary, or a prompt and
        max_tokens (and the drafts' rows) beyond the context."""
        build, prompt = self.model.build, request.prompt
        wrong = params_problem(request.params, build.vocab_used)
        if wrong is not None:
            return f"{wrong[0]}: {wrong[1]}"
        if not prompt or not all(0 <= t < build.vocab_used for t in prompt):
            return "prompt: empty, or an id outside the vocabulary"
        if len(prompt) + request.params.max_tokens + build.rows - 1 > build.context:
            return f"prompt and max_tokens: beyond the context of {build.context}"
        return None

    def _refuse(self, request: Request, why: str) -> None:
        """End queued `request` with an error (logged in one line: `why`)."""
        log.error("%s; it ends with an error, the others go on", why)
        self.metrics.requests.labels("error").inc()
        request.deliver(Update([], "error"))

    def _prefilled(
        self, prompt: list[int], hit: CachedPrefix | None
    ) -> tuple[list[jax.Array], list[Observed]]:
        """A prompt's caches on the decode mesh, holding all its tokens but the last (the
        kernel is fed that one): prefilled, or `hit`'s cached caches restored with the
        tokens after them prefilled at the positions that follow; and what the build's
        drafter observes of the prefill (DrafterStates.observed): an mtp or block
        drafter's prefilled states (none after a hit, whose first tokens' states are not
        kept, so that sequence drafts by prompt lookup), a kernel's first drafts (after a
        hit too: its MTP module's cache is restored with the others)."""
        if hit is not None and hit.length == len(prompt) - 1:
            return restore(hit.caches, self.model), []
        start, cached = (hit.length, hit.caches) if hit is not None else (0, None)
        states = DrafterStates(self.model, start)
        keep = states.keep if self._observe is not None and hit is None else None
        sequence = prefill_sequence(
            self.prefiller, prompt[start:-1], start, cached, keep, next_token=prompt[-1],
            drafted=states.drafted if states.wants_drafts else None,
        )  # fmt: skip
        if self.prefiller is not self.model:
            sequence = hand_over(sequence, self.model)
        return sequence, states.observed()

    def _commit_prompt(self, slot: int, prompt: list[int], observed: list[Observed]) -> None:
        """The build's drafter observes a prompt prefilled into `slot` (a commit from
        position 0 begins the slot afresh)."""
        batch = len(self._slots)
        histories: list[list[int]] = [[] for _ in range(batch)]
        histories[slot] = prompt
        for offset, values, n in observed:  # only a drafter that observes gets any
            assert self.model.drafting is not None
            axis = self.model.drafting.drafter.observed_batch_axis
            # On the host: the values may lie on a disaggregated prefill's mesh.
            one = np.moveaxis(host_value(values), axis, 0)
            slots = np.zeros((batch, *one.shape[1:]), one.dtype)
            slots[slot] = one[0]
            count = [0] * batch
            count[slot] = n
            self._draft_state = commit_states(
                self.model, self._observe, self._draft_weights, self._draft_state, histories,
                [offset] * batch, np.moveaxis(slots, 0, axis), count,
            )  # fmt: skip

    def _decode_call(self) -> None:
        """One device call for every running sequence; each gets its tokens. When the
        call fails before it consumed the caches, the requests whose dry run alone fails
        end with an error (_culprits) and the call is made again without them."""
        inputs = {
            b: _SlotInputs(running.history, running.request.params.max_tokens
                           - running.request.generated, running.request.params)
            for b, running in enumerate(self._slots) if running is not None
        }  # fmt: skip
        start = time.perf_counter()
        try:
            out, gained, count = self._call(inputs)
        except Exception as error:
            culprits = self._culprits(inputs)
            if not culprits:
                raise  # no request alone makes it fail: every running one ends (_loop)
            log.error("device call failed (%s); requests %s fail it alone: they end with "
                      "an error, the others go on", one_line(error),
                      ", ".join(str(self._slots[b].request.id) for b in culprits))  # fmt: skip
            for b in culprits:
                self._finish(b, Update([], "error"), keep=False)
                del inputs[b]
            if not inputs:
                return
            start = time.perf_counter()
            out, gained, count = self._call(inputs)
        done = time.perf_counter()
        for b in inputs:
            running = self._slots[b]
            assert running is not None
            per_step = gained[:count, b]
            for tokens_in_step in per_step[per_step > 0]:
                self.metrics.accepted_length.observe(int(tokens_in_step))
            every_step = bool((per_step > 0).all())
            self._advance(b, running, gained_tokens(out, gained, b), every_step, done - start, done)

    def _call(
        self, inputs: dict[int, _SlotInputs], count: int | None = None
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """The device call (chunk_decoder) for the slots in `inputs` (the others take a
        free slot's inputs: budget 0), `count` steps (default: as many as the largest
        budget needs, at most steps_per_call): its tokens and gained counts on the host,
        and the count."""
        batch = len(self._slots)
        budget, positions = [0] * batch, [0] * batch
        temperature, top_k, top_p, seed = [0.0] * batch, [0] * batch, [1.0] * batch, [0] * batch
        histories: list[list[int]] = [[] for _ in range(batch)]
        for b, slot in inputs.items():
            budget[b], histories[b], positions[b] = slot.budget, slot.history, len(slot.history) - 1
            params = slot.params
            temperature[b], top_k[b], top_p[b] = params.temperature, params.top_k, params.top_p
            seed[b] = params.seed
        if count is None:
            count = min(self.steps_per_call, max(budget))
        out, gained, self._caches, self._draft_state = self._decoder(
            history_array(histories, self.model.build.context),
            jnp.asarray(positions, jnp.int32), jnp.asarray(budget, jnp.int32), count,
            SamplingParams.create(temperature, top_k, top_p, seed), self._embedding,
            self.model.placed, self._caches, self._draft_weights, self._draft_state,
        )  # fmt: skip
        return host_value(jax.block_until_ready(out)), host_value(gained), count

    def _culprits(self, inputs: dict[int, _SlotInputs]) -> list[int]:
        """The slots whose inputs alone make the device call fail, found by a dry run (no
        kernel step: the caches come back as they were) of each. None (an empty list)
        when the failed call consumed the caches (donated), for then nothing can be run
        again, or when every dry run fails: then the fault is not one request's."""
        culprits = []
        for b, slot in inputs.items():
            if any(c.is_deleted() for c in self._caches):
                return []
            try:
                self._call({b: slot}, count=0)
            except Exception:
                culprits.append(b)
        consumed = any(c.is_deleted() for c in self._caches)
        return [] if consumed or len(culprits) == len(inputs) else culprits

    def _advance(
        self,
        slot: int,
        running: _Running,
        tokens: list[int],
        every_step: bool,
        call_s: float,
        now: float,
    ) -> None:
        """Slot `slot`'s sequence gained `tokens` from a device call of `call_s` seconds
        (some in `every_step` of the call, or it ended before the last one)."""
        request = running.request
        stops = [i for i, t in enumerate(tokens) if t in request.params.stop_ids]
        if self._recurrent:
            # A recurrent state holds every token the kernel was fed: tokens after a stop
            # id, or a step repeated in place after the sequence ended, were fed and not
            # kept. (Attention caches are written by position: what is fed after the kept
            # tokens leaves theirs as they are.)
            running.reusable = every_step and (not stops or stops[0] == len(tokens) - 1)
        if stops:
            tokens = tokens[: stops[0] + 1]
        request.generated += len(tokens)
        running.history += tokens
        self.metrics.generation_tokens.inc(len(tokens))
        if running.first_token_at is None:
            running.first_token_at = now
            self.metrics.time_to_first_token.observe(now - request.arrival)
            later = len(tokens) - 1
        else:
            later = len(tokens)
        for _ in range(later):  # the call's tokens came at an even pace
            self.metrics.inter_token_latency.observe(call_s / len(tokens))
        shown = tokens[: stops[0]] if stops else tokens
        if stops:
            self._finish(slot, Update(shown, "stop"), keep=True)
        elif request.generated >= request.params.max_tokens:
            self._finish(slot, Update(shown, "length"), keep=True)
        else:
            request.deliver(Update(shown))

    def _finish(self, slot: int, last: Update | None, *, keep: bool) -> None:
        """Free `slot`; its request gets `last` (None: it was cancelled, nobody listens).
        With `keep` (the caches are those of the last device call, which did not fail),
        its caches go to the host cache first."""
        running = self._slots[slot]
        assert running is not None
        if keep:
            self._keep(slot, running)
        self._slots[slot] = None
        self.metrics.slots_in_use.set(sum(s is not None for s in self._slots))
        if last is not None:
            self.metrics.requests.labels(last.finish_reason).inc()
            running.request.deliver(last)
        else:
            self.metrics.requests.labels("cancelled").inc()

    def _keep(self, slot: int, running: _Running) -> None:
        """Offload slot `slot`'s caches into the host cache under the tokens they hold: its
        sequence's history but the last token (never fed), when they hold exactly those."""
        if self._host_cache is None or not running.reusable:
            return
        caches = offload(extract_sequence(self._caches, slot))
        self.metrics.host_cache_evictions.inc(self._host_cache.store(running.history[:-1], caches))
        self.metrics.host_cache_bytes.set(self._host_cache.bytes)
        self.metrics.host_cache_sequences.set(len(self._host_cache))

    def _end_running(self, reason: str) -> None:
        """End every request in a slot with `reason` (its caches are not kept: the engine
        stops, or the device call failed)."""
        for slot, running in enumerate(self._slots):
            if running is not None:
                last = None if running.request.cancelled else Update([], reason)
                self._finish(slot, last, keep=False)

    def _end_queued(self, reason: str) -> None:
        """End every request still waiting for a slot with `reason` (one given up
        meanwhile is counted as cancelled, and gets nothing)."""
        with self._wake:
            waiting, self._queue = [*self._queue, *self._arrived], collections.deque()
            self._arrived = []
            self.metrics.queue_depth.set(0)
        for request in waiting:
            self.metrics.requests.labels("cancelled" if request.cancelled else reason).inc()
            if not request.cancelled:
                request.deliver(Update([], reason))


@dataclass(frozen=True)
class _SlotInputs:
    """What a device call takes of one slot's sequence: its history (the last token is
    fed next), the tokens it may still gain, and its sampling parameters."""

    history: list[int]
    budget: int
    params: GenerationParams


def warm_up_prefills(longest: int) -> list[int]:
    """Prefill lengths that together use every prompt chunk of a prefill of up to
    `longest` tokens (chunks are the powers of two of a length's binary form): the
    largest power p and p - 1 (every smaller one), as one length when 2p - 1 fits."""
    if longest < 1:
        return []
    p = 1 << (longest.bit_length() - 1)
    return [2 * p - 1] if 2 * p - 1 <= longest else [p, p - 1]
