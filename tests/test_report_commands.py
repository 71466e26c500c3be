"""The commands a build prints (REPORT.md, `mkgen build`'s next: line) run as printed."""

from __future__ import annotations

import re
import shlex

from cli_run import mkgen_here


def _report_commands(report: str) -> list[str]:
    """Every `mkgen VERB ARGS` command quoted in backticks in a REPORT.md (a bare
    `mkgen build` in the prose names a command, it is not one to run)."""
    return re.findall(r"`(mkgen [a-z-]+ [^`]+)`", report)


def test_an_o_build_prints_commands_that_run_as_printed(tmp_path) -> None:
    built = mkgen_here("build", "qwen3-30b-a3b", "--topology", "2x2x1", "-o", "out", cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    next_line = built.stdout.strip().splitlines()[-1]
    commands = set(_report_commands((tmp_path / "out" / "REPORT.md").read_text()))
    commands |= set(_report_commands((tmp_path / "out" / "mini" / "REPORT.md").read_text()))
    by_verb: dict[str, list[str]] = {}
    for command in sorted(commands):
        by_verb.setdefault(shlex.split(command)[1], []).append(command)
    # The files name no directory (a copy elsewhere keeps its bytes): they name the build
    # in generated/; the next: line names this one, and its commands run as printed.
    assert by_verb["build"] == ["mkgen build qwen3-30b-a3b --topology 2x2x1 --force"]
    assert sorted(by_verb["inspect"]) == [
        "mkgen inspect qwen3-30b-a3b-2x2x1", "mkgen inspect qwen3-30b-a3b-2x2x1/mini"
    ]  # fmt: skip
    for path in (tmp_path / "out").rglob("*"):
        if path.is_file():
            assert b"-o out" not in path.read_bytes(), path
            assert str(tmp_path).encode() not in path.read_bytes(), path
    printed = [c.strip() for c in next_line.removeprefix("next: ").split(";")]
    assert [shlex.split(c)[1] for c in printed] == ["verify", "compile", "inspect"]
    for command in printed[:2]:
        assert shlex.split(command)[-3:] == ["-o", "out", "--update-report"], command
    again = mkgen_here(*shlex.split(by_verb["build"][0])[1:], "-o", "out", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "is up to date" in again.stdout  # the rebuild the report names, given its -o
    shown = mkgen_here(*shlex.split(printed[2])[1:], cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "megakernel.py" in shown.stdout


def test_a_default_build_prints_no_output_flag(tmp_path) -> None:
    from mkgen.codegen.package import render_build
    from mkgen.plan.options import BuildOptions
    from mkgen.spec.loader import load_spec
    from mkgen.spec.topology import parse_topology

    options = BuildOptions.create(rows=4, acceptance=2)
    files = render_build(load_spec("qwen3-32b"), parse_topology("2x2x1"), options).files
    commands = _report_commands(files["REPORT.md"])
    assert "mkgen build qwen3-32b --topology 2x2x1 --rows 4 --acceptance 2 --force" in commands
    assert "mkgen verify qwen3-32b --topology 2x2x1 --rows 4 --update-report" in commands
    assert "mkgen inspect qwen3-32b-2x2x1" in commands
    assert not any(" -o " in c for c in commands), commands
