"""A PNG of a run's loss history with checkpoint, resume and pivot steps marked.

matplotlib is an optional extra (``pip install tieredckpt[plot]``).
"""

from __future__ import annotations

import os
from pathlib import Path

from .._tiers.local import LocalTier
from ..errors import TieredCkptError
from .runlog import RunLog


def plot_run(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise TieredCkptError("plotting needs matplotlib: pip install 'tieredckpt[plot]'") from None
    run_dir = Path(run_dir)
    tier = LocalTier(run_dir, create=False)
    history = RunLog(run_dir).read_loss()
    losses = history.by_step()
    if not losses:
        raise TieredCkptError(f"{run_dir / '.loss.json'}: no loss entries to plot")
    out = Path(out) if out else run_dir / "loss.png"
    steps = sorted(losses)
    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=100)
    ax.plot(steps, [losses[s] for s in steps], lw=0.8, color="#1f77b4", label="loss")
    for i, step in enumerate(tier.steps()):
        ax.axvline(step, color="#2ca02c", ls=":", lw=1, label="checkpoint" if i == 0 else None)
    for i, event in enumerate(history.events("resume")):
        ax.axvline(event["step"], color="#ff7f0e", ls="--", lw=1, label="resume" if i == 0 else None)
    for i, event in enumerate(history.events("pivot")):
        ax.axvline(event["step"], color="#d62728", lw=1.5, label="pivot" if i == 0 else None)
        ax.annotate(event.get("note") or "pivot", (event["step"], ax.get_ylim()[1]), fontsize=8,
                    color="#d62728", rotation=90, va="top", ha="right")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{run_dir.name}: {len(steps)} steps, {len(tier.steps())} checkpoints on disk")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
