"""A preempted run: how long from SIGTERM until the step it saved is on the remote, and until exit.

    python benchmarks/bench_preempt.py [--params 117000000] [--runs 3] [--servers moto,seaweedfs]

A training process (a real subprocess, the store at its default settings: upload_on_exit
20 s, exit_timeout 2 s) holds GPT-shaped model + AdamW state (117M params -> 1.4 GB). It
uploads step 0, then "trains": every step changes every tensor, so the step saved on
SIGTERM shares no part with step 0 and all of it travels. SIGTERM; the parent, polling the
remote's newest step every 0.1 s, records when the SIGTERM step is there, and when the
process has exited. Against moto (a mock, in its own process) and SeaweedFS (``weed mini``,
a production object store, its data on this disk), both on 127.0.0.1.

Then the same against a remote that leaves every request hanging (moto behind the suite's
fault proxy, "drop"): the exit must come within upload_on_exit + exit_timeout of the
stop, plus the save, with the step committed locally.
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
from common import model_adamw_state, state_bytes, table, tensors_of  # noqa: E402
from faultproxy import FaultProxy  # noqa: E402
from s3server import MotoServer, SeaweedServer  # noqa: E402

from tieredckpt import CheckpointStore  # noqa: E402
from tieredckpt._tiers.local import LocalTier  # noqa: E402
from tieredckpt._tiers.remote import RemoteTier  # noqa: E402


def child(url: str, endpoint: str, run_dir: str, params: int) -> None:
    """The training process: default store settings, no cadence save; SIGTERM saves and stops."""
    from tests_creds import options
    state = model_adamw_state(params)
    tensors = [t for t in tensors_of(state) if t.numel() > 1]
    with CheckpointStore(run_dir, url, remote_options=options(endpoint), every=10**9) as store, \
            store.handle_signals():
        store.save(0, state).wait()
        store.wait(uploads=True)
        print("READY", flush=True)
        for step in range(1, 1_000_000):
            for t in tensors:  # "training": every tensor changes, so every part of the next save does
                t.add_(1e-6)
            if store.step_end(step, state):
                return


def one_run(server, endpoint: str, bucket: str, params: int, hang=None) -> dict:
    """SIGTERM one training process; seconds to the step being on the remote (None: never) and to exit."""
    server.make_bucket(bucket)
    url = f"s3://{bucket}/run"
    run_dir = tempfile.mkdtemp(prefix="bench-preempt-")
    proc = subprocess.Popen([sys.executable, __file__, "--child", url, endpoint, run_dir, str(params)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: dict[int, float] = {}
    stop = threading.Event()

    def poll() -> None:  # what a fresh machine would find, read around any proxy
        tier = RemoteTier(url, server.options())
        while not stop.is_set():
            try:
                newest = tier.newest_step()
                if newest is not None and newest not in seen:
                    seen[newest] = time.monotonic()
            except Exception:  # noqa: BLE001 - a failed poll is tried again
                pass
            stop.wait(0.1)

    try:
        line = proc.stdout.readline().strip()
        assert line == "READY", (line, proc.stderr.read()[-3000:])
        if hang is not None:
            hang.set("drop")
        time.sleep(2.0)  # a few training steps
        watcher = threading.Thread(target=poll, daemon=True)
        watcher.start()
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=600)
        exited = time.monotonic() - started
        time.sleep(0.5)  # the watcher's last look
        stop.set()
        watcher.join()
        assert proc.returncode == 0, (proc.returncode, proc.stderr.read()[-3000:])
        stopped = LocalTier(run_dir).latest_step()
        assert stopped and stopped > 0, stopped
        on_remote = seen[stopped] - started if stopped in seen else None
        return {"step": stopped, "on_remote": on_remote, "exit": exited}
    finally:
        stop.set()
        if hang is not None:
            hang.clear()
        if proc.poll() is None:
            proc.kill()
        shutil.rmtree(run_dir, ignore_errors=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(*sys.argv[2:5], params=int(sys.argv[5]))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=int, default=117_000_000)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--servers", default="moto,seaweedfs")
    p.add_argument("--no-hang", action="store_true", help="skip the run against a hanging remote")
    args = p.parse_args()
    size = state_bytes(model_adamw_state(args.params)) / 1e9
    print(f"state: {size:.2f} GB ({args.params:,} params); store defaults (upload_on_exit 20 s)", flush=True)
    rows = []
    kinds = {"moto": MotoServer, "seaweedfs": SeaweedServer}
    for name in args.servers.split(","):
        server = kinds[name]().start()
        try:
            runs = [one_run(server, server.endpoint, f"preempt-{name}-{i}", args.params) for i in range(args.runs)]
        finally:
            server.kill()
        rows.append(report(name, runs))
        print(table(rows[-1:], HEADERS), flush=True)
    if not args.no_hang:
        server = MotoServer().start()
        proxy = FaultProxy(server.endpoint).start()
        try:
            runs = [one_run(server, proxy.endpoint, f"hang-{i}", args.params, hang=proxy) for i in range(args.runs)]
        finally:
            proxy.close()
            server.kill()
        rows.append(report("moto, every request hanging", runs))
    print()
    print(table(rows, HEADERS))


def report(name: str, runs: list[dict]) -> tuple:
    def spread(values):
        if any(v is None for v in values):
            return f"{sum(v is None for v in values)} of {len(values)} never"
        return f"{min(values):.1f}-{max(values):.1f} (median {statistics.median(values):.1f})"
    return (name, len(runs), spread([r["on_remote"] for r in runs]), spread([r["exit"] for r in runs]))


HEADERS = ("remote", "runs", "SIGTERM -> step on the remote, s", "SIGTERM -> exit, s")


if __name__ == "__main__":
    main()
