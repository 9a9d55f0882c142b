"""Folder steps: save_files of a Hugging Face checkpoint folder against cp -r + sync, and what
the Trainer callback adds to the Trainer's own save.

A real transformers.Trainer trains a GPT-2 (124M parameters, built from a config, CPU) and
saves ``checkpoint-N/`` (model.safetensors + an optimizer.pt of AdamW state: ~1.5 GB) every
step with TieredCheckpointCallback (local tier only, so the disk is not shared with an upload).
Measured per save, in the same run:

  trainer save   Trainer._save_checkpoint (safetensors, torch.save; the Trainer never fsyncs)
  callback       what the callback adds on the training thread (on_step_end + on_save: the
                 folder hard-linked into the step's scratch; the commit runs on the store's writer)
  commit         the background commit: fsync of every file, crc32c, manifest, rename

Then, on the last folder, interleaved repeats each starting with a different method:
  cp -r + sync   a durable copy by hand
  save_files     the safe default: returns once every file is copied into the step (a reflink
                 where the filesystem has them, else copy_file_range); .wait(): durable
  link=True      hard links (for writers that never rewrite a file in place: the callback's mode)

    python benchmarks/bench_files.py [--repeats 3] [--layers 12]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from common import median, table  # noqa: E402


def trainer_saves(work: Path, layers: int, saves: int) -> tuple[dict, Path]:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from tieredckpt.hf import TieredCheckpointCallback

    times: dict[str, list[float]] = {"trainer save": [], "callback": [], "commit": []}
    callback = TieredCheckpointCallback(keep_local=2)
    for name in ("on_step_end", "on_save"):  # time what the callback spends on the training thread
        method = getattr(callback, name)

        def timed(*a, _method=method, **k):
            start = time.perf_counter()
            try:
                return _method(*a, **k)
            finally:
                times["callback"].append(time.perf_counter() - start)
        setattr(callback, name, timed)

    class Timed(Trainer):
        def _save_checkpoint(self, model, trial):
            start = time.perf_counter()
            super()._save_checkpoint(model, trial)
            times["trainer save"].append(time.perf_counter() - start)

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=layers))
    ids = torch.randint(0, 50257, (8, 32))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(str(work / "out"), max_steps=saves, save_steps=1, save_total_limit=2,
                             per_device_train_batch_size=1, use_cpu=True, report_to=[], disable_tqdm=True)
    trainer = Timed(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train()
    # the callback's time is two calls per step; pair them up per save
    calls = times["callback"]
    times["callback"] = [calls[i] + calls[i + 1] for i in range(0, len(calls) - 1, 2)]
    events = [json.loads(line) for line in open(work / "out" / ".tieredckpt" / ".events.jsonl")]
    times["commit"] = [e["write_s"] + e["fsync_s"] + e["commit_s"] for e in events if e.get("event") == "save"]
    return times, work / "out" / f"checkpoint-{saves}"


def folder_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def cp_sync(src: Path, dst: Path) -> float:
    start = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    subprocess.run(["sync"], check=True)
    return time.perf_counter() - start


def save_files(src: Path, run: Path, step: int, link: bool) -> tuple[float, float]:
    from tieredckpt import CheckpointStore
    with CheckpointStore(run, every=0) as store:
        start = time.perf_counter()
        handle = store.save_files(step, src, link=link)
        linked = time.perf_counter() - start
        handle.wait()
        return linked, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", type=int, default=12, help="GPT-2 layers (12: 124M parameters)")
    p.add_argument("--saves", type=int, default=4)
    p.add_argument("--dir", default=None, help="where to work (default: a temp dir on the disk under test)")
    p.add_argument("--json", default=None, help="write the figures here as JSON")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_files-", dir=args.dir))
    try:
        times, folder = trainer_saves(work, args.layers, args.saves)
        size = folder_size(folder)
        print(f"checkpoint folder: {size / 1e9:.2f} GB ({', '.join(sorted(p.name for p in folder.iterdir()))})")
        rows = [(name, f"{median(v):.3f}", f"{min(v):.3f}-{max(v):.3f}", len(v)) for name, v in times.items() if v]
        print(table(rows, ("per Trainer save", "median s", "range s", "n")))
        ratio = median(times["callback"]) / median(times["trainer save"])
        print(f"callback / trainer save: {ratio:.3f}x (target <= 0.1x)")
        subprocess.run(["sync"], check=True)
        results: dict[str, list[float]] = {name: [] for name in (
            "cp -r + sync", "save_files returns (copied)", "save_files durable (copied)",
            "save_files returns (link=True)", "save_files durable (link=True)")}
        methods = ["cp", "copy", "link"]
        for r in range(args.repeats):
            for method in methods[r % 3:] + methods[:r % 3]:  # each repeat starts with another
                if method == "cp":
                    results["cp -r + sync"].append(cp_sync(folder, work / f"copy{r}"))
                    shutil.rmtree(work / f"copy{r}")
                else:
                    mode = "copied" if method == "copy" else "link=True"
                    returned, durable = save_files(folder, work / f"run{r}", 1, link=method == "link")
                    results[f"save_files returns ({mode})"].append(returned)
                    results[f"save_files durable ({mode})"].append(durable)
                    shutil.rmtree(work / f"run{r}")
                subprocess.run(["sync"], check=True)
                time.sleep(0.5)
        base = median(results["cp -r + sync"])
        rows = [(name, f"{median(v):.3f}", f"{min(v):.3f}-{max(v):.3f}", f"{base / median(v):.1f}x")
                for name, v in results.items()]
        print(table(rows, (f"a {size / 1e9:.2f} GB folder", "median s", "range s", "speed vs cp -r + sync")))
        copy_ratio = median(results["save_files returns (copied)"]) / median(times["trainer save"])
        print(f"the default's copy on the caller's thread / the Trainer's own save: {copy_ratio:.3f}x")
        if args.json:
            Path(args.json).write_text(json.dumps({"folder_bytes": size, "per_save": times, "folder": results,
                                                   "callback_over_trainer_save": ratio, "copy_over_trainer_save": copy_ratio}, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
