"""The tieredckpt command line on a real run directory, run as a user would (a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import flip_byte, trained

from tieredckpt._format.flat import model_to_flat, read_flat, write_flat
from tieredckpt._tiers.local import LocalTier


def cli(*args):
    return subprocess.run([sys.executable, "-m", "tieredckpt.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def run(run_dir):
    model, opt = trained(steps=2)
    tier = LocalTier(run_dir)
    for step in (100, 200, 300):
        tier.save(step, [{"model": model.state_dict(), "optim": opt.state_dict()}], wall_clock_seconds=step * 10)
    return run_dir


def test_ls_lists_steps_sizes_and_verification(run):
    out = cli("ls", run)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["STEP", "AGE", "SIZE", "FILES", "WHERE", "STATUS"]
    assert [line.split()[0] for line in lines[1:]] == ["300", "200", "100"]  # newest first
    assert all(" local " in line for line in lines[1:])
    assert "ok (crc32c)" in lines[3] and "<- latest" in lines[1]
    flip_byte(run / "step_000200" / "rank0.bin", 200)
    out = cli("ls", run)
    assert out.returncode == 1
    assert "BAD" in out.stdout and "rank0.bin" in out.stdout


def test_verify_exit_status_reflects_problems(run):
    out = cli("verify", run, "--full")
    assert out.returncode == 0 and out.stdout.count(": ok") == 3 and "sha256" in out.stdout
    os.truncate(run / "step_000300" / "rank0.bin", 100)
    out = cli("verify", run)
    assert out.returncode == 1
    assert "step 300: FAILED" in out.stdout and "truncated" in out.stdout
    assert cli("verify", run, "--step", 100).returncode == 0


def test_inspect_shows_manifest_and_tensor_index(run):
    out = cli("inspect", run, "--step", 200)
    assert out.returncode == 0, out.stderr
    assert "step 200, world_size 1" in out.stdout and "wall_clock_seconds 2000" in out.stdout
    assert "model/fc.weight" in out.stdout and "F32" in out.stdout
    raw = json.loads(cli("inspect", run, "--json").stdout)
    assert raw["step"] == 300 and raw["schema_version"] == 1


def test_convert_flat_to_checkpoint_and_back(tmp_path):
    flat = model_to_flat(*trained(steps=1))
    src = tmp_path / "step_000001.bin"
    write_flat(src, 1, flat.weights, flat.m, flat.v)
    out = cli("convert", src, tmp_path / "run")
    assert out.returncode == 0, out.stderr
    assert "step_000001" in out.stdout
    out = cli("convert", tmp_path / "run", tmp_path / "back.bin")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "back.bin").read_bytes() == src.read_bytes()
    assert read_flat(tmp_path / "back.bin").step == 1


@pytest.mark.parametrize("args, message", [
    (["ls", "/nonexistent/run"], "/nonexistent/run: no such run directory"),
    (["inspect", "{run}", "--step", "7"], "no committed checkpoint for step 7"),
    (["convert", "/nonexistent.bin", "x"], "/nonexistent.bin: no such file"),
])
def test_user_errors_are_one_clear_line_without_traceback(run, args, message):
    out = cli(*[a.format(run=run) for a in args])
    assert out.returncode == 3  # could not run (1 is for a problem found)
    assert message in out.stderr and out.stderr.startswith("tieredckpt: error (CheckpointNotFoundError): ")
    assert "Traceback" not in out.stderr


def test_bad_flat_file_is_a_clear_error(tmp_path):
    (tmp_path / "step_000001.bin").write_bytes(b"\x01\x00\x00\x00\x05\x00\x00\x00" + b"\x00" * 10)
    out = cli("convert", tmp_path / "step_000001.bin", tmp_path / "run")
    assert out.returncode == 1 and "needs exactly 68" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "run" / "step_000001").exists()


def test_plot_writes_a_png_of_the_loss_history(tmp_path):
    from tieredckpt import CheckpointStore
    run_dir = tmp_path / "run"
    with CheckpointStore(run_dir, every=50) as store:
        for step in range(1, 201):
            store.log_loss(step, 3.0 / step ** 0.3)
            store.step_end(step, {"step": step})
            if step == 120:
                store.pivot(step, note="new data mix")
        store.run.mark_resume(150)
    out = cli("plot", run_dir, "-o", tmp_path / "loss.png")
    assert out.returncode == 0, out.stderr
    png = (tmp_path / "loss.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    empty = tmp_path / "empty"
    empty.mkdir()
    out = cli("plot", empty)
    assert out.returncode == 3 and "no loss entries" in out.stderr


def test_output_into_a_closed_pipe_ends_quietly(run):
    # `tieredckpt ls RUN | head -1`: once the reader is gone, no error and no traceback
    read, write = os.pipe()
    os.close(read)  # the reader left before the first line: the first write meets EPIPE
    try:
        done = subprocess.run([sys.executable, "-m", "tieredckpt.cli", "ls", str(run)], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write)
    assert done.returncode == 141 and done.stderr == "", done.stderr


def test_remote_option_values_are_json_where_they_parse_and_secrets_stay_text():
    import argparse

    from tieredckpt._cli.remoteargs import remote_options
    args = argparse.Namespace(endpoint_url="http://127.0.0.1:9", remote_option=[
        "anon=false", "max_concurrency=8", 'config_kwargs={"retries": {"max_attempts": 3}}',
        "default_cache_type=none", "secret=12345", "key=007", "version_aware=true"])
    assert remote_options(args, "s3://b/r") == {
        "anon": False, "max_concurrency": 8, "config_kwargs": {"retries": {"max_attempts": 3}},
        "default_cache_type": "none", "secret": "12345", "key": "007", "version_aware": True,
        "endpoint_url": "http://127.0.0.1:9"}
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        remote_options(argparse.Namespace(endpoint_url=None, remote_option=["=1"]), None)


def test_the_debug_flag_works_after_the_command_too(tmp_path):
    for argv in (["--debug", "ls", str(tmp_path / "none")], ["ls", str(tmp_path / "none"), "--debug"]):
        out = subprocess.run([sys.executable, "-m", "tieredckpt.cli", *argv], capture_output=True, text=True)
        assert out.returncode == 3 and "Traceback" in out.stderr, (argv, out.stderr)
    plain = subprocess.run([sys.executable, "-m", "tieredckpt.cli", "ls", str(tmp_path / "none")],
                           capture_output=True, text=True)
    assert plain.returncode == 3 and "Traceback" not in plain.stderr and "no such run directory" in plain.stderr
