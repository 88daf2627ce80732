"""`ray job submit` and `rayft submit | status | logs | stop | list` against a real local Ray
cluster (token auth on, as Ray 2.60 starts it), plus the checks that run before anything is sent:
spec validation, secrets, the working dir's size and boundaries, and the auth token."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
import zipfile
from pathlib import Path

import pytest
from inproc import rayft_in_process
from polling import wait_until

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SPEC = "examples/tiny-lora.yaml"
# One worker, two optimizer steps of 8 sequences, short sequences: a job is mostly start-up.
TINY = [
    "resources.num_workers=1",
    "batch.global_batch_size=8",
    "batch.micro_batch_size=4",
    "run.max_steps=2",
    "data.max_seq_len=64",
    "lora.r=4",
    "lora.alpha=8",
]


@pytest.fixture(autouse=True)
def _token_mode(monkeypatch):
    """`import ray` fixes the process's auth mode from RAY_AUTH_MODE; tests here import ray
    in-process before the session's `ray_head` fixture may start, and that one needs "token"."""
    monkeypatch.setenv("RAY_AUTH_MODE", "token")


def uniq(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def rayft(*args: str, env: dict | None = None, timeout: float = 300, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "rayft"), *args],
        cwd=cwd,
        env=env if env is not None else dict(os.environ),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def one_line_error(r: subprocess.CompletedProcess, code: int = 2) -> str:
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    return lines[0]


def jobs_on(ray_head) -> list:
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(ray_head.dashboard).list_jobs()


def token(ray_head) -> str:
    return ray_head.token_path.read_text().strip()


def metrics_steps(out: Path) -> list[int]:
    p = out / "metrics.jsonl"
    return [json.loads(line)["step"] for line in p.read_text().splitlines() if line.strip()] if p.exists() else []


# ---- before anything is sent (no cluster) ------------------------------------------------------


def test_submission_id_is_deterministic_and_carries_no_token():
    from orchestrator.backends.ray_jobs import build_submission

    secret = "tok-" + uuid.uuid4().hex
    env = dict(os.environ, RAY_AUTH_TOKEN=secret)
    base = ["submit", SPEC, "--dry-run", "--address", "http://127.0.0.1:1", *TINY, "name=det-job"]
    # two processes (a fresh one, and this one): the id does not depend on either
    a, b = rayft(*base, env=env), rayft_in_process(*base)
    assert a.returncode == 0, a.stderr
    assert secret not in a.stdout and "RAY_AUTH_TOKEN" not in a.stdout
    da, db = json.loads(a.stdout), json.loads(b.stdout)
    assert da["submission_id"] == db["submission_id"]
    h = da["metadata"]["rayft.spec_hash"]
    assert da["submission_id"] == f"det-job-{h}" and len(h) == 10
    # in-process: the same id again; another spec, another id; a later attempt, a suffix
    same = build_submission(SPEC, [*TINY, "name=det-job"], address="http://127.0.0.1:1")
    assert same.submission_id == da["submission_id"] and same.spec_hash == h
    assert (
        build_submission(SPEC, [*TINY, "name=det-job", "optim.lr=0.02"], address="http://127.0.0.1:1").submission_id
        != da["submission_id"]
    )
    assert (
        build_submission(SPEC, [*TINY, "name=det-job"], address="http://127.0.0.1:1", attempt=3).submission_id
        == f"det-job-{h}-a3"
    )
    # what would be sent: the project as working_dir, with the excludes; the driver's small CPU share
    assert da["runtime_env"]["working_dir"] == str(ROOT)
    assert {".venv", "outputs", ".git"} <= set(da["runtime_env"]["excludes"])
    assert "env_vars" not in da["runtime_env"]
    assert 0 < da["entrypoint_num_cpus"] < 1
    assert da["entrypoint"].startswith(f"python -m jobs.finetune {SPEC} ")
    # a local cluster: outputs go to the project's outputs/, not into Ray's copy of the project
    assert f"run.output_dir={ROOT / 'outputs' / 'det-job'}" in da["entrypoint"]
    remote = build_submission(SPEC, [*TINY, "name=det-job"], address="http://10.1.2.3:8265")
    assert "run.output_dir" not in remote.entrypoint and "relative" in remote.warnings[0]


def test_upload_size_matches_what_ray_packages(tmp_path):
    """The size rayft checks is the size of the package Ray builds: same files, same excludes."""
    from ray._private.runtime_env.packaging import GCS_STORAGE_MAX_SIZE, create_package

    from orchestrator.backends.working_dir import DEFAULT_EXCLUDES, plan_upload, ray_upload_limit

    assert ray_upload_limit() == GCS_STORAGE_MAX_SIZE  # rayft's copy of Ray's limit

    proj = tmp_path / "proj"
    (proj / "jobs").mkdir(parents=True)
    (proj / "jobs" / "finetune.py").write_text("print('hi')\n")
    (proj / ".gitignore").write_text("*.log\nbuild/\n")
    for rel, size in [
        ("outputs/run/metrics.jsonl", 300_000),
        (".venv/lib/big.so", 900_000),
        (".git/objects/pack", 500_000),
        ("build/x.o", 40_000),
        ("a.log", 7_000),
        ("sub/.rayignore", 0),
        ("sub/secret.txt", 3_000),
        ("sub/keep.txt", 11_000),
        ("sub/deeper/.gitignore", 0),
        ("sub/deeper/tmp.cache", 5_000),
        ("sub/deeper/ok.py", 222),
        ("data.jsonl", 123_456),
    ]:
        p = proj / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x" * size)
    (proj / "sub" / ".rayignore").write_text("secret.txt\n")
    (proj / "sub" / "deeper" / ".gitignore").write_text("*.cache\n")
    plan = plan_upload(proj, DEFAULT_EXCLUDES)

    pkg = tmp_path / "pkg.zip"
    create_package(str(proj), pkg, include_gitignore=True, excludes=DEFAULT_EXCLUDES)
    with zipfile.ZipFile(pkg) as z:
        files = [i for i in z.infolist() if not i.is_dir()]
    assert plan.files == len(files)
    assert plan.size_bytes == sum(i.file_size for i in files)
    names = {i.filename for i in files}
    assert "data.jsonl" in names and "sub/keep.txt" in names and "sub/secret.txt" not in names
    assert plan.size_bytes < 200_000  # outputs/, .venv/, .git/ and ignored files not counted

    # and the real project, as `rayft submit` uploads it
    real = plan_upload(ROOT, DEFAULT_EXCLUDES)
    pkg2 = tmp_path / "real.zip"
    create_package(str(ROOT), pkg2, include_gitignore=True, excludes=DEFAULT_EXCLUDES)
    with zipfile.ZipFile(pkg2) as z:
        assert real.size_bytes == sum(i.file_size for i in z.infolist() if not i.is_dir())


def test_working_dir_must_not_escape_the_project(tmp_path):
    from jobs.errors import SpecError, UserError
    from orchestrator.backends.ray_jobs import build_submission
    from orchestrator.backends.working_dir import DEFAULT_EXCLUDES, plan_upload

    proj = tmp_path / "proj"
    (proj / "jobs").mkdir(parents=True)
    (proj / "jobs" / "finetune.py").write_text("")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "big").write_bytes(b"x" * 1000)
    (proj / "inner-link").symlink_to(proj / "jobs")  # inside: fine
    plan_upload(proj, DEFAULT_EXCLUDES)
    (proj / "data-link").symlink_to(outside)  # outside: Ray would upload what it points to
    with pytest.raises(UserError, match="data-link is a symlink to .* outside the project"):
        plan_upload(proj, DEFAULT_EXCLUDES)

    # A spec outside the working dir (through the CLI: one line, exit 2), a data path leaving it,
    # a working dir that is not the project.
    spec = tmp_path / "spec.yaml"
    spec.write_text((ROOT / SPEC).read_text().replace("examples/data/", f"{ROOT}/examples/data/"))
    msg = one_line_error(rayft_in_process("submit", str(spec), "--dry-run", "--address", "http://127.0.0.1:1"))
    assert "outside the working dir" in msg
    data = tmp_path / "d.jsonl"
    data.write_text((ROOT / "examples/data/tiny.jsonl").read_text())
    with pytest.raises(SpecError, match="data.path: .* is outside the working dir"):
        build_submission(SPEC, [f"data.path={os.path.relpath(data, ROOT)}"], address="http://127.0.0.1:1")
    with pytest.raises(UserError, match="not the rayft project"):
        build_submission(SPEC, [], working_dir=str(tmp_path))


# ---- against the cluster ---------------------------------------------------------------------


@pytest.mark.ray
@pytest.mark.slow
def test_ray_job_submit_runs_jobs_finetune(ray_head, tmp_path):
    """The README's command, verbatim apart from the overrides that keep it tiny."""
    out = tmp_path / "out"
    cmd = [
        str(BIN / "ray"),
        "job",
        "submit",
        "--address",
        ray_head.dashboard,
        "--working-dir",
        ".",
        "--",
        "python",
        "-m",
        "jobs.finetune",
        SPEC,
        *TINY,
        f"name={uniq('ray-cli')}",
        f"run.output_dir={out}",
    ]
    r = subprocess.run(cmd, cwd=ROOT, env=ray_head.env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "succeeded" in r.stdout
    assert "step 2/2" in r.stdout
    assert metrics_steps(out) == [1, 2]
    assert (out / "adapter" / "adapter_config.json").exists()


@pytest.mark.ray
@pytest.mark.slow
def test_rayft_submit_status_logs_stop_list(ray_head, tmp_path):
    env = dict(ray_head.env)
    # The token from RAY_AUTH_TOKEN, with RAY_AUTH_MODE unset: rayft turns token auth on as ray.init does.
    env.pop("RAY_AUTH_MODE")
    env["RAY_AUTH_TOKEN"] = token(ray_head)
    a = ["--address", ray_head.dashboard]
    name, out = uniq("sub"), tmp_path / "out"
    job = [SPEC, *TINY, f"name={name}", f"run.output_dir={out}"]
    first = rayft("submit", *job, *a, "--json", env=env)
    assert first.returncode == 0, first.stderr
    d1 = json.loads(first.stdout)
    assert d1["created"] is True and d1["submission_id"].startswith(f"{name}-")
    sid = d1["submission_id"]

    # the same thing again: reported, not started again
    second = rayft("submit", *job, *a, "--json", env=env)
    assert second.returncode == 0, second.stderr
    d2 = json.loads(second.stdout)
    assert d2["submission_id"] == sid and d2["created"] is False
    assert "already submitted" in second.stderr
    mine = [j for j in jobs_on(ray_head) if (j.metadata or {}).get("rayft.name") == name]
    assert [j.submission_id for j in mine] == [sid]

    # what reached the cluster: spec hash in the metadata, no token anywhere
    info = mine[0]
    assert info.metadata["rayft.spec_hash"] == d1["spec_hash"]
    assert info.entrypoint.startswith(f"python -m jobs.finetune {SPEC}")
    sent = json.dumps({"runtime_env": info.runtime_env, "metadata": info.metadata, "entrypoint": info.entrypoint})
    assert token(ray_head) not in sent and "RAY_AUTH_TOKEN" not in sent
    assert "env_vars" not in (info.runtime_env or {})

    st = rayft("status", sid, *a, "--json", env=env)
    assert st.returncode == 0, st.stderr
    assert json.loads(st.stdout)["status"] in ("PENDING", "RUNNING", "SUCCEEDED")

    # a second job, stopped while it starts
    other = rayft("submit", SPEC, *TINY, f"name={uniq('stop')}", f"run.output_dir={tmp_path / 'o2'}", *a, env=env)
    assert other.returncode == 0, other.stderr
    sid2 = other.stdout.strip()
    stop = rayft("stop", sid2, *a, env=env)
    assert stop.returncode == 0 and "stop requested" in stop.stderr, stop.stderr

    follow = rayft("logs", sid, "--follow", *a, env=env, timeout=400)
    assert follow.returncode == 0, follow.stderr
    assert "step 2/2" in follow.stdout and f"{sid}: SUCCEEDED" in follow.stderr
    assert json.loads(rayft("status", sid, *a, "--json", env=env).stdout)["status"] == "SUCCEEDED"
    assert metrics_steps(out) == [1, 2]
    logs = rayft("logs", sid, *a, env=env)
    assert logs.returncode == 0 and "step 1/2" in logs.stdout

    wait_until(
        lambda: json.loads(rayft("status", sid2, *a, "--json", env=env).stdout)["status"] == "STOPPED",
        60,
        "the stopped job reached STOPPED",
        every_s=1,
    )
    again = rayft("stop", sid, *a, env=env)
    assert again.returncode == 0 and "already ended (SUCCEEDED)" in again.stderr

    listed = {r["submission_id"]: r["status"] for r in json.loads(rayft("list", *a, "--json", env=env).stdout)}
    assert listed[sid] == "SUCCEEDED" and listed[sid2] == "STOPPED"
    assert all(r.get("spec_hash") for r in json.loads(rayft("list", *a, "--json", env=env).stdout))

    # and `--wait`: an already-finished job is reported at once with its outcome as the exit code
    w = rayft("submit", *job, *a, "--wait", "--quiet", env=env)
    assert w.returncode == 0 and f"{sid}: SUCCEEDED" in w.stderr


@pytest.mark.ray
def test_wrong_or_missing_token_is_refused(ray_head):
    before = len(jobs_on(ray_head))
    bad = dict(ray_head.env, RAY_AUTH_TOKEN="not-the-token-" + uuid.uuid4().hex)
    a = ["--address", ray_head.dashboard]
    for args in (
        ["submit", SPEC, *TINY, f"name={uniq('badtok')}"],
        ["status", "whatever"],
        ["list"],
        ["logs", "whatever"],
        ["stop", "whatever"],
    ):
        msg = one_line_error(rayft(*args, *a, env=bad))
        assert "rejected the auth token (from RAY_AUTH_TOKEN)" in msg, msg
        assert bad["RAY_AUTH_TOKEN"] not in msg
    no = dict(ray_head.env, RAY_AUTH_MODE="disabled")
    msg = one_line_error(rayft("list", *a, env=no))
    assert "requires an auth token" in msg
    path = dict(ray_head.env, RAY_AUTH_TOKEN_PATH=str(ray_head.token_path.parent / "no-such-token"))
    assert "no token in that file" in one_line_error(rayft("list", *a, env=path))
    # the right token from a file named by RAY_AUTH_TOKEN_PATH works
    good = dict(ray_head.env, RAY_AUTH_TOKEN_PATH=str(ray_head.token_path))
    assert rayft("list", *a, env=good).returncode == 0
    assert len(jobs_on(ray_head)) == before


@pytest.mark.ray
def test_nothing_invalid_reaches_the_cluster(ray_head, tmp_path):
    before = len(jobs_on(ray_head))
    a = ["--address", ray_head.dashboard]
    env = ray_head.env
    name = uniq("invalid")
    cases = [
        (["batch.micro_batch_size=3"], "is not divisible by"),
        (["batch.foo=1"], "batch.foo: unknown key"),
        (["data.path=examples/data/nope.jsonl"], "data.path: file not found"),
        (["name=Not_Valid"], "is not a DNS-1123 label"),
        (["run.env.HF_TOKEN=abc"], "HF_TOKEN looks like a secret"),
        (["run.env.MY_SETTING=hf_" + "a" * 34], "MY_SETTING looks like a secret"),
    ]
    for overrides, fragment in cases:
        msg = one_line_error(rayft_in_process("submit", SPEC, *TINY, f"name={name}", *overrides, *a, env=env))
        assert fragment in msg, msg
        # the queue refuses the same at `queue add`
        msg = one_line_error(
            rayft_in_process(
                "queue", "add", SPEC, *TINY, f"name={name}", *overrides, "--db", str(tmp_path / "q.db"), env=env
            )
        )
        assert fragment in msg, msg
    # a data file that is not JSONL (preflight, not just existence)
    bad = ROOT / "examples" / "data" / f"{name}.jsonl"
    try:
        bad.write_text('{"text": "ok"}\nnot json\n')
        msg = one_line_error(
            rayft_in_process("submit", SPEC, *TINY, f"name={name}", f"data.path={bad.relative_to(ROOT)}", *a, env=env)
        )
        assert "line 2" in msg
    finally:
        bad.unlink()
    # over Ray's upload limit (lowered here via Ray's own setting, which the client reads once, when
    # Ray is imported: so in a fresh process)
    small = dict(env, RAY_max_grpc_message_size="200000")
    msg = one_line_error(rayft("submit", SPEC, *TINY, f"name={name}", *a, env=small))
    assert "over Ray's limit of 0.2 MiB" in msg
    st = rayft_in_process("queue", "status", "--db", str(tmp_path / "q.db"), "--json")
    assert json.loads(st.stdout) == []
    assert len(jobs_on(ray_head)) == before


def test_backend_kuberay_dispatches_to_the_kubernetes_api(tmp_path):
    """`--backend kuberay` goes to orchestrator.backends.kuberay.KubeRayBackend: here through the real
    `kubernetes` client (a kubeconfig in KUBECONFIG) to the fake API server of tests/helpers/k8s_fake_api.py.
    In fresh processes: the client reads KUBECONFIG once, when it is imported."""
    from k8s_fake_api import FakeKubeAPI

    with FakeKubeAPI() as api:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "fake",
                    "clusters": [{"name": "fake", "cluster": {"server": api.url}}],
                    "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u", "namespace": "rayft"}}],
                    "users": [{"name": "u", "user": {}}],
                }
            )
        )
        env = dict(os.environ, KUBECONFIG=str(kubeconfig))
        env.pop("KUBERNETES_SERVICE_HOST", None)
        k = ["--backend", "kuberay", "--namespace", "rayft"]
        r = rayft("submit", SPEC, *TINY, "name=kr-job", *k, "--overlay", "dev-cpu", env=env)
        assert r.returncode == 0, r.stderr
        name = r.stdout.strip()
        assert name.startswith("kr-job-") and ("rayft", name) in api.rayjobs
        st = rayft("status", name, *k, "--json", env=env)
        assert st.returncode == 0 and json.loads(st.stdout)["name"] == name
        ls = rayft("list", *k, "--json", env=env)
        assert [j["name"] for j in json.loads(ls.stdout)] == [name]
        assert rayft("stop", name, *k, env=env).returncode == 0
        assert ("rayft", name) not in api.rayjobs
        assert "no RayJob" in one_line_error(rayft("status", name, *k, env=env))
