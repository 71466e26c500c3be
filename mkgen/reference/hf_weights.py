"""Hugging Face checkpoint tensors -> mkgen's weight inventory (numpy only, no jax).

`load_hf_weights(spec, arch, tensors)` maps the tensors of a Hugging Face
checkpoint (names and layouts as `save_pretrained` writes them, i.e. the hub
layout) to the names and shapes of `mkgen.spec.weights.model_weights(spec)`:

- nn.Linear weights [out, in] are transposed to [in, out] (``x @ W``); the
  embedding stays [vocab, hidden]; norms, biases, sinks and gate constants keep
  their vectors.
- Per-expert tensors (``experts.{j}.gate_proj`` / ``w1``...) are stacked on a
  leading expert axis. The fused layouts are read too: transformers 5's
  ``experts.gate_up_proj`` [E, 2F, hidden] (gate rows first) with ``down_proj``
  [E, hidden, F], and gpt-oss's ``gate_up_proj`` [E, hidden, 2F] (already
  [in, out]; gate at even, up at odd columns) with ``down_proj`` [E, F, hidden]
  and their ``_bias`` vectors.
- Qwen3-Next: ``in_proj_qkvz`` and ``in_proj_ba`` are grouped per key head
  (transformers' ``fix_query_key_value_ordering``): for each key head g, rows
  [q (dk) | k (dk) | v (r*dv) | z (r*dv)] and [b (r) | a (r)], r = value heads per
  key head. The depthwise ``conv1d.weight`` [2K+V, 1, W] splits into conv_q/k/v
  [W, channels] (tap W-1 multiplies the newest token). The gated ``q_proj`` holds
  per head [query (head_dim) | gate (head_dim)] rows, split into wq and wgate.
- Kimi Linear: ``q_conv1d``/``k_conv1d``/``v_conv1d`` (or a fused ``conv1d``),
  ``f_a_proj``/``f_b_proj`` -> wf_a/wf_b, ``g_a_proj``/``g_b_proj`` -> wg_a/wg_b,
  ``b_proj`` -> wbeta, ``A_log`` [1, 1, H, 1] -> [H].
- DeepSeek/Kimi MLA: ``kv_a_proj_with_mqa`` -> wkv_a, ``q_a_layernorm`` -> q_norm,
  ``kv_a_layernorm`` -> kv_norm; the router's ``e_score_correction_bias`` ->
  selection_bias. RoPE dims stay in the checkpoint's (interleaved) order.

Norm weights are copied as stored: a zero-centred model's norms hold w of
(1 + w); the gated output norms of Gated DeltaNet and KDA are plain-weight norms
in every model. Every inventory tensor must come out with exactly its shape and
every checkpoint tensor must be used, except the per-architecture ignore list
(rotary inv_freq buffers; multi-token-prediction layers, which are not decoded).
Quantized checkpoints (fp8 block scales, MXFP4 blocks, int4 packs) are refused:
dequantize them first.

Files are read with the safetensors library (`SafetensorsCheckpoint`), after a small
check of what it does not check; an index must hold each tensor in exactly one shard
inside the checkpoint folder; NaN or Inf values are refused as tensors are read.
`HFMapping.check_inventory` runs the mapping over the headers' shapes alone, so that a
checkpoint that does not fit the spec is refused before any tensor is read.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from mkgen.errors import SpecError
from mkgen.spec.files import read_json
from mkgen.spec.hf_import import canonical_architecture, default_spec_name, import_hf_dict
from mkgen.spec.schema import (
    DenseFFN,
    GatedDeltaNetAttention,
    GQAAttention,
    KDAAttention,
    MLAAttention,
    ModelSpec,
    MoEFFN,
)
from mkgen.spec.weights import model_weights

# Tensors that hold no weights of the model, per architecture (regexes on the HF name).
_IGNORE_ALL = (r"\.rotary_emb\.(inv_freq|original_inv_freq)$",)
IGNORED: dict[str, tuple[str, ...]] = {
    "DeepseekV3ForCausalLM": _IGNORE_ALL,
    "Qwen3ForCausalLM": _IGNORE_ALL,
    "Qwen3MoeForCausalLM": _IGNORE_ALL,
    "MixtralForCausalLM": _IGNORE_ALL,
    # Qwen3-Next checkpoints carry their MTP block under mtp.* (transformers skips it too).
    "Qwen3NextForCausalLM": (*_IGNORE_ALL, r"^mtp\."),
    "GptOssForCausalLM": _IGNORE_ALL,
    "KimiLinearForCausalLM": _IGNORE_ALL,
}
# Names of the side tensors of quantized checkpoints.
_QUANTIZED = re.compile(
    r"(weight_scale_inv|weight_scale|input_scale|_blocks|_scales|qweight|qzeros|g_idx|"
    r"weight_packed|weight_shape|weight_zero_point)$"
)


# ---------------------------------------------------------------- safetensors, lazily

# Stored dtypes the safetensors library hands to numpy (BF16 through ml_dtypes); the
# others (F8_*, F6_*, F4, E8M0) are the codes of quantized checkpoints.
_NUMPY_READABLE = frozenset(
    ("F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "BOOL")
)


def _unreadable(file: Path, reason: str) -> SpecError:
    return SpecError(f"{file}: not a readable safetensors file ({' '.join(reason.split())})")


def _unique_keys(file: Path) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    """A json object_pairs_hook refusing a key given twice."""

    def to_dict(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key, value in pairs:
            if key in result:
                raise SpecError(f"{file}: {key}: appears twice in the safetensors header")
            result[key] = value
        return result

    return to_dict


def _check_header(file: Path) -> None:
    """The header checks safe_open does not make, or makes without naming the tensor: a
    name given twice (the library keeps the last one silently) and data cut short (the
    library only says the file is not covered). A header length beyond the file is refused
    before anything is read. The library checks the rest (dtypes, shapes, offsets that
    overlap or leave gaps) when it opens the file."""
    try:
        length = file.stat().st_size
        with file.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise _unreadable(file, f"{length} bytes, no 8-byte header length")
            (size,) = struct.unpack("<Q", prefix)
            if size > length - 8:
                raise _unreadable(file, f"header length {size} exceeds the file's {length} bytes")
            text = handle.read(size)
    except OSError as error:
        raise _unreadable(file, error.strerror or str(error)) from None
    try:
        header = json.loads(text, object_pairs_hook=_unique_keys(file))
    except ValueError as error:
        raise _unreadable(file, f"header: {error}") from None
    if not isinstance(header, dict):
        raise _unreadable(file, f"the header is a JSON {type(header).__name__}, not an object")
    ends = {
        name: info["data_offsets"][1]
        for name, info in header.items()
        if isinstance(info, dict)
        and isinstance(info.get("data_offsets"), list)
        and len(info["data_offsets"]) == 2
        and isinstance(info["data_offsets"][1], int)
    }
    last = max(ends, key=ends.__getitem__, default=None)
    if last is not None and 8 + size + ends[last] > length:
        raise SpecError(
            f"{file}: truncated: {last} ends at byte {8 + size + ends[last]}, the file has "
            f"{length} (an interrupted download?)"
        )


def _shard_path(folder: Path, shard: Any, index: Path, name: str) -> Path:
    """An index's shard, which must be a file in the checkpoint folder: no absolute path,
    no .., no symlink leading out of it, except from a snapshot of the Hugging Face cache
    (.../snapshots/REV/) into its repository's blobs/, where the cache keeps the files."""
    if not isinstance(shard, str) or not shard:
        raise SpecError(f"{index}: weight_map: {name}: shard {shard!r} is not a file name")
    path = folder / shard
    home = folder.resolve()
    roots = [home, home.parent.parent / "blobs"] if home.parent.name == "snapshots" else [home]
    escapes = Path(shard).is_absolute() or ".." in Path(shard).parts
    if escapes or not any(path.resolve().is_relative_to(root) for root in roots):
        raise SpecError(
            f"{index}: weight_map: {name}: shard {shard!r} lies outside the checkpoint folder"
        )
    return path


class SafetensorsCheckpoint(Mapping[str, np.ndarray]):
    """Read-only mapping name -> array over one .safetensors file or a sharded set, read
    with the safetensors library (safe_open, numpy).

    Opening checks every header and the index (each tensor in exactly the shard the index
    names, shard paths inside the checkpoint folder); tensors are read on access. BF16
    tensors are widened to float32 (exactly); other numpy dtypes come as stored; a float
    tensor holding NaN or Inf is refused.
    """

    def __init__(self, path: Path | str) -> None:
        path = Path(path)
        single = None
        if path.is_dir():
            index, single = path / "model.safetensors.index.json", path / "model.safetensors"
            path = index if index.exists() else single
        if not path.exists():
            raise SpecError(f"{path}: no such file (expected model.safetensors or its index)")
        self.path = path
        self.shards: dict[str, Path] = {}  # each shard's name in the checkpoint -> its path
        self._handles: dict[Path, Any] = {}
        self._entries: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
        if path.suffix != ".json":
            self.shards[path.name] = path
            self._open(path)
            return
        index = read_json(path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise SpecError(f"{path}: weight_map: missing; not a safetensors index")
        for name, shard in weight_map.items():
            if shard not in self.shards:
                self.shards[shard] = _shard_path(path.parent, shard, path, name)
        if single is not None and single.exists() and single.name not in self.shards:
            raise SpecError(
                f"{path.parent}: holds both {single.name} and {path.name} (which does not "
                "list it), so which is the checkpoint is unclear; move one of them out"
            )
        for shard, file in sorted(self.shards.items()):
            for name in self._open(file):
                if weight_map.get(name) != shard:
                    where = (
                        f"puts it in {weight_map[name]}"
                        if name in weight_map
                        else "does not list it"
                    )
                    raise SpecError(
                        f"{file}: {name}: stored in this shard, but the index {where} (a "
                        "tensor in two shards, or a wrong index)"
                    )
        missing = sorted(set(weight_map) - set(self._entries))
        if missing:
            raise SpecError(f"{path}: weight_map: {missing[0]} is in no shard")

    def _open(self, file: Path) -> list[str]:
        """Check and open one shard; its tensor names."""
        _check_header(file)
        try:
            handle = safe_open(file, framework="numpy")
            names = handle.keys()  # a safe_open handle is not iterable
            views = {name: handle.get_slice(name) for name in names}
        except (SafetensorError, OSError) as error:
            raise _unreadable(file, str(error)) from None
        self._handles[file] = handle
        for name, view in views.items():
            self._entries[name] = (file, view.get_dtype(), tuple(view.get_shape()))
        return list(views)

    def stored_dtype(self, name: str) -> str:
        return self._entries[name][1]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][2]

    def __getitem__(self, name: str) -> np.ndarray:
        file, dtype, _ = self._entries[name]
        if dtype not in _NUMPY_READABLE:
            raise SpecError(
                f"{file}: {name}: stored as {dtype}: a quantized tensor; mkgen loads float "
                "checkpoints only (dequantize first)"
            )
        try:
            array = self._handles[file].get_tensor(name)
        except (SafetensorError, OSError) as error:
            raise _unreadable(file, f"{name}: {error}") from None
        if array.dtype == ml_dtypes.bfloat16:
            array = array.astype(np.float32)
        # One pass in float64 (no overflow for any float32 sum): NaN or Inf survives it.
        if array.dtype.kind == "f" and not np.isfinite(array.sum(dtype=np.float64)):
            raise SpecError(f"{file}: {name}: holds NaN or Inf values (a damaged checkpoint)")
        return array

    def __contains__(self, name: object) -> bool:  # without reading the tensor
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def read_safetensors(path: Path | str) -> SafetensorsCheckpoint:
    """Open a checkpoint lazily: a .safetensors file, an index .json, or a directory."""
    return SafetensorsCheckpoint(path)


# ---------------------------------------------------------------- the mapping


class _Source:
    """The checkpoint's tensors; remembers which were used."""

    def __init__(self, tensors: Mapping[str, np.ndarray], source: str) -> None:
        self.tensors = tensors
        self.source = source
        self.used: set[str] = set()

    def error(self, name: str, message: str) -> SpecError:
        return SpecError(f"{self.source}: {name}: {message}")

    def has(self, name: str) -> bool:
        return name in self.tensors

    def first(self, *names: str) -> str:
        """The first of these names the checkpoint has (errors name the first)."""
        for name in names:
            if name in self.tensors:
                return name
        also = f" (nor {', '.join(names[1:])})" if len(names) > 1 else ""
        raise self.error(names[0], f"missing from the checkpoint{also}")

    def take(self, *names: str) -> np.ndarray:
        name = self.first(*names)
        self.used.add(name)
        # The stored dtype, when the tensors come from files, is checked before any read.
        stored = getattr(self.tensors, "stored_dtype", lambda _n: None)(name)
        if stored and stored not in ("F32", "F16", "F64", "BF16"):
            raise self.error(
                name,
                f"stored as {stored}: a quantized or non-float tensor; mkgen loads float "
                "checkpoints only (dequantize first)",
            )
        array = self.tensors[name]
        if not stored and array.dtype.kind != "f" and array.dtype.name != "bfloat16":
            raise self.error(
                name,
                f"has dtype {array.dtype}: a quantized or non-float tensor; mkgen loads float "
                "checkpoints only (dequantize first)",
            )
        return array

    def linear(self, *names: str) -> np.ndarray:
        """An nn.Linear weight [out, in] as [in, out]."""
        array = self.take(*names)
        if array.ndim != 2:
            raise self.error(self.first(*names), f"expected a matrix, got shape {array.shape}")
        return array.T


class _Shape:
    """A checkpoint tensor's shape standing in for its data: the reshapes, transposes,
    slices, splits and stacks of the mapping applied to shapes alone
    (HFMapping.check_inventory). `origin` names the tensor in errors; `dtype` is the
    array's for tensors in memory, None for stored ones (their stored dtype is checked)."""

    def __init__(self, shape: Sequence[int], origin: str, dtype: np.dtype | None = None) -> None:
        self.shape, self.origin, self.dtype = tuple(int(n) for n in shape), origin, dtype

    @property
    def _meta(self) -> tuple[str, np.dtype | None]:
        return self.origin, self.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def T(self) -> _Shape:  # noqa: N802 (numpy's name)
        return _Shape(self.shape[::-1], *self._meta)

    def transpose(self, *axes: int) -> _Shape:
        return _Shape([self.shape[a] for a in axes], *self._meta)

    def reshape(self, *shape: int) -> _Shape:
        known = math.prod(n for n in shape if n != -1)
        new = [self.size // known if n == -1 and known else n for n in shape]
        if math.prod(new) != self.size:
            raise SpecError(f"{self.origin}: shape {self.shape} cannot be read as {tuple(shape)}")
        return _Shape(new, *self._meta)

    def __getitem__(self, key: Any) -> _Shape:
        key = key if isinstance(key, tuple) else (key,)
        dims = [
            len(range(*k.indices(n)))
            for k, n in zip(key, self.shape, strict=False)
            if isinstance(k, slice)
        ]  # an integer index drops its axis
        return _Shape([*dims, *self.shape[len(key) :]], *self._meta)

    def _split(self, sections: Any, axis: int = 0) -> list[_Shape]:
        n = self.shape[axis]
        if isinstance(sections, int):
            if n % sections:
                raise SpecError(f"{self.origin}: shape {self.shape}: axis {axis} does not split")
            bounds = [n * i // sections for i in range(sections + 1)]
        else:
            bounds = [0, *(min(int(b), n) for b in sections), n]
        return [
            _Shape([*self.shape[:axis], end - start, *self.shape[axis + 1 :]], *self._meta)
            for start, end in zip(bounds, bounds[1:], strict=False)
        ]

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        if func is np.split:
            return args[0]._split(*args[1:], **kwargs)
        if func is np.stack:
            return _Shape([len(args[0]), *args[0][0].shape], *args[0][0]._meta)
        if func is np.ascontiguousarray:
            return args[0]
        if func is np.array_equal:  # the values are compared when the tensors are read
            return args[0].shape == args[1].shape
        return NotImplemented


class _Shapes(Mapping[str, Any]):
    """A checkpoint's tensors as `_Shape`s, with their stored dtypes: nothing is read from
    a checkpoint's files."""

    def __init__(self, tensors: Mapping[str, np.ndarray], source: str) -> None:
        self.tensors, self.source = tensors, source

    def stored_dtype(self, name: str) -> str | None:
        return getattr(self.tensors, "stored_dtype", lambda _n: None)(name)

    def __getitem__(self, name: str) -> Any:
        origin = f"{self.source}: {name}"
        if isinstance(self.tensors, SafetensorsCheckpoint):
            return _Shape(self.tensors.shape(name), origin)
        value = self.tensors[name]
        return _Shape(value.shape, origin, value.dtype)

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


def header_shapes(tensors: Mapping[str, np.ndarray], source: str) -> Mapping[str, Any]:
    """A checkpoint's tensors as their shapes (from the headers, nothing read): run a
    mapping over them to check a checkpoint before any tensor is read."""
    return _Shapes(tensors, source)


class TensorView(Mapping[str, Any]):
    """Some of a checkpoint's tensors under other names (`names`: a name here -> the
    tensor's name in `tensors`), their stored dtypes with them: a part of a checkpoint
    (a drafter's tensors) read as a checkpoint of its own."""

    def __init__(self, tensors: Mapping[str, Any], names: Mapping[str, str]) -> None:
        self.tensors, self.names = tensors, dict(names)

    def stored_dtype(self, name: str) -> str | None:
        return getattr(self.tensors, "stored_dtype", lambda _n: None)(self.names[name])

    def __getitem__(self, name: str) -> Any:
        return self.tensors[self.names[name]]

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


class _Out:
    """The inventory being filled: shapes are checked as tensors arrive."""

    def __init__(self, spec: ModelSpec, source: str) -> None:
        self.expected = {w.name: w.shape for w in model_weights(spec)}
        self.source = source
        self.values: dict[str, np.ndarray] = {}

    def put(self, name: str, array: np.ndarray, hf: str) -> None:
        if name not in self.expected:
            raise SpecError(
                f"{self.source}: {hf}: maps to {name}, which the spec does not have (the "
                "config and the checkpoint disagree)"
            )
        want = self.expected[name]
        if tuple(array.shape) != want:
            raise SpecError(
                f"{self.source}: {hf}: gives {name} of shape {tuple(array.shape)}, but the spec "
                f"needs {want} (the config and the checkpoint disagree)"
            )
        # A shape stands for itself (np.ascontiguousarray would box it in an array).
        self.values[name] = array if isinstance(array, _Shape) else np.ascontiguousarray(array)


def _split_rows(array: np.ndarray, sizes: Sequence[int], name: str, src: _Source) -> list:
    if array.shape[0] != sum(sizes):
        raise src.error(name, f"has {array.shape[0]} rows, expected {sum(sizes)} ({sizes})")
    return np.split(array, np.cumsum(sizes)[:-1], axis=0)


def _gqa(src: _Source, out: _Out, p: str, o: str, kind: GQAAttention, hidden: int) -> None:
    h, d = kind.num_heads, kind.head_dim
    q_name = src.first(p + "q_proj.weight")
    q = src.take(q_name)
    if kind.output_gate == "sigmoid":
        # Qwen3-Next: per head, rows [query (head_dim) | gate (head_dim)].
        if q.shape != (2 * h * d, hidden):
            raise src.error(q_name, f"shape {q.shape}, expected {(2 * h * d, hidden)}")
        per_head = q.reshape(h, 2, d, hidden)
        out.put(o + "wq", per_head[:, 0].reshape(h * d, hidden).T, q_name)
        out.put(o + "wgate", per_head[:, 1].reshape(h * d, hidden).T, q_name)
    else:
        out.put(o + "wq", q.T, q_name)
    for hf, name in (("k_proj", "wk"), ("v_proj", "wv"), ("o_proj", "wo")):
        out.put(o + name, src.linear(p + hf + ".weight"), p + hf + ".weight")
    if kind.qkv_bias:
        bq = src.take(p + "q_proj.bias")
        if kind.output_gate == "sigmoid":
            raise src.error(
                p + "q_proj.bias",
                "holds the output gate's bias too; mkgen's GQA has no tensor for it",
            )
        out.put(o + "bq", bq, p + "q_proj.bias")
        out.put(o + "bk", src.take(p + "k_proj.bias"), p + "k_proj.bias")
        out.put(o + "bv", src.take(p + "v_proj.bias"), p + "v_proj.bias")
    if kind.o_bias:
        out.put(o + "bo", src.take(p + "o_proj.bias"), p + "o_proj.bias")
    if kind.qk_norm == "rms":
        out.put(o + "q_norm", src.take(p + "q_norm.weight"), p + "q_norm.weight")
        out.put(o + "k_norm", src.take(p + "k_norm.weight"), p + "k_norm.weight")
    if kind.sinks:
        out.put(o + "sinks", src.take(p + "sinks"), p + "sinks")


def _mla(src: _Source, out: _Out, p: str, o: str, kind: MLAAttention) -> None:
    pairs = [("kv_a_proj_with_mqa", "wkv_a"), ("kv_b_proj", "wkv_b"), ("o_proj", "wo")]
    if kind.q_lora_rank:
        pairs += [("q_a_proj", "wq_a"), ("q_b_proj", "wq_b")]
        out.put(o + "q_norm", src.take(p + "q_a_layernorm.weight"), p + "q_a_layernorm.weight")
    else:
        pairs.append(("q_proj", "wq"))
    for hf, name in pairs:
        out.put(o + name, src.linear(p + hf + ".weight"), p + hf + ".weight")
    out.put(o + "kv_norm", src.take(p + "kv_a_layernorm.weight"), p + "kv_a_layernorm.weight")
    if kind.output_gate == "sigmoid":
        raise src.error(p + "q_proj.weight", "an MLA output gate has no Hugging Face layout here")


def _conv_taps(w: np.ndarray) -> np.ndarray:
    """A depthwise Conv1d weight [channels, 1, W] as taps [W, channels]."""
    return w.reshape(w.shape[0], w.shape[-1]).T


def _kda(src: _Source, out: _Out, p: str, o: str, kind: KDAAttention) -> None:
    d = kind.num_heads * kind.head_dim
    for hf, name in (
        ("q_proj", "wq"),
        ("k_proj", "wk"),
        ("v_proj", "wv"),
        ("o_proj", "wo"),
        ("b_proj", "wbeta"),
    ):
        out.put(o + name, src.linear(p + hf + ".weight"), p + hf + ".weight")
    gate = (
        (("g_a_proj", "wg_a"), ("g_b_proj", "wg_b"))
        if kind.output_gate_rank
        else (("g_proj", "wg"),)
    )
    for hf, name in gate:
        out.put(o + name, src.linear(p + hf + ".weight"), p + hf + ".weight")
    for hf, name in (("f_a_proj", "wf_a"), ("f_b_proj", "wf_b")):
        names = (p + hf + ".weight", p + "forget_gate." + hf + ".weight")
        out.put(o + name, src.linear(*names), src.first(*names))
    for hf in ("A_log", "dt_bias"):
        names = (p + hf, p + "forget_gate." + hf)
        value = src.take(*names)
        if hf == "A_log" and value.size == kind.num_heads:
            value = value.reshape(kind.num_heads)  # Kimi stores [1, 1, H, 1]
        out.put(o + hf, value, src.first(*names))
    if src.has(p + "q_conv1d.weight"):
        for c in "qkv":
            name = f"{p}{c}_conv1d.weight"
            out.put(f"{o}conv_{c}", _conv_taps(src.take(name)), name)
    else:
        name = src.first(p + "q_conv1d.weight", p + "conv1d.weight")
        taps = _split_rows(src.take(name), [d, d, d], name, src)
        for c, w in zip("qkv", taps, strict=True):
            out.put(f"{o}conv_{c}", _conv_taps(w), name)
    out.put(o + "o_norm", src.take(p + "o_norm.weight"), p + "o_norm.weight")


def _gated_deltanet(
    src: _Source, out: _Out, p: str, o: str, kind: GatedDeltaNetAttention, hidden: int
) -> None:
    hk, hv = kind.num_key_heads, kind.num_value_heads
    dk, dv = kind.key_head_dim, kind.value_head_dim
    r = hv // hk
    name = p + "in_proj_qkvz.weight"
    w = src.take(name)
    group = 2 * dk + 2 * r * dv
    if w.shape != (hk * group, hidden):
        raise src.error(name, f"shape {w.shape}, expected {(hk * group, hidden)}")
    w = w.reshape(hk, group, hidden)
    parts = np.split(w, np.cumsum([dk, dk, r * dv]), axis=1)  # q, k, v, z per key head
    for part, spec_name in zip(parts, ("wq", "wk", "wv", "wz"), strict=True):
        out.put(o + spec_name, part.reshape(-1, hidden).T, name)
    name = p + "in_proj_ba.weight"
    w = src.take(name)
    if w.shape != (hk * 2 * r, hidden):
        raise src.error(name, f"shape {w.shape}, expected {(hk * 2 * r, hidden)}")
    b, a = np.split(w.reshape(hk, 2 * r, hidden), 2, axis=1)
    out.put(o + "wb", b.reshape(hv, hidden).T, name)
    out.put(o + "wa", a.reshape(hv, hidden).T, name)
    name = p + "conv1d.weight"
    taps = _split_rows(src.take(name), [hk * dk, hk * dk, hv * dv], name, src)
    for c, t in zip("qkv", taps, strict=True):
        out.put(f"{o}conv_{c}", _conv_taps(t), name)
    for hf, spec_name in (("A_log", "A_log"), ("dt_bias", "dt_bias"), ("norm.weight", "o_norm")):
        out.put(o + spec_name, src.take(p + hf), p + hf)
    out.put(o + "wo", src.linear(p + "out_proj.weight"), p + "out_proj.weight")


def _dense(src: _Source, out: _Out, p: str, o: str, kind: DenseFFN) -> None:
    names = (("gate_proj", "w_gate"), ("up_proj", "w_up"), ("down_proj", "w_down"))
    for hf, name in names if kind.gated else names[1:]:
        out.put(o + name, src.linear(p + hf + ".weight"), p + hf + ".weight")
    if kind.bias:
        for hf, name in (("gate_proj", "b_gate"), ("up_proj", "b_up"), ("down_proj", "b_down")):
            if hf == "gate_proj" and not kind.gated:
                continue
            out.put(o + name, src.take(p + hf + ".bias"), p + hf + ".bias")


def _experts(src: _Source, out: _Out, p: str, o: str, kind: MoEFFN, arch: str) -> None:
    e, f = kind.num_experts, kind.expert_width
    fused = p + "experts.gate_up_proj"
    if src.has(fused):
        gate_up = src.take(fused)
        down_name = p + "experts.down_proj"
        down = src.take(down_name)
        if arch == "GptOssForCausalLM":
            # [E, in, 2F] (x @ W layout), gate at even and up at odd columns; down [E, F, out].
            out.put(o + "experts_gate", gate_up[:, :, 0::2], fused)
            out.put(o + "experts_up", gate_up[:, :, 1::2], fused)
            out.put(o + "experts_down", down, down_name)
        else:
            # transformers 5 runtime layout: [E, 2F, in] = [gate rows | up rows]; down [E, out, F].
            if gate_up.ndim != 3 or gate_up.shape[1] != 2 * f:
                raise src.error(fused, f"shape {gate_up.shape}, expected [{e}, {2 * f}, in]")
            out.put(o + "experts_gate", gate_up[:, :f].transpose(0, 2, 1), fused)
            out.put(o + "experts_up", gate_up[:, f:].transpose(0, 2, 1), fused)
            out.put(o + "experts_down", down.transpose(0, 2, 1), down_name)
        if kind.expert_bias:
            name = fused + "_bias"
            bias = src.take(name)
            if arch == "GptOssForCausalLM":
                out.put(o + "experts_b_gate", bias[:, 0::2], name)
                out.put(o + "experts_b_up", bias[:, 1::2], name)
            else:
                out.put(o + "experts_b_gate", bias[:, :f], name)
                out.put(o + "experts_b_up", bias[:, f:], name)
            out.put(o + "experts_b_down", src.take(down_name + "_bias"), down_name + "_bias")
        return
    if kind.expert_bias:
        raise src.error(fused, "missing: per-expert biases are only read from fused experts")
    first = p + "experts.0."
    names = (
        ("w1", "w3", "w2")
        if src.has(first + "w1.weight")
        else ("gate_proj", "up_proj", "down_proj")
    )
    for hf, name in zip(names, ("experts_gate", "experts_up", "experts_down"), strict=True):
        stack = [src.linear(f"{p}experts.{j}.{hf}.weight") for j in range(e)]
        shapes = {a.shape for a in stack}
        if len(shapes) > 1:
            raise src.error(f"{p}experts.*.{hf}.weight", f"experts differ in shape: {shapes}")
        out.put(o + name, np.stack(stack), f"{p}experts.{{0..{e - 1}}}.{hf}.weight")


def _moe(src: _Source, out: _Out, p: str, o: str, kind: MoEFFN, arch: str) -> None:
    if kind.latent:
        raise src.error(p + "experts", "latent MoE projections have no Hugging Face layout here")
    router = "router." if arch == "GptOssForCausalLM" else "gate."
    out.put(o + "router", src.linear(p + router + "weight"), p + router + "weight")
    if kind.router.bias:
        out.put(o + "router_bias", src.take(p + router + "bias"), p + router + "bias")
    if kind.router.selection_bias:
        name = p + "gate.e_score_correction_bias"
        out.put(o + "selection_bias", src.take(name), name)
    _experts(src, out, p, o, kind, arch)
    if kind.shared_experts:
        sp = p + ("shared_expert." if kind.shared_experts.gate else "shared_experts.")
        for hf, name in (
            ("gate_proj", "shared_gate"),
            ("up_proj", "shared_up"),
            ("down_proj", "shared_down"),
        ):
            out.put(o + name, src.linear(sp + hf + ".weight"), sp + hf + ".weight")
        if kind.shared_experts.gate:
            name = p + "shared_expert_gate.weight"
            out.put(o + "shared_gate_proj", src.linear(name), name)


def _ffn_prefix(src: _Source, p: str, moe: bool) -> str:
    """mlp. or block_sparse_moe. (Mixtral, Kimi Linear MoE layers), whichever is there."""
    if moe:
        for sub in ("mlp.", "block_sparse_moe."):
            if any(src.has(p + sub + g) for g in ("gate.weight", "router.weight")):
                return p + sub
    return p + "mlp."


class HFMapping:
    """The mapping of one checkpoint onto the inventory, a layer at a time.

    `globals()` gives the embedding, final norm and lm_head, `layer(i)` the tensors of
    decoder layer i (mkgen names), reading only that layer's checkpoint tensors; once
    every part was taken, `check_complete()` holds the checkpoint to the spec (nothing
    missing, nothing unused). `load_hf_weights` takes every part at once; the converter
    (mkgen/weights/convert.py) takes them one layer at a time, so that at most one layer
    of the checkpoint is in memory."""

    def __init__(
        self,
        spec: ModelSpec,
        arch: str,
        tensors: Mapping[str, np.ndarray],
        *,
        mtp_layers: int = 0,
        source: str = "checkpoint",
    ) -> None:
        self.spec, self.mtp_layers = spec, mtp_layers
        self.arch = canonical_architecture(arch, source)
        self.src = _Source(tensors, source)
        quantized = sorted(n for n in tensors if _QUANTIZED.search(n))
        if quantized:
            raise self.src.error(
                quantized[0],
                "a quantization side tensor: this is a quantized checkpoint; mkgen loads float "
                "checkpoints only (dequantize first)",
            )
        if spec.attention_residual:
            raise self.src.error(
                "attn_res_logits", "the attention residual has no Hugging Face layout"
            )
        self.out = _Out(spec, source)
        self.produced: set[str] = set()

    def _taken(self) -> dict[str, np.ndarray]:
        values, self.out.values = self.out.values, {}
        self.produced.update(values)
        return values

    def globals(self) -> dict[str, np.ndarray]:
        """embedding, final_norm and (untied) lm_head."""
        src, out = self.src, self.out
        embedding = src.take("model.embed_tokens.weight")
        out.put("embedding", embedding, "model.embed_tokens.weight")
        out.put("final_norm", src.take("model.norm.weight"), "model.norm.weight")
        if not self.spec.dims.tie_embeddings:
            out.put("lm_head", src.linear("lm_head.weight"), "lm_head.weight")
        elif src.has("lm_head.weight"):
            lm_head = src.take("lm_head.weight")
            if not np.array_equal(lm_head, embedding):
                raise src.error(
                    "lm_head.weight", "differs from the embedding but the spec ties them"
                )
        return self._taken()

    def layer(self, i: int) -> dict[str, np.ndarray]:
        """Decoder layer i's inventory tensors (names layers.{i}.*)."""
        src, out, spec = self.src, self.out, self.spec
        attn_name, ffn_name = spec.layer_table()[i]
        p, o = f"model.layers.{i}.", f"layers.{i}."
        out.put(
            o + "attn_norm", src.take(p + "input_layernorm.weight"), p + "input_layernorm.weight"
        )
        out.put(
            o + "ffn_norm",
            src.take(p + "post_attention_layernorm.weight"),
            p + "post_attention_layernorm.weight",
        )
        attn = spec.attention_kinds[attn_name]
        if isinstance(attn, GQAAttention):
            _gqa(src, out, p + "self_attn.", o + "attn.", attn, spec.dims.hidden)
        elif isinstance(attn, MLAAttention):
            _mla(src, out, p + "self_attn.", o + "attn.", attn)
        elif isinstance(attn, KDAAttention):
            _kda(src, out, p + "self_attn.", o + "attn.", attn)
        else:
            _gated_deltanet(src, out, p + "linear_attn.", o + "attn.", attn, spec.dims.hidden)
        ffn = spec.ffn_kinds[ffn_name]
        fp = _ffn_prefix(src, p, isinstance(ffn, MoEFFN))
        if isinstance(ffn, MoEFFN):
            _moe(src, out, fp, o + "ffn.", ffn, self.arch)
        else:
            _dense(src, out, fp, o + "ffn.", ffn)
        return self._taken()

    def check_inventory(self) -> None:
        """The whole mapping run over the tensors' shapes and stored dtypes (the headers),
        reading no data: a missing, unexpected or misshapen tensor anywhere in the
        checkpoint is a one-line error before the first layer is converted."""
        dry = HFMapping(
            self.spec,
            self.arch,
            _Shapes(self.src.tensors, self.src.source),
            mtp_layers=self.mtp_layers,
            source=self.src.source,
        )
        dry.globals()
        for i in range(self.spec.layers.count):
            dry.layer(i)
        dry.check_complete()

    def skip_globals(self) -> None:
        """Count the globals as taken without reading them (a resumed conversion that
        verified what an earlier run wrote from them)."""
        self.produced.update(n for n in self.out.expected if not n.startswith("layers."))
        names = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
        self.src.used.update(n for n in names if self.src.has(n))

    def skip_layer(self, i: int) -> None:
        """Count layer i as taken without reading it (see skip_globals)."""
        self.produced.update(n for n in self.out.expected if n.startswith(f"layers.{i}."))
        prefix = f"model.layers.{i}."
        self.src.used.update(n for n in self.src.tensors if n.startswith(prefix))

    def check_complete(self) -> None:
        _check_complete(self.spec, self.src, self.produced, self.out, self.arch, self.mtp_layers)


def load_hf_weights(
    spec: ModelSpec,
    arch: str,
    tensors: Mapping[str, np.ndarray],
    *,
    mtp_layers: int = 0,
    source: str = "checkpoint",
) -> dict[str, np.ndarray]:
    """Map a checkpoint's tensors (HF names) to the spec's inventory (mkgen names).

    arch: the architecture class or model_type (e.g. "Qwen3NextForCausalLM", "kimi_k2").
    mtp_layers: DeepSeek-style multi-token-prediction layers stored after the last
    decoder layer (``model.layers.{count}..``), skipped as the importer skips them.
    Returns float arrays (BF16 widened to float32) in inventory order.
    """
    mapping = HFMapping(spec, arch, tensors, mtp_layers=mtp_layers, source=source)
    values = mapping.globals()
    for i in range(spec.layers.count):
        values.update(mapping.layer(i))
    mapping.check_complete()
    return {name: values[name] for name in mapping.out.expected}


def _check_complete(
    spec: ModelSpec, src: _Source, produced: set[str], out: _Out, arch: str, mtp: int
) -> None:
    missing = [name for name in out.expected if name not in produced]
    if missing:  # a gap in this module's mapping, not in the checkpoint
        raise SpecError(f"{src.source}: {missing[0]}: no checkpoint tensor maps to it")
    ignored = [re.compile(r) for r in IGNORED[arch]]
    count = spec.layers.count
    mtp_prefixes = tuple(f"model.layers.{i}." for i in range(count, count + mtp))
    left = sorted(
        name
        for name in src.tensors
        if name not in src.used
        and not any(r.search(name) for r in ignored)
        and not name.startswith(mtp_prefixes)
    )
    if left:
        more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
        raise src.error(
            left[0],
            f"not used by the {arch} mapping{more}; the checkpoint has weights the spec does "
            "not describe (a config/checkpoint mismatch or an unsupported feature)",
        )


def mtp_layer_count(config: Mapping[str, Any]) -> int:
    """DeepSeek-style MTP layers a config declares (stored as extra model.layers.N)."""
    value = config.get("num_nextn_predict_layers") or 0
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def load_hf_checkpoint(
    directory: Path | str, name: str | None = None
) -> tuple[ModelSpec, dict[str, np.ndarray]]:
    """Import directory/config.json and map its safetensors weights: (spec, weights)."""
    directory = Path(directory)
    config_path = directory / "config.json"
    config = read_json(config_path)
    spec_name = name or default_spec_name(directory)
    spec = import_hf_dict(config, spec_name, str(config_path))
    arch = canonical_architecture(
        (config.get("architectures") or [config.get("model_type", "")])[0], str(config_path)
    )
    tensors = read_safetensors(directory)
    weights = load_hf_weights(
        spec, arch, tensors, mtp_layers=mtp_layer_count(config), source=str(tensors.path)
    )
    return spec, weights


__all__: list[str] = [
    "IGNORED",
    "HFMapping",
    "SafetensorsCheckpoint",
    "TensorView",
    "header_shapes",
    "load_hf_checkpoint",
    "load_hf_weights",
    "mtp_layer_count",
    "read_safetensors",
]
