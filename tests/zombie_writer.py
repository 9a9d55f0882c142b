"""A writer of the fencing tests: saves (and uploads) a step every INTERVAL seconds until SIGTERM.

    python zombie_writer.py RUN_DIR REMOTE_URL [INTERVAL [TIMELINE [KEEP_REMOTE [takeover]]]]

(AWS_ENDPOINT_URL set for an s3:// remote.) It resumes from the newest step it can restore, so
a second one started with ``takeover`` is a relaunch of the first; each state records TIMELINE.
"""

import os
import sys
import time

import torch

from tieredckpt import CheckpointStore, KeepLast

run_dir, url = sys.argv[1], sys.argv[2]
interval = float(sys.argv[3]) if len(sys.argv) > 3 else 0.2
timeline = sys.argv[4] if len(sys.argv) > 4 else "a"
keep = KeepLast(int(sys.argv[5])) if len(sys.argv) > 5 and sys.argv[5] != "0" else None
takeover = len(sys.argv) > 6 and sys.argv[6] == "takeover"
options = {"endpoint_url": os.environ["AWS_ENDPOINT_URL"]} if url.startswith("s3://") else {}


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step * 7 + (0 if timeline == "a" else sum(map(ord, timeline))))
    return {"w": torch.randn(50_000, generator=g), "step": step, "timeline": timeline}


with CheckpointStore(run_dir, url, remote_options=options, every=1, upload_backoff=(0.05, 0.5, 0.5),
                     keep_remote=keep, takeover=takeover) as store, store.handle_signals():
    saved = store.restore()
    step = saved["step"] if saved else 0
    print(f"resumed {step} token {store.uploader.lease.token}", flush=True)
    while True:
        step += 1
        time.sleep(interval)
        if store.step_end(step, lambda: state(step)):
            break
        print(f"step {step} uploaded {store.upload_status()['newest_uploaded']}", flush=True)
