"""What a build's bytes are a function of, hashed; and the deterministic JSON it writes.

Every file of a build is a pure function of the inputs (the spec after quant overrides,
the topology, the options, the kernel arguments, the templates as Jinja reads them, the
mkgen version and the formatter's), hashed into ``inputs_sha256`` in every header. The
templates are hashed by their names in the package and their text, never by a file
location, so a checkout, an installed wheel and a moved module hash alike.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

from jinja2 import meta

from mkgen import __version__
from mkgen.codegen.library import expanded_template
from mkgen.codegen.render import environment, formatter_version, template_file
from mkgen.kinds import macro_name
from mkgen.plan.options import BuildOptions
from mkgen.spec.schema import ModelSpec
from mkgen.spec.topology import Topology

# The templates a build renders its files from.
ROOT_TEMPLATES = ("megakernel.py.j2", "runner.py.j2", "REPORT.md.j2")


def loaded_templates(roots: tuple[str, ...], kind_types: Iterable[str]) -> dict[str, str]:
    """`roots`, then every template they import, transitively, sorted by name: what Jinja
    loads to render them, each name -> its source as Jinja reads it (library directives
    expanded). The kernel imports a layer kind's macros by the type of each record of its
    layout (an import of an expression, which Jinja cannot name before rendering), so such
    an import loads the macros of `kind_types`: the kinds of the build's spec. A kind
    folder no build's spec uses is not an input of that build."""
    kind_macros = [macro_name(kind_type) for kind_type in kind_types]
    sources: dict[str, str] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in sources:
            continue
        sources[name] = expanded_template(template_file(name).read_bytes(), name)
        found = _referenced_templates(sources[name])
        todo += [n for n in found if n is not None] + (kind_macros if None in found else [])
    order = roots + tuple(sorted(set(sources) - set(roots)))
    return {name: sources[name] for name in order}


@functools.lru_cache(maxsize=256)
def _referenced_templates(source: str) -> tuple[str | None, ...]:
    """The templates a template's source imports (None for an import of an expression),
    parsed once per text: every build's inputs hash walks the same templates."""
    return tuple(meta.find_referenced_templates(environment().parse(source)))


def spec_kind_types(spec: ModelSpec) -> tuple[str, ...]:
    """The types of the spec's layer kinds, each once, attention kinds first."""
    kinds = (*spec.attention_kinds.values(), *spec.ffn_kinds.values())
    return tuple(dict.fromkeys(kind.type for kind in kinds))


def template_files(spec: ModelSpec) -> dict[str, str]:
    """The templates a build of `spec` loads (its inputs among the templates): name ->
    source as Jinja reads it."""
    return loaded_templates(ROOT_TEMPLATES, spec_kind_types(spec))


def _canonical(data: Any) -> str:
    """Compact JSON that keeps key order: the order of a spec's kinds is meaningful (it
    numbers them in the kernel's layer tables), so it must change the hash."""
    return json.dumps(data, separators=(",", ":"), ensure_ascii=True)


def inputs_digest(
    spec: ModelSpec, topology: Topology, options: BuildOptions, kernel_args: Mapping[str, Any]
) -> str:
    """sha256 of everything a build is rendered from (`spec` with its overrides applied)."""
    # Each template as Jinja reads it: with the kernel library members it includes.
    template_digests = {
        name: hashlib.sha256(source.encode()).hexdigest()
        for name, source in template_files(spec).items()
    }
    data = {
        "mkgen": __version__,
        "spec": spec.model_dump(mode="json"),
        "topology": topology.name,
        "options": options.model_dump(mode="json"),
        "kernel_args": dict(kernel_args),
        "templates": template_digests,
        "ruff": formatter_version(),  # it formats the generated code
    }
    return hashlib.sha256(_canonical(data).encode()).hexdigest()


def sorted_keys(data: Any) -> Any:
    """`data` with every dict's keys sorted (for data whose dict order means nothing)."""
    if isinstance(data, dict):
        return {key: sorted_keys(data[key]) for key in sorted(data)}
    if isinstance(data, list | tuple):
        return [sorted_keys(value) for value in data]
    return data


def dump_json(data: Any, *, sort: bool = True) -> str:
    """Deterministic JSON for files: sorted keys (unless `sort` is off because the caller
    fixed the order), ASCII, one trailing newline."""
    return json.dumps(data, sort_keys=sort, indent=1, ensure_ascii=True) + "\n"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
