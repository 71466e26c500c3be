"""The weights a runner feeds its kernel: a `mkgen convert` directory or the reference's
random weights, each core's arrays placed on its device.

Imports JAX: imported by `run` after the device environment is set.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mkgen import output
from mkgen.runtime.build import Build
from mkgen.weights import convert, pack


class RandomWeights:
    """The reference's random weights as the kernel stores them (bf16, or the spec's
    quantized formats: mkgen.weights.quantize.stored_random_weights), packed per core on
    demand (mkgen.weights.pack)."""

    def __init__(self, spec: Any, layout: Any, seed: int) -> None:
        from mkgen.weights.quantize import stored_draft_weights, stored_random_weights

        self.layout = layout
        self.inventory = stored_random_weights(spec, seed)
        if layout.draft_passes is not None:  # the kernel's passes stream the MTP module's
            self.inventory |= stored_draft_weights(spec, seed)
        self.embedding = self.inventory["embedding"]
        self.final_norm = self.inventory["final_norm"]

    def draft_module(self) -> dict[str, np.ndarray]:
        """A fused drafter's MTP module tensors (`draft.0.*`), as the kernel stores them."""
        return {n: v for n, v in self.inventory.items() if n.startswith("draft.")}

    def embedding_rows(self, rank: int) -> np.ndarray:
        return pack.pack_embedding(self.layout, self.inventory, rank)

    def stream(self, rank: int) -> np.ndarray:
        return pack.pack_stream(self.layout, self.inventory, rank)

    def vectors(self, rank: int) -> np.ndarray:
        return pack.pack_vectors(self.layout, self.inventory, rank)

    def experts(self, rank: int, which: int) -> np.ndarray:
        index, j = pack.expert_arrays(self.layout)[which]
        layers = self.layout.ffn[index].layers
        return np.stack(
            [pack.pack_experts_layer(self.layout, self.inventory, rank, n)[j] for n in layers]
        )


class ConvertedWeights:
    """Weights of a `mkgen convert` directory, checked against this build (one-line
    MkgenErrors); each core's arrays are read (memory-mapped) only when a local device
    needs them.

    `verify` (off with --trust-weights) is whether every file's sha256 recorded in
    layout.json is checked as the file is read: flipped bytes are a one-line error naming
    the file, never different tokens."""

    def __init__(self, spec: Any, layout: Any, directory: Path, build: Build, verify: bool) -> None:
        self.layout, self.directory, self.verify = layout, Path(directory), verify
        self.manifest = convert.open_weights(self.directory, spec, layout, build.name)
        self.embedding, self.final_norm = convert.read_globals(
            self.directory, self.manifest, verify=verify
        )
        # A kernel that drafts packs its passes from its MTP module's tensors as it reads.
        self.module = None
        if layout.draft_passes is not None:
            from mkgen.weights.draft import read_drafter

            tensors = read_drafter(self.directory, self.manifest, spec, verify=verify)
            self.module = {n: v for n, v in tensors.items() if n.startswith("draft.")}

    def draft_module(self) -> dict[str, np.ndarray]:
        """A fused drafter's MTP module tensors (`draft.0.*`), as converted."""
        assert self.module is not None, "only a kernel that drafts reads its module's tensors"
        return self.module

    def embedding_rows(self, rank: int) -> np.ndarray:
        return pack.pack_embedding(self.layout, {"embedding": self.embedding}, rank)

    def drafter(self, spec: Any) -> dict[str, np.ndarray]:
        """The build's drafter's converted weights (mkgen.weights.draft.read_drafter), as
        its random ones come: a model drafter's by the small model's names as its kernel
        would store them (fake-quantized to its formats); an mtp or block drafter's
        `draft.*` beside the target's embedding and, untied, its LM head in the target's
        lm_head format."""
        from mkgen.spec.schema import ModelDraft
        from mkgen.weights.draft import read_drafter
        from mkgen.weights.quantize import fake_quantize

        tensors = read_drafter(self.directory, self.manifest, spec, verify=self.verify)
        if isinstance(spec.draft, ModelDraft):
            own = {name.removeprefix("draft."): value for name, value in tensors.items()}
            return fake_quantize(spec.draft.model, own)
        shared = {"embedding": np.asarray(self.embedding, np.float32)}
        shared |= (
            fake_quantize(spec, {"lm_head": tensors.pop("lm_head")}) if "lm_head" in tensors else {}
        )
        return {**tensors, **shared}

    def _read(self, reader: Callable[..., np.ndarray], *args: int) -> np.ndarray:
        return reader(
            self.directory, self.manifest, self.layout, *args, verify=self.verify,
            module=self.module,
        )  # fmt: skip

    def stream(self, rank: int) -> np.ndarray:
        return self._read(convert.read_stream, rank)

    def vectors(self, rank: int) -> np.ndarray:
        return self._read(convert.read_vectors, rank)

    def experts(self, rank: int, which: int) -> np.ndarray:
        return self._read(convert.read_experts, rank, which)


def progress_bar(total: int, what: str, unit: str) -> Any:
    """A progress bar on stderr (stdout stays clean for --json): only on a terminal, and
    only in process 0 of a multi-host job."""
    shown = jax.process_index() == 0
    return output.progress_bar(total=total, desc=what, unit=unit, shown=shown)


def place_weights(build: Build, weights: Any, mesh: Mesh, kernel: Any) -> dict[str, Any]:
    """Every core's weight stream, vector slab and routed-expert arrays, sharded on the
    mesh axis (each process builds only its own devices' shards), and the replicated final
    norm."""
    sharded, replicated = NamedSharding(mesh, P(kernel.AXIS)), NamedSharding(mesh, P())
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    # stream, vectors, each expert array, and a fused drafter's embedding rows
    arrays = 2 + len(kernel.expert_shapes()) + int(build.fused_draft)
    bar = progress_bar(arrays * len(local), "placing weights", "array")

    def place(read: Callable[[int], np.ndarray]) -> jax.Array:
        def counted(rank: int) -> np.ndarray:
            value = read(rank)
            bar.update()
            return value

        # The shape comes from a core of this process, whose array is then kept for its shard.
        rank = list(mesh.devices.flat).index(local[0])
        cache = {rank: counted(rank)}
        shape = cache[rank].shape

        def shard(index: tuple[slice, ...]) -> np.ndarray:
            rank = index[0].start or 0
            value = cache.pop(rank, None)
            return (counted(rank) if value is None else value)[None]

        return jax.make_array_from_callback((build.devices, *shape), sharded, shard)

    with bar:
        placed = {
            "stream": place(weights.stream),
            "vectors": place(weights.vectors),
            "experts": [
                place(lambda rank, i=i: weights.experts(rank, i))
                for i in range(len(kernel.expert_shapes()))
            ],
            "final_norm": jax.device_put(
                np.asarray(weights.final_norm, np.float32)[None, :], replicated
            ),
        }
        if build.fused_draft:  # the kernel's drafter reads its norms and embeds its tokens
            module = weights.draft_module()
            placed["draft_norms"] = jax.device_put(pack.pack_draft_norms(module), replicated)
            placed["embedding_rows"] = place(weights.embedding_rows)
        return placed


def embedding_on_devices(build: Build, table: np.ndarray, mesh: Mesh, kernel: Any) -> jax.Array:
    """The embedding table in bf16 for decoding on the device (decode.chunk_decoder): split
    by vocabulary rows over the cores when they divide it, else replicated."""
    table = np.asarray(table).astype(ml_dtypes.bfloat16)
    split = P(kernel.AXIS) if len(table) % build.devices == 0 else P()
    return jax.make_array_from_callback(table.shape, NamedSharding(mesh, split), lambda i: table[i])
