"""The vLLM server rank 0 starts (`rollout.engine: vllm` without `rollout.vllm_url`) in the memory
plan: `vllm_engine` is the base's weights in the run's precision, one adapter slot at vLLM's
`--max-lora-rank` over every projection, the KV cache (`rollout.vllm_kv_cache_gib`, or every
completion of a step at `data.max_seq_len` in whole 16-token blocks) and, on a GPU, its own CUDA
context -- each part checked here against the saved model itself, not the estimate's arithmetic.
It is in the device's total (so `rayft estimate`, the budget, queue admission and `rayft k8s
render` see it), not in the trainer's own peak; the server is started with exactly that KV cache
(`--kv-cache-memory-bytes`), never vLLM's default share of the device."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from gradtools import ROOT
from grpo_rollouts import save_tiny_base

from jobs.errors import RunError, SpecError
from jobs.memory import CUDA_CONTEXT_BYTES, plan_for_spec
from jobs.rollout import vllm_server
from jobs.rollout.vllm_sync import server_settings
from jobs.spec import load_spec

SPEC = ROOT / "examples" / "tiny-grpo.yaml"
GIB = 2**30


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return save_tiny_base(tmp_path_factory.mktemp("tiny-base"))


def spec_for(base: Path, *more: str):
    overrides = [f"model.name={base}", "rollout.engine=vllm", "data.max_seq_len=96", "lora.r=4"]
    overrides += ["resources.num_workers=1", "batch.global_batch_size=16", "batch.micro_batch_size=4"]
    return load_spec(SPEC, [*overrides, *more, "run.output_dir=/tmp/unused"], files=False)


def by_hand(base: Path, kv_tokens: int, lora_rank: int) -> dict[str, int]:
    """The server's parts from the saved model: its parameters (fp32), a slot of `lora_rank` on
    each of the 7 projections of each layer, and K and V of `kv_tokens` tokens in every layer."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(base)
    weights = sum(p.numel() for p in model.parameters()) * 4
    linears = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "layers." in n]
    lora = sum(lora_rank * (m.in_features + m.out_features) for m in linears) * 4
    c = model.config
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * kv_tokens * 4
    return {"weights": weights, "lora_slot": lora, "kv_cache": kv}


def test_the_server_rank_0_starts_is_counted_beside_training_not_in_it(base):
    spec = spec_for(base)
    plan = plan_for_spec(spec, device="cpu")
    engine = plan.vllm_engine
    want = by_hand(base, kv_tokens=16 * 96, lora_rank=8)  # r=4 -> vLLM's --max-lora-rank 8; 96 = 6 blocks
    assert {k: engine[k] for k in want} == want
    assert engine["context"] == 0 and engine["total"] == sum(want.values())
    # the same run against a user's server: the trainer's own memory is the same, the device's less
    user = plan_for_spec(spec_for(base, "rollout.vllm_url=http://127.0.0.1:9"), device="cpu")
    assert user.vllm_engine is None and "vllm_engine" not in user.estimate.components
    assert plan.estimate.peak_allocated_bytes == user.estimate.peak_allocated_bytes
    assert plan.estimate.total_bytes == user.estimate.total_bytes + engine["total"]
    assert ("vllm_engine", engine["total"] / GIB) in plan.estimate.table()  # what `rayft estimate` prints


def test_the_kv_cache_is_the_specs_when_given_and_blocks_round_up(base):
    given = plan_for_spec(spec_for(base, "rollout.vllm_kv_cache_gib=0.25"), device="cpu").vllm_engine
    assert given["kv_cache"] == GIB // 4
    ragged = plan_for_spec(spec_for(base, "data.max_seq_len=100"), device="cpu").vllm_engine
    assert ragged["kv_cache"] == by_hand(base, kv_tokens=16 * 112, lora_rank=8)["kv_cache"]  # 100 -> 7 blocks


def test_on_a_gpu_the_server_adds_its_context_and_a_budget_counts_it(base):
    spec = spec_for(base)
    on_gpu = plan_for_spec(spec, device="cuda", gpu_memory_gib=80)
    assert on_gpu.vllm_engine["context"] == CUDA_CONTEXT_BYTES
    engine_gib, trainer_gib = on_gpu.vllm_engine["total"] / GIB, on_gpu.total_gib - on_gpu.vllm_engine["total"] / GIB
    between = f"memory.budget_gib={trainer_gib + engine_gib / 2:.6f}"  # the trainer fits, trainer + server not
    assert not plan_for_spec(spec_for(base, between), device="cuda").fits
    assert plan_for_spec(spec_for(base, between, "rollout.vllm_url=http://127.0.0.1:9"), device="cuda").fits


def test_the_server_is_started_with_the_plans_kv_cache(base, monkeypatch):
    spec = spec_for(base, "rollout.vllm_kv_cache_gib=0.5")
    plan = plan_for_spec(spec, device="cpu")
    settings = server_settings(spec, SimpleNamespace(plan=plan, precision="fp32"))
    assert settings.kv_cache_bytes == plan.vllm_engine["kv_cache"] == GIB // 2
    cmd = vllm_server.command(Path("/env"), settings, 8000)
    assert f"--kv-cache-memory-bytes={GIB // 2}" in cmd
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")  # vLLM's older CPU setting would override the flag
    assert "VLLM_CPU_KVCACHE_SPACE" not in vllm_server.environment(Path("/env"), settings)


@pytest.mark.parametrize(
    ("more", "fragment"),
    [
        (
            ["rollout.engine=hf", "rollout.vllm_kv_cache_gib=1"],
            "rollout.vllm_kv_cache_gib applies to rollout.engine=vllm",
        ),
        (["rollout.vllm_url=http://127.0.0.1:9", "rollout.vllm_kv_cache_gib=1"], "leave one of the two unset"),
        (["rollout.engine=hf", "rollout.vllm_placement=separate"], "rollout.vllm_placement and"),
        (["rollout.engine=hf", "rollout.vllm_num_gpus=1"], "rollout.vllm_num_gpus applies to rollout.engine=vllm"),
        (["rollout.vllm_url=http://127.0.0.1:9", "rollout.vllm_placement=separate"], "leave one of the two unset"),
        (["rollout.vllm_url=http://127.0.0.1:9", "rollout.vllm_num_cpus=2"], "rollout.vllm_num_cpus applies to"),
        (["rollout.vllm_num_gpus=2"], "with rollout.vllm_placement=colocate it shares rank 0's device"),
        (["rollout.vllm_num_cpus=4"], "with rollout.vllm_placement=colocate it shares rank 0's device"),
        (["rollout.vllm_placement=apart"], "rollout.vllm_placement"),
        (["rollout.vllm_kv_cache_gib=0"], "rollout.vllm_kv_cache_gib"),
        (["rollout.vllm_kv_cache_gib=-1"], "rollout.vllm_kv_cache_gib"),
        ([f"rollout.vllm_kv_cache_gib={math.inf}"], "rollout.vllm_kv_cache_gib"),
    ],
)
def test_an_engine_setting_that_cannot_apply_is_refused(base, more, fragment):
    with pytest.raises(SpecError, match=fragment.replace(".", r"\.")):
        spec_for(base, *more)


def test_a_separate_engine_is_judged_on_its_own_devices_not_in_the_trainers_total(base):
    """`rollout.vllm_placement: separate`: the trainer's device total is that of a user's engine (the
    engine is not on it); the engine's weights and cache are split over its `vllm_num_gpus` devices,
    each with its own CUDA context; the one budget judges the trainer's device and each engine device."""
    colocated = plan_for_spec(spec_for(base), device="cuda", gpu_memory_gib=80)
    apart = plan_for_spec(spec_for(base, "rollout.vllm_placement=separate"), device="cuda", gpu_memory_gib=80)
    user = plan_for_spec(spec_for(base, "rollout.vllm_url=http://127.0.0.1:9"), device="cuda", gpu_memory_gib=80)
    assert "vllm_engine" not in apart.estimate.components
    assert apart.estimate.total_bytes == user.estimate.total_bytes < colocated.estimate.total_bytes
    engine = apart.vllm_engine
    assert (engine["colocated"], engine["devices"]) == (0, 1) and colocated.vllm_engine["colocated"] == 1
    assert engine["per_device"] == engine["total"] == colocated.vllm_engine["total"]
    two = plan_for_spec(
        spec_for(base, "rollout.vllm_placement=separate", "rollout.vllm_num_gpus=2"), device="cuda", gpu_memory_gib=80
    ).vllm_engine
    shared = two["weights"] + two["lora_slot"] + two["kv_cache"]
    assert two["devices"] == 2 and two["per_device"] == shared // 2 + CUDA_CONTEXT_BYTES
    # one budget judges both devices: between the trainer's total and a big engine's share, the
    # trainer fits and the engine does not
    big = ("rollout.vllm_placement=separate", "rollout.vllm_kv_cache_gib=4")
    trainer_gib = plan_for_spec(spec_for(base, *big), device="cuda", gpu_memory_gib=80).total_gib
    engine_gib = plan_for_spec(spec_for(base, *big), device="cuda", gpu_memory_gib=80).vllm_engine["per_device"] / GIB
    assert trainer_gib < engine_gib
    between = f"memory.budget_gib={(trainer_gib + engine_gib) / 2:.6f}"
    assert not plan_for_spec(spec_for(base, *big, between), device="cuda").fits
    above = f"memory.budget_gib={engine_gib * 1.01:.6f}"
    assert plan_for_spec(spec_for(base, *big, above), device="cuda").fits


def test_the_engine_actor_is_placed_as_the_spec_says(base):
    """Colocated: on rank 0's node (not soft: never elsewhere), holding nothing (it shares rank 0's
    CPUs and GPU); separate: its own CPUs and GPUs, 1 GPU by default on a GPU cluster, 0 on CPUs."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from jobs.rollout.vllm_host import actor_options

    NODE = "ab" * 28  # a node id: 28 bytes in hex
    rollout = spec_for(base).online.rollout
    options = actor_options(rollout, True, NODE)
    strategy = options.pop("scheduling_strategy")
    assert isinstance(strategy, NodeAffinitySchedulingStrategy) and (strategy.node_id, strategy.soft) == (
        NODE,
        False,
    )
    assert options == {"num_cpus": 0, "num_gpus": 0}
    apart = spec_for(base, "rollout.vllm_placement=separate").online.rollout
    assert actor_options(apart, True, NODE) == {"num_cpus": 1.0, "num_gpus": 1}
    assert actor_options(apart, False, NODE) == {"num_cpus": 1.0, "num_gpus": 0}
    sized = spec_for(base, "rollout.vllm_placement=separate", "rollout.vllm_num_gpus=4", "rollout.vllm_num_cpus=8")
    assert actor_options(sized.online.rollout, True, NODE) == {"num_cpus": 8.0, "num_gpus": 4}


def test_the_api_key_is_in_the_servers_environment_only(base, monkeypatch):
    """The key of an engine rayft starts is in the server's environment (vLLM's VLLM_API_KEY), never
    on its command line (`ps` shows that); a key the user's own environment holds is not passed on."""
    spec = spec_for(base)
    settings = server_settings(spec, SimpleNamespace(plan=plan_for_spec(spec, device="cpu"), precision="fp32"))
    monkeypatch.setenv("VLLM_API_KEY", "the-users-own")
    assert "VLLM_API_KEY" not in vllm_server.environment(Path("/env"), settings)
    keyed = dataclasses.replace(settings, api_key="k3y", host="10.0.0.7", tensor_parallel=2)
    assert vllm_server.environment(Path("/env"), keyed)["VLLM_API_KEY"] == "k3y"
    cmd = vllm_server.command(Path("/env"), keyed, 8000)
    assert not any("k3y" in a for a in cmd) and "k3y" not in repr(keyed)
    assert "--host=10.0.0.7" in cmd and "--tensor-parallel-size=2" in cmd


def test_rayft_estimate_shows_a_separate_engine_on_its_own_devices(base, capsys):
    """`rayft estimate` of a separate engine: no `vllm_engine` row in the training device's table,
    a line with its share per device and the budget's verdict on it; `--json` carries the parts."""
    from orchestrator.cli import main

    spec = SPEC.parent / "tiny-grpo.yaml"
    common = [f"model.name={base}", "rollout.engine=vllm", "data.max_seq_len=96", "run.output_dir=/tmp/unused"]
    apart = [*common, "rollout.vllm_placement=separate", "rollout.vllm_kv_cache_gib=2"]
    assert main(["estimate", str(spec), *apart, "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert "vllm_engine" not in rep["components"] and rep["vllm_engine"]["colocated"] == 0
    assert rep["vllm_engine"]["kv_cache"] == 2 * GIB
    assert main(["estimate", str(spec), *apart, "memory.budget_gib=1"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "vllm_engine (rollout.vllm_placement=separate, on 1 device(s) of its own" in out
    assert "exceeds the budget" in out  # 2 GiB of cache on a 1 GiB budget
    assert main(["estimate", str(spec), *common]) == 0
    assert "rollout.vllm_placement=separate" not in capsys.readouterr().out  # colocated: a row of the table


@pytest.mark.parametrize(
    ("more", "fragment"),
    [
        (["rollout.vllm_sleep=true"], "with resources.use_gpu=false there is no device memory to free"),
        (["resources.use_gpu=true", "rollout.vllm_sleep=true", "rollout.vllm_placement=separate"], "it has its own"),
        (["resources.use_gpu=true", "rollout.vllm_sleep=true", "rollout.vllm_url=http://127.0.0.1:9"], "the user's"),
        (["rollout.engine=hf", "rollout.vllm_sleep=true"], "rollout.vllm_sleep applies to rollout.engine=vllm"),
    ],
)
def test_sleep_where_it_cannot_free_anything_is_refused(base, more, fragment):
    with pytest.raises(SpecError, match=fragment.replace(".", r"\.").replace("(", r"\(")):
        spec_for(base, *more)


def test_a_sleeping_engine_is_whole_only_while_it_generates(base):
    """`rollout.vllm_sleep`: the device's total is the larger of training beside the sleeping engine
    (its CUDA context and LoRA slot) and generation (the whole engine beside the trainer's static
    memory), never more than the awake engine's total; the server gets vLLM's sleep flag, and its
    development routes (sleep among them, unauthenticated) only on loopback."""
    awake = plan_for_spec(spec_for(base, "resources.use_gpu=true"), device="cuda", gpu_memory_gib=80).estimate
    spec = spec_for(base, "resources.use_gpu=true", "rollout.vllm_sleep=true")
    plan = plan_for_spec(spec, device="cuda", gpu_memory_gib=80)
    est, engine = plan.estimate, plan.vllm_engine
    assert engine["sleeps"] == 1 and engine["asleep"] == engine["context"] + engine["lora_slot"] < engine["total"]
    overhead = est.components["framework_overhead"]
    stepping = est.peak_allocated_bytes + engine["asleep"]
    generating = est.static_bytes + engine["total"]
    assert est.total_bytes == max(stepping, generating) + overhead
    assert est.total_bytes < awake.total_bytes == est.peak_allocated_bytes + overhead + engine["total"]
    settings = server_settings(spec, SimpleNamespace(plan=plan, precision="bf16"))
    assert settings.sleep and "--enable-sleep-mode" in vllm_server.command(Path("/env"), settings, 8000)
    assert vllm_server.environment(Path("/env"), settings)["VLLM_SERVER_DEV_MODE"] == "1"
    plain = dataclasses.replace(settings, sleep=False)
    assert "VLLM_SERVER_DEV_MODE" not in vllm_server.environment(Path("/env"), plain)
    with pytest.raises(RunError, match="served on loopback only, not on 10.0.0.7"):
        vllm_server.VLLMServer.start(dataclasses.replace(settings, host="10.0.0.7"))


def test_the_engine_sleeps_after_every_ranks_completions_and_wakes_before_the_next_adapter(base, tmp_path):
    """The order `VLLMRollout` asks of a sleeping engine over two rollout batches: load step 0's
    adapter, (generate), sleep; wake, load step 1's, unload step 0's, (generate), sleep. vLLM's sleep
    mode does not run on a CPU, so a recording engine stands in for the server here
    (tests/gpu/test_vllm_sleep.py runs the real one)."""
    import torch.nn as nn
    from peft import LoraConfig, get_peft_model

    from jobs.rollout.vllm_host import LocalHost
    from jobs.rollout.vllm_sync import VLLMRollout
    from jobs.train.context import LocalContext

    class Recording:
        name, version, sync_metrics = "recording engine", None, {}

        def __init__(self):
            self.calls: list[str] = []

        def load(self, version, path):
            assert (Path(path) / "adapter_model.safetensors").is_file()
            self.calls.append(f"load {version}")

        def unload(self, version):
            self.calls.append(f"unload {version}")

        def sleep(self):
            self.calls.append("sleep")

        def wake_up(self):
            self.calls.append("wake")

    model = get_peft_model(nn.Sequential(nn.Linear(4, 4)), LoraConfig(r=2, target_modules=["0"]))
    engine, ctx = Recording(), LocalContext(on_progress=lambda r: None)
    rollout = VLLMRollout(engine, LocalHost(), sleeps=True)  # type: ignore[arg-type]
    for step in (0, 1):
        assert rollout.at_step(model, ctx, step) is engine and engine.version == f"step-{step}"
        rollout.rest(ctx)
    assert engine.calls == ["load step-0", "sleep", "wake", "load step-1", "unload step-0", "sleep"]
    rollout.close()
