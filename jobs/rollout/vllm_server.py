"""The vLLM server rayft starts for `rollout.engine: vllm` (without `rollout.vllm_url`): vLLM's
OpenAI-compatible server, run by rank 0 from vLLM's own environment (`make vllm-env` builds
`.venv-vllm`: its transformers pin is not rayft's), on loopback, on a free port, with runtime LoRA
loading on. It loads the base once; only adapters reach it afterwards (`jobs.rollout.vllm_sync`).

Its life is bounded: the start waits at most `start_timeout_s` for `/health`, and the server goes
when `stop` is called, when the process that started it exits (`atexit`), or when the thread that
started it ends (Linux's parent-death signal: a Ray Train worker's training thread).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from jobs.errors import RunError

# Where `make vllm-env` builds vLLM's environment; RAYFT_VLLM_ENV names another (a cluster's image).
DEFAULT_ENV = Path(__file__).resolve().parents[2] / ".venv-vllm"
ENV_VAR = "RAYFT_VLLM_ENV"
# vLLM's accepted `--max-lora-rank` values (vllm/config/lora.py): the smallest at least lora.r is asked.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# vLLM's own KV-cache setting on a CPU (GiB, whole): it would override `--kv-cache-memory-bytes`.
LEGACY_CPU_KV_ENV = "VLLM_CPU_KVCACHE_SPACE"
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def vllm_env() -> Path:
    return Path(os.environ.get(ENV_VAR) or DEFAULT_ENV)


def iomp_library(env: Path) -> Path | None:
    """intel-openmp's libiomp5.so in `env` (the CPU engine runs with it preloaded)."""
    found = sorted(env.glob("lib/libiomp5.so"))
    return found[0] if found else None


def env_problem() -> str | None:
    """Why rank 0 cannot start a vLLM server here (one line), or None."""
    env = vllm_env()
    if not (env / "bin" / "python").is_file():
        return f"no vLLM environment at {env}: run `make vllm-env` (or set {ENV_VAR}, or give rollout.vllm_url)"
    if iomp_library(env) is None:
        return f"{env} has no lib/libiomp5.so (intel-openmp): run `make vllm-env` again"
    return None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def lora_rank_bound(r: int) -> int:
    """vLLM's `--max-lora-rank` for adapters of rank `r`."""
    return next((b for b in LORA_RANKS if b >= r), r)


@dataclass(frozen=True)
class ServerSettings:
    """What the server is started with: the base (a local directory vLLM loads), its dtype
    (rayft's precision), the context length, the adapters' rank and the KV cache the memory plan
    gave it (`jobs.memory.generation.engine_terms`: `rollout.vllm_kv_cache_gib`, or every
    completion of a step at once); where it listens (loopback, or its node's address when the
    run's ranks reach it through Ray), the API key its `/v1` routes ask for (passed in its
    environment, never on its command line), the devices it sees and its tensor-parallel size."""

    model: str
    precision: str
    max_model_len: int
    lora_rank: int
    kv_cache_bytes: int
    start_timeout_s: float = 600.0
    host: str = "127.0.0.1"
    api_key: str | None = field(default=None, repr=False)
    visible_devices: str | None = None  # CUDA_VISIBLE_DEVICES of the server (colocated: rank 0's)
    tensor_parallel: int = 1
    sleep: bool = False  # vLLM's sleep mode (`rollout.vllm_sleep`): its routes need loopback


def command(env: Path, settings: ServerSettings, port: int) -> list[str]:
    return [
        str(env / "bin" / "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        f"--model={settings.model}",
        f"--host={settings.host}",
        f"--port={port}",
        f"--dtype={DTYPES[settings.precision]}",
        f"--max-model-len={settings.max_model_len}",
        # the plan's size, not vLLM's default (90% of the device, or of a CPU's memory)
        f"--kv-cache-memory-bytes={settings.kv_cache_bytes}",
        "--enable-lora",
        f"--max-lora-rank={lora_rank_bound(settings.lora_rank)}",
        "--max-loras=1",
        "--max-cpu-loras=2",  # the new version is loaded before the old one is unloaded
        "--disable-uvicorn-access-log",
        *([f"--tensor-parallel-size={settings.tensor_parallel}"] if settings.tensor_parallel > 1 else []),
        *(["--enable-sleep-mode"] if settings.sleep else []),
    ]


def environment(env: Path, settings: ServerSettings) -> dict[str, str]:
    out = dict(os.environ)
    out.pop("VLLM_API_KEY", None)
    if settings.api_key:
        out["VLLM_API_KEY"] = settings.api_key
    out.pop("VLLM_SERVER_DEV_MODE", None)
    if settings.sleep:
        # /sleep and /wake_up are development routes, served with others and without the API key:
        # only on loopback (`VLLMServer.start` refuses any other address)
        out["VLLM_SERVER_DEV_MODE"] = "1"
    if settings.visible_devices is not None:
        out["CUDA_VISIBLE_DEVICES"] = settings.visible_devices
    out.update(
        LD_PRELOAD=str(iomp_library(env)),
        VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
        VIRTUAL_ENV=str(env),
        PATH=f"{env / 'bin'}{os.pathsep}{out.get('PATH', '')}",
    )
    out.pop("PYTHONPATH", None)  # rayft's own packages stay out of vLLM's interpreter
    out.pop(LEGACY_CPU_KV_ENV, None)
    return out


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the starting thread ends (Linux prctl)."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class VLLMServer:
    """A running server: its process (a session of its own: vLLM starts children), its URL and log."""

    process: subprocess.Popen
    url: str
    log_path: Path
    started_s: float = 0.0
    _stopped: bool = field(default=False, repr=False)

    @classmethod
    def start(cls, settings: ServerSettings) -> VLLMServer:
        if settings.sleep and settings.host != "127.0.0.1":
            raise RunError(
                f"rollout.vllm_sleep: vLLM's sleep routes come with its unauthenticated development routes, "
                f"served on loopback only, not on {settings.host}"
            )
        problem = env_problem()
        if problem:
            raise RunError(f"rollout.engine=vllm: {problem}")
        env, port = vllm_env(), free_port(settings.host)
        log_path = Path(tempfile.mkdtemp(prefix="rayft-vllm-")) / "server.log"
        t0 = time.perf_counter()
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                command(env, settings, port),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=environment(env, settings),
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        server = cls(process, f"http://{settings.host}:{port}", log_path)
        atexit.register(server.stop)
        server.wait_ready(settings.start_timeout_s)
        server.started_s = time.perf_counter() - t0
        return server

    def wait_ready(self, timeout_s: float) -> None:
        """Until `/health` answers 200; a server that exits or stays silent is one line (RunError)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.stop()
                raise RunError(
                    f"vLLM server exited with code {self.process.returncode} while starting: "
                    f"{self.last_line()} (log: {self.log_path})"
                )
            if self.healthy():
                return
            time.sleep(0.5)
        self.stop()
        raise RunError(
            f"vLLM server did not answer {self.url}/health within rollout.vllm_start_timeout_s={timeout_s:g} s "
            f"(log: {self.log_path})"
        )

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def last_line(self) -> str:
        """The server log's last line that says something (vLLM ends a failure with its error)."""
        try:
            lines = [s for s in self.log_path.read_text(errors="replace").splitlines() if s.strip()]
        except OSError:
            return "(no log)"
        return lines[-1].strip()[-300:] if lines else "(empty log)"

    def exit_note(self) -> str:
        """`; the server exited with code N: <its last log line>` once it has exited, else ''."""
        if self.process.poll() is None:
            return ""
        return f"; the server exited with code {self.process.returncode}: {self.last_line()}"

    def stop(self) -> None:
        """SIGTERM to the server's process group (vLLM shuts its children down), SIGKILL after 15 s."""
        if self._stopped:
            return
        self._stopped = True
        for sig, wait_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(wait_s)
                os.killpg(self.process.pid, signal.SIGKILL)  # children the server left behind
                return
            except subprocess.TimeoutExpired:
                continue
            except ProcessLookupError:
                return
