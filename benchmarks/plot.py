"""Charts for the Benchmarks page, drawn from the JSON the benchmarks write with ``--json``.

    python benchmarks/plot.py [--results benchmarks/results] [--out docs/img]

Every chart is drawn from files only (``<bench>-<run>.json``, one per run on a quiet
machine), so an image on the page can be redrawn from the JSON committed beside it. A
benchmark whose JSON is missing is skipped with a note. Needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent


def runs(results: Path, bench: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(results.glob(f"{bench}-*.json"))]


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, below, above): the median of the runs and its distance to their min and max."""
    mid = statistics.median(values)
    return mid, mid - min(values), max(values) - mid


def lightning(results: Path, out: Path, plt) -> Path | None:
    data = runs(results, "lightning")
    if not data:
        return None
    labels = {"torch": "TorchCheckpointIO", "async": "AsyncCheckpointIO(Torch)", "tiered": "TieredCheckpointIO"}
    fig, axes = plt.subplots(1, 2, figsize=(11.5, 3.6))
    for ax, key, title in ((axes[0], "blocked", "training loop blocked per checkpoint"),
                           (axes[1], "durable", "until the checkpoint is durable")):
        per_run = {k: [statistics.median(r[key]) for d in data for r in d[k]] for k in labels}
        mids, errs = zip(*((m, (lo, hi)) for m, lo, hi in (spread(per_run[k]) for k in labels)))
        ax.barh(list(labels.values()), mids, xerr=list(zip(*errs)), color=["#999999", "#6b8fb5", "#2c7a3f"], capsize=4)
        if key == "blocked":  # on a log scale: 0.1 s and 5 s on one axis
            floor = statistics.median(c for d in data for r in d["tiered"] for c in r["copy"])
            ax.axvline(floor, color="black", linestyle="--", linewidth=1, label="a copy into reused buffers")
            ax.set_xscale("log")
            ax.set_xlim(0.03, 20)
            ax.set_xticks([0.1, 0.3, 1, 3, 10], ["0.1", "0.3", "1", "3", "10"])
            ax.minorticks_off()
            ax.legend(fontsize=8, loc="lower right")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("seconds (median of the repeats; bars: min-max)")
        ax.invert_yaxis()
    state = data[0]["tiered"][0]["bytes"] / 1e9
    repeats = sum(len(d["tiered"]) for d in data)
    fig.suptitle(f"Lightning checkpoints, {state:.2f} GB of state ({len(data)} runs, {repeats} repeats each plugin)",
                 fontsize=11)
    fig.tight_layout()
    path = out / "lightning.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def files(results: Path, out: Path, plt) -> Path | None:
    data = runs(results, "files")
    if not data:
        return None
    fig, ax = plt.subplots(figsize=(7, 2.8))
    names = list(data[0]["folder"])
    values = {n: [statistics.median(d["folder"][n]) for d in data] for n in names}
    mids, errs = zip(*((m, (lo, hi)) for m, lo, hi in (spread(values[n]) for n in names)))
    ax.barh(names, mids, xerr=list(zip(*errs)), color="#2c7a3f", capsize=4)
    ax.set_xlabel("seconds (median of runs; bars: min-max)")
    ax.set_title(f"a {data[0]['folder_bytes'] / 1e9:.2f} GB checkpoint folder made durable", fontsize=10)
    ax.invert_yaxis()
    fig.tight_layout()
    path = out / "files.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


CHARTS = {"lightning": lightning, "files": files}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=HERE / "results")
    p.add_argument("--out", type=Path, default=HERE.parent / "docs" / "img")
    args = p.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    args.out.mkdir(parents=True, exist_ok=True)
    for name, chart in CHARTS.items():
        path = chart(args.results, args.out, plt)
        print(f"{name}: {path}" if path else f"{name}: no {name}-*.json in {args.results}, skipped")


if __name__ == "__main__":
    main()
