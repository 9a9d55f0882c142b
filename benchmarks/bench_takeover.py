"""What fencing costs and how fast a takeover stops a zombie writer (moto's S3, conditional writes).

    python benchmarks/bench_takeover.py [--steps 10] [--repeats 3]

Each repeat: writer A saves and uploads a small state in a loop (a zombie that never
stops on its own) through the test suite's fault proxy, which counts every request.
Writer B opens the same remote with ``takeover=True``. Reported:

  - the time from B's takeover until A knows it lost the lease (target: <= one upload
    attempt of A), and how many commits (upload.json) A made after B owned the
    lease (target: 0);
  - then B trains, commits a few steps and closes (releasing the remote) while A goes
    on saving for a few seconds: A's commits after B's release and B's steps that are
    gone at the end (deleted by A's retention) (target: 0 and 0: a replaced writer
    never takes the remote back, issue 38);
  - requests per committed step of a lone writer, by kind: the lease record's
    conditional writes (the "sending" note before the parts, the fence before the
    commit marker) against what a step costs in all (target: <= 2 small requests of
    fencing per step).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
import torch  # noqa: E402
from faultproxy import FaultProxy  # noqa: E402
from s3server import MotoServer  # noqa: E402

from tieredckpt import CheckpointStore  # noqa: E402
from tieredckpt._tiers.remote import RemoteTier  # noqa: E402


def state(step: int) -> dict:
    return {"w": torch.full((250_000,), float(step)), "step": step}


def one(server, proxy, bucket: str, steps: int) -> dict:
    server.make_bucket(bucket)
    url, options = f"s3://{bucket}/run", {**server.options(), "endpoint_url": proxy.endpoint}
    tmp = tempfile.mkdtemp(prefix="bench-takeover-")
    try:
        a = CheckpointStore(os.path.join(tmp, "a"), url, remote_options=options, upload_backoff=(0.05, 0.5, 0.5))
        proxy.reset_counts()
        for step in range(1, steps + 1):  # a lone writer: what each committed step costs
            a.save(step, state(step)).wait()
            assert a.wait(uploads=True, timeout=60)
        lease_puts = len(proxy.requests("PUT", "writer.json"))
        total = proxy.total()
        stop, step_box = threading.Event(), [steps]

        def zombie() -> None:
            while not stop.is_set():
                step_box[0] += 1
                a.save(step_box[0], state(step_box[0])).wait()
                time.sleep(0.05)
        thread = threading.Thread(target=zombie)
        thread.start()
        time.sleep(1.0)
        started = time.monotonic()
        b = CheckpointStore(os.path.join(tmp, "b"), url, remote_options=options, takeover=True)
        owned_at, owned_wall = time.monotonic(), time.time()
        mine = b.uploader.lease.token
        while a.uploader.lease.owned and time.monotonic() - owned_at < 60:
            time.sleep(0.005)
        noticed = time.monotonic() - owned_at
        for step in range(1000, 1003):  # B's own timeline, while A goes on
            b.save(step, state(step)).wait()
            assert b.wait(uploads=True, timeout=60)
        b_steps = RemoteTier(url, server.options()).steps()
        b.close()  # B leaves normally: the record is marked free
        released = time.time()
        time.sleep(3.0)  # A saves and tries to upload a few more steps
        stop.set()
        thread.join()
        remote = RemoteTier(url, server.options())
        late = [s for s in remote.steps() if (remote.committed_by(s) or {}).get("token") != mine
                and remote.upload_manifest(s).uploaded_unix > owned_wall]
        after_release = [s for s in late if remote.upload_manifest(s).uploaded_unix > released]
        lost = sorted(set(b_steps) - set(remote.steps()))
        try:
            a.close()
        except Exception:  # noqa: BLE001 - the zombie's refused uploads are raised at its close
            pass
        return {"takeover_s": owned_at - started, "noticed_s": noticed, "late_commits": len(late),
                "after_release": len(after_release), "b_steps_lost": len(lost),
                "lease_puts_per_step": lease_puts / steps, "requests_per_step": total / steps}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    server = MotoServer().start()
    proxy = FaultProxy(server.endpoint).start()
    try:
        runs = [one(server, proxy, f"takeover-{i}", args.steps) for i in range(args.repeats)]
    finally:
        proxy.close()
        server.kill()
    for i, r in enumerate(runs):
        print(f"run {i + 1}: takeover {r['takeover_s']:.3f} s; zombie noticed {r['noticed_s']:.3f} s after; "
              f"zombie commits after the takeover: {r['late_commits']} (after B's release: {r['after_release']}); "
              f"B's steps deleted: {r['b_steps_lost']}; per committed step: "
              f"{r['lease_puts_per_step']:.1f} lease writes of {r['requests_per_step']:.1f} requests")
    print(f"median: noticed {statistics.median(r['noticed_s'] for r in runs):.3f} s, "
          f"late commits {sum(r['late_commits'] for r in runs)}, after the release "
          f"{sum(r['after_release'] for r in runs)}, B's steps deleted {sum(r['b_steps_lost'] for r in runs)} in all")


if __name__ == "__main__":
    main()
