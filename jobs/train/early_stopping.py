"""`run.early_stopping`: stop a run whose held-out metric no longer improves, and end it with the
best step's adapter. The metric is the objective's held-out one unless `run.early_stopping.metric`
names another it reports: the eval loss (lower is better), for GRPO the held-out mean reward
`eval_reward` (higher is better). `train()` asks `EarlyStopping` after every evaluation (`judge`),
after every checkpoint (`checkpointed`) and at the end (`best_adapter`, `summary`); its state travels
in checkpoints (`state`), so a resumed run judges as the uninterrupted one would."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from jobs.spec import JobSpec

log = logging.getLogger("rayft")


class EarlyStopping:
    """`run.early_stopping`: after each evaluation, the metric either improves on the best so far
    by more than `min_delta` (lower for mode "min", higher for "max"; then the adapter of that step
    is kept, rank 0, as `<output_dir>/early-stopping/best-step-N.safetensors`) or counts as one bad
    evaluation; `patience` bad evaluations in a row stop the run, which ends with the best step's
    adapter as `adapter/` (summary.json `best_step`). The state travels in checkpoints; the kept
    adapter named by the newest checkpoint is never deleted, so a resumed run finds it. Inert
    without `run.early_stopping` (`enabled` False)."""

    DIR = "early-stopping"

    def __init__(
        self,
        patience: int = 0,
        min_delta: float = 0.0,
        state: dict | None = None,
        metric: str = "eval_loss",
        mode: str = "min",
    ):
        self.enabled, self.patience, self.min_delta = patience > 0, patience, min_delta
        self.metric, self.sign = metric, 1.0 if mode == "min" else -1.0
        state = state or {}
        self.best_value: float | None = state.get("best_value", state.get("best_loss"))
        self.best_step: int = state.get("best_step", 0)
        self.bad_evals: int = state.get("bad_evals", 0)
        self.stopped_at: int | None = state.get("stopped_at")
        self.kept_step = self.best_step  # the best adapter the newest checkpoint names

    @classmethod
    def of(cls, spec: JobSpec, state: dict | None) -> EarlyStopping:
        es, obj = spec.run.early_stopping, spec.objective
        if not es:
            return cls()
        metric = es.metric or obj.held_out_metric
        return cls(es.patience, es.min_delta, state, metric, obj.held_out_metrics[metric])

    def value_of(self, eval_loss: float | None, eval_stats: dict) -> float | None:
        """The judged metric from one held-out evaluation (the loss and its `eval_` statistics)."""
        return eval_loss if self.metric == "eval_loss" else eval_stats.get(self.metric)

    @property
    def stopped(self) -> bool:
        return self.stopped_at is not None

    def state(self) -> dict:
        return {
            "best_value": self.best_value,
            "best_step": self.best_step,
            "bad_evals": self.bad_evals,
            "stopped_at": self.stopped_at,
        }

    def best_file(self, out: Path, step: int) -> Path:
        return out / self.DIR / f"best-step-{step:08d}.safetensors"

    def judge(self, step: int, value: float | None, adapter: Callable[[], dict], out: Path, is_main: bool) -> None:
        """Every rank, after the evaluation of optimizer step `step` (`value`, the metric, is the same
        on all); `adapter()` gives the full adapter state on rank 0 (every rank calls it: under FSDP
        it gathers the shards)."""
        if not self.enabled or value is None or value != value:  # NaN: nothing was scored
            return
        if self._improves(value):
            self.best_value, self.best_step, self.bad_evals = value, step, 0
            state = adapter()
            if is_main:
                self._keep(state, out, step)
            return
        self.bad_evals += 1
        if self.bad_evals >= self.patience:
            self.stopped_at = step
            log.warning(
                "early stopping at step %d: %s has not improved by more than %g for %d "
                "evaluations; the adapter of step %d (%s %.4f) is the result",
                step,
                self.metric,
                self.min_delta,
                self.bad_evals,
                self.best_step,
                self.metric,
                self.best_value,
            )

    def _improves(self, value: float) -> bool:
        """Better than the best so far by more than `min_delta` (the first evaluation always is)."""
        best = self.best_value
        return best is None or self.sign * (best - value) > self.min_delta

    def _keep(self, adapter: dict, out: Path, step: int) -> None:
        from safetensors.torch import save_file

        path = self.best_file(out, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        from jobs.run import save_check

        tensors = {k: v.detach().cpu().contiguous() for k, v in adapter.items()}
        save_file(tensors, str(tmp))
        save_check.check_file(tmp, tensors)
        os.replace(tmp, path)
        self._prune(out)

    def checkpointed(self, out: Path | None) -> None:
        """A checkpoint naming `best_step` is on disk (rank 0 passes `out`)."""
        if self.enabled and out is not None:
            self.kept_step = self.best_step
            self._prune(out)

    def _prune(self, out: Path) -> None:
        keep = {self.best_file(out, self.best_step).name, self.best_file(out, self.kept_step).name}
        for f in (out / self.DIR).glob("best-step-*.safetensors"):
            if f.name not in keep:
                f.unlink(missing_ok=True)

    def best_adapter(self, out: Path) -> dict | None:
        """Rank 0, at the end: the best step's adapter state (what is saved as `adapter/`), or None.
        It was kept as `judge` got it, the run's full adapter state (`jobs.train.fsdp.full_adapter`), so
        it is keyed as the final adapter is."""
        if not self.enabled or not self.best_step:
            return None
        from safetensors.torch import load_file

        return load_file(str(self.best_file(out, self.best_step)))

    def summary(self) -> dict:
        """summary.json's keys: `best_step`, `best_<metric>` (`best_eval_loss`, `best_eval_reward`)
        and `stopped_early_at_step`."""
        if not self.enabled:
            return {}
        return {
            "best_step": self.best_step or None,
            f"best_{self.metric}": self.best_value,
            "stopped_early_at_step": self.stopped_at,
        }
