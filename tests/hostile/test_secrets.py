"""The credential scanner (`jobs.secrets`): real-shaped FAKE tokens are found wherever they sit
in a value, near misses pass, and no message ever shows more than a token's first 6 characters.

The fake tokens are assembled at run time (prefix + filler), so no token-shaped literal sits in
the source for a secret scanner to trip on."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs import secrets
from jobs.errors import SpecError
from jobs.spec import load_spec

DATA = Path(__file__).resolve().parents[2] / "examples" / "data" / "tiny.jsonl"
# Where a token may sit inside a value.
WRAPS = ["{}", "prefix text {}", "{}/suffix", "KEY={};", "'{}'", "x {}\n", "[{}]", "a,{},b"]


def _fill(n: int, alphabet: str = "aB3xY7kQ9mZ2") -> str:
    return (alphabet * (n // len(alphabet) + 1))[:n]


# (kind, fake token): the shapes issuers hand out, with fake bodies.
FAKES = [
    ("Hugging Face token", "hf_" + _fill(34)),
    ("GitHub token", "ghp_" + _fill(36)),
    ("GitHub token", "gho_" + _fill(36)),
    ("GitHub token", "ghu_" + _fill(36)),
    ("GitHub token", "ghs_" + _fill(36)),
    ("GitHub token", "ghr_" + _fill(36)),
    ("GitHub token", "github_pat_" + _fill(22, "A1b2C3") + "_" + _fill(59)),
    ("AWS access key id", "AKIA" + _fill(16, "QWERTY234567")),
    ("AWS access key id", "ASIA" + _fill(16, "ZXCVBN234567")),
    ("OpenAI-style API key", "sk-" + _fill(48)),
    ("OpenAI-style API key", "sk-proj-" + _fill(40) + "-" + _fill(20) + "_" + _fill(30)),
    ("Slack token", "xoxb-" + "123456789012-1234567890123-" + _fill(24)),
    ("Slack token", "xoxp-" + "123456789012-" + _fill(20)),
    ("JSON Web Token", "eyJ" + _fill(20) + "." + "eyJ" + _fill(40) + "." + _fill(43)),
    ("Bearer token", "Bearer " + _fill(40)),
    ("Bearer token", "bearer " + _fill(24, "abc123._-")),
    ("password in a URL", "https://alice:" + _fill(12) + "@example.com/repo.git"),
    ("password in a URL", "postgres://svc:p4ss" + _fill(8) + "@db.internal:5432/runs"),
]

# Strings that resemble credentials but are not, and must pass.
NEAR_MISSES = [
    "hf_hub_download",
    "HF_TOKEN",
    "HF_HOME",
    "hf_transfer",
    "sk-learn",
    "scikit-learn",
    "task-classification",
    "sk-" + "learn-classification-pipeline",
    "Bearer",
    "Bearer token",
    "https://example.com/path?q=1",
    "https://user@example.com/repo.git",
    "http://localhost:8265",
    "ray://head:10001",
    "ghp_x",
    "ghp_short1",
    "AKIA",
    "AKIA1234",
    "xoxb-",
    "eyJhbGciOi",
    "outputs/{name}",
    "examples/data/tiny.jsonl",
    "meta-llama/Llama-3.2-1B",
    "q_proj",
    "NCCL_DEBUG",
    "WARN",
    "",
    "git@github.com:org/repo.git",
]


@pytest.mark.parametrize("kind,token", FAKES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(FAKES)])
def test_fake_tokens_are_found_wherever_they_sit(kind, token):
    for wrap in WRAPS:
        text = wrap.format(token)
        found = secrets.find_tokens(text)
        assert [f.kind for f in found] == [kind], (text, found)
        said = secrets.describe(text)
        assert kind in said and token not in said and token[:6] + "..." in said
        assert token not in secrets.redact(text) and token[:6] + "..." in secrets.redact(text)


def test_near_misses_pass():
    for text in NEAR_MISSES:
        assert secrets.find_tokens(text) == [], text
        assert secrets.describe(text) is None and secrets.redact(text) == text
        assert not secrets.looks_like_token(text), text


def test_looks_like_token_refuses_tokens_where_a_name_belongs():
    for _, token in FAKES:
        assert secrets.looks_like_token(token), token
    assert secrets.looks_like_token(_fill(40))  # random-looking, no known prefix
    for name in (
        "HF_TOKEN",
        "MY_HUB_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "hf_token",
        "Token2",
        "HF_TOKEN_FOR_PROD_CLUSTER_2",
    ):
        assert not secrets.looks_like_token(name), name


def test_the_token_pattern_matches_a_token_and_not_a_lookalike():
    hf = "hf_" + _fill(34)
    assert secrets.TOKEN.match(hf) and not secrets.TOKEN.match("hf_hub_download")


def _refusal(*overrides: str) -> str:
    data = {"name": "s", "data": {"path": str(DATA)}, "batch": {"global_batch_size": 8, "micro_batch_size": 2}}
    with pytest.raises(SpecError) as e:
        load_spec(data=data, overrides=list(overrides))
    msg = str(e.value)
    assert len(msg.splitlines()) == 1
    return msg


@pytest.mark.parametrize("kind,token", FAKES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(FAKES)])
def test_the_spec_refuses_a_credential_in_any_field_without_printing_it(kind, token):
    for override, field in (
        (f"run.env.SOME_SETTING={token}", "run.env"),
        (f"model.name=x/{token}", "model.name"),
        (f"data.eval_path=d/{token}.jsonl", "data.eval_path"),
        (f"lora.target_modules=[q_proj, '{token}']", "lora.target_modules.1"),
    ):
        msg = _refusal(override)
        assert field in msg and kind in msg, msg
        assert token not in msg and token[:6] + "..." in msg, msg


def test_hf_token_env_must_be_a_name_not_the_token():
    token = "hf_" + _fill(34)
    msg = _refusal(f"model.hf_token_env={token}")
    assert "model.hf_token_env: must be the NAME" in msg and token not in msg and "hf_aB3..." in msg
    # a token given as a run.env variable *name* is refused too, also without printing it
    msg = _refusal(f"run.env.{token}=1")
    assert "run.env" in msg and token not in msg


def test_validation_errors_never_echo_a_whole_token():
    token = "ghp_" + _fill(36)
    msg = _refusal(f"optim.name={token}")  # an enum mismatch would quote its input
    assert token not in msg and "ghp_aB..." in msg
    for override in (f"{token}=1", f"run.{token}=1", f"batch.{token}.x=1", f"run.env.X_{token}=1", token):
        msg = _refusal(override)  # a token as a key, in a field path, or as a whole override
        assert token not in msg and "ghp_aB..." in msg, msg


# ---- one redaction rule for every URL shape --------------------------------------------------

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_WORD = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=12)
# Secrets carry a marker no other part of the generated URL can hold (upper case, '!'), so finding
# one in the output means the secret itself leaked.
_SECRET = st.text(alphabet="ABCDEFGHJKLMNPQRSTUVWXYZ", min_size=8, max_size=24).map(lambda s: f"S!{s}")
_KEYS = ["token", "access_token", "password", "passwd", "api_key", "apikey", "secret", "sig", "Password", "TOKEN"]


@st.composite
def _url_with_a_secret(draw) -> tuple[str, str]:
    scheme = draw(st.sampled_from(["http", "https", "sqlite", "postgresql+psycopg", "ray", "s3", "mlflow"]))
    host = draw(_WORD) + draw(st.sampled_from(["", ".example.com", ":5000", ":8265"]))
    path = "/" + "/".join(draw(st.lists(_WORD, max_size=3)))
    secret = draw(_SECRET)
    where = draw(st.sampled_from(["userinfo", "userinfo-no-user", "query", "query-second", "params", "fragment"]))
    key = draw(st.sampled_from(_KEYS))
    user = draw(_WORD)
    if where == "userinfo":
        url = f"{scheme}://{user}:{secret}@{host}{path}"
    elif where == "userinfo-no-user":
        url = f"{scheme}://:{secret}@{host}{path}"
    elif where == "query":
        url = f"{scheme}://{host}{path}?{key}={secret}"
    elif where == "query-second":
        url = f"{scheme}://{host}{path}?a={user}&{key}={secret}&b=1"
    elif where == "params":
        url = f"{scheme}://{host}{path};{key}={secret}"
    else:
        url = f"{scheme}://{host}{path}#{key}={secret}"
    before, after = draw(st.sampled_from(["", "tracking uri ", "(", "'"])), draw(st.sampled_from(["", ")", " ok", "'"]))
    return before + url + after, secret


@given(_url_with_a_secret())
def test_no_url_shape_shows_its_password(case):
    """Whatever the URL's shape -- a password with or without a user name, a credential in the
    query, the path parameters or the fragment, inside other text -- `redact` leaves no part of
    the secret beyond what `shown` allows of the whole match (which starts before the secret)."""
    text, secret = case
    out = secrets.redact(text)
    assert secret[2:] not in out and secrets.describe(text) is not None, (text, out)


@given(scheme=st.sampled_from(["http", "https", "sqlite", "ray"]), host=_WORD, path=st.lists(_WORD, max_size=3))
def test_urls_without_a_secret_pass_unchanged(scheme, host, path):
    url = f"{scheme}://{host}:8265/{'/'.join(path)}"
    assert secrets.redact(url) == url and secrets.find_tokens(url) == []
    assert secrets.redact("sqlite:////data/x.db") == "sqlite:////data/x.db"
