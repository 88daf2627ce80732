"""Is there a Ray cluster at `--address`? Asked once, bounded, before anything is created.

`ray.init(address=...)` waits for minutes on an address where nothing answers as Ray does (a
closed port fails fast, but an HTTP server, a cluster that froze, or `auto` finding a dead one
hang it), and a run would by then have claimed its output directory. So the driver first checks
the address's form, then that it accepts a TCP connection (CONNECT_TIMEOUT_S), then connects for
real in a child process that is killed after PROBE_TIMEOUT_S (the child pays Ray's import, a few
seconds; it is what `ray.init` will do next, with the same environment and token). Any failure
is `ClusterUnreachable`: one line naming the address, exit 2.

No ray import here: the check runs before Ray is started or imported in this process.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from jobs.errors import ClusterUnreachable, UserError, error_line

CONNECT_TIMEOUT_S = 5.0  # how long an address gets to accept a TCP connection
# How long the child's `ray.init` gets (RAYFT_PROBE_TIMEOUT_S overrides): Ray's import takes 3-10 s
# on a loaded 2-core machine; a cluster that answers connects within a second after it.
PROBE_TIMEOUT_S = 30.0
_PROBE = (
    "import logging, sys, ray\n"
    "ray.init(address=sys.argv[1], logging_level=logging.ERROR, log_to_driver=False, include_dashboard=False)\n"
    "print('rayft-probe-ok', flush=True)\n"
)


def check_cluster(address: str) -> None:
    """Refuse `address` unless a Ray cluster answers there (see the module doc)."""
    _check_form_and_port(address)
    timeout_s = float(os.environ.get("RAYFT_PROBE_TIMEOUT_S", PROBE_TIMEOUT_S))
    try:
        got = subprocess.run([sys.executable, "-c", _PROBE, address], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ClusterUnreachable(
            f"--address {address}: no Ray cluster answered within {timeout_s:g} s (something accepts "
            "connections there, but not as a Ray GCS does)"
        ) from None
    if got.returncode != 0 or "rayft-probe-ok" not in got.stdout:
        raise ClusterUnreachable(f"--address {address}: no Ray cluster answers ({_last_line(got.stderr)})")


def _last_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    return error_line(Exception(lines[-1] if lines else "ray.init failed"))[:300]


def _check_form_and_port(address: str) -> None:
    """A GCS address HOST:PORT (or ray://HOST:PORT) must accept a TCP connection; `auto` is left
    to the child's `ray.init` (it finds the cluster of this machine)."""
    if address == "auto":
        return
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        raise UserError(f"--address {address}: not HOST:PORT (the GCS address, e.g. 10.0.0.1:6379)")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise ClusterUnreachable(f"--address {address}: no Ray cluster answers ({e.strerror or e})") from None
