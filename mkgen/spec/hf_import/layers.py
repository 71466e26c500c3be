"""Compact layer tables: a per-layer list of kind names written as a default or a
pattern plus the fewest rules (the spec's `LayerAssignment`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mkgen.spec.schema import LayerAssignment


def _rule_cost(rule: dict[str, Any]) -> int:
    if "indices" in rule:
        return 1 + len(rule["indices"])
    if "every" in rule:
        return 3 if rule.get("offset") else 2
    return 2


def _apply(table: list[str], rule: dict[str, Any]) -> list[str]:
    n = len(table)
    if "every" in rule:
        picked = range(rule.get("offset", 0), n, rule["every"])
    elif "first" in rule:
        picked = range(min(rule["first"], n))
    elif "last" in rule:
        picked = range(max(0, n - rule["last"]), n)
    else:
        picked = rule["indices"]
    out = list(table)
    for i in picked:
        out[i] = rule["kind"]
    return out


def _greedy_rules(base: list[str], target: list[str]) -> list[dict[str, Any]]:
    """Rules that turn `base` into `target`: each step takes the every/first/last rule that
    fixes the most layers net of its cost; leftovers become one `indices` rule per kind."""
    n = len(target)
    kinds = sorted(set(target))
    current = list(base)
    rules: list[dict[str, Any]] = []
    for _ in range(n):
        if current == target:
            break
        best: tuple[int, int, dict[str, Any]] | None = None
        for kind in kinds:
            # gain of writing `kind` on layer i: fixes it if wrong now, breaks it if right.
            delta = [
                (cur != want) - (kind != want) for cur, want in zip(current, target, strict=True)
            ]
            candidates: list[tuple[int, dict[str, Any]]] = []
            for every in range(2, n):
                for offset in range(every):
                    rule = {"kind": kind, "every": every}
                    if offset:
                        rule["offset"] = offset
                    candidates.append((sum(delta[offset::every]), rule))
            head = tail = 0
            for m in range(1, n):
                head += delta[m - 1]
                tail += delta[n - m]
                candidates.append((head, {"kind": kind, "first": m}))
                candidates.append((tail, {"kind": kind, "last": m}))
            for gain, rule in candidates:
                if gain <= 0:
                    continue
                cost = _rule_cost(rule)
                if best is None or (gain - cost, -cost) > best[:2]:
                    best = (gain - cost, -cost, rule)
        # An explicit list of the fixed layers would cost 1 + gain: take the rule when it
        # costs no more than that (a first/last/every rule reads better than a list).
        if best is None or best[0] < -1:
            break
        rules.append(best[2])
        current = _apply(current, best[2])
    for kind in kinds:
        rest = [i for i in range(n) if current[i] != target[i] and target[i] == kind]
        if rest:
            rules.append({"kind": kind, "indices": rest})
            current = _apply(current, rules[-1])
    return rules


def compact_layer_assignment(table: Sequence[str]) -> dict[str, Any]:
    """The most compact LayerAssignment (as plain data) whose expansion equals `table`.

    Candidates: each kind as the default, and each short repeating pattern (period 2..8,
    the majority kind at each position); each followed by greedily chosen every/offset,
    first and last rules, then explicit indices for whatever is left. The cheapest by
    the number of values written wins (ties: fewer rules, then a default over a pattern,
    then the most common kind as the default).
    """
    target = list(table)
    n = len(target)
    if not n:
        raise ValueError("empty layer table")
    options: list[tuple[int, int, int, int, dict[str, Any]]] = []
    for kind in sorted(set(target)):
        rules = _greedy_rules([kind] * n, target)
        cost = 1 + sum(map(_rule_cost, rules))
        options.append(
            (cost, len(rules), 0, -target.count(kind), {"default": kind, "rules": rules})
        )
    for period in range(2, min(8, n - 1) + 1):
        pattern = []
        for r in range(period):
            column = target[r::period]
            pattern.append(max(sorted(set(column)), key=column.count))
        if len(set(pattern)) < 2:
            continue
        base = [pattern[i % period] for i in range(n)]
        rules = _greedy_rules(base, target)
        cost = period + sum(map(_rule_cost, rules))
        options.append((cost, len(rules), 1, 0, {"pattern": pattern, "rules": rules}))
    best = min(options, key=lambda o: o[:4])[4]
    data = {k: v for k, v in best.items() if v or k != "rules"}
    expanded = LayerAssignment.model_validate(data).expand(n, "layers")
    if expanded != target:  # a bug here, never a user error
        raise AssertionError(f"compact_layer_assignment: {data} does not expand to {target}")
    return data
