"""The lm_head: final norm, this core's vocabulary shard of the logits, and the greedy
token chosen across the shards in the collectives' rounds."""

import jax
import jax.numpy as jnp

from mkgen.kernellib.collectives import _round_exchange
from mkgen.kernellib.constants import (
    AXIS,
    GREEDY_ROUNDS,
    LM_HEAD,
    LM_HEAD_ROW,
    LOGIT_MULTIPLIER,
    LOGIT_SOFTCAP,
    NUM_DEVICES,
    ROUNDS,
    TOKENS_PADDED,
    VOCAB_PER_CORE,
    VOCAB_USED,
)
from mkgen.kernellib.elementwise import _rms_norm

# fmt: off

def _lm_head(ctx, x, final_norm, logits_ref, tokens_ref, greedy_vmem, greedy_sems):
    """Final norm, logits of this core's vocabulary shard, greedy token across shards."""
    logits = _logits(ctx, x, final_norm, LM_HEAD_ROW)
    logits_ref[...] = logits
    tokens_ref[...] = _greedy_token(logits, greedy_vmem, greedy_sems)


def _logits(ctx, x, norm, row):
    """This core's vocabulary shard of the logits of the rows `x`, normed by `norm`, through
    the LM head that starts at stream row `row`."""
    logits = ctx.stream.matmul(_rms_norm(x, norm), row, LM_HEAD) * LOGIT_MULTIPLIER
    if LOGIT_SOFTCAP is not None:
        logits = LOGIT_SOFTCAP * jnp.tanh(logits / LOGIT_SOFTCAP)
    return logits


def _greedy_token(logits, greedy_vmem, greedy_sems):
    """The greedy token of every row across the vocabulary shards [TOKENS_PADDED, 128] int32
    (every lane)."""
    me = jax.lax.axis_index(AXIS) if NUM_DEVICES > 1 else 0
    ids = me * VOCAB_PER_CORE + jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    masked = jnp.where(ids < VOCAB_USED, logits, -jnp.inf)
    best = jnp.max(masked, axis=1, keepdims=True)
    best_id = jnp.min(jnp.where(masked == best, ids, jnp.iinfo(jnp.int32).max), axis=1, keepdims=True)
    lane = jax.lax.broadcasted_iota(jnp.int32, (TOKENS_PADDED, 128), 1)
    mine = jnp.where(lane == 0, best, jnp.where(lane == 1, best_id.astype(jnp.float32), 0.0))
    # In rounds like the collectives (f32: ids are not exact in bf16): each round keeps the
    # group's best in member order; a larger value wins and a tie keeps the lower id, so
    # every core chooses the same token.
    value, token = best, best_id.astype(jnp.float32)
    for round_ in GREEDY_ROUNDS:
        size, stride, offset = ROUNDS[round_]
        row = offset + (me // stride) % size
        greedy_vmem[row] = mine
        _round_exchange(greedy_vmem, greedy_sems.at[0], greedy_sems.at[1], round_, 128, lambda m, row=row: row)
        value, token = greedy_vmem[offset][:, 0:1], greedy_vmem[offset][:, 1:2]
        for j in range(1, size):
            v_j, t_j = greedy_vmem[offset + j][:, 0:1], greedy_vmem[offset + j][:, 1:2]
            better = (v_j > value) | ((v_j == value) & (t_j < token))
            value = jnp.where(better, v_j, value)
            token = jnp.where(better, t_j, token)
        mine = jnp.where(lane == 0, value, jnp.where(lane == 1, token, 0.0))
    return jnp.broadcast_to(token.astype(jnp.int32), (TOKENS_PADDED, 128))


# fmt: on
