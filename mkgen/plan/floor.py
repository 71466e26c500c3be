"""The ideal floor of a decode step: what one core must read from HBM per step if nothing
were replicated, the experts were spread evenly and nothing were padded, at the catalog's
measured streaming rate.

It depends only on the model, its formats, the topology and the step's shape (batch,
rows, context): no kernel decision enters it, so `step / ideal floor` measures how much
of the step a kernel design spends above what any design must read. The published floor
of the hand-written Muse Spark kernel is defined the same way ("7.02 GB read per core per
step = 2.19 ms at 3.2 TB/s", the reference rows in mkgen/plan/calibration.py)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from mkgen.plan.options import BuildOptions
from mkgen.spec.figures import cache_bytes, state_bytes_per_sequence
from mkgen.spec.schema import ModelSpec, MoEFFN
from mkgen.spec.tensors import VECTORS
from mkgen.spec.topology import Topology
from mkgen.spec.weights import model_weights


class IdealFloor(BaseModel):
    model_config = ConfigDict(frozen=True)

    weight_bytes_per_core: float
    expert_bytes_per_core: float
    cache_bytes_per_core: float
    stream_rate: float  # bytes/s per core: the catalog's measured HBM -> VMEM rate

    @property
    def bytes_per_core(self) -> float:
        return self.weight_bytes_per_core + self.expert_bytes_per_core + self.cache_bytes_per_core

    @property
    def ms(self) -> float:
        return self.bytes_per_core / self.stream_rate * 1e3

    def ratio(self, step_ms: float) -> float:
        """floor / step: the share of the step no kernel design can avoid (1 = at the floor).
        The one floor ratio mkgen reports (`ideal_floor_ratio`)."""
        return self.ms / step_ms

    def times(self, step_ms: float) -> str:
        """The step as a multiple of the floor, e.g. '2.3x the ideal floor' (a share such as
        '43 % of the floor' would read as faster than the floor)."""
        return f"{step_ms / self.ms:.1f}x the ideal floor"


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Experts at least one of `tokens` rows picks, each row picking `top_k` of
    `num_experts` uniformly: E (1 - (1 - k/E)^tokens)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def _experts_read(ffn: MoEFFN, options: BuildOptions) -> float:
    if options.distinct_experts_per_layer is not None:
        return min(ffn.num_experts, options.distinct_experts_per_layer)
    return expected_distinct_experts(ffn.num_experts, ffn.top_k, options.batch * options.rows)


def ideal_floor(spec: ModelSpec, topo: Topology, options: BuildOptions) -> IdealFloor:
    """Bytes per core per step: every matrix a step multiplies (the embedding is a host
    lookup, not read), the routed experts the step's rows pick in expectation, and each
    sequence's caches read once and its recurrent state written back; all split evenly
    over the cores."""
    cores = topo.num_devices
    layer_ffn = [spec.ffn_kinds[ffn] for _, ffn in spec.layer_table()]
    dense = experts = 0.0
    for w in model_weights(spec):
        if w.family == "embedding":
            continue
        nbytes = w.nbytes("bf16" if w.family == VECTORS else getattr(spec.quantization, w.family))
        if w.experts:
            ffn = layer_ffn[int(w.name.split(".")[1])]
            experts += nbytes * _experts_read(ffn, options) / ffn.num_experts
        else:
            dense += nbytes
    caches = options.batch * (cache_bytes(spec, options.context) + state_bytes_per_sequence(spec))
    return IdealFloor(
        weight_bytes_per_core=dense / cores,
        expert_bytes_per_core=experts / cores,
        cache_bytes_per_core=caches / cores,
        stream_rate=topo.chip_info.cost_model_hbm_bandwidth,
    )
