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


def proxied_to(server):
    """A fresh bucket on ``server`` behind a fault proxy: (transport through it, the proxy)."""
    from faultproxy import FaultProxy
    proxy = FaultProxy(server.endpoint).start()
    bucket = f"conflict-{threading.get_ident() % 10_000}-{id(proxy) % 100_000}"
    server.make_bucket(bucket)
    return Transport(f"s3://{bucket}/run", {**server.options(), "endpoint_url": proxy.endpoint}), proxy


def test_a_409_conditional_conflict_is_sent_again_and_its_condition_then_decides(server):
    """409 ConditionalRequestConflict (AWS: another conditional write on the key was in flight)
    decided nothing: the write is sent again, then wins -- or is refused by its own condition --
    as it would have without the conflict. Three 409s in a row, then the real server answers."""
    t, proxy = proxied_to(server)
    try:
        proxy.set("409-conditions", times=3, path="/run/lease")
        first = t.put_if_absent("lease", b"mine")
        assert first is not None and proxy.injected["409-conditions"] == 3  # won after three conflicts
        proxy.set("409-conditions", times=2, path="/run/lease")
        assert t.put_if_absent("lease", b"theirs") is None  # then refused: the key exists (412)
        proxy.set("409-conditions", times=2, path="/run/lease")
        second = t.put_if_match("lease", b"renewed", first)
        assert second is not None and t.read_versioned("lease", 100)[:2] == (b"renewed", second)
        proxy.set("409-conditions", times=2, path="/run/lease")
        assert t.put_if_match("lease", b"stale", first) is None  # a stale version, after the conflicts
    finally:
        proxy.close()


def test_a_409_that_never_ends_is_a_transient_error_not_a_lost_race(server):
    t, proxy = proxied_to(server)
    try:
        proxy.set("409-conditions", path="/run/lease")
        with pytest.raises(RemoteError, match="ConditionalRequestConflict") as info:
            t.put_if_absent("lease", b"mine")
        assert info.value.transient and proxy.injected["409-conditions"] == 6  # the first send and five more
        proxy.clear()
        assert t.get_optional("lease", 100) is None and t.put_if_absent("lease", b"mine") is not None
    finally:
        proxy.close()


def test_a_fork_copies_on_the_server_and_its_commit_is_create_only(server, tmp_path):
    """The fork's copy on each real server: CopyObject into the child's objects/, then the child's
    create-only marker; a second fork onto that step is refused by the marker, and a fresh machine
    restores the child bit for bit with the parent gone."""
    bucket = f"fork-{id(tmp_path) % 100_000}"
    server.make_bucket(bucket)
    parent_url, child_url = f"s3://{bucket}/parent", f"s3://{bucket}/child"
    saved = state(3)
    with CheckpointStore(tmp_path / "parent", parent_url, remote_options=server.options()) as parent:
        parent.save(3, saved).wait()
        assert parent.wait(uploads=True, timeout=60)
        parent.fork(3, tmp_path / "child", remote=child_url)
    from tieredckpt._tiers.remote import RemoteTier
    child, source = RemoteTier(child_url, server.options()), RemoteTier(parent_url, server.options())
    assert child.steps() == [3] and child.upload_manifest(3).sent_size == 0  # no byte went through us
    with pytest.raises(TieredCkptError, match="already"):
        child.copy_step_from(source, 3)  # the marker is create-only on this server too
    source.t.rm_tree("")  # the parent's remote is gone: the child's objects are its own
    with CheckpointStore(tmp_path / "fresh", child_url, remote_options=server.options(), read_only=True) as r:
        got = r.restore()
    assert got["step"] == 3 and torch.equal(got["w"], saved["w"])


def test_a_wrong_secret_is_refused_by_seaweedfs_as_an_access_error(seaweed_server, tmp_path):
    seaweed_server.make_bucket("creds")
    options = {**seaweed_server.options(), "secret": "not-the-secret"}
    with pytest.raises(RemoteAccessError, match="refused"):
        CheckpointStore(tmp_path / "a", "s3://creds/run", remote_options=options)


def test_each_servers_own_answers_land_in_the_right_class(server):
    """The classes of the error map, against what each real server answers: a missing key and a
    missing bucket are not-found (never transient), a refused condition is a lost race, not an
    error, and a server that will not answer is transient."""
    bucket = f"answers-{id(server) % 10_000}-{threading.get_ident() % 1000}"
    server.make_bucket(bucket)
    t = Transport(f"s3://{bucket}/run", server.options())
    with pytest.raises(RemoteNotFoundError) as missing_key:
        t.get("no-such-key", 100)
    with pytest.raises(RemoteNotFoundError, match="NoSuchBucket|does not exist") as missing_bucket:
        Transport("s3://no-such-bucket-here/run", server.options()).probe(create=False)
    assert not missing_key.value.transient and not missing_bucket.value.transient
    assert t.put_if_absent("k", b"1") is not None and t.put_if_absent("k", b"2") is None
    gone = Transport(f"s3://{bucket}/run", {**server.options(), "endpoint_url": "http://127.0.0.1:9"},
                     request_timeout=5)
    with pytest.raises(RemoteError) as unreachable:
        gone.get("k", 100)
    assert unreachable.value.transient and not isinstance(unreachable.value, RemoteAccessError)


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
