"""The generated runner on converted checkpoints, in TPU interpret mode on virtual CPU devices.

Tiny transformers checkpoints (tests/fixtures/hf), re-published as the hub does (BF16
shards, an index, a tokenizer), are built for tpu7x:1x1x1 (2 cores), converted with
`mkgen convert --build`, and generated from with the build's runner.py (XLA prefill, then
the kernel): for every supported family the greedy tokens are the reference model's and
transformers' own; a batch of prompts of different lengths over recurrent state;
speculative decoding with the prompt-lookup drafter returns exactly the plain greedy
tokens and reports its acceptance length; weights converted for another layout are
refused. The sampling rules are checked on the runner's own functions without a kernel.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_convert import FIXTURES, write_sharded

from mkgen.cli import main
from mkgen.codegen.package import make_build, render_build
from mkgen.plan.options import BuildOptions
from mkgen.spec.loader import load_spec
from mkgen.spec.topology import parse_topology

PROMPT = [3, 17, 42, 99, 5, 64, 127, 23, 88, 11, 70, 36]  # the fixtures' prompt
TOPOLOGY = "1x1x1"  # the fixtures' 4 heads split over 2 cores, not 8


def _build(tmp: Path, folder: str, **options) -> Path:
    directory = tmp / f"{folder}-build"
    spec = load_spec(FIXTURES / folder / "config.json")
    opts = BuildOptions.create(context=64, **options)
    make_build(spec, parse_topology(TOPOLOGY), opts, output=directory)
    return directory


def _convert(checkpoint: Path, build: Path, out: Path, *extra: str) -> Path:
    args = ["convert", "--checkpoint", str(checkpoint), "-o", str(out), *extra]
    if not extra:
        args += ["--build", str(build)]
    main(args)
    return out


def _run(build: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(build / "runner.py"), "--interpret", *args],
        capture_output=True, text=True, timeout=timeout, cwd=build,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )  # fmt: skip


def _tokens(result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _ids(prompt: list[int]) -> list[str]:
    return ["--prompt-ids", ",".join(map(str, prompt))]


def _with_tokenizer(checkpoint: Path) -> Path:
    """Add a word-level tokenizer.json (token tN = id N) to a checkpoint."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(checkpoint / "tokenizer.json"))
    return checkpoint


def _words(ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


# Every family the generator supports, from its transformers fixture re-published as the hub
# does (BF16 shards, an index, a tokenizer): convert copies the tokenizer, --prompt TEXT is
# tokenized with it, the prompt goes through the XLA prefill and the kernel, and the
# greedy tokens are both the reference model's on that checkpoint and transformers' own.
# The fixtures' weights are bf16-exact (BF16 shards lose nothing) and their seeds keep
# the greedy ids under bf16 compute (scripts/make_hf_fixtures.py).
@pytest.mark.slow
@pytest.mark.parametrize(
    "folder",
    ["qwen3", "qwen3_moe", "mixtral", "deepseek_v3", "deepseek_v3_noqlora", "qwen3_next",
     "kimi_linear", "gpt_oss"],
)  # fmt: skip
def test_hub_checkpoint_generates_the_reference_and_transformers_tokens(
    tmp_path: Path, folder: str
) -> None:
    from mkgen.reference import model as reference
    from mkgen.reference.hf_weights import load_hf_checkpoint

    checkpoint = _with_tokenizer(write_sharded(FIXTURES / folder, tmp_path / "ckpt"))
    build = _build(tmp_path, folder)
    weights = _convert(checkpoint, build, tmp_path / "w")
    assert (weights / "tokenizer.json").read_bytes() == (checkpoint / "tokenizer.json").read_bytes()
    assert "tokenizer.json" in json.loads((weights / "layout.json").read_text())["files"]
    transformers = np.load(FIXTURES / folder / "expected.npz")["greedy_ids"].tolist()
    spec, inventory = load_hf_checkpoint(checkpoint)
    ours = reference.generate(spec, inventory, np.array(PROMPT), len(transformers)).tolist()
    args = ["--weights", str(weights), "--prompt", _words(PROMPT), "--steps", "8", "--json"]
    out = _tokens(_run(build, *args))
    assert out["tokens"] == [ours] == [transformers]
    assert out["text"] == [_words(transformers)]
    assert "acceptance_length" not in out
    # 11 prompt tokens prefilled in XLA, then the last one and 7 generated tokens fed in
    # one device call of 8 kernel steps (--steps-per-call 8).
    assert out["calls"] == 1


@pytest.mark.slow
def test_a_batch_of_prompts_matches_the_reference(tmp_path: Path) -> None:
    """A batch of two prompts of different lengths over Gated DeltaNet state: the XLA
    prefill takes the first 4 tokens of each, the kernel the rest of the longer one while
    the shorter one generates; the greedy tokens are the reference model's."""
    from mkgen.reference import model as reference
    from mkgen.reference.hf_weights import load_hf_checkpoint

    checkpoint = write_sharded(FIXTURES / "qwen3_next", tmp_path / "ckpt")
    build = _build(tmp_path, "qwen3_next", batch=2)
    weights = _convert(checkpoint, build, tmp_path / "w")
    # The second prompt's greedy steps all lead by >= 0.2 in the reference's logits, so
    # bf16 cannot flip them ([9, 8, 7, 9, 8] has a 0.0096 tie at its sixth step).
    prompts, steps = [PROMPT, [1, 2, 3, 4, 5]], 4
    spec, inventory = load_hf_checkpoint(checkpoint)
    expected = [
        reference.generate(spec, inventory, np.array([p]), steps)[0].tolist() for p in prompts
    ]
    args = ["--weights", str(weights), "--steps", str(steps), "--json"]
    out = _tokens(_run(build, *args, *_ids(prompts[0]), *_ids(prompts[1])))
    assert out["tokens"] == expected


@pytest.mark.slow
def test_speculation_returns_the_plain_greedy_tokens(tmp_path: Path) -> None:
    """Rows of 3 (the last token and two prompt-lookup drafts): the tokens are exactly the
    greedy ones, and the repeating continuation (97 127 97 127 ...) is drafted and
    accepted. Sampling with top-k 1 through the rejection rule gives the same tokens (the
    prompt through the kernel this time, --prefill kernel); a stop id ends the sequence;
    --bench reports its medians."""
    build = _build(tmp_path, "qwen3", rows=3)
    weights = _convert(FIXTURES / "qwen3", build, tmp_path / "w")
    expected = np.load(FIXTURES / "qwen3" / "expected.npz")["greedy_ids"].tolist()
    base = ["--weights", str(weights), *_ids(PROMPT), "--json"]
    out = _tokens(_run(build, *base, "--steps", "8"))
    assert out["tokens"] == [expected]
    assert out["acceptance_length"] > 1.2  # measured 1.33: 8 tokens in 6 generating calls
    sampled = _tokens(
        _run(build, *base, "--steps", "8", "--temperature", "1.0", "--top-k", "1", "--seed", "3",
             "--stop-ids", "127", "--bench", "--warmup", "1", "--prefill", "kernel")
    )  # fmt: skip
    assert sampled["tokens"] == [expected[: expected.index(127) + 1]]
    bench = sampled["bench"]
    assert bench["ms_per_step"] > 0 and bench["tokens_per_s"] == bench["tokens_per_s_per_user"]


@pytest.mark.slow
def test_weights_for_another_layout_are_refused(tmp_path: Path) -> None:
    build = _build(tmp_path, "qwen3")
    other = _convert(
        FIXTURES / "qwen3", build, tmp_path / "w", "--topology", TOPOLOGY, "--quant",
        "attention=int8",
    )  # fmt: skip
    result = _run(build, "--weights", str(other), "--steps", "1", timeout=300)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "lays weights out differently" in lines[0], result.stderr
    assert "attention=int8" in lines[0] and "mkgen convert --build" in lines[0]
    missing = _run(build, "--weights", str(tmp_path / "nothing"), "--steps", "1", timeout=300)
    assert missing.returncode == 2 and "no layout.json" in missing.stderr


# ---------------------------------------------------------------- sampling, no kernel


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    """The rendered runner.py of a rows-4 build, imported as a module."""
    spec = load_spec(FIXTURES / "qwen3" / "config.json")
    options = BuildOptions.create(context=64, rows=4)
    files = render_build(spec, parse_topology(TOPOLOGY), options, with_mini=False).files
    path = tmp_path_factory.mktemp("runner") / "runner.py"
    path.write_text(files["runner.py"])
    module_spec = importlib.util.spec_from_file_location("runner_under_test", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def test_prompt_lookup_matches_the_longest_suffix(runner) -> None:
    assert runner.drafts([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 2) == [9, 2]  # "1 2 3" -> 9, 2
    assert runner.drafts([5, 6, 5], 3) == [6, 5, 5]  # padded with the last token
    assert runner.drafts([4], 2) == [4, 4]
    assert runner.drafts([1, 2], 0) == []


def test_sampling_filters(runner) -> None:
    logits = np.log(np.array([0.1, 0.4, 0.2, 0.3] + [1e-30] * (runner.VOCAB_USED - 4)))
    p = runner.distribution(logits, 1.0, 0, 1.0)
    np.testing.assert_allclose(p[:4], [0.1, 0.4, 0.2, 0.3], rtol=1e-6)
    np.testing.assert_allclose(runner.distribution(logits, 1.0, 2, 1.0)[:4], [0, 4 / 7, 0, 3 / 7])
    np.testing.assert_allclose(runner.distribution(logits, 1.0, 0, 0.6)[:4], [0, 4 / 7, 0, 3 / 7])
    assert runner.distribution(logits, 1e-3, 0, 1.0)[1] == pytest.approx(1.0)


def test_rejection_sampling_keeps_the_target_distribution(runner) -> None:
    """Drafts from a point-mass drafter (always token 1, then 2) and from a drafter that
    samples its drafts from its own distribution q: either way the first two generated
    tokens are distributed as sampling without drafts gives them (p1 for the first token,
    p2 for the second after a first token 1)."""
    vocab = runner.VOCAB_USED
    p1, p2, q = np.zeros(vocab), np.zeros(vocab), np.zeros(vocab)
    p1[:3], p2[:3], q[:3] = [0.5, 0.3, 0.2], [0.1, 0.1, 0.8], [0.2, 0.6, 0.2]
    logits = np.full((runner.ROWS, vocab), -1e9)
    logits[0, :3], logits[1, :3] = np.log(p1[:3]), np.log(p2[:3])
    logits[2, :3] = logits[3, :3] = 0.0  # later rows: uniform over 0..2
    draws = 40_000
    rng = np.random.default_rng(0)

    def sampler(row):
        return runner.distribution(row, 1.0, 0, 1.0)

    for drafter_q in (None, q):
        first, second = np.zeros(3), np.zeros(3)
        for _ in range(draws):
            if drafter_q is None:
                ids, proposal = [1, 2, 0], [1, 2, 0]
            else:
                ids = rng.choice(3, size=3, p=q[:3]).tolist()
                proposal = (ids, [q, q, q])
            rows = np.array([7, *ids])  # one known token, then the drafts
            new, valid = runner.accept(rows, None, logits, 1, proposal, sampler, rng)
            first[new[0]] += 1
            if new[0] == 1:
                second[new[1]] += 1
        np.testing.assert_allclose(first / draws, p1[:3], atol=0.01)
        np.testing.assert_allclose(second / second.sum(), p2[:3], atol=0.015)
    rows = np.array([7, 1, 2, 0])
    tokens = np.array([1, 2, 5, 6])  # greedy: the kernel's tokens after each row
    assert runner.accept(rows, tokens, None, 1, [1, 2, 0], None, rng) == ([1, 2, 5], 3)


def test_mkgen_run_passes_arguments_to_the_runner(tmp_path: Path, capfd) -> None:
    build = _build(tmp_path, "qwen3")
    with pytest.raises(SystemExit) as exit_:
        main(["run", str(build), "--help"])
    assert exit_.value.code == 0
    assert "--weights DIR" in capfd.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(["run", str(build), "--weights", str(tmp_path / "none"), "--random-weights", "0"])
    assert exit_.value.code == 2  # argparse: the two weight sources exclude each other
    assert "not allowed with argument" in capfd.readouterr().err


def test_streamed_text_prints_only_what_is_settled(runner, capsys) -> None:
    """Text appears call by call; a character still missing its second byte (decoded as
    U+FFFD) waits for the call that completes it; without a tokenizer ids stream."""

    class Bytes:  # id 1 is the first byte of "é", id 2 its second; others: letters
        def decode(self, ids):
            text = "".join({1: "\ufffd", 2: ""}.get(i, chr(96 + i)) for i in ids)
            return text.replace("\ufffd", "é") if 2 in ids else text

    stream = runner.Streamer(Bytes())
    for ids in ([3], [3, 4, 1], [3, 4, 1, 2, 5]):
        stream(ids)
        print("|", end="")
    assert capsys.readouterr().out == "c|d|ée|"
    ids_only = runner.Streamer(None)
    ids_only([7, 8])
    ids_only([7, 8, 9])
    assert capsys.readouterr().out == "7 8 9"


@pytest.mark.slow
def test_bench_builds_and_times_one_runner_per_batch() -> None:
    """mkgen bench at batches 1 and 2 (the qwen3 fixture's spec, random weights, interpret
    mode): one row per batch with its medians, all tokens = batch x per user, and the
    plan's prediction beside them."""
    args = [
        "bench", str(FIXTURES / "qwen3" / "config.json"), "--topology", TOPOLOGY,
        "--batches", "1,2", "--context", "64", "--interpret", "--random-weights", "0",
        "--prompt-ids", "1,2,3", "--steps", "2", "--warmup", "1",
    ]  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "mkgen.cli", *args], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0].split()[:2] == ["batch", "ms/step"]
    table = [line.replace("(", " ").replace(")", " ").split() for line in lines[1:]]
    assert [row[0] for row in table] == ["1", "2"]
    for row in table:
        batch, ms, per_user, total, predicted = int(row[0]), *map(float, (row[1], *row[3:]))
        assert ms > 0 and predicted > 0
        assert total == pytest.approx(batch * per_user, abs=0.1 * batch)
    bad = subprocess.run(
        [sys.executable, "-m", "mkgen.cli", "bench", "qwen3-32b", "--topology", "2x2x1",
         "--batches", "1,x"], capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "--batches" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
