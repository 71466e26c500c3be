"""Segment: how a matrix streams through a Ring (the template prints one per stream and
expert segment of the build)."""

from typing import NamedTuple


class Segment(NamedTuple):
    """A matrix that streams through a Ring: x [rows, fan_in] @ it -> [rows, fan_out] in
    k_chunks x col_blocks chunks, stored in `fmt` (None: the ring's own format). In the
    weight stream it starts `offset` rows after its layer kind's first row; a bf16 one in
    chunks of `chunk_rows` x LANES, its last column block, when `tail_rows` > 0, stored
    transposed (`tail_rows` x LANES chunks: columns as rows, fan-in along the lanes).
    Expert segments start `offset` pieces after the expert's first piece."""

    offset: int
    fan_in: int
    fan_out: int
    k_chunks: int
    col_blocks: int
    fmt: str | None = None
    chunk_rows: int = 256
    tail_rows: int = 0
