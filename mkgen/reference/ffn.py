"""Feed-forward layers of the reference model: the dense MLP and mixture of experts.

Routing (transformers DeepseekV3TopkRouter, Qwen3MoE/Mixtral/gpt-oss routers):

    logits  = x @ router (+ router_bias)                 in f32
    scores  = softmax(logits) or sigmoid(logits)         these weigh the experts
    choice  = scores (+ selection_bias)                  this chooses them
    grouped: experts split into n_group equal groups; a group scores the sum of its
             two best `choice` values; only the topk_group best groups stay eligible
    chosen  = top_k(choice)                              jax.lax.top_k: ties go to
                                                          the lower expert index
    weights = scores[chosen] (/ their sum if renormalize) * routed_scaling

Softmax, then top-k, then renormalisation equals gpt-oss's softmax over the
top-k logits. A `ChooseExperts` callback may replace `chosen` (the verifier makes the
reference follow the kernel through a near tie, mkgen/verify/numerics.py); the weights
are then those of the experts it returns. Routed experts run only for the tokens that chose them (each
token gathers its k experts' matrices), so an expert nobody picked is never read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp

from mkgen.reference.dispatch import FFN
from mkgen.reference.layers import Project, act_fn, einsum, gated_activation, mm, multiply, rms_norm
from mkgen.spec.schema import DenseFFN, Dims, MoEFFN, PlainMLP

Weights = Mapping[str, jax.Array]
# (kind, weights, x [N, d], chosen [N, top_k], weights [N, top_k]) -> [N, d]: routed_experts
# here; the sharded prefill passes one that runs a core's own experts and sums over cores.
RoutedExperts = Callable[[MoEFFN, Weights, jax.Array, jax.Array, jax.Array], jax.Array]
# (kind, choice values [N, E] before any group masking, the top-k chosen [N, top_k]) ->
# the experts to use [N, top_k].
ChooseExperts = Callable[[MoEFFN, jax.Array, jax.Array], jax.Array]


@FFN.computes(DenseFFN)
def dense_ffn(kind: DenseFFN, w: Weights, x: jax.Array) -> jax.Array:
    """Gated: act(x W_gate + b_gate, x W_up + b_up) W_down + b_down; plain: act(x W_up) W_down."""
    up = mm(x, w["w_up"])
    if kind.bias:
        up = up + w["b_up"]
    if kind.gated:
        gate = mm(x, w["w_gate"])
        if kind.bias:
            gate = gate + w["b_gate"]
        hidden = gated_activation(kind.activation, gate, up)
    else:
        hidden = act_fn(kind.activation.kind, up)
    out = mm(hidden, w["w_down"])
    if kind.bias:
        out = out + w["b_down"]
    return out


@FFN.computes(PlainMLP)
def plain_mlp(kind: PlainMLP, w: Weights, x: jax.Array) -> jax.Array:
    """act(x W_up) W_down."""
    return mm(act_fn(kind.activation, mm(x, w["w_up"])), w["w_down"])


def router_scores(
    kind: MoEFFN, w: Weights, x: jax.Array, project: Project | None = None
) -> jax.Array:
    """Expert scores [N, E] of tokens x [N, hidden] (the values that weigh experts);
    `project` computes x @ router (by default with the whole router in w)."""
    logits = (project or multiply(w))(x, "router")
    if kind.router.bias:
        logits = logits + w["router_bias"].astype(jnp.float32)
    if kind.router.score == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    return jax.nn.sigmoid(logits)


def route(
    kind: MoEFFN,
    w: Weights,
    x: jax.Array,
    choose: ChooseExperts | None = None,
    project: Project | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(expert indices [N, top_k] int32, weights [N, top_k] f32) of tokens x [N, hidden]
    (`project`: router_scores)."""
    r = kind.router
    scores = router_scores(kind, w, x, project)
    choice = scores
    if r.selection_bias:
        choice = choice + w["selection_bias"].astype(jnp.float32)
    unmasked = choice
    if r.n_group > 1:
        n, e = choice.shape
        per_group = e // r.n_group
        grouped = choice.reshape(n, r.n_group, per_group)
        best_two = jax.lax.top_k(grouped, min(2, per_group))[0].sum(axis=-1)  # [N, G]
        _, groups = jax.lax.top_k(best_two, r.topk_group)
        keep = jax.nn.one_hot(groups, r.n_group, dtype=jnp.bool_).any(axis=1)  # [N, G]
        keep = jnp.repeat(keep, per_group, axis=1)
        choice = jnp.where(keep, choice, -jnp.inf)
    _, chosen = jax.lax.top_k(choice, kind.top_k)
    if choose is not None:
        chosen = jnp.asarray(choose(kind, unmasked, chosen))
    weights = jnp.take_along_axis(scores, chosen, axis=-1)
    if r.renormalize:
        # DeepSeek adds 1e-20 so that all-zero sigmoid scores cannot divide by zero.
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return chosen.astype(jnp.int32), weights * r.routed_scaling


def routed_experts(
    kind: MoEFFN, w: Weights, x: jax.Array, chosen: jax.Array, weights: jax.Array
) -> jax.Array:
    """Sum over each token's chosen experts of weight * expert(x); x [N, d] in the
    experts' space (the latent when there is one)."""
    gate = einsum("nd,nkdf->nkf", x, w["experts_gate"][chosen])
    up = einsum("nd,nkdf->nkf", x, w["experts_up"][chosen])
    if kind.expert_bias:
        gate = gate + w["experts_b_gate"][chosen]
        up = up + w["experts_b_up"][chosen]
    out = einsum(
        "nkf,nkfd->nkd", gated_activation(kind.activation, gate, up), w["experts_down"][chosen]
    )
    if kind.expert_bias:
        out = out + w["experts_b_down"][chosen]
    return jnp.sum(out * weights[..., None], axis=1)


@FFN.computes(MoEFFN)
def moe_ffn(
    kind: MoEFFN,
    w: Weights,
    x: jax.Array,
    dims: Dims,
    routed: RoutedExperts = routed_experts,
    choose: ChooseExperts | None = None,
    project: Project | None = None,
) -> jax.Array:
    """Mixture of experts of x [B, T, hidden].

    The router reads the full hidden state. With a latent projection the routed
    experts work on x @ latent_in (RMS-normed with latent_norm when present, model
    norm style and eps) and their weighted sum returns through latent_out. Shared
    experts are one gated MLP on the full hidden state with the MoE's activation,
    scaled by sigmoid(x @ shared_gate_proj) when gated (Qwen3-Next). `choose` may
    replace the routing's choice of experts (route). `project` computes x @ router and
    the latent projections (by default with the whole weights in w).
    """
    project = project or multiply(w)
    shape = x.shape
    x = x.reshape(-1, shape[-1]).astype(jnp.float32)
    chosen, weights = route(kind, w, x, choose, project)
    xe = x
    if kind.latent:
        xe = project(x, "latent_in")
        if kind.latent.norm:
            xe = rms_norm(xe, w["latent_norm"], dims.norm_eps, dims.norm_style == "zero_centered")
    out = routed(kind, w, xe, chosen, weights)
    if kind.latent:
        out = project(out, "latent_out")
    if kind.shared_experts:
        shared = shared_mlp(kind, w, x)
        if kind.shared_experts.gate:
            shared = shared * jax.nn.sigmoid(mm(x, w["shared_gate_proj"]))
        out = out + shared
    return out.reshape(shape)


def shared_mlp(kind: MoEFFN, w: Weights, x: jax.Array) -> jax.Array:
    """The shared experts' gated MLP of x [..., hidden], before their sigmoid gate:
    act(x shared_gate, x shared_up) shared_down (any columns of shared_gate and shared_up
    with the same rows of shared_down give that slice's share of the sum)."""
    hidden = gated_activation(kind.activation, mm(x, w["shared_gate"]), mm(x, w["shared_up"]))
    return mm(hidden, w["shared_down"])
