"""The generated build: atomic, deterministic, guarded against lost edits, injection-safe,
and its runner generates the reference model's greedy tokens in interpret mode."""

from __future__ import annotations

import ast
import io
import json
import os
import shutil
import subprocess
import sys
import tokenize
from pathlib import Path

import numpy as np
import pytest

from mkgen import __version__
from mkgen.codegen import digest, render, writer
from mkgen.codegen.build import identifier, safe_text
from mkgen.codegen.build_list import read_build_list
from mkgen.codegen.digest import inputs_digest
from mkgen.codegen.measurements import MEASUREMENTS, read_measurements
from mkgen.codegen.naming import CommandLine
from mkgen.codegen.package import load_build_inputs, make_build, record_measurement, render_build
from mkgen.codegen.writer import MANIFEST, local_edits, write_build
from mkgen.errors import MkgenError
from mkgen.plan.options import BuildOptions
from mkgen.spec.loader import load_spec
from mkgen.spec.topology import parse_topology

REPO = Path(__file__).resolve().parents[1]
FILES = {"megakernel.py", "runner.py", "plan.json", "REPORT.md"}


def _inputs(name: str = "qwen3-32b", topology: str = "2x2x1", **options):
    return load_spec(name), parse_topology(topology), BuildOptions.create(**options)


def _tree(directory: Path) -> dict[str, bytes]:
    return {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One qwen3-32b 2x2x1 build that the read-only tests share."""
    directory = tmp_path_factory.mktemp("builds") / "qwen3-32b-2x2x1"
    make_build(*_inputs(), output=directory)
    return directory


@pytest.fixture(scope="module")
def files() -> dict[str, str]:
    """The files of that build without its mini twin, rendered once for the tests that
    write them themselves (read-only: a test changes a copy)."""
    return render_build(*_inputs(), with_mini=False).files


def test_build_has_every_file_and_a_manifest_of_them(build_dir: Path) -> None:
    files = set(_tree(build_dir))
    assert FILES | {f"mini/{f}" for f in FILES} | {MANIFEST} == files
    manifest = json.loads((build_dir / MANIFEST).read_text())["files"]
    assert set(manifest) == files - {MANIFEST}
    plan = json.loads((build_dir / "plan.json").read_text())
    assert plan["kernel"]["model"] == "qwen3-32b"
    mini = json.loads((build_dir / "mini" / "plan.json").read_text())
    assert mini["kernel"]["model"] == "qwen3-32b-mini"
    # The mini kernel is the one `mkgen verify` proves: the same small banks and ring.
    from mkgen.codegen.package import MINI_BANK_ROWS, MINI_RING_DEPTH

    assert mini["kernel"]["stream"]["bank_rows"] == MINI_BANK_ROWS
    assert mini["kernel"]["stream"]["ring_depth"] == MINI_RING_DEPTH


def test_same_inputs_give_identical_bytes(build_dir: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    make_build(*_inputs(), output=again)
    assert _tree(again) == _tree(build_dir)
    other = render_build(*_inputs(context=2048), with_mini=False).files
    assert other["megakernel.py"] != _tree(build_dir)["megakernel.py"].decode()


def test_every_file_names_its_inputs(build_dir: Path) -> None:
    spec, topo, options = _inputs()
    plan = json.loads((build_dir / "plan.json").read_text())
    digest = inputs_digest(options.apply(spec), topo, options, plan["kernel_args"])
    assert plan["build"]["inputs_sha256"] == digest
    kernel = (build_dir / "megakernel.py").read_text()
    header = ast.get_docstring(ast.parse(kernel)) or ""
    for fragment in (
        "qwen3-32b",
        "tpu7x:2x2x1",
        f"mkgen {__version__}",
        f"Inputs sha256: {digest}",
        "DO NOT EDIT",
        "mkgen build qwen3-32b --topology 2x2x1 --force",
    ):
        assert fragment in header
        assert fragment in (build_dir / "runner.py").read_text()
        assert fragment in (build_dir / "REPORT.md").read_text()
    mini_kernel = (build_dir / "mini" / "megakernel.py").read_text()
    assert "qwen3-32b-mini" in mini_kernel and digest not in mini_kernel


def test_inputs_hash_covers_the_templates(tmp_path: Path, monkeypatch) -> None:
    spec, topo, options = _inputs()
    args = {"bank_rows": 4096, "ring_depth": 12}
    before = inputs_digest(spec, topo, options, args)
    for name in digest.template_files(spec):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(digest.template_file(name).read_bytes())
    monkeypatch.setattr(digest, "template_file", lambda name: tmp_path / name)
    assert inputs_digest(spec, topo, options, args) == before
    digests = set()
    for name in ("runner.py.j2", "kinds/dense.py.j2"):  # a layer kind's macros too
        with open(tmp_path / name, "a") as handle:
            handle.write("\n")
        digests.add(inputs_digest(spec, topo, options, args))
    assert before not in digests and len(digests) == 2


def test_the_inputs_hash_reads_the_templates_a_build_loads_and_no_other(
    tmp_path: Path, monkeypatch
) -> None:
    files = {
        "root.j2": '{% import "kinds/a.py.j2" as a %}{{ a.x() }}',
        "dynamic.j2": '{% import "kinds/" ~ kind ~ ".py.j2" as k %}',
        "kinds/a.py.j2": '{% import "kinds/b.py.j2" as b %}{% macro x() %}{% endmacro %}',
        "kinds/b.py.j2": "",
        "kinds/unused.py.j2": "",  # a kind folder no template imports
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(digest, "template_file", lambda name: tmp_path / name)
    assert tuple(digest.loaded_templates(("root.j2",), ["unused"])) == (
        "root.j2", "kinds/a.py.j2", "kinds/b.py.j2",
    )  # fmt: skip
    # An import by a record's type loads the macros of the build's kinds, and theirs.
    assert tuple(digest.loaded_templates(("dynamic.j2",), ["a"])) == (
        "dynamic.j2", "kinds/a.py.j2", "kinds/b.py.j2",
    )  # fmt: skip


def test_the_kernel_hashes_the_macros_of_its_specs_kinds_only() -> None:
    spec, _, _ = _inputs()  # GQA attention and dense FFN
    kinds = {name for name in digest.template_files(spec) if name.startswith("kinds/")}
    assert {"kinds/gqa.py.j2", "kinds/dense.py.j2", "kinds/cache_attention.py.j2"} <= kinds
    assert not kinds & {"kinds/moe.py.j2", "kinds/mla.py.j2", "kinds/kda.py.j2"}


def test_inputs_hash_covers_the_formatter_version(monkeypatch) -> None:
    spec, topo, options = _inputs()
    args = {"bank_rows": 4096, "ring_depth": 12}
    before = inputs_digest(spec, topo, options, args)
    monkeypatch.setattr(digest, "formatter_version", lambda: "0.0.1")
    assert inputs_digest(spec, topo, options, args) != before


def test_a_formatter_failure_is_not_reported_as_a_parse_error(monkeypatch) -> None:
    with pytest.raises(MkgenError, match="generated code does not parse: Failed to parse at 1:7"):
        render.format_python("def f(:\n")
    monkeypatch.setattr(render, "FORMAT_COMMAND", [sys.executable, "-m", "no_such_formatter"])
    with pytest.raises(MkgenError) as raised:
        render.format_python("x = 1\n")
    assert "does not parse" not in str(raised.value)
    assert "formatting generated code failed" in str(raised.value)
    assert "No module named no_such_formatter" in str(raised.value)


COMPILE_RECORD = {  # what `mkgen compile --update-report` records (checks.CompileOutcome)
    "build": "qwen3-32b-2x2x1",
    "topology": "tpu7x:2x2x1",
    "seconds": 2.5,
    "vmem_bytes": 31_187_968,
    "plan_vmem_bytes": None,
    "scratch_padded_bytes": 29_245_440,
    "jax": "x",
    "libtpu": "y",
}


def test_kind_order_is_an_input(tmp_path: Path) -> None:
    """The order of a spec's kinds numbers them in the kernel: it changes the hash, and a
    saved build (plan.json) re-renders byte for byte (muse-spark lists local before global)."""
    spec, topo, options = _inputs("muse-spark-1.2")
    args = {"bank_rows": 4096, "ring_depth": 12}
    flipped = spec.model_copy(
        update={"attention_kinds": dict(reversed(spec.attention_kinds.items()))}
    )
    assert inputs_digest(spec, topo, options, args) != inputs_digest(flipped, topo, options, args)
    target = tmp_path / "build"
    make_build(spec, topo, options, output=target)
    before = _tree(target)
    loaded = load_build_inputs(target)[0]
    assert list(loaded.attention_kinds) == list(spec.attention_kinds) == ["local", "global"]
    record_measurement(target, "compile", COMPILE_RECORD)
    after = _tree(target)
    assert {k for k in after if after[k] != before.get(k)} == {
        "REPORT.md", MEASUREMENTS, MANIFEST,
    }  # fmt: skip


def test_a_failure_mid_render_leaves_no_directory(
    files: dict[str, str], tmp_path: Path, monkeypatch
) -> None:
    target = tmp_path / "out" / "build"
    real = writer._write_tree

    def half_then_fail(root: Path, tree: dict[str, str]) -> None:
        real(root, dict(list(tree.items())[:2]))
        raise OSError("disk full")

    monkeypatch.setattr(writer, "_write_tree", half_then_fail)
    with pytest.raises(MkgenError, match=f"^cannot write the build {target}: disk full$"):
        write_build(files, target, force=False)
    assert not target.exists()
    assert list(target.parent.iterdir()) == []  # no temp directory left beside it


def test_a_failure_keeps_the_previous_build(files: dict[str, str], tmp_path: Path) -> None:
    target = tmp_path / "build"
    write_build(files, target, force=False)
    before = _tree(target)
    broken = {**files, "runner.py": "def broken(:\n"}  # a check before the swap fails
    with pytest.raises(SyntaxError):
        write_build(broken, target, force=True)
    assert _tree(target) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["build"]


def test_local_edits_are_refused_without_force(files: dict[str, str], tmp_path: Path) -> None:
    target = tmp_path / "build"
    assert write_build(files, target, force=False)
    assert not write_build(files, target, force=False)  # unchanged: nothing to do
    (target / "__pycache__").mkdir()  # bytecode caches do not count as edits
    (target / "__pycache__" / "megakernel.cpython-312.pyc").write_bytes(b"\0")
    assert not write_build(files, target, force=False)
    runner = target / "runner.py"
    runner.write_text(runner.read_text() + "# my tweak\n")
    with pytest.raises(MkgenError, match=r"runner\.py was edited .*pass --force"):
        write_build(files, target, force=False)
    assert runner.read_text().endswith("# my tweak\n")
    assert write_build(files, target, force=True)
    assert runner.read_text() == files["runner.py"]
    (target / "notes.txt").write_text("mine")
    with pytest.raises(MkgenError, match=r"notes\.txt was added"):
        make_build(*_inputs(), output=target)
    (target / "notes.txt").unlink()
    (target / "plan.json").unlink()
    with pytest.raises(MkgenError, match=r"plan\.json was deleted"):
        write_build(files, target, force=False)


def test_a_directory_that_is_not_a_build_is_not_replaced(
    files: dict[str, str], tmp_path: Path
) -> None:
    target = tmp_path / "precious"
    target.mkdir()
    (target / "thesis.tex").write_text("years of work")
    with pytest.raises(MkgenError, match="mkgen did not write"):
        write_build(files, target, force=False)
    assert (target / "thesis.tex").exists()


HOSTILE = (
    'x"""\nimport os; os.system("PWNED")  # \\\n\'\'\'\r\n-->\n<script>PWNED()</script> '
    "\\N{BULLET} \u2028 {{ L.model }} {% raw %} ${PWNED}"
)


def test_spec_text_lands_only_inside_strings_and_comments() -> None:
    spec, topo, options = _inputs()
    spec = spec.model_copy(update={"description": HOSTILE})
    files = render_build(spec, topo, options, with_mini=False).files
    for name in ("megakernel.py", "runner.py"):
        source = files[name]
        tree = ast.parse(source)
        assert "PWNED" in (ast.get_docstring(tree) or "")  # the text is there, quoted
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if "PWNED" in tok.string:
                assert tok.type in (tokenize.STRING, tokenize.COMMENT), (name, tok)
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "system"]
        assert not calls, name
    report = files["REPORT.md"]
    assert report.count("-->") == 1 and "<script>" not in report
    for name in ("megakernel.py", "runner.py"):  # template syntax in a value stays text
        assert "{{ L.model }} {% raw %}" in (ast.get_docstring(ast.parse(files[name])) or "")
    assert json.loads(files["plan.json"])["spec"]["description"] == HOSTILE
    assert ast.literal_eval(safe_text(HOSTILE)) == HOSTILE
    for bad in ("os.system('x')", "a-b", "naïve", "x\n"):
        with pytest.raises(MkgenError):
            identifier(bad)
    assert identifier("global") == "global"  # muse-spark's kind: always affixed
    with pytest.raises(MkgenError):
        identifier("global", bare=True)


def test_checked_in_builds_regenerate_byte_for_byte(checked_in_renders, tmp_path: Path) -> None:
    assert [e.spec for e in read_build_list()][:1] == ["qwen3-32b"]
    for checked_in, _, rendered in checked_in_renders:
        assert checked_in.is_dir(), f"{checked_in} missing: run `make regen`"
        fresh = tmp_path / checked_in.name
        write_build(rendered.files, fresh, force=False)  # as make_build writes a new build
        ours, theirs = _tree(fresh), _tree(checked_in)
        assert set(ours) == set(theirs), f"{checked_in}: run `make regen`"
        stale = [name for name in ours if ours[name] != theirs[name]]
        assert not stale, f"{checked_in}: {stale} differ from a fresh build; run `make regen`"


def test_every_reports_step_carries_its_calibrated_regime_and_range(checked_in_renders) -> None:
    """REPORT.md states beside its predicted step the calibrated regime and the lowest and
    highest step of its sensitivity table (verify + draft where the step is)."""
    for checked_in, _, rendered in checked_in_renders:
        confidence = rendered.plan.confidence
        said = confidence.beside_step()
        draft = confidence.draft_ms or 0.0
        steps = [s + draft for r in confidence.sensitivity for s in (r.step_ms_low, r.step_ms_high)]
        assert said.startswith(f"{confidence.calibrated_step_ms + draft:.3f} ms in the calibrated")
        assert f"; {min(steps):.3f} to {max(steps):.3f} ms with one unmeasured input" in said
        report = " ".join(rendered.files["REPORT.md"].split())
        headline, beside = report.index("tokens/s per user"), report.index(f"Beside it: {said}")
        assert headline < beside < report.index("How far to trust it"), checked_in


def test_measurements_survive_a_rebuild_only_while_inputs_match(
    build_dir: Path, tmp_path: Path
) -> None:
    target = shutil.copytree(build_dir, tmp_path / "build")  # what make_build(*_inputs()) writes
    record_measurement(target, "compile", COMPILE_RECORD)
    assert "| compile time | 2.5 s |" in (target / "REPORT.md").read_text()
    assert not make_build(*_inputs(), output=target).written  # kept, nothing to rewrite
    dropped = make_build(*_inputs(context=2048), output=target)  # other inputs: stale
    assert dropped.dropped == ("compile",)  # and said so
    assert not (target / MEASUREMENTS).exists()
    assert "Not measured in this build" in (target / "REPORT.md").read_text()


def test_a_build_names_no_directory_so_a_copy_keeps_its_bytes_and_measurements(
    build_dir: Path, tmp_path: Path
) -> None:
    first = shutil.copytree(build_dir, tmp_path / "first-place")
    record_measurement(first, "compile", COMPILE_RECORD)
    # Written with -o as a user types it: the files still name no directory.
    make_build(*_inputs(), output=first, line=CommandLine(output=str(first)))
    assert all(b"first-place" not in data for data in _tree(first).values())
    moved = shutil.copytree(first, tmp_path / "elsewhere" / "moved")
    again = make_build(*_inputs(), output=moved, line=CommandLine(output=str(moved)))
    assert not again.written and again.dropped == ()  # the same inputs: nothing to rewrite
    assert read_measurements(moved)["compile"] == COMPILE_RECORD


def test_runner_help_says_where_weights_come_from(build_dir: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(build_dir / "runner.py"), "--help"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "--interpret" in text and "--random-weights SEED" in text
    assert "--weights DIR" in text and "mkgen convert" in text


# Runs a build's runner with its drafter an oracle that proposes the reference's own
# continuation: its first `right` drafts of a call are right, the rest wrong (argv:
# runner, JSON [prompts, expected, right], args...).
ORACLE = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("runner", sys.argv[1])
runner = importlib.util.module_from_spec(spec)
spec.loader.exec_module(runner)
prompts, expected, right = json.loads(sys.argv[2])

def drafts(history, count):
    b = next(i for i, p in enumerate(prompts) if history[: len(p)] == p)
    future = expected[b][len(history) - len(prompts[b]) :][:count]
    future += [history[-1]] * (count - len(future))
    return future[:right] + [(t + 1) % runner.VOCAB_USED for t in future[right:]]

runner.run(runner.BUILD, [*sys.argv[3:], "--drafter", "__main__:drafts"])
"""


def _reference_tokens(runner: Path, prompts: list[list[int]], steps: int) -> list[list[int]]:
    from mkgen.reference import model as reference
    from mkgen.spec.schema import ModelSpec
    from mkgen.weights.quantize import stored_random_weights

    spec = ModelSpec.model_validate(json.loads((runner.parent / "plan.json").read_text())["spec"])
    weights = stored_random_weights(spec, 0)  # what the kernel stores
    return reference.generate(spec, weights, np.array(prompts), steps).tolist()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("spec", "topology", "batch", "rows", "right"),
    [
        ("qwen3-32b", "2x2x1", 2, 3, 2),  # every draft right
        ("qwen3.8-27b", "1x1x1", 1, 3, 1),  # Gated DeltaNet: one draft of two rejected
    ],
)
def test_runner_matches_the_reference_in_interpret_mode(
    tmp_path: Path, spec: str, topology: str, batch: int, rows: int, right
) -> None:
    """The mini build's runner (virtual CPU devices, TPU interpret mode): prefill in XLA,
    greedy decode through the megakernel, verifying drafts when rows > 1 from an oracle
    whose first `right` drafts of a call are right (over recurrent state a rejected draft
    row must leave no trace: the runner keeps the state snapshot after the last accepted
    row); the tokens equal reference.generate's."""
    build_dir = tmp_path / "build"
    make_build(*_inputs(spec, topology, batch=batch, rows=rows), output=build_dir)
    prompts, steps = [[5, 6, 7, 5], [9, 9, 9, 9]][:batch], 5
    runner = build_dir / "mini" / "runner.py"
    expected = _reference_tokens(runner, prompts, steps)
    ids = [arg for p in prompts for arg in ("--prompt-ids", ",".join(map(str, p)))]
    args = ["--interpret", "--random-weights", "0", "--json", "--steps", str(steps), *ids]
    command = [sys.executable, str(runner), *args]
    if right is not None:
        oracle = json.dumps([prompts, expected, right])
        command = [sys.executable, "-c", ORACLE, str(runner), oracle, *args]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=300, cwd=build_dir,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["tokens"] == expected
    assert ("acceptance_length" in out) == (rows > 1)
    if right is not None:  # rows of 3: the tokens a call gains, at most right + 1
        assert right < out["acceptance_length"] <= right + 1
    assert local_edits(build_dir) is None  # running it left the build as written


def test_the_verify_table_counts_the_routing_near_ties_it_followed(
    build_dir: Path, tmp_path: Path
) -> None:
    from mkgen.verify.checks import verify_record
    from mkgen.verify.numerics import NumericsReport, StepCheck

    report = NumericsReport("qwen3-32b", "2x2x1", 8, "on_wait", 1, 1)
    tie = "layer 1 token 0: near tie, the kernel chose experts [2, 6] for the reference's [2, 5]"
    report.steps = [
        StepCheck(
            step=s,
            max_logit_diff=0.001,
            logit_tolerance=0.08,
            tokens_equal=1,
            tokens_near_tie=0,
            tokens_total=1,
            max_cache_diff=0.01,
            cache_tolerance=0.06,
            max_residual_diff=0.001,
            residual_tolerance=0.02,
            first_diverging_layer=None,
            finite=True,
            cores_identical=True,
            seconds=1.0,
            route_ties=[tie] * s,
        )  # fmt: skip
        for s in range(3)
    ]
    target = shutil.copytree(build_dir, tmp_path / "build")
    record = verify_record([report], steps=3, batch=1, rows=1, context=128, seed=7)
    record_measurement(target, "verify", record)
    text = (target / "REPORT.md").read_text()
    assert "| routing near ties | seconds |" in text  # no drafts column: the kernel drafts none
    assert "context 128, random weights seed 7):" in text
    assert "| on_wait | pass | 3 |" in text
    row = next(line for line in text.splitlines() if "| on_wait |" in line)
    assert row.split("|")[-3].strip() == "3"  # 0 + 1 + 2 ties over the three steps
    # A kernel that drafts: its drafts equal to the reference drafter's, over the steps.
    report.steps[0].drafts_total, report.steps[0].drafts_equal = 2, 2
    report.steps[1].drafts_total, report.steps[1].drafts_near_tie = 2, 2
    record = verify_record([report], steps=3, batch=1, rows=3, context=128, seed=7)
    record_measurement(target, "verify", record)
    text = (target / "REPORT.md").read_text()
    assert "| routing near ties | drafts equal | seconds |" in text
    row = next(line for line in text.splitlines() if "| on_wait |" in line)
    assert row.split("|")[-3].strip() == "2/4 (2 after a near tie)"


def test_report_says_why_the_router_is_split_or_replicated() -> None:
    report = render_build(*_inputs("qwen3-30b-a3b"), with_mini=False).files["REPORT.md"]
    rows = [line for line in report.splitlines() if line.startswith("| ffn moe | router |")]
    assert len(rows) == 1, rows
    # Without a latent the scores would need an all-gather of their own: replicated wins.
    assert rows[0].startswith("| ffn moe | router | replicated | router replicated: split + ")
    assert "scores all-gathered" in rows[0] and rows[0].endswith(" us per layer |")
