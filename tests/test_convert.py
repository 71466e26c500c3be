"""mkgen convert: Hugging Face checkpoints -> per-core containers (mkgen/weights/convert.py).

Fast tests (no kernel runs): the containers hold exactly what the packer makes from the
same weights; sharded BF16 checkpoints, resumption after an interruption, and one-line
errors for a missing shard, a truncated file, a wrong shape or dtype and a layout that
does not match the build; the weights directory as convert's own (--force removes the
earlier conversion's files, a foreign file is refused, damaged state files are one-line
errors, modes follow the umask); the reader's sha256 check. Hostile checkpoints are in
tests/test_checkpoint_safety.py, the runner's generation from converted weights in
tests/test_runner.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
from cli_run import REPO, assert_user_error, mkgen_here
from safetensors.numpy import load_file

from mkgen.cli import main
from mkgen.errors import MkgenError
from mkgen.kinds import default_registry
from mkgen.plan import plan_build
from mkgen.plan.options import BuildOptions
from mkgen.reference.hf_weights import load_hf_checkpoint
from mkgen.spec.topology import parse_topology
from mkgen.weights import convert, pack

FIXTURES = Path(__file__).parent / "fixtures" / "hf"


def write_sharded(
    source: Path,
    target: Path,
    shards: int = 2,
    bf16: bool = True,
    tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    """A fixture checkpoint re-published as a hub checkpoint: config.json, BF16 tensors in
    `shards` files model-0000i-of-0000n.safetensors and model.safetensors.index.json;
    `tensors` instead of the fixture's."""
    target.mkdir(parents=True, exist_ok=True)
    shutil.copy(source / "config.json", target / "config.json")
    if tensors is None:
        tensors = load_file(source / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {}
        for name in names[i::shards]:
            value = tensors[name]
            if bf16:  # the bits of bf16 as the hub stores them (safetensors BF16)
                value = value.astype(ml_dtypes.bfloat16)
            part[name] = value
            weight_map[name] = file
        save_safetensors(part, target / file)
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (target / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return target


def save_safetensors(tensors: dict[str, np.ndarray], path: Path) -> None:
    """safetensors.numpy cannot write ml_dtypes' bfloat16: write BF16 headers by hand."""
    import struct

    header, blobs, offset = {}, [], 0
    for name, value in tensors.items():
        value = np.ascontiguousarray(value)
        dtype = {"bfloat16": "BF16", "float32": "F32", "int32": "I32"}[value.dtype.name]
        raw = value.tobytes()
        header[name] = {
            "dtype": dtype,
            "shape": list(value.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        blobs.append(raw)
        offset += len(raw)
    data = json.dumps(header).encode()
    data += b" " * (-len(data) % 8)
    path.write_bytes(struct.pack("<Q", len(data)) + data + b"".join(blobs))


def _convert(args: list[str], capsys) -> tuple[int, str, str]:
    try:
        main(["convert", *args])
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def _layout(folder: str = "qwen3_moe", topology: str = "1x1x1", **options):
    from mkgen.spec.hf_import import import_hf_config

    spec = import_hf_config(FIXTURES / folder / "config.json", folder)
    opts = BuildOptions.create(context=64, **options)
    spec = opts.apply(spec)
    return spec, plan_build(spec, parse_topology(topology), opts, kinds=default_registry()).kernel


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    return write_sharded(FIXTURES / "qwen3_moe", tmp_path_factory.mktemp("ckpt") / "qwen3_moe")


def test_containers_hold_what_the_packer_makes(sharded: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "w"
    code, stdout, err = _convert(
        ["--checkpoint", str(sharded), "--topology", "1x1x1", "--context", "64", "-o", str(out)],
        capsys,
    )
    assert code == 0, err
    assert stdout.startswith("wrote") and stdout.count("\n") == 1  # stdout stays clean,
    assert err == ""  # and stderr, not a terminal, has no bar (tests/test_progress.py)
    spec, layout = _layout()
    manifest = convert.open_weights(out, spec, layout, "test")
    _, weights = load_hf_checkpoint(sharded, "qwen3_moe")  # the same BF16 values
    for rank in range(layout.devices):
        np.testing.assert_array_equal(
            convert.read_stream(out, manifest, layout, rank).view(np.uint16),
            pack.pack_stream(layout, weights, rank).view(np.uint16),
        )
        np.testing.assert_array_equal(
            convert.read_vectors(out, manifest, layout, rank),
            pack.pack_vectors(layout, weights, rank),
        )
        experts = pack.pack_experts(layout, weights, rank)
        for i, want in enumerate(experts):
            got = convert.read_experts(out, manifest, layout, rank, i)
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    embedding, final_norm = convert.read_globals(out, manifest)
    np.testing.assert_array_equal(embedding.astype(np.float32), weights["embedding"])
    np.testing.assert_array_equal(final_norm, weights["final_norm"])
    identity = manifest["identity"]
    assert identity["topology"] == "tpu7x:1x1x1" and identity["spec"] == "qwen3_moe"
    assert set(identity["checkpoint"]["files"]) == {
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    }  # fmt: skip
    assert all(len(e["sha256"]) == 64 for e in manifest["files"].values())
    assert not (out / convert.PROGRESS_FILE).exists()
    # Same inputs again: verified and left alone.
    code, stdout, _ = _convert(
        ["--checkpoint", str(sharded), "--topology", "1x1x1", "--context", "64", "-o", str(out)],
        capsys,
    )
    assert code == 0 and "is up to date" in stdout


def test_quantized_formats_go_through_the_packer(sharded: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "w"
    args = ["--checkpoint", str(sharded), "--topology", "1x1x1", "--context", "64"]
    code, _, err = _convert([*args, "--quant", "attention=int8", "-o", str(out)], capsys)
    assert code == 0, err
    spec, layout = _layout(quant=["attention=int8"])
    manifest = convert.open_weights(out, spec, layout, "test")
    assert manifest["identity"]["formats"]["attention"] == "int8"
    _, weights = load_hf_checkpoint(sharded, "qwen3_moe")
    stream = convert.read_stream(out, manifest, layout, 1).view(np.uint16)
    np.testing.assert_array_equal(stream, pack.pack_stream(layout, weights, 1).view(np.uint16))
    assert any(s.format == "int8" for kind in layout.attention for s in kind.segments)
    # The bf16 build lays attention out otherwise: a clear refusal.
    spec_bf16, layout_bf16 = _layout()
    with pytest.raises(
        MkgenError, match=r"formats attention=int8, .*lays weights out differently .*formats bf16"
    ):
        convert.open_weights(out, spec_bf16, layout_bf16, "qwen3_moe-1x1x1")


def _expect_error(capsys, checkpoint: Path, out: Path, pattern: str) -> None:
    code, _, err = _convert(
        ["--checkpoint", str(checkpoint), "--topology", "1x1x1", "-o", str(out)], capsys
    )
    lines = err.splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("mkgen: error: "), err
    assert re.search(pattern, lines[0]), lines[0]
    assert not (out / convert.LAYOUT_FILE).exists()  # nothing that looks complete
    # A failure before any unit is finished leaves no directory; after one, the progress
    # file that a resumed run starts from.
    assert not out.exists() or (out / convert.PROGRESS_FILE).exists()


def test_missing_shard(sharded: Path, tmp_path: Path, capsys) -> None:
    broken = tmp_path / "ckpt"
    shutil.copytree(sharded, broken)
    (broken / "model-00002-of-00002.safetensors").unlink()
    _expect_error(
        capsys, broken, tmp_path / "w", r"model-00002-of-00002.safetensors: not a readable"
    )


def test_truncated_shard(sharded: Path, tmp_path: Path, capsys) -> None:
    broken = tmp_path / "ckpt"
    shutil.copytree(sharded, broken)
    shard = broken / "model-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    _expect_error(capsys, broken, tmp_path / "w", r"00001-of-00002.safetensors: truncated: ")


def test_corrupt_header(sharded: Path, tmp_path: Path, capsys) -> None:
    broken = tmp_path / "ckpt"
    shutil.copytree(sharded, broken)
    shard = broken / "model-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[10:20] = b"\xff" * 10
    shard.write_bytes(bytes(data))
    _expect_error(capsys, broken, tmp_path / "w", r"00001-of-00002.safetensors: not a readable")


def test_wrong_shape_and_dtype(tmp_path: Path, capsys) -> None:
    source = FIXTURES / "qwen3"
    tensors = load_file(source / "model.safetensors")
    name = "model.layers.1.self_attn.k_proj.weight"
    for value, pattern in (
        (tensors[name][:-1], rf"{name}: gives layers.1.attn.wk of shape .* but the spec needs"),
        (tensors[name].astype(np.int32), rf"{name}: stored as I32: a quantized or non-float"),
    ):
        broken = tmp_path / f"ckpt-{value.dtype}"
        broken.mkdir()
        shutil.copy(source / "config.json", broken / "config.json")
        save_safetensors({**tensors, name: value}, broken / "model.safetensors")
        _expect_error(capsys, broken, tmp_path / f"w-{value.dtype}", pattern)


def _interrupted(args: list[str], capsys, monkeypatch) -> None:
    """Convert with Ctrl-C pressed while the seventh file is written (inside layer 1 of
    the fixture: globals 2 files, layer 0 2 cores x 3)."""
    real, count = convert._write_array, [0]

    def dies_on_the_seventh_file(path, array):
        count[0] += 1
        if count[0] == 7:
            raise KeyboardInterrupt
        return real(path, array)

    monkeypatch.setattr(convert, "_write_array", dies_on_the_seventh_file)
    code, _, err = _convert(args, capsys)  # click aborts
    monkeypatch.setattr(convert, "_write_array", real)
    assert code == 2 and "aborted" in err


def test_an_interrupted_conversion_resumes(sharded: Path, tmp_path: Path, capsys, monkeypatch):
    args = ["--checkpoint", str(sharded), "--topology", "1x1x1", "--context", "64"]
    reference = tmp_path / "reference"
    assert _convert([*args, "-o", str(reference)], capsys)[0] == 0
    out = tmp_path / "w"
    _interrupted([*args, "-o", str(out)], capsys, monkeypatch)
    assert (out / convert.PROGRESS_FILE).exists() and not (out / convert.LAYOUT_FILE).exists()
    assert not list(out.rglob(".*.tmp"))  # the file being written was removed
    spec, layout = _layout()
    with pytest.raises(MkgenError, match=r"no layout.json; an interrupted conversion"):
        convert.open_weights(out, spec, layout, "test")
    # A finished unit's file damaged meanwhile: redone, not trusted.
    damaged = out / "core-001" / "layer-000.stream.npy"
    damaged.write_bytes(damaged.read_bytes()[:-4] + b"\0\0\0\1")
    code, stdout, err = _convert([*args, "-o", str(out)], capsys)
    assert code == 0, err
    assert "resumed: 1 unit(s) verified and kept" in stdout  # globals; layer 0 redone
    ours = json.loads((out / convert.LAYOUT_FILE).read_text())["files"]
    theirs = json.loads((reference / convert.LAYOUT_FILE).read_text())["files"]
    assert ours == theirs  # byte-identical files to an uninterrupted conversion


def test_other_inputs_are_not_overwritten(sharded: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "w"
    args = ["--checkpoint", str(sharded), "--topology", "1x1x1", "-o", str(out)]
    assert _convert([*args, "--context", "64"], capsys)[0] == 0
    code, _, err = _convert([*args, "--quant", "attention=int8"], capsys)
    assert code == 2 and "holds another conversion" in err and "--force" in err
    assert _convert([*args, "--quant", "attention=int8", "--force"], capsys)[0] == 0
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "thesis.tex").write_text("years")
    code, _, err = _convert([*args[:-1], str(tmp_path / "other")], capsys)
    assert code == 2 and "is not a mkgen weights directory" in err
    code, _, err = _convert([*args[:-1], str(tmp_path / "other" / "thesis.tex")], capsys)
    assert code == 2 and "thesis.tex is not a directory" in err
    assert (tmp_path / "other" / "thesis.tex").read_text() == "years"


def test_tokenizer_files_follow_the_checkpoint_without_a_reconversion(
    tmp_path: Path, capsys
) -> None:
    """A tokenizer file added to (or changed in) a checkpoint already converted is copied
    on the next run, one it no longer has is removed, the weights kept as they are; one
    put beside the weights by hand is refused and kept."""
    checkpoint = shutil.copytree(FIXTURES / "qwen3", tmp_path / "ckpt")
    out = tmp_path / "w"
    args = ["--checkpoint", str(checkpoint), "--topology", "1x1x1", "-o", str(out)]
    assert _convert(args, capsys)[0] == 0
    weights = (out / "core-000" / "layer-000.stream.npy").stat().st_mtime_ns
    copied = f"{out}/ is up to date (13 files verified); copied tokenizer.json from the checkpoint"
    for tokenizer in ('{"model": 1}', '{"model": 2}'):  # added, then changed
        (checkpoint / convert.TOKENIZER_FILE).write_text(tokenizer)
        code, stdout, err = _convert(args, capsys)
        assert (code, stdout) == (0, copied + "\n"), err
        assert (out / convert.TOKENIZER_FILE).read_text() == tokenizer
        assert convert.tokenizer_file(out, convert.TOKENIZER_FILE) == out / "tokenizer.json"
    assert _convert(args, capsys)[1] == f"{out}/ is up to date (13 files verified)\n"
    (checkpoint / convert.TOKENIZER_FILE).unlink()
    code, stdout, _ = _convert([*args, "--force"], capsys)  # --force changes nothing here
    assert code == 0 and stdout.endswith("; removed tokenizer.json (not in the checkpoint)\n")
    assert not (out / convert.TOKENIZER_FILE).exists()
    assert convert.tokenizer_file(out, convert.TOKENIZER_FILE) is None
    assert (out / "core-000" / "layer-000.stream.npy").stat().st_mtime_ns == weights
    (out / convert.TOKENIZER_CONFIG_FILE).write_text("mine")
    (checkpoint / convert.TOKENIZER_CONFIG_FILE).write_text("{}")
    code, _, err = _convert(args, capsys)
    assert code == 2 and f"{out}: tokenizer_config.json was not written by mkgen convert" in err
    assert (out / convert.TOKENIZER_CONFIG_FILE).read_text() == "mine"


def test_an_output_directory_convert_cannot_write_is_one_line(tmp_path: Path) -> None:
    """An immutable directory (as mkgen build refuses it: mkgen.output's probe), and one
    under it, before any work; nothing is written."""
    immutable = tmp_path / "immutable"
    immutable.mkdir()
    if subprocess.run(["chattr", "+i", str(immutable)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not permitted here")
    args = ["convert", "--checkpoint", str(FIXTURES / "qwen3"), "--topology", "1x1x1", "-o"]
    try:
        result = mkgen_here(*args, str(immutable))
        assert_user_error(result, f"cannot write {immutable}: it is not writable (Operation not")
        under = mkgen_here(*args, str(immutable / "w"))
        assert_user_error(under, f"cannot write {immutable / 'w'}: {immutable} is not writable")
        assert list(immutable.iterdir()) == []
    finally:
        subprocess.run(["chattr", "-i", str(immutable)], check=True)
    assert_user_error(mkgen_here(*args, "/"), "/ is the filesystem root; choose another output")


def test_the_digest_ignores_batch_rows_and_context() -> None:
    spec, a = _layout()
    _, b = _layout(batch=2, rows=3)
    assert convert.weights_digest(spec, a) == convert.weights_digest(spec, b)
    _, c = _layout(quant=["attention=int8"])
    assert convert.weights_digest(spec, a) != convert.weights_digest(
        _layout(quant=["attention=int8"])[0], c
    )


def _files_in(directory: Path) -> set[str]:
    return {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()}


def test_force_removes_exactly_the_earlier_conversions_files(tmp_path: Path, capsys) -> None:
    out = tmp_path / "w"
    larger = write_sharded(FIXTURES / "qwen3_moe", tmp_path / "moe")  # experts: more files
    smaller = write_sharded(FIXTURES / "qwen3", tmp_path / "dense")
    args = ["--topology", "1x1x1", "-o", str(out)]
    assert _convert(["--checkpoint", str(larger), *args], capsys)[0] == 0
    earlier = _files_in(out)
    code, _, err = _convert(["--checkpoint", str(smaller), *args, "--force"], capsys)
    assert code == 0, err
    listed = set(json.loads((out / convert.LAYOUT_FILE).read_text())["files"])
    assert _files_in(out) == listed | {convert.LAYOUT_FILE}
    assert any("experts" in name for name in earlier - listed)  # they were there before


def test_an_interrupted_conversion_of_other_inputs_is_replaced_only_with_force(
    sharded: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    out = tmp_path / "w"
    args = ["--checkpoint", str(sharded), "--topology", "1x1x1", "-o", str(out)]
    _interrupted([*args, "--quant", "attention=int8"], capsys, monkeypatch)
    assert (out / convert.PROGRESS_FILE).exists()
    code, _, err = _convert(args, capsys)
    assert code == 2 and "holds another conversion (qwen3_moe for tpu7x:1x1x1)" in err
    assert "pass --force to replace it" in err
    assert _convert([*args, "--force"], capsys)[0] == 0
    listed = set(json.loads((out / convert.LAYOUT_FILE).read_text())["files"])
    assert _files_in(out) == listed | {convert.LAYOUT_FILE}


@pytest.mark.parametrize(
    ("foreign", "reported"),
    [("notes.txt", "notes.txt"), ("core-000/mine.npy", "core-000/mine.npy"), ("data/x", "data")],
)
def test_a_foreign_file_is_refused_and_kept(
    sharded: Path, tmp_path: Path, capsys, foreign: str, reported: str
) -> None:
    out = tmp_path / "w"
    args = ["convert", "--checkpoint", str(sharded), "--topology", "1x1x1", "-o", str(out)]
    assert _convert(args[1:], capsys)[0] == 0
    (out / foreign).parent.mkdir(exist_ok=True)
    (out / foreign).write_text("mine")
    for extra in ([], ["--force"]):  # other inputs, with and without --force
        result = mkgen_here(*args, "--quant", "attention=int8", *extra)
        assert_user_error(result, f"{out}: {reported} was not written by mkgen convert")
        assert "--force" not in result.stderr
    assert (out / foreign).read_text() == "mine"
    assert (
        json.loads((out / convert.LAYOUT_FILE).read_text())["identity"]["formats"]["attention"]
        == "bf16"
    )  # the earlier conversion is left as it was


def test_a_symlink_in_the_weights_directory_is_foreign(
    sharded: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "w"
    args = ["--checkpoint", str(sharded), "--topology", "1x1x1", "-o", str(out)]
    assert _convert(args, capsys)[0] == 0
    (tmp_path / "elsewhere").mkdir()
    (out / "core-009").symlink_to(tmp_path / "elsewhere")
    code, _, err = _convert([*args, "--quant", "attention=int8", "--force"], capsys)
    assert code == 2 and "core-009 was not written by mkgen convert" in err


@pytest.mark.parametrize(
    ("name", "text", "fragment"),
    [
        ("layout.json", '{"identity": {', "not JSON"),
        ("layout.json", "[1, 2]", "no identity object"),
        ("layout.json", '{"identity": {}, "files": []}', "files: expected a table of files"),
        (
            "layout.json",
            '{"identity": {}, "files": {"../thesis.tex": {"bytes": 1, "sha256": "0"}}}',
            "'../thesis.tex' is not a file mkgen convert writes",
        ),
        ("progress.json", "", "not JSON"),
        ("progress.json", '{"identity": {}, "units": []}', "units: expected a table"),
        (
            "progress.json",
            '{"identity": {}, "units": {"globals": {"embedding.npy": {"bytes": "1"}}}}',
            "units: globals: embedding.npy: expected bytes and sha256",
        ),
    ],
)
def test_damaged_convert_state_is_a_one_line_error(
    sharded: Path, tmp_path: Path, name: str, text: str, fragment: str
) -> None:
    out = tmp_path / "w"
    out.mkdir()
    (out / name).write_text(text)
    (tmp_path / "thesis.tex").write_text("years")
    result = mkgen_here(
        "convert", "--checkpoint", str(sharded), "--topology", "1x1x1", "-o", str(out), "--force"
    )
    assert_user_error(result, f"{out / name}: ", fragment)
    assert (tmp_path / "thesis.tex").exists()
    if name == convert.LAYOUT_FILE:  # the runner's reader says the same
        with pytest.raises(MkgenError, match=re.escape(fragment)):
            convert.open_weights(out, *_layout(), "test")


def test_a_truncated_plan_json_under_build(sharded: Path, tmp_path: Path) -> None:
    build = tmp_path / "build"
    build.mkdir()
    plan = (REPO / "generated" / "qwen3-32b-2x2x1" / "plan.json").read_text()
    (build / "plan.json").write_text(plan[: len(plan) // 2])
    result = mkgen_here(
        "convert", "--build", str(build), "--checkpoint", str(sharded), "-o", str(tmp_path / "w")
    )
    assert_user_error(result, f"{build / 'plan.json'}: damaged")


def test_converted_files_honour_the_umask(sharded: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "w"
    previous = os.umask(0o002)
    try:
        code, _, err = _convert(
            ["--checkpoint", str(sharded), "--topology", "1x1x1", "-o", str(out)], capsys
        )
    finally:
        os.umask(previous)
    assert code == 0, err
    modes = {name: stat.S_IMODE((out / name).stat().st_mode) for name in _files_in(out)}
    assert convert.LAYOUT_FILE in modes and set(modes.values()) == {0o664}, modes


@pytest.mark.parametrize(
    ("name", "read"),
    [
        ("core-001/head.stream.npy", lambda out, m, layout, v: convert.read_stream(out, m, layout, 1, verify=v)),
        ("core-000/layer-002.vectors.npy", lambda out, m, layout, v: convert.read_vectors(out, m, layout, 0, verify=v)),
        ("core-001/layer-001.experts-0.npy", lambda out, m, layout, v: convert.read_experts(out, m, layout, 1, 0, verify=v)),
        ("embedding.npy", lambda out, m, layout, v: convert.read_globals(out, m, verify=v)[0]),
    ],
)  # fmt: skip
def test_the_reader_verifies_the_sha256_of_every_file(
    sharded: Path, tmp_path: Path, capsys, name: str, read
) -> None:
    out = tmp_path / "w"
    args = ["--checkpoint", str(sharded), "--topology", "1x1x1", "-o", str(out)]
    assert _convert(args, capsys)[0] == 0
    spec, layout = _layout()
    manifest = convert.open_weights(out, spec, layout, "test")
    intact = np.array(read(out, manifest, layout, True))
    damaged = bytearray((out / name).read_bytes())
    damaged[-1] ^= 0x40  # a flipped bit in the data: the size stays right
    (out / name).write_bytes(damaged)
    with pytest.raises(MkgenError, match=rf"{out / name}: sha256 differs from layout.json's"):
        read(out, manifest, layout, True)
    trusted = np.array(read(out, manifest, layout, False))  # the fast path reads it as it is
    assert (trusted.view(np.uint8) != intact.view(np.uint8)).sum() == 1


def test_the_runner_checks_sha256_unless_told_to_trust_the_weights(
    sharded: Path, tmp_path: Path, capsys
) -> None:
    """The runner's reader passes --trust-weights through: damaged bytes are refused by
    default and read as they are with the flag."""
    from mkgen.runtime.weights import ConvertedWeights

    out = tmp_path / "w"
    args = ["--checkpoint", str(sharded), "--topology", "1x1x1", "-o", str(out)]
    assert _convert(args, capsys)[0] == 0
    spec, layout = _layout()
    build = SimpleNamespace(name="test")
    name = out / "core-000/layer-002.vectors.npy"
    damaged = bytearray(name.read_bytes())
    damaged[-1] ^= 0x40
    name.write_bytes(damaged)
    with pytest.raises(MkgenError, match=rf"{name}: sha256 differs from layout.json's"):
        ConvertedWeights(spec, layout, out, build, verify=True).vectors(0)
    assert ConvertedWeights(spec, layout, out, build, verify=False).vectors(0).shape[0] > 2
