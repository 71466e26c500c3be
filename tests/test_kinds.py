"""One module and one template macro file per layer kind, and templates that only print
what the layout decided (no count, offset or format computed in Jinja)."""

from __future__ import annotations

import subprocess
import sys
import typing

import pytest
from jinja2 import nodes

from mkgen.codegen.build import render_kernel
from mkgen.codegen.conformance import consumed_segments
from mkgen.codegen.render import environment, template_file
from mkgen.errors import SpecError
from mkgen.kinds import default_registry, macro_files, macro_name, moe
from mkgen.plan import BuildOptions, plan_build
from mkgen.plan.kind import LayerKind
from mkgen.plan.layout import GENERATED_EXPERT_FORMATS, AttentionRecord, FFNRecord
from mkgen.spec.loader import load_spec
from mkgen.spec.schema import AttentionKind, FFNKind
from mkgen.spec.topology import parse_topology

KERNEL_TEMPLATE = "megakernel.py.j2"
# Macros every kind's template defines (the kernel places their output).
ATTENTION_MACROS = {"constants", "functions", "kernel_args", "scratch", "scratch_shapes"}
FFN_MACROS = ATTENTION_MACROS | {"hbm_args", "hbm_entry", "expert_shapes", "trace"}
# What a kind's module gives the plan's generic machinery: the LayerKind protocol's members.
MODULE_NAMES = {name for name in vars(LayerKind) if not name.startswith("_")}
ARITHMETIC = (nodes.Add, nodes.Sub, nodes.Mul, nodes.Div, nodes.FloorDiv, nodes.Mod,
              nodes.Pow, nodes.Neg)  # fmt: skip
COUNTING_FILTERS = {"length", "count", "sum", "max", "min", "round", "int", "float", "abs"}


def computations(source: str) -> list[str]:
    """Where a template computes instead of printing: arithmetic, counting filters,
    list appends and namespace counters, each as 'line N: what'."""
    found = []
    for node in environment().parse(source).find_all(nodes.Node):
        if isinstance(node, ARITHMETIC):
            found.append(f"line {node.lineno}: {type(node).__name__.lower()}")
        elif isinstance(node, nodes.Filter) and node.name in COUNTING_FILTERS:
            found.append(f"line {node.lineno}: | {node.name}")
        elif isinstance(node, nodes.Call) and _called(node) in ("append", "extend", "namespace"):
            found.append(f"line {node.lineno}: {_called(node)}()")
    return found


def _called(call: nodes.Call) -> str:
    """The name a call calls: a method's or a function's."""
    target = call.node
    return getattr(target, "attr", None) or getattr(target, "name", "")


def _schema_members(union: object) -> tuple[type, ...]:
    """The spec's kind classes of AttentionKind or FFNKind."""
    return typing.get_args(typing.get_args(union)[0])


def _schema_types(union: object) -> set[str]:
    return {typing.get_args(m.model_fields["type"].annotation)[0] for m in _schema_members(union)}


def _kernel_templates() -> list[str]:
    return [KERNEL_TEMPLATE, *macro_files()]


@pytest.mark.parametrize("template", _kernel_templates())
def test_the_kernel_templates_compute_nothing(template: str) -> None:
    assert computations(template_file(template).read_text()) == []


@pytest.mark.parametrize(
    "source",
    [
        "{{ a.rows * 8 }}",
        "{{ (a.group * rows + 7) // 8 }}",
        "{{ a.caches | length }}",
        "{{ [a.x, a.y] | max }}",
        "{% set group = [] %}{% set _ = group.append(1) %}",
        "{% set n = namespace(k=0) %}",
    ],
)
def test_the_template_lint_finds_computation(source: str) -> None:
    assert computations(source) != []


def test_the_template_lint_lets_printing_and_choosing_pass() -> None:
    source = '{% if a.gate %}{{ a.name | upper }}_X = {{ a.q_rows }}{% endif %}{{ "x" ~ a.name }}'
    assert computations(source) == []


@pytest.mark.parametrize(
    ("types", "macros"),
    [(_schema_types(AttentionKind), ATTENTION_MACROS), (_schema_types(FFNKind), FFN_MACROS)],
    ids=["attention", "ffn"],
)
def test_every_kind_of_the_schema_has_a_module_and_macros(
    types: set[str], macros: set[str]
) -> None:
    env = environment()
    for type_ in types:
        module = default_registry()[type_]
        assert set(vars(module)) >= MODULE_NAMES, type_
        # The kernel imports a record's macros by its type: kinds/<type>.py.j2.
        assert macro_name(type_) == module.TEMPLATE and module.TEMPLATE in macro_files(), type_
        defined = {m.name for m in env.parse(env.loader.get_source(env, module.TEMPLATE)[0])
                   .find_all(nodes.Macro)}  # fmt: skip
        assert macros <= defined, (type_, macros - defined)
    assert set(default_registry().types()) == _schema_types(AttentionKind) | _schema_types(FFNKind)


def test_a_kind_unknown_to_the_code_generator_is_one_line() -> None:
    with pytest.raises(SpecError, match=r"^attention_kinds\.x \(ssm\) is not supported"):
        default_registry().rules("ssm", "attention_kinds.x")


@pytest.mark.parametrize("module", sorted(default_registry().types()))
def test_a_kinds_module_imports_on_its_own(module: str) -> None:
    """A kind's module imported first (before mkgen.plan and the registry) finds the
    plan's records whole: the plan imports no kind back."""
    done = subprocess.run(
        [sys.executable, "-c", f"import mkgen.kinds.{module}"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr.strip().splitlines()[-1:]


def test_the_moe_kernel_and_program_follow_one_op_list(monkeypatch) -> None:
    """MoE's op order lives in one place (mkgen.kinds.moe.ops): swap two of its ops and
    the program and the rendered kernel both consume the stream in the new order."""
    plan = _kimi_plan()
    moe_kernel = next(f for f in plan.kernel.ffn if f.name == "moe")
    assert moe_kernel.ops.index("shared") < moe_kernel.ops.index("latent_out")
    assert plan.schedule.segment_order["moe"] == ["in", "shared_down", "latent_out"]
    original = moe.ops

    def swapped(kind: object) -> list[str]:
        order = original(kind)
        i, j = order.index("shared"), order.index("latent_out")
        order[i], order[j] = order[j], order[i]
        return order

    monkeypatch.setattr(moe, "ops", swapped)
    plan = _kimi_plan()
    consumed = consumed_segments(render_kernel(plan.kernel, ""), plan.kernel)
    assert plan.schedule.segment_order["moe"] == consumed["moe"]
    assert consumed["moe"] == ["in", "latent_out", "shared_down"]


def _kimi_plan():  # the program unchecked: a swapped order may wait on the ring
    options = BuildOptions.create(rows=8)
    return plan_build(
        load_spec("kimi-k3"),
        parse_topology("2x2x4"),
        options,
        enforce=False,
        kinds=default_registry(),
    )


def test_every_generated_expert_format_has_a_note_for_the_kernel() -> None:
    assert set(GENERATED_EXPERT_FORMATS) == set(moe.FORMAT_NOTES)


def _record_classes(base: type) -> list[type]:
    """The registered kinds' layout record classes (their RECORD) that extend `base`."""
    records = {default_registry().record(t) for t in default_registry().types()}
    return sorted((r for r in records if issubclass(r, base)), key=lambda r: r.__name__)


def test_every_layout_record_states_the_facts_the_later_stages_read() -> None:
    """The stages after the plan read these instead of a kind's name: class facts of the
    record (restored from plan.json by its type tag, never written into it), with
    own_heads naming head fields of a spec kind and counts of the record."""
    spec_fields = {f for m in _schema_members(AttentionKind) for f in m.model_fields}
    for record in _record_classes(AttentionRecord):
        assert isinstance(record.recurrent, bool), record.__name__
        assert set(record.own_heads) <= spec_fields, record.__name__
        assert set(record.own_heads.values()) <= set(record.model_fields), record.__name__
        assert {"recurrent", "own_heads"}.isdisjoint(record.model_fields), record.__name__
    for record in _record_classes(FFNRecord):
        assert isinstance(record.routed_experts, bool), record.__name__
        assert "routed_experts" not in record.model_fields, record.__name__
