"""Does a remote with months of checkpoints open as fast as a new one? And how fast does the CLI start?

    python benchmarks/bench_scale.py [--steps 10,1000,10000] [--repeats 3] [--params 1000000]

For each backend (moto's S3 server in its own process; a file:// directory) and
each number of remote steps, a real upload of GPT-shaped model + AdamW state is
made and copied (tests/remotefill.py: every step gets its own upload manifest;
the newest also its parts, so it restores). Then, on a fresh machine (an empty
local directory), timed, median of ``--repeats``:

  open + latest   a read-only store opened, latest_step() asked
  restore newest  a read-only store opened and the newest step restored
  writer open     a writing store opened (probe, lease) until its uploader has read the remote
  ls first row    `tieredckpt ls` until the first step's row is printed
  ls 50 rows      ... until it has printed its default page of 50

and, in the same run, `tieredckpt --help` against `python -c "import torch"`.
Target: open + latest at 10,000 steps within 1.2x of the time at 10; the CLI's
start at most 0.25x the torch import.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)
from common import model_adamw_state, table  # noqa: E402
from remotefill import fill  # noqa: E402
from s3server import CREDS, MotoServer  # noqa: E402

from tieredckpt import CheckpointStore  # noqa: E402
from tieredckpt._tiers.remote import RemoteTier  # noqa: E402

CLI = [sys.executable, "-m", "tieredckpt.cli"]


def timed(fn, repeats: int) -> float:
    fn()  # untimed: the first run in a process pays for importing s3fs and opening its session
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def fresh_dir(root: str) -> str:
    return tempfile.mkdtemp(dir=root)


def measure(url: str, options: dict, root: str, cli_env: dict, cli_extra: list, repeats: int) -> dict:
    def open_latest():
        with CheckpointStore(fresh_dir(root), url, remote_options=options, read_only=True) as s:
            s.latest_step()

    def restore_newest():
        with CheckpointStore(fresh_dir(root), url, remote_options=options, read_only=True) as s:
            s.restore()

    def writer_open():
        with CheckpointStore(fresh_dir(root), url, remote_options=options) as s:
            s.wait(uploads=True)

    def ls(rows: int):
        def run():
            proc = subprocess.Popen([*CLI, "ls", fresh_dir(root), "--remote", url, *cli_extra], env=cli_env,
                                    stdout=subprocess.PIPE, text=True)
            seen = 0
            for line in proc.stdout:
                seen += line.split()[0].isdigit() if line.strip() else 0
                if seen >= rows:
                    break
            proc.kill()
            proc.wait()
        return run
    return {"open + latest": timed(open_latest, repeats), "restore newest": timed(restore_newest, repeats),
            "writer open": timed(writer_open, repeats), "ls first row": timed(ls(1), repeats),
            "ls 50 rows": timed(ls(50), repeats)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", default="10,1000,10000")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--params", type=int, default=1_000_000)
    args = p.parse_args()
    counts = [int(n) for n in args.steps.split(",")]
    state = model_adamw_state(args.params)
    root = tempfile.mkdtemp(prefix="bench-scale-")
    server = MotoServer().start()
    env = dict(os.environ, AWS_ACCESS_KEY_ID=CREDS["key"], AWS_SECRET_ACCESS_KEY=CREDS["secret"],
               PYTHONPATH=os.path.join(HERE, ".."))
    results = {}
    try:
        for backend in ("moto", "file"):
            for n in counts:
                if backend == "moto":
                    bucket = f"scale-{n}"
                    server.make_bucket(bucket)
                    url, options, extra = f"s3://{bucket}/run", server.options(), ["--endpoint-url", server.endpoint]
                else:
                    url, options, extra = f"file://{root}/remote-{n}", {}, []
                with CheckpointStore(fresh_dir(root), url, remote_options=options) as s:
                    s.save(1, state).wait()
                    s.wait(uploads=True)
                start = time.perf_counter()
                fill(RemoteTier(url, options), 1, range(2, n + 1), with_parts={n})
                print(f"{backend}: {n} remote steps built in {time.perf_counter() - start:.1f} s", flush=True)
                results[(backend, n)] = measure(url, options, root, env, extra, args.repeats)
                print(table([(f"{backend} {n}", *(f"{v:.3f}" for v in results[(backend, n)].values()))],
                            ("remote steps", *results[(backend, n)])), flush=True)
        startup = {"tieredckpt --help": [], "python -c 'import torch'": []}
        for _ in range(max(3, args.repeats)):
            for name, cmd in (("tieredckpt --help", [*CLI, "--help"]),
                              ("python -c 'import torch'", [sys.executable, "-c", "import torch"])):
                start = time.perf_counter()
                subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, check=True)
                startup[name].append(time.perf_counter() - start)
    finally:
        server.kill()
        shutil.rmtree(root, ignore_errors=True)
    print()
    rows = [(f"{b} {n}", *(f"{v:.3f}" for v in r.values())) for (b, n), r in results.items()]
    print(table(rows, ("remote steps (s)", *next(iter(results.values())))))
    for backend in ("moto", "file"):
        first, last = results[(backend, counts[0])], results[(backend, counts[-1])]
        print(f"{backend}: at {counts[-1]} steps vs {counts[0]}: " +
              ", ".join(f"{k} {last[k] / first[k]:.2f}x" for k in first))
    helps, torch_import = statistics.median(startup["tieredckpt --help"]), statistics.median(
        startup["python -c 'import torch'"])
    print(f"tieredckpt --help {helps:.3f} s (runs {', '.join(f'{x:.3f}' for x in startup['tieredckpt --help'])}), "
          f"import torch {torch_import:.3f} s: {helps / torch_import:.2f}x")


if __name__ == "__main__":
    main()
