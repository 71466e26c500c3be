"""How many ring refills a build holds for its collectives: scored by the cost model, or
read from the table of tuned choices checked in beside this module (holds.json).

The planner's question (docs/planner.md#held-refills): how many of the last used-up
banks' refills wait for a collective round, and how many of them a round starts. The
scorer walks about ten programs and keeps the fastest: about a second for Kimi K3, on
every plan of the same build, and a second a point of an estimate sweep. holds.json answers for the builds that are
planned again and again (the checked-in builds, the benchmark's plans), keyed by a digest
of everything the scorer reads: the spec, the topology, the options that shape the
program, the weight banks, ring depth and expert pieces, and the cost model's constants
(the catalog's figures and the op-count model's measured tables). A build whose digest is
not in the table is scored, once per process.

The digest does not cover mkgen's own code (the schedule, the walk): tests/test_holds.py
scores every entry again and fails when one is no longer what the scorer would choose;
`python scripts/tune_holds.py` rewrites the table (with `SPEC TOPOLOGY [FIELD=VALUE ...]`
it adds that build's entry first).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

from mkgen.plan.cost import CostConstants
from mkgen.plan.opcount import measured_tables
from mkgen.plan.options import BuildOptions
from mkgen.spec.schema import ModelSpec
from mkgen.spec.topology import Topology

TABLE = Path(__file__).with_name("holds.json")
# Options that do not change the program or its walk's step: left out of the digest so
# that a plan at another acceptance or price finds the same entry.
_NOT_PRICED = {"acceptance", "price_per_chip_hour_usd", "held_refills"}
# Kernel modes the VMEM plan chooses from the other inputs when not forced: left out of
# the digest unless forced (a forced mode is an input; a chosen one follows from them);
# so is the expert sharing when auto (the planner's choice, mkgen.plan.sharding).
_CHOSEN_MODES = ("residual_snapshots", "recurrent_states")


class HoldChoice(NamedTuple):
    held: int  # refills held for the collectives
    per_round: int  # held refills each collective round starts


def hold_digest(
    spec: ModelSpec,
    topo: Topology,
    options: BuildOptions,
    shape: dict[str, Any],
) -> str:
    """sha256 of what the scorer reads (module docstring); `shape` holds plan_program's
    arguments that size the program and the ring depth the VMEM plan chose."""
    constants = CostConstants.from_chip(topo.chip_info, options)
    payload = {
        "spec": spec.model_dump(mode="json"),
        "topology": topo.name,
        "options": options.model_dump(
            mode="json",
            exclude=_NOT_PRICED
            | {m for m in _CHOSEN_MODES if getattr(options, m) is None}
            | ({"expert_sharing"} if options.expert_sharing == "auto" else set()),
        ),
        "shape": shape,
        # Every figure the walk computes with; not the price, the sources' text or the
        # clock's range (the sensitivity table's ends), which no walk of a plan reads.
        "constants": constants.model_dump(
            mode="json",
            exclude={
                "price_per_chip_hour_usd": True,
                "sources": True,
                "issue_rates": {"clock_range_hz", "clock_source"},
            },
        ),
        "op_counts": measured_tables(),
    }
    text = json.dumps(payload, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


@cache
def _table() -> dict[str, HoldChoice]:
    entries = json.loads(TABLE.read_text())["entries"]
    return {e["digest"]: HoldChoice(e["held_refills"], e["refills_per_round"]) for e in entries}


# Choices scored in this process (every command and test plans the same builds again).
_SCORED: dict[str, HoldChoice] = {}


def known_choice(digest: str) -> HoldChoice | None:
    """The tuned table's choice for `digest`, or one scored earlier in this process."""
    return _table().get(digest) or _SCORED.get(digest)


def score_holds(
    step_ms: Callable[[HoldChoice], float], flight: int, most: int
) -> tuple[HoldChoice, dict[int, dict[int, float]]]:
    """The fastest hold and every score: for rounds that start the `flight` refills their
    flight covers and for rounds that start all `most` held ones, 0, most / 2, 3 most / 4
    and `most` held, then from the fastest of all one count at a time while a neighbour is
    faster. Returns the choice and {refills a round: {held: predicted step ms}}."""
    found: dict[int, dict[int, float]] = {r: {} for r in sorted({flight, max(most, 1)})}

    def score(held: int, per_round: int) -> float:
        scores = found[per_round]
        if held not in scores:
            scores[held] = step_ms(HoldChoice(held, per_round))
            if held == 0:  # nothing held: the release rule does not matter
                for other in found.values():
                    other[0] = scores[0]
        return scores[held]

    for per_round in found:
        for held in (0, most // 2, 3 * most // 4, most):
            score(held, per_round)
    per_round = min(found, key=lambda r: min(found[r].values()))
    for way in (-1, 1):
        held = min(found[per_round], key=found[per_round].__getitem__)
        while 0 <= held + way <= most and score(held + way, per_round) < score(held, per_round):
            held += way
    found = {r: dict(sorted(s.items())) for r, s in found.items()}
    per_round = min(found, key=lambda r: min(found[r].values()))
    held = min(found[per_round], key=found[per_round].__getitem__)
    return HoldChoice(held, per_round), found


def remember(digest: str, choice: HoldChoice) -> None:
    _SCORED[digest] = choice
