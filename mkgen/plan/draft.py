"""The drafter's step, priced by the cost model from programs the planner builds.

A build with rows R > 1 verifies R rows a step; a drafter (mkgen/spec/draft.py,
docs/drafting.md) makes the next step's R - 1 drafts after the verify rows are accepted.
No kernel drafts yet, so the drafter's passes are priced, not generated: each pass is a
program the planner builds for the layers it runs (a ModelSpec synthesized from the
drafter, with the target's hidden width and vocabulary, planned by `plan_program` on the
build's topology and options at the pass's rows) and walked by the same cost model as
the verify step (`mkgen.plan.timeline.estimate`). The passes, as the reference runs them
(mkgen/reference/draft.py):

- mtp: one pass over the R verified rows (enorm / hnorm, eh_proj 2H -> H, one decoder
  layer of the target's own kinds, its final norm, the LM head), then R - 2 single-row
  passes (each draft chains on the one before);
- block (DFlash): one pass of the block through its layers: `block_size` rows (the
  reference embeds the whole block, which attends non-causally, so all of it runs
  whatever R <= block_size is) plus the R accepted rows whose context features (fc:
  features x H -> H, hidden_norm) every layer projects into its keys and values, then
  the LM head (the target's, or its own over draft_vocab);
- model: one pass of the small model over the R rows, then R - 2 single-row passes.

What a program cannot express, eh_proj and fc, is priced as the stream prices a dense
projection: its bytes split over the cores by output column, in the ring's banks
(`mkgen.plan.stream.make_segment`), each bank a DMA at the catalog's rate
(`CostConstants.dma_s`), its chunks at their measured ops (`opcount.ring_matmul_ops`) at
the chip's issue rates, whichever is longer, then the all-gather of the output
(`sharding.collective_cost`).

Assumptions (docs/cost-model.md#drafting): each pass is priced as its own kernel step,
so the dispatch share, the entry barrier and the epilogue (final norm, LM head, greedy
pick) count once per pass where a fused kernel would share the launch and the barrier;
the block pass runs the context rows through whole layers where only their K/V
projections are needed, and the LM head over every row of the pass: both overstate the
compute, not the weight stream. Every figure is a prediction of the cost model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from mkgen.errors import SpecError
from mkgen.plan.cost import CostConstants, pad_rows
from mkgen.plan.opcount import bound_us, ring_matmul_ops
from mkgen.plan.options import MAX_TOKEN_ROWS, BuildOptions
from mkgen.plan.sharding import collective_cost
from mkgen.plan.stream import cdiv, make_segment
from mkgen.spec.schema import BlockDraft, Dims, ModelDraft, ModelSpec, MtpDraft

if TYPE_CHECKING:
    from mkgen.plan.kind import KindRegistry
    from mkgen.plan.stream import StreamPlan
    from mkgen.spec.topology import Topology

ASSUMPTION = (
    "each pass priced as its own kernel step (its dispatch share, entry barrier and epilogue "
    "count per pass, where a fused kernel would share them); predictions of the cost model"
)


class DraftPass(BaseModel):
    """One kind of pass the drafter runs each step, `count` times, priced once."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    what: str  # what runs, e.g. "mtp module over the 8 verified rows"
    rows: int  # token rows per sequence the pass runs
    count: int  # passes of this kind per step
    program_ms: float  # the pass's program walked as one step (mkgen.plan.timeline)
    projection_ms: float  # eh_proj or fc, priced as a stream matmul (0: none)

    @property
    def ms(self) -> float:
        """Every pass of this kind in one step."""
        return self.count * (self.program_ms + self.projection_ms)


class DraftPrice(BaseModel):
    """The drafter's step: its passes and their sum (predictions of the cost model)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    drafter: str  # which drafter: its kind and shape
    passes: list[DraftPass]
    assumption: str = ASSUMPTION

    @property
    def ms(self) -> float:
        return sum(p.ms for p in self.passes)

    def describe(self) -> str:
        """The passes for people (`mkgen plan`)."""
        lines = [f"Draft ({self.drafter}): {self.ms:.3f} ms a step; {self.assumption}"]
        for p in self.passes:
            projection = f" + projection {p.projection_ms * 1e3:.1f} us" if p.projection_ms else ""
            lines.append(
                f"  {p.count} x {p.what}: {p.program_ms * 1e3:.1f} us{projection} = {p.ms:.3f} ms"
            )
        return "\n".join(lines)

    def record(self) -> dict[str, object]:
        """As `mkgen plan --json` prints it (estimate.draft)."""
        return {
            "drafter": self.drafter,
            "draft_ms": self.ms,
            "passes": [{**p.model_dump(), "ms": p.ms} for p in self.passes],
            "assumption": self.assumption,
        }


def price_draft(
    spec: ModelSpec, topo: Topology, options: BuildOptions, *, kinds: KindRegistry
) -> DraftPrice:
    """The drafter of `spec` (its draft section) priced for one step of a build verifying
    `options.rows` rows (module docstring). One-line SpecError for rows 1 or a block
    drafter whose block is shorter than the rows."""
    draft, rows = spec.draft, options.rows
    if draft is None:
        raise SpecError(f"{spec.name}: no drafter to price; attach one with --draft")
    if rows < 2:
        raise SpecError(
            f"--rows {rows}: a drafter drafts rows - 1 tokens a step, and rows 1 verifies no "
            "draft; pass --rows 2 or more, or leave out --draft"
        )
    target = options.apply(spec.model_copy(update={"draft": None}))
    pricer = _Pricer(target, topo, options, kinds)
    if isinstance(draft, MtpDraft):
        layer = _mtp_layer(target, draft)
        eh_proj = (2 * target.dims.hidden, target.dims.hidden)
        passes = [
            pricer.run(f"mtp module over the {rows} verified rows", layer, rows, 1, eh_proj),
            pricer.run("mtp module, one chained draft", layer, 1, rows - 2, eh_proj),
        ]
        return DraftPrice(drafter=f"mtp: {draft.layers} module(s), {draft.attention} + "
                          f"{draft.ffn} layer", passes=passes)  # fmt: skip
    if isinstance(draft, BlockDraft):
        if rows > draft.block_size:
            raise SpecError(
                f"--rows {rows}: the block drafter drafts block_size - 1 = "
                f"{draft.block_size - 1} tokens a step; lower --rows to {draft.block_size}"
            )
        block_rows = draft.block_size + rows
        fc = (len(draft.feature_layers) * target.dims.hidden, target.dims.hidden)
        what = (f"{draft.layers} block layers over the {draft.block_size}-row block and the "
                f"{rows} accepted context rows")  # fmt: skip
        passes = [pricer.run(what, _block_layers(target, draft), block_rows, 1, fc, rows)]
        return DraftPrice(drafter=f"block: {draft.layers} layers, block_size "
                          f"{draft.block_size}, {len(draft.feature_layers)} feature layers",
                          passes=passes)  # fmt: skip
    assert isinstance(draft, ModelDraft), draft
    model = draft.model
    passes = [
        pricer.run(f"{model.name} over the {rows} verified rows", model, rows, 1),
        pricer.run(f"{model.name}, one chained draft", model, 1, rows - 2),
    ]
    return DraftPrice(drafter=f"model: {model.name}, {model.layers.count} layers", passes=passes)


class _Pricer:
    """Prices passes on one topology with one build's options (module docstring)."""

    def __init__(
        self, target: ModelSpec, topo: Topology, options: BuildOptions, kinds: KindRegistry
    ) -> None:
        self.target, self.topo, self.options, self.kinds = target, topo, options, kinds
        self.constants = CostConstants.from_chip(topo.chip_info, options)

    def run(
        self,
        what: str,
        program_spec: ModelSpec,
        rows: int,
        count: int,
        projection: tuple[int, int] | None = None,
        projection_rows: int | None = None,
    ) -> DraftPass:
        """`count` passes of `program_spec` at `rows` rows per sequence, each after a
        projection (fan_in, fan_out) of `projection_rows` rows (default: `rows`)."""
        from mkgen.plan.program import plan_program
        from mkgen.plan.timeline import estimate

        # A forced --held-refills is the verify ring's: a pass's program chooses its own.
        options = self.options.model_copy(
            update={"rows": rows, "acceptance": 1.0, "held_refills": None}
        )
        if options.tokens > MAX_TOKEN_ROWS:
            raise SpecError(
                f"--batch {options.batch}: the drafter's pass runs {rows} rows a sequence, "
                f"{options.tokens} token rows, over the {MAX_TOKEN_ROWS} a step holds; lower "
                "--batch"
            )
        if not count:  # rows 2: no chained draft
            return DraftPass(what=what, rows=rows, count=0, program_ms=0.0, projection_ms=0.0)
        program = plan_program(program_spec, self.topo, options, kinds=self.kinds)
        program_ms = estimate(self.topo, options, program).step_ms
        projection_ms = 0.0
        if projection is not None:
            tokens = options.batch * (projection_rows or rows)
            projection_ms = self.projection_s(*projection, tokens, program.stream) * 1e3
        return DraftPass(what=what, rows=rows, count=count, program_ms=program_ms,
                         projection_ms=projection_ms)  # fmt: skip

    def projection_s(self, fan_in: int, fan_out: int, tokens: int, stream: StreamPlan) -> float:
        """A dense projection of the `projections` family streamed like a program's
        segment: each core's output columns in the ring's banks, the banks' DMAs or the
        chunks' measured ops at the issue rates (whichever is longer: the ring overlaps
        them), then the all-gather of the output."""
        c, devices = self.constants, self.topo.num_devices
        fmt = str(self.target.quantization.projections)
        bank_rows = stream.bank_rows
        segment = make_segment("projection", [], fan_in, cdiv(fan_out, devices), 0, bank_rows, fmt)
        dma_s = c.dma_s(segment.bytes, cdiv(segment.rows, bank_rows))
        compute_s = 0.0
        if c.issue_rates is not None:
            try:
                ops = ring_matmul_ops(fmt if fmt == "bf16" else f"stream:{fmt}",
                                      segment.k_chunks, segment.col_blocks, pad_rows(tokens))  # fmt: skip
                compute_s = max(bound_us(ops, c.issue_rates).values()) * 1e-6
            except KeyError:  # a format without a chunk measurement: its DMAs only
                compute_s = 0.0
        gather_s = 0.0
        if devices > 1:
            gather_s = collective_cost(self.topo, "draft projection", "all_gather", "projection",
                                       fan_out, tokens).time_s  # fmt: skip
        return max(dma_s, compute_s) + gather_s


def _mtp_layer(target: ModelSpec, draft: MtpDraft) -> ModelSpec:
    """One MTP module's decoder layer as a one-layer model with the target's dims (its
    embedding, final norm and LM head are the program's own)."""
    return _one_kind_model(
        f"{target.name}-mtp",
        target.dims,
        (draft.attention, target.attention_kinds[draft.attention]),
        (draft.ffn, target.ffn_kinds[draft.ffn]),
        1,
        target,
    )


def _block_layers(target: ModelSpec, draft: BlockDraft) -> ModelSpec:
    """A block drafter's layers as a model with the target's hidden width and the LM head
    it drafts through: the target's (vocabulary and tie as the target's), or its own over
    draft_vocab rows."""
    dims = target.dims.model_copy(update={"norm_eps": draft.norm_eps, "norm_style": "plain"})
    if draft.lm_head == "own":
        vocab = draft.draft_vocab or target.dims.vocab
        dims = Dims(hidden=draft.hidden, vocab=vocab, norm_eps=draft.norm_eps)
    return _one_kind_model(f"{target.name}-block-drafter", dims, ("draft", draft.attention),
                           ("draft", draft.ffn), draft.layers, target)  # fmt: skip


def _one_kind_model(
    name: str,
    dims: Dims,
    attention: tuple[str, BaseModel],
    ffn: tuple[str, BaseModel],
    layers: int,
    target: ModelSpec,
) -> ModelSpec:
    """`layers` layers of one attention and one FFN kind, stored in the target's formats."""
    return ModelSpec.model_validate(
        {
            "name": name,
            "dims": dims.model_dump(),
            "attention_kinds": {attention[0]: attention[1].model_dump()},
            "ffn_kinds": {ffn[0]: ffn[1].model_dump()},
            "layers": {"count": layers, "attention": {"default": attention[0]},
                       "ffn": {"default": ffn[0]}},
            "quantization": target.quantization.model_dump(),
        }
    )  # fmt: skip
