"""The build constants the library's members read, as module globals.

First the ones the template prints from the plan, with representative values: a single
core, one sequence of one row, small sizes. They exist for the library's own import,
type checks and tests; the generated kernel has its build's (imports are never
included). Then the constants that are the same in every build: the template includes
those (its `library("constants", ...)` directives), so their values live here only.
"""

from mkgen.kernellib.segment import Segment

# ---------------------------------------------------------------- per build (representative)
NUM_DEVICES = 1
BATCH = 1
ROWS = 1
TOKENS = 1
TOKENS_PADDED = 8
ROW_BLOCK = 8
CONTEXT = 128
HIDDEN = 256
VOCAB_PER_CORE = 512
VOCAB_USED = 500
NORM_EPS = 1e-6
NORM_OFFSET = 0.0
LOGIT_MULTIPLIER = 1.0
LOGIT_SOFTCAP: float | None = None
NUM_LAYERS = 1
BANK_ROWS = 512
RING_DEPTH = 2
HELD_REFILLS = 1
REFILLS_PER_ROUND = 1
TOTAL_BANKS = 4
VECTOR_ROWS = 2
VECTOR_WIDTH = 256
# (group size, stride in the mesh, first landing slot) of each round: none on one core.
ROUNDS: tuple[tuple[int, int, int], ...] = ()
GREEDY_ROUNDS: tuple[int, ...] = ()  # the greedy exchange's rounds (indices into ROUNDS)
BARRIER_ROUNDS: tuple[int, ...] = ()  # the rounds whose members the entry barrier signals
COLLECTIVE_SLOTS = 0
COLLECTIVE_PEERS = 0
# Per collective buffer: (landing slots, 32-bit lanes of a slot, reduce-scatter staging rows).
COLLECTIVE_LANDING: tuple[tuple[int, int, int], ...] = ()
# (buffer, op, columns) -> (round, phase, wire dtype, lanes) of each round it runs, in order.
COLLECTIVE_WIRES: dict[tuple[int, str, int], tuple[tuple[int, str, str, int], ...]] = {}
LAYER_TABLES: tuple[list[int], ...] = ([0], [0], [0], [0], [0], [0])
LM_HEAD_ROW = 0
LM_HEAD = Segment(offset=0, fan_in=256, fan_out=512, k_chunks=1, col_blocks=2)
MAX_SNAPSHOTS = 4
RESIDUAL_LOGITS_ROW = 2
# A fused drafter's passes (mkgen/plan/fused.py): layers FIRST_PASS.. of the tables.
FIRST_PASS = 1
PASSES = 1
EH_PROJ = Segment(offset=0, fan_in=512, fan_out=256, k_chunks=2, col_blocks=1)
EH_PROJ_ROWS = (0,)  # each pass's eh_proj's first stream row
HEAD_ROWS = (0,)  # the LM head's after each pass
MASK_FIRST_EMBEDDING = True
CHAIN_NORMED = False
EMBEDDING_BUFFER = 0  # the collective buffer of a pass's embedding rows' all-reduce
EH_PROJ_BUFFER = 1  # of its eh_proj columns' all-gather


def cache_shapes() -> list[tuple[tuple[int, ...], object]]:
    """The build's cache arrays (the template prints them per build): none here."""
    return []


def expert_shapes() -> list[tuple[tuple[int, ...], object]]:
    """The build's routed-expert arrays (the template prints them per build): none here."""
    return []


# ---------------------------------------------------------------- the same in every build

AXIS = "d"  # the mesh axis the cores form
LANES = 256  # column block of a stream segment (the MXU width)
CHUNK = 256  # rows per matmul step inside a bank
CHUNKS_PER_BANK = BANK_ROWS // CHUNK
CACHE_ALIGN = 16  # bf16 HBM rows are tiled by 16: cache writes start on a multiple
DMA_LANES = 128  # remote copies move whole 128-lane rows: Mosaic needs 512-byte runs
# Rows of every layer's vector slab: its two norms' weights.
ATTN_NORM_VEC = (slice(0, 1), slice(0, HIDDEN))
FFN_NORM_VEC = (slice(1, 2), slice(0, HIDDEN))
