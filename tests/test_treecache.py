"""The reused flatten (treecache.py): a save whose structure repeats the last one's takes the last
skeleton with its scalars rewritten; anything that changes the structure -- a key, a key's type, a
shape, a dtype, aliasing, a tensor turned scalar -- is flattened afresh. The contract: whatever
the cache returns equals what a full flatten of the same state returns."""

from __future__ import annotations

import copy
import json
from collections import OrderedDict

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tieredckpt import CheckpointStore
from tieredckpt._format import tree
from tieredckpt._format.compare import first_difference
from tieredckpt._format.shardheader import read_header
from tieredckpt._format.treecache import FlattenCache


def state() -> dict:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    meta = OrderedDict(w={"version": 1})
    sd = OrderedDict(w=torch.ones(3), b=torch.zeros(2, dtype=torch.bfloat16))
    sd._metadata = meta  # type: ignore[attr-defined]
    return {"model": sd, "opt": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(5)}, 1: {"m": torch.randn(2)}},
            "groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0, 1]}], "tied": [base, base],
            "view": base[1:3], "t": base.t(), "epoch": 1, "name": "run", "none": None}


def same_as_full(cache: FlattenCache, s) -> object:
    """The cache's answer, checked against a full flatten of the same state; its Structure."""
    skeleton, tensors, names, pieces, structure = cache.flatten(s)
    want_skeleton, want_tensors, want_names, want_pieces = tree.flatten_with_pieces(s)
    assert json.dumps(skeleton) == json.dumps(want_skeleton)  # key types too: 1 and True differ in JSON
    assert names == want_names and pieces == want_pieces
    assert len(tensors) == len(want_tensors) and all(a is b for a, b in zip(tensors, want_tensors))
    return structure


def test_a_repeated_structure_is_reused_with_its_new_scalars():
    cache, s = FlattenCache(), state()
    assert same_as_full(cache, s) is None  # the first save of a structure: not kept
    kept = same_as_full(cache, s)
    assert kept is not None and cache.hits == 0  # the second: kept
    s["epoch"], s["groups"][0]["lr"], s["model"]._metadata["w"]["version"] = 2, 0.05, 7
    s["opt"][0]["exp_avg"].add_(1)  # bytes change, structure does not
    assert same_as_full(cache, s) is kept and cache.hits == 1


def test_a_run_that_makes_new_tensors_for_every_save_never_keeps_a_structure():
    cache, alive = FlattenCache(), []  # kept alive: new tensors at freed addresses would look the same
    for _ in range(4):
        alive.append(state())
        assert same_as_full(cache, alive[-1]) is None
    assert cache.hits == 0


def kept_structure(cache: FlattenCache, s):
    same_as_full(cache, s)
    kept = same_as_full(cache, s)
    assert kept is not None
    return kept


@pytest.mark.parametrize("change", ["key", "key type", "shape", "dtype", "untied", "tensor to scalar",
                                    "list length", "container type", "subclass", "metadata"])
def test_a_changed_structure_is_flattened_afresh(change):
    cache, s = FlattenCache(), state()
    kept = kept_structure(cache, s)
    if change == "key":
        s["opt"][1]["v"] = s["opt"][1].pop("m")
    elif change == "key type":
        s["opt"][True] = s["opt"].pop(1)  # equal keys (1 == True), stored differently
    elif change == "shape":
        s["opt"][0]["exp_avg"].resize_(4)  # same data pointer, smaller shape
    elif change == "dtype":
        s["opt"][0]["exp_avg"] = s["opt"][0]["exp_avg"].view(torch.int32)  # same bytes, pointer and shape
    elif change == "untied":
        s["tied"][1] = s["tied"][1].view(4, 6)  # same storage and view, no longer the same tensor... still tied
    elif change == "tensor to scalar":
        s["opt"][0]["step"], s["epoch"] = 3.0, torch.tensor(1)
    elif change == "list length":
        s["groups"][0]["params"].append(2)
    elif change == "container type":
        s["groups"][0]["betas"] = list(s["groups"][0]["betas"])
    elif change == "subclass":
        s["model"]["w"] = torch.nn.Parameter(s["model"]["w"])
    elif change == "metadata":
        s["model"]._metadata["b"] = {"version": 1}
    got = same_as_full(cache, s)
    if change == "untied":  # a new view object of the same bytes is the same structure
        assert got is kept and cache.hits == 1
    else:
        assert got is not kept and cache.hits == 0


def test_a_view_of_a_bigger_storage_at_the_same_address_is_flattened_afresh():
    """Whether a tensor covers its storage decides views. Two storages over one buffer, one
    bigger: the same pointers, offsets, shapes and strides, so the storage's size is compared
    too."""
    memory = bytearray(64 * 4)
    cache = FlattenCache()
    base = torch.frombuffer(memory, dtype=torch.float32, count=8)  # covers its storage
    s = {"base": base, "half": base[:4]}
    kept = kept_structure(cache, s)
    assert len(tree.flatten(s)[1]) == 1  # half is a view of base
    base = torch.frombuffer(memory, dtype=torch.float32, count=64)[:8]  # the same address, in a bigger storage
    s = {"base": base, "half": base[:4]}
    got = same_as_full(cache, s)
    assert got is not kept and len(tree.flatten(s)[1]) == 2  # half is stored on its own now


def leaves():
    return st.one_of(st.integers(-3, 3), st.floats(allow_nan=False), st.booleans(), st.none(), st.text(max_size=3),
                     st.builds(lambda n, d: torch.arange(n).to(d), st.integers(0, 4),
                               st.sampled_from([torch.float32, torch.int64, torch.bfloat16])))


states = st.recursive(leaves(), lambda kids: st.one_of(
    st.lists(kids, max_size=4), st.lists(kids, max_size=3).map(tuple),
    st.dictionaries(st.one_of(st.text(max_size=2), st.integers(0, 3), st.booleans()), kids, max_size=4)),
    max_leaves=12).filter(lambda s: isinstance(s, (dict, list, tuple)))

MUTATIONS = ["none", "scalar", "shape", "dtype", "retype", "tie", "drop"]


def mutate(s, how: str, data) -> None:
    """Change ``s`` in place at one place ``data`` picks."""
    spots = []

    def walk(node):
        items = list(node.items()) if isinstance(node, dict) else list(enumerate(node))
        for k, v in items:
            spots.append((node, k))
            if isinstance(v, (dict, list)):
                walk(v)
    walk(s)
    spots = [(c, k) for c, k in spots if not isinstance(c, tuple)]
    if how == "none" or not spots:
        return
    container, key = data.draw(st.sampled_from(spots))
    value = container[key]
    tensors = [c[k] for c, k in spots if isinstance(c[k], torch.Tensor)]
    if how == "scalar":
        container[key] = data.draw(st.integers(10, 20))
    elif how == "shape" and isinstance(value, torch.Tensor) and value.numel() > 1:
        value.resize_(value.numel() - 1)
    elif how == "dtype" and isinstance(value, torch.Tensor) and value.dtype == torch.float32:
        container[key] = value.view(torch.int32)
    elif how == "retype":
        container[key] = torch.tensor([1.5]) if not isinstance(value, torch.Tensor) else 1.5
    elif how == "tie" and tensors:
        container[key] = tensors[0]
    elif how == "drop" and isinstance(container, dict):
        del container[key]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(s=states, hows=st.lists(st.sampled_from(MUTATIONS), min_size=1, max_size=4), data=st.data())
def test_whatever_changes_between_saves_the_cache_answers_as_a_full_flatten(s, hows, data):
    cache = FlattenCache()
    for how in hows:
        for _ in range(3):  # kept from the second save on, reused from the third
            same_as_full(cache, s)
        mutate(s, how, data)
        same_as_full(cache, s)


def test_a_store_writes_each_save_with_its_own_header_while_the_structure_changes(tmp_path):
    """Through the store and its shard files: steps 3 and 4 reuse the structure (and the
    header's entries) step 2 kept; step 5 changes a dtype in place of the same bytes, step 6 a
    shape, step 7 a key; every step restores as it was saved, and each file's header names what it
    holds."""
    s = state()
    want = {}
    with CheckpointStore(tmp_path / "run", every=0, keep_local=10) as store:
        for step in range(1, 8):
            s["epoch"] = step
            s["opt"][0]["exp_avg"].add_(step)
            if step == 5:
                s["opt"][0]["exp_avg"] = s["opt"][0]["exp_avg"].view(torch.int32)
            if step == 6:
                s["model"]["w"].resize_(2)
            if step == 7:
                s["opt"][1]["v"] = s["opt"][1].pop("m")
            store.save(step, s).wait()
            want[step] = copy.deepcopy(s)  # what was saved, by value (ties and views kept)
            if step == 4:
                assert store._stager._flattens.hits == 2  # the cache was in use
        assert store._stager._flattens.hits == 2  # and only there
        for step in range(1, 8):
            assert first_difference(want[step], store.restore(step, mark_resume=False)) is None, step
        headers = {step: read_header(next((tmp_path / "run" / f"step_{step:06d}").glob("*.bin")))
                   for step in (4, 5, 6, 7)}
    assert headers[4]["opt/0/exp_avg"]["dtype"] == "F32" and headers[5]["opt/0/exp_avg"]["dtype"] == "I32"
    assert headers[5]["model/w"]["shape"] == [3] and headers[6]["model/w"]["shape"] == [2]
    assert "opt/1/m" in headers[6] and "opt/1/v" in headers[7] and "opt/1/m" not in headers[7]

