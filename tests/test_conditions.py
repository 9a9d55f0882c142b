"""A server that does not enforce conditional writes is found out at open, before it costs a step.

Through the fault proxy in front of moto: "strip-conditions" takes If-None-Match/If-Match
off every request (a server that ignores them answers 200 to every write, as many
S3-compatible ones do), "501-conditions" answers 501 to any request that carries them.
Against the servers themselves: what the lease relies on holds there. And the error map
classes each answer by the server's code and status.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from tieredckpt import CheckpointStore, TieredCkptError
from tieredckpt._tiers import condprobe
from tieredckpt._tiers.remoteerrors import map_error
from tieredckpt._tiers.transport import Transport
from tieredckpt.errors import RemoteAccessError, RemoteError, RemoteNotFoundError


def state(step: int) -> dict:
    return {"w": torch.full((1000,), float(step)), "step": step}


def open_store(path, proxied, **kw):
    kw.setdefault("upload_backoff", (0.05, 0.5, 0.5))
    return CheckpointStore(path, proxied.url, remote_options=proxied.options, **kw)


def test_a_server_that_ignores_the_headers_is_refused_at_open_and_nothing_is_written(tmp_path, proxied):
    proxied.proxy.set("strip-conditions")
    with pytest.raises(RemoteError, match=r"does not enforce conditional writes \(it accepted a create-only "
                                          r"write .*allow_unfenced=True") as info:
        open_store(tmp_path / "a", proxied)
    assert proxied.url.split("//")[1] in str(info.value)  # names the remote
    assert not info.value.transient
    held = proxied.remote().t.fs.find(f"{proxied.bucket}")
    assert not [k for k in held if "writer.json" in k or "/step_" in k], held  # no lease, no step
    assert not [k for k in held if "/.probe/" in k], held  # the probe cleaned up after itself
    with CheckpointStore(tmp_path / "r", proxied.url, remote_options=proxied.options, read_only=True) as r:
        assert r.restore() is None  # a reader never needs the probe


def test_a_reader_sends_no_probe(tmp_path, proxied):
    proxied.proxy.set("strip-conditions")
    proxied.proxy.reset_counts()
    with CheckpointStore(tmp_path / "r", proxied.url, remote_options=proxied.options, read_only=True):
        pass
    assert proxied.proxy.requests(contains="/.probe/") == []
    assert proxied.proxy.requests("PUT") == []


def test_with_allow_unfenced_it_opens_warns_uploads_and_a_fresh_machine_restores(tmp_path, proxied, caplog):
    proxied.proxy.set("strip-conditions")
    caplog.set_level(logging.WARNING, logger="tieredckpt")
    with open_store(tmp_path / "a", proxied, allow_unfenced=True) as store:
        assert store.remote.t.conditions_ignored and not store.remote.t.conditional
        store.save(5, state(5)).wait()
        assert store.wait(uploads=True, timeout=60)
    assert "writers are NOT fenced here" in caplog.text
    with CheckpointStore(tmp_path / "fresh", proxied.url, remote_options=proxied.direct, read_only=True) as r:
        assert torch.equal(r.restore()["w"], state(5)["w"])


def test_two_writers_through_it_the_second_is_refused_at_its_probe_and_the_first_keeps_the_remote(
        tmp_path, proxied):
    proxied.proxy.set("strip-conditions")
    with open_store(tmp_path / "a", proxied, allow_unfenced=True) as a:
        token = a.uploader.lease.token
        with pytest.raises(RemoteError, match="does not enforce conditional writes"):
            open_store(tmp_path / "b", proxied)
        a.save(1, state(1)).wait()
        assert a.wait(uploads=True, timeout=60)
        assert proxied.remote().committed_by(1)["token"] == token


def test_a_server_answering_501_to_the_headers_is_a_clear_error_at_open_not_a_retry_loop(tmp_path, proxied):
    proxied.proxy.set("501-conditions")
    proxied.proxy.reset_counts()
    with pytest.raises(RemoteError, match=r"does not enforce conditional writes \(it answered 501 NotImplemented "
                                          r"to If-None-Match") as info:
        open_store(tmp_path / "a", proxied)
    assert not info.value.transient
    assert proxied.proxy.total() < 10  # one probe, not retries until a close timeout
    assert proxied.proxy.requests("PUT", "writer.json") == []  # refused before the lease


def test_the_probe_passes_on_the_real_servers_and_is_not_asked_of_a_disk(tmp_path, moto_server, seaweed_server):
    for server in (moto_server, seaweed_server):
        bucket = f"probe-{id(server) % 10_000}"
        server.make_bucket(bucket)
        t = Transport(f"s3://{bucket}/run", server.options())
        assert condprobe.ignored_conditions(t) is None
        assert t.list_files(condprobe.PROBE_DIR) == {}  # deleted again
    disk = Transport(f"file://{tmp_path}/remote")
    assert condprobe.ignored_conditions(disk) is None and not (tmp_path / "remote").exists()


@pytest.fixture(params=["moto", "seaweedfs"])
def server(request, moto_server, seaweed_server):
    return {"moto": moto_server, "seaweedfs": seaweed_server}[request.param]


def test_32_concurrent_create_only_writes_of_one_key_yield_exactly_one_success(server):
    bucket = f"race-{threading.get_ident() % 100_000}-{id(server) % 1000}"
    server.make_bucket(bucket)
    t = Transport(f"s3://{bucket}/run", server.options())
    results: list = []
    barrier = threading.Barrier(32)

    def write(i: int) -> None:
        barrier.wait()
        results.append(t.put_if_absent("key", f"writer {i}".encode()))
    threads = [threading.Thread(target=write, args=(i,)) for i in range(32)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    winners = [v for v in results if v is not None]
    assert len(results) == 32 and len(winners) == 1, results
    data, version, _ = t.read_versioned("key", 1 << 10)
    assert version == winners[0] and data.startswith(b"writer ")


def test_if_match_with_a_stale_etag_or_on_a_missing_key_is_refused_as_changed_or_gone(server):
    bucket = f"match-{id(server) % 10_000}"
    server.make_bucket(bucket)
    t = Transport(f"s3://{bucket}/run", server.options())
    first = t.put_if_absent("rec", b"1")
    second = t.put_if_match("rec", b"2", first)
    assert second is not None and second != first
    assert t.put_if_match("rec", b"3", first) is None  # stale
    assert t.read_versioned("rec", 100)[0] == b"2"
    assert t.put_if_match("missing", b"x", first) is None  # gone (404 on moto, 412 on SeaweedFS)
    assert t.get_optional("missing", 100) is None


def test_a_wrong_secret_is_refused_by_seaweedfs_as_an_access_error(seaweed_server, tmp_path):
    seaweed_server.make_bucket("creds")
    options = {**seaweed_server.options(), "secret": "not-the-secret"}
    with pytest.raises(RemoteAccessError, match="refused"):
        CheckpointStore(tmp_path / "a", "s3://creds/run", remote_options=options)


# ---- the error map, by what the server said -------------------------------------------------

def client_error(code: str, status: int):
    from botocore.exceptions import ClientError
    error = ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
                        "PutObject")
    wrapped = OSError(5, "m")  # as s3fs translates it: the ClientError kept as the cause
    wrapped.__cause__ = error
    return wrapped


@pytest.mark.parametrize("code,status,kind,transient", [
    ("NotImplemented", 501, RemoteError, False),
    ("SlowDown", 503, RemoteError, True),
    ("InternalError", 500, RemoteError, True),
    ("AccessDenied", 403, RemoteAccessError, False),
    ("SignatureDoesNotMatch", 403, RemoteAccessError, False),
    ("NoSuchBucket", 404, RemoteNotFoundError, False),
    ("InvalidArgument", 400, RemoteError, False),
    ("BadDigest", 400, RemoteError, True),
    ("Unheard", 502, RemoteError, True),
])
def test_each_answer_is_classed_by_its_code_and_status_not_by_its_text(code, status, kind, transient):
    err = map_error(client_error(code, status), "write x", "s3://b/x", lambda s: s)
    assert type(err) is kind and err.transient is transient
    assert err.code == code and err.status == status


def test_no_credentials_is_an_access_error_that_says_how_to_give_them():
    from botocore.exceptions import NoCredentialsError
    err = map_error(NoCredentialsError(), "list bucket b", "s3://b/x", lambda s: s)
    assert isinstance(err, RemoteAccessError)
    assert "AWS_ACCESS_KEY_ID" in str(err) and "remote_options" in str(err)


def test_a_store_without_credentials_fails_at_open_naming_how_to_give_them(tmp_path, moto_server, monkeypatch):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(TieredCkptError, match="credentials"):
        CheckpointStore(tmp_path / "a", "s3://nobucket/run", remote_options={"endpoint_url": moto_server.endpoint})
