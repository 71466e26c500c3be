"""One module per layer kind: its layout builder, VMEM buffers and program ops.

Each kind's module (gqa, mla, gated_deltanet, kda, dense, moe) holds the rules the plan
applies to that kind; `registry` maps a kind's type to its module and its template macros
(mkgen/templates/kinds/<kind>.py.j2). The generic machinery (mkgen/plan/layout.py's
KernelLayout, vmem.py, schedule.py) dispatches through the registry. GQA and MLA share
cache_attention, Gated DeltaNet and KDA share recurrent.
"""

# The plan package dispatches to these modules while it loads: load it first, so that a
# kind's module imported on its own (before mkgen.plan) finds its siblings whole.
import mkgen.plan  # noqa: E402, F401
