"""The CEL rules (`x-kubernetes-validations`) of the KubeRay v1.7.0 and Kueue v0.19.2 CRDs, evaluated
with cel-python over every object rayft builds or renders, as the API server would on create.

The API server evaluates a rule at the schema node that declares it, with `self` bound to the
object's value there (once per element under `items`, per value under `additionalProperties`),
after applying the schema's defaults, and only where the value is present. Transition rules
(those naming `oldSelf`) are not evaluated on create, and neither are they here. A rule that
evaluates to false, or fails to evaluate (e.g. a field read without `has()`), rejects the object.

cel-python lacks Kubernetes' CEL libraries; `K8S_FUNCTIONS` implements the ones a CRD may use
(quantity, URL, regex `find`, list and string extensions). Every rule's functions and macros are
checked against what is implemented before anything runs: a rule this checker could not evaluate
fails the tests instead of passing unseen. The CRDs come from ../shared (skipped, with the
reason, when absent) and are read, never copied.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml
from k8s_fake_api import CRD_DIR

from jobs.spec import load_spec
from orchestrator.backends.kuberay import policy
from orchestrator.backends.kuberay.node_types import overlays
from orchestrator.backends.kuberay.render import render
from tests.integration.test_k8s import RENDERED, _inline_spec

celpy = pytest.importorskip("celpy", reason="cel-python not installed: CRD CEL rules not evaluated")
from celpy import celtypes  # noqa: E402
from celpy.evaluation import CELEvalError  # noqa: E402

KUEUE_CRD_DIR = CRD_DIR.parent / "kueue-crds"
CRD_FILES = sorted(CRD_DIR.glob("*.yaml")) + sorted(KUEUE_CRD_DIR.glob("*.yaml"))
pytestmark = pytest.mark.skipif(
    not (list(CRD_DIR.glob("*.yaml")) and list(KUEUE_CRD_DIR.glob("*.yaml"))),
    reason=f"KubeRay or Kueue CRDs not found in {CRD_DIR} / {KUEUE_CRD_DIR}",
)


# ---- Kubernetes' CEL libraries that cel-python lacks ------------------------------------------------

_SUFFIX = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
    "Ki": Decimal(2**10),
    "Mi": Decimal(2**20),
    "Gi": Decimal(2**30),
    "Ti": Decimal(2**40),
    "Pi": Decimal(2**50),
    "Ei": Decimal(2**60),
}
# k8s.io/apimachinery resource.Quantity: a signed decimal, then a binary/decimal SI suffix or an
# exponent (e3, E-2).
_QUANTITY = re.compile(
    r"([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(?:(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)|[eE]([+-]?[0-9]+))?"
)


class Quantity:
    """A Kubernetes quantity as CEL's quantity library sees it (exact decimal value)."""

    def __init__(self, text: str):
        m = _QUANTITY.fullmatch(str(text))
        if not m:
            raise ValueError(f"quantities must match the regular expression ...: {text!r}")
        num, suffix, exp = m.groups()
        self.value = Decimal(num) * (_SUFFIX[suffix or ""] if exp is None else Decimal(10) ** int(exp))

    @classmethod
    def of(cls, value: Decimal) -> Quantity:
        q = cls("0")
        q.value = value
        return q

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Quantity) and self.value == other.value

    def __hash__(self) -> int:
        return hash(self.value)


def _q(x: Any) -> Decimal:
    if isinstance(x, Quantity):
        return x.value
    if isinstance(x, (celtypes.IntType, int)) and not isinstance(x, bool):
        return Decimal(int(x))
    raise TypeError(f"no such overload: {type(x).__name__}")


def _int_checked(v: Decimal) -> celtypes.IntType:
    if v != v.to_integral_value() or not -(2**63) <= v < 2**63:
        raise ValueError("cannot convert value to integer")
    return celtypes.IntType(int(v))


def _url(s: Any):
    text = str(s)
    parts = urlsplit(text)
    # Go's url.ParseRequestURI: an absolute URL or an absolute path.
    if not (parts.scheme or text.startswith("/")) or " " in text:
        raise ValueError(f"URL parse error during conversion from string: {text!r}")
    return parts


def _index_of(x: Any, item: Any, *start: Any) -> celtypes.IntType:
    if isinstance(x, str):
        return celtypes.IntType(str(x).find(str(item), *(int(s) for s in start)))
    return celtypes.IntType(next((i for i, v in enumerate(x) if v == item), -1))


def _last_index_of(x: Any, item: Any) -> celtypes.IntType:
    if isinstance(x, str):
        return celtypes.IntType(str(x).rfind(str(item)))
    return celtypes.IntType(max((i for i, v in enumerate(x) if v == item), default=-1))


def _bool(f):
    return lambda *a: celtypes.BoolType(bool(f(*a)))


K8S_FUNCTIONS: dict[str, Any] = {
    # quantity library (k8s.io/apiserver/pkg/cel/library/quantity.go)
    "quantity": lambda s: Quantity(str(s)),
    "isQuantity": _bool(lambda s: _QUANTITY.fullmatch(str(s))),
    "sign": lambda q: celtypes.IntType((_q(q) > 0) - (_q(q) < 0)),
    "isInteger": _bool(lambda q: _q(q) == _q(q).to_integral_value() and -(2**63) <= _q(q) < 2**63),
    "asInteger": lambda q: _int_checked(_q(q)),
    "asApproximateFloat": lambda q: celtypes.DoubleType(float(_q(q))),
    "add": lambda a, b: Quantity.of(_q(a) + _q(b)),
    "sub": lambda a, b: Quantity.of(_q(a) - _q(b)),
    "isGreaterThan": _bool(lambda a, b: _q(a) > _q(b)),
    "isLessThan": _bool(lambda a, b: _q(a) < _q(b)),
    "compareTo": lambda a, b: celtypes.IntType((_q(a) > _q(b)) - (_q(a) < _q(b))),
    # URL library (url.go)
    "url": _url,
    "isURL": _bool(lambda s: _safe(lambda: _url(s))),
    "getScheme": lambda u: celtypes.StringType(u.scheme),
    "getHost": lambda u: celtypes.StringType(u.netloc.rsplit("@", 1)[-1]),
    "getHostname": lambda u: celtypes.StringType(u.hostname or ""),
    "getPort": lambda u: celtypes.StringType("" if u.port is None else str(u.port)),
    "getEscapedPath": lambda u: celtypes.StringType(u.path),
    "getQuery": lambda u: celtypes.MapType(
        {
            celtypes.StringType(k): celtypes.ListType([celtypes.StringType(x) for x in v])
            for k, v in parse_qs(u.query).items()
        }
    ),
    # regex library (regex.go): find / findAll; `matches` is cel-python's (RE2, unanchored)
    "find": lambda s, r: celtypes.StringType((lambda m: m.group(0) if m else "")(re.search(str(r), str(s)))),
    "findAll": lambda s, r, *n: celtypes.ListType(
        [celtypes.StringType(m.group(0)) for m in re.finditer(str(r), str(s))][
            : (int(n[0]) if n and int(n[0]) >= 0 else None)
        ]
    ),
    # lists library (lists.go), min/max left out: cel-python would read them as its own macros
    "isSorted": _bool(lambda xs: list(xs) == sorted(xs)),
    "sum": lambda xs: sum(xs[1:], xs[0]) if len(xs) else celtypes.IntType(0),
    "indexOf": _index_of,
    "lastIndexOf": _last_index_of,
    # strings extension (cel-go ext.Strings)
    "charAt": lambda s, i: celtypes.StringType(str(s)[int(i)] if int(i) < len(str(s)) else ""),
    "lowerAscii": lambda s: celtypes.StringType("".join(c.lower() if c.isascii() else c for c in str(s))),
    "upperAscii": lambda s: celtypes.StringType("".join(c.upper() if c.isascii() else c for c in str(s))),
    "replace": lambda s, a, b, *n: celtypes.StringType(str(s).replace(str(a), str(b), *(int(x) for x in n))),
    "split": lambda s, sep, *n: celtypes.ListType(
        [
            celtypes.StringType(x)
            for x in (str(s).split(str(sep), int(n[0]) - 1) if n and int(n[0]) > 0 else str(s).split(str(sep)))
        ]
    ),
    "substring": lambda s, a, *b: celtypes.StringType(str(s)[int(a) : int(b[0]) if b else None]),
    "trim": lambda s: celtypes.StringType(str(s).strip()),
    "join": lambda xs, *sep: celtypes.StringType((str(sep[0]) if sep else "").join(str(x) for x in xs)),
}


def _safe(f) -> bool:
    try:
        f()
        return True
    except Exception:
        return False


# Functions and macros cel-python provides with the Kubernetes meaning (the CEL standard library).
CEL_STANDARD = {
    "has",
    "all",
    "exists",
    "exists_one",
    "map",
    "filter",
    "size",
    "contains",
    "startsWith",
    "endsWith",
    "matches",
    "int",
    "uint",
    "double",
    "string",
    "bytes",
    "bool",
    "duration",
    "timestamp",
    "type",
    "getDate",
    "getDayOfMonth",
    "getDayOfWeek",
    "getDayOfYear",
    "getFullYear",
    "getMonth",
    "getHours",
    "getMilliseconds",
    "getMinutes",
    "getSeconds",
}
SUPPORTED = CEL_STANDARD | set(K8S_FUNCTIONS)


# ---- rules, compiled once -----------------------------------------------------------------------


class Unsupported(Exception):
    """A rule this checker cannot evaluate faithfully: the test fails."""


@dataclass
class Rule:
    crd: str
    path: str  # schema path where the rule is declared, e.g. spec.deletionStrategy
    rule: str
    message: str
    transition: bool  # names oldSelf: not evaluated on create
    program: Any = None
    unsupported: str | None = None


def _names(tree) -> Iterator[tuple[str, str]]:
    """(kind, name) of every function call and macro in a cel-python parse tree."""
    from lark import Token

    for node in tree.iter_subtrees():
        if node.data == "ident_arg":
            tok = node.children[0]
            yield "function", tok.value if isinstance(tok, Token) else str(tok)
        elif node.data == "member_dot_arg":
            tok = next(c for c in node.children[1:] if isinstance(c, Token))
            yield "method", tok.value
        elif node.data == "ident":
            tok = node.children[0]
            if isinstance(tok, Token) and tok.value == "oldSelf":
                yield "variable", "oldSelf"


_ENV = None


def compile_rule(crd: str, path: str, v: dict) -> Rule:
    global _ENV
    _ENV = _ENV or celpy.Environment()
    r = Rule(crd, path, v["rule"], v.get("message") or v["rule"], transition=False)
    try:
        tree = _ENV.compile(r.rule)
    except Exception as e:  # a rule cel-python cannot parse
        r.unsupported = f"does not parse here: {type(e).__name__}: {str(e).splitlines()[0]}"
        return r
    names = list(_names(tree))
    r.transition = ("variable", "oldSelf") in names
    missing = sorted({n for kind, n in names if kind != "variable" and n not in SUPPORTED})
    if missing:
        r.unsupported = f"uses {', '.join(missing)}, which this checker does not implement"
    elif v.get("optionalOldSelf"):
        r.unsupported = "optionalOldSelf (CEL optionals) is not implemented here"
    else:
        r.program = _ENV.program(tree, functions=K8S_FUNCTIONS)
    return r


@dataclass
class Schema:
    """One CRD version's openAPIV3Schema with its rules compiled, in place."""

    crd: str
    root: dict
    rules: dict[int, list[Rule]] = field(default_factory=dict)  # id(schema node) -> its rules
    evaluated: set = field(default_factory=set)  # (rule path, rule) evaluated so far

    @classmethod
    def of(cls, crd: str, schema: dict) -> Schema:
        s = cls(crd, schema)
        reached = s._compile(schema, "")
        declared = _count_rules(schema)
        if reached != declared:  # a rule under anyOf/allOf/not would never be evaluated below
            raise Unsupported(f"{crd}: {declared - reached} rule(s) sit where this checker does not walk")
        return s

    def _compile(self, node: dict, path: str) -> int:
        n = 0
        rules = [compile_rule(self.crd, path or "<root>", v) for v in node.get("x-kubernetes-validations") or []]
        if rules:
            self.rules[id(node)] = rules
            n += len(rules)
        for name, sub in (node.get("properties") or {}).items():
            n += self._compile(sub, f"{path}.{name}" if path else name)
        if isinstance(node.get("items"), dict):
            n += self._compile(node["items"], f"{path}[*]")
        if isinstance(node.get("additionalProperties"), dict):
            n += self._compile(node["additionalProperties"], f"{path}[*]")
        return n

    def all_rules(self) -> list[Rule]:
        return [r for rs in self.rules.values() for r in rs]

    def check(self, obj: dict) -> list[str]:
        """The rule failures of `obj` on create: ["path: message (rule)", ...]."""
        out: list[str] = []
        self._walk(_defaulted(copy.deepcopy(obj), self.root), self.root, "", out)
        return out

    def _walk(self, value: Any, node: dict, path: str, out: list[str]) -> None:
        if value is None:
            return
        for r in self.rules.get(id(node), []):
            if r.transition:
                continue  # oldSelf: an update rule; there is no old object on create
            if r.unsupported:
                raise Unsupported(f"{r.crd} {r.path}: {r.rule!r} {r.unsupported}")
            self.evaluated.add((r.path, r.rule))
            try:
                result = r.program.evaluate({"self": celpy.json_to_cel(value)})
            except Exception as e:
                result = e
            if isinstance(result, (CELEvalError, Exception)):
                out.append(f"{path or '<root>'}: {r.message} (rule {r.rule!r} failed to evaluate: {result})")
            elif result is not True and not (isinstance(result, celtypes.BoolType) and bool(result)):
                out.append(f"{path or '<root>'}: {r.message}")
        props = node.get("properties") or {}
        if isinstance(value, dict):
            for k, v in value.items():
                if k in props:
                    self._walk(v, props[k], f"{path}.{k}" if path else k, out)
                elif isinstance(node.get("additionalProperties"), dict):
                    self._walk(v, node["additionalProperties"], f"{path}[{k}]", out)
        elif isinstance(value, list) and isinstance(node.get("items"), dict):
            for i, v in enumerate(value):
                self._walk(v, node["items"], f"{path}[{i}]", out)


def _count_rules(node: Any) -> int:
    if isinstance(node, list):
        return sum(_count_rules(n) for n in node)
    if not isinstance(node, dict):
        return 0
    return len(node.get("x-kubernetes-validations") or []) + sum(_count_rules(v) for v in node.values())


def _defaulted(value: Any, node: dict) -> Any:
    """The API server's structural defaulting: a missing property with a `default` gets it, and
    defaulting continues inside (defaults of defaults)."""
    if isinstance(value, dict):
        for k, sub in (node.get("properties") or {}).items():
            if k not in value and "default" in sub:
                value[k] = copy.deepcopy(sub["default"])
            if k in value:
                value[k] = _defaulted(value[k], sub)
        if isinstance(node.get("additionalProperties"), dict):
            for k in value:
                if k not in (node.get("properties") or {}):
                    value[k] = _defaulted(value[k], node["additionalProperties"])
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        return [_defaulted(v, node["items"]) for v in value]
    return value


def load_schemas() -> dict[tuple[str, str], Schema]:
    """(apiVersion, kind) -> Schema, for every served version of every CRD in ../shared."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    out = {}
    for f in CRD_FILES:
        for crd in yaml.load_all(f.read_text(), Loader=loader):
            if not crd:
                continue
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for v in crd["spec"]["versions"]:
                if v.get("served", True):
                    out[(f"{group}/{v['name']}", kind)] = Schema.of(
                        f"{kind} {v['name']}", v["schema"]["openAPIV3Schema"]
                    )
    return out


SCHEMAS = load_schemas() if CRD_FILES else {}


def cel_violations(objs: list[dict]) -> list[str]:
    """Rule failures of every object whose kind a CRD here defines; other objects are skipped."""
    out = []
    for o in objs:
        schema = SCHEMAS.get((o.get("apiVersion"), o.get("kind")))
        if schema is not None:
            out += [f"{o['kind']}/{o['metadata']['name']}: {v}" for v in schema.check(o)]
    return out


# ---- the objects: every overlay build and every render variant ---------------------------------------


def _render_variants() -> list[tuple[str, list[dict]]]:
    """RENDERED (every example on every overlay it fits, + GPU variants), and: the tune kind, an image
    by digest and `resources.gpus_per_worker` 2 and 4 on every overlay they fit (4 workers: within
    the GPU overlays' Kueue quota of 6)."""
    out = list(RENDERED)
    digest = "registry.example/rayft@sha256:" + "a" * 64
    search_text = "name: s\nsearch:\n  trials: 3\n"
    for ov in overlays():
        gpu = ov != "dev-cpu"
        spec = load_spec(data=_inline_spec(use_gpu=gpu), files=False)
        out.append((f"tune@{ov}", render(spec, overlay=ov, kind="tune", spec_text=search_text, concurrent_trials=2)))
        out.append((f"digest@{ov}", render(spec, overlay=ov, image=digest)))
        if gpu:
            for n in (2, 4):
                s = load_spec(data=_inline_spec(use_gpu=True, num_workers=4, gpus_per_worker=n), files=False)
                out.append((f"gpus_per_worker={n}@{ov}", render(s, overlay=ov)))
    return out


VARIANTS = _render_variants()


# ---- tests ------------------------------------------------------------------------------------------


def test_every_rule_of_the_crds_is_compiled_and_evaluable_here():
    rules = [r for s in SCHEMAS.values() for r in s.all_rules()]
    assert len(rules) >= 40, len(rules)  # KubeRay v1.7.0 + Kueue v0.19.2 declare dozens
    kinds = {s.crd.split()[0] for s in SCHEMAS.values() if s.rules}
    assert {"RayCluster", "RayJob", "ClusterQueue", "ResourceFlavor", "LocalQueue", "Workload"} <= kinds
    bad = [f"{r.crd} {r.path}: {r.rule!r}: {r.unsupported}" for r in rules if r.unsupported]
    assert bad == [], "rules this checker cannot evaluate:\n" + "\n".join(bad)
    # Only rules naming oldSelf are left to updates.
    assert all(r.transition == ("oldSelf" in r.rule) for r in rules)
    assert any(not r.transition for r in rules if r.crd.startswith("RayJob"))


def test_every_built_object_passes_the_crd_rules(built):
    seen = set()
    for d, objs in built.items():
        assert cel_violations(objs) == [], d
        seen |= {o["kind"] for o in objs if (o.get("apiVersion"), o.get("kind")) in SCHEMAS}
    assert {"RayCluster", "RayJob", "ResourceFlavor", "ClusterQueue", "LocalQueue"} <= seen
    # The rules on what the overlays set were evaluated, not skipped: the ClusterQueue's cohort and
    # flavor rules, the ResourceFlavors' toleration rules.
    cq = SCHEMAS[("kueue.x-k8s.io/v1beta2", "ClusterQueue")].evaluated
    assert {p for p, _ in cq} >= {"spec", "spec.resourceGroups[*]"}
    rf = SCHEMAS[("kueue.x-k8s.io/v1beta2", "ResourceFlavor")].evaluated
    assert sum(p == "spec.tolerations" for p, _ in rf) == 5


@pytest.mark.parametrize("sid,objs", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_every_rendered_variant_passes_the_crd_rules(sid, objs):
    rj = next(o for o in objs if o["kind"] == "RayJob")
    assert (rj["apiVersion"], "RayJob") in SCHEMAS
    assert cel_violations(objs) == []


def test_render_variants_cover_kinds_overlays_digests_and_gpu_packing():
    ids = [v[0] for v in VARIANTS]
    for ov in overlays():
        assert f"tune@{ov}" in ids and f"digest@{ov}" in ids
    assert any(i.startswith("gpus_per_worker=4@") for i in ids)


# ---- the checker reports broken objects ------------------------------------------------------------


def _rendered_rayjob() -> dict:
    return copy.deepcopy(render(load_spec(data=_inline_spec(use_gpu=True), files=False), overlay="gpu")[1])


def _built(built, kind: str, overlay: str = "gpu") -> dict:
    return copy.deepcopy(next(o for o in built[f"overlays/{overlay}"] if o["kind"] == kind))


@pytest.mark.parametrize(
    "mutate,expect",
    [
        (lambda s: s.update(managedBy="someone-else"), "managedBy field value must be either"),
        (lambda s: s["rayClusterSpec"].update(managedBy="x"), "managedBy field value must be either"),
        (
            lambda s: s.update(
                deletionStrategy={
                    "onSuccess": {"policy": "DeleteCluster"},
                    "deletionRules": [{"policy": "DeleteCluster", "condition": {"jobStatus": "SUCCEEDED"}}],
                }
            ),
            "cannot be used together within the same deletionStrategy",
        ),
        (
            lambda s: s.update(deletionStrategy={"onSuccess": {"policy": "DeleteCluster"}}),
            "requires either BOTH onSuccess and onFailure",
        ),
        (
            lambda s: s.update(
                deletionStrategy={
                    "deletionRules": [
                        {
                            "policy": "DeleteCluster",
                            "condition": {"jobStatus": "FAILED", "jobDeploymentStatus": "Failed"},
                        }
                    ]
                }
            ),
            "cannot be used together within the same deletion condition",
        ),
        (
            lambda s: s.update(deletionStrategy={"deletionRules": [{"policy": "DeleteCluster", "condition": {}}]}),
            "requires either the JobStatus or the JobDeploymentStatus",
        ),
    ],
    ids=["managedBy", "cluster-managedBy", "legacy+rules", "half-legacy", "rule-two-conditions", "rule-no-condition"],
)
def test_checker_reports_a_rayjob_breaking_a_kuberay_rule(mutate, expect):
    rj = _rendered_rayjob()
    assert cel_violations([rj]) == []
    mutate(rj["spec"])
    bad = cel_violations([rj])
    assert any(expect in b for b in bad), bad


def test_kuberay_v170_declares_no_cel_rule_on_shutdown_and_ttl_so_the_policy_checks_it():
    """KubeRay v1.7.0 checks `ttlSecondsAfterFinished` against `shutdownAfterJobFinishes` in its
    operator, not in the CRD: the CEL rules let it through, rayft's policy does not."""
    objs = copy.deepcopy(render(load_spec(data=_inline_spec(use_gpu=True), files=False), overlay="gpu"))
    rj = objs[1]
    rj["spec"].update(shutdownAfterJobFinishes=False, ttlSecondsAfterFinished=600)
    assert cel_violations([rj]) == []
    bad = policy.policy_violations(objs)
    assert any("shutdownAfterJobFinishes" in b for b in bad), bad


def test_checker_reports_a_raycluster_breaking_a_kuberay_rule(built):
    rc = _built(built, "RayCluster")
    rc["spec"]["managedBy"] = "kueue.x-k8s.io/multikueue"
    assert cel_violations([rc]) == []
    rc["spec"]["managedBy"] = "me"
    assert any("spec.managedBy" in b and "must be either" in b for b in cel_violations([rc]))


def test_checker_reports_kueue_objects_breaking_their_rules(built):
    cq = _built(built, "ClusterQueue")
    assert cel_violations([cq]) == []
    cq["spec"]["resourceGroups"][0]["flavors"][0]["resources"].pop()
    assert any(
        "resourceGroups[0]" in b and "same number of resources as the coveredResources" in b
        for b in cel_violations([cq])
    )
    cq = _built(built, "ClusterQueue")
    cq["spec"].pop("cohortName", None)
    cq["spec"]["resourceGroups"][0]["flavors"][0]["resources"][0]["borrowingLimit"] = 1
    assert any("borrowingLimit must be nil when cohort is empty" in b for b in cel_violations([cq]))
    rf = _built(built, "ResourceFlavor")
    rf["spec"]["tolerations"] = [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 60}
    ]
    assert any("effect must be 'NoExecute'" in b for b in cel_violations([rf]))
    rf["spec"]["tolerations"] = [{"operator": "Equal", "value": "x"}]
    assert any("operator must be Exists when 'key' is empty" in b for b in cel_violations([rf]))


def test_transition_rules_wait_for_an_update():
    """LocalQueue's `clusterQueue` is immutable (`self == oldSelf`): nothing to compare on create."""
    lq = {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "LocalQueue",
        "metadata": {"name": "q"},
        "spec": {"clusterQueue": "rayft"},
    }
    schema = SCHEMAS[("kueue.x-k8s.io/v1beta2", "LocalQueue")]
    assert [r.transition for r in schema.all_rules()] == [True]
    assert cel_violations([lq]) == []


def test_defaults_apply_before_the_rules():
    """A rule reading a field the schema defaults sees the default, as on the API server."""
    schema = Schema.of(
        "T",
        {
            "type": "object",
            "properties": {
                "spec": {
                    "type": "object",
                    "x-kubernetes-validations": [{"rule": "self.mode == 'fast'", "message": "mode"}],
                    "properties": {"mode": {"type": "string", "default": "slow"}},
                }
            },
        },
    )
    assert schema.check({"spec": {}}) == ["spec: mode"]
    assert schema.check({"spec": {"mode": "fast"}}) == []
    assert schema.check({}) == []  # absent: the rule is not evaluated


def test_a_rule_reading_a_missing_field_rejects():
    schema = Schema.of(
        "T",
        {
            "type": "object",
            "properties": {
                "spec": {
                    "type": "object",
                    "x-kubernetes-validations": [{"rule": "self.x > 1", "message": "x"}],
                    "properties": {"x": {"type": "integer"}},
                }
            },
        },
    )
    bad = schema.check({"spec": {}})
    assert len(bad) == 1 and "failed to evaluate" in bad[0]


def _one_rule(rule: str) -> Schema:
    return Schema.of(
        "T",
        {
            "type": "object",
            "properties": {
                "v": {
                    "type": "object",
                    "x-kubernetes-preserve-unknown-fields": True,
                    "x-kubernetes-validations": [{"rule": rule, "message": "no"}],
                }
            },
        },
    )


@pytest.mark.parametrize(
    "rule,good,bad",
    [
        ("quantity(self.m).isLessThan(quantity('1Gi'))", {"m": "512Mi"}, {"m": "2Gi"}),
        ("quantity(self.m).compareTo(quantity('1.5')) == 0", {"m": "1500m"}, {"m": "1.4"}),
        ("isQuantity(self.m) && quantity(self.m).add(1).isGreaterThan(quantity('1e3'))", {"m": "1k"}, {"m": "1x"}),
        ("quantity(self.m).asInteger() == 1024", {"m": "1Ki"}, {"m": "1.5"}),
        (
            "isURL(self.u) && url(self.u).getScheme() == 'https' && url(self.u).getPort() == '8443'",
            {"u": "https://h.example:8443/p"},
            {"u": "h.example"},
        ),
        ("self.m.size() == 2 && size(self.m) == 2", {"m": {"a": 1, "b": 2}}, {"m": {"a": 1}}),
        ("self.s.matches('^[a-z]+$') && self.s.find('[a-z]+') == self.s", {"s": "abc"}, {"s": "ab1"}),
        ("self.l.isSorted() && self.l.sum() == 6 && self.l.indexOf(2) == 1", {"l": [1, 2, 3]}, {"l": [3, 2, 1]}),
        ("self.s.lowerAscii().split('-').join('.') == 'a.b'", {"s": "A-B"}, {"s": "A_B"}),
        ("has(self.x) ? self.x.exists_one(e, e == 'y') : true", {"x": ["y", "z"]}, {"x": ["y", "y"]}),
    ],
    ids=[
        "isLessThan",
        "compareTo",
        "isQuantity-add",
        "asInteger",
        "url",
        "map-size",
        "regex",
        "lists",
        "strings",
        "has-macro",
    ],
)
def test_kubernetes_cel_functions_behave(rule, good, bad):
    schema = _one_rule(rule)
    assert schema.check({"v": good}) == []
    assert schema.check({"v": bad}), f"{rule} passed {bad}"


def test_a_rule_the_checker_cannot_evaluate_fails_instead_of_passing():
    # `ip()` is a Kubernetes CEL function this checker does not implement; guarded by has(), it
    # would never run on this object, and still the rule is refused.
    schema = _one_rule("has(self.addr) ? ip(self.addr).family() == 4 : true")
    (rule,) = schema.all_rules()
    assert rule.unsupported and "ip" in rule.unsupported
    with pytest.raises(Unsupported, match="ip"):
        schema.check({"v": {}})
    with pytest.raises(Unsupported, match="do not walk|not walk"):
        Schema.of("T", {"type": "object", "anyOf": [{"x-kubernetes-validations": [{"rule": "true"}]}]})
