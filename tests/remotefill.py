"""Filling a remote with many steps quickly, by copying one real upload (for tests and bench_scale).

    fill(remote, template_step=1, steps=range(2, 2001))

Each new step gets a copy of the template's ``upload.json`` rewritten to name that
step (its embedded manifest's digest recomputed), so it is committed in every
reader's eyes. Only ``with_parts`` steps also get copies of the template's parts
(restorable); the others hold their upload manifest alone, which is all that
listing and resolving a remote ever look at.
"""

from __future__ import annotations

import json

from tieredckpt._format import layout
from tieredckpt._format.manifest import DIGEST_KEY, canonical_digest


def upload_json_for(template: bytes, step: int) -> bytes:
    raw = json.loads(template)
    raw["step"] = step
    raw["checkpoint"]["step"] = step
    raw["checkpoint"][DIGEST_KEY] = canonical_digest(raw["checkpoint"])
    return json.dumps(raw).encode()


def fill(remote, template_step: int, steps, with_parts=()) -> None:
    fs = remote.fs
    src = layout.step_dir_name(template_step)
    template = fs.cat_file(remote.path(src, layout.UPLOAD_MANIFEST))
    parts = {p.rsplit("/", 1)[-1]: fs.cat_file(p) for p in fs.find(remote.path(src))
             if not p.endswith(layout.UPLOAD_MANIFEST)}
    objects = {}
    for step in steps:
        name = layout.step_dir_name(step)
        objects[remote.path(name, layout.UPLOAD_MANIFEST)] = upload_json_for(template, step)
        if step in with_parts:
            for part, data in parts.items():
                objects[remote.path(name, part)] = data
    items = list(objects.items())
    for i in range(0, len(items), 500):  # fsspec's pipe sends a batch concurrently on async backends
        fs.pipe(dict(items[i:i + 500]))
    newest = max(steps, default=template_step)
    fs.pipe_file(remote.path(layout.LATEST), (layout.step_dir_name(max(newest, template_step)) + "\n").encode())
    fs.invalidate_cache()
