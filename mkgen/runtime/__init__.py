"""The runner of a generated build, as a library.

Every build's runner.py is a short file holding the build's constants (a `Build`) that
calls `run`; `mkgen run BUILD` calls the same function. The work is split by concern:

    build.py        Build (the constants), loading plan.json and megakernel.py
    arguments.py    the options, all checked before any expensive work (one-line errors)
    devices.py      JAX's environment, the mesh, jax.distributed, prompts broadcast,
                    host values
    weights.py      converted or random weights, placed per core on the mesh
    decode.py       loading the model, the XLA prefill into the kernel's caches, the
                    decode loop (several steps per device call, sampling on the device)
    disaggregation.py  prefill on its own mesh, caches handed over, offloaded and restored
    slots.py        one sequence's caches into and out of a batch slot (mkgen serve)
    sampling.py     sampling from logits: on the host (speculation) or in a jitted step
    speculation.py  drafters (prompt lookup or a user callable) and draft acceptance
    device_speculation.py  prompt lookup and acceptance on the device (decode's loop)
    device_drafting.py     the build's own drafter on the device (decode's loop)
    hidden_drafting.py     an mtp or block drafter there, from the kernel's hidden states
    bench.py        step-time medians and tokens/s
    main.py         run: the steps above in order, and what is printed

JAX reads its environment (interpret mode's virtual CPU devices) when it is imported, so
nothing imports it before `run` has set that: devices.py imports it inside its functions,
weights.py, decode.py, device_drafting.py, hidden_drafting.py, device_speculation.py,
disaggregation.py,
sampling.py and slots.py at their top, and
`run` imports them only afterwards.
"""

from mkgen.runtime.build import Build
from mkgen.runtime.main import run

__all__ = ["Build", "run"]
