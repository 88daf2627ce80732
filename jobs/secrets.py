"""The one credential scanner: what a credential looks like, wherever it hides in a string.

A spec travels: into Ray's runtime_env, job submissions, Kubernetes ConfigMaps and logs. So a
spec never carries a credential, by value, anywhere; it names the environment variable that
holds one (`model.hf_token_env`). This module decides what "looks like a credential":

* tokens recognised by their issuer's prefix (Hugging Face, GitHub, AWS access key ids,
  OpenAI-style `sk-`, Slack) and JSON Web Tokens, found anywhere inside a value, with any text
  before (after a non-alphanumeric character) or after them;
* `Bearer <token>` (an HTTP Authorization value pasted whole);
* a URL that carries a password: `scheme://user:password@host` (the user name may be empty:
  `scheme://:password@host`), or a credential in its query, path parameters or fragment
  (`?token=...`, `;password=...`, `#access_token=...`, `api_key`, `secret`): one rule for every
  URL form (tests/hostile/test_secrets.py generates the shapes).

`redact` is the one redaction of everything rayft prints: `RedactingStream` applies it to every
line that reaches stdout or stderr while a command runs, and `RedactingFilter` to every log
record, whatever the line's source (a CLI flag, the environment, the spec, a cluster's answer).

Invariants: `find_tokens` never reports a match shorter than its pattern's minimum (so
"hf_hub_download", "sk-learn", "Bearer" alone, a plain https URL, "ghp_x" pass), and nothing
here ever returns or formats more of a found credential than its first `SHOWN_CHARS`
characters (`shown`, `redact`): an error message may say *what* it found, never the secret.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass

# At most this many characters of a credential appear in any message, then "...".
SHOWN_CHARS = 6

# A token starts after a character that cannot be part of it: "task-..." is not an `sk-` key.
_START = r"(?<![A-Za-z0-9])"

# Tokens recognised by their prefix alone. (kind, pattern); each pattern matches the token only,
# so `TOKEN.match(word)` works on a word and `TOKEN.search(text)` anywhere in a text.
PREFIXED: tuple[tuple[str, str], ...] = (
    ("Hugging Face token", _START + r"hf_[A-Za-z0-9]{20,}"),
    ("GitHub token", _START + r"(?:gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{22,})"),
    ("AWS access key id", r"(?<![A-Z0-9])(?:AKIA|ASIA)[0-9A-Z]{16}(?![0-9A-Z])"),
    # `sk-` is also an ordinary word fragment ("sk-learn"): the body must look random, i.e. hold
    # an upper-case letter, a lower-case letter and a digit, as every issued key does.
    (
        "OpenAI-style API key",
        _START + r"sk-(?:proj-|svcacct-|admin-|ant-)?"
        r"(?=[A-Za-z0-9_-]*[A-Z])(?=[A-Za-z0-9_-]*[a-z])(?=[A-Za-z0-9_-]*[0-9])"
        r"[A-Za-z0-9_-]{20,}",
    ),
    ("Slack token", _START + r"xox[baprs]-[A-Za-z0-9-]{10,}"),
    ("JSON Web Token", r"(?<![A-Za-z0-9_-])eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]*"),
)
# Credentials recognised by their context.
CONTEXTUAL: tuple[tuple[str, str], ...] = (
    ("Bearer token", r"(?i:\bbearer)\s+[A-Za-z0-9._~+/=-]{16,}"),
    # userinfo with a password, the user name empty or not (`http://:PASSWORD@host`)
    ("password in a URL", r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s/?#@:]*:[^\s/?#@]+@"),
    (
        # a query, path-parameter (`;password=`) or fragment (`#access_token=`) credential
        "credential in a URL query",
        r"[?&;#](?i:token|access_token|auth_token|id_token|refresh_token|password|passwd|pwd|api_?key|secret"
        r"|client_secret|sig|signature)=[^\s&;#]{8,}",
    ),
)

# Every prefixed token kind as one pattern.
TOKEN = re.compile("|".join(f"(?:{p})" for _, p in PREFIXED))
# Environment variable names that say they hold a credential (`run.env` refuses them).
SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|ACCESS_?KEY|PRIVATE_?KEY|CREDENTIAL)", re.I)

_KINDS = [(kind, re.compile(p)) for kind, p in PREFIXED + CONTEXTUAL]


@dataclass(frozen=True)
class Finding:
    """One credential-shaped span of a text: `kind` and where it is. Never holds the text."""

    kind: str
    start: int
    end: int


def find_tokens(text: str) -> list[Finding]:
    """Every credential-shaped span in `text`, in order of position (overlaps dropped)."""
    if not isinstance(text, str) or not text:
        return []
    found = sorted(
        (Finding(kind, m.start(), m.end()) for kind, rx in _KINDS for m in rx.finditer(text)),
        key=lambda f: (f.start, -f.end),
    )
    out: list[Finding] = []
    for f in found:
        if not out or f.start >= out[-1].end:
            out.append(f)
    return out


def shown(secret: str) -> str:
    """The most of a credential any message shows: its first `SHOWN_CHARS` characters, then "..."."""
    return secret[:SHOWN_CHARS] + "..."


def describe(text: str) -> str | None:
    """ "a Hugging Face token (hf_AbC...)" for the first credential in `text`, or None."""
    found = find_tokens(text)
    if not found:
        return None
    f = found[0]
    return f"{_article(f.kind)} {f.kind} ({shown(text[f.start : f.end])})"


def redact(text: str) -> str:
    """`text` with every credential cut to its first `SHOWN_CHARS` characters and "...": for
    messages that quote user input (a validation error echoing a value)."""
    found = find_tokens(text)
    if not found:
        return text
    parts, at = [], 0
    for f in found:
        parts += [text[at : f.start], shown(text[f.start : f.end])]
        at = f.end
    parts.append(text[at:])
    return "".join(parts)


class RedactingStream:
    """A text stream that writes `redact(line)` to `raw` for every line written to it: what a
    command prints cannot show a credential, from whatever source the text came. Whole lines are
    redacted (a credential split over two `write` calls is still found); a partial line goes out
    on `flush` (progress bars) or when it grows past `MAX_PENDING` characters."""

    MAX_PENDING = 1 << 16

    def __init__(self, raw):
        self.raw = raw
        self._pending = ""

    def write(self, text: str) -> int:
        self._pending += text
        cut = max(self._pending.rfind("\n"), self._pending.rfind("\r"))
        if cut >= 0:
            self.raw.write(redact(self._pending[: cut + 1]))
            self._pending = self._pending[cut + 1 :]
        if len(self._pending) > self.MAX_PENDING:
            self.raw.write(redact(self._pending))
            self._pending = ""
        return len(text)

    def flush(self) -> None:
        if self._pending:
            self.raw.write(redact(self._pending))
            self._pending = ""
        self.raw.flush()

    def isatty(self) -> bool:
        return self.raw.isatty()

    def __getattr__(self, name: str):  # encoding, fileno, errors, ... as the stream it wraps
        return getattr(self.raw, name)


class RedactingFilter(logging.Filter):
    """A log handler filter that redacts the record's message (its arguments merged in first)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        return True


@contextlib.contextmanager
def redacted_output() -> Iterator[None]:
    """For the life of a command: sys.stdout and sys.stderr through `RedactingStream`, and
    `RedactingFilter` on every handler of the root logger (install handlers before entering)."""
    saved = sys.stdout, sys.stderr
    out, err = RedactingStream(sys.stdout), RedactingStream(sys.stderr)
    sys.stdout, sys.stderr = out, err
    handlers, flt = list(logging.getLogger().handlers), RedactingFilter()
    for h in handlers:
        h.addFilter(flt)
    try:
        yield
    finally:
        for h in handlers:
            h.removeFilter(flt)
        sys.stdout, sys.stderr = saved
        out.flush()
        err.flush()


def looks_like_token(name: str) -> bool:
    """Whether a string given where a variable *name* belongs (`model.hf_token_env`) is a
    credential instead: any credential shape, or a long random-looking word (upper and lower
    case and digits, no '_' between words) that no one would choose as a variable name."""
    if not isinstance(name, str):
        return False
    if find_tokens(name):
        return True
    return (
        len(name) >= 24
        and "_" not in name.strip("_")
        and any(c.isupper() for c in name)
        and any(c.islower() for c in name)
        and any(c.isdigit() for c in name)
    )


def walk_strings(obj, path: str = "") -> Iterator[tuple[str, str]]:
    """(dotted path, string) for every string key and value inside nested dicts and lists."""
    if isinstance(obj, str):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            sub = f"{path}.{k}" if path else str(k)
            if isinstance(k, str):
                yield sub, k
            yield from walk_strings(v, sub)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from walk_strings(v, f"{path}.{i}" if path else str(i))


def _article(kind: str) -> str:
    return "an" if kind[0].upper() in "AEIOU" else "a"
