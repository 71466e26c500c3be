"""Collectives by remote DMA in one-shot rounds (ROUNDS: the cores of a host, then one core
of every host, or one round of every core), their wire format (f32, or bf16 pairs in 32-bit
words) and the barrier before the first copy."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mkgen.kernellib.constants import (
    AXIS,
    BARRIER_ROUNDS,
    COLLECTIVE_LANDING,
    COLLECTIVE_PEERS,
    COLLECTIVE_WIRES,
    DMA_LANES,
    NUM_DEVICES,
    ROUNDS,
    TOKENS,
    TOKENS_PADDED,
)


def _round_exchange(buf, send_sems, recv_sems, round_, lanes, send_row, on_sent=None):
    """One one-shot round: this core's row `send_row(m)` of `buf` straight to slot offset +
    (its position) of every other member m of its group, one semaphore per in-flight copy,
    then on_sent() while they travel; returns when every member's row has landed in this
    core's slots offset .. offset + size.
    The first `lanes` 32-bit lanes matter; copies round them up to whole DMA_LANES rows.
    Only the TOKENS real token rows travel, not the sublane padding up to TOKENS_PADDED:
    at batch 1 x rows 1 a copy moves one row of the slot's eight (Mosaic lowers a DMA of
    a sub-tile slice of the second-minor dimension)."""
    size, stride, offset = ROUNDS[round_]
    me = jax.lax.axis_index(AXIS)
    pos = (me // stride) % size
    base = me - pos * stride
    lanes = min(buf.shape[-1], -(-lanes // DMA_LANES) * DMA_LANES)

    def copy(row, slot, m, device):
        return pltpu.make_async_remote_copy(
            buf.at[row, pl.ds(0, TOKENS), pl.ds(0, lanes)],
            buf.at[slot, pl.ds(0, TOKENS), pl.ds(0, lanes)],
            send_sems.at[offset + m],
            recv_sems.at[slot],
            device_id={AXIS: device},
        )

    sends = []
    for k in range(1, size):
        m = (pos + k) % size
        sends.append(copy(send_row(m), offset + pos, m, base + m * stride))
    for c in sends:
        c.start()
    if on_sent is not None:
        on_sent()
    for c in sends:
        c.wait_send()
    for k in range(1, size):
        m = (pos + size - k) % size
        copy(offset + m, offset + m, m, me).wait_recv()


def _to_wire(value, wire, lanes):
    """`value` [rows, w] f32 as 32-bit words: its f32 bits (w words), or `lanes`
    words of bf16 pairs (round to nearest even), column c in the high half of word c and
    column c + lanes in its low half (w zero-padded to 2 * lanes)."""
    if wire == "f32":
        return jax.lax.bitcast_convert_type(value, jnp.uint32)
    if value.shape[1] < 2 * lanes:
        pad = jnp.zeros((value.shape[0], 2 * lanes - value.shape[1]), jnp.float32)
        value = jnp.concatenate([value, pad], axis=1)
    bits = jax.lax.bitcast_convert_type(value.astype(jnp.bfloat16).astype(jnp.float32), jnp.uint32)
    return bits[:, :lanes] | (bits[:, lanes:] >> 16)


def _from_wire(words, wire, width):
    """The f32 values [rows, width] that `_to_wire` packed into `words` [rows, lanes]."""
    if wire == "f32":
        return jax.lax.bitcast_convert_type(words, jnp.float32)[:, :width]
    high = jax.lax.bitcast_convert_type(words & jnp.uint32(0xFFFF0000), jnp.float32)
    low = jax.lax.bitcast_convert_type(words << 16, jnp.float32)
    return jnp.concatenate([high, low], axis=1)[:, :width]


# fmt: off

class Collectives:
    """All-reduce, all-gather and reduce-scatter in the one-shot rounds the plan gives each
    call (COLLECTIVE_WIRES: indices into ROUNDS, in execution order): the cores of a host,
    then one core of every host, or one round of every core (flat).

    In a round every member writes its piece straight to every other member, and each
    combines the group's slots in member order, so a group ends bit-identical and, after
    the last round, every core does. Only the real token rows (TOKENS) are written and
    sent; the padding rows up to TOKENS_PADDED are zeroed once, before the entry barrier
    lets a peer write, so every collective's result has zero padding rows (never another
    step's or uninitialised words, which a product over rows could carry into a real one). A round's wire dtype and lanes come from
    COLLECTIVE_WIRES too (bf16: sent rounded, summed in f32 on arrival). Each collective
    of a layer has its own buffer (the attention's all-reduce 0, the FFN's 1..3; a split
    MLA A-projection's all-gather borrows 1 before the all-reduce) and each round its own
    slots: a core cannot write a buffer again before every member of its groups has read
    it, since it first needs their contributions to the collectives in between.
    """

    def __init__(self, buffers, send_sems, recv_sems, on_sent):
        self.bufs = buffers  # per collective k of a layer: [slots_k (+ staging), TOKENS_PADDED, lanes_k] uint32
        self.send = send_sems  # DMA[COLLECTIVE_BUFFERS, COLLECTIVE_SLOTS]
        self.recv = recv_sems  # DMA[COLLECTIVE_BUFFERS, COLLECTIVE_SLOTS]
        self.on_sent = on_sent  # what starts once a round's copies are under way (the held refills)
        if TOKENS < TOKENS_PADDED:
            for buf in buffers:
                buf[:, TOKENS:, :] = jnp.zeros((buf.shape[0], TOKENS_PADDED - TOKENS, buf.shape[2]), jnp.uint32)

    def _round(self, which, round_, wire, lanes, width, value=None, send_row=None):
        """This core's piece into its own slot of the round (`value` put on the wire, or
        its own staged row send_row(position)), exchanged (each member m gets row
        send_row(m), by default that slot); the group's pieces in member order as f32
        [TOKENS_PADDED, width]."""
        size, stride, offset = ROUNDS[round_]
        buf = self.bufs[which]
        pos = (jax.lax.axis_index(AXIS) // stride) % size
        mine = offset + pos
        if send_row is None:
            words = _to_wire(value[:TOKENS], wire, lanes)
            buf[mine, :TOKENS, : words.shape[1]] = words
            send_row = lambda m: mine  # noqa: E731
        else:
            buf[mine, :TOKENS, :lanes] = buf[send_row(pos), :TOKENS, :lanes]
        _round_exchange(buf, self.send.at[which], self.recv.at[which], round_, lanes, send_row, self.on_sent)
        return [_from_wire(buf[offset + j][:, :lanes], wire, width) for j in range(size)]

    def all_reduce(self, which, partial):
        """The sum over all cores, bit-identical on every core: [TOKENS_PADDED, width].
        Scattered (the plan's phases): a reduce-scatter over the host, an all-reduce of
        this core's part across hosts, then an all-gather of the parts over the host."""
        total = partial
        for round_, phase, wire, lanes in COLLECTIVE_WIRES[which, "all_reduce", partial.shape[1]]:
            if phase == "reduce_scatter":
                total = self._scatter_round(which, round_, wire, lanes, total)
            elif phase == "all_gather":
                total = self._gather_round(which, round_, wire, lanes, [total])[0]
            else:
                total = _summed(self._round(which, round_, wire, lanes, total.shape[1], value=total))
        return total

    def all_gather(self, which, piece):
        """Pieces of every core side by side, in mesh order: [TOKENS_PADDED, D * width]."""
        return self.all_gather_parts(which, [piece])[0]

    def all_gather_parts(self, which, parts):
        """Several pieces in the rounds of one all-gather: each part of every core side by
        side, in mesh order, one [TOKENS_PADDED, D * width_i] per part."""
        wires = COLLECTIVE_WIRES[which, "all_gather", sum(part.shape[1] for part in parts)]
        for round_, _, wire, lanes in wires:
            parts = self._gather_round(which, round_, wire, lanes, parts)
        return parts

    def reduce_scatter(self, which, partial):
        """This core's columns [me * W / D, (me + 1) * W / D) of the sum over all cores,
        in the rounds the plan orders (staged: across hosts first)."""
        total = partial
        for round_, _, wire, lanes in COLLECTIVE_WIRES[which, "reduce_scatter", partial.shape[1]]:
            total = self._scatter_round(which, round_, wire, lanes, total)
        return total

    def _gather_round(self, which, round_, wire, lanes, parts):
        """The group's `parts` side by side in member order, one array per part."""
        widths = [part.shape[1] for part in parts]
        piece = jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
        slots = self._round(which, round_, wire, lanes, piece.shape[1], value=piece)
        gathered, start = [], 0
        for width in widths:
            gathered.append(jnp.concatenate([slot[:, start : start + width] for slot in slots], axis=1))
            start += width
        return gathered

    def _scatter_round(self, which, round_, wire, lanes, total):
        """One reduce-scatter round: the running sum split into `size` contiguous parts
        (staged in the rows after the buffer's landing slots), part j sent to member j,
        the parts this core receives summed in member order."""
        buf = self.bufs[which]
        staging = COLLECTIVE_LANDING[which][0]
        width = total.shape[1] // ROUNDS[round_][0]
        for j in range(ROUNDS[round_][0]):
            words = _to_wire(total[:TOKENS, j * width : (j + 1) * width], wire, lanes)
            buf[staging + j, :TOKENS, : words.shape[1]] = words
        return _summed(self._round(which, round_, wire, lanes, width, send_row=lambda m: staging + m))


def _summed(pieces):
    """The group's pieces summed in member order (every member adds in the same order, so
    the group ends bit-identical)."""
    total = pieces[0]
    for piece in pieces[1:]:
        total = total + piece
    return total


# fmt: on


def _reduce_scatter_in_flight(collectives, which, partial, work):
    """collectives.reduce_scatter(which, partial) with `work` (which does not need the sum)
    run while its first round's copies travel, after the round's held refills start (at
    the end where there are no rounds, on one core); returns the sum's columns and what
    work returned. Each round calls collectives.on_sent once its copies are under way, so
    for this call on_sent also runs the work, the first time."""
    held = collectives.on_sent
    ran, result = False, None

    def on_sent():
        nonlocal ran, result
        if held is not None:
            held()
        if not ran:
            ran, result = True, _in_flight(work)

    collectives.on_sent = on_sent
    total = collectives.reduce_scatter(which, partial)
    collectives.on_sent = held
    if not ran:  # no rounds (one core): nothing travels
        result = _in_flight(work)
    return total, result


def _in_flight(work):
    """Runs a caller's `work` from inside a collective (while a round's copies travel): the
    compiled profile (mkgen/verify/profile.py) gives its ops the phase of the code inside,
    not the collective's."""
    return work()


def _barrier():
    """Every core this one will write to (the members of its groups in BARRIER_ROUNDS, which
    cover every round's) is inside the kernel."""
    if NUM_DEVICES == 1:
        return
    me = jax.lax.axis_index(AXIS)
    sem = pltpu.get_barrier_semaphore()
    for round_ in BARRIER_ROUNDS:
        size, stride, _ = ROUNDS[round_]
        pos = (me // stride) % size
        for k in range(1, size):
            pl.semaphore_signal(sem, 1, device_id={AXIS: me + ((pos + k) % size - pos) * stride})
    pl.semaphore_wait(sem, COLLECTIVE_PEERS)
