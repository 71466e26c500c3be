"""What the plan knows of a layer kind: the `LayerKind` protocol, the records the plan
hands a kind (`LayoutInputs`, `BufferInputs`, `Step`) and the `KindRegistry` value that
maps a kind's type to its rules.

The plan never imports a concrete kind: the caller builds a registry once
(`mkgen.kinds.default_registry()`) and passes it into `plan_build` and the functions
that dispatch on a kind. The dependency arrows go one way: the kinds' implementations
(mkgen/kinds/) build on the plan's records, the plan reads them through this protocol.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from mkgen.errors import SpecError

if TYPE_CHECKING:  # annotations only: these modules take a KindRegistry themselves
    from mkgen.plan.layout import KindRecord
    from mkgen.plan.options import BuildOptions
    from mkgen.plan.schedule import _Builder
    from mkgen.plan.sharding import AttentionSharding, FFNSharding, _Ctx
    from mkgen.plan.stream import Segment, StreamPlan, TensorView
    from mkgen.plan.vmem import KernelDims, _List
    from mkgen.spec.schema import Dims


@dataclass(frozen=True)
class LayoutInputs:
    """What a kind's layout builder reads: the kind as the spec and the plan have it."""

    name: str
    index: int  # position among the model's attention (or FFN) kinds: the layer table's code
    layers: list[int]  # model layers of this kind, in order
    kind: Any  # the spec's kind (GQAAttention, MoEFFN, ...)
    shard: Any  # its AttentionSharding or FFNSharding
    segments: list[Segment]  # its weight-stream segments
    devices: int
    options: BuildOptions
    dims: Dims
    first_row: int  # first row of the layer's vector slab the kind may use
    expert_format: str
    max_piece_chunks: int
    expert_slots: int
    # A cache attention kind's tokens per streamed KV tile, as the plan chose it
    # (mkgen.plan.kvtiles); None for the kinds without a KV cache.
    kv_tile: int | None = None
    # A recurrent kind's sequences in VMEM at once (0: every one; mkgen.plan.vmem)
    state_slots: int = 0


@dataclass(frozen=True)
class BufferInputs:
    """What a kind's VMEM buffers depend on (mkgen.plan.vmem)."""

    name: str
    kind: Any  # the spec's kind
    shard: Any  # its AttentionSharding or FFNSharding
    dims: KernelDims
    stream: StreamPlan
    expert_slots: int
    expert_format: str
    state_slots: int = 0  # a recurrent kind's sequences in VMEM at once (0: every one)


@dataclass(frozen=True)
class Step:
    """One layer of a kind in the program (mkgen.plan.schedule): what its ops read."""

    layer: int
    name: str
    kind: Any  # the spec's kind
    shard: Any  # its AttentionSharding or FFNSharding
    segments: dict[str, Segment]  # its stream segments by name, in stream order
    stream_row: int  # the layer's first stream row of this kind
    collectives: dict[str, Any]  # its collectives by name (mkgen.plan.sharding.Collective)
    vectors: int  # the op that loaded the layer's vector slab
    x: int  # the op that produced its normed input


@dataclass(frozen=True)
class CacheGeometry:
    """How a kind attends over a KV cache in tiles: what the cost model counts."""

    q_rows: int  # query rows of one kv head (or latent) in the attention scratch
    key: int  # key width
    value: int  # value width
    window: int | None  # sliding window (None: the whole cache)
    caches: int  # cache arrays written per (sequence, kv head)
    kv_heads: int  # kv heads (or latents) per core
    sinks: bool  # attention sinks


# A kind's fused weight-stream segments: (segment name, the tensors it fuses), in the
# order its ops consume them.
FusedSegments = list[tuple[str, list[str]]]


class StateDims(NamedTuple):
    """A recurrent kind's per-core state (the VMEM plan and the op counts read it)."""

    heads: int  # state (value) heads
    key_dim: int
    value_dim: int
    channels: int  # causal conv channels
    key_heads: int  # key heads the delta rule reads


class LayerKind(Protocol):
    """The rules every layer kind provides (a kind's module under mkgen/kinds/ satisfies
    it). The spec's kind object is typed Any here: each kind reads its own schema class."""

    @property
    def TEMPLATE(self) -> str:
        """Its macro file, relative to the template root."""

    @property
    def RECORD(self) -> type[KindRecord]:
        """Its layout record class (in its folder's record.py): what `layout` returns, and
        what a layout read back from plan.json builds for its `type` tag."""

    @property
    def SLAB_VECTORS(self) -> tuple[str, ...] | None:
        """The vector-family tensors its layers keep in their vector slab (None: all)."""

    @property
    def SEGMENTS(self) -> FusedSegments:
        """Its fused weight-stream segments, in the order its ops consume them."""

    def shard(self, ctx: _Ctx, kind_name: str, kind: Any, /) -> AttentionSharding | FFNSharding:
        """How each of its tensors splits over the cores, its caches and collectives."""

    def layout(self, inputs: LayoutInputs, /) -> KindRecord:
        """Its record of the kernel layout: everything its macros print."""

    def buffers(self, out: _List, inputs: BufferInputs, /) -> None:
        """Its VMEM scratch, SMEM arrays and semaphores, in its macros' order."""

    def program(self, builder: _Builder, step: Step, /) -> int:
        """Its ops of one layer, in its op list's order; returns the last op."""

    def rotary_dim(self, kind: Any, /) -> int:
        """The rotary width of its positions (0: none)."""

    def state_dims(self, kind: Any, shard: Any, /) -> StateDims | None:
        """A recurrent kind's per-core state (None: the kind keeps none)."""

    def views(self, kind: Any, /) -> dict[tuple[str, str], TensorView]:
        """How its stream reads a tensor in another arrangement than the inventory's, by
        (segment, tensor) (none: every tensor as stored)."""

    def cache_geometry(self, kind: Any, shard: Any, rows: int, /) -> CacheGeometry | None:
        """How it attends over a KV cache, `rows` rows a sequence (None: no KV cache)."""


@dataclass(frozen=True, eq=False)  # one registry is one value: hashed by identity
class KindRegistry:
    """Layer kind type -> its rules: built once by the caller, passed into the plan."""

    kinds: Mapping[str, LayerKind]

    def __post_init__(self) -> None:
        # Read-only: one registry is shared (default_registry is cached); a variant is a
        # new registry (KindRegistry({**kinds.kinds, "x": rules})).
        object.__setattr__(self, "kinds", MappingProxyType(dict(self.kinds)))

    def __getitem__(self, type_: str) -> LayerKind:
        return self.rules(type_, type_)

    def rules(self, type_: str, where: str) -> LayerKind:
        """The rules of the kind of type `type_` (`where` names the kind in the spec)."""
        if type_ not in self.kinds:
            raise SpecError(f"{where} ({type_}) is not supported by the code generator yet")
        return self.kinds[type_]

    def record(self, type_: str) -> type[KindRecord]:
        """The layout record class of the kind of type `type_` (a record's `type` tag)."""
        return self.rules(type_, "a kernel layout record").RECORD

    def types(self) -> list[str]:
        """The registered types, attention kinds then FFN kinds."""
        return list(self.kinds)
