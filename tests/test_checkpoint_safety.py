"""Hostile or damaged checkpoints given to `mkgen convert`: each is a one-line error naming
the file (and the tensor, where there is one), found before anything is converted except
NaN/Inf values, which are found while converting, tensor by tensor.

The checkpoints are the qwen3_moe fixture re-published as a two-shard hub checkpoint
(tests/test_convert.py's write_sharded) and then damaged.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from cli_run import assert_user_error, mkgen_here
from safetensors.numpy import load_file
from test_convert import FIXTURES, save_safetensors, write_sharded

from mkgen.reference.hf_weights import HFMapping, read_safetensors
from mkgen.spec.hf_import import import_hf_dict

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
INDEX = "model.safetensors.index.json"
LAST_LAYER = 2  # the fixture's three layers


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Path:
    return write_sharded(FIXTURES / "qwen3_moe", tmp_path_factory.mktemp("hub") / "qwen3_moe")


def _copy(hub: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(hub, tmp_path / "ckpt"))


def _index(checkpoint: Path) -> dict:
    return json.loads((checkpoint / INDEX).read_text())


def _shard_of(checkpoint: Path, name: str) -> str:
    return _index(checkpoint)["weight_map"][name]


def _edit_shard(checkpoint: Path, shard: str, edit: Callable[[dict], None]) -> Path:
    tensors = load_file(checkpoint / shard)
    edit(tensors)
    save_safetensors(tensors, checkpoint / shard)
    return checkpoint / shard


def _edit_index(checkpoint: Path, edit: Callable[[dict], None]) -> None:
    index = _index(checkpoint)
    edit(index["weight_map"])
    (checkpoint / INDEX).write_text(json.dumps(index))


def _raw_shard(path: Path, header: bytes, data: bytes, length: int | None = None) -> None:
    """A .safetensors file written byte by byte: `length` is the header length it claims."""
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + data)


def _convert(checkpoint: Path, out: Path, *spec: str):
    return mkgen_here(
        "convert", *spec, "--checkpoint", str(checkpoint), "--topology", "1x1x1", "-o", str(out)
    )


def _refused_before_converting(checkpoint: Path, tmp_path: Path, *fragments: str) -> None:
    out = tmp_path / "w"
    assert_user_error(_convert(checkpoint, out), *fragments)
    assert not out.exists()  # not a single layer was converted


# ---------------------------------------------------------------- shards and the index


def test_a_tensor_in_two_shards(hub: Path, tmp_path: Path) -> None:
    checkpoint = _copy(hub, tmp_path)
    name = "model.layers.0.self_attn.q_proj.weight"
    home = _shard_of(checkpoint, name)
    other = next(s for s in SHARDS if s != home)
    value = load_file(checkpoint / home)[name]
    _edit_shard(checkpoint, other, lambda tensors: tensors.update({name: value}))
    _refused_before_converting(
        checkpoint, tmp_path, f"{other}: {name}: stored in this shard, but the index puts it in "
        f"{home}"
    )  # fmt: skip


def test_a_tensor_the_index_does_not_list(hub: Path, tmp_path: Path) -> None:
    checkpoint = _copy(hub, tmp_path)
    name = "model.layers.1.mlp.gate.weight"
    shard = _shard_of(checkpoint, name)
    _edit_index(checkpoint, lambda weight_map: weight_map.pop(name))
    _refused_before_converting(
        checkpoint, tmp_path, f"{shard}: {name}: stored in this shard, but the index does not "
        "list it"
    )  # fmt: skip


def test_a_single_file_beside_an_index_that_does_not_list_it(hub: Path, tmp_path: Path) -> None:
    """model.safetensors beside model.safetensors.index.json: which one is the checkpoint
    is not guessed; an index whose one shard is model.safetensors is no such doubt."""
    checkpoint = _copy(hub, tmp_path)
    shutil.copy(FIXTURES / "qwen3_moe" / "model.safetensors", checkpoint)
    _refused_before_converting(
        checkpoint, tmp_path, f"{checkpoint}: holds both model.safetensors and {INDEX} (which "
        "does not list it)", "move one of them out"
    )  # fmt: skip
    for shard in SHARDS:
        (checkpoint / shard).unlink()
    _edit_index(checkpoint, lambda m: m.update(dict.fromkeys(m, "model.safetensors")))
    assert set(read_safetensors(checkpoint).shards) == {"model.safetensors"}


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_an_index_path_outside_the_checkpoint_folder(hub: Path, tmp_path: Path, how: str) -> None:
    checkpoint = _copy(hub, tmp_path)
    outside = tmp_path / SHARDS[1]
    shutil.move(checkpoint / SHARDS[1], outside)  # a valid shard, in the wrong place
    if how == "symlink":
        (checkpoint / SHARDS[1]).symlink_to(outside)
        shard = SHARDS[1]
    else:
        shard = f"../{SHARDS[1]}" if how == "dotdot" else str(outside)
        _edit_index(
            checkpoint, lambda m: m.update({k: shard for k, v in m.items() if v == SHARDS[1]})
        )
    _refused_before_converting(
        checkpoint, tmp_path, f"{checkpoint / INDEX}: weight_map: ", f"shard {shard!r} lies "
        "outside the checkpoint folder"
    )  # fmt: skip


def test_shards_in_the_hugging_face_cache_are_read_through_their_symlinks(
    hub: Path, tmp_path: Path
) -> None:
    """The cache keeps a snapshot's files as symlinks into the repository's blobs/."""
    repository = tmp_path / "models--org--qwen3_moe"
    snapshot = repository / "snapshots" / "0123abc"
    (repository / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in hub.iterdir():
        blob = repository / "blobs" / f"blob-{file.name}"
        shutil.copy(file, blob)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob.name))
    result = _convert(snapshot, tmp_path / "w")
    assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------- hostile headers


def _entry(dtype: str, shape: list[int], start: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}


HOSTILE_HEADERS = {
    "header length 2^62": (b"{}", b"", 2**62, "header length 4611686018427387904 exceeds"),
    "header length 2^64-1": (b"{}", b"", 2**64 - 1, "header length 18446744073709551615 exceeds"),
    "a JSON list": (b"[1, 2]", b"", None, "the header is a JSON list, not an object"),
    "a negative shape": (
        json.dumps({"a": _entry("F32", [-1], 0, 4)}).encode(),
        bytes(4),
        None,
        "not a readable safetensors file",
    ),
    "truncated data": (
        json.dumps({"a": _entry("F32", [4], 0, 16)}).encode(),
        bytes(4),
        None,
        "truncated: a ends at byte",
    ),
    "a tensor twice": (
        b'{"a": %s, "a": %s}' % ((json.dumps(_entry("F32", [1], 0, 4)).encode(),) * 2),
        bytes(4),
        None,
        "a: appears twice in the safetensors header",
    ),
    "overlapping data": (
        json.dumps({"a": _entry("F32", [2], 0, 8), "b": _entry("F32", [2], 4, 12)}).encode(),
        bytes(12),
        None,
        "invalid offset for tensor `b`",
    ),
}


@pytest.mark.parametrize("case", HOSTILE_HEADERS)
def test_a_hostile_header_is_a_one_line_error(hub: Path, tmp_path: Path, case: str) -> None:
    header, data, length, fragment = HOSTILE_HEADERS[case]
    checkpoint = _copy(hub, tmp_path)
    _raw_shard(checkpoint / SHARDS[1], header, data, length)
    _refused_before_converting(checkpoint, tmp_path, f"{checkpoint / SHARDS[1]}: ", fragment)


# ---------------------------------------------------------------- the inventory, up front


@pytest.mark.parametrize(
    "folder", sorted(d.name for d in FIXTURES.iterdir() if (d / "config.json").exists())
)
def test_the_inventory_check_runs_the_mapping_of_every_architecture(folder: str) -> None:
    """Every reshape, split and stack of each architecture's mapping, on shapes alone."""
    config = json.loads((FIXTURES / folder / "config.json").read_text())
    spec = import_hf_dict(config, folder, "config.json")
    tensors = read_safetensors(FIXTURES / folder)
    mapping = HFMapping(spec, config["architectures"][0], tensors, source=folder)
    mapping.check_inventory()
    assert not mapping.produced  # nothing was read or taken for the real conversion


def _last_layer_tensor(checkpoint: Path) -> tuple[str, str]:
    name = f"model.layers.{LAST_LAYER}.self_attn.k_proj.weight"
    return name, _shard_of(checkpoint, name)


def test_a_missing_tensor_of_the_last_layer_is_found_before_the_first(
    hub: Path, tmp_path: Path
) -> None:
    checkpoint = _copy(hub, tmp_path)
    name, shard = _last_layer_tensor(checkpoint)
    _edit_shard(checkpoint, shard, lambda tensors: tensors.pop(name))
    _edit_index(checkpoint, lambda weight_map: weight_map.pop(name))
    _refused_before_converting(checkpoint, tmp_path, f"{name}: missing from the checkpoint")


def test_an_unexpected_tensor_is_found_before_the_first_layer(hub: Path, tmp_path: Path) -> None:
    checkpoint = _copy(hub, tmp_path)
    name = f"model.layers.{LAST_LAYER}.mlp.surprise.weight"
    value = np.ones((4, 4), ml_dtypes.bfloat16)
    _edit_shard(checkpoint, SHARDS[0], lambda tensors: tensors.update({name: value}))
    _edit_index(checkpoint, lambda weight_map: weight_map.update({name: SHARDS[0]}))
    _refused_before_converting(checkpoint, tmp_path, f"{name}: not used by the")


def test_a_misshapen_tensor_of_the_last_layer_is_found_before_the_first(
    hub: Path, tmp_path: Path
) -> None:
    checkpoint = _copy(hub, tmp_path)
    name, shard = _last_layer_tensor(checkpoint)
    _edit_shard(checkpoint, shard, lambda tensors: tensors.update({name: tensors[name][:-1]}))
    _refused_before_converting(
        checkpoint, tmp_path, f"{name}: gives layers.{LAST_LAYER}.attn.wk of shape"
    )


# ---------------------------------------------------------------- values


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_or_inf_weights_are_refused_while_converting(
    hub: Path, tmp_path: Path, bad: float
) -> None:
    checkpoint = _copy(hub, tmp_path)
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    shard = _shard_of(checkpoint, name)

    def poison(tensors: dict) -> None:
        tensors[name] = tensors[name].copy()
        tensors[name][1, 2] = bad

    _edit_shard(checkpoint, shard, poison)
    out = tmp_path / "w"
    result = _convert(checkpoint, out)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [
        f"mkgen: error: {checkpoint / shard}: {name}: holds NaN or Inf values (a damaged "
        "checkpoint)"
    ]  # no progress bar: stderr is not a terminal
    assert (out / "progress.json").exists()  # layer 0 was converted: checked on the way


# ---------------------------------------------------------------- config.json


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("num_experts_per_tok", 3, "layer 1 top_k is 3 in the checkpoint's config but 2"),
        ("rms_norm_eps", 1e-5, "norm eps is 1e-05 in the checkpoint's config but 1e-06"),
        ("rope_parameters", {"rope_theta": 10000.0, "rope_type": "default"}, "rope theta is"),
    ],
)
def test_a_config_that_disagrees_with_the_spec(
    hub: Path, tmp_path: Path, key: str, value: object, fragment: str
) -> None:
    checkpoint = _copy(hub, tmp_path)
    config = json.loads((checkpoint / "config.json").read_text())
    config[key] = value
    (checkpoint / "config.json").write_text(json.dumps(config))
    out = tmp_path / "w"
    spec = str(hub / "config.json")  # the spec of the checkpoint as it was
    assert_user_error(_convert(checkpoint, out, spec), f"{checkpoint / 'config.json'}: ", fragment)
    assert not out.exists()
