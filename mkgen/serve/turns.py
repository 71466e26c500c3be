"""The engines of a multi-host `mkgen serve` share process 0's turns (engine.Turn).

Process 0 takes the HTTP requests; every process must still make the same device calls
with the same inputs (jax.distributed's rule), so every turn process 0's engine takes
goes to the others before any of them acts on it, as JSON bytes through JAX's own
broadcast across processes (multihost_utils.broadcast_one_to_all: a collective over
every process's devices). Two broadcasts per turn: the length, then the bytes padded to
a power of two (and sent as 32-bit words), so that the broadcast compiles for a few sizes only.

Imports JAX: imported after the device environment is set.
"""

from __future__ import annotations

import numpy as np
from jax.experimental.multihost_utils import broadcast_one_to_all

from mkgen.serve.engine import Turn

MIN_TURN_BYTES = 256  # the smallest padded turn (an idle one is about 50 bytes)


class BroadcastTurns:
    """engine.TurnChannel across the processes of a jax.distributed job: process 0 passes
    its turn, the others None, and all of them get process 0's."""

    def share(self, turn: Turn | None) -> Turn:
        payload = turn.to_json().encode() if turn is not None else b""
        length = int(broadcast_one_to_all(np.array(len(payload), np.int32)))
        padded = np.zeros(max(MIN_TURN_BYTES, 1 << (length - 1).bit_length()), np.uint8)
        padded[: len(payload)] = np.frombuffer(payload, np.uint8)
        # As 32-bit words: the collective sums them (zeros from all but process 0).
        shared = np.asarray(broadcast_one_to_all(padded.view(np.int32))).view(np.uint8)
        return Turn.from_json(bytes(shared[:length]).decode())
