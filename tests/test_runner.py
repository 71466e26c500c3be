"""The generated runner on converted checkpoints, in TPU interpret mode on virtual CPU devices.

Tiny transformers checkpoints (tests/fixtures/hf), re-published as the hub does (BF16
shards, an index, a tokenizer), are built for tpu7x:1x1x1 (2 cores), converted with
`mkgen convert --build`, and generated from with the build's runner.py (XLA prefill, then
the kernel): for every supported family the greedy tokens are the reference model's and
transformers' own; a batch of prompts of different lengths over recurrent state;
speculative decoding with the prompt-lookup drafter returns exactly the plain greedy
tokens and reports its acceptance length; weights converted for another layout are
refused. The sampling rules are checked on the runner library's own functions
(mkgen.runtime) without a kernel; its option errors are one line each, before any work.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cli_run import assert_user_error, mkgen, mkgen_here
from fixture_builds import TOPOLOGY, make_fixture_build
from test_convert import FIXTURES, write_sharded

from mkgen.cli import main
from mkgen.codegen.naming import GENERATED
from mkgen.codegen.package import render_build
from mkgen.errors import MkgenError
from mkgen.plan.options import BuildOptions
from mkgen.runtime.main import Streamer
from mkgen.runtime.sampling import Sampler
from mkgen.runtime.speculation import accept, prompt_lookup
from mkgen.spec.loader import load_spec
from mkgen.spec.topology import parse_topology

PROMPT = [3, 17, 42, 99, 5, 64, 127, 23, 88, 11, 70, 36]  # the fixtures' prompt
CHAT = Path(__file__).parent / "fixtures" / "chat"  # a tokenizer_config.json with a template


def _build(tmp: Path, folder: str, **options) -> Path:
    """A build of the test's own (the shared_build fixture holds the common ones)."""
    return make_fixture_build(tmp / f"{folder}-build", folder, **options)


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
    """The --json object, which must be all of stdout (progress goes to stderr)."""
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(result.stdout.splitlines()) == 1, result.stdout
    return json.loads(result.stdout)


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
# the greedy ids under bf16 compute (scripts/make_hf_fixtures.py). Four tokens each; the
# deepseek_v3_noqlora fixture's reference is held to transformers in
# tests/test_reference_hf.py, and its kernel paths run in deepseek_v3 (DeepSeek's MoE,
# here) and kimi_linear (MLA without a q LoRA, below). qwen3_next's and kimi_linear's
# checkpoints, re-published and converted alike, are generated from by the tests below
# (test_a_batch_of_prompts_matches_the_reference at batch 2, and
# test_speculation_over_recurrent_layers_returns_the_plain_greedy_tokens at rows 3) and
# held to transformers' tokens there, which are the reference's on every fixture
# (tests/test_reference_hf.py): here they would only add a kernel compile and run each
# (the tokenizer's part is the same for every family).
HUB_STEPS = 4


@pytest.mark.slow
@pytest.mark.parametrize("folder", ["qwen3", "qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_hub_checkpoint_generates_the_reference_and_transformers_tokens(
    shared_build, tmp_path: Path, folder: str
) -> None:
    from mkgen.reference import model as reference
    from mkgen.reference.hf_weights import load_hf_checkpoint

    checkpoint = _with_tokenizer(write_sharded(FIXTURES / folder, tmp_path / "ckpt"))
    build = shared_build(folder)
    weights = _convert(checkpoint, build, tmp_path / "w")
    assert (weights / "tokenizer.json").read_bytes() == (checkpoint / "tokenizer.json").read_bytes()
    assert "tokenizer.json" in json.loads((weights / "layout.json").read_text())["files"]
    transformers = np.load(FIXTURES / folder / "expected.npz")["greedy_ids"].tolist()[:HUB_STEPS]
    spec, inventory = load_hf_checkpoint(checkpoint)
    ours = reference.generate(spec, inventory, np.array(PROMPT), HUB_STEPS).tolist()
    args = ["--weights", str(weights), "--prompt", _words(PROMPT), "--steps", str(HUB_STEPS),
            "--json"]  # fmt: skip
    out = _tokens(_run(build, *args))
    assert out["tokens"] == [ours] == [transformers]
    assert out["text"] == [_words(transformers)]
    assert "acceptance_length" not in out
    # 11 prompt tokens prefilled in XLA, then the last one and 3 generated tokens fed in
    # one device call of 4 kernel steps (up to --steps-per-call 8).
    assert out["calls"] == 1


@pytest.mark.slow
def test_a_batch_of_prompts_matches_the_reference(tmp_path: Path) -> None:
    """A batch of two prompts of different lengths over Gated DeltaNet state (the
    qwen3_next checkpoint re-published as the hub does): the XLA prefill takes the first 4
    tokens of each, the kernel the rest of the longer one while the shorter one generates;
    the greedy tokens are the reference model's, and the fixture prompt's transformers'."""
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
    transformers = np.load(FIXTURES / "qwen3_next" / "expected.npz")["greedy_ids"].tolist()
    assert out["tokens"][0] == transformers[:steps]


@pytest.mark.slow
def test_speculation_returns_the_plain_greedy_tokens(tmp_path: Path) -> None:
    """Rows of 3 (the last token and two prompt-lookup drafts): the tokens are exactly the
    greedy ones, and the repeating continuation (97 127 97 127 ...) is drafted and
    accepted. Sampling with top-k 1 through the rejection rule gives the same tokens (the
    prompt through the kernel this time, --prefill kernel, and through `mkgen run`); a stop
    id ends the sequence; --bench reports its medians."""
    build = _build(tmp_path, "qwen3", rows=3)
    weights = _convert(FIXTURES / "qwen3", build, tmp_path / "w")
    expected = np.load(FIXTURES / "qwen3" / "expected.npz")["greedy_ids"].tolist()
    base = ["--weights", str(weights), *_ids(PROMPT), "--json"]
    out = _tokens(_run(build, *base, "--steps", "8"))
    assert out["tokens"] == [expected]
    assert out["acceptance_length"] > 1.2  # measured 1.33: 8 tokens in 6 generating calls
    sampled = _tokens(
        mkgen("run", str(build), "--interpret", *base, "--steps", "8", "--temperature", "1.0",
              "--top-k", "1", "--seed", "3", "--stop-ids", "127", "--bench", "--warmup", "1",
              "--prefill", "kernel", "--trust-weights", timeout=600)
    )  # fmt: skip
    assert sampled["tokens"] == [expected[: expected.index(127) + 1]]
    bench = sampled["bench"]
    assert bench["ms_per_step"] > 0 and bench["tokens_per_s"] == bench["tokens_per_s_per_user"]


@pytest.mark.slow
def test_speculation_over_recurrent_layers_returns_the_plain_greedy_tokens(
    tmp_path: Path,
) -> None:
    """kimi_linear (MLA + KDA) with rows of 3, drafts verified three steps per device
    call: a rejected draft's row leaves no trace in the KDA conv tails and states (the
    last accepted row's snapshot is kept inside the loop), so the tokens are
    transformers' greedy ones."""
    build = _build(tmp_path, "kimi_linear", rows=3)
    weights = _convert(
        write_sharded(FIXTURES / "kimi_linear", tmp_path / "ckpt"), build, tmp_path / "w"
    )
    expected = np.load(FIXTURES / "kimi_linear" / "expected.npz")["greedy_ids"].tolist()
    args = ["--weights", str(weights), *_ids(PROMPT), "--steps", "8", "--steps-per-call", "3"]
    out = _tokens(_run(build, *args, "--json"))
    assert out["tokens"] == [expected]
    assert out["calls"] <= 3  # 8 tokens, 3 steps per call: the host drafter would take 8 calls


@pytest.mark.slow
def test_weights_for_another_layout_are_refused(shared_build, tmp_path: Path) -> None:
    build = shared_build("qwen3")
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


# The sampling tests' vocabulary (padding ids beyond it are left out): the rules do not
# depend on its size, and 512 made the device sampling tests 14 CPU s instead of 3.
VOCAB = 64


def test_prompt_lookup_matches_the_longest_suffix() -> None:
    assert prompt_lookup([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 2, ngram=3) == [9, 2]  # "1 2 3" -> 9, 2
    assert prompt_lookup([5, 6, 5], 3, ngram=3) == [6, 5, 5]  # padded with the last token
    assert prompt_lookup([4], 2, ngram=3) == [4, 4]
    assert prompt_lookup([1, 2], 0, ngram=3) == []
    assert prompt_lookup([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 2, ngram=1) == [7, 1]  # "3" only


def test_sampling_filters() -> None:
    logits = np.log(np.array([0.1, 0.4, 0.2, 0.3] + [1e-30] * (VOCAB - 4) + [5.0]))
    p = Sampler(1.0, 0, 1.0, VOCAB)(logits)
    assert p.shape == (VOCAB,)  # the padding id after the vocabulary is never drawn
    np.testing.assert_allclose(p[:4], [0.1, 0.4, 0.2, 0.3], rtol=1e-6)
    np.testing.assert_allclose(Sampler(1.0, 2, 1.0, VOCAB)(logits)[:4], [0, 4 / 7, 0, 3 / 7])
    np.testing.assert_allclose(Sampler(1.0, 0, 0.6, VOCAB)(logits)[:4], [0, 4 / 7, 0, 3 / 7])
    assert Sampler(1e-3, 0, 1.0, VOCAB)(logits)[1] == pytest.approx(1.0)


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(0.7, 0, 1.0), (1.0, 2, 1.0), (1.0, 0, 0.6), (1.5, 3, 0.8)])  # fmt: skip
def test_sampling_on_the_device_draws_what_the_host_sampler_gives(
    temperature: float, top_k: int, top_p: float
) -> None:
    """filtered_logits and draw (inside the jitted multi-step call) draw from the
    distribution Sampler gives on the host (4,000 draws, one seed each); a seed and
    position always give the same token, and the padding ids beyond the vocabulary are
    never drawn."""
    from mkgen.runtime.sampling import draw, filtered_logits

    logits = np.log(np.array([0.1, 0.4, 0.2, 0.3] + [1e-30] * (VOCAB - 4) + [5.0]))
    draws = 4000
    rows = np.tile(logits.astype(np.float32), (draws, 1))

    def sample(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
        def full(value, dtype):
            return np.full(draws, value, dtype)

        z = filtered_logits(
            rows, full(temperature, np.float32), full(top_k, np.int32), full(top_p, np.float32),
            VOCAB,
        )  # fmt: skip
        return np.asarray(draw(z, seeds.astype(np.uint32), positions.astype(np.int32)))

    seeds = np.arange(draws)
    tokens = sample(seeds, np.full(draws, 5))
    assert tokens.max() < VOCAB
    expected = Sampler(temperature, top_k, top_p, VOCAB)(logits)
    np.testing.assert_allclose(np.bincount(tokens, minlength=VOCAB) / draws, expected, atol=0.03)
    np.testing.assert_array_equal(sample(seeds, np.full(draws, 5)), tokens)
    assert (sample(seeds, np.full(draws, 6)) != tokens).any()  # the position is in the key


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    """Drafts from a point-mass drafter (always token 1, then 2) and from a drafter that
    samples its drafts from its own distribution q: either way the first two generated
    tokens are distributed as sampling without drafts gives them (p1 for the first token,
    p2 for the second after a first token 1)."""
    vocab, rows = VOCAB, 4
    p1, p2, q = np.zeros(vocab), np.zeros(vocab), np.zeros(vocab)
    p1[:3], p2[:3], q[:3] = [0.5, 0.3, 0.2], [0.1, 0.1, 0.8], [0.2, 0.6, 0.2]
    logits = np.full((rows, vocab), -1e9)
    logits[0, :3], logits[1, :3] = np.log(p1[:3]), np.log(p2[:3])
    logits[2, :3] = logits[3, :3] = 0.0  # later rows: uniform over 0..2
    draws = 40_000
    rng = np.random.default_rng(0)

    sampler = Sampler(1.0, 0, 1.0, vocab)
    for drafter_q in (None, q):
        first, second = np.zeros(3), np.zeros(3)
        for _ in range(draws):
            if drafter_q is None:
                ids, proposal = [1, 2, 0], [1, 2, 0]
            else:
                ids = rng.choice(3, size=3, p=q[:3]).tolist()
                proposal = (ids, [q, q, q])
            rows = np.array([7, *ids])  # one known token, then the drafts
            new, valid = accept(rows, None, logits, 1, proposal, sampler, rng)
            first[new[0]] += 1
            if new[0] == 1:
                second[new[1]] += 1
        np.testing.assert_allclose(first / draws, p1[:3], atol=0.01)
        np.testing.assert_allclose(second / second.sum(), p2[:3], atol=0.015)
    rows = np.array([7, 1, 2, 0])
    tokens = np.array([1, 2, 5, 6])  # greedy: the kernel's tokens after each row
    assert accept(rows, tokens, None, 1, [1, 2, 0], None, rng) == ([1, 2, 5], 3)


def test_prompt_lookup_on_the_device_drafts_what_the_host_drafter_does() -> None:
    """prompt_lookup_on_device, every sequence of a batch at once (zero-padded histories of
    several lengths, small vocabularies so that suffixes recur), gives prompt_lookup's
    drafts."""
    from mkgen.runtime.decode import history_array
    from mkgen.runtime.device_speculation import prompt_lookup_on_device

    rng = np.random.default_rng(0)
    histories = [[4], [5, 6, 5], [1, 2, 3, 9, 2, 3, 7, 1, 2, 3]]
    histories += [
        rng.integers(0, vocab, size=n).tolist() for vocab, n in [(3, 20), (2, 9), (5, 30)]
    ]
    lengths = np.array([len(h) for h in histories], np.int32)
    for ngram, count in [(3, 3), (1, 2), (4, 5)]:
        drafts = prompt_lookup_on_device(history_array(histories, 32), lengths, count, ngram)
        expected = [prompt_lookup(h, count, ngram) for h in histories]
        assert np.asarray(drafts).tolist() == expected, (ngram, count)


def test_acceptance_on_the_device_is_the_host_rule() -> None:
    """accept_on_device: greedy, the longest run of drafts equal to the kernel's tokens
    before them, as accept gives it; sampled (a point-mass drafter: token 1, then 2, then 0)
    the first two tokens are distributed as sampling without drafts gives them (p1, and p2
    after a first token 1), one seed per draw; one row and a temperature is plain sampling
    (draw)."""
    from mkgen.runtime.decode import SamplingParams
    from mkgen.runtime.device_speculation import accept_on_device
    from mkgen.runtime.sampling import draw, filtered_logits

    fed = np.array([[7, 1, 2, 0], [7, 3, 2, 0], [7, 1, 2, 6]], np.int32)
    greedy = np.array([[1, 2, 5, 6]] * 3, np.int32)
    logits = np.zeros((12, VOCAB), np.float32)
    greedy_params = SamplingParams.create([0.0] * 3, [0] * 3, [1.0] * 3, [0] * 3)
    new, accepted = accept_on_device(
        fed, greedy, logits, greedy_params, np.zeros(3, np.int32), VOCAB
    )
    for b in range(3):
        host_new, valid = accept(fed[b], greedy[b], None, 1, fed[b, 1:], None, None)
        assert np.asarray(new)[b, : int(accepted[b]) + 1].tolist() == host_new
        assert int(accepted[b]) + 1 == valid

    # 20,000 draws over a vocabulary of 8: 20,000 x 4 rows of softmax and sampling over
    # 512 ids were 16 of this test's 18 CPU seconds.
    draws, vocab = 20_000, 8
    p1, p2 = np.zeros(vocab), np.zeros(vocab)
    p1[:3], p2[:3] = [0.5, 0.3, 0.2], [0.1, 0.1, 0.8]
    one = np.full((4, vocab), -1e9, np.float32)
    one[0], one[1] = np.log(np.maximum(p1, 1e-30)), np.log(np.maximum(p2, 1e-30))
    one[2, :3] = one[3, :3] = 0.0
    sampled = SamplingParams.create([1.0] * draws, [0] * draws, [1.0] * draws, list(range(draws)))
    new, accepted = accept_on_device(
        np.tile([[7, 1, 2, 0]], (draws, 1)).astype(np.int32), np.zeros((draws, 4), np.int32),
        np.tile(one, (draws, 1)), sampled, np.full(draws, 5, np.int32), vocab,
    )  # fmt: skip
    new, accepted = np.asarray(new), np.asarray(accepted)
    first = np.bincount(new[:, 0], minlength=3)[:3] / draws
    np.testing.assert_allclose(first, p1[:3], atol=0.015)
    after_one = new[(new[:, 0] == 1) & (accepted >= 1), 1]
    np.testing.assert_allclose(
        np.bincount(after_one, minlength=3)[:3] / len(after_one), p2[:3], atol=0.02
    )
    plain = SamplingParams.create([1.0] * 3, [0] * 3, [1.0] * 3, [4, 5, 6])
    positions = np.array([3, 9, 11], np.int32)
    alone, _ = accept_on_device(fed[:, :1], greedy[:, :1], logits[:3], plain, positions, VOCAB)
    z = filtered_logits(logits[:3], plain.temperature, plain.top_k, plain.top_p, VOCAB)
    assert np.asarray(alone)[:, 0].tolist() == np.asarray(draw(z, plain.seed, positions)).tolist()


# ---------------------------------------------------------------- the runner's command line


@pytest.fixture(scope="module")
def shims(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """By rows (1 and 3): a directory holding only a build's runner.py (the qwen3 fixture,
    vocabulary 128, context 64). Without plan.json and megakernel.py beside it, any work
    past the options fails otherwise than with the one-line option error expected."""
    spec = load_spec(FIXTURES / "qwen3" / "config.json")
    out = {}
    for rows in (1, 3):
        options = BuildOptions.create(context=64, rows=rows)
        files = render_build(spec, parse_topology(TOPOLOGY), options, with_mini=False).files
        directory = tmp_path_factory.mktemp(f"rows-{rows}")
        (directory / "runner.py").write_text(files["runner.py"])
        out[rows] = directory
    return out


@pytest.mark.parametrize(
    ("rows", "args", "fragments"),
    [
        (
            1,
            ["--temperature", "nan"],
            ["--temperature: must be 0 (greedy) or a finite number >= 1e-05"],
        ),
        (1, ["--temperature", "inf"], ["--temperature: must be 0", "got inf"]),
        (1, ["--temperature", "-0.5"], ["--temperature: must be 0", "got -0.5"]),
        (1, ["--temperature", "1e-40"], ["--temperature: must be 0", "got 1e-40"]),
        (1, ["--temperature", "1e308"], ["--temperature: must be 0", "got 1e308"]),
        (1, ["--seed", "-1"], ["--seed: must be an integer in [0, 4294967295], got -1"]),
        (1, ["--seed", "4294967296"], ["--seed: must be an integer in [0, 4294967295]"]),
        (1, ["--stop-ids", "2,128"], ["--stop-ids: token id 128", "vocabulary [0, 128)"]),
        (1, ["--stop-ids", "-1"], ["--stop-ids: token id -1", "vocabulary [0, 128)"]),
        (1, ["--top-p", "0"], ["--top-p: must be in (0, 1], got 0"]),
        (1, ["--top-p", "1e-50"], ["--top-p: must be in (0, 1], got 1e-50"]),
        (1, ["--top-p", "1.01"], ["--top-p: must be in (0, 1], got 1.01"]),
        (1, ["--top-p", "nan"], ["--top-p: must be in (0, 1], got nan"]),
        (1, ["--top-k", "-1"], ["--top-k: must be an integer in [0, 128], got -1"]),
        (1, ["--top-k", "129"], ["--top-k: must be an integer in [0, 128], got 129"]),
        (1, ["--top-k", "1000000000000"], ["--top-k: must be an integer in [0, 128]"]),
        (1, ["--top-k", "1e12"], ["--top-k: expected an integer, got '1e12'"]),
        (1, ["--steps-per-call", "65"], ["--steps-per-call: must be an integer in [1, 64]"]),
        (3, ["--ngram", "1000000000000"], ["--ngram: must be an integer in [1, 64]"]),
        (1, ["--prompt", "t1 \udcff"], ["--prompt: character 3 is byte 0xff, which is not UTF-8"]),
        (1, ["--prompt-ids", "1,200,2"], ["--prompt-ids: token id 200", "vocabulary [0, 128)"]),
        (1, ["--prompt-ids", "1,two"], ["--prompt-ids: expected comma-separated integers"]),
        (1, ["--steps", "0"], ["--steps: must be an integer >= 1, got 0"]),
        (1, ["--steps", "61"], ["--steps:", "exceed the build's context of 64"]),
        (1, ["--drafter", "ngram"], ["--drafter: this build verifies no drafts (rows 1)"]),
        (1, ["--ngram", "2"], ["--ngram: this build verifies no drafts (rows 1)"]),
        (
            3,
            ["--drafter", "os:getcwd", "--steps-per-call", "4"],
            ["--steps-per-call: the os:getcwd drafter runs on the host, one step per call"],
        ),
        (1, ["--warmup", "3"], ["--warmup: only with --bench"]),
        (3, ["--drafter", "os:sep"], ["--drafter os:sep: not callable"]),
        (3, ["--drafter", "no_such_module:f"], ["--drafter no_such_module:f:", "no_such_module"]),
        (3, ["--drafter", "os:getcwd", "--ngram", "2"], ["--ngram: only the ngram drafter"]),
        (1, ["--random-weights", "-3"], ["--random-weights: must be an integer in [0, "]),
        (1, ["--trust-weights"], ["--trust-weights: only with --weights"]),
        (1, ["--process-id", "1"], ["--process-id: only with --multi-host"]),
        (1, ["--weights", "w"], ["--weights: not allowed with argument --random-weights"]),
        (1, ["--unknown"], ["unrecognized arguments: --unknown"]),
    ],
)
def test_a_refused_option_is_one_line_before_any_work(
    shims: dict[int, Path], rows: int, args: list[str], fragments: list[str]
) -> None:
    args = ["--random-weights", "0", *args] if "--random-weights" not in args else args
    # In this process: the refusal comes before any work (devices, JAX), so a fresh
    # process would only add its imports (36 cases, about 0.6 CPU s each).
    result = mkgen_here("run", str(shims[rows]), *args)
    assert_user_error(result, "mkgen run: error: ", *fragments)


@pytest.fixture(scope="module")
def tokenized_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The qwen3 fixture with a tokenizer.json and a tokenizer_config.json, converted for
    tpu7x:1x1x1 (the shims' build) with both tokenizer files. Tests change a copy."""
    checkpoint = tmp_path_factory.mktemp("tokenized") / "ckpt"
    shutil.copytree(FIXTURES / "qwen3", checkpoint)
    _with_tokenizer(checkpoint)
    shutil.copy(CHAT / "tokenizer_config.json", checkpoint)
    weights = checkpoint.parent / "w"
    main(["convert", "--checkpoint", str(checkpoint), "--topology", TOPOLOGY, "--context", "64",
          "-o", str(weights)])  # fmt: skip
    return weights


def test_run_and_serve_refuse_tokenizer_files_changed_since_the_conversion(
    shims: dict[int, Path], tokenized_weights: Path, tmp_path: Path
) -> None:
    """mkgen run loads tokenizer.json and mkgen serve also tokenizer_config.json from the
    weights directory: each must be what convert copied there (layout.json's sha256),
    before any other work; --trust-weights takes them as they are."""
    from mkgen.runtime.arguments import load_tokenizer

    weights = shutil.copytree(tokenized_weights, tmp_path / "w")
    tokenizer = weights / "tokenizer.json"
    original = tokenizer.read_bytes()
    tokenizer.write_bytes(original + b"\n")
    result = mkgen("run", str(shims[1]), "--weights", str(weights), "--prompt", "t1", timeout=120)
    assert_user_error(
        result, f"mkgen run: error: {tokenizer} was changed after the conversion",
        "re-run mkgen convert", "--trust-weights",
    )  # fmt: skip
    assert load_tokenizer(None, str(weights), verify=False).encode("t5").ids == [5]
    tokenizer.write_bytes(original)
    config = weights / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"content": "t2"', '"content": "t3"', 1))
    served = mkgen("serve", str(shims[1]), "--weights", str(weights), "--port", "0", timeout=120)
    assert_user_error(served, f"{config} was changed after the conversion")
    assert load_tokenizer(None, str(weights)).encode("t5").ids == [5]  # itself unchanged


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ("delete", "is missing (layout.json lists it); re-run mkgen convert"),
        ("unlist", "was added after the conversion (layout.json does not list it); move it "
                   "out, or put it in the checkpoint and re-run mkgen convert"),
    ],
)  # fmt: skip
def test_a_tokenizer_deleted_or_added_beside_the_weights_is_refused(
    tokenized_weights: Path, tmp_path: Path, change: str, fragment: str
) -> None:
    from mkgen.weights.convert import LAYOUT_FILE, TOKENIZER_FILE, tokenizer_file

    weights = shutil.copytree(tokenized_weights, tmp_path / "w")
    if change == "delete":
        (weights / TOKENIZER_FILE).unlink()
    else:  # as if converted from a checkpoint without one, and added by hand since
        layout = json.loads((weights / LAYOUT_FILE).read_text())
        del layout["files"][TOKENIZER_FILE]
        (weights / LAYOUT_FILE).write_text(json.dumps(layout))
    with pytest.raises(MkgenError, match=re.escape(f"{weights / TOKENIZER_FILE} {fragment}")):
        tokenizer_file(weights, TOKENIZER_FILE)
    trusted = tokenizer_file(weights, TOKENIZER_FILE, verify=False)
    assert trusted == (None if change == "delete" else weights / TOKENIZER_FILE)


def test_a_prompt_with_a_lone_surrogate_is_one_line(
    shims: dict[int, Path], capfd: pytest.CaptureFixture[str]
) -> None:
    """A surrogate no command line can carry (argv gives only U+DC80 to U+DCFF, for bytes
    that are not UTF-8), passed to the runner library's run."""
    with pytest.raises(SystemExit) as exit_:
        main(["run", str(shims[1]), "--random-weights", "0", "--prompt", "t1 \ud800 t2"])
    assert exit_.value.code == 2
    err = capfd.readouterr().err
    assert err == (
        "mkgen run: error: --prompt: character 3 is a lone surrogate U+D800; give the text in "
        "UTF-8\n"
    )


def test_the_runner_file_itself_prints_the_same_one_line_errors(
    shims: dict[int, Path], tmp_path: Path
) -> None:
    """runner.py run directly, from another directory, names itself in its errors and
    prints its help (which says where weights come from)."""
    command = [sys.executable, str(shims[1] / "runner.py")]
    run = subprocess.run(
        [*command, "--random-weights", "0", "--temperature", "nan"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert_user_error(
        run, "runner.py: error: --temperature: must be 0 (greedy) or a finite number >= 1e-05"
    )
    shown = subprocess.run(
        [*command, "--help"], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("usage: runner.py ")
    assert "--weights DIR" in shown.stdout and "--trust-weights" in shown.stdout


def test_mkgen_run_help_explains_build_and_passes_the_rest_to_the_runner(
    shims: dict[int, Path], capfd: pytest.CaptureFixture[str]
) -> None:
    for flag in ("--help", "-h"):
        result = mkgen("run", flag, timeout=120)
        assert result.returncode == 0, result.stderr
        assert "Usage: mkgen run [OPTIONS] BUILD [RUNNER_ARGS]" in result.stdout
        assert "build directory" in result.stdout and "mkgen run BUILD --help" in result.stdout
    with pytest.raises(SystemExit) as exit_:
        main(["run", str(shims[1]), "--help"])
    assert exit_.value.code == 0
    usage = capfd.readouterr().out
    # argparse wraps the usage line by the path's length: the program name ends in a space
    # or a line break.
    assert re.match(rf"usage: mkgen run {re.escape(str(shims[1]))}\s", usage), usage
    assert "--weights DIR" in usage


def test_mkgen_run_names_a_runner_from_another_mkgen(tmp_path: Path) -> None:
    (tmp_path / "runner.py").write_text("STEPS = 8  # a runner without a runtime Build\n")
    plan = {"build": {"rebuild": "mkgen build qwen3-32b --topology 2x2x1 --force"}}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    result = mkgen("run", str(tmp_path), "--help", timeout=120)
    assert_user_error(
        result, "was written by another mkgen", "rebuild it (mkgen build qwen3-32b --topology 2x2x1"
    )


def test_too_few_devices_is_the_one_line_shown(tmp_path: Path) -> None:
    """Without --interpret on a host without a TPU: JAX's TPU backend (libtpu) writes its
    start-up noise to stderr before falling back to the CPU; the user sees only the
    runner's line about the devices."""
    build = GENERATED / "qwen3-32b-2x2x1" / "mini"
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    result = subprocess.run(
        [sys.executable, str(build / "runner.py"), "--random-weights", "0"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**env, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "PYTHONDONTWRITEBYTECODE": "1"},
    )  # fmt: skip
    assert_user_error(result, "runner.py: error: this build needs 8 devices, JAX sees 1")
    assert "or pass --interpret" in result.stderr


def test_every_checked_in_runner_is_a_short_file_of_constants() -> None:
    runners = sorted(GENERATED.glob("*/runner.py")) + sorted(GENERATED.glob("*/mini/runner.py"))
    assert len(runners) >= 12
    for path in runners:
        text = path.read_text()
        assert len(text.splitlines()) < 80, path
        assert "from mkgen.runtime import Build, run" in text, path
        # No code of its own (a text search would also find "def" in the inputs hash).
        defined = [
            node
            for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        ]
        assert not defined, path


def test_streamed_text_prints_only_what_is_settled(capsys) -> None:
    """Text appears call by call; a character still missing its second byte (decoded as
    U+FFFD) waits for the call that completes it; without a tokenizer ids stream."""

    class Bytes:  # id 1 is the first byte of "é", id 2 its second; others: letters
        def decode(self, ids):
            text = "".join({1: "\ufffd", 2: ""}.get(i, chr(96 + i)) for i in ids)
            return text.replace("\ufffd", "é") if 2 in ids else text

    stream = Streamer(Bytes())
    for ids in ([3], [3, 4, 1], [3, 4, 1, 2, 5]):
        stream(ids)
        print("|", end="")
    assert capsys.readouterr().out == "c|d|ée|"
    ids_only = Streamer(None)
    ids_only([7, 8])
    ids_only([7, 8, 9])
    assert capsys.readouterr().out == "7 8 9"


@pytest.mark.slow
def test_bench_builds_and_times_one_runner_per_batch() -> None:
    """mkgen bench at batches 1 and 2 (the qwen3 fixture's spec, random weights, interpret
    mode): one row per batch with its medians, all tokens = batch x per user, and the
    plan's prediction beside them, with its calibrated regime (no refill held)."""
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
        batch, ms, per_user, total, predicted, calibrated = (
            int(row[0]),
            *map(float, (row[1], *row[3:])),
        )
        assert ms > 0 and calibrated >= predicted > 0
        assert total == pytest.approx(batch * per_user, abs=0.1 * batch)
    bad = subprocess.run(
        [sys.executable, "-m", "mkgen.cli", "bench", "qwen3-32b", "--topology", "2x2x1",
         "--batches", "1,x"], capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "--batches" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
