"""The run lock on object storage (`jobs.run.lease`), against the real S3 server: a live lease of
another holder refuses `rayft run` in one line (exit 2) naming it and its expiry, with nothing
written in the bucket; an expired one is taken over; the lease is in the bucket before the run
marker and is given back at the end; a racing starter's write inside the settle window wins; the
holder's thread refreshes it and notices when it was taken over."""

from __future__ import annotations

import json
import re
import time

import pytest

from jobs.errors import RunError, UserError
from jobs.run import lease, mirror
from jobs.run.storage import open_store
from tests.integration.test_object_storage import _one_line_exit_2, _rayft_run


def _put_lease(server, prefix: str, *, expires: float, token: str = "their-token") -> bytes:
    """A lease as another run on host `elsewhere` leaves it."""
    rec = {"holder": {"pid": 4242, "host": "elsewhere", "token": token}, "taken": expires - 60, "expires": expires}
    body = (json.dumps(rec) + "\n").encode()
    with server.filesystem().open_output_stream(f"{prefix}/{lease.LEASE}") as f:
        f.write(body)
    return body


def _read(server, key: str) -> bytes:
    with server.filesystem().open_input_stream(key) as f:
        return f.read()


@pytest.fixture
def store(s3_server, monkeypatch):
    """A fresh prefix's Store, the process environment pointing at the server."""
    bucket = s3_server.make_bucket("lease")
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    prefix = f"{bucket}/p{time.monotonic_ns()}"
    return open_store(f"s3://{prefix}")


def test_a_live_lease_of_another_run_refuses_the_run_in_one_line_with_nothing_written(s3_server, tmp_path):
    s3_server.make_bucket("leased")
    body = _put_lease(s3_server, "leased/run", expires=time.time() + 45)
    p = _rayft_run(s3_server, tmp_path / "cache", "s3://leased/run")
    _one_line_exit_2(p, "another run is using it (pid 4242 on host elsewhere; its lease expires at ")
    left_s = int(re.search(r"\(in (\d+) s\)", p.stderr).group(1))
    assert 0 < left_s <= 45  # the lease's own expiry, not a fixed TTL from now
    assert s3_server.objects("leased/run") == {lease.LEASE: len(body)}
    assert _read(s3_server, f"leased/run/{lease.LEASE}") == body  # left as it was


def test_an_expired_lease_is_taken_over_held_before_the_marker_and_given_back(s3_server, tmp_path):
    s3_server.make_bucket("expired")
    _put_lease(s3_server, "expired/run", expires=time.time() - 1)  # its holder died a while ago
    seen: dict[str, dict | None] = {}
    real = mirror.upload

    def upload(store, local, rel):
        seen.setdefault(rel, lease.read(store))  # the lease in the bucket when each file first goes up
        return real(store, local, rel)

    mirror.upload = upload
    try:
        p = _rayft_run(s3_server, tmp_path / "cache", "s3://expired/run")
    finally:
        mirror.upload = real
    assert p.returncode == 0, p.stderr[-3000:]
    at_marker = seen[".rayft-run"]
    assert at_marker is not None and at_marker["holder"]["host"] != "elsewhere"
    assert at_marker["expires"] - at_marker["taken"] == lease.TTL_S
    assert "summary.json" in s3_server.objects("expired/run")
    assert lease.LEASE not in s3_server.objects("expired/run")  # given back at the end


def test_a_starter_that_writes_inside_the_settle_window_wins_and_the_other_is_refused(store, monkeypatch):
    def racer_writes(_seconds):  # between our write and our read-back
        with store.fs.open_output_stream(store.key(lease.LEASE)) as f:
            f.write(json.dumps(lease.record("racer", time.time())).encode())

    monkeypatch.setattr(lease.time, "sleep", racer_writes)
    with pytest.raises(UserError, match="another run is using it"):
        lease.take(store, "ours")
    assert lease.token_of(lease.read(store)) == "racer"
    assert store.uri not in lease._HELD


def test_the_holder_refreshes_its_lease_notices_a_takeover_and_gives_back_only_its_own(store, monkeypatch):
    monkeypatch.setattr(lease, "REFRESH_S", 0.2)
    monkeypatch.setattr(lease, "SETTLE_S", 0.0)
    lease.take(store, "ours")
    try:
        first = lease.read(store)
        assert first is not None
        refreshed = _wait_for(lambda: (r := lease.read(store)) and r["expires"] > first["expires"] and r)
        assert lease.token_of(refreshed) == "ours"
        lease.check(store, "ours")  # still ours: nothing raised
        _put_lease_at(store, "thief")
        # The refresher's next pass (every 0.2 s; later on a loaded machine) reads the thief's lease.
        with pytest.raises(RunError, match="this run's lease was taken over by pid 4242 on host elsewhere"):
            _wait_for(lambda: lease.check(store, "ours"))
    finally:
        lease.give_back(store)
    assert lease.token_of(lease.read(store)) == "thief"  # not ours: left in place


def _wait_for(probe, timeout_s: float = 30.0):
    """Calls `probe` every 0.1 s until it returns something true (returned) or raises (raised);
    fails after `timeout_s`. The lease's refresher is a thread: on a loaded machine its pass comes late."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = probe()
        if got:
            return got
        time.sleep(0.1)
    pytest.fail(f"nothing changed within {timeout_s} s")


def _put_lease_at(store, token: str) -> None:
    rec = {"holder": {"pid": 4242, "host": "elsewhere", "token": token}, "taken": time.time()}
    rec["expires"] = rec["taken"] + 60
    with store.fs.open_output_stream(store.key(lease.LEASE)) as f:
        f.write(json.dumps(rec).encode())


def test_a_run_that_ends_gives_the_lease_back_so_a_run_from_another_machine_is_not_refused(s3_server, tmp_path):
    s3_server.make_bucket("again")
    first = _rayft_run(s3_server, tmp_path / "cache", "s3://again/run")
    assert first.returncode == 0, first.stderr[-3000:]
    second = _rayft_run(s3_server, tmp_path / "other-machine", "s3://again/run")
    assert second.returncode == 0, second.stderr[-3000:]
    assert lease.LEASE not in s3_server.objects("again/run")


def test_a_run_whose_lease_is_taken_over_mid_run_stops_in_one_line_and_uploads_nothing_more(s3_server, tmp_path):
    s3_server.make_bucket("stolen")
    real = mirror.upload

    def upload(store, local, rel):
        real(store, local, rel)
        if rel == "metrics.jsonl":  # after checkpoint 2: another run takes the prefix over
            _put_lease(s3_server, "stolen/run", expires=time.time() + 60, token="thief")

    mirror.upload = upload
    try:
        p = _rayft_run(s3_server, tmp_path / "cache", "s3://stolen/run")
    finally:
        mirror.upload = real
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 1 and last.startswith("rayft: error: "), p.stderr[-3000:]
    assert "this run's lease was taken over by pid 4242 on host elsewhere" in last
    assert "Traceback" not in p.stderr
    objects = s3_server.objects("stolen/run")
    assert "summary.json" not in objects and not [k for k in objects if "step-00000004" in k]
    assert "checkpoints/step-00000002/" in "".join(objects)  # what went up before the takeover stays
    lease_now = json.loads(_read(s3_server, f"stolen/run/{lease.LEASE}"))
    assert lease.token_of(lease_now) == "thief"  # the new holder's lease is left alone
