"""`rollout.engine: vllm`: completions from a vLLM OpenAI-compatible server (`VLLMEngine`, a
`jobs.rollout.engine.RolloutEngine`), and the adapter versions it serves.

Exactness across the process boundary: each request sends its prompt as token ids and gets the
sampled ids back (`return_token_ids`), so the ids trained on are the engine's, never text
re-tokenized; a completion is cut by the same rule as in-process (`cut_at_eos`: its first EOS
kept, else `max_completion_length` and truncated). Each request carries its completion's own seed
(`sample_seed`), so a prompt's completions differ and a rerun on the same engine draws them again.
The engine's log-probabilities of the sampled ids (vLLM's raw ones: before temperature, like the
trainer's) come back in `Completion.logprobs`.

Every failure is one line naming the engine and what it said (`RunError`, exit 1): a refusal
(HTTP error and vLLM's message), no answer within `timeout_s`, nothing listening, or -- for a
server rayft started -- the server's exit and the last line of its log.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jobs.errors import RunError
from jobs.rollout.engine import Completion, Request, Sampling, cut_at_eos

# Requests in flight at once: vLLM batches what arrives together.
CONCURRENCY = 64
MAX_SAID_CHARS = 300


def shown_url(url: str) -> str:
    """`url` without user info, query or fragment: what an error line may name."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path.rstrip('/')}"


def what_it_said(body: bytes) -> str:
    """vLLM's error message in a response body (`{"error": {"message": ...}}`), else its text."""
    text = body.decode(errors="replace")
    try:
        said = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        said = text
    return " ".join(str(said).split())[:MAX_SAID_CHARS]


class VLLMEngine:
    """A client of one vLLM OpenAI-compatible server at `url`. Generation names the adapter
    `version` the server holds for the current step (`jobs.rollout.vllm_sync`); `server`, when
    rayft started it, explains a connection that broke (its exit code and log)."""

    returns_logprobs = True

    def __init__(
        self, url: str, timeout_s: float, eos_token_ids: Sequence[int], server: Any = None, api_key: str | None = None
    ):
        self.url, self.timeout_s, self.eos, self.server = url.rstrip("/"), timeout_s, tuple(eos_token_ids), server
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.name = f"vLLM engine at {shown_url(self.url)}"
        self.version: str | None = None
        self.sync_metrics: dict[str, float] = {}  # rank 0: the last adapter sync's time and bytes

    # ---- generation -------------------------------------------------------------------------

    def generate(self, requests: Sequence[Request], sampling: Sampling) -> list[Completion]:
        if self.version is None:
            raise RunError(f"{self.name}: no adapter version loaded to generate with")
        if not requests:
            return []
        with ThreadPoolExecutor(min(CONCURRENCY, len(requests))) as pool:
            return list(pool.map(lambda r: self._one(r, sampling), requests))

    def _one(self, request: Request, sampling: Sampling) -> Completion:
        choice = self.post("/v1/completions", self.body(request, sampling))["choices"][0]
        ids, logprobs = sampled(choice)
        kept, truncated = cut_at_eos(ids, self.eos, sampling.max_completion_length)
        if len(logprobs) < len(kept):
            raise RunError(f"{self.name} returned {len(logprobs)} log-probs for {len(kept)} sampled tokens")
        return Completion(request.prompt_index, request.sample_index, kept, truncated, logprobs[: len(kept)])

    def body(self, request: Request, sampling: Sampling) -> dict:
        """The `/v1/completions` request of one completion: the prompt's ids, its seed, `rollout.*`."""
        return {
            "model": self.version,
            "prompt": list(request.prompt_ids),
            "max_tokens": sampling.max_completion_length,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,  # 0: off, as in rayft
            "seed": request.seed,
            "stop_token_ids": list(self.eos),
            "logprobs": 0,  # the sampled token's own
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }

    # ---- adapters ---------------------------------------------------------------------------

    def load(self, version: str, path: str) -> None:
        """The adapter saved at `path` (PEFT format, on the server's disk) served as `version`."""
        self.post("/v1/load_lora_adapter", {"lora_name": version, "lora_path": path}, what=f"loading adapter {version}")

    def unload(self, version: str) -> None:
        self.post("/v1/unload_lora_adapter", {"lora_name": version}, what=f"unloading adapter {version}")

    def sleep(self) -> None:
        """vLLM's sleep, level 1: the weights offloaded to host memory, the KV cache dropped."""
        self.post("/sleep?level=1", {}, what="sleeping")

    def wake_up(self) -> None:
        self.post("/wake_up", {}, what="waking up")

    def check(self) -> None:
        """The server answers `/health` (a user's `rollout.vllm_url`, before the first step)."""
        self.call(urllib.request.Request(f"{self.url}/health"), "/health")

    # ---- HTTP -------------------------------------------------------------------------------

    def post(self, path: str, body: dict, what: str | None = None) -> dict:
        data = json.dumps(body).encode()
        req = urllib.request.Request(f"{self.url}{path}", data, {"Content-Type": "application/json", **self._headers})
        text = self.call(req, what or path)
        try:
            return json.loads(text)
        except ValueError:
            return {"text": text.decode(errors="replace")}

    def call(self, req: urllib.request.Request, what: str) -> bytes:
        """The response body, or a RunError naming the engine, `what` was asked and what it said."""
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                return r.read()
        except urllib.error.HTTPError as e:
            raise RunError(f"{self.name} refused {what} (HTTP {e.code}): {what_it_said(e.read())}") from None
        except TimeoutError:
            raise RunError(
                f"{self.name} did not answer {what} within rollout.vllm_timeout_s={self.timeout_s:g} s"
            ) from None
        except OSError as e:
            reason = getattr(e, "reason", e)
            raise RunError(f"{self.name}: {what} failed: {reason}{self.server_state()}") from None

    def server_state(self) -> str:
        """`; <the server's exit and last log line>` when rayft's server has exited, else ''."""
        return "" if self.server is None else self.server.exit_note()


def sampled(choice: dict) -> tuple[list[int], tuple[float, ...]]:
    """(ids, the engine's log-probs of them) of one `/v1/completions` choice: the ids the server
    returns (`token_ids`), else those its `return_tokens_as_token_ids` tokens name."""
    lp = choice.get("logprobs") or {}
    ids = choice.get("token_ids")
    if ids is None:
        ids = [int(t.removeprefix("token_id:")) for t in lp.get("tokens") or []]
    return [int(i) for i in ids], tuple(float(x) for x in lp.get("token_logprobs") or [])
