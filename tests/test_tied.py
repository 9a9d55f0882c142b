"""Tensors that share storage inside one state (tied embeddings and output heads) are written
once and restored sharing it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tieredckpt import CheckpointStore, load_sharded, save_sharded
from tieredckpt._format.tree import unflatten
from tieredckpt.errors import CorruptCheckpointError

VOCAB, DIM = 5_000, 256


class TiedLM(nn.Module):
    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight  # as GPT-2 and small Llama models tie them


def distinct_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() yields a tied one once


def test_a_tied_embedding_is_written_once_and_restored_sharing_one_storage(tmp_path):
    model = TiedLM()
    with CheckpointStore(tmp_path / "run") as store:
        store.save(1, {"model": model}).wait()
        size = store.local.manifest(1).total_size
        back = store.restore()["model"]
    assert size <= 1.02 * distinct_bytes(model)  # not 2x: the head is the embedding
    embed, head = back["embed.weight"], back["head.weight"]
    assert embed.untyped_storage().data_ptr() == head.untyped_storage().data_ptr()
    assert torch.equal(embed, model.embed.weight.detach())

    fresh = TiedLM()
    with CheckpointStore(tmp_path / "run", read_only=True) as store:
        store.restore(into={"model": fresh})
    assert fresh.head.weight is fresh.embed.weight and torch.equal(fresh.embed.weight, model.embed.weight)


def test_equal_but_separate_tensors_stay_separate(tmp_path):
    model = TiedLM(tied=False)
    with torch.no_grad():
        model.head.weight.copy_(model.embed.weight)  # the same values, two storages
    with CheckpointStore(tmp_path / "run") as store:
        store.save(1, {"model": model}).wait()
        assert store.local.manifest(1).total_size >= 2 * VOCAB * DIM * 4
        back = store.restore()["model"]
    back["head.weight"].add_(1)
    assert torch.equal(back["embed.weight"], model.embed.weight.detach())  # not aliased


def test_save_sharded_writes_aliases_once_too(tmp_path):
    w = torch.randn(1000, 64)
    manifest = save_sharded([{"a": w, "b": w, "view": w.view(64, 1000)}], tmp_path / "step", 1)
    (back,) = load_sharded(tmp_path / "step", 1)
    assert manifest.shards[0].size < 2.5 * w.numel() * 4  # a and b once (not 3x); the reshaped view is a view of them
    assert back["a"].untyped_storage().data_ptr() == back["b"].untyped_storage().data_ptr()
    assert torch.equal(back["view"], w.view(64, 1000))


def test_views_saved_beside_their_base_are_written_once_and_come_back_as_views(tmp_path):
    w = torch.randn(1000, 64)
    state = {"head": w[:10], "w": w, "t": w.t(), "flat": w.view(64, 1000), "col": w[:, 3], "step": 4,
             "other": torch.randn(5)}
    manifest = save_sharded([state], tmp_path / "step", 1)
    (back,) = load_sharded(tmp_path / "step", 1)
    assert manifest.shards[0].size < 1.1 * w.numel() * 4  # every view's bytes are the base's
    base = back["w"].untyped_storage().data_ptr()
    for name in ("head", "t", "flat", "col"):
        assert back[name].untyped_storage().data_ptr() == base, name  # a view of the restored base
        assert back[name].stride() == state[name].stride() and torch.equal(back[name], state[name]), name
    back["w"][0, 3] = 42.0
    assert back["t"][3, 0] == 42.0 and back["col"][0] == 42.0  # they share it, as before the save


def test_a_view_without_its_base_in_the_state_is_stored_on_its_own(tmp_path):
    w = torch.randn(1000, 64)
    manifest = save_sharded([{"head": w[:10]}], tmp_path / "step", 1)
    (back,) = load_sharded(tmp_path / "step", 1)
    assert manifest.shards[0].size < 10 * 64 * 4 + 4096 and torch.equal(back["head"], w[:10])


def test_views_go_through_the_store_s_staging_too(tmp_path):
    model = torch.nn.Linear(64, 64)
    state = {"w": model.weight.detach(), "first_row": model.weight.detach()[0]}
    with CheckpointStore(tmp_path / "run") as store:
        store.save(1, state).wait()
        back = store.restore()
    assert back["first_row"].untyped_storage().data_ptr() == back["w"].untyped_storage().data_ptr()
    assert torch.equal(back["first_row"], model.weight.detach()[0])


@pytest.mark.parametrize("spec", [[0, 0, [10], [100]], [0, 45, [10], [1]], [0, -1, [2], [1]], [0, 0, [2], [-1]],
                                  [0, 0, [2, 2], [1]], [3, 0, [1], [1]], [0, 0, "x", []], "view"])
def test_a_hostile_view_node_is_refused_by_name(spec):
    with pytest.raises(CorruptCheckpointError, match="shard.bin: invalid state tree"):
        unflatten({"@d": [["v", {"@v": spec}]]}, [torch.zeros(50)], "shard.bin")


def test_views_and_dtensor_pieces_in_one_state_keep_every_index_right():
    # a flattened state mixing a piece's local tensor, a base and its views: the views leave the
    # tensor list and every remaining reference (the piece's too) is renumbered
    from tieredckpt._format.pieces import Chunk
    from tieredckpt._format.tree import flatten
    w = torch.randn(8, 4)
    piece = Chunk(torch.arange(6.0), (12,), (6,))
    skeleton, tensors, _ = flatten({"row": w[1], "piece": piece, "w": w, "col": w[:, 2], "b": torch.ones(2)})
    back = unflatten(skeleton, tensors, "t", on_piece=lambda path, node: tensors[node["t"]])
    assert len(tensors) == 3 and torch.equal(back["piece"], torch.arange(6.0))
    assert torch.equal(back["row"], w[1]) and torch.equal(back["col"], w[:, 2]) and torch.equal(back["b"], torch.ones(2))
