"""Resharding the flat parameter space N -> M: plans tile exactly, bytes land where they belong."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tieredckpt import UnsupportedStateError
from tieredckpt._tiers.reshard import Copy, even_spans, plan, reshard


def zero_states(total, spans, seed=0):
    g = torch.Generator().manual_seed(seed)
    params, m, v = torch.randn(total, generator=g), torch.randn(total, generator=g), torch.rand(total, generator=g)
    states = [{"flat": {"params": params[o:o + n].clone(), "exp_avg": m[o:o + n].clone(),
                        "exp_avg_sq": v[o:o + n].clone()},
               "step": 1234, "hparams": {"lr": 3e-4, "betas": (0.9, 0.95)}} for o, n in spans]
    return states, (params, m, v)


def assemble(states, key):
    return torch.cat([s["flat"][key] for s in states])


def test_plan_is_a_list_of_range_copies():
    assert plan([(0, 4), (4, 4)], [(0, 3), (3, 3), (6, 2)]) == [
        Copy(0, 0, 0, 0, 3), Copy(0, 3, 1, 0, 1), Copy(1, 0, 1, 1, 2), Copy(1, 2, 2, 0, 2)]
    assert even_spans(10, 4) == [(0, 3), (3, 3), (6, 2), (8, 2)]


@pytest.mark.parametrize("n, m", [(4, 8), (8, 2), (3, 5), (5, 3), (1, 7), (7, 1), (4, 4)])
def test_named_reshards_are_byte_exact(n, m):
    total = 1001
    states, (params, mom, var) = zero_states(total, even_spans(total, n))
    out, spans = reshard(states, even_spans(total, n), m)
    assert len(out) == m and spans == even_spans(total, m)
    for key, ref in (("params", params), ("exp_avg", mom), ("exp_avg_sq", var)):
        assert torch.equal(assemble(out, key), ref)
    assert all(s["step"] == 1234 and s["hparams"]["betas"] == (0.9, 0.95) for s in out)


@settings(max_examples=150, deadline=None)
@given(total=st.integers(0, 3000), n=st.integers(1, 9), m=st.integers(1, 9), seed=st.integers(0, 10),
       cuts=st.lists(st.integers(0, 3000), max_size=8))
def test_any_n_to_m_reassembles_the_same_flat_vectors(total, n, m, seed, cuts):
    # uneven source layouts too: arbitrary cut points
    points = sorted({min(c, total) for c in cuts})[: n - 1]
    bounds = [0, *points, total]
    src = [(a, b - a) for a, b in zip(bounds, bounds[1:])]
    states, (params, mom, var) = zero_states(total, src, seed)
    out, dst = reshard(states, src, m)
    assert [n for _, n in dst] == [n for _, n in even_spans(total, m)]
    for key, ref in (("params", params), ("exp_avg", mom), ("exp_avg_sq", var)):
        assert torch.equal(assemble(out, key), ref)
    back, _ = reshard(out, dst, len(src), dst_spans=src)
    for key in ("params", "exp_avg", "exp_avg_sq"):
        assert torch.equal(assemble(back, key), assemble(states, key))


def test_what_cannot_be_resharded_is_named():
    states, _ = zero_states(10, even_spans(10, 2))
    states[1]["step"] = 999
    with pytest.raises(UnsupportedStateError, match=r"rank 1: replicated value .*'step'.*differs"):
        reshard(states, even_spans(10, 2), 3)
    states, _ = zero_states(10, even_spans(10, 2))
    states[0]["flat"]["exp_avg"] = torch.zeros(2, 3)
    with pytest.raises(UnsupportedStateError, match="flat/exp_avg' must be a 1-D tensor of 5"):
        reshard(states, even_spans(10, 2), 3)
    with pytest.raises(UnsupportedStateError, match="no 'flat' dict"):
        reshard([{"model": {}}], [(0, 0)], 2)
    with pytest.raises(UnsupportedStateError, match="tile"):
        plan([(0, 5), (6, 5)], [(0, 11)])


def test_cli_reshard_writes_a_new_run_at_the_new_world_size(tmp_path):
    import subprocess
    import sys

    from tieredckpt import load_sharded, save_sharded
    total = 777
    spans = even_spans(total, 4)
    states, (params, mom, var) = zero_states(total, spans)
    save_sharded(states, tmp_path / "run" / "step_000050", 50, param_shards=spans)
    out = subprocess.run([sys.executable, "-m", "tieredckpt.cli", "reshard", str(tmp_path / "run"), "--world-size", "3"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "4 -> 3 ranks" in out.stdout
    new = load_sharded(tmp_path / "run-ws3" / "step_000050", 3, verify="sha256")
    assert torch.equal(assemble(new, "exp_avg_sq"), var) and torch.equal(assemble(new, "params"), params)
    bad = subprocess.run([sys.executable, "-m", "tieredckpt.cli", "reshard", str(tmp_path / "run"), "--world-size", "3"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 3 and "never overwritten" in bad.stderr  # the output exists already


# ---- the n-D planner DTensor pieces use (boxes.cover) ------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tieredckpt._format.boxes import Box, cover, overlap  # noqa: E402
from tieredckpt.errors import CorruptCheckpointError  # noqa: E402


@st.composite
def tiling_and_box(draw):
    """A global shape cut into a grid of pieces (uneven cuts, empty ones too) and a wanted box."""
    dims = draw(st.integers(1, 3))
    shape = [draw(st.integers(1, 9)) for _ in range(dims)]
    cuts = [sorted(draw(st.lists(st.integers(0, n), max_size=4))) for n in shape]
    edges = [[0, *c, n] for c, n in zip(cuts, shape)]
    pieces = [Box((), ())]
    for e in edges:
        pieces = [Box(b.offset + (lo,), b.shape + (hi - lo,)) for b in pieces for lo, hi in zip(e, e[1:])]
    lo = [draw(st.integers(0, n - 1)) for n in shape]
    want = Box(tuple(lo), tuple(draw(st.integers(1, n - o)) for o, n in zip(lo, shape)))
    return shape, draw(st.permutations(pieces)), want


@settings(max_examples=300, deadline=None)
@given(tiling_and_box(), st.booleans())
def test_cover_fills_the_wanted_box_exactly_once_from_any_tiling(case, duplicate):
    shape, pieces, want = case
    if duplicate and pieces:  # a replicated piece written twice is read once
        pieces = [*pieces, pieces[0]]
    used = cover(pieces, want)
    cells = {}
    for i, part in used:
        assert overlap(part, pieces[i]) == part and overlap(part, want) == part
        for cell in _cells(part):
            assert cell not in cells
            cells[cell] = i
    assert set(cells) == set(_cells(want))


@settings(max_examples=100, deadline=None)
@given(tiling_and_box())
def test_cover_refuses_a_missing_piece_it_needs(case):
    shape, pieces, want = case
    needed = [i for i, p in enumerate(pieces) if overlap(p, want) is not None]
    pieces = [p for i, p in enumerate(pieces) if i != needed[0]]
    with pytest.raises(CorruptCheckpointError, match="missing"):
        cover(pieces, want)


def _cells(box: Box) -> set[tuple]:
    import itertools
    return set(itertools.product(*(range(o, o + s) for o, s in zip(box.offset, box.shape))))
