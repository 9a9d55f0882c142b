"""A fault a real server does not produce on cue: one part vanishes between its send and the commit
(as if deleted as an object no step named). Used in-process and by rank_worker's leader."""

from __future__ import annotations

from tieredckpt._tiers.remote import RemoteTier


def losing_commit(file_index: int, lost: list[str]):
    """A RemoteTier.commit_upload that first deletes the last part of file ``file_index`` (once,
    recorded in ``lost``), then commits as usual."""
    real = RemoteTier.commit_upload

    def lose_one_then_commit(self, manifest, codec, files, *args, **kwargs):
        if not lost:
            lost.append(files[file_index].parts[-1].path)
            self.t.rm(lost[0])
        return real(self, manifest, codec, files, *args, **kwargs)
    return lose_one_then_commit
