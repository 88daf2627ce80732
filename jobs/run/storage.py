"""Where a run's files live: a local directory, or an object store (`s3://bucket/prefix`,
`gs://bucket/prefix`) reached through `pyarrow.fs`, Ray Train's own storage layer.

Invariants:

* A URI is what `jobs.spec.fields.STORE_URI` accepts; `open_store` turns it (or a local path) into
  a `Store`: a pyarrow filesystem and a path on it. S3 and GCS go through the same code path.
* The endpoint and credentials come from the environment only, as AWS and GCP tools take them,
  never from the spec and never into a message: pyarrow's S3 client reads AWS_ACCESS_KEY_ID,
  AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_REGION / AWS_DEFAULT_REGION, the profile files and
  an instance role itself; it does not read AWS_ENDPOINT_URL when built directly, so
  `_s3_filesystem` passes AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL (scheme and host:port) explicitly.
  GCS takes application default credentials.
* A run whose `run.output_dir` is a URI is written into its staging directory (`staging_dir`: one
  per URI, under the rayft cache), and `jobs.run.mirror` copies it to the store. Buckets are never
  created: a missing bucket is the user's mistake.
* Every failure of the store is one typed line (`store_error`): wrong credentials, a missing bucket,
  or no answer before the run starts are a SpecError (exit 2); a failure during the run a RunError
  (exit 1).
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from jobs.errors import RayftError, RunError, SpecError
from jobs.spec.fields import STORE_URI
from jobs.spec.yaml_file import one_line

# The S3 endpoint variables AWS's own tools read, the service-specific one first.
ENDPOINT_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
# What the store says when the request was the user's mistake: the keys, the permissions, the bucket
# (AWS's error codes as pyarrow's S3 client and GCS's HTTP statuses spell them).
_CREDENTIALS = re.compile(
    r"SIGNATURE_DOES_NOT_MATCH|INVALID_ACCESS_KEY_ID|ACCESS_DENIED|InvalidAccessKeyId|SignatureDoesNotMatch|"
    r"AccessDenied|Forbidden|\b40[13]\b|UNAUTHENTICATED|PERMISSION_DENIED|credentials",
    re.IGNORECASE,
)
_NO_BUCKET = re.compile(r"NO_SUCH_BUCKET|NoSuchBucket|bucket does not exist|\bNOT_FOUND\b.*bucket", re.IGNORECASE)
_AWS_CODE = re.compile(r"AWS Error ([A-Z_]+)")


def is_uri(location: str | Path) -> bool:
    """True when `location` (a `run.output_dir`, `{name}` filled in) is an object-store URI."""
    return isinstance(location, str) and STORE_URI.fullmatch(location) is not None


@dataclass(frozen=True)
class Store:
    """A place on a filesystem: `fs` (pyarrow), `path` on it (`bucket/prefix` for a bucket, an
    absolute path locally), and `uri` as the user wrote it (what messages name)."""

    fs: Any  # pyarrow.fs.FileSystem (pyarrow ships no type information)
    path: str
    uri: str

    def key(self, *parts: str) -> str:
        """The path of `parts` (joined with '/') below this store's path."""
        return "/".join([self.path.rstrip("/"), *parts])


def open_store(location: str) -> Store:
    """`location` (a URI or a local path) as a Store. Builds the client only; sends nothing."""
    m = STORE_URI.fullmatch(location)
    if m is None:
        from pyarrow import fs

        return Store(fs.LocalFileSystem(), str(Path(location).resolve()), location)
    scheme, bucket, prefix = m.group(1), m.group(2), m.group(3)
    client = _s3_filesystem() if scheme == "s3" else _gcs_filesystem()
    return Store(client, f"{bucket}{prefix}".rstrip("/"), location)


def _s3_filesystem():
    from pyarrow import fs

    endpoint = next((os.environ[v] for v in ENDPOINT_VARS if os.environ.get(v)), None)
    if endpoint is None:
        return fs.S3FileSystem()
    parsed = urlparse(endpoint if "://" in endpoint else f"https://{endpoint}")
    return fs.S3FileSystem(endpoint_override=parsed.netloc, scheme=parsed.scheme or "https")


def _gcs_filesystem():
    from pyarrow import fs

    return fs.GcsFileSystem()


def cache_root() -> Path:
    """rayft's cache on this machine: `$RAYFT_CACHE`, else `~/.cache/rayft`."""
    return Path(os.environ.get("RAYFT_CACHE", Path.home() / ".cache" / "rayft"))


def staging_dir(uri: str) -> Path:
    """The local directory a run to `uri` is written into before its files are uploaded: one per
    URI (its sha256 names it; the bucket and last prefix component are there for a reader)."""
    m = STORE_URI.fullmatch(uri)
    assert m is not None, "staging_dir takes a URI"
    tail = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{m.group(2)}-{uri.rstrip('/').rsplit('/', 1)[-1]}")[:80]
    return cache_root() / "staging" / f"{m.group(1)}-{tail}-{hashlib.sha256(uri.encode()).hexdigest()[:16]}"


def store_error(err: OSError, uri: str, doing: str, *, during_run: bool, field: str = "run.output_dir") -> RayftError:
    """The one line a failure of the store is reported as (`field=uri: doing: why`): the user's
    mistake (credentials, a missing bucket) a SpecError; anything else a SpecError before the run
    starts (nothing answers at the endpoint the environment names) and a RunError during it."""
    text = str(err)
    code = _AWS_CODE.search(text)
    reason = code.group(1) if code else one_line(text.split(". ")[0])[:160]
    where = f"{field}={one_line(uri)}: {doing}"
    if _NO_BUCKET.search(text):
        return SpecError(
            f"{where}: the bucket does not exist ({reason}); create it first (rayft never creates buckets)"
        )
    if _CREDENTIALS.search(text):
        return SpecError(
            f"{where}: the store refused the credentials ({reason}); check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY "
            "(or the instance role, or GCP's application default credentials) and the bucket's permissions"
        )
    if during_run:
        return RunError(f"{where}: the store failed ({reason}); the run's files are kept in its staging directory")
    return SpecError(f"{where}: the store does not answer ({reason}); check AWS_ENDPOINT_URL and the network")


@contextmanager
def reported(store: Store, doing: str, *, during_run: bool, field: str = "run.output_dir") -> Iterator[None]:
    """Run the block; an OSError from the store is re-raised as `store_error`'s one line."""
    try:
        yield
    except OSError as e:
        raise store_error(e, store.uri, doing, during_run=during_run, field=field) from None


CHUNK_BYTES = 8 << 20


def list_files(store: Store, where: str, *, recursive: bool = True) -> list[str]:
    """Paths (relative to `where` under the store's path) of the files there; [] when none."""
    from pyarrow import fs

    base = store.key(where).rstrip("/") if where else store.path.rstrip("/")
    infos = store.fs.get_file_info(fs.FileSelector(base, recursive=recursive, allow_not_found=True))
    return sorted(i.path[len(base) + 1 :] for i in infos if i.type == fs.FileType.File)


def download(store: Store, rel: str, local: Path) -> None:
    """The object `rel` below the store's path (`""`: the object the path names) into the local
    file `local` (parents made)."""
    local.parent.mkdir(parents=True, exist_ok=True)
    with store.fs.open_input_stream(store.key(rel) if rel else store.path) as src, open(local, "wb") as dst:
        for chunk in iter(lambda: src.read(CHUNK_BYTES), b""):
            dst.write(chunk)


def upload(store: Store, local: Path, rel: str) -> None:
    """The local file `local` to the object `rel` below the store's path."""
    with open(local, "rb") as src, store.fs.open_output_stream(store.key(rel)) as dst:
        for chunk in iter(lambda: src.read(CHUNK_BYTES), b""):
            dst.write(chunk)
