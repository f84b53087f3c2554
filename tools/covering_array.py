"""A covering array of strength t: few rows (a value for every factor) such that every t values of t
different factors appear together in at least one row that the constraints allow.

    rows = covering_array({"a": [0, 1], "b": [0, 1, 2], "c": ["x", "y"]}, strength=2,
                          constraints=[(("a", "c"), lambda row: not (row.get("a") == 1 and row.get("c") == "y"))])

A constraint is (the factors it reads, a predicate on a row). The row may be partial (a dict of the
factors assigned so far); the predicate returns False only when the values already assigned break it,
whatever the others become. It is asked again whenever one of its factors is assigned. A t-tuple that
no allowed row holds is left out (`coverable` tells them apart).

The construction is AETG's greedy one (Cohen et al., 1997), seeded and so deterministic: each new row
is the best of `candidates` rows (the most uncovered tuples per unit of `cost`), each started from a
random uncovered tuple and completed, factor by factor in a random order, with the value that covers
the most still-uncovered tuples (ties broken by `cost`, then at random). A completion that reaches a
factor with no allowed value is redone with a search that never assigns a value after which no
allowed completion exists. Rows whose tuples the others all hold are dropped. Several seeds are tried
and the array of the lowest total cost (then the fewest rows) is kept.
"""

import itertools
import random
from collections.abc import Callable

Row = dict[str, object]
Constraint = tuple[tuple[str, ...], Callable[[Row], bool]]


class _Rules:
    """The constraints by factor: `fits(row, name)` checks only those reading `name`."""

    def __init__(self, factors: dict[str, list], constraints: list[Constraint]):
        self.factors = factors
        self.by_factor = {name: [predicate for names, predicate in constraints if name in names] for name in factors}

    def fits(self, row: Row, name: str) -> bool:
        return all(predicate(row) for predicate in self.by_factor[name])

    def allows(self, row: Row) -> bool:
        return all(self.fits(row, name) for name in row)

    def complete(self, row: Row) -> Row | None:
        """An allowed full row extending the allowed `row` (the missing factors filled in table order, first
        values first), or None when there is none: a depth-first search."""
        name = next((name for name in self.factors if name not in row), None)
        if name is None:
            return dict(row)
        for value in self.factors[name]:
            row[name] = value
            found = self.complete(row) if self.fits(row, name) else None
            del row[name]
            if found is not None:
                return found
        return None


def _tuples(factors: dict[str, list], strength: int) -> list[frozenset]:
    """Every t-tuple, a frozenset of (factor, value) pairs, in table order."""
    return [frozenset(zip(group, values)) for group in itertools.combinations(factors, strength)
            for values in itertools.product(*(factors[name] for name in group))]


def covered_by(row: Row, strength: int) -> set:
    """The t-tuples a full row holds (frozensets of (factor, value) pairs)."""
    return {frozenset(group) for group in itertools.combinations(row.items(), strength)}


def coverable(factors: dict[str, list], strength: int, constraints: list[Constraint] = ()) -> tuple[set, list]:
    """(the t-tuples some allowed row holds, the ones none does)."""
    rules = _Rules(factors, list(constraints))
    reachable, unreachable = set(), []
    for combination in _tuples(factors, strength):
        row = dict(combination)
        if rules.allows(row) and rules.complete(row) is not None:
            reachable.add(combination)
        else:
            unreachable.append(combination)
    return reachable, unreachable


def _gain(row: Row, name: str, uncovered: set, strength: int) -> int:
    """How many uncovered t-tuples `row[name]` completes with the row's other assigned factors."""
    others = [(other, value) for other, value in row.items() if other != name]
    return sum(frozenset((*group, (name, row[name]))) in uncovered
               for group in itertools.combinations(others, strength - 1))


def _candidate(rules: _Rules, start: frozenset, uncovered: set, strength: int, generator: random.Random,
               cost, careful: bool) -> Row | None:
    """A row holding the tuple `start`, completed greedily in a random factor order. Only `careful` checks
    that an allowed completion exists after each value; then None means that no allowed row holds
    `start`, else that the completion reached a factor with no allowed value."""
    row = dict(start)
    if careful and rules.complete(row) is None:
        return None
    rest = [name for name in rules.factors if name not in row]
    generator.shuffle(rest)
    for name in rest:
        options = []
        for value in rules.factors[name]:
            row[name] = value
            if rules.fits(row, name) and (not careful or rules.complete(row) is not None):
                options.append((-_gain(row, name, uncovered, strength), cost(row), generator.random(), value))
            del row[name]
        if not options:
            return None
        row[name] = min(options, key=lambda option: option[:3])[3]
    return {name: row[name] for name in rules.factors}


def _one_array(rules: _Rules, tuples: list, strength: int, seed: int, candidates: int, cost) -> list[Row]:
    """Rows covering every tuple of `tuples` that an allowed row can hold."""
    generator = random.Random(seed)
    position = {name: index for index, name in enumerate(rules.factors)}
    uncovered, rows, impossible = set(tuples), [], set()
    while uncovered:
        # Sorted, since a set's order changes with the hash seed.
        pool = sorted(uncovered, key=lambda tup: sorted((position[name], repr(value)) for name, value in tup))
        best = None
        for _ in range(candidates):
            start = generator.choice(pool)
            if start in impossible:
                continue
            row = (_candidate(rules, start, uncovered, strength, generator, cost, careful=False)
                   or _candidate(rules, start, uncovered, strength, generator, cost, careful=True))
            if row is None:
                impossible.add(start)
                continue
            # The most new tuples per unit of cost.
            score = (-len(covered_by(row, strength) & uncovered) / cost(row), cost(row))
            if best is None or score < best[0]:
                best = (score, row)
        uncovered -= impossible
        if best is not None:
            rows.append(best[1])
            uncovered -= covered_by(best[1], strength)
    return _drop_redundant(rows, strength)


def _drop_redundant(rows: list[Row], strength: int) -> list[Row]:
    """Drop rows (last first) whose tuples the other rows all hold."""
    kept = list(rows)
    for row in reversed(rows):
        others = [other for other in kept if other is not row]
        if covered_by(row, strength) <= set().union(*(covered_by(other, strength) for other in others)):
            kept = others
    return kept


def covering_array(factors: dict[str, list], strength: int = 2, constraints: list[Constraint] = (),
                   cost: Callable[[Row], float] = lambda row: 1.0, seeds: int = 2, candidates: int = 10) -> list[Row]:
    """Rows (dicts factor -> value, in the order of `factors`) covering every t-tuple of `factors` (factor ->
    its values) that an allowed row can hold. `cost(row)` (positive; also asked of partial rows): each new
    row is the candidate covering the most new tuples per unit of cost, a value's cost breaks ties between
    values covering as many, and the array of lowest total cost wins (then the fewest rows). The same
    arguments give the same rows."""
    if not 1 <= strength <= len(factors):
        raise ValueError(f"strength must be between 1 and the number of factors ({len(factors)}), got {strength}")
    rules = _Rules(factors, list(constraints))
    tuples = [combination for combination in _tuples(factors, strength) if rules.allows(dict(combination))]
    arrays = [_one_array(rules, tuples, strength, seed, candidates, cost) for seed in range(seeds)]
    return min(arrays, key=lambda rows: (sum(cost(row) for row in rows), len(rows)))
