"""rayft's errors, by meaning. The CLI maps them once (`orchestrator.cli.main`): the message is
printed as one line, the process exits with the class's `exit_code`, never with a traceback.

    RayftError
    +-- UserError          exit 2  the user's input is wrong: a spec, an override, a file, an argument,
    |   |                          an id that names nothing, a lock that another driver holds
    |   +-- SpecError              ... a spec or override field (the message names the field path)
    |   +-- RewardError            ... a user reward function failed on a record (it raised, returned
    |                                  the wrong count, NaN, infinity or no number): names both
    +-- ClusterError       exit 1  a cluster refused or failed a well-formed request
    |   +-- ClusterUnreachable  exit 2  no cluster answers at that address (a wrong address or a cluster down)
    |   +-- ClusterAuthError    exit 2  the cluster rejected the credentials (a wrong or missing token)
    |   +-- JobNotFound         exit 2  the cluster has no job of that id / name
    |   +-- NodeLost            exit 1  a node that held a training worker died mid-run (checkpoints kept)
    +-- RunError           exit 1  a run failed for a reason no input fixes: training diverged, the runner
        |                          started another world size than asked, a bad fault-injection setting
        +-- RewardTimeout  exit 1  a reward function ran longer than `reward.timeout_s`

Every class is defined here, in `jobs`, because the worker raises some of them (a bad data
line is a `SpecError` raised on a Ray worker, a diverged loss a `RunError`) and `jobs` imports
nothing above it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

# An error line shows at most this much of any one word (a path, a value it quotes): a 100,000-
# character value is cut to its head and tail, the reason around it stays whole.
MAX_WORD_CHARS = 200
_LONG_WORD = re.compile(rf"\S{{{MAX_WORD_CHARS + 1},}}")


# Characters a terminal acts on instead of showing (C0 and C1 controls: escape sequences that clear
# the screen, set the window title, hide text; DEL) and the bidirectional controls that reorder
# what is shown (right-to-left override, isolates, marks).
_INVISIBLE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def visible(text: str, keep: str = "") -> str:
    """`text` as a terminal will show it and no more: every control and bidirectional-control
    character (but those in `keep`, e.g. newline and tab in a data preview) written as its escape
    (`\\x1b`, `\\u202e`). The rule for user text rayft prints or saves as a picture."""

    def escaped(m: re.Match) -> str:
        c = m.group(0)
        return c if c in keep else (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")

    return _INVISIBLE.sub(escaped, text)


def error_line(err: BaseException | str) -> str:
    """The one line an error is printed as (`rayft: error: ...`): line breaks and every other
    control character escaped (`visible`), and every word longer than MAX_WORD_CHARS cut in the
    middle, saying how long it was. The one rule for every message rayft prints about a failure,
    whichever value it quotes."""
    text = visible(str(err).replace("\r", "\\r").replace("\n", "\\n"))

    def cut(m: re.Match) -> str:
        w = m.group(0)
        return f"{w[:120]}...({len(w)} characters)...{w[-40:]}"

    return _LONG_WORD.sub(cut, text)


class RayftError(Exception):
    """Base of every error rayft reports as one line."""

    exit_code = 1


class UserError(RayftError, ValueError):
    """A user mistake (spec, override, file, argument): fix the input and run again."""

    exit_code = 2


class SpecError(UserError):
    """A mistake in a spec, an override or a file the spec names; the message names the field path."""


class RewardError(UserError):
    """A reward function (`reward.functions`) failed on the completions of a record: it raised,
    returned another number of values than completions, NaN, infinity or something not a number.
    The message names the function and the record."""


class ClusterError(RayftError, RuntimeError):
    """The cluster refused or failed a request that was well-formed."""

    exit_code = 1


class ClusterUnreachable(ClusterError):
    """Nothing answers at the cluster address (wrong address, cluster down, no kubeconfig)."""

    exit_code = 2


class ClusterAuthError(ClusterError):
    """The cluster rejected the credentials, or needs some and none were sent."""

    exit_code = 2


class JobNotFound(ClusterError):
    """The cluster has no job with that submission id or RayJob name."""

    exit_code = 2


class NodeLost(ClusterError):
    """A node holding a training worker died while the job ran: the cluster's fault, not the user's
    (exit 1). Carries the node as Ray reports it, so callers (the CLI, a search's table, the queue
    driver's logs) can name it."""

    exit_code = 1

    def __init__(self, message: str, node_id: str = "", node_ip: str = ""):
        super().__init__(message)
        self.node_id, self.node_ip = node_id, node_ip

    def __reduce__(self):  # Ray pickles errors across processes (a Tune trial's error)
        return (self.__class__, (str(self), self.node_id, self.node_ip))


class RunError(RayftError, RuntimeError):
    """A run failed, and neither the user's input nor the cluster is what to fix (exit 1): training
    diverged (NaN or infinite loss), the runner started another number of workers than
    `resources.num_workers`, a `RAYFT_FAULT` setting (fault injection for tests and drills) that
    does not parse. Not a `ValueError`: the places that turn a `ValueError` into a `SpecError`
    naming a field never catch it."""

    exit_code = 1


class RewardTimeout(RunError):
    """A reward function ran longer than `reward.timeout_s` on one batch of completions (exit 1:
    the input may be fine, the function or what it waits on is not)."""


# ---- failures that come back wrapped (by Ray Train, Ray Tune, the Jobs API) --------------------


def causes(err: BaseException | None) -> Iterator[BaseException]:
    """`err` and everything it wraps: Ray Train's per-worker failures, `__cause__`, `__context__`.
    The one walk over Ray's wrapping that `worker_error` and `oom_line` use."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        failures = getattr(e, "worker_failures", None)
        if isinstance(failures, dict):
            todo.extend(failures.values())
        # Ray Train's WorkerHealthCheckFailedError and ControllerError keep what they wrap here.
        todo.extend([getattr(e, "health_check_failure", None), getattr(e, "controller_failure", None)])
        todo.extend([e.__cause__, e.__context__])


# The errors a worker raises that the CLI reports as they are, by name; Ray's text of a failure
# names them as "...SpecError: <message>".
_WORKER_ERRORS: dict[str, type[RayftError]] = {cls.__name__: cls for cls in (SpecError, RunError)}
_WORKER_ERROR_LINE = re.compile(r"(?<!\w)(" + "|".join(_WORKER_ERRORS) + r"): ")


def worker_error(err: BaseException | None) -> RayftError | None:
    """A SpecError (bad data line, LoRA targets that match nothing) or RunError (training diverged)
    raised on a worker comes back wrapped by Ray, sometimes only as text; unwrap it so the CLI
    prints its one line and exits with its code (2 and 1)."""
    for e in causes(err):
        for cls in _WORKER_ERRORS.values():
            if isinstance(e, cls):
                return cls(str(e))
        named = list(_WORKER_ERROR_LINE.finditer(str(e)))
        if named:
            lines = str(e)[named[-1].end() :].strip().splitlines()
            return _WORKER_ERRORS[named[-1].group(1)](lines[0] if lines else "")
    return None


# torch's exception line as Ray flattens it into a message or a log (torch.OutOfMemoryError,
# torch.cuda.OutOfMemoryError, ...); other lines count when they say "out of memory" (CUDA's
# "CUDA out of memory" / "CUDA error: out of memory", ROCm's "HIP out of memory").
_OOM_EXCEPTION_LINE = re.compile(r"(\w+\.)*OutOfMemoryError: .*")


def oom_line(*failures: BaseException | str | None) -> str | None:
    """The out-of-memory message in a training failure -- an exception (walked with `causes`) or
    the text of a job's status message or logs -- or None when it is not out of memory. The one
    rule Tune (trial -> infeasible) and the queue driver (job -> retried at half the micro-batch) use.
    Preference: an OutOfMemoryError/MemoryError object, then torch's exception line, then any
    line that says "out of memory"."""
    found: str | None = None
    for failure in failures:
        for e in [failure] if isinstance(failure, str) or failure is None else causes(failure):
            if isinstance(e, BaseException) and (isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError"):
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                return f"{type(e).__name__}: {first}"[:300]
            for line in str(e or "").splitlines():
                m = _OOM_EXCEPTION_LINE.search(line)
                if m:
                    return m.group(0).strip()[:300]
                if found is None and "out of memory" in line.lower():
                    found = line.strip()[:300]
    return found


# Ray Train's health check says which worker stopped answering, with the node it ran on: "A worker
# health check failed.\nWorker info: Worker(... metadata=ActorMetadata(..., node_id='<hex>',
# node_ip='<ip>', ...". The health check is the only way a lost node shows up in Train v2: a poll
# that fails is WorkerHealthCheckFailedError (it wraps ActorUnavailableError or ActorDiedError, by
# timing), a poll that hangs past RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S (a node that froze or
# was cut off rather than died) is WorkerHealthCheckTimeoutError, with the same worker info.
_WORKER_NODE = re.compile(r"node_id='([0-9a-f]+)',\s*node_ip='([^']*)'")
_HEALTH_CHECK_ERRORS = ("WorkerHealthCheckFailedError", "WorkerHealthCheckTimeoutError")


def unreachable_workers(err: BaseException | None) -> dict[str, tuple[str, list[int]]]:
    """{node id: (node ip, [world ranks])} of the training workers whose health check failed or hung
    in a Ray Train failure (`WorkerGroupError.worker_failures`); empty when none did. Whether their
    node is gone, or only the worker process, is for the caller to ask the cluster."""
    found: dict[str, tuple[str, list[int]]] = {}
    for e in causes(err):
        failures = getattr(e, "worker_failures", None)
        if not isinstance(failures, dict):
            continue
        for rank, f in failures.items():
            if type(f).__name__ not in _HEALTH_CHECK_ERRORS:
                continue
            m = _WORKER_NODE.search(str(f))
            if m:
                found.setdefault(m.group(1), (m.group(2), []))[1].append(int(rank))
    return found


# Ray's words for why an actor's process ended ("... Worker exit detail: Worker unexpectedly exits
# with a connection error code 2. End of file. Some common causes include: ..."): its first sentence.
_EXIT_DETAIL = re.compile(r"Worker exit detail: ([^.\n]*)")


def worker_failure(err: BaseException | None) -> tuple[int, str] | None:
    """(world rank, what happened to it) for the training worker a Ray Train failure `err`
    (`WorkerGroupError.worker_failures`) is first about: a worker whose process died or stopped
    answering (Ray Train's health check) before one that raised -- the survivors of a crashed
    rank only lose their peer -- and the lowest rank among equals. None when `err` names none."""
    failures: dict[int, BaseException] = {}
    for e in causes(err):
        found = getattr(e, "worker_failures", None)
        if isinstance(found, dict):
            failures = {**found, **failures}
    if not failures:
        return None
    checked = [r for r in failures if type(failures[r]).__name__ in _HEALTH_CHECK_ERRORS]
    rank = min(checked or failures)
    return int(rank), _what_happened(failures[rank])


def worker_failure_line(err: BaseException | None) -> str | None:
    """`worker_failure` in the words a run's error line and a search's trial row use: training
    worker rank R died (...) / stopped answering (...) / failed: <exception line>. None when `err`
    names no worker."""
    found = worker_failure(err)
    return None if found is None else f"training worker rank {found[0]} {found[1]}"


def _what_happened(failure: BaseException) -> str:
    """A worker's failure as the end of the sentence "training worker rank R ...": it died, it
    stopped answering, or the exception line it raised (a traceback's last line)."""
    name, text = type(failure).__name__, str(failure)
    if name == "WorkerHealthCheckTimeoutError":
        return "stopped answering (Ray Train's health check of it hung)"
    if name == "WorkerHealthCheckFailedError":
        detail = _EXIT_DETAIL.search(text)
        return "died" + (f" ({detail.group(1).strip()})" if detail else " (Ray Train's health check of it failed)")
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if len(lines) > 1:  # a traceback as Ray carries it: its last line names the exception
        return f"failed: {lines[-1]}"
    return f"failed: {name}: {lines[0] if lines else ''}"


# What a rank says when a peer of its collective went away: gloo's lines for a closed or reset
# connection, torch's (it adds "This is typically caused by a remote worker crashing"), NCCL's for
# an aborted communicator. A reset connection is gloo's only: a download that fails the same way
# inside the training function is not a lost peer.
_PEER_GONE = re.compile(
    r"gloo[^\n]*connection (closed|reset) by peer|connection was likely closed|remote worker crashing|"
    r"remote process exited|NCCL communicator was aborted|DistNetworkError",
    re.IGNORECASE,
)


def peer_gone(err: BaseException | None) -> bool:
    """True when a failure in `err` (walked with `causes`) is a rank's collective losing a peer:
    what the ranks that survive a lost node raise, often before Ray Train's health check has
    noticed the lost node's own workers."""
    return any(_PEER_GONE.search(str(e)) for e in causes(err))
