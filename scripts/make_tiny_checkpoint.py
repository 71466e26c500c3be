"""Make examples/tiny-qwen3/: a tiny random Qwen3 checkpoint with a tokenizer and a chat
template, for the README's CPU walkthrough (convert, run, serve).

The model is the architecture of the qwen3 transformers fixture (tests/fixtures/hf/qwen3:
2 layers, hidden 64, GQA 4q/2kv heads of 32, q/k RMSNorm, untied lm_head, vocabulary
128) with weights drawn here from a seeded numpy generator, as that fixture's were redrawn
(linear weights N(0, 1/fan_in), embeddings N(0, 1), RMSNorm weights 1 + 0.1 N(0, 1)), then
rounded to the nearest bfloat16 and stored as float32 (lossless in bf16, as hub
checkpoints are bf16). The weights are random: the model writes gibberish; the walkthrough
shows the plumbing, not a language model.

The tokenizer is a byte-pair encoding learned (Hugging Face `tokenizers`) on TRAINING_TEXT
below, lower-cased, with a metaspace word marker, sized to the config's vocabulary: 3
ChatML special tokens, `<unk>` for characters it never saw, the characters of the text
and merges up to 128 ids. tokenizer_config.json carries a ChatML chat template (Qwen's
shape: `<|im_start|>role ... <|im_end|>`), with `<|im_end|>` as the eos token.

Only the project's own dependencies are used (numpy, ml_dtypes, safetensors, tokenizers),
and the output is byte-identical from run to run (`--check` says whether the files in the
repository are what this script writes). Run from anywhere:

    python scripts/make_tiny_checkpoint.py [--out examples/tiny-qwen3] [--check]

`--leads TEXT... [--chat MESSAGE...]` prints the reference model's greedy ids for the
given prompts (and user messages through the chat template) and how far each chosen id
leads the runner-up: the README walkthrough's prompts lead by at least MIN_LEAD, so its
output cannot change with the CPU it runs on (tests/test_docs.py holds them to it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "examples" / "tiny-qwen3"
SEED = 0
MIN_LEAD = 0.01  # the transformers fixtures' margin (tests/fixtures/hf/README.md)
VOCAB = 128
HIDDEN, INTERMEDIATE, LAYERS = 64, 96, 2
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
TRAINING_TEXT = """\
The cat sat on the mat. The dog sat on the log. A bird sang in the tree, and the
sun rose over the hills. We read a book, we wrote a letter, and we went to the sea.
What is the weather like today? It is warm and bright, with a light wind from the west.
Hello, how are you? I am fine, thank you. Tell me a story about a small model that
runs on a laptop: it speaks in riddles, because its weights are random numbers.
The user asked the assistant a question, and the assistant gave an answer.
"""
# Characters the BPE knows even where TRAINING_TEXT lacks them (the rest are <unk>); a
# newline, because the chat template puts one after each role.
ALPHABET = list("abcdefghijklmnopqrstuvwxyz0123456789.,:;!?'\"-()\n")
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def config() -> dict:
    """The qwen3 fixture's Hugging Face config, with this tokenizer's eos id."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": SPECIAL_TOKENS.index("<|im_end|>"),
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "max_position_embeddings": 32768,
        "model_type": "qwen3",
        "num_attention_heads": HEADS,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": KV_HEADS,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_sliding_window": False,
        "vocab_size": VOCAB,
    }


def weights(seed: int) -> dict[str, np.ndarray]:
    """Random Qwen3 weights in the hub's tensor names and shapes, bf16-exact float32."""
    rng = np.random.default_rng(seed)

    def linear(rows: int, fan_in: int) -> np.ndarray:
        return rng.normal(0.0, fan_in**-0.5, (rows, fan_in))

    def norm(size: int) -> np.ndarray:
        return 1.0 + 0.1 * rng.normal(size=size)

    tensors = {"model.embed_tokens.weight": rng.normal(size=(VOCAB, HIDDEN))}
    for i in range(LAYERS):
        layer = f"model.layers.{i}"
        tensors |= {
            f"{layer}.input_layernorm.weight": norm(HIDDEN),
            f"{layer}.self_attn.q_proj.weight": linear(HEADS * HEAD_DIM, HIDDEN),
            f"{layer}.self_attn.k_proj.weight": linear(KV_HEADS * HEAD_DIM, HIDDEN),
            f"{layer}.self_attn.v_proj.weight": linear(KV_HEADS * HEAD_DIM, HIDDEN),
            f"{layer}.self_attn.o_proj.weight": linear(HIDDEN, HEADS * HEAD_DIM),
            f"{layer}.self_attn.q_norm.weight": norm(HEAD_DIM),
            f"{layer}.self_attn.k_norm.weight": norm(HEAD_DIM),
            f"{layer}.post_attention_layernorm.weight": norm(HIDDEN),
            f"{layer}.mlp.gate_proj.weight": linear(INTERMEDIATE, HIDDEN),
            f"{layer}.mlp.up_proj.weight": linear(INTERMEDIATE, HIDDEN),
            f"{layer}.mlp.down_proj.weight": linear(HIDDEN, INTERMEDIATE),
        }
    tensors["model.norm.weight"] = norm(HIDDEN)
    tensors["lm_head.weight"] = linear(VOCAB, HIDDEN)
    return {
        name: value.astype(ml_dtypes.bfloat16).astype(np.float32) for name, value in tensors.items()
    }


def tokenizer() -> Tokenizer:
    """A BPE of exactly VOCAB ids learned on TRAINING_TEXT (special tokens first)."""
    made = Tokenizer(models.BPE(unk_token="<unk>"))
    made.normalizer = normalizers.Lowercase()
    made.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    made.decoder = decoders.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=ALPHABET,
        show_progress=False,
    )
    made.train_from_iterator(TRAINING_TEXT.splitlines(), trainer)
    if made.get_vocab_size() != VOCAB:
        raise SystemExit(
            f"the tokenizer learned {made.get_vocab_size()} ids, the config says {VOCAB}: "
            "lengthen TRAINING_TEXT"
        )
    return made


def tokenizer_config() -> dict:
    """The special tokens and the chat template, as transformers saves them."""
    return {
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<unk>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 64,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def write(out: Path) -> None:
    """Every file of the checkpoint into `out` (created if needed)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config(), indent=2) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    tokenizer().save(str(out / "tokenizer.json"))
    save_file(weights(SEED), str(out / "model.safetensors"), metadata={"format": "pt"})


def chat_prompt(checkpoint: Path, message: str) -> str:
    """The prompt text `mkgen serve` makes of one user message (the chat template)."""
    from mkgen.serve.chat import load_tokenizer_config

    template, _ = load_tokenizer_config(checkpoint / "tokenizer_config.json")
    assert template is not None
    return template.render([{"role": "user", "content": message}])


def greedy_leads(checkpoint: Path, texts: list[str], steps: int) -> list[tuple[list[int], float]]:
    """Per prompt text, the plain-JAX reference model's `steps` greedy ids and the least
    lead of a chosen id over the runner-up in the logits: rounding in another CPU's
    float32, or the kernel's bf16, cannot flip a token that leads by far more. The prompts
    run as one batch padded at the end (causal: the padding changes no earlier logit), so
    the forward compiles once."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from mkgen.reference import model as reference
    from mkgen.reference.hf_weights import load_hf_checkpoint

    spec, inventory = load_hf_checkpoint(checkpoint)
    encode = Tokenizer.from_file(str(checkpoint / "tokenizer.json")).encode
    prompts = [encode(text).ids for text in texts]
    lengths = np.array([len(prompt) for prompt in prompts])
    tokens = np.zeros((len(prompts), lengths.max() + steps), np.int32)
    for row, prompt in zip(tokens, prompts, strict=True):
        row[: len(prompt)] = prompt
    rows = np.arange(len(prompts))
    leads = np.full(len(prompts), np.inf)
    for _ in range(steps):
        cache = reference.init_cache(spec, *tokens.shape)
        logits, _ = reference.compile_forward(spec)(inventory, tokens, cache)
        last = np.asarray(logits)[rows, lengths - 1]
        top2 = np.sort(last, axis=-1)[:, -2:]
        leads = np.minimum(leads, top2[:, 1] - top2[:, 0])
        tokens[rows, lengths] = last.argmax(axis=-1)
        lengths += 1
    return [
        (row[length - steps : length].tolist(), float(lead))
        for row, length, lead in zip(tokens, lengths, leads, strict=True)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help="Checkpoint directory.")
    parser.add_argument(
        "--check", action="store_true", help="Exit 1 if --out differs from what is written."
    )
    parser.add_argument(
        "--leads", nargs="*", metavar="TEXT", help="Print the greedy ids of these prompts "
        "(no files written) and how far each step's id leads the runner-up.",
    )  # fmt: skip
    parser.add_argument(
        "--chat", nargs="*", default=[], metavar="MESSAGE",
        help="With --leads: user messages, rendered with the chat template.",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=8, help="Greedy steps for --leads.")
    args = parser.parse_args()
    if args.leads is not None:
        texts = [*args.leads, *(chat_prompt(args.out, message) for message in args.chat)]
        for text, (ids, lead) in zip(texts, greedy_leads(args.out, texts, args.steps), strict=True):
            print(f"{text!r}: {ids}, least lead {lead:.4f}")
        return
    if not args.check:
        write(args.out)
        print(f"wrote {args.out}")
        return
    with tempfile.TemporaryDirectory() as fresh:
        write(Path(fresh))
        stale = [p.name for p in sorted(Path(fresh).iterdir())
                 if not (args.out / p.name).is_file()
                 or (args.out / p.name).read_bytes() != p.read_bytes()]  # fmt: skip
    print(f"stale: {', '.join(stale)}" if stale else f"{args.out} is current")
    sys.exit(1 if stale else 0)


if __name__ == "__main__":
    main()
