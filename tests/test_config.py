"""The checkpoint section of a training config: dict, TOML, JSON; secrets from the environment."""

from __future__ import annotations

import json

import pytest
import torch

import tieredckpt
from tieredckpt import AnyOf, CheckpointStore, KeepEvery, KeepLast, StoreConfig

PUBLIC = {
    "CheckpointStore", "SaveHandle", "CheckpointInfo", "StoreConfig", "KeepLast", "KeepEvery", "AnyOf",
    "capture_rng", "restore_rng", "LossHistory", "RunLog",
    "ShardManifest", "ShardEntry", "save_sharded", "load_sharded", "verify_checkpoint",
    "FlatCheckpoint", "read_flat", "write_flat", "model_to_flat", "flat_to_model", "flat_state", "__version__",
}


def test_the_public_surface_is_exactly_the_store_policies_format_functions_and_errors():
    import inspect
    import pkgutil

    from tieredckpt import errors
    error_names = {n for n, v in vars(errors).items() if inspect.isclass(v) and issubclass(v, Exception)
                   and v.__module__ == errors.__name__}
    assert set(tieredckpt.__all__) == PUBLIC | error_names  # both ways: nothing missing, nothing extra
    for name in tieredckpt.__all__:
        value = getattr(tieredckpt, name)
        assert name == "__version__" or getattr(value, "__name__", name) == name, name
    with pytest.raises(AttributeError):
        tieredckpt.LocalTier  # noqa: B018 - internals are not reachable from the package
    # every other module is private: a leading underscore on its package
    public_modules = {m.name for m in pkgutil.iter_modules(tieredckpt.__path__) if not m.name.startswith("_")}
    # dcp: torch.distributed.checkpoint on the store; hf, lightning: the framework integrations
    assert public_modules == {"errors", "cli", "dcp", "hf", "lightning"}


def test_toml_section_with_env_secrets(tmp_path, monkeypatch):
    monkeypatch.setenv("MY_SECRET", "s3cr3t-value")
    path = tmp_path / "train.toml"
    path.write_text(f"""
[model]
layers = 12

[checkpoint]
local = "{tmp_path / 'run'}"
remote = "file://{tmp_path / 'remote'}"
every = 50
keep_local = 2
compression = "none"
keep_remote = {{ last = 3, every = 1000 }}
[checkpoint.remote_options]
token = "${{MY_SECRET}}"
""")
    cfg = StoreConfig.load(path)
    assert cfg.every == 50 and cfg.keep_local == 2 and cfg.compression is None
    assert cfg.remote_options == {"token": "s3cr3t-value"}
    assert cfg.keep_remote == AnyOf(KeepLast(3), KeepEvery(1000))


def test_store_from_a_dict_config_uploads(tmp_path):
    section = {"local": str(tmp_path / "run"), "remote": f"file://{tmp_path / 'remote'}", "every": 1,
               "keep_remote": {"last": 1}}
    with CheckpointStore.from_config(section) as store:
        assert store.every == 1
        store.save(1, {"x": torch.ones(3)}).wait()
        store.save(2, {"x": torch.ones(3)}).wait()
        store.wait(uploads=True)
        assert store.remote.steps() == [2]


@pytest.mark.parametrize("raw, match", [
    ({"remote": "s3://b/x"}, "'local'"),
    ({"local": "x", "evry": 5}, r"unknown checkpoint settings \['evry'\]"),
    ({"local": "x", "keep_remote": {"newest": 2}}, "keep_remote"),
    ({"local": "${NOT_SET_ANYWHERE_123}"}, "NOT_SET_ANYWHERE_123 is not set"),
])
def test_bad_config_is_refused_naming_the_setting(raw, match):
    with pytest.raises(ValueError, match=match):
        StoreConfig.from_dict(raw)


def test_json_file_and_missing_section(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"checkpoint": {"local": "r", "every": 7}}))
    assert StoreConfig.load(path).every == 7
    with pytest.raises(ValueError, match=r"no \[ckpt\] section"):
        StoreConfig.load(path, section="ckpt")


@pytest.mark.parametrize("url", ["s3://bucket/run", "file:///data/x", "gs://b/r"])
def test_a_url_given_as_the_local_run_directory_is_refused_saying_where_it_goes(tmp_path, monkeypatch, url):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"is a URL, but the first argument is the local run directory.*remote="):
        CheckpointStore(url)
    with pytest.raises(ValueError, match="a path on this machine"):
        CheckpointStore(url, "s3://bucket/other")
    assert list(tmp_path.iterdir()) == []  # no ./s3:/bucket/run made


def test_storage_options_and_fs_are_fsspec_names_for_remote_options_and_remote_fs(tmp_path):
    remote = f"file://{tmp_path / 'remote'}"
    with CheckpointStore(tmp_path / "a", remote, storage_options={"auto_mkdir": True}) as store:
        store.save(1, {"w": torch.ones(3)}).wait()
        assert store.wait(uploads=True, timeout=30)
    from conftest import FlakyFS

    from tieredckpt._tiers.remote import RemoteTier
    other = f"file://{tmp_path / 'other'}"
    counted = FlakyFS(RemoteTier(other, {}).fs, {})  # counts its pipe_file and cat_file calls
    with CheckpointStore(tmp_path / "b", other, fs=counted) as store:
        store.save(1, {"w": torch.ones(3)}).wait()
        assert store.wait(uploads=True, timeout=30)
    assert counted.calls.get("pipe_file", 0) > 0  # the instance given was the one used
    memfs = counted
    with pytest.raises(ValueError, match="same option under two names"):
        CheckpointStore(tmp_path / "c", remote, storage_options={}, remote_options={})
    with pytest.raises(ValueError, match=r"needs remote="):
        CheckpointStore(tmp_path / "d", fs=memfs)


def _store_options() -> dict:
    import inspect
    params = inspect.signature(CheckpointStore.__init__).parameters
    return {n: p.default for n, p in params.items() if n != "self"}


def test_a_config_holds_every_store_option_a_file_can_hold_with_the_same_default():
    from dataclasses import MISSING, fields

    from tieredckpt._loop.config import NOT_IN_FILES
    options = _store_options()
    held = {f.name: (f.default_factory() if f.default_factory is not MISSING else f.default) for f in fields(StoreConfig)}
    assert set(held) == set(options) - set(NOT_IN_FILES)  # both ways: a new option needs a config field
    for name, default in held.items():
        if name == "remote_options":
            assert options[name] is None and default == {}
        elif name != "local":
            assert default == options[name], name


# One value for every option a file can hold, none of them the default.
EVERY_OPTION = """
[checkpoint]
local = "{run}"
remote = "file://{remote}"
every = 7
keep_local = 4
verify = "sha256"
keep_remote = {{ last = 2, every = 1000 }}
compression = "zstd"
compression_level = 3
uploads = "all"
max_pending_uploads = 5
upload_backoff = [0.25, 5.0, 30.0]
request_timeout = 30.0
audit_interval = 120.0
upload_part_size = 8388608
close_timeout = "none"
exit_timeout = 3.0
upload_on_exit = 10.0
on_save_error = "warn"
read_only = false
takeover = true
allow_unfenced = true
distributed = false
stall_budget = 0.05
overlap = true
orphan_grace = "none"
[checkpoint.storage_options]
auto_mkdir = true
"""


def test_every_option_round_trips_from_toml_into_the_store(tmp_path):
    path = tmp_path / "train.toml"
    path.write_text(EVERY_OPTION.format(run=tmp_path / "run", remote=tmp_path / "remote"))
    cfg = StoreConfig.load(path)
    defaults = StoreConfig(local="x")
    changed = {k for k, v in cfg.store_kwargs().items() if v != getattr(defaults, k)}
    assert changed == set(cfg.store_kwargs()) - {"read_only"}  # the file set every one (read_only=false is the default)
    assert cfg.remote_options == {"auto_mkdir": True} and cfg.close_timeout is None and cfg.orphan_grace is None
    assert cfg.upload_backoff == (0.25, 5.0, 30.0) and cfg.keep_remote == AnyOf(KeepLast(2), KeepEvery(1000))
    with CheckpointStore.from_config(path) as store:  # the store takes every one of them
        assert (store.every, store.keep_local, store.verify, store.on_save_error) == (7, 4, "sha256", "warn")
        assert store.overlap is True and store.close_timeout is None and store.upload_on_exit == 10.0
        store.save(7, {"w": torch.ones(3)}).wait()
        assert store.wait(uploads=True, timeout=60)
        assert store.remote.steps() == [7]


def test_every_option_can_come_from_the_environment():
    env = {"TIEREDCKPT_LOCAL": "/nvme/run", "TIEREDCKPT_REMOTE": "s3://b/run", "TIEREDCKPT_KEEP_LOCAL": "5",
           "TIEREDCKPT_KEEP_REMOTE": '{"last": 3}', "TIEREDCKPT_TAKEOVER": "true", "TIEREDCKPT_VERIFY": "sha256",
           "TIEREDCKPT_ORPHAN_GRACE": "none", "TIEREDCKPT_DEBUG": "1", "HOME": "/root"}
    cfg = StoreConfig.from_env(env)
    assert (cfg.local, cfg.remote, cfg.keep_local, cfg.keep_remote) == ("/nvme/run", "s3://b/run", 5, KeepLast(3))
    assert cfg.takeover is True and cfg.verify == "sha256" and cfg.orphan_grace is None
    with pytest.raises(ValueError, match=r"the environment \(TIEREDCKPT_\*\): unknown checkpoint settings \['evry'\]"):
        StoreConfig.from_env({"TIEREDCKPT_LOCAL": "x", "TIEREDCKPT_EVRY": "5"})
