"""Writer A of the zombie test: saves (and uploads) a step every 0.2 s until SIGTERM.

    python zombie_writer.py RUN_DIR REMOTE_URL     (AWS_ENDPOINT_URL set for an s3:// remote)
"""

import os
import sys
import time

import torch

from tieredckpt import CheckpointStore

run_dir, url = sys.argv[1], sys.argv[2]
options = {"endpoint_url": os.environ["AWS_ENDPOINT_URL"]} if url.startswith("s3://") else {}


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step * 7)
    return {"w": torch.randn(50_000, generator=g), "step": step, "timeline": "a"}


with CheckpointStore(run_dir, url, remote_options=options, every=1, upload_backoff=(0.05, 0.5, 0.5)) as store, \
        store.handle_signals():
    step = 0
    while True:
        step += 1
        time.sleep(0.2)
        if store.step_end(step, lambda: state(step)):
            break
        print(f"step {step} uploaded {store.upload_status()['newest_uploaded']}", flush=True)
