"""GQA's record of the kernel layout (mkgen.kinds.gqa builds it, its macros print it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Literal

from mkgen.plan.layout import Array, AttentionRecord, CacheArray, Columns, Rank, Rope, VectorRow
from mkgen.plan.stream import Segment
from mkgen.spec.schema import ModelSpec


class GQALayout(AttentionRecord):
    type: Literal["gqa"] = "gqa"
    # Facts of the kind (AttentionRecord says what each means).
    recurrent: ClassVar[bool] = False  # its cache is rows indexed by position
    heads_split: ClassVar[bool] = True
    own_cache: ClassVar[bool] = True  # the k and v of its kv heads
    own_heads: ClassVar[dict[str, str]] = {"num_heads": "heads", "num_kv_heads": "kv_heads"}
    name: str
    index: int  # position among the model's attention kinds (the layer table's code)
    layers: list[int]  # model layers of this kind, in order (cache slot = position here)
    heads: int  # q heads on each core
    kv_heads: int  # kv heads on each core (replicated when fewer than cores)
    kv_rank_divisor: int  # consecutive cores sharing one kv head (1: not replicated)
    group: int  # q heads per kv head
    head_dim: int  # key width of a cache row
    value_dim: int
    values_in_keys: bool = False  # False: separate k and v caches
    q_cols: int
    kv_cols: int
    q_rows: int  # query rows of a kv head in the attention scratch: group x rows, padded to 8
    columns: dict[str, Columns]  # outputs of the qkv segment: wq, wk, wv, (wgate)
    gate: bool
    qk_norm: Literal["none", "rms", "rms_noparam"]
    sinks: bool
    qkv_bias: bool
    o_bias: bool
    window: int | None
    softmax_scale: float
    rope: Rope | None
    segments: list[Segment]  # qkv (q | k | v | gate), o
    ops: list[str]  # the layer's ops in program order (mkgen.kinds.gqa.OPS): the kernel's order
    cache_arrays: int  # k and v
    vectors: list[VectorRow]
    kv_tile: int  # cache tokens per streamed tile
    caches: list[CacheArray]

    def cache_pieces(
        self, spec: ModelSpec, cache: Mapping[str, Array], rank: Rank
    ) -> dict[str, Array]:
        """k and v [B, kv heads of the core, context, head_dim]: kv heads split, or shared
        by kv_rank_divisor consecutive cores."""
        from mkgen.kinds.common.caches import piece

        mine = rank // self.kv_rank_divisor
        return {
            n: piece(cache[n], 2, self.kv_heads, mine).transpose(0, 2, 1, 3) for n in ("k", "v")
        }

    def own_cache_pieces(self, cache: Mapping[str, Array]) -> dict[str, Array]:
        """[B, context, kv heads, head_dim] as [B, kv heads, context, head_dim]."""
        return {n: v.transpose(0, 2, 1, 3) for n, v in cache.items()}

    def prefill_cache(self, spec: ModelSpec, pieces: Mapping[str, Array]) -> dict[str, Array]:
        """Each core's own k and v, kv heads and positions swapped back."""
        return {n: v.transpose(0, 1, 3, 2, 4) for n, v in pieces.items()}
