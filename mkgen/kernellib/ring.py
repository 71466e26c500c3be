"""The weight ring: units of weight chunks flowing from HBM through a few VMEM slots (Ring:
an MoE layer's expert pieces; WeightStream: the per-core stream of banks that crosses
layer boundaries into the lm_head), and a matmul's input cut into chunks and its output
blocks put together."""

from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mkgen.kernellib.constants import (
    BANK_ROWS,
    CHUNK,
    CHUNKS_PER_BANK,
    HELD_REFILLS,
    LANES,
    REFILLS_PER_ROUND,
    RING_DEPTH,
    TOTAL_BANKS,
)


def _to_chunks(xk, x, fan_in, k_chunks, width=CHUNK):
    """Store x [rows, fan_in] as bf16 `width`-wide pieces xk[kc], each zero padded to CHUNK."""
    xb = x.astype(jnp.bfloat16)
    for kc in range(k_chunks):
        piece = xb[:, kc * width : min((kc + 1) * width, fan_in)]
        if piece.shape[1] < CHUNK:  # the last chunk of a fan-in that is not a multiple
            piece = jnp.pad(piece, ((0, 0), (0, CHUNK - piece.shape[1])))
        xk[kc] = piece


def _from_blocks(acc, col_blocks, fan_out):
    return jnp.concatenate([acc[cb] for cb in range(col_blocks)], axis=1)[:, :fan_out]


# fmt: off

class Ring:
    """Units of weight chunks flowing from HBM through `depth` VMEM slots.

    Unit q lives in slot q % depth. Consuming unit q waits for its DMA and, once its
    chunks are used, starts unit q + depth into the same slot, so `depth` units are
    always in flight. The weight stream's units are its banks (the ring crosses layer
    boundaries into the lm_head); an MoE layer's are pieces of its chosen experts.
    A ring reads units in one format, or (the weight stream) in the format of each
    segment: `formats` maps a format to (chunks per unit, product).
    """

    def __init__(self, copies, depth, chunks_per_unit, limit, product, xk, acc, formats=None):
        self.copies = copies  # q -> the DMA descriptors that fill slot q % depth
        self.depth = depth
        self.limit = limit  # units in this ring (static, or a traced count)
        # format -> (chunks per unit, product); product (x chunk, slot, j) -> x @ chunk j
        # of the slot, f32. None: the ring's one format.
        self.formats = {None: (chunks_per_unit, product), **(formats or {})}
        self.xk = xk  # [k_chunks, rows, CHUNK] bf16: a matmul's input, chunked
        self.acc = acc  # [col_blocks, rows, LANES] f32: its output blocks

    def with_buffers(self, xk, acc):
        """The same ring (slots, position in the stream) feeding other matmul buffers."""
        chunks_per_unit, product = self.formats[None]
        return Ring(self.copies, self.depth, chunks_per_unit, self.limit, product, xk, acc, self.formats)

    def start(self, q):
        @pl.when(q < self.limit)
        def _():
            for copy in self.copies(q):
                copy.start()

    def wait(self, q):
        for copy in self.copies(q):
            copy.wait()

    def release_after(self, q):
        """Unit q is used up: its slot takes unit q + depth."""
        self.start(q + self.depth)

    def first_unit(self, first, segment):
        return first + segment.offset

    def prime(self, first=0):
        for q in range(self.depth):
            self.start(first + q)

    def unit_matmul(self, x, first, segment):
        """x [rows, segment.fan_in] @ `segment`, whose chunks start with unit
        first_unit(first, segment), unit by unit."""
        chunks_per_unit, product = self.formats[segment.fmt]
        k_chunks, col_blocks = segment.k_chunks, segment.col_blocks
        _to_chunks(self.xk, x, segment.fan_in, k_chunks)
        self.acc[pl.ds(0, col_blocks)] = jnp.zeros((col_blocks, *self.acc.shape[1:]), jnp.float32)
        chunks = k_chunks * col_blocks
        units = -(-chunks // chunks_per_unit)

        def unit_step(i, carry):
            q = self.first_unit(first, segment) + i
            slot = q % self.depth
            self.wait(q)
            for j in range(chunks_per_unit):
                c = i * chunks_per_unit + j

                @pl.when(c < chunks)
                def _():
                    kc = c % k_chunks
                    self.acc[c // k_chunks] += product(self.xk[kc], slot, j)

            self.release_after(q)
            return carry

        jax.lax.fori_loop(0, units, unit_step, 0)
        return _from_blocks(self.acc, col_blocks, segment.fan_out)

    matmul = unit_matmul


# fmt: on


class WeightStream(Ring):
    """The per-core weight stream through the ring of RING_DEPTH banks, read chunk by chunk
    from any stream row on (a chunk may reach from one bank into the next), quantized
    segments whole banks at a time; without held refills (HeldRefillStream holds them).

    The template writes the kernel's class per build: its docstring, constructor and (on
    a mesh) with_buffers, then includes these methods; on a mesh, HeldRefillStream's too.
    """

    def __init__(
        self, stream_hbm: Any, ring_vmem: Any, ring_sems: Any, xk: Any, acc: Any, formats: Any
    ) -> None:
        def copies(bank: Any) -> list[Any]:
            slot = bank % RING_DEPTH
            rows = ring_vmem.at[pl.ds(slot * BANK_ROWS, BANK_ROWS)]
            return [pltpu.make_async_copy(stream_hbm.at[0, bank], rows, ring_sems.at[slot])]

        super().__init__(copies, RING_DEPTH, CHUNKS_PER_BANK, TOTAL_BANKS, None, xk, acc, formats)
        self.stream_hbm, self.ring_vmem, self.ring_sems = stream_hbm, ring_vmem, ring_sems

    def with_buffers(self, xk, acc):
        return WeightStream(self.stream_hbm, self.ring_vmem, self.ring_sems, xk, acc, self.formats)

    # fmt: off

    def _wrap_copy(self, bank):
        """Bank `bank`'s first CHUNK rows into the rows after the last slot."""
        return pltpu.make_async_copy(self.stream_hbm.at[0, bank, pl.ds(0, CHUNK)], self.ring_vmem.at[pl.ds(RING_DEPTH * BANK_ROWS, CHUNK)], self.ring_sems.at[RING_DEPTH])

    # fmt: on

    def start(self, q):
        super().start(q)

        @pl.when((q < self.limit) & (q % RING_DEPTH == 0))
        def _():
            self._wrap_copy(q).start()

    def wait(self, q):
        super().wait(q)

        @pl.when(q % RING_DEPTH == 0)
        def _():
            self._wrap_copy(q).wait()

    def first_unit(self, first, segment):
        """The first bank of a quantized segment (its rows start on one)."""
        return (first + segment.offset) // BANK_ROWS

    def release_after(self, q):
        """Bank q has been reached: the bank before it is used up."""

        @pl.when(q > 0)
        def _():
            self.start(q - 1 + self.depth)

    def _chunk(self, row, rows, use):
        """use(w) on stream rows [row, row + rows) zero padded to CHUNK rows, waiting for the
        bank they reach into first, if any."""
        bank = (row + rows - 1) // BANK_ROWS
        reached = bank * BANK_ROWS >= row

        @pl.when(reached)
        def _():
            self.wait(bank)

        at = pl.multiple_of(row // BANK_ROWS % RING_DEPTH * BANK_ROWS + row % BANK_ROWS, 16)
        w = self.ring_vmem[pl.ds(at, rows), :]
        if rows < CHUNK:
            w = jnp.concatenate([w, jnp.zeros((CHUNK - rows, LANES), w.dtype)], axis=0)
        use(w)

        @pl.when(reached)
        def _():
            self.release_after(bank)

    # fmt: off

    def matmul(self, x, first, segment):
        """x [rows, segment.fan_in] @ `segment`, which starts segment.offset rows after row
        `first` of the stream."""
        if segment.fmt is not None:  # quantized: whole banks from a bank boundary on
            return self.unit_matmul(x, first, segment)
        k_chunks, rows, tail = segment.k_chunks, segment.chunk_rows, segment.tail_rows
        blocks = segment.col_blocks - (tail > 0)
        _to_chunks(self.xk, x, segment.fan_in, k_chunks, rows)
        self.acc[pl.ds(0, segment.col_blocks)] = jnp.zeros((segment.col_blocks, *self.acc.shape[1:]), jnp.float32)
        start = first + segment.offset

        def block_chunk(c, carry):
            def use(w):
                self.acc[c // k_chunks] += jnp.dot(self.xk[c % k_chunks], w, preferred_element_type=jnp.float32)

            self._chunk(start + c * rows, rows, use)
            return carry

        jax.lax.fori_loop(0, blocks * k_chunks, block_chunk, 0)
        if tail:

            def tail_chunk(kc, carry):
                def use(w):  # w [columns, fan-in]: x @ w.T
                    self.acc[blocks] += jax.lax.dot_general(self.xk[kc], w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

                self._chunk(start + blocks * k_chunks * rows + kc * tail, tail, use)
                return carry

            jax.lax.fori_loop(0, k_chunks, tail_chunk, 0)
        return _from_blocks(self.acc, segment.col_blocks, segment.fan_out)

    # fmt: on


class HeldRefillStream(WeightStream):
    """The weight stream of a mesh: the refills of the last HELD_REFILLS used-up banks wait
    for a collective round's copies (Collectives' on_sent starts the oldest
    REFILLS_PER_ROUND), then stream while it travels. `held` is SMEM [2]: the oldest
    used-up bank whose refill is held, the bank reached last."""

    def __init__(
        self,
        stream_hbm: Any,
        ring_vmem: Any,
        ring_sems: Any,
        held: Any,
        xk: Any,
        acc: Any,
        formats: Any,
    ) -> None:
        super().__init__(stream_hbm, ring_vmem, ring_sems, xk, acc, formats)
        self.held = held

    def with_buffers(self, xk: Any, acc: Any) -> "HeldRefillStream":
        return HeldRefillStream(
            self.stream_hbm, self.ring_vmem, self.ring_sems, self.held, xk, acc, self.formats
        )

    def prime(self, first=0):
        super().prime(first)
        self.held[0] = first
        self.held[1] = first

    def release_after(self, q):
        """Bank q has been reached: the bank before it is used up and its refill joins the
        held ones; the oldest beyond HELD_REFILLS starts now."""
        oldest = self.held[0]
        self.held[1] = q

        @pl.when(q - oldest > HELD_REFILLS)
        def _():
            self.start(oldest + self.depth)
            self.held[0] = oldest + 1

    def release_held(self):
        """A collective round's copies are under way: start the oldest REFILLS_PER_ROUND held
        refills (more would still stream when the next round's copies queue)."""

        def refill(bank, carry):
            self.start(bank + self.depth)
            return carry

        released = jnp.minimum(self.held[1], self.held[0] + REFILLS_PER_ROUND)
        jax.lax.fori_loop(self.held[0], released, refill, 0)
        self.held[0] = released
