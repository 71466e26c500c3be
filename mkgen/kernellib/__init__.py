"""The kernel's runtime library: the code that runs inside every generated megakernel and
is the same for every build, as ordinary Python (linted, type-checked, unit-tested).

Not to be confused with mkgen/plan/kernel.py (the kernel *layout* the plan decides) or
mkgen/runtime/ (the runner around a build). The template (templates/megakernel.py.j2)
includes a member of these modules verbatim with a directive on a line of its own,
indented like the member::

    {{ library("ring", "Ring") }}
        {{ library("ring", "WeightStream.matmul") }}

A member is a top-level function, class or constant (`NAME = ...`) of
mkgen/kernellib/<module>.py, or `Class.member` for a method of a top-level class; its
text runs from the comment lines directly above it (no blank line between) to its last
line, comments and docstrings kept. mkgen/codegen/library.py puts the text in place when
the template is loaded, before Jinja parses it, so Jinja renders it like any other line
and the inputs hash in every build's header covers it (the hash takes the expanded
template). Choosing stays in the template: `{% if ... %}` around a directive, so a kernel
holds only what its model needs. Directives are not Jinja: a library member never holds
`{{`, `{%` or `{#` (the loader refuses one that does).

Rules for these modules:

- Build constants (CHUNK, TOKENS_PADDED, NORM_EPS, ROUNDS, ...) are module globals, as in
  the generated module: a library module imports them from `constants`, which gives
  representative values for the library's own import, type checks and tests (a test
  that needs another value patches the module global). Imports are never included, so in
  a generated kernel the names are the build's own constants. The constants that are the
  same in every build (LANES, CHUNK, AXIS, ...) are members of `constants` too, and the
  template includes them like code.
- Siblings are imported by name (`from mkgen.kernellib.ring import _to_chunks`); every
  name a member uses must be a generated kernel's too (tests/test_codegen.py reads the
  generated kernels for undefined names).
- A member's text is what the generated kernels hold, byte for byte: the template's
  output goes through ruff format, so members are written as ruff formats them, and
  their text decides every build's bytes and inputs hash. Members are not annotated, as
  the kernels are not; mypy checks their bodies (check_untyped_defs, pyproject.toml).
  A few were written before the kernels were formatted and hold lines longer than 100
  columns: they sit in `# fmt: off` regions, since reformatting them would change every
  checked-in build's inputs hash (their kernels' code would not change).
- What only the library needs (representative constants, a class's constructor for the
  tests when the template writes the kernel's own per build) is annotated and not
  included.

Modules, one concern each:

    constants.py    build constants: representative values, then the fixed ones
    segment.py      Segment: a matrix streamed through a ring
    elementwise.py  RMSNorm, sigmoid, softplus, token rows padded to TOKENS_PADDED
    recurrent.py    the causal conv step and the gated delta rule
    ring.py         chunking a matmul's input, the Ring, the WeightStream
    products.py     a chunk's product in each stored format (bf16, int4, int8, mxfp4,
                    nvfp4, fp8) and the grouped dot under the scaled ones
    routing.py      top-k over expert scores
    collectives.py  one-shot rounds, the wire format, Collectives, the barrier
    residual.py     the attention residual's snapshot mixture
    head.py         the lm_head and the greedy token across vocabulary shards
    step.py         around the kernel: the phases' context, RoPE tables, argument shapes
"""
