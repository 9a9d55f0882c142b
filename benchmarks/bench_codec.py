"""Bytes sent and client CPU per GB for each codec, on real AdamW state in fp32, bf16 and fp16.

    python benchmarks/bench_codec.py [--params 120000000] [--repeats 3]

The state is a GPT-shaped transformer trained a few AdamW steps on CPU in each
dtype (its optimizer state in the same dtype), saved as one tieredckpt shard.
Each codec encodes the shard the way the uploader does (64 MiB parts; zstd-dtype
with the element-width runs from the shard header, into one reused frame buffer) and decodes it back; the
result must equal the shard byte for byte. Reported per dtype and codec: stored
bytes / raw bytes (what goes over the wire), and encode and decode seconds of CPU
per GB of raw bytes (median of the repeats, spread in brackets). No network is
involved: the wire costs the same for every codec per byte sent (see bench_remote).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
from bench_remote import cpu_seconds, trained_state  # noqa: E402
from common import median, table  # noqa: E402

from tieredckpt._format.checksum import map_file  # noqa: E402
from tieredckpt._format.codec import decode, encode, frame_bound, runs_in  # noqa: E402
from tieredckpt._format.shardheader import float_spans  # noqa: E402
from tieredckpt._tiers.sharded import save_sharded  # noqa: E402

PART = 64 << 20
CODECS = ("zstd-dtype", "zstd-planes", "zstd")


def round_trip(shard: str, codec: str) -> tuple[int, float, float]:
    """Stored bytes, encode CPU s, decode CPU s for the whole shard, part by part."""
    size = os.path.getsize(shard)
    buf = map_file(shard, size)
    spans = float_spans(shard) if codec == "zstd-dtype" else []
    stored_total, enc, dec = 0, 0.0, 0.0
    frame = bytearray(PART + (1 << 20)) if codec == "zstd-dtype" else None  # reused, as the uploader's pool does
    for offset in range(0, size, PART):
        raw = buf[offset:offset + PART]
        runs = runs_in(spans, offset, raw.numel()) if codec == "zstd-dtype" else None
        t0 = cpu_seconds()
        out = frame if frame is not None and len(frame) >= frame_bound(raw.numel(), runs) else None
        stored = encode(raw, codec, 1, runs, out=out)
        t1 = cpu_seconds()
        back = decode(stored, codec, raw.numel(), shard)
        t2 = cpu_seconds()
        if not torch.equal(torch.frombuffer(back, dtype=torch.uint8), raw):
            raise SystemExit(f"{codec}: part at {offset} did not round-trip")
        stored_total += len(stored)
        enc, dec = enc + t1 - t0, dec + t2 - t1
    return stored_total, enc, dec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=int, default=120_000_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="write the figures here as JSON (benchmarks/plot.py draws them)")
    args = p.parse_args()
    torch.set_num_threads(1)  # CPU seconds of one encoder, as the uploader's thread spends them
    rows, figures = [], []
    with tempfile.TemporaryDirectory(prefix="bench-codec-") as root:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            name = str(dtype).split(".")[1]
            print(f"training in {name} for real AdamW state ...", flush=True)
            state = trained_state(args.params, dtype=dtype)
            ckpt = os.path.join(root, name)
            nbytes = save_sharded([state], ckpt, 3).total_size
            del state
            shard = os.path.join(ckpt, "rank0.bin")
            for codec in CODECS:
                runs = [round_trip(shard, codec) for _ in range(args.repeats)]
                stored = runs[0][0]
                enc = [r[1] / nbytes * 1e9 for r in runs]
                dec = [r[2] / nbytes * 1e9 for r in runs]
                rows.append([name, f"{nbytes / 1e9:.3f}", codec, f"{stored / nbytes:.3f}x",
                             f"{median(enc):.2f} [{min(enc):.2f}-{max(enc):.2f}]",
                             f"{median(dec):.2f} [{min(dec):.2f}-{max(dec):.2f}]"])
                print("  ", " | ".join(rows[-1]), flush=True)
                figures.append({"dtype": name, "codec": codec, "raw": nbytes, "stored": stored,
                                "encode_s_per_gb": enc, "decode_s_per_gb": dec})
    print()
    print(table(rows, ("dtype", "raw GB", "codec", "stored/raw", "encode CPU s/GB", "decode CPU s/GB")))
    print(f"\n{time.strftime('%Y-%m-%d %H:%M')}; targets: bf16 and fp16 <= 0.75x raw, fp32 <= 0.84x")
    if args.json:
        import json
        with open(args.json, "w") as f:
            json.dump({"params": args.params, "part": PART, "rows": figures}, f, indent=1)


if __name__ == "__main__":
    main()
