"""rayft's errors, by meaning. The CLI maps them once (`orchestrator.cli.main`): the message is
printed as one line, the process exits with the class's `exit_code`, never with a traceback.

    RayftError
    +-- UserError          exit 2  the user's input is wrong: a spec, an override, a file, an argument,
    |   |                          an id that names nothing, a lock that another driver holds
    |   +-- SpecError              ... a spec or override field (the message names the field path)
    +-- ClusterError       exit 1  a cluster refused or failed a well-formed request
        +-- ClusterUnreachable  exit 2  no cluster answers at that address (a wrong address or a cluster down)
        +-- ClusterAuthError    exit 2  the cluster rejected the credentials (a wrong or missing token)
        +-- JobNotFound         exit 2  the cluster has no job of that id / name

Every class is defined here, in `jobs`, because the worker raises some of them (a bad data
line is a `SpecError` raised on a Ray worker) and `jobs` imports nothing above it.
"""

from __future__ import annotations


class RayftError(Exception):
    """Base of every error rayft reports as one line."""

    exit_code = 1


class UserError(RayftError, ValueError):
    """A user mistake (spec, override, file, argument): fix the input and run again."""

    exit_code = 2


class SpecError(UserError):
    """A mistake in a spec, an override or a file the spec names; the message names the field path."""


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
