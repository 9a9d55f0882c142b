"""The benchmarks' interleaving: bench_local's figures rest on every method meeting the same
neighbours, so the order it draws repeats from is checked here (the timings themselves are
never asserted: see docs/development.md)."""

from __future__ import annotations

import sys
from collections import Counter

import pytest
from conftest import ROOT


@pytest.fixture(scope="module")
def bench_local():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_local
        yield bench_local
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


@pytest.mark.parametrize("n", range(2, 10))
def test_over_one_cycle_each_method_runs_once_in_each_place_and_after_each_other_equally_often(bench_local, n):
    methods = {f"m{i}": i for i in range(n)}
    rows = [[name for name, _ in bench_local.ordered(methods, rep)] for rep in range(bench_local.cycle(n))]
    assert all(sorted(row) == sorted(methods) for row in rows)
    places = Counter((place, name) for row in rows for place, name in enumerate(row))
    assert set(places.values()) == {len(rows) // n} and len(places) == n * n
    follows = Counter(pair for row in rows for pair in zip(row, row[1:]))
    assert len(follows) == n * (n - 1)  # every ordered pair of methods occurs...
    assert len(set(follows.values())) == 1  # ...equally often


def test_repeats_are_rounded_up_to_whole_cycles(bench_local):
    assert bench_local.whole_cycles(30, 7) == 42  # --repeats 5: the warm loads, 7 methods timed
    assert bench_local.whole_cycles(15, 2) == 16  # the cold loads
    assert bench_local.whole_cycles(4, 4) == 4
