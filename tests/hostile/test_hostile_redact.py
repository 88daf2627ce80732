"""One redaction for every line rayft prints (`jobs.secrets.redacted_output`, installed by
`orchestrator.cli.main` and `python -m jobs.finetune`): a password in a URL or a token-shaped
value never reaches stdout, stderr or a log line, whatever its source -- a flag (--jobs-api,
--image, --overlay), the environment (RAY_ADDRESS), a log record, an argparse message.

The fake tokens are assembled at run time, as in tests/hostile/test_secrets.py."""

from __future__ import annotations

import io
import logging
import os

import pytest
from inproc import rayft_in_process

from jobs import secrets

SPEC = "examples/tiny-lora.yaml"
PASSWORD = "pw" + "Z9q" * 6  # in http://alice:PASSWORD@host
FAKE_GH = "ghp_" + "aB3xY7kQ9mZ2" * 3
FAKE_HF = "hf_" + "Qm7Zx2Lk9Pw4" * 3
SECRETS = (PASSWORD, FAKE_GH, FAKE_HF)


def _clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    return {**env, **extra}


def _refused_without_secret(r, code: int = 2) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == code and "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1, r.stderr
    for s in SECRETS:
        assert s not in r.stderr and s not in r.stdout, r.stderr
    return lines[0]


@pytest.mark.parametrize(
    "argv",
    [
        ["status", "x", "--jobs-api", f"http://alice:{PASSWORD}@127.0.0.1:1"],
        ["status", "x", "--address", f"ftp://alice:{PASSWORD}@127.0.0.1:8265"],
        ["list", "--address", f"http://alice:{PASSWORD}@127.0.0.1:99999"],
        ["submit", SPEC, "--address", f"http://alice:{PASSWORD}@exa mple:8265"],
    ],
    ids=["unreachable", "wrong-scheme", "bad-port", "bad-host"],
)
def test_a_password_in_the_jobs_api_url_is_never_printed(argv):
    line = _refused_without_secret(rayft_in_process(*argv, env=_clean_env()))
    assert "alice" not in line or "..." in line  # the URL is cut where its credential starts


def test_a_password_in_ray_address_is_never_printed():
    env = _clean_env(RAY_ADDRESS=f"http://alice:{PASSWORD}@127.0.0.1:1")
    line = _refused_without_secret(rayft_in_process("status", "x", env=env))
    assert "127.0.0.1:1" in line


@pytest.mark.parametrize(
    "flag,value",
    [("--overlay", FAKE_GH), ("--image", FAKE_GH), ("--image", f"Bearer {FAKE_HF}")],
    ids=["overlay", "image", "image-bearer"],
)
def test_a_token_given_as_image_or_overlay_is_never_echoed(flag, value):
    r = rayft_in_process("k8s", "render", SPEC, flag, value)
    _refused_without_secret(r)
    assert value not in r.stderr


def test_an_argparse_message_is_redacted_too():
    r = rayft_in_process("queue", "retry", FAKE_GH)
    line = _refused_without_secret(r)
    assert "queue retry" in line


def test_lines_and_log_records_pass_the_one_redaction(monkeypatch):
    """Whatever prints inside a command: print, a stream written in pieces, a log record with
    arguments -- all leave redacted."""
    raw = io.StringIO()
    handler = logging.StreamHandler(raw)
    root = logging.getLogger()
    root.addHandler(handler)
    out = io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    try:
        with secrets.redacted_output():
            import sys

            print(f"cluster answered: http://bob:{PASSWORD}@head:8265/api")
            half = len(FAKE_GH) // 2
            sys.stdout.write(f"split {FAKE_GH[:half]}")
            sys.stdout.write(f"{FAKE_GH[half:]} token\n")
            sys.stdout.write(f"no newline {FAKE_HF}")
            logging.getLogger("rayft.test").warning("value %s from the spec", FAKE_HF)
    finally:
        root.removeHandler(handler)
    text = out.getvalue() + raw.getvalue()
    for s in SECRETS:
        assert s not in text, text
    assert "cluster answered: http:/..." in text and "split ghp_aB..." in text and "no newline hf_Qm7..." in text
    assert "value hf_Qm7... from the spec" in raw.getvalue()
    assert handler.filters == []  # the filter leaves with the command


def test_a_credential_in_a_url_query_is_found():
    text = f"GET https://store.example/x?sig={FAKE_HF[3:]}&token={PASSWORD} failed"
    cleaned = secrets.redact(text)
    assert FAKE_HF[3:] not in cleaned and PASSWORD not in cleaned
    assert secrets.redact("https://example.com/path?q=1&page=2") == "https://example.com/path?q=1&page=2"
