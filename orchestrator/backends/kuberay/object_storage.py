"""Where a rendered job's Ray pods keep run.output_dir: the shared volume, or object storage.

With a local `run.output_dir` every Ray pod mounts the ReadWriteMany claim `rayft-data` at
`DATA_MOUNT` (k8s/base/pvc.yaml). With `s3://` or `gs://` (`jobs.run.storage`) there is no claim:
each pod gets a local emptyDir at the same mount, sized by the node type's `headCacheGiB` /
`workerCacheGiB`, which holds what each node keeps for itself (the hub's downloads, the token
cache, data read from a bucket, the run's staging copy that `jobs.run.mirror` pushes to the
bucket). The Ray object carries `OUTPUTS_ANNOTATION` so the policy (`policy`) knows the pods are
meant to have no claim. Credentials reach the pods by reference only:

* s3://: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (AWS_SESSION_TOKEN optional) by
  `secretKeyRef` from the Secret `--credentials-secret NAME` (default `DEFAULT_S3_SECRET`, created
  out of band; its name is all a manifest carries), unless `--service-account` is given alone.
  AWS_REGION and AWS_ENDPOINT_URL (an S3-compatible server) are plain values from `--s3-region` /
  `--s3-endpoint` (neither is a secret), else optional keys of the same Secret.
* `--service-account NAME`: the Ray pods run as that ServiceAccount, which carries the cloud
  identity (GKE Workload Identity: `iam.gke.io/gcp-service-account`; EKS IAM roles for service
  accounts: `eks.amazonaws.com/role-arn`; EKS Pod Identity: an association). gs:// takes
  credentials this way or from the node's own identity; a key file in a Secret is not offered.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from jobs.errors import SpecError, UserError
from jobs.run.storage import is_uri

from .policy import OBJECT_STORAGE, OUTPUTS_ANNOTATION

Obj = dict[str, Any]

PVC_NAME = "rayft-data"  # k8s/base/pvc.yaml
DATA_VOLUME = "rayft-data"  # the volume every Ray pod mounts at DATA_MOUNT
DEFAULT_S3_SECRET = "rayft-s3"  # the Secret `--credentials-secret` names by default (s3://)
# The S3 variables pyarrow's client reads (jobs.run.storage) from the Secret: (name, required).
S3_SECRET_KEYS = (("AWS_ACCESS_KEY_ID", True), ("AWS_SECRET_ACCESS_KEY", True), ("AWS_SESSION_TOKEN", False))
# A Secret's or ServiceAccount's name: a DNS-1123 subdomain of at most 253 characters.
K8S_NAME = re.compile(r"(?=.{1,253}\Z)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
S3_ENDPOINT = re.compile(r"https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?/?")  # scheme and host[:port], no user
S3_REGION = re.compile(r"[a-z0-9][a-z0-9-]{0,39}")  # us-east-1, auto, ... (no secret)


@dataclass(frozen=True)
class StorageAccess:
    """How a job's Ray pods reach its run.output_dir."""

    scheme: str | None  # "s3" or "gs"; None: the shared volume (a PVC)
    secret: str | None = None  # the Secret holding the S3 keys (its name only)
    service_account: str | None = None  # the ServiceAccount carrying a workload identity
    endpoint: str | None = None  # AWS_ENDPOINT_URL, a plain value
    region: str | None = None  # AWS_REGION, a plain value

    @property
    def on_object_storage(self) -> bool:
        return self.scheme is not None


@dataclass(frozen=True)
class AccessFlags:
    """What the user passed (`rayft k8s render --credentials-secret ...`); None: not given."""

    credentials_secret: str | None = None
    service_account: str | None = None
    s3_endpoint: str | None = None
    s3_region: str | None = None


def k8s_object_name(flag: str, name: str) -> str:
    """`name` when it is a Kubernetes object name; a UserError that does not echo it otherwise (a
    value pasted into the wrong flag may be the secret itself)."""
    if not K8S_NAME.fullmatch(name):
        raise UserError(
            f"{flag}: not a Kubernetes object name (lowercase letters, digits, '-' and '.', "
            "starting and ending with a letter or digit, at most 253)"
        )
    return name


def _checked_plain(flags: AccessFlags) -> None:
    if flags.s3_endpoint is not None and not S3_ENDPOINT.fullmatch(flags.s3_endpoint):
        raise UserError("--s3-endpoint: expected http(s)://HOST[:PORT] (no user or path)")
    if flags.s3_region is not None and not S3_REGION.fullmatch(flags.s3_region):
        raise UserError("--s3-region: expected a region name such as us-east-1")
    for flag, name in _flag_values(flags)[:2]:  # the two that name Kubernetes objects
        if name is not None:
            k8s_object_name(flag, name)


def _refuse_misplaced(flags: AccessFlags, scheme: str | None, location: str, where: str) -> None:
    """A flag that would do nothing for this output location is refused, not ignored."""
    given = [f for f, v in _flag_values(flags) if v is not None]
    if given and scheme is None:
        raise SpecError(
            f"{where}: {given[0]} is for run.output_dir on object storage (s3:// or gs://); "
            f"run.output_dir={location} is on the shared volume"
        )
    s3_only = [f for f, v in _flag_values(flags) if v is not None and f != "--service-account"]
    if s3_only and scheme == "gs":
        raise SpecError(
            f"{where}: {s3_only[0]} is for s3://; gs:// takes credentials from a workload identity "
            "(--service-account) or the node's own"
        )


def _flag_values(flags: AccessFlags) -> tuple[tuple[str, str | None], ...]:
    return (
        ("--credentials-secret", flags.credentials_secret),
        ("--service-account", flags.service_account),
        ("--s3-endpoint", flags.s3_endpoint),
        ("--s3-region", flags.s3_region),
    )


def storage_access(location: str, where: str, flags: AccessFlags | None = None) -> StorageAccess:
    """The access for a job writing to `location` (the spec's output location, `{name}` filled in),
    with the flags checked: each names a Kubernetes object or a plain value, and is refused where it
    would do nothing."""
    flags = flags or AccessFlags()
    _checked_plain(flags)
    scheme = location.split("://", 1)[0] if is_uri(location) else None
    _refuse_misplaced(flags, scheme, location, where)
    secret = flags.credentials_secret
    if scheme == "s3" and secret is None and flags.service_account is None:
        secret = DEFAULT_S3_SECRET
    return StorageAccess(scheme, secret, flags.service_account, flags.s3_endpoint, flags.s3_region)


def data_volume(cache_size: str | None) -> Obj:
    """The volume at DATA_MOUNT: the shared claim, or (object storage) a local emptyDir of `cache_size`."""
    if cache_size is None:
        return {"name": DATA_VOLUME, "persistentVolumeClaim": {"claimName": PVC_NAME}}
    return {"name": DATA_VOLUME, "emptyDir": {"sizeLimit": cache_size}}


def _secret_ref(secret: str, key: str, required: bool) -> Obj:
    return {"name": key, "valueFrom": {"secretKeyRef": {"name": secret, "key": key, "optional": not required}}}


def credential_env(access: StorageAccess) -> list[Obj]:
    """The S3 variables: keys from the Secret by reference, the region and endpoint as plain values
    when given (else optional keys of the Secret). Empty for gs:// and the shared volume."""
    if access.scheme != "s3":
        return []
    env = [_secret_ref(access.secret, k, req) for k, req in S3_SECRET_KEYS] if access.secret else []
    for key, value in (("AWS_REGION", access.region), ("AWS_ENDPOINT_URL", access.endpoint)):
        if value is not None:
            env.append({"name": key, "value": value})
        elif access.secret:
            env.append(_secret_ref(access.secret, key, False))
    return env


def identity(access: StorageAccess) -> Obj:
    """The pod spec's fields for a workload identity ({} without `--service-account`). The API
    token stays unmounted: GKE's metadata server and EKS's webhook-injected token do not need it."""
    return {"serviceAccountName": access.service_account} if access.service_account else {}


def outputs_annotation(access: StorageAccess) -> dict[str, str]:
    """The Ray object's annotation saying its pods keep outputs in a bucket ({} on the volume)."""
    return {OUTPUTS_ANNOTATION: OBJECT_STORAGE} if access.on_object_storage else {}
