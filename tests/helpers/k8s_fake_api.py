"""Test helpers for k8s: strict CRD validation and a small fake Kubernetes API server.

`strict_crd_validator(kind)` validates an object against the KubeRay v1.7.0 CRD schema of that
kind (from ../shared/kuberay-crds, next to the repository) the way `kubectl apply
--validate=strict` does: unknown fields are errors. The CRD's openAPIV3Schema alone does not say
so (JSON Schema allows extra properties), so every object schema that lists `properties` and
neither sets `x-kubernetes-preserve-unknown-fields` nor `additionalProperties` gets
`additionalProperties: false`, recursively. The root `metadata` (ObjectMeta, which the API server
validates itself) gets a strict ObjectMeta schema.

`FakeKubeAPI` serves the few endpoints the KubeRay backend calls, on 127.0.0.1 (random port, in a
thread), through which the real `kubernetes` client talks to it: it validates request bodies
(RayJobs against the strict CRD schema, ConfigMaps with kubernetes-validate), answers 409
AlreadyExists on a duplicate create, and serves RayJob status transitions on successive GETs.
With `kueue=True` it stands in for Kueue as well: a RayJob labelled for a LocalQueue is created
suspended (Kueue's webhook does that) and stays `Suspended` until the test `admit`s it; then it
moves along the transitions. `finish` ends a RayJob the way KubeRay reports an end (deployment
status, Ray job status, message), e.g. a failure whose log says out of memory.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import threading
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import yaml

CRD_DIR = Path(__file__).resolve().parents[3] / "shared" / "kuberay-crds"
CRD_FILES = {"RayCluster": "ray.io_rayclusters.yaml", "RayJob": "ray.io_rayjobs.yaml"}
K8S_VALIDATE_OLDEST = "1.33.0"  # plus the newest schema the installed kubernetes-validate ships

_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
OBJECT_META = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string"},
        "generateName": {"type": "string"},
        "namespace": {"type": "string"},
        "labels": _STR_MAP,
        "annotations": _STR_MAP,
        "finalizers": {"type": "array", "items": {"type": "string"}},
        "ownerReferences": {"type": "array", "items": {"type": "object"}},
        "uid": {"type": "string"},
        "resourceVersion": {"type": "string"},
        "generation": {"type": "integer"},
        "creationTimestamp": {"type": ["string", "null"]},
        "deletionTimestamp": {"type": "string"},
        "managedFields": {"type": "array"},
    },
}


def crds_available() -> bool:
    return all((CRD_DIR / f).is_file() for f in CRD_FILES.values())


def strictify(node: Any) -> Any:
    """A copy of an OpenAPI v3 schema in which undeclared properties are errors."""
    if isinstance(node, list):
        return [strictify(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k == "properties":
            out[k] = {name: strictify(sub) for name, sub in v.items()}
        elif k in ("items", "not") or (k == "additionalProperties" and isinstance(v, dict)):
            out[k] = strictify(v)
        elif k in ("anyOf", "allOf", "oneOf"):
            out[k] = [strictify(s) for s in v]
        else:
            out[k] = v
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def crd_schema(kind: str, version: str = "v1") -> dict:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load((CRD_DIR / CRD_FILES[kind]).read_text(), Loader=loader)
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            schema = strictify(v["schema"]["openAPIV3Schema"])
            schema["properties"]["metadata"] = OBJECT_META
            schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "metadata"})
            schema["properties"]["apiVersion"] = {"const": f"ray.io/{version}"}
            schema["properties"]["kind"] = {"const": kind}
            return schema
    raise KeyError(f"{kind} CRD has no version {version}")


_validators: dict = {}


def strict_crd_validator(kind: str) -> Callable[[dict], list[str]]:
    """errors(obj) -> ["path: message", ...] (empty when the object is valid)."""
    if kind not in _validators:
        import jsonschema

        schema = crd_schema(kind)
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
        _validators[kind] = cls(schema)
    v = _validators[kind]

    def errors(obj: dict) -> list[str]:
        return [
            f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
            for e in sorted(v.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))
        ]

    return errors


def _cache_schema_reads() -> None:
    """kubernetes-validate reads and parses its JSON schema files (the strict `_definitions.json`
    among them) on every `validate` call: about 70% of a call's time, and test_k8s.py and
    test_k8s_flavours.py validate 1,086 objects, each against two Kubernetes versions. The files
    never change while the tests run, so each is read once; the validation itself is the library's,
    unchanged (jsonschema does not modify a schema)."""
    from kubernetes_validate import utils

    if not hasattr(utils.schema_contents, "cache_info"):
        utils.schema_contents = functools.lru_cache(maxsize=None)(utils.schema_contents)
        utils.all_versions = functools.lru_cache(maxsize=None)(utils.all_versions)


def k8s_validate_errors(obj: dict) -> list[str] | None:
    """kubernetes-validate --strict on a core object; None when it has no schema for the kind."""
    import kubernetes_validate as kv

    _cache_schema_reads()
    errs: list[str] = []
    for version in sorted({K8S_VALIDATE_OLDEST, str(kv.latest_version())}):
        try:
            kv.validate(obj, version, strict=True)
        except kv.SchemaNotFoundError:
            return None
        except kv.ValidationError as e:
            errs.append(f"k8s {version}: {'.'.join(str(p) for p in e.path)}: {e.message}")
    return errs


# ---- the fake API server -------------------------------------------------------------------------


def _status(code: int, reason: str, message: str, **details) -> dict:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "details": details,
        "code": code,
    }


def _ok_status() -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 200}


def _match(labels: dict, selector: str) -> bool:
    for term in filter(None, (selector or "").split(",")):
        k, _, v = term.partition("=")
        if labels.get(k.strip()) != v.strip():
            return False
    return True


class FakeKubeAPI:
    """A tiny in-memory API server for ConfigMaps, RayJobs, PodDisruptionBudgets and pods (logs)."""

    DEFAULT_TRANSITIONS = [("Initializing", ""), ("Running", "RUNNING"), ("Complete", "SUCCEEDED")]

    QUEUE_LABEL = "kueue.x-k8s.io/queue-name"

    def __init__(
        self, transitions=None, validate_rayjob: Callable[[dict], list[str]] | None = None, kueue: bool = False
    ):
        self.transitions = list(transitions or self.DEFAULT_TRANSITIONS)
        self.validate_rayjob = validate_rayjob
        self.kueue = kueue
        self.ended: dict[tuple[str, str], dict] = {}  # a status `finish` pinned
        self.configmaps: dict[tuple[str, str], dict] = {}
        self.rayjobs: dict[tuple[str, str], dict] = {}
        self.pdbs: dict[tuple[str, str], dict] = {}
        self.gets: dict[tuple[str, str], int] = {}
        self.pods: dict[tuple[str, str], dict] = {}
        self.logs: dict[tuple[str, str], str] = {}
        self.requests: list[tuple[str, str, int]] = []  # (method, path, response code)
        self.request_names: list[str] = []  # the object each request named (POST: the body's)
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _send(self, code: int, body: Any, ctype: str = "application/json"):
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                fake.requests.append((self.command, urlparse(self.path).path, code))
                fake.request_names.append(getattr(self, "object_name", ""))

            def _body(self):
                n = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(n) or b"null")

            def do_POST(self):
                self.object_name = ""
                with fake.lock:
                    fake.handle(self, "POST")

            def do_GET(self):
                self.object_name = ""
                with fake.lock:
                    fake.handle(self, "GET")

            def do_PATCH(self):
                self.object_name = ""
                with fake.lock:
                    fake.handle(self, "PATCH")

            def do_DELETE(self):
                self.object_name = ""
                with fake.lock:
                    fake.handle(self, "DELETE")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    # -- lifecycle --
    def __enter__(self) -> FakeKubeAPI:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def api_client(self):
        from kubernetes import client

        cfg = client.Configuration(host=self.url)
        return client.ApiClient(cfg)

    def add_pod(
        self,
        ns: str,
        name: str,
        labels: dict,
        log: str,
        created: str = "2026-01-01T00:00:00Z",
        container: str = "ray-job-submitter",
    ) -> None:
        self.pods[(ns, name)] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "labels": labels, "creationTimestamp": created},
            "spec": {"containers": [{"name": container, "image": "rayproject/ray:2.60.0-py311"}]},
            "status": {"phase": "Running"},
        }
        self.logs[(ns, name)] = log

    # -- driving RayJobs from the test (what Kueue and KubeRay would do) --
    def admit(self, ns: str, name: str) -> None:
        """Kueue admits the RayJob: unsuspended, it starts along `transitions` from the first step."""
        with self.lock:
            self.rayjobs[(ns, name)]["spec"]["suspend"] = False
            self.gets[(ns, name)] = 0

    def finish(
        self,
        ns: str,
        name: str,
        deployment: str = "Failed",
        job_status: str = "FAILED",
        message: str = "",
        log: str | None = None,
    ) -> None:
        """End the RayJob: every GET from now on shows this status; `log` becomes its submitter
        pod's log (where `rayft logs` and the queue driver read a failure's cause)."""
        with self.lock:
            self.ended[(ns, name)] = {
                "jobDeploymentStatus": deployment,
                "jobStatus": job_status,
                "message": message,
                "rayClusterName": f"{name}-abcde",
            }
        if log is not None:
            self.add_pod(ns, f"{name}-submit", {"batch.kubernetes.io/job-name": name}, log)

    def created(self, ns: str = "rayft") -> list[str]:
        """Names of the RayJobs created (201), in order: a duplicate create is a 409, not here."""
        # Under the lock: a handler appends to both lists (under it too), so they are read equal.
        with self.lock:
            return [
                n
                for (m, p, c), n in zip(self.requests, self.request_names, strict=True)
                if m == "POST" and c == 201 and p == f"/apis/ray.io/v1/namespaces/{ns}/rayjobs"
            ]

    # -- routing --
    CM = re.compile(r"^/api/v1/namespaces/([^/]+)/configmaps(?:/([^/]+))?$")
    RJ = re.compile(r"^/apis/ray\.io/v1/namespaces/([^/]+)/rayjobs(?:/([^/]+))?$")
    PDB = re.compile(r"^/apis/policy/v1/namespaces/([^/]+)/poddisruptionbudgets(?:/([^/]+))?$")
    PODS = re.compile(r"^/api/v1/namespaces/([^/]+)/pods(?:/([^/]+)(/log)?)?$")

    def handle(self, h, method: str) -> None:
        url = urlparse(h.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        for pattern, store, kind in (
            (self.CM, self.configmaps, "ConfigMap"),
            (self.RJ, self.rayjobs, "RayJob"),
            (self.PDB, self.pdbs, "PodDisruptionBudget"),
        ):
            m = pattern.match(url.path)
            if m:
                return self._objects(h, method, m.group(1), m.group(2), store, kind, query)
        m = self.PODS.match(url.path)
        if m and method == "GET":
            ns, name, log = m.groups()
            if name is None:
                items = [
                    p
                    for (pns, _), p in self.pods.items()
                    if pns == ns and _match(p["metadata"]["labels"], query.get("labelSelector", ""))
                ]
                return h._send(200, {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items})
            if (ns, name) not in self.pods:
                return h._send(404, _status(404, "NotFound", f'pods "{name}" not found', name=name, kind="pods"))
            if log:
                text = self.logs[(ns, name)]
                if query.get("tailLines"):
                    text = "".join(text.splitlines(True)[-int(query["tailLines"]) :])
                return h._send(200, text, "text/plain")
            return h._send(200, self.pods[(ns, name)])
        return h._send(404, _status(404, "NotFound", f"no route for {method} {url.path}"))

    def _objects(self, h, method, ns, name, store, kind, query) -> None:
        plural = {"ConfigMap": "configmaps", "RayJob": "rayjobs", "PodDisruptionBudget": "poddisruptionbudgets"}[kind]
        if method == "POST" and name is None:
            body = h._body()
            errs = self._validate(kind, body)
            if errs:
                return h._send(
                    422,
                    _status(
                        422,
                        "Invalid",
                        f"{kind} is invalid: " + "; ".join(errs),
                        kind=kind,
                        name=(body.get("metadata") or {}).get("name"),
                    ),
                )
            name = body["metadata"]["name"]
            h.object_name = name
            if (ns, name) in store:
                return h._send(
                    409, _status(409, "AlreadyExists", f'{plural} "{name}" already exists', name=name, kind=plural)
                )
            obj = copy.deepcopy(body)
            obj["metadata"].update(
                namespace=ns, uid=str(uuid.uuid4()), resourceVersion="1", creationTimestamp="2026-01-01T00:00:00Z"
            )
            if kind == "RayJob" and self.kueue and (obj["metadata"].get("labels") or {}).get(self.QUEUE_LABEL):
                obj["spec"]["suspend"] = True  # Kueue's webhook: held until admitted
            store[(ns, name)] = obj
            return h._send(201, obj)
        if method == "GET" and name is None:
            items = [
                self._with_status(kind, ons, oname, o, advance=False)
                for (ons, oname), o in store.items()
                if ons == ns and _match(o["metadata"].get("labels") or {}, query.get("labelSelector", ""))
            ]
            return h._send(
                200,
                {
                    "apiVersion": {"ConfigMap": "v1", "RayJob": "ray.io/v1"}.get(kind, "policy/v1"),
                    "kind": f"{kind}List",
                    "metadata": {},
                    "items": items,
                },
            )
        if (ns, name) not in store:
            return h._send(404, _status(404, "NotFound", f'{plural} "{name}" not found', name=name, kind=plural))
        obj = store[(ns, name)]
        if method == "GET":
            return h._send(200, self._with_status(kind, ns, name, obj, advance=True))
        if method == "PATCH":
            ops = h._body()
            if h.headers.get("Content-Type", "").startswith("application/json-patch+json"):
                for op in ops:
                    if op["op"] not in ("add", "replace"):
                        return h._send(422, _status(422, "Invalid", f"unsupported op {op['op']}"))
                    parts = op["path"].strip("/").split("/")
                    node = obj
                    for p in parts[:-1]:
                        node = node.setdefault(p, {})
                    node[parts[-1]] = op["value"]
            else:
                return h._send(415, _status(415, "UnsupportedMediaType", "use a JSON patch"))
            return h._send(200, obj)
        if method == "DELETE":
            del store[(ns, name)]
            return h._send(200, _ok_status())
        return h._send(405, _status(405, "MethodNotAllowed", method))

    def _with_status(self, kind: str, ns: str, name: str, obj: dict, advance: bool) -> dict:
        """A RayJob GET moves it one step along `transitions` (a list shows the current step)."""
        if kind != "RayJob":
            return obj
        if (ns, name) in self.ended:
            return {**copy.deepcopy(obj), "status": dict(self.ended[(ns, name)])}
        if (obj.get("spec") or {}).get("suspend"):
            return {**copy.deepcopy(obj), "status": {"jobDeploymentStatus": "Suspended"}}
        n = self.gets.get((ns, name), 0) + (1 if advance else 0)
        self.gets[(ns, name)] = n
        obj = copy.deepcopy(obj)
        if n == 0:
            return obj  # not reconciled yet: no status
        ds, js = self.transitions[min(n, len(self.transitions)) - 1]
        obj["status"] = {"jobDeploymentStatus": ds, "rayClusterName": f"{name}-abcde"}
        if js:
            obj["status"]["jobStatus"] = js
        return obj

    def _validate(self, kind: str, body: dict) -> list[str]:
        if not isinstance(body, dict) or body.get("kind") != kind or not (body.get("metadata") or {}).get("name"):
            return [f"expected a {kind} with metadata.name"]
        if kind == "RayJob":
            return self.validate_rayjob(body) if self.validate_rayjob else []
        return k8s_validate_errors(body) or []
