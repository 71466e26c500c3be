"""The drafter fused into the kernel: an `mtp` drafter's passes as layers of the step.

A build that fuses its MTP drafter (plan_build's `fuse_draft`) plans the target as a
model of L + P layers, L the target's and P = rows - 1 passes of the MTP module's
decoder layer after them (`fused_model`). Everything the planner does per layer (the
sharding, the weight stream, the vector slabs, the VMEM plan, the program the cost
model walks) then covers the passes too; what is particular to them is this record
(`DraftPasses`, plain data on the sharding plan):

- every pass layer reads the cache slot (and routed experts) of the first pass layer:
  the MTP module has one KV cache, written at the positions of each pass;
- the stream holds, after the target's layers, its LM head, and around each pass the
  module's eh_proj (before) and the target's LM head again (after): the ring streams
  each pass's weights once per pass (duplicated in HBM, so that the ring stays linear);
- the module's enorm, hnorm and final norm are three global vectors.

Pass 1 runs over the verified rows (row r pairs the target's final-normed state of row r
with the kernel's greedy token of row r, the token after it for every accepted row);
pass j + 1 over one row per sequence (draft j and pass j's output at the row that made
it), at the position after. docs/drafting.md#the-drafter-in-the-kernel.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from mkgen.errors import SpecError
from mkgen.spec.schema import LayerAssignment, LayerRule, ModelSpec, MtpDraft

# The module's vectors, in the order of the kernel's draft-norms input.
DRAFT_NORMS = ("enorm", "hnorm", "final_norm")
# The inventory prefix of the MTP module's tensors (mkgen.spec.draft.draft_weights).
MODULE_PREFIX = "draft.0."


class DraftPasses(BaseModel):
    """Where the drafter's passes sit among the layers of a fused build."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    first_layer: int  # the target's layer count: pass p is layer first_layer + p
    passes: int  # rows - 1: the drafts a step writes
    # DeepSeek-V3's MTP zeroes the embedding at position 0 (mkgen.spec.schema.MtpDraft)
    mask_first_embedding: bool
    chain_normed: bool  # a chained pass reads the previous output after the final norm

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.first_layer + self.passes)

    def source(self, layer: int) -> int:
        """The layer whose cache slot and experts `layer` uses: the first pass's for a pass."""
        return self.first_layer if layer in self.layers else layer

    def tensor_prefix(self, layer: int) -> str:
        """The inventory prefix of `layer`'s tensors: a pass reads the MTP module's."""
        return MODULE_PREFIX if layer in self.layers else f"layers.{layer}."


def planned_model(
    spec: ModelSpec, fuse_draft: bool, rows: int
) -> tuple[ModelSpec, DraftPasses | None]:
    """The model a build plans and its drafter's passes: `spec` itself and none, or with
    --fuse-draft (`fuse_draft`) `fused_model`'s. Every plan of a build goes through it
    (plan_build, and the tuned tables' keys and scores, mkgen.plan.program)."""
    return fused_model(spec, rows) if fuse_draft else (spec, None)


def fused_model(spec: ModelSpec, rows: int) -> tuple[ModelSpec, DraftPasses]:
    """`spec` (with an mtp draft section) as the model a fused build plans: its layers, then
    rows - 1 layers of the MTP module's kinds; the draft section dropped (the kernel reads
    the drafter's inputs itself, so it writes no hidden states for a runner)."""
    draft = spec.draft
    if not isinstance(draft, MtpDraft):
        kind = "none" if draft is None else draft.kind
        raise SpecError(
            f"--fuse-draft: the kernel fuses an mtp drafter only (this build's drafter: {kind}); "
            "give --draft mtp (the spec's own MTP layers) or an mtp drafter spec, or leave "
            "--fuse-draft out"
        )
    if rows < 2:
        raise SpecError("--fuse-draft: rows 1 verifies no draft; give --rows 2 or more")
    if draft.layers != 1:
        raise SpecError(
            f"--fuse-draft: the spec has {draft.layers} MTP modules; the kernel fuses one"
        )
    count, passes = spec.layers.count, rows - 1

    def assignment(table: list[str], pass_kind: str) -> LayerAssignment:
        kinds = [*table, *[pass_kind] * passes]
        return LayerAssignment(
            rules=[
                LayerRule(kind=k, indices=[i for i, n in enumerate(kinds) if n == k])
                for k in dict.fromkeys(kinds)
            ]
        )

    layers = spec.layers.model_copy(
        update={
            "count": count + passes,
            "attention": assignment(spec.attention_table(), draft.attention),
            "ffn": assignment(spec.ffn_table(), draft.ffn),
        }
    )
    fused = spec.model_copy(update={"layers": layers, "draft": None})
    return fused, DraftPasses(
        first_layer=count,
        passes=passes,
        mask_first_embedding=draft.mask_first_embedding,
        chain_normed=draft.chain == "normed",
    )
