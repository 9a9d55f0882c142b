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

BOUND = "two reads: a crc32c pass, then a sizes-only load"  # as bench_local.py names it

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
    return _save(fig, out, "lightning", plt)


def files(results: Path, out: Path, plt) -> Path | None:
    data = runs(results, "files")
    if not data:
        return None
    fig, ax = plt.subplots(figsize=(7, 2.8))
    names = list(data[0]["folder"])
    values = {n: [statistics.median(d["folder"][n]) for d in data] for n in names}
    _bars(ax, names, values, "#2c7a3f", f"a {data[0]['folder_bytes'] / 1e9:.2f} GB checkpoint folder made durable",
          "seconds (median of runs; bars: min-max)")
    return _save(fig, out, "files", plt)


def _save(fig, out: Path, name: str, plt) -> Path:
    fig.tight_layout()
    path = out / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _bars(ax, names: list[str], per_run: dict[str, list[float]], colors, title: str, xlabel: str) -> None:
    """Horizontal bars: the median of the runs' values per name, whiskers to their min and max."""
    mids, errs = zip(*((m, (lo, hi)) for m, lo, hi in (spread(per_run[n]) for n in names)))
    ax.barh(names, mids, xerr=list(zip(*errs)), color=colors, capsize=4)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.invert_yaxis()


def _ours(name: str) -> str:
    return "#2c7a3f" if "tieredckpt" in name or "CheckpointStore" in name else "#999999"


def local(results: Path, out: Path, plt) -> Path | None:
    """Durable saves (warm and fresh processes) and loads (warm and cold) against the peers and the
    disk's limit, each as seconds for the same state: bench_local.py --json."""
    data = {mode: [d for d in runs(results, "local") if d["mode"] == mode] for mode in ("warm", "fresh")}
    if not data["warm"]:
        return None
    panels = [("warm", "save", "durable save (warm memory)"), ("fresh", "save", "durable save (a fresh process)"),
              ("warm", "load", "load into the model (warm page cache)"), ("warm", "cold", "load (cold page cache)")]
    panels = [p for p in panels if data[p[0]] and p[1] in data[p[0]][0]]
    fig, axes = plt.subplots(len(panels), 1, figsize=(8.5, 2.1 + 0.42 * sum(len(data[m][0][k]) for m, k, _ in panels)),
                             gridspec_kw={"height_ratios": [len(data[m][0][k]) for m, k, _ in panels]})
    for ax, (mode, key, title) in zip(axes, panels):
        names = list(data[mode][0][key])
        per_run = {n: [statistics.median(d[key][n]) for d in data[mode]] for n in names}
        if key == "load" and BOUND not in names:  # runs before the bound was timed as one operation
            names.insert(1, BOUND)
            per_run[BOUND] = [statistics.median(d["crc_pass"]) + statistics.median(d["load"]["tieredckpt load (sizes only)"])
                              for d in data[mode]]
        _bars(ax, names, per_run, [_ours(n) for n in names], f"{title}, {len(data[mode])} runs", "seconds")
    state = data["warm"][0]["bytes"] / 1e9
    fig.suptitle(f"{state:.2f} GB of GPT-shaped fp32 state + AdamW: bars are the median of each run's median, "
                 "whiskers its spread", fontsize=9)
    return _save(fig, out, "local", plt)


def stall(results: Path, out: Path, plt) -> Path | None:
    """How long save() holds the training loop, against a bare copy and the peers: bench_stall.py --json."""
    data = runs(results, "stall")
    if not data:
        return None
    names = list(data[0]["methods"])
    per_run = {n: [statistics.median(r["blocked"] for r in d["methods"][n]) for d in data] for n in names}
    fig, ax = plt.subplots(figsize=(8.5, 3.2))
    _bars(ax, names, per_run, [_ours(n) for n in names],
          f"training loop blocked per checkpoint, {data[0]['bytes'] / 1e9:.2f} GB ({len(data)} runs)",
          "seconds (log scale)")
    ax.set_xscale("log")
    return _save(fig, out, "stall", plt)


def codec(results: Path, out: Path, plt) -> Path | None:
    """Bytes sent per byte of state, by dtype and codec: bench_codec.py --json."""
    data = runs(results, "codec")
    if not data:
        return None
    rows = data[-1]["rows"]
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    codecs = list(dict.fromkeys(r["codec"] for r in rows))
    fig, ax = plt.subplots(figsize=(7.5, 3.2))
    width = 0.8 / (len(codecs) + 1)
    colors = {"raw": "#999999", "zstd": "#b5a26b", "zstd-planes": "#6b8fb5", "zstd-dtype": "#2c7a3f"}
    for i, name in enumerate(["raw", *codecs]):
        ratios = [1.0 if name == "raw" else next(r["stored"] / r["raw"] for r in rows if r["dtype"] == d and r["codec"] == name)
                  for d in dtypes]
        bars = ax.bar([x + i * width for x in range(len(dtypes))], ratios, width, label=name, color=colors.get(name))
        ax.bar_label(bars, [f"{r:.2f}" for r in ratios], fontsize=7)
    ax.set_xticks([x + width * len(codecs) / 2 for x in range(len(dtypes))], dtypes)
    ax.set_ylabel("bytes sent / bytes of state")
    ax.set_ylim(0, 1.32)
    ax.legend(fontsize=8, ncols=len(codecs) + 1, loc="upper center", frameon=False)
    ax.set_title("bytes sent to the remote per checkpoint, AdamW state after real training steps", fontsize=10)
    return _save(fig, out, "codec", plt)


def outage(results: Path, out: Path, plt) -> Path | None:
    """One run of a remote outage: the loop's and the remote's newest step over time, and how long each
    save() held the loop: bench_outage.py --json (its first run)."""
    data = runs(results, "outage")
    if not data:
        return None
    run = data[-1]["runs"][0]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8.5, 4.6), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    t, loop, remote = zip(*run["newest"])
    top.step(t, loop, where="post", label="newest step committed locally", color="#2c7a3f")
    top.step(t, remote, where="post", label="newest step on the remote", color="#6b8fb5")
    start, end = run["outage_window"]
    for ax in (top, bottom):
        ax.axvspan(start, end, color="#d9534f", alpha=0.12)
    top.text((start + end) / 2, max(loop) * 0.05, "remote down: " + ", ".join(run["modes"]), ha="center", fontsize=8)
    top.set_ylabel("step")
    top.legend(fontsize=8, loc="upper left")
    top.set_title(f"a {end - start:.0f} s outage, a save every {data[-1]['interval']:g} s of "
                  f"{data[-1]['bytes'] / 1e6:.0f} MB (uploads={run['uploads']!r}); caught up {run['catch_up']:.1f} s after",
                  fontsize=10)
    st, _, blocked = zip(*run["saves"])
    bottom.plot(st, [b * 1e3 for b in blocked], "o", markersize=3, color="#2c7a3f")
    bottom.set_ylabel("save() blocked (ms)")
    bottom.set_xlabel("seconds since the run started")
    bottom.set_ylim(0, max(b * 1e3 for b in blocked) * 1.3)
    return _save(fig, out, "outage", plt)


CHARTS = {"local": local, "stall": stall, "codec": codec, "outage": outage, "lightning": lightning, "files": files}


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
