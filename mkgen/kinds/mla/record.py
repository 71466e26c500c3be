"""MLA's record of the kernel layout (mkgen.kinds.mla builds it, its macros print it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Literal

import numpy as np

from mkgen.plan.layout import Array, AttentionRecord, CacheArray, Columns, Rank, Rope, VectorRow
from mkgen.plan.stream import Segment
from mkgen.spec.schema import MLAAttention, ModelSpec


class MLALayout(AttentionRecord):
    """Multi-head latent attention, absorbed: q heads split over cores, each core keeps the
    whole latent cache (every head reads it) as one key row [latent | rotated k_rope].

    A head's nope query is turned into latent space by wkv_b's key half (segment uk) and
    its attention output back into values by the value half (uv); the cached latent is
    both key (with k_rope) and value, so attention is GQA with one kv head of width
    `head_dim` whose values are its first `value_dim` columns."""

    type: Literal["mla"] = "mla"
    recurrent: ClassVar[bool] = False  # its cache is rows indexed by position
    heads_split: ClassVar[bool] = True
    own_cache: ClassVar[bool] = False  # the latent cache, whole on every core
    own_heads: ClassVar[dict[str, str]] = {"num_heads": "heads"}
    name: str
    index: int
    layers: list[int]
    heads: int  # q heads per core
    kv_heads: Literal[1] = 1  # the latent, shared by every head
    group: int  # q heads reading the latent: all of them
    q_rows: int  # query rows of the latent in the attention scratch: heads x rows, padded to 8
    q_lora_rank: int  # 0: q straight from the hidden state (segment down)
    kv_lora_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    head_dim: int  # cache row: kv_lora_rank + rope_dim
    value_dim: int  # kv_lora_rank: values are the cached latent
    values_in_keys: Literal[True] = True
    gate: bool
    latent_eps: float  # eps of the q and kv latent norms
    softmax_scale: float
    window: None = None
    sinks: Literal[False] = False
    rope: Rope | None  # rope columns are stored de-interleaved (TensorView.rotary)
    columns: dict[str, Columns]  # outputs of the down segment: wq_a | wq, wkv_a, wgate
    # wq_a and wkv_a split over the cores: one all-gather joins each one's pieces.
    latent_split: bool
    segments: list[Segment]  # down, (q_b), uk, uv, o
    ops: list[str]  # the layer's ops in program order (mkgen.kinds.mla.ops): the kernel's order
    vectors: list[VectorRow]  # q_norm, kv_norm
    kv_tile: int
    caches: list[CacheArray]  # latent: [layers, batch, 1, context, head_dim] bf16
    cache_arrays: Literal[1] = 1  # the latent row

    def _spec_kind(self, spec: ModelSpec) -> MLAAttention:
        kind = spec.attention_kinds[self.name]
        assert isinstance(kind, MLAAttention), kind
        return kind

    def cache_pieces(
        self, spec: ModelSpec, cache: Mapping[str, Array], rank: Rank
    ) -> dict[str, Array]:
        """The latent row [B, 1, context, latent | k_rope], whole on every core, its rotary
        pairs stored as halves where the model's rope is interleaved (as
        mkgen.kinds.mla.views stores them)."""
        import jax.numpy as jnp

        k_rope = cache["k_rope"]
        rope = self._spec_kind(spec).rope
        if rope is not None and rope.interleaved:
            k_rope = jnp.concatenate([k_rope[..., 0::2], k_rope[..., 1::2]], axis=-1)
        row = jnp.concatenate([cache["latent"].astype(k_rope.dtype), k_rope], axis=-1)
        return {"latent": row[:, None]}

    def prefill_cache(self, spec: ModelSpec, pieces: Mapping[str, Array]) -> dict[str, Array]:
        """The whole reference cache [B, ...] from core 0's latent row [latent | k_rope],
        its rotary halves interleaved again where the model's rope is."""
        mla = self._spec_kind(spec)
        row = pieces["latent"][0, :, 0]  # [B, context, latent | k_rope]
        latent, k_rope = row[..., : mla.kv_lora_rank], row[..., mla.kv_lora_rank :]
        if mla.rope is not None and mla.rope.interleaved:
            half = k_rope.shape[-1] // 2
            k_rope = np.stack([k_rope[..., :half], k_rope[..., half:]], axis=-1).reshape(
                k_rope.shape
            )
        return {"latent": latent, "k_rope": k_rope}
