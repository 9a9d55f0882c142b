"""A process that commits a folder step, then is killed (SIGKILL) while it saves the next one."""

import os
import sys
from pathlib import Path

from tieredckpt import CheckpointStore

run, src = Path(sys.argv[1]), Path(sys.argv[2])
src.mkdir(parents=True)
(src / "small.json").write_text("{}")
with CheckpointStore(run) as store:
    store.save_files(1, src).wait()
    print("step 1 committed", flush=True)
    for i in range(4):  # fresh, unflushed data: the commit's fsync has work to do
        (src / f"model-{i}.safetensors").write_bytes(os.urandom(16 << 20))
    print("saving step 2", flush=True)
    store.save_files(2, src).wait()
    print("step 2 committed", flush=True)
