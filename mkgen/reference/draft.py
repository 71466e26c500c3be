"""The plain-JAX reference of the drafters (mkgen.spec.draft) and the greedy accept rule.

One step of drafting, whatever the kind (`draft_step`): the target has just run a verify
(or the prefill) over `tokens` [B, n], at positions start..start+n-1 where start is what
the drafter has committed (`state["length"]`), and accepted them all; `hidden`
[layers, B, n, hidden] is the target's residual stream after every layer there
(forward_traced), and `next_token` [B] is the token the target chose after them (the
bonus), the first row of the next verify. The drafter proposes the rows - 1 tokens that
follow `next_token` and keeps its caches for the next step: everything it wrote at
positions >= start + n is speculative and is overwritten then, which is the roll-back.

- mtp (as vLLM's deepseek_mtp.py and qwen3_next_mtp.py run it): entry i pairs the
  target's final-normed hidden state at position i with the embedding of token i + 1
  (zeroed at position 0 when `mask_first_embedding`): enorm(embedding) and
  hnorm(hidden), concatenated, eh_proj, one decoder layer (its own KV cache, positions
  as the target's), its final norm, the target's LM head. Draft 1 comes from the last
  entry; draft j + 1 from an entry at the next position pairing draft j with the
  layer's output for draft j (before the final norm, or after it when `chain` is
  normed): rows - 2 more single-position passes.
- block (DFlash, z-lab/dflash dflash/model.py): the target's hidden states at
  `feature_layers` (transformers' hidden_states[layer + 1]: the last layer's is
  final-normed), concatenated, projected (fc) and RMS-normed (hidden_norm) are the
  context; each layer's keys and values are its k/v projections of the context (cached
  per position, committed) followed by those of the block; the block is `next_token` and
  block_size - 1 mask tokens embedded with the target's table, attending non-causally
  over the whole context and block in one pass; positions 1.. of the block, final-normed,
  through the LM head, are the drafts.
- model: the small model's greedy continuation of the committed tokens and `next_token`.

Greedy choices take the lowest index on ties (jnp.argmax) over the used vocabulary.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mkgen.errors import SpecError
from mkgen.reference.attention import gqa_attend, gqa_project, store
from mkgen.reference.ffn import dense_ffn
from mkgen.reference.layers import mm, rms_norm
from mkgen.reference.model import (
    Cache,
    Weights,
    compile_forward,
    decoder_layer,
    forward_traced,
    greedy_token,
    head_logits,
    init_cache,
    init_kind_cache,
    init_tensor,
    init_weights,
    jit_once,
    layer_weights,
    tensor_key,
)
from mkgen.spec.draft import draft_weights
from mkgen.spec.schema import (
    BlockDraft,
    Dims,
    GatedDeltaNetAttention,
    KDAAttention,
    ModelDraft,
    ModelSpec,
    MtpDraft,
)

# state: {"length": committed positions, "layers": [per-layer cache]}
DraftState = dict[str, Any]
# (drafts [B, rows - 1], target tokens of the verify [B, rows]) -> (accepted drafts [B],
# bonus tokens [B]): the rule `speculative_generate` applies.
AcceptRule = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


# ---------------------------------------------------------------- weights and state


def init_draft_weights(spec: ModelSpec, seed: int = 0) -> dict[str, jax.Array]:
    """Random f32 drafter tensors (`draft.*`, mkgen.spec.draft.draft_weights) by the
    reference model's scheme; a block drafter's norms are plain whatever the target's
    style (DFlash's layers are Qwen3's); `draft.d2t` maps draft ids onto a random sorted
    subset of the target's vocabulary."""
    draft = spec.draft
    if isinstance(draft, ModelDraft):
        return {f"draft.{k}": v for k, v in init_weights(draft.model, seed).items()}
    style = "plain" if isinstance(draft, BlockDraft) else spec.dims.norm_style
    styled = spec.model_copy(update={"dims": spec.dims.model_copy(update={"norm_style": style})})
    out = {}
    for w in draft_weights(spec):
        key = tensor_key(seed, w.name)
        if w.name == "draft.d2t":
            chosen = np.sort(np.asarray(jax.random.permutation(key, spec.dims.vocab)[: w.shape[0]]))
            out[w.name] = jnp.asarray(chosen - np.arange(w.shape[0]), jnp.int32)
        else:
            out[w.name] = jnp.asarray(init_tensor(styled, w, key), jnp.float32)
    return out


def init_draft_state(spec: ModelSpec, batch: int, max_len: int) -> DraftState:
    """The drafter's empty caches for `batch` sequences of up to `max_len` positions
    (drafts included): mtp one cache per module, block one GQA cache per layer holding
    the context's keys and values, model the small model's cache."""
    draft = spec.draft
    if isinstance(draft, ModelDraft):
        return init_cache(draft.model, batch, max_len)
    if isinstance(draft, MtpDraft):
        kind = spec.attention_kinds[draft.attention]
        layers = [init_kind_cache(kind, batch, max_len) for _ in range(draft.layers)]
    else:
        assert isinstance(draft, BlockDraft), "the spec has no draft section"
        layers = [init_kind_cache(draft.attention, batch, max_len) for _ in range(draft.layers)]
    return {"length": jnp.zeros((), jnp.int32), "layers": layers}


# ---------------------------------------------------------------- one drafting step


def draft_step(
    spec: ModelSpec,
    weights: Weights,
    state: DraftState,
    tokens: jax.Array,
    hidden: jax.Array,
    next_token: jax.Array,
    rows: int,
) -> tuple[jax.Array, jax.Array, DraftState]:
    """Draft tokens [B, rows - 1] after `next_token`, their logits [B, rows - 1, vocab]
    (the target's vocabulary; a reduced draft vocabulary's logits are its own) and the
    next state (module docstring). `weights` holds the target's tensors and `draft.*`."""
    if rows < 2:
        raise ValueError(f"rows {rows}: drafting needs at least 2 rows")
    draft = spec.draft
    tokens, next_token = jnp.asarray(tokens, jnp.int32), jnp.asarray(next_token, jnp.int32)
    if isinstance(draft, MtpDraft):
        return _mtp_step(spec, draft, weights, state, tokens, hidden, next_token, rows)
    if isinstance(draft, BlockDraft):
        if rows > draft.block_size:
            raise ValueError(
                f"rows {rows} exceed the block drafter's block_size {draft.block_size}"
            )
        return _block_step(spec, draft, weights, state, tokens, hidden, next_token, rows)
    assert isinstance(draft, ModelDraft), "the spec has no draft section"
    return _model_step(
        draft.model, layer_weights(weights, "draft."), state, tokens, next_token, rows
    )


def _mtp_step(
    spec: ModelSpec,
    draft: MtpDraft,
    weights: Weights,
    state: DraftState,
    tokens: jax.Array,
    hidden: jax.Array,
    next_token: jax.Array,
    rows: int,
) -> tuple[jax.Array, jax.Array, DraftState]:
    if draft.layers != 1:
        raise ValueError(
            f"the reference drafts with one MTP module; this spec has {draft.layers} (vLLM "
            "and SGLang run module j % layers at draft j; not modelled yet)"
        )
    start, entry = state["length"], _compile_mtp_entry(spec)
    last_hidden = target_hidden(spec, weights, hidden, spec.layers.count - 1)
    following = jnp.concatenate([tokens[:, 1:], next_token[:, None]], axis=1)
    logits, out, cache = entry(weights, state["layers"][0], following, last_hidden, start)
    drafts, all_logits = [], []
    at = start + tokens.shape[1]
    for j in range(rows - 1):
        drafts.append(greedy_token(spec, logits))
        all_logits.append(logits)
        if j + 1 < rows - 1:
            logits, out, cache = entry(weights, cache, drafts[-1][:, None], out, at + j)
    state = {"length": at, "layers": [cache]}
    return jnp.stack(drafts, axis=1), jnp.stack(all_logits, axis=1), state


def _mtp_entry(
    spec: ModelSpec,
    weights: Weights,
    cache: dict[str, jax.Array],
    token_ids: jax.Array,
    previous: jax.Array,
    at: jax.Array,
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """MTP entries at positions at.. pairing token_ids [B, n] with the previous hidden
    states [B, n, hidden]: the last entry's logits [B, vocab], what the next draft chains
    on [B, 1, hidden] (the output before or after the module's final norm) and the cache."""
    out, cache = mtp_layer(spec, weights, cache, token_ids, previous, at)
    logits, chained = mtp_head(spec, weights, out[:, -1:])
    return logits, chained, cache


def mtp_layer(
    spec: ModelSpec,
    weights: Weights,
    cache: dict[str, jax.Array],
    token_ids: jax.Array,
    previous: jax.Array,
    at: jax.Array,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The MTP module's layer over entries at positions at.. pairing token_ids [B, n] with
    the previous hidden states [B, n, hidden] (final-normed target states, or a chained
    output): every entry's output [B, n, hidden] before the final norm, and the cache."""
    draft = spec.draft
    assert isinstance(draft, MtpDraft)
    dims, w = spec.dims, layer_weights(weights, "draft.0.")
    zero_centered = dims.norm_style == "zero_centered"
    positions = at + jnp.arange(token_ids.shape[1])
    embedded = jnp.asarray(weights["embedding"], jnp.float32)[token_ids]
    if draft.mask_first_embedding:  # vLLM's deepseek_mtp.py: "not needed by MTP"
        embedded = jnp.where((positions == 0)[None, :, None], 0.0, embedded)
    joined = jnp.concatenate(
        [
            rms_norm(embedded, w["enorm"], dims.norm_eps, zero_centered),
            rms_norm(previous, w["hnorm"], dims.norm_eps, zero_centered),
        ],
        axis=-1,
    )
    attention, ffn = spec.attention_kinds[draft.attention], spec.ffn_kinds[draft.ffn]
    return decoder_layer(attention, ffn, w, mm(joined, w["eh_proj"]), cache, at, dims)


def mtp_head(spec: ModelSpec, weights: Weights, out: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One entry's output [B, 1, hidden] (mtp_layer) as its logits [B, vocab] and what the
    next draft chains on [B, 1, hidden]."""
    draft = spec.draft
    assert isinstance(draft, MtpDraft)
    dims, w = spec.dims, layer_weights(weights, "draft.0.")
    normed = rms_norm(out, w["final_norm"], dims.norm_eps, dims.norm_style == "zero_centered")
    chained = normed if draft.chain == "normed" else out
    return head_logits(dims, weights, normed[:, 0]), chained


def _compile_mtp_entry(spec: ModelSpec) -> Callable[..., Any]:
    """jax.jit of _mtp_entry for one spec (a chain reuses the one-entry compilation)."""
    return jit_once(_COMPILED, (spec.model_dump_json(), "mtp"), functools.partial(_mtp_entry, spec))


def _block_step(
    spec: ModelSpec,
    draft: BlockDraft,
    weights: Weights,
    state: DraftState,
    tokens: jax.Array,
    hidden: jax.Array,
    next_token: jax.Array,
    rows: int,
) -> tuple[jax.Array, jax.Array, DraftState]:
    start, n = state["length"], tokens.shape[1]
    features = jnp.concatenate(
        [target_hidden(spec, weights, hidden, i) for i in draft.feature_layers], -1
    )
    caches = block_context(draft, weights, state["layers"], features, start)
    drafts, logits = block_drafts(spec, draft, weights, caches, next_token, start + n, rows)
    return drafts, logits, {"length": start + n, "layers": caches}


def block_context(
    draft: BlockDraft, weights: Weights, caches: list[Any], features: jax.Array, start: jax.Array
) -> list[Any]:
    """The block drafter's caches with the context of features [B, n, len(feature_layers)
    x hidden] (the target's states at its feature layers, concatenated) at positions
    start..start + n - 1: fc, hidden_norm, then every layer's k/v projections of it."""
    dims = Dims(hidden=draft.hidden, vocab=1, norm_eps=draft.norm_eps)
    context = rms_norm(
        mm(features, weights["draft.fc"]), weights["draft.hidden_norm"], dims.norm_eps
    )
    positions = start + jnp.arange(features.shape[1])
    out = []
    for i, cache in enumerate(caches):
        w_attn = layer_weights(weights, f"draft.layers.{i}.attn.")
        _, k, v = gqa_project(draft.attention, w_attn, context, positions, dims)
        out.append({"k": store(cache["k"], k, start), "v": store(cache["v"], v, start)})
    return out


def block_drafts(
    spec: ModelSpec,
    draft: BlockDraft,
    weights: Weights,
    caches: list[Any],
    next_token: jax.Array,
    at: jax.Array,
    rows: int,
) -> tuple[jax.Array, jax.Array]:
    """The block drafter's rows - 1 drafts [B, rows - 1] after next_token [B] at position
    `at` (the context committed before it), and their logits: one non-causal pass over
    the block (next_token, then mask tokens) attending to the committed context."""
    dims = Dims(hidden=spec.dims.hidden, vocab=spec.dims.vocab, norm_eps=draft.norm_eps)
    eps = draft.norm_eps
    block = jnp.concatenate(
        [
            next_token[:, None],
            jnp.full((next_token.shape[0], draft.block_size - 1), draft.mask_token),
        ],
        axis=1,
    )
    x = jnp.asarray(weights["embedding"], jnp.float32)[block]
    block_positions = at + jnp.arange(draft.block_size)
    for i, cache in enumerate(caches):
        w = layer_weights(weights, f"draft.layers.{i}.")
        w_attn = layer_weights(w, "attn.")
        normed = rms_norm(x, w["attn_norm"], eps)
        q, k_block, v_block = gqa_project(draft.attention, w_attn, normed, block_positions, dims)
        keys = jnp.concatenate([cache["k"].astype(jnp.float32), k_block], axis=1)
        values = jnp.concatenate([cache["v"].astype(jnp.float32), v_block], axis=1)
        # Every block row sees the committed context and the whole block (non-causal).
        committed = jnp.arange(cache["k"].shape[1]) < at
        visible = jnp.concatenate([committed, jnp.ones(draft.block_size, bool)])[None, :]
        x = x + gqa_attend(draft.attention, w_attn, normed, q, keys, values, visible)
        x = x + dense_ffn(draft.ffn, layer_weights(w, "ffn."), rms_norm(x, w["ffn_norm"], eps))
    out = rms_norm(x[:, 1:rows], weights["draft.final_norm"], eps)
    if draft.lm_head == "shared":
        logits = mm(out, weights["embedding"].T if spec.dims.tie_embeddings else weights["lm_head"])
        return greedy_token(spec, logits), logits
    logits = mm(out, weights["draft.lm_head"])
    drafts = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if draft.draft_vocab is not None:
        drafts = drafts + weights["draft.d2t"][drafts]
    return drafts, logits


def target_hidden(spec: ModelSpec, weights: Weights, hidden: jax.Array, layer: int) -> jax.Array:
    """Target layer `layer`'s output as a drafter reads it (transformers' hidden_states[layer
    + 1]): the residual stream after the layer (`hidden`: forward_traced's, [layers, ...]),
    final-normed for the last layer (what vLLM hands an MTP module)."""
    if layer < spec.layers.count - 1:
        return hidden[layer]
    zero_centered = spec.dims.norm_style == "zero_centered"
    return rms_norm(hidden[layer], weights["final_norm"], spec.dims.norm_eps, zero_centered)


def _model_step(
    model: ModelSpec,
    weights: Weights,
    cache: Cache,
    tokens: jax.Array,
    next_token: jax.Array,
    rows: int,
) -> tuple[jax.Array, jax.Array, Cache]:
    # The committed tokens first: that cache is the state, since recurrent layers cannot
    # drop the drafted positions afterwards.
    _, committed = compile_forward(model)(weights, tokens, cache)
    drafts, logits = model_drafts(model, weights, committed, next_token, rows)
    return drafts, logits, committed


def model_drafts(
    model: ModelSpec, weights: Weights, cache: Cache, next_token: jax.Array, rows: int
) -> tuple[jax.Array, jax.Array]:
    """A model drafter's rows - 1 greedy drafts [B, rows - 1] and their logits [B, rows -
    1, vocab]: `next_token` [B] fed at the cache's length, then each draft after it (what
    they write in the cache is speculative, so the cache is not returned)."""
    run = compile_forward(model)
    fed, drafts, all_logits = next_token[:, None], [], []
    for _ in range(rows - 1):
        logits, cache = run(weights, fed, cache)
        drafts.append(greedy_token(model, logits[:, -1]))
        all_logits.append(logits[:, -1])
        fed = drafts[-1][:, None]
    return jnp.stack(drafts, axis=1), jnp.stack(all_logits, axis=1)


# Jitted steps per (spec, rows), keyed by the spec's JSON like compile_forward.
_COMPILED: dict[tuple[str, int | str | None], Callable[..., Any]] = {}


def compile_draft_step(spec: ModelSpec, rows: int) -> Callable[..., Any]:
    """jax.jit of `draft_step` for one spec and row count: f(weights, state, tokens,
    hidden, next_token)."""
    if not isinstance(spec.draft, BlockDraft):  # jitted a forward or an MTP entry at a time
        return functools.partial(draft_step, spec, rows=rows)
    return jit_once(
        _COMPILED,
        (spec.model_dump_json(), rows),
        lambda w, state, tokens, hidden, next_token: draft_step(
            spec, w, state, tokens, hidden, next_token, rows
        ),
    )


def compile_traced(spec: ModelSpec) -> Callable[..., Any]:
    """jax.jit of the target's forward_traced: f(weights, tokens, cache) -> (logits, cache,
    residual stream after every layer); shared by every drafter of the same target."""
    target = spec.model_copy(update={"draft": None})
    return jit_once(
        _COMPILED, (target.model_dump_json(), None), lambda w, t, c: forward_traced(target, w, t, c)
    )


# ---------------------------------------------------------------- accepting and generating


def accept_greedy(drafts: np.ndarray, verified: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Greedy acceptance of drafts [B, rows - 1] against the target's greedy tokens of
    the verify rows [B, rows] (row r predicts what follows row r): the longest prefix of
    drafts equal to verified[:, :-1], and the bonus token verified[accepted]."""
    drafts, verified = np.asarray(drafts), np.asarray(verified)
    matches = np.cumprod(drafts == verified[:, :-1], axis=1)
    accepted = matches.sum(axis=1)
    return accepted, verified[np.arange(len(verified)), accepted]


def speculative_generate(
    spec: ModelSpec,
    weights: Weights,
    prompt: np.ndarray,
    steps: int,
    rows: int,
    accept: AcceptRule = accept_greedy,
) -> tuple[np.ndarray, list[int]]:
    """Greedy generation of `steps` tokens after prompt [T] (one sequence) by drafting and
    verifying `rows` rows a step: the tokens, and how many each verify step produced
    (accepted drafts + the bonus). With the greedy rule the tokens are the target's own
    greedy continuation whatever the drafter proposes. Where a draft is rejected, attention
    caches drop the rejected rows by their length, and a target with recurrent layers runs
    the accepted rows again from the cache before the verify (its state cannot drop rows)."""
    prompt = jnp.asarray(prompt, jnp.int32)[None]
    max_len = prompt.shape[1] + steps + rows
    recurrent = any(isinstance(k, KDAAttention | GatedDeltaNetAttention)
                    for k in spec.attention_kinds.values())  # fmt: skip
    run, draft = compile_traced(spec), compile_draft_step(spec, rows)
    logits, cache, hidden = run(weights, prompt, init_cache(spec, 1, max_len))
    state = init_draft_state(spec, 1, max_len + rows)
    tokens, next_token = prompt, greedy_token(spec, logits[:, -1])
    out, produced = [int(next_token[0])], []
    while len(out) < steps:
        drafts, _, state = draft(weights, state, tokens, hidden, next_token)
        verify_rows = jnp.concatenate([next_token[:, None], drafts], axis=1)
        logits, verified_cache, hidden = run(weights, verify_rows, cache)
        accepted, bonus = accept(np.asarray(drafts), np.asarray(greedy_token(spec, logits)))
        count = int(accepted[0]) + 1
        tokens = verify_rows[:, :count]
        if count == rows:
            cache = verified_cache
        elif recurrent:  # its state holds the rejected rows: run the accepted ones again
            cache = run(weights, tokens, cache)[1]
        else:  # attention caches drop the rejected rows by their length
            cache = {**verified_cache, "length": cache["length"] + count}
        hidden, next_token = hidden[:, :, :count], jnp.asarray(bonus, jnp.int32)
        out += [int(t) for t in np.asarray(drafts[0, : count - 1])] + [int(bonus[0])]
        produced.append(count)
    return np.asarray(out[:steps], np.int32), produced


def mean_acceptance(produced: list[int]) -> float:
    """Tokens per verify step (accepted drafts + bonus), the acceptance length."""
    return sum(produced) / max(len(produced), 1)


def perturbed(
    weights: Mapping[str, jax.Array], scale: float, seed: int = 1
) -> dict[str, jax.Array]:
    """A copy of float `weights` with relative Gaussian noise `scale` on every tensor
    (tables stay): a drafter that mostly but not always agrees with its original."""
    out = {}
    for name, value in weights.items():
        if not jnp.issubdtype(value.dtype, jnp.floating):
            out[name] = value
            continue
        noise = jax.random.normal(tensor_key(seed, name), value.shape, jnp.float32)
        out[name] = value + scale * math.sqrt(float(jnp.mean(value * value))) * noise
    return out


# ---------------------------------------------------------------- checkpoints

# DeepSeek-V3's MTP tensors beside its decoder layer's (model.layers.{N}.<name>.weight),
# ours by theirs; shared_head.head and embed_tokens are copies of the target's, not read.
_MTP_TENSORS = {"enorm": "enorm", "hnorm": "hnorm", "final_norm": "shared_head.norm"}
_MTP_COPIES = ("shared_head.head.weight", "embed_tokens.weight")
# DFlash's tensors beside its Qwen3 layers (layers.{i}.*), ours by theirs.
_BLOCK_TENSORS = {"draft.hidden_norm": "hidden_norm.weight", "draft.final_norm": "norm.weight"}


def load_draft_weights(
    spec: ModelSpec, arch: str, tensors: Mapping[str, Any], source: str = "drafter"
) -> dict[str, Any]:
    """A drafter checkpoint's tensors as `draft.*` (numpy, matrices [fan_in, fan_out]).

    mtp: DeepSeek-V3's layout, `model.layers.{N}.*` (N: the target's layer count): enorm,
    hnorm, eh_proj, shared_head.norm and the decoder layer as a target layer of `arch`;
    the checkpoint's other tensors (the target's own, when the MTP layers sit in the
    target's checkpoint) are not the drafter's. block: DFlash's layout: fc, hidden_norm,
    norm and Qwen3 layers `layers.{i}.*`. model: the small model's checkpoint of `arch`.
    A missing tensor, or one the mapping does not read, is a one-line SpecError naming it.
    Over `header_shapes(tensors)` it reads no data and gives the shapes alone."""
    from mkgen.reference.hf_weights import HFMapping, TensorView  # numpy only

    draft = spec.draft
    if isinstance(draft, ModelDraft):
        model = HFMapping(draft.model, arch, tensors, source=source)
        values = model.globals()
        for i in range(draft.model.layers.count):
            values |= model.layer(i)
        model.check_complete()
        return {f"draft.{name}": value for name, value in values.items()}
    if isinstance(draft, MtpDraft):
        n = spec.layers.count
        prefix = f"model.layers.{n}."
        view = TensorView(tensors, {name: name for name in tensors if name.startswith(prefix)})
        mapping = HFMapping(_mtp_host(spec, draft), arch, view, source=source)
        out = _renamed(mapping.layer(n), f"layers.{n}.", "draft.0.")
        for ours, theirs in _MTP_TENSORS.items():
            out[f"draft.0.{ours}"] = mapping.src.take(f"{prefix}{theirs}.weight")
        out["draft.0.eh_proj"] = mapping.src.linear(prefix + "eh_proj.weight")
        copies = {prefix + name for name in _MTP_COPIES}
    else:
        assert isinstance(draft, BlockDraft), "the spec has no draft section"
        # DFlash's layers under the names of a Qwen3 checkpoint's (model.layers.{i}.*).
        names = {("model." + k if k.startswith("layers.") else k): k for k in tensors}
        view = TensorView(tensors, names)
        mapping = HFMapping(_block_layers(spec, draft), "Qwen3ForCausalLM", view, source=source)
        out = {}
        for i in range(draft.layers):
            out |= _renamed(mapping.layer(i), f"layers.{i}.", f"draft.layers.{i}.")
        out["draft.fc"] = mapping.src.linear("fc.weight")
        out |= {ours: mapping.src.take(theirs) for ours, theirs in _BLOCK_TENSORS.items()}
        copies = set()
    unread = sorted(set(view) - mapping.src.used - copies)
    if unread:
        raise SpecError(
            f"{source}: {view.names[unread[0]]}: not a tensor of this {draft.kind} drafter"
        )
    return out


def _renamed(tensors: Mapping[str, np.ndarray], old: str, new: str) -> dict[str, np.ndarray]:
    return {new + k.removeprefix(old): v for k, v in tensors.items()}


def _mtp_host(spec: ModelSpec, draft: MtpDraft) -> ModelSpec:
    """The target with one more layer, of the MTP module's kinds, where DeepSeek-V3's
    checkpoint stores it (so the target's layer mapping reads it)."""
    data = spec.model_dump(mode="json", exclude={"draft", "attention_residual"})
    layers, n = data["layers"], spec.layers.count
    layers["count"] = n + 1
    for section, kind in (("attention", draft.attention), ("ffn", draft.ffn)):
        layers[section]["rules"] = [*layers[section]["rules"], {"kind": kind, "indices": [n]}]
    return ModelSpec.model_validate(data)


def _block_layers(spec: ModelSpec, draft: BlockDraft) -> ModelSpec:
    """The block drafter's layers as a model of their own (Qwen3's layout)."""
    return ModelSpec.model_validate(
        {
            "name": "block-drafter",
            "dims": {"hidden": draft.hidden, "vocab": spec.dims.vocab, "norm_eps": draft.norm_eps},
            "attention_kinds": {"attention": draft.attention.model_dump(mode="json")},
            "ffn_kinds": {"ffn": draft.ffn.model_dump(mode="json")},
            "layers": {"count": draft.layers, "attention": {"default": "attention"},
                       "ffn": {"default": "ffn"}},
        }
    )  # fmt: skip
