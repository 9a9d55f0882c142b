"""Tensors that share storage inside one state (tied embeddings and output heads) are written
once and restored sharing it."""

from __future__ import annotations

import torch
from torch import nn

from tieredckpt import CheckpointStore, load_sharded, save_sharded

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
    assert manifest.shards[0].size < 2.5 * w.numel() * 4  # a and b once (not 3x); the reshaped view is its own entry
    assert back["a"].untyped_storage().data_ptr() == back["b"].untyped_storage().data_ptr()
    assert torch.equal(back["view"], w.view(64, 1000))
