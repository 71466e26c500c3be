"""The planner's store (mkgen/plan/store.py): a plan's calibrated regime and sensitivity
walked once and read back by the next plan of the same inputs, with the same figures; a
changed input or a changed mkgen is another entry; a broken entry is walked again; a file
mkgen did not write is never replaced; the store can be turned off."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

import mkgen.plan.confidence
import mkgen.plan.store
from mkgen.kinds import default_registry, dense
from mkgen.plan import BuildPlan, KindRegistry, plan_build
from mkgen.plan.options import BuildOptions
from mkgen.spec.loader import load_spec
from mkgen.spec.topology import parse_topology

SPEC = "qwen3-30b-a3b"  # routed experts on 4 chips: every sensitivity row but cross-host
TOPOLOGY = parse_topology("2x2x1")


def _plan(kinds: KindRegistry | None = None, **options: int) -> BuildPlan:
    return plan_build(
        load_spec(SPEC), TOPOLOGY, BuildOptions.create(**options),
        kinds=kinds or default_registry(),
    )  # fmt: skip


def _entries(store: Path) -> list[Path]:
    return sorted(store.glob("*.json"))


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MKGEN_CACHE_DIR", str(tmp_path / "store"))
    return tmp_path / "store"


def _no_walks(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_args: object) -> None:
        raise AssertionError("the plan walked again what the store holds")

    monkeypatch.setattr(mkgen.plan.confidence, "assess", refuse)


def test_a_second_plan_reads_the_walks_back_with_the_same_figures(
    store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = _plan()
    walked = first.to_json()
    assert len(_entries(store)) == 1
    _no_walks(monkeypatch)
    again = _plan()
    assert again.confidence == first.confidence
    assert again.to_json() == walked
    sensitivity = json.loads(walked)["estimate"]["sensitivity"]
    assert [row["input"] for row in sensitivity][:1] == ["core clock (GHz)"]


def test_another_input_or_another_mkgen_is_another_entry(
    store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    one = _plan().confidence
    two = _plan(batch=2).confidence
    assert len(_entries(store)) == 2
    assert one.calibrated_step_ms != two.calibrated_step_ms
    monkeypatch.setattr(mkgen.plan.store, "package_digest", lambda: "another mkgen")
    assert _plan().confidence == one
    assert len(_entries(store)) == 3


def test_a_broken_entry_is_walked_again_and_replaced(store: Path) -> None:
    figures = _plan().to_json()
    (entry,) = _entries(store)
    stored = json.loads(entry.read_text())
    stored["value"]["calibrated_step_ms"] = "not a number"
    entry.write_text(json.dumps(stored))
    assert _plan().to_json() == figures
    assert json.loads(entry.read_text())["value"]["calibrated_step_ms"] > 0


def test_a_file_mkgen_did_not_write_is_read_as_no_entry_and_kept(store: Path) -> None:
    figures = _plan().to_json()
    (entry,) = _entries(store)
    entry.write_text("my notes")
    assert _plan().to_json() == figures
    assert entry.read_text() == "my notes"


def test_an_empty_store_folder_setting_turns_the_store_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MKGEN_CACHE_DIR", "")
    monkeypatch.chdir(tmp_path)
    assert _plan().confidence.sensitivity
    assert list(tmp_path.iterdir()) == []


def test_a_kind_from_outside_mkgen_is_walked_every_time(store: Path) -> None:
    outside = types.ModuleType("my_kinds.dense")
    outside.__dict__.update({k: v for k, v in vars(dense).items() if not k.startswith("__")})
    kinds = KindRegistry({**default_registry().kinds, "dense": outside})
    assert _plan(kinds=kinds).confidence.sensitivity
    assert _entries(store) == []
