"""What a 60 s remote outage costs a training loop: save() blocks, local disk, catching up.

    python benchmarks/bench_outage.py [--params 12800000] [--outage 60] [--interval 2] [--repeats 3]

A loop saves GPT-shaped model + AdamW state (12.8M params -> 154 MB) every
``--interval`` seconds into a store whose remote is moto's S3 server (its own
process) reached through the fault-injecting proxy of the test suite. Phases:

  normal   10 saves with the remote up: the normal save() stall;
  outage   ``--outage`` seconds in which every request fails: a third answered
           503 SlowDown, a third reset, a third left hanging unanswered;
  return   the proxy passes requests again and the loop stops saving: how long
           until the remote's newest step is the loop's newest, with no call
           from the user.

Reported per run: the longest and median save() block in each phase (the peer is
the normal stall of the same run), the most local steps on disk during the
outage (bound: keep_local + 2), and the catch-up time. ``--all-mode`` adds the
same outage (a third as long) for ``uploads="all"``, the back-pressure mode,
which does block saves while the remote is down.

``--exit-runs N`` measures the stop instead, N times: a training process (a real
subprocess, the store at its default settings) uploads a step, then the remote
hangs every request (the proxy's "drop", as in a network partition) while it
saves two more; SIGTERM; the time until the process has exited (bound: the save,
plus upload_on_exit 20 s spent trying to send the stopped step, plus exit_timeout
2 s; inside Kubernetes' 30 s grace). bench_preempt.py measures the stop with a
remote that answers.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)
from common import model_adamw_state, state_bytes, table, warm_memory  # noqa: E402
from faultproxy import FaultProxy  # noqa: E402
from s3server import MotoServer  # noqa: E402

from tieredckpt import CheckpointStore  # noqa: E402
from tieredckpt._tiers.remote import RemoteTier  # noqa: E402

MODES = ("503", "reset", "drop")


def one_run(server, proxy, bucket, state, args, uploads: str, outage: float) -> dict:
    server.make_bucket(bucket)
    url = f"s3://{bucket}/run"
    direct = RemoteTier(url, server.options())
    run_dir = tempfile.mkdtemp(prefix="bench-outage-")
    store = CheckpointStore(run_dir, url, remote_options={**server.options(), "endpoint_url": proxy.endpoint},
                            keep_local=args.keep, uploads=uploads, request_timeout=10.0,
                            upload_backoff=(0.5, 5.0, 30.0))
    blocks = {"normal": [], "outage": []}
    step, most_local = 0, 0
    t0 = time.monotonic()
    saves: list[list] = []  # [seconds since start, step, seconds save() blocked]
    newest: list[list] = []  # [seconds since start, the loop's newest step, the remote's newest step]
    polling = threading.Event()

    def poll() -> None:  # what a user watching both tiers would see, twice a second
        while not polling.wait(0.5):
            try:
                remote_newest = direct.newest_step()
            except Exception:  # noqa: BLE001 - the poller reads moto directly; a hiccup is a gap
                continue
            newest.append([time.monotonic() - t0, step, remote_newest or 0])
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        def train(phase: str, seconds: float | None, count: int | None = None) -> None:
            nonlocal step, most_local
            end = time.monotonic() + (seconds or 1e9)
            n = 0
            while time.monotonic() < end and (count is None or n < count):
                step += 1
                n += 1
                state["step"] = step
                start = time.perf_counter()
                handle = store.save(step, state)
                blocks[phase].append(time.perf_counter() - start)
                saves.append([time.monotonic() - t0, step, blocks[phase][-1]])
                handle.wait()
                most_local = max(most_local, len(store.local.steps())) if phase == "outage" else most_local
                time.sleep(args.interval)

        warm_memory(int(2.5 * state_bytes(state)))
        train("normal", None, count=10)
        store.wait(uploads=True, timeout=600)
        returned: list[float] = []

        window: list[float] = []

        def outage_schedule() -> None:  # by the clock, whatever the loop is doing
            window.append(time.monotonic() - t0)
            for mode in MODES:
                proxy.set(mode)
                time.sleep(outage / len(MODES))
            proxy.clear()
            returned.append(time.monotonic())
            window.append(returned[0] - t0)
        schedule = threading.Thread(target=outage_schedule)
        schedule.start()
        train("outage", outage)
        schedule.join()
        while direct.newest_step() != step:
            time.sleep(0.05)
        caught_up = time.monotonic() - returned[0]
        time.sleep(1.0)  # the poller sees the caught-up remote
        store.close()
    finally:
        polling.set()
        proxy.clear()
        shutil.rmtree(run_dir, ignore_errors=True)
    return {"normal": blocks["normal"], "outage": blocks["outage"], "local": most_local, "catch_up": caught_up,
            "uploads": uploads, "outage_window": window, "modes": list(MODES), "saves": saves, "newest": newest}


def exit_child(url: str, endpoint: str, run_dir: str, params: int) -> None:
    """The training process of ``--exit-runs``: default store settings, a save every 5 steps."""
    from tests_creds import options
    state = model_adamw_state(params)
    with CheckpointStore(run_dir, url, remote_options=options(endpoint), every=5) as store, store.handle_signals():
        store.save(0, state).wait()
        store.wait(uploads=True)
        print("UPLOADED", flush=True)
        for step in range(1, 1_000_000):
            time.sleep(0.05)  # "training"
            state["step"] = step
            if store.step_end(step, state):
                return
            if step % 5 == 0:
                print("SAVED", step, flush=True)


def exit_run(server, proxy, bucket: str, params: int) -> float:
    server.make_bucket(bucket)
    run_dir = tempfile.mkdtemp(prefix="bench-exit-")
    proc = subprocess.Popen([sys.executable, __file__, "--child-exit", f"s3://{bucket}/run", proxy.endpoint, run_dir,
                             "--params", str(params)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "UPLOADED"
        proxy.set("drop")
        for _ in range(2):  # two more local commits; the upload of the first hangs, the second waits
            assert proc.stdout.readline().startswith("SAVED")
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=300)
        took = time.monotonic() - started
        assert proc.returncode == 0, proc.returncode
        return took
    finally:
        proxy.clear()
        if proc.poll() is None:
            proc.kill()
        shutil.rmtree(run_dir, ignore_errors=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child-exit":
        return exit_child(*sys.argv[2:5], params=int(sys.argv[6]))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=int, default=12_800_000)
    p.add_argument("--outage", type=float, default=60.0)
    p.add_argument("--interval", type=float, default=2.0, help="seconds of 'training' between saves")
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--all-mode", action="store_true", help="also measure uploads='all' (blocks by design)")
    p.add_argument("--exit-runs", type=int, default=0, help="measure SIGTERM's exit with a hanging remote instead")
    p.add_argument("--json", help="write every run's figures and timeline here as JSON (benchmarks/plot.py draws them)")
    args = p.parse_args()
    if args.exit_runs:
        return exit_main(args)
    state = model_adamw_state(args.params)
    print(f"state: {state_bytes(state) / 1e9:.3f} GB; a save every {args.interval:g} s; "
          f"outage {args.outage:g} s ({', '.join(MODES)}); keep_local={args.keep}", flush=True)
    server = MotoServer().start()
    proxy = FaultProxy(server.endpoint).start()
    rows, runs = [], []
    try:
        plans = [("newest", args.outage)] * args.repeats
        if args.all_mode:
            plans += [("all", args.outage / 3)]
        for i, (uploads, outage) in enumerate(plans):
            r = one_run(server, proxy, f"outage-{i}", state, args, uploads, outage)
            runs.append(r)
            normal, during = max(r["normal"]), max(r["outage"])
            rows.append((f"{i + 1} uploads={uploads}", f"{outage:.0f}", f"{statistics.median(r['normal']) * 1e3:.0f}",
                         f"{normal * 1e3:.0f}", f"{statistics.median(r['outage']) * 1e3:.0f}",
                         f"{during * 1e3:.0f}", f"{during / normal:.2f}x", len(r["outage"]),
                         f"{r['local']}", f"{r['catch_up']:.1f}"))
            print(table(rows[-1:], HEADERS), flush=True)
    finally:
        proxy.close()
        server.kill()
    print()
    print(table(rows, HEADERS))
    if args.json:
        import json
        with open(args.json, "w") as f:
            json.dump({"params": args.params, "bytes": state_bytes(state), "interval": args.interval,
                       "keep_local": args.keep, "runs": runs}, f, indent=1)


def exit_main(args) -> None:
    server = MotoServer().start()
    proxy = FaultProxy(server.endpoint).start()
    try:
        times = [exit_run(server, proxy, f"exit-{i}", args.params) for i in range(args.exit_runs)]
    finally:
        proxy.close()
        server.kill()
    print(f"SIGTERM to exit with every request hanging ({args.params:,} params, default settings): "
          + ", ".join(f"{t:.2f} s" for t in times) + f"; median {statistics.median(times):.2f} s")


HEADERS = ("run", "outage s", "normal median ms", "normal max ms", "outage median ms", "outage max ms",
           "max vs normal", "saves in outage", "most local steps", "catch-up s")


if __name__ == "__main__":
    main()
