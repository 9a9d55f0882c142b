"""Shared helpers: real models, real AdamW state, bit-exact comparison."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))


class TinyNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 8)
        self.fc = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.bn(self.norm(torch.relu(self.fc(self.emb(x))))))


def trained(steps: int = 3, seed: int = 0):
    """A model and its AdamW optimizer after ``steps`` real training steps."""
    torch.manual_seed(seed)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(steps):
        train_step(model, opt)
    return model, opt


def train_step(model, opt) -> float:
    x = torch.randint(0, 11, (32,))
    y = torch.randint(0, 3, (32,))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


@pytest.fixture
def run_dir(tmp_path) -> Path:
    return tmp_path / "run"


def flip_byte(path: os.PathLike, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
