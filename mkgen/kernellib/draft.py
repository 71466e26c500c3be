"""A fused drafter's passes (mkgen/plan/fused.py, docs/drafting.md): the accept rule over the
verify rows, each pass's input rows, and its drafts, counted and chosen on SMEM scalars.

SMEM `draft_smem` [1 + PASSES, BATCH] int32: row 0 each sequence's accepted rows (bonus
included), row 1 + p its draft of pass p."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mkgen.kernellib.constants import (
    AXIS,
    BATCH,
    EH_PROJ,
    EH_PROJ_BUFFER,
    EMBEDDING_BUFFER,
    HIDDEN,
    NUM_DEVICES,
    PASSES,
    ROWS,
    TOKENS,
    TOKENS_PADDED,
    VOCAB_PER_CORE,
    expert_shapes,
)
from mkgen.kernellib.elementwise import _rms_norm, _stack_rows
from mkgen.kernellib.step import argument_shapes

# fmt: off

def _accept(tokens_vmem, greedy_smem, row_tokens_smem, draft_smem, sem):
    """Each sequence's accepted rows: its leading rows whose greedy token is the next fed
    row's token, and one more (the bonus, the greedy token after the last of them)."""
    copy = pltpu.make_async_copy(tokens_vmem, greedy_smem, sem)
    copy.start()
    copy.wait()
    for b in range(BATCH):
        def count(r, carry, b=b):
            accepted, matching = carry
            same = (greedy_smem[b * ROWS + r, 0] == row_tokens_smem[b * ROWS + r + 1]).astype(jnp.int32)
            return accepted + matching * same, matching * same

        draft_smem[0, b] = jax.lax.fori_loop(0, ROWS - 1, count, (jnp.int32(1), jnp.int32(1)))[0]


def _embeddings(ctx, embedding_hbm, embed_vmem, sem, token_of):
    """[TOKENS_PADDED, HIDDEN] f32: row i the embedding of token `token_of(i)` (an SMEM
    scalar). Each core holds VOCAB_PER_CORE rows of the table ([1, VOCAB_PER_CORE, 1,
    HIDDEN] bf16 in HBM): it copies every row's candidate from its shard (one DMA a row),
    keeps those it owns, and the cores' rows are summed (one owner a row: exact)."""
    me = jax.lax.axis_index(AXIS) if NUM_DEVICES > 1 else 0
    local = [token_of(i) - me * VOCAB_PER_CORE for i in range(TOKENS)]
    copies = [
        pltpu.make_async_copy(
            embedding_hbm.at[0, pl.ds(jnp.clip(local[i], 0, VOCAB_PER_CORE - 1), 1)], embed_vmem.at[pl.ds(i, 1)], sem
        )
        for i in range(TOKENS)
    ]
    for c in copies:
        c.start()
    for c in copies:
        c.wait()
    row = jax.lax.broadcasted_iota(jnp.int32, (TOKENS_PADDED, HIDDEN), 0)
    owned = row < 0
    for i in range(TOKENS):
        owned = owned | ((row == i) & (local[i] >= 0) & (local[i] < VOCAB_PER_CORE))
    mine = jnp.where(owned, embed_vmem[:, 0, :].astype(jnp.float32), 0.0)
    return ctx.collectives.all_reduce(EMBEDDING_BUFFER, mine)


def _chosen_rows(row_of, count, index_of, width):
    """[TOKENS_PADDED, width] f32: sequence b's candidate row `index_of(b)` (a scalar in
    [0, count)) of `row_of(b, t)` ([1, width] each), repeated over the sequence's rows:
    exact selects, no dynamic slicing."""
    blocks = []
    for b in range(BATCH):
        index, chosen = index_of(b), jnp.zeros((1, width), jnp.float32)
        for t in range(count):
            chosen = jnp.where(index == t, row_of(b, t), chosen)
        blocks.append(jnp.broadcast_to(chosen, (ROWS, width)))
    return _stack_rows(blocks)


def _row_of_each_sequence(values, index_of):
    """Each sequence's row `index_of(b)` (in [0, ROWS)) of `values` [TOKENS_PADDED, w] f32,
    repeated over the sequence's rows."""
    return _chosen_rows(lambda b, r: values[b * ROWS + r : b * ROWS + r + 1], ROWS, index_of, values.shape[1])


def _rope_rows(table, offset_of):
    """A chained pass's RoPE rows [TOKENS_PADDED, w]: sequence b's rows all at its table row
    `offset_of(b)` (in [0, 2 ROWS)) of `table` [BATCH, 2 ROWS, w]; only the first row of
    each sequence is a draft's entry, the rest repeat it."""
    return _chosen_rows(lambda b, t: table[b, t : t + 1], 2 * ROWS, offset_of, table.shape[2])


def _pass_input(ctx, embedded, previous, norms, eh_proj_row):
    """A pass's rows into the MTP layer: the embedding and the previous hidden state, each
    RMS-normed (enorm, hnorm), concatenated, through eh_proj."""
    joined = jnp.concatenate([_rms_norm(embedded, norms[0:1]), _rms_norm(previous, norms[1:2])], axis=1)
    return ctx.collectives.all_gather(EH_PROJ_BUFFER, ctx.stream.matmul(joined, eh_proj_row, EH_PROJ))


def _at(values, index):
    """values[index] of a tuple of ints at a traced index: scalar selects."""
    out = jnp.int32(values[0])
    for i in range(1, len(values)):
        out = jnp.where(index == i, values[i], out)
    return out


def _draft_rope_tables(positions, inv_freq, attention_factor):
    """cos/sin [BATCH, 2 ROWS, len(inv_freq)] of each sequence's positions from its first
    row on (XLA, before the kernel): a chained pass's rows read theirs."""
    rows = positions[:, None] + jnp.arange(2 * ROWS, dtype=jnp.int32)[None, :]
    angles = rows.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    return jnp.cos(angles) * attention_factor, jnp.sin(angles) * attention_factor


def fused_argument_shapes(mesh):
    """argument_shapes with the fused drafter's inputs: the fed rows' tokens after the
    positions, the MTP module's norms after the final norm, each core's rows of the
    embedding table after the vectors."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    replicated = NamedSharding(mesh, P())
    tables, positions, x, final_norm, stream, vectors, *arrays = argument_shapes(mesh)
    sharded = NamedSharding(mesh, P(AXIS))
    tokens = jax.ShapeDtypeStruct((TOKENS,), jnp.int32, sharding=replicated)
    norms = jax.ShapeDtypeStruct((3, HIDDEN), jnp.float32, sharding=replicated)
    table = jax.ShapeDtypeStruct((NUM_DEVICES, VOCAB_PER_CORE, 1, HIDDEN), jnp.bfloat16, sharding=sharded)
    experts = len(expert_shapes())
    return list(fused_step_arguments(tables, positions, tokens, x, final_norm, norms, stream, vectors, table,
                                     arrays[:experts], arrays[experts:]))


def fused_step_arguments(tables, positions, row_tokens, x, final_norm, draft_norms, stream, vectors, embedding,
                         experts, caches):
    """The decode step's arguments in the order make_decode_step takes them (the runner and
    verify reach it through mkgen.codegen.step_call.decode_step_arguments): the plain step's,
    with the fed rows' tokens after the positions, the MTP module's norms after the final
    norm and each core's embedding rows after the vectors."""
    return (tables, positions, row_tokens, x, final_norm, draft_norms, stream, vectors, embedding, *experts, *caches)


def _drafts_out(draft_smem):
    """[8k, 128] int32: row b lane 0 sequence b's accepted rows, lanes 1.. its drafts."""
    shape = (-(-BATCH // 8) * 8, 128)
    row = jax.lax.broadcasted_iota(jnp.int32, shape, 0)
    lane = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    out = jnp.zeros(shape, jnp.int32)
    for b in range(BATCH):
        for j in range(1 + PASSES):
            out = jnp.where((row == b) & (lane == j), draft_smem[j, b], out)
    return out


# fmt: on
