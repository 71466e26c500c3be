"""The KV tile of each cache attention kind, chosen by the cost model (docs/planner.md#kv-tiles).

A cache attention kind streams its cache in double-buffered tiles
(mkgen/kinds/cache_attention). A bigger tile issues fewer DMAs, each priced its issue cost,
and runs fewer loop trips, but reads more of a partly filled last tile and takes VMEM from
the weight ring and the expert slots. The candidates are options.kv_tile_candidates: the
KV_TILE_CHOICES up to the context that divide it; a candidate the planner
refuses (its buffers over the VMEM budget) is out. The kinds are chosen one at a time in
the spec's order, each with the others at their choice so far, by the predicted step of the
program with no refill held (the calibrated regime; the held refills are chosen afterwards,
for the chosen tiles). A bigger tile is kept only where it predicts a shorter step: with no
gain a kind keeps the context rule's tile (options.kv_tile).

The choice is plain data of the plan (plan.json's "kv_tiles", `mkgen plan --json`); the
kernel's templates print each kind's tile, never decide it. kvtiles.json beside this
module holds the choices of the builds planned again and again (the held-refill table's,
mkgen/plan/holds.py), keyed by the digest of what the walk reads; `python
scripts/tune_holds.py` rewrites both tables and tests/test_kv_tiles.py holds each entry to
what the scorer chooses today.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from mkgen.errors import SpecError
from mkgen.plan.options import kv_tile, kv_tile_candidates

if TYPE_CHECKING:
    from mkgen.plan.timeline import ProgramPlan


class KvTileChoice(BaseModel):
    """The planner's KV tile of each cache attention kind and the scores it chose by."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tiles: dict[str, int]  # cache attention kind -> cache tokens per streamed tile
    # kind -> candidate tile -> predicted step in ms with no refill held (the kinds before
    # it at their chosen tiles, the ones after it at the context rule's)
    scores: dict[str, dict[int, float]]
    refused: dict[str, dict[int, str]]  # kind -> candidate -> why the planner refused it


TABLE = Path(__file__).with_name("kvtiles.json")
# Choices made in this process, by the digest of what the walk reads (holds.hold_digest):
# every command and test plans the same builds again.
_CHOSEN: dict[str, KvTileChoice] = {}
_TUNING: list[bool] = []  # non-empty while the tuning script scores every build again


@contextmanager
def rescoring() -> Iterator[None]:
    """Within it, every build's tiles are scored, whatever either table says."""
    _TUNING.append(True)
    _CHOSEN.clear()
    try:
        yield
    finally:
        _TUNING.pop()


@cache
def _table() -> dict[str, KvTileChoice]:
    entries = json.loads(TABLE.read_text())["entries"]
    return {e["digest"]: KvTileChoice.model_validate(e["choice"]) for e in entries}


def known_choice(digest: str) -> KvTileChoice | None:
    """The tuned table's choice for `digest`, or one scored earlier in this process."""
    if _TUNING:
        return _CHOSEN.get(digest)
    return _table().get(digest) or _CHOSEN.get(digest)


def scored_choice(digest: str) -> KvTileChoice | None:
    """The choice scored in this process for `digest` (the tuning script's entries)."""
    return _CHOSEN.get(digest)


def choose_program(
    program_at: Callable[[dict[str, int]], ProgramPlan],
    names: list[str],
    context: int,
    step_ms: Callable[[ProgramPlan], float],
    digest: str,
) -> ProgramPlan:
    """The program at the fastest KV tiles of the cache kinds `names` (module docstring),
    its `kv_tiles` the choice. `program_at(tiles)` plans the program at those tiles (a
    SpecError when the planner refuses them); `step_ms` prices one. The program at the
    context rule's tiles is planned first: its refusal is the build's. A build whose
    `digest` is in the tuned table or was chosen before in this process is planned at its
    tiles only."""
    least = dict.fromkeys(names, kv_tile(context))
    if len(kv_tile_candidates(context)) == 1 or not names:
        return program_at(least)
    choice = known_choice(digest)
    if choice is None:
        choice = _CHOSEN[digest] = _score(program_at, least, context, step_ms)
    return program_at(choice.tiles)._replace(kv_tiles=choice)


def _score(
    program_at: Callable[[dict[str, int]], ProgramPlan],
    least: dict[str, int],
    context: int,
    step_ms: Callable[[ProgramPlan], float],
) -> KvTileChoice:
    """Each kind's candidates scored in turn, the others at their choice so far."""
    tiles = dict(least)
    walked: dict[tuple[int, ...], float] = {}

    def score(trial: dict[str, int]) -> float:
        key = tuple(trial.values())
        if key not in walked:
            program = program_at(trial)
            vmem = program.vmem
            # The context rule's tiles over the budget are the build's own failure (its
            # schedule check says so); a bigger tile's are a refusal.
            if trial != least and not vmem.within_budget:
                raise SpecError(
                    f"VMEM: {vmem.explicit_bytes:,} B explicit + {vmem.internal_bytes:,} B of "
                    f"Mosaic scratch, over the {vmem.budget_bytes:,} B budget or the "
                    f"{vmem.limit_bytes:,} B limit"
                )
            walked[key] = step_ms(program)
        return walked[key]

    score(tiles)  # the context rule's tiles: a refusal here is the build's own
    scores: dict[str, dict[int, float]] = {}
    refused: dict[str, dict[int, str]] = {}
    for name in least:
        scores[name], refused[name] = {}, {}
        for tile in kv_tile_candidates(context):
            try:
                scores[name][tile] = score({**tiles, name: tile})
            except SpecError as error:
                refused[name][tile] = str(error)
        # Ties keep the smaller tile: a bigger one must predict a gain.
        tiles[name] = min(scores[name], key=lambda t: (scores[name][t], t))
    return KvTileChoice(tiles=tiles, scores=scores, refused=refused)
